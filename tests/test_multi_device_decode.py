"""The decode loop (several tokens per dispatch, the token picked on the device) under -sm graph
and -sm layer, on 2 fake CPU devices (tests/multi_device_worker.py in a subprocess, as
test_multi_device does): its tokens equal the one-device loop's, greedy and sampled, for n < chunk,
a batch of two sequences and banned ids, and `generate_batch`'s; -sm layer's prompt micro-batches
equal one device fed the same chunks; and the -sm graph loop's collectives per step are the
fewest the split allows (`ikjax.runtime.mesh.collectives`).

The 4- and 8-device meshes and pipelines run the same loop in test_multi_device's generate
checks (`generate` takes it wherever `Engine.decode_loop()`)."""
from __future__ import annotations

import numpy as np
import pytest

from ikjax.runtime.mesh import collectives
from test_multi_device import _of, _run_worker


@pytest.fixture(scope="module")
def rows(tiny4_model, tmp_path_factory) -> list[dict]:
    cases = {"decode": [dict(model=tiny4_model, mla=3, sm="graph", ts=""),
                        dict(model=tiny4_model, mla=3, sm="layer", ts="")],
             "micro": [dict(model=tiny4_model, mla=3, ts="", mb=2)]}
    return _run_worker(cases, 2, tmp_path_factory)


def _case(rows, sm: str) -> dict:
    return next(r for r in _of(rows, "decode") if r["case"]["sm"] == sm)


@pytest.mark.parametrize("sm", ["graph", "layer"])
def test_decode_loop_equals_one_device(rows, sm):
    r = _case(rows, sm)
    assert _of(rows, "devices") == [{"check": "devices", "n": 2}]
    assert r["loops"], "the split engine does not run the decode loop"
    one, many = r["one"], r["many"]
    assert len(one["greedy"]) == 20 and len(one["short"]) == 5 and len(one["sampled"]) == 12
    for what in ("greedy", "short", "sampled", "resampled", "batch_banned", "generate_batch"):
        assert many[what] == one[what], (what, many[what], one[what])
    # a draw's values are step arguments (a key per row) under both split modes, as on one device
    assert many["resampled_compiles"] == one["resampled_compiles"] == 0
    assert one["generate_batch"][0] == one["greedy"][:6]  # a row of the batch = the prompt alone
    # the bans bit: the first sequence's greedy picks are banned, so it takes other tokens
    assert not set(one["batch_banned"][0]) & set(one["ban"])
    assert one["batch_banned"][0] != one["greedy"][1:7]
    assert any(t >= 512 for t in one["ban"]) and any(t < 512 for t in one["ban"])  # both halves of the vocabulary


def test_layer_split_has_two_stages(rows):
    assert _case(rows, "layer")["stages"] == "device 0: embedding, layers 0-2; device 1: layers 3-3, output"


def test_graph_collectives_per_step(rows):
    """Two psums a layer (attention's heads, the FFN / experts) and, greedy, one all-gather of
    [B, 3 + d] that picks the token and carries its embedding: 2 L + 1 a step, the embedding's
    psum once a dispatch. Sampling gathers the logits and assembles the embedding with a psum:
    2 L + 2."""
    r = _case(rows, "graph")
    L = r["n_layer"]
    # a draw names its top_k bucket (a key per row: generation.sampling_key), greedy its ban at most
    got = {(c["batch"], "bucket" in c["sampling"]): c for c in r["collectives"]}
    assert set(got) == {(1, False), (1, True), (2, False)}, r["collectives"]
    for B in (1, 2):
        c = got[(B, False)]
        assert (c["per_step"], c["outside"]) == (2 * L + 1, 1), c
        assert c["kinds"] == {"all-reduce": 2 * L, "all-gather": 1}, c
        d = 256  # the tiny preset's width: the layers' psums of [B, d] and the gather of [2, B, 3 + d]
        assert c["bytes"] == B * 4 * (2 * L * d + 2 * (3 + d)), c
    c = got[(1, True)]
    assert (c["per_step"], c["outside"]) == (2 * L + 2, 0), c
    # what sweep-bench prints (Engine.collectives): every compiled step, the loops among them
    lines = r["engine_lines"]
    assert any(line.startswith("decode loop, batch 1, kv_len ") and
               f": {2 * L + 1} collectives a step (1 all-gather, {2 * L} all-reduce; " in line for line in lines), lines
    assert any(line.startswith("step of batch 1 x 16 tokens") and f": {2 * L + 2} collectives" in line
               for line in lines), lines
    assert _case(rows, "layer")["engine_lines"] == []


def test_layer_prompt_micro_batches(rows):
    """-sm layer with a prompt step of 16 tokens as 2 micro-batches in flight (IKJAX_PIPELINE_MB=2):
    the logits equal, bit for bit, one device fed the same 8-token chunks, for every token, for
    rows whose last token falls in either micro-batch (a step of batch 2)."""
    r = _of(rows, "micro")[0]
    assert r["micro"] == 2
    # the picked rows of a batch-2 step: bit for bit where XLA:CPU's code for the head's [2, d] rows
    # sums as the oracle's does (AVX2 hosts); an AVX-512 host's 1.8e-6 is that sum's order
    assert r["rel_logits"] == 0.0 and r["rel_last"] <= 1e-5, r


def test_micro_batch_rule(monkeypatch):
    """auto: on GPUs only, halving while each micro-batch keeps MICRO_MIN tokens, at most
    MICRO_MAX; never where one stage holds all the layers or the tokens do not divide."""
    from types import SimpleNamespace
    from ikjax.runtime import pipeline as pl
    p = pl.Pipeline.__new__(pl.Pipeline)
    p.stages = ((0, 0, 13, True, False), (1, 13, 14, False, True))
    p.devices = [SimpleNamespace(platform="gpu")] * 2
    p.stage_weights = [{"groups": [{"attn_q": np.zeros(3)}]}, {"groups": [{"ffn_up_exps": np.zeros(3)}]}]
    p.cfg = SimpleNamespace(n_expert=0, n_expert_used=0)  # dense: tokens alone decide
    monkeypatch.delenv("IKJAX_PIPELINE_MB", raising=False)
    assert [p.micro_batches(t) for t in (1, 64, 256, 512, 1024, 2048, 4096, 1000, 1001)] == [1, 1, 1, 2, 4, 4, 4, 2, 1]
    # routed experts: each micro-batch keeps MICRO_MIN_PICKS picks an expert (it reads them all)
    p.cfg = SimpleNamespace(n_expert=256, n_expert_used=8)  # R1: 2048 -> 2 of 1024 (32 picks), not 4
    assert [p.micro_batches(t) for t in (1024, 2048, 4096, 8192)] == [1, 2, 4, 4]
    p.cfg = SimpleNamespace(n_expert=64, n_expert_used=6)  # V2-Lite: 2048 -> 4 of 512 (48 picks)
    assert [p.micro_batches(t) for t in (512, 1024, 2048)] == [1, 2, 4]
    # a stage's experts in host RAM (-ot exps=CPU): whole prompt steps (each micro-batch would move
    # the experts over the link again, and one of 512 tokens would compute them on the host CPU)
    from ikjax.placement.host import HostQuantArray
    from ikjax.quant.types import by_name
    q4 = by_name("Q4_0")
    p.stage_weights[1]["groups"][0]["ffn_up_exps"] = HostQuantArray(np.zeros((4, 2, 18), np.uint8), q4, (4, 2, 32))
    assert p.host_experts and p.micro_batches(2048) == 1
    monkeypatch.setenv("IKJAX_PIPELINE_MB", "2")
    assert p.micro_batches(2048) == 2  # asked for by name: as asked
    monkeypatch.delenv("IKJAX_PIPELINE_MB")
    p.stage_weights[1]["groups"][0]["ffn_up_exps"] = np.zeros(3)
    assert not p.host_experts and p.micro_batches(2048) == 4
    p.devices = [SimpleNamespace(platform="cpu")] * 2
    assert p.micro_batches(2048) == 1
    monkeypatch.setenv("IKJAX_PIPELINE_MB", "4")
    assert (p.micro_batches(2048), p.micro_batches(6), p.micro_batches(1)) == (4, 1, 1)
    p.stages = ((0, 0, 27, True, False), (1, 27, 0, False, True))  # the head alone on device 1
    monkeypatch.setenv("IKJAX_PIPELINE_MB", "auto")
    p.devices = [SimpleNamespace(platform="gpu")] * 2
    assert p.micro_batches(2048) == 1


HLO = """HloModule m

%body.inner (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ar = f32[4,8]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %ag.s = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%x), channel_id=2, dimensions={0}
  %ag.d = f32[8,8]{1,0} all-gather-done(%ag.s)
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %ar)
}

%branch.a (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %ar2 = f32[4,8]{1,0} all-reduce(%p), channel_id=3, to_apply=%add
}

%branch.b (p: f32[4,8]) -> f32[4,8] {
  ROOT %p = f32[4,8]{1,0} parameter(0)
}

%body.outer (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %w = (s32[], f32[4,8]{1,0}) while(%p), condition=%cond, body=%body.inner, backend_config={"known_trip_count":{"n":"3"}}
  %c = f32[4,8]{1,0} conditional(%i, %x, %x), branch_computations={%branch.a, %branch.b}
  %ar3 = (f32[2]{0}, bf16[4]{0}) all-reduce(%y, %z), channel_id=4, to_apply=%add
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %c)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %ar0 = f32[4,8]{1,0} all-reduce(%a), channel_id=5, to_apply=%add
  %loop = (s32[], f32[4,8]{1,0}) while(%t0), condition=%cond.outer, body=%body.outer
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_collectives_counts_each_run():
    """Scan bodies count times their known trip count, a conditional its costliest branch, an
    async start once with its result bytes; the top loop of unknown trip count is the step."""
    c = collectives(HLO)
    # a step: 3 x (all-reduce + all-gather) + the conditional's all-reduce + the combined all-reduce
    assert c.per_step == 3 * 2 + 1 + 1
    assert c.kinds == {"all-reduce": 3 + 1 + 1, "all-gather": 3}
    assert c.per_step_bytes == 3 * (128 + 256) + 128 + (8 + 8)
    assert c.outside == 1
    assert "8 collectives a step" in c.line() and "1 once a dispatch" in c.line()
    plain = collectives(HLO.replace("%loop = (s32[], f32[4,8]{1,0}) while(%t0), condition=%cond.outer, "
                                    "body=%body.outer", "%loop = (s32[], f32[4,8]{1,0}) call(%t0), to_apply=%body.outer"))
    assert (plain.per_step, plain.outside) == (9, 0)  # one step: everything, once
