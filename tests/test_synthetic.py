"""make-model: real shapes, valid GGUF (the gguf package reads it), loads in ikjax, finite logits."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

import ikjax
from ikjax.tools import synthetic
from ikjax.gguf_io.config import ModelConfig
from ikjax.model.groups import layer_tensors


def _cfg(preset, qtype="Q4_0", **kw):
    cfg = synthetic.preset_config(preset, **kw)
    return cfg, synthetic.plan_tensors(cfg, qtype)


def test_v2_lite_shapes_and_size():
    cfg, plans = _cfg("v2-lite")
    names = {t.name: t for t in plans}
    assert cfg["num_hidden_layers"] == 27 and cfg["hidden_size"] == 2048
    assert names["blk.0.attn_q.weight"].shape == (16 * 192, 2048)  # no q_lora
    assert names["blk.0.attn_kv_a_mqa.weight"].shape == (576, 2048)
    assert names["blk.0.ffn_gate.weight"].shape == (10944, 2048)  # 1 leading dense layer
    assert names["blk.1.ffn_gate_exps.weight"].shape == (64, 1408, 2048)
    assert names["blk.1.ffn_up_shexp.weight"].shape == (2 * 1408, 2048)
    assert names["token_embd.weight"].shape == (102400, 2048)
    assert "blk.1.exp_probs_b.bias" not in names  # softmax gating
    total = sum(t.nbytes for t in plans)
    assert 8.0e9 < total < 9.5e9  # ~8.8 GB in Q4_0 (incl. kv_b + k_b + v_b)


def test_v3_r1_shapes():
    cfg, plans = _cfg("r1", "Q4_K")
    names = {t.name: t for t in plans}
    assert len([n for n in names if n.endswith("attn_norm.weight")]) == 61
    assert names["blk.0.attn_q_a.weight"].shape == (1536, 7168)
    assert names["blk.0.attn_q_b.weight"].shape == (128 * 192, 1536)
    assert names["blk.2.ffn_gate.weight"].shape == (18432, 7168)
    assert names["blk.3.ffn_gate_exps.weight"].shape == (256, 2048, 7168)
    assert names["blk.3.exp_probs_b.bias"].shape == (256,)
    assert names["blk.3.ffn_gate_inp.weight"].qtype == gguf.GGMLQuantizationType.F32
    # 128-wide rows cannot hold 256-blocks: ik's rule, Q8_0
    assert names["blk.0.attn_k_b.weight"].qtype == gguf.GGMLQuantizationType.Q8_0
    assert names["blk.3.ffn_down_exps.weight"].qtype == gguf.GGMLQuantizationType.Q4_K
    n_params = sum(math.prod(t.shape) for t in plans)
    assert 6.6e11 < n_params < 7.0e11  # 671B + the k_b/v_b copies


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "IQ4_XS", "Q5_1"])
def test_block_pool_statistics(qtype):
    qt = gguf.GGMLQuantizationType[qtype]
    pool = synthetic.block_pool(qt, 0.02, np.random.default_rng(0), 512)
    x = gguf.quants.dequantize(pool, qt)
    assert np.isfinite(x).all()
    assert abs(float(x.mean())) < 0.004
    assert float(x.std()) == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("preset,qtype", [("tiny", "Q4_0"), ("tiny", "Q4_K"), ("tiny", "BF16")])
def test_make_model_loads_with_finite_logits(tmp_path, preset, qtype):
    p = synthetic.make_model(tmp_path / f"{preset}-{qtype}.gguf", preset, qtype, layers=2)
    r = gguf.GGUFReader(str(p))  # other GGUF tools accept it
    assert r.fields["general.architecture"].contents() == "deepseek2"
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 1024
    assert len(r.fields["tokenizer.ggml.merges"].contents()) > 0
    eng = ikjax.load(p, ctx=64, ubatch=16, mla=3)
    logits = eng.logits([0, 5, 17, 300, 1000])
    assert logits.shape == (5, 1024)
    assert np.isfinite(logits).all()
    assert 0.05 < float(logits.std()) < 50  # activations stayed in range


def test_v3_metadata():
    """V3/R1 routing keys as ModelConfig reads them (a V3-shape file is GBs even cut down: header only)."""
    cfg, plans = _cfg("v3", "Q8_0", layers=4, experts=16)
    assert cfg["n_routed_experts"] == 16 and cfg["first_k_dense_replace"] == 3
    from ikjax.gguf_io import writer as gw
    kv = {k: v for k, v, _ in gw.deepseek2_metadata(cfg, layout="all") + gw._trailing_metadata(cfg, "all")}
    kv["general.architecture"] = "deepseek2"
    mc = ModelConfig.from_metadata(kv)
    assert (mc.n_expert_group, mc.n_expert_group_used, mc.gating) == (8, 4, 2)
    assert mc.yarn.factor == 40 and mc.yarn.original_context == 4096
    assert mc.yarn.log_multiplier == pytest.approx(0.1)
    assert mc.expert_weights_norm and mc.expert_weights_scale == 2.5


def test_bad_requests():
    with pytest.raises(ikjax.OptionError, match="preset"):
        synthetic.preset_config("huge")
    with pytest.raises(ikjax.OptionError, match="experts"):
        synthetic.preset_config("v3", experts=12)  # not a multiple of 8 groups
    # 8 experts in R1's 8 groups: the router's 4 groups would hold 4, fewer than the 8 it picks
    # (make-model wrote such a file and the loader refused it); every count make-model accepts
    # makes a config the loader takes
    with pytest.raises(ikjax.OptionError, match="from 16 "):
        synthetic.preset_config("r1", experts=8)
    for kw in ({"layers": 1025}, {"layers": 0}, {"experts": 4104}):  # past any model: refused before planning
        with pytest.raises(ikjax.OptionError, match="layers: need 1 to 1024|to 4096"):
            synthetic.preset_config("tiny", **kw)
    from ikjax.gguf_io.config import ModelConfig
    from ikjax.gguf_io.writer import _trailing_metadata, deepseek2_metadata

    def config(hf):
        meta = {k: v for k, v, _ in deepseek2_metadata(hf) + _trailing_metadata(hf, "all")}
        return ModelConfig.from_metadata({"general.architecture": "deepseek2", **meta}, source="make-model")
    for preset, n in (("r1", 16), ("v3", 16), ("kimi-k2", 8), ("tiny", 4)):
        assert config(synthetic.preset_config(preset, layers=2, experts=n)).n_expert == n
    with pytest.raises(ikjax.errors.ModelFileError, match="groups"):  # what such a file met at load
        config(dict(synthetic.preset_config("r1", layers=2), n_routed_experts=8))
    with pytest.raises(ikjax.OptionError, match="type"):
        synthetic.make_model("/tmp/never.gguf", "tiny", "Q9_9")


def test_q_lora_rank_override(tmp_path):
    """`make-model --q-lora-rank N` (the shape ik accepts for a shortened V2-Lite): attn_q_a /
    attn_q_a_norm / attn_q_b of width N instead of attn_q, the metadata key, and it loads and runs."""
    cfg, plans = _cfg("v2-lite", "Q8_0", layers=4, q_lora_rank=1536)
    names = {t.name: t for t in plans}
    assert "blk.0.attn_q.weight" not in names
    assert names["blk.0.attn_q_a.weight"].shape == (1536, 2048)
    assert names["blk.0.attn_q_a_norm.weight"].shape == (1536,)
    assert names["blk.3.attn_q_b.weight"].shape == (16 * 192, 1536)
    _, direct = _cfg("r1", "Q4_0", layers=4, q_lora_rank=0)  # 0: the direct attn_q of V2-Lite
    assert any(t.name == "blk.0.attn_q.weight" for t in direct) and not any("attn_q_a" in t.name for t in direct)
    for bad in (-1, 1.5, True):
        with pytest.raises(ikjax.OptionError, match="q-lora-rank"):
            synthetic.preset_config("tiny", q_lora_rank=bad)

    p = synthetic.make_model(tmp_path / "ql.gguf", "tiny", "Q8_0", layers=2, q_lora_rank=96)
    r = gguf.GGUFReader(str(p))
    assert r.fields["deepseek2.attention.q_lora_rank"].contents() == 96
    assert "q_lora 96" in r.fields["general.name"].contents()
    eng = ikjax.load(p, ctx=64, ubatch=16)
    assert eng.config.q_lora_rank == 96
    assert layer_tensors(eng.weights, 0)["q_b"].shape == (8 * 96, 96)
    logits = eng.logits([0, 5, 17, 300])
    assert np.isfinite(logits).all() and 0.05 < float(logits.std()) < 50


def test_q_lora_rank_cli_and_json_config(tmp_path):
    from typer.testing import CliRunner

    from ikjax.cli import app
    out = tmp_path / "cli.gguf"
    res = CliRunner().invoke(app, ["make-model", "--preset", "tiny", "--layers", "1", "--q-lora-rank", "64",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert gguf.GGUFReader(str(out)).fields["deepseek2.attention.q_lora_rank"].contents() == 64
    cfg = tmp_path / "mm.json"
    out2 = tmp_path / "json.gguf"
    cfg.write_text(f'{{"command": "make-model", "preset": "tiny", "layers": 1, "q_lora_rank": 32, "output": "{out2}"}}')
    res = CliRunner().invoke(app, ["run", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert gguf.GGUFReader(str(out2)).fields["deepseek2.attention.q_lora_rank"].contents() == 32


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "Q6_K", "Q4_K"])
def test_block_pools_lean_no_way(name):
    """A pool's blocks average zero over the pool whatever the type (Q4_0's d * (q - 8) leans to
    -d/2 in every block: without mixed signs every synthetic matrix added one vector to every token)."""
    if name not in synthetic.SUPPORTED_TYPES:
        pytest.skip(f"{name} is not a make-model type")
    qt = gguf.GGMLQuantizationType[name]
    pool = synthetic.block_pool(qt, 0.02, np.random.default_rng(1))
    vals = gguf.quants.dequantize(pool, qt).astype(np.float64)
    assert abs(vals.mean()) < 0.02 * 0.02 * 4, (name, vals.mean())  # well under 1/sqrt(n) of the spread
    assert 0.015 < vals.std() < 0.025


@pytest.mark.parametrize("name,sub", [("Q4_K", 32), ("Q5_K", 32), ("Q2_K", 16), ("Q4_0", 32), ("Q6_K", 16)])
def test_sub_blocks_are_centred(name, sub):
    """Each sub-block's values average ~0 beside the spread inside it, as a quantizer's output
    does: random bytes gave every Q4_K sub-block its own random min (58 % of the variance in a
    pattern shared through the pool) and the residual stream jumped 8.5x at layer 0 (an outside
    probe's numpy forward, stop 69)."""
    qt = gguf.GGMLQuantizationType[name]
    pool = synthetic.block_pool(qt, 0.02, np.random.default_rng(2))
    v = gguf.quants.dequantize(pool, qt).astype(np.float64).reshape(len(pool), -1, sub)
    share = float((v.mean(-1) ** 2).mean() / (v ** 2).mean())
    # a sub-block of n random values has a mean of spread 1/sqrt(n): a share of 1/n; Q4_0's
    # d * (q - 8), uncentred by design, adds ~0.01
    assert share < 1 / sub + 0.03, (name, share)


def _routing(path, n_tokens=512):
    """Tokens routed to each expert of each MoE layer on a batch of random tokens."""
    import jax
    import ikjax.model.moe as moe
    counts, order = {}, [0]
    orig = moe.route

    def route(x, layer, cfg, ser):
        w, ids = orig(x, layer, cfg, ser)
        li = order[0]
        order[0] += 1
        jax.debug.callback(lambda ids, li=li: counts.setdefault(li, []).append(np.asarray(ids)), ids)
        return w, ids
    moe.route = route
    try:
        eng = ikjax.load(path, ctx=n_tokens, ubatch=n_tokens, dtype="f32")
        eng.logits(np.random.default_rng(0).integers(2, eng.config.vocab_size, n_tokens))
    finally:
        moe.route = orig
    E = eng.config.n_expert
    return [np.bincount(np.concatenate(counts[li]).reshape(-1), minlength=E) for li in sorted(counts)]


def test_synthetic_routers_spread_tokens_at_depth(tmp_path, monkeypatch):
    """R1's routing (sigmoid, 8 groups, 4 of them, 8 of 256 experts) on R1's own layout at a small
    width, 24 layers of Q4_0: every MoE layer uses >= 90 % of its experts for 512 random tokens and
    none takes more than 4x the mean (before: the hidden states of all tokens became one and a
    batch went to 8 experts)."""
    monkeypatch.setenv("IKJAX_LAYERS", "unroll")  # each MoE layer traced on its own: one count each
    small = dict(synthetic.PRESETS["r1"], num_hidden_layers=24, hidden_size=256, num_attention_heads=4,
                 num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                 v_head_dim=32, moe_intermediate_size=32, intermediate_size=512, vocab_size=2048, rope_scaling=None)
    monkeypatch.setitem(synthetic.PRESETS, "r1-small-test", small)
    monkeypatch.setitem(synthetic.PRESET_NAMES, "r1-small-test", "r1-small-test")
    path = tmp_path / "r1s.gguf"
    synthetic.make_model(path, "r1-small-test", "Q4_0")
    counts = _routing(str(path))
    assert len(counts) == 24 - 3
    for li, c in enumerate(counts):
        used = np.count_nonzero(c) / len(c)
        assert used >= 0.9 and c.max() <= 4 * c.mean(), (li, used, c.max() / c.mean())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_attn_k_b_v_b_derived_from_kv_b(tmp_path, qtype):
    """make-model writes attn_k_b / attn_v_b from attn_kv_b's values, as ik's converter does: so the
    -mla 3 decode (absorbed: k_b, v_b) and the prompt steps (kv_b) compute one model. Checked on the
    tensors (k_b / v_b equal kv_b's per-head blocks within their quantization) and end to end: in
    f32, each greedy decode token is the argmax of a fresh prompt step over the tokens before it,
    with -mla 3 as with -mla 0 (no absorbed weights at all). With random k_b / v_b of their own
    the two paths disagreed from the second token on (found by an outside probe of the server's
    prompt cache)."""
    from ikjax.gguf_io.reader import GGUFModelFile
    p = synthetic.make_model(tmp_path / "t.gguf", "tiny", qtype, layers=2)
    f = GGUFModelFile(p)
    cfg = synthetic.preset_config("tiny", 2)
    H, nope, v, r = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"])
    r_ = gguf.GGUFReader(str(p))
    t = {x.name: x for x in r_.tensors}

    def values(name):
        x = t[name]
        return np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), np.float32)

    kvb = values("blk.1.attn_kv_b.weight").reshape(H, nope + v, r)
    k_b = values("blk.1.attn_k_b.weight").reshape(H, r, nope)
    v_b = values("blk.1.attn_v_b.weight").reshape(H, v, r)
    for got, want in ((k_b, kvb[:, :nope].transpose(0, 2, 1)), (v_b, kvb[:, nope:])):
        err = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
        assert err < (0.15 if qtype == "Q4_0" else 0.01), err  # the k_b / v_b type's rounding of kv_b's values
        assert abs(np.corrcoef(got.ravel(), want.ravel())[0, 1]) > (0.98 if qtype == "Q4_0" else 0.9999)
    assert f.tensors["blk.1.attn_k_b.weight"].qtype.name == ("Q4_0" if qtype == "Q4_0" else "Q8_0")
    prompt = [0, 5, 17, 300, 88, 1000, 41]
    for mla in (0, 3):
        eng = ikjax.load(p, ctx=64, ubatch=16, mla=mla, dtype="f32")
        got = list(eng.generate(prompt, 6))
        for i, tok in enumerate(got):
            logits = eng.logits(prompt + got[:i])[-1]
            top2 = np.sort(logits)[-2:]
            if top2[1] - top2[0] > 1e-3:  # a clear argmax: decode must pick it
                assert tok == int(np.argmax(logits)), (mla, i, tok, int(np.argmax(logits)))
