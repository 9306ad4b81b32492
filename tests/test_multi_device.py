"""Several devices without GPUs: 4 fake CPU devices (`--xla_force_host_platform_device_count=4`).

The flag must be in XLA_FLAGS before JAX starts, so every multi-device check runs in one
subprocess (tests/multi_device_worker.py) that compiles each configuration once and prints JSON;
the tests here read its results. Oracle: the same model on one device, at f32 — logits within
1e-5 (relative, as conftest.rel_err) for every MLA mode x -sm layer/graph x odd -ts; greedy
generation equal token for token. -sm layer runs the same kernels per stage as one device does,
so it must match bit for bit; -sm graph runs the same kernels on each device's part inside
shard_map, joined by psum (sums in another order), compared with the one-device run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ikjax
import ikjax.errors
from conftest import FIXTURES_MISSING, TEST_XLA_FLAGS

WORKER = Path(__file__).with_name("multi_device_worker.py")
TOL = 1e-5
# -sm graph splits contractions (attn_output and FFN down columns, experts) into per-device partial
# sums joined by psum: the same f32 sums in another order. These random-weight models amplify
# that: on one device the C++ kernels and the XLA path (sums in another order, nothing else) differ
# by 4e-5 (tiny 4-layer) to 1.1e-4 (v2lite_tiny kvb, mla 0). So a graph split is held to
# max(TOL, 2 x that one-device gap of the same model and mode), which the worker measures next to
# it; layer splits reorder nothing and match bit for bit.
# the floor of a graph split's tolerance: the psum of 4 partial f32 sums measured 1.55e-5 on the
# tiny model whose synthetic weights lean no way (issue 24's generator) while its one-device
# order gap fell below 5e-6, so 2 x the gap alone undercut plain f32 reordering
GRAPH_TOL_FLOOR = 3e-5


def graph_tol(row) -> float:
    return max(GRAPH_TOL_FLOOR, 2 * row["order_gap"])


def _fixtures() -> Path | None:
    env = os.environ.get("IKJAX_FIXTURES")
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "fixtures"
    return d if (d / "MANIFEST.json").exists() else None


@pytest.fixture(scope="module")
def model4(tiny4_model):
    return tiny4_model


def _cases(model4: str) -> dict:
    fx = _fixtures()
    # -sm graph splits each mode's tensors its own way: every mode on the tiny model. -sm layer runs
    # one device's kernels per stage, the mode changing only the kernels and the cache (mla 0 per
    # head, 1-3 the latent): mla 0 and 3 here, mla 1 and 2 on ik's file below where it is present
    layer_modes = (0, 3) if fx is not None else (0, 1, 2, 3)
    cases = [dict(model=model4, mla=mla, sm="graph", ts="") for mla in (0, 1, 2, 3)]
    cases += [dict(model=model4, mla=mla, sm="layer", ts="1,3") for mla in layer_modes]
    if fx is not None:
        a = str(fx / "v3tiny-all-Q4_0.gguf")  # MoE, every MLA tensor form, 3 layers
        b = str(fx / "v2lite_tiny-kvb-Q5_1.gguf")  # attn_kv_b only: k_b/v_b derived in the graph
        # every MLA mode once on ik's file and each split kind in two modes: the tiny model above
        # runs every mode under both splits; here the converter's tensors (attn_kv_b beside
        # attn_k_b/attn_v_b) take mla 0 (attn_kv_b) and mla 3 (k_b/v_b) under the graph split, whose
        # head split differs between the two, and mla 1 and 2 through an odd layer split
        cases += [dict(model=a, mla=1, sm="layer", ts="1,1,2"), dict(model=a, mla=2, sm="layer", ts="1,1,2"),
                  dict(model=a, mla=0, sm="graph", ts="1,1,1"), dict(model=a, mla=3, sm="graph", ts="1,1,1")]
        cases += [dict(model=b, mla=3, sm="layer", ts="5,2,1"), dict(model=b, mla=0, sm="graph", ts="")]
    return {"cases": cases,
            "generate": [dict(model=model4, mla=3, sm="layer", ts="1,3"), dict(model=model4, mla=1, sm="graph", ts="")],
            "refusals": {"model": model4}}


def _run_worker(cases: dict, n_devices: int, tmp_path_factory) -> list[dict]:
    spec = tmp_path_factory.mktemp("md") / "spec.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, IKJAX_DTYPE="f32",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices} {TEST_XLA_FLAGS}")
    env.pop("IKJAX_KERNELS", None)
    run = subprocess.run([sys.executable, str(WORKER), str(spec)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=str(WORKER.parent))
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def results(model4, tmp_path_factory) -> list[dict]:
    return _run_worker(_cases(model4), 4, tmp_path_factory)


def test_eight_fake_devices(model4, tmp_path_factory):
    """8 devices: the tiny model's 8 heads one per device, its 16 experts two per device, its
    1024-row vocabulary in 8 parts; and a layer split with 4 devices left without layers."""
    cases = {"cases": [dict(model=model4, mla=3, sm="graph", ts=""), dict(model=model4, mla=0, sm="graph", ts=""),
                       dict(model=model4, mla=2, sm="layer", ts="1,1,1,1,1,1,1,1")],
             "generate": [dict(model=model4, mla=3, sm="graph", ts="")]}
    rows = _run_worker(cases, 8, tmp_path_factory)
    assert _of(rows, "devices") == [{"check": "devices", "n": 8}]
    logits = _of(rows, "logits")
    assert len(logits) == 3
    for r in logits:
        assert r["rel"] <= (graph_tol(r) if r["case"]["sm"] == "graph" else 0.0), r
        assert set(r["per_device"]) == {f"CPU{i}" for i in range(8)}
    graph = logits[0]["per_device"]
    assert len(set(graph.values())) == 1 and graph["CPU0"] < logits[0]["weights"] / 4
    gen = _of(rows, "generate")[0]
    assert len(gen["one"]) == 8 and gen["many"] == gen["one"]


def _of(results, check):
    return [r for r in results if r["check"] == check]


def test_four_fake_devices(results):
    assert _of(results, "devices") == [{"check": "devices", "n": 4}]


def test_logits_equal_one_device(results):
    rows = _of(results, "logits")
    assert len(rows) >= 8
    bad = [(r["case"], r["rel"]) for r in rows if not r["rel"] <= (graph_tol(r) if r["case"]["sm"] == "graph" else TOL)]
    assert not bad, bad
    for r in rows:
        if r["case"]["sm"] == "layer":  # the same kernels, stage by stage: bit for bit
            assert r["rel"] == 0.0, r


def test_layer_split_follows_the_shares(results):
    """llama.cpp's rule on 4 layers with -ts 1,3 (cumulative 0.25, 1; layer i at fraction i/5, the
    head at 4/5): layers 0-1 (0, 0.2 < 0.25) on device 0, layers 2-3 and the head on device 1;
    devices 2, 3 hold nothing."""
    r = next(r for r in _of(results, "logits") if r["case"]["sm"] == "layer" and r["case"]["ts"] == "1,3")
    assert r["stages"] == "device 0: embedding, layers 0-1; device 1: layers 2-3, output"
    per = r["per_device"]
    assert set(per) == {"CPU0", "CPU1", "CPU2", "CPU3"}
    assert per["CPU2"] == per["CPU3"] == 0 and per["CPU1"] > per["CPU0"] > 0
    assert sum(per.values()) == r["weights"] - r["host"]
    assert any(line.strip().startswith("on CPU1") and "KV cache" in line for line in r["lines"])


def test_graph_split_spreads_every_tensor(results):
    """-sm graph: every device holds a part of each split tensor: about a quarter of the weights
    each (the norms, the router and the latent projections are whole copies)."""
    for r in _of(results, "logits"):
        if r["case"]["sm"] != "graph" or r["case"]["ts"]:
            continue
        per = r["per_device"]
        assert len(set(per.values())) == 1, per
        assert r["weights"] / 4 <= per["CPU0"] < r["weights"] / 2, (per, r["weights"])


def test_three_device_mesh_leaves_the_zero_share_out(results):
    rows = [r for r in _of(results, "logits") if r["case"]["ts"] == "1,1,1"]
    if not rows:
        pytest.skip(FIXTURES_MISSING.format(d="../shared/fixtures"))
    for r in rows:
        assert r["per_device"]["CPU3"] == 0 and r["per_device"]["CPU0"] > 0


def test_generate_equal_token_for_token(results):
    rows = _of(results, "generate")
    assert len(rows) == 2
    for r in rows:
        assert len(r["one"]) == 8 and r["many"] == r["one"], r


def test_refusals(results):
    got = {r["what"]: r for r in _of(results, "refuse")}
    assert got["graph uneven ts"]["error"] == "OptionError" and "-sm layer" in got["graph uneven ts"]["message"]
    assert got["ts longer than devices"]["error"] == "OptionError" and "for 4 devices" in got["ts longer than devices"]["message"]
    assert got["ot device with sm layer"]["error"] == "OptionError" and "only =CPU" in got["ot device with sm layer"]["message"]
    assert got["mg past the devices"]["error"] == "OptionError" and "CPU0, CPU1, CPU2, CPU3" in got["mg past the devices"]["message"]
    over = got["device over its memory"]
    assert over["error"] == "DoesNotFitError" and "on CPU1" in over["message"] and "\n" not in over["message"]
    assert got["device without layers fits"]["error"] is None


def test_host_experts_and_main_device(results):
    for check in ("host experts with sm layer", "host experts with sm graph"):
        r = _of(results, check)[0]
        assert r["host"] > 0 and r["rel"] <= (2e-4 if "graph" in check else TOL), r
    r = _of(results, "host experts with sm layer")[0]
    assert r["rel"] == 0.0
    mg = _of(results, "mg")[0]
    assert mg["rel"] == 0.0 and "id=2" in mg["device"], mg


def test_one_device_keeps_the_note(tiny_model):
    """In this process (one device) -sm/-ts are accepted and change nothing, with a note."""
    from ikjax.options import RunOptions, switch_notes
    notes = switch_notes({"split_mode": "layer", "ts": "3,1"}, "generate")
    assert any(n.startswith("-sm layer has no effect with one device") for n in notes)
    assert any(n.startswith("-ts 3,1 has no effect with one device") for n in notes)
    eng = ikjax.load(tiny_model, ctx=64, ubatch=16, sm="graph", ts="3,1")
    assert eng.split_mode == "none" and any("-sm graph has no effect" in n for n in eng.placement.notes)
    assert RunOptions.from_kwargs(sm="LAYER", ts=[3, 1], mg=0).split_mode == "layer"
    with pytest.raises(ikjax.errors.OptionError, match=r"^-sm: expected none, layer or graph"):
        RunOptions.from_kwargs(sm="row")
    with pytest.raises(ikjax.errors.OptionError, match=r"^-ts: expected non-negative shares"):
        RunOptions.from_kwargs(ts="0,0")


def test_graph_split_notes_what_runs_whole_and_ignored_options(tiny_model):
    """-sm graph over a device count the model's heads, experts and vocabulary do not divide runs
    those groups whole on every device: a note says which (it was silent: 3x the memory and no
    split); -mg under -sm graph, a device left out by a 0 share (either split mode), and -ts without
    a split mode are noted too. Over 2 devices (all divide) nothing is noted."""
    from types import SimpleNamespace
    from ikjax.options import RunOptions
    from ikjax.placement.rules import plan_placement
    eng = ikjax.load(tiny_model, ctx=64)
    devs = [SimpleNamespace(platform="cpu", id=i) for i in range(4)]  # as 4 fake CPU devices
    tensors = eng.file.tensors.values()

    def notes(n, **kw):
        return plan_placement(eng.config, tensors, RunOptions.from_kwargs(**kw), devices=devs[:n]).notes

    assert notes(2, sm="graph") == ()
    three = notes(3, sm="graph")
    assert len(three) == 1 and "do not divide into 3 whole parts" in three[0] and "attention heads" in three[0], three
    assert any("-mg 1 has no effect with -sm graph" in n for n in notes(2, sm="graph", mg=1))
    assert any("over 2 of 3 devices: -ts leaves out CPU1" in n for n in notes(3, sm="graph", ts="1,0,1"))
    assert any("-sm layer over 1 of 2 devices: -ts leaves out CPU0" in n for n in notes(2, sm="layer", ts="0,1"))
    assert not any("leaves out" in n for n in notes(2, sm="layer", ts="1,1") + notes(2, sm="layer"))
    assert any("-ts has no effect with -sm none" in n for n in notes(2, ts="3,1"))
