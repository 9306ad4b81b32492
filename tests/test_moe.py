"""Routed experts: -fmoe (fused gate+up) and -ser (smart expert reduction), both expert-FFN forms."""
from __future__ import annotations

import numpy as np
import pytest

import ikjax
from conftest import fixture_entry, fixtures_dir, load_ref, rel_err
from hf_models import hf_logits, make_model
from ikjax.gguf_io.writer import write_deepseek2_gguf
from ikjax.model.moe import smart_expert_reduction
from ikjax.options import SmartExpertReduction


def test_ser_rule_on_known_weights():
    w = np.array([[0.1, 0.5, 0.3, 0.05], [0.4, 0.39, 0.01, 0.2]], np.float32)
    # Kmin 1, t 0.5: keep the max, then others only where w > 0.5 * max
    got = np.asarray(smart_expert_reduction(w, SmartExpertReduction(1, 0.5)))
    np.testing.assert_array_equal(got, w * [[0, 1, 1, 0], [1, 1, 0, 0]])  # 0.2 is not > 0.5 * 0.4
    # t = 1: exactly Kmin experts
    got = np.asarray(smart_expert_reduction(w, SmartExpertReduction(2, 1.0)))
    assert ((got > 0).sum(-1) == 2).all()
    np.testing.assert_array_equal(got[0], w[0] * [0, 1, 1, 0])
    # t = 0: every expert
    np.testing.assert_array_equal(np.asarray(smart_expert_reduction(w, SmartExpertReduction(1, 0.0))), w)


@pytest.fixture(scope="module")
def v2lite_k3(tmp_path_factory):
    """V2-Lite-style (softmax, no weight norm, 3 of 8 experts) HF model and its F32 GGUF."""
    model, cfg, sd = make_model("v2lite", seed=5)
    path = tmp_path_factory.mktemp("ser") / "v2lite-F32.gguf"
    write_deepseek2_gguf(path, cfg, sd, layout="all", qtype="F32")
    return cfg, sd, str(path)


@pytest.mark.parametrize("n_tokens", [40, 400])
def test_ser_t1_equals_model_with_fewer_experts(v2lite_k3, n_tokens):
    """-ser Kmin,1 keeps exactly the top Kmin experts with their unnormalized weights: with softmax
    gating and no norm that is transformers' model with num_experts_per_tok = Kmin. 400 tokens:
    upstream's SER broke past 300."""
    cfg, sd, path = v2lite_k3
    hf_fewer, _, _ = make_model("v2lite", seed=5, num_experts_per_tok=2)
    from hf_models import set_weights
    set_weights(hf_fewer, sd)
    tokens = np.random.default_rng(2).integers(2, 500, n_tokens)
    want = hf_logits(hf_fewer, tokens)
    for mla, fa in [(0, False), (3, True)]:
        eng = ikjax.load(path, mla=mla, fa=fa, ctk="f32", ser="2,1", ubatch=128, ctx=512)
        assert rel_err(eng.logits(tokens), want) < 1e-4
    full = ikjax.load(path, mla=0, ctk="f32", ctx=512).logits(tokens)
    assert rel_err(full, want) > 1e-2  # the reduction really changed the computation


def test_ser_keeping_all_experts_changes_nothing():
    e = fixture_entry("v3tiny-all-Q4_0.gguf")
    tokens, ref = load_ref(e)
    eng = ikjax.load(fixtures_dir() / e["file"], mla=0, ctk="f32", ser="4,0")
    assert rel_err(eng.logits(tokens), ref) <= e["tol"]


@pytest.mark.parametrize("mla,name", [(0, "v3tiny-all-Q4_K_M.gguf"), (3, "v3dense-all-BF16.gguf")])
def test_fmoe_matches_reference_in_prompt_and_decode(mla, name):
    """Prompt steps take the grouped (sorted, ragged_dot) form, decode steps the gather form.
    mla 3 mixes attn_kv_b (prompt) and attn_k_b/attn_v_b (decode): judged on the BF16 file, where
    both hold the same values, so one reference covers both."""
    e = fixture_entry(name)
    tokens, ref = load_ref(e)
    eng = ikjax.load(fixtures_dir() / e["file"], mla=mla, ctk="f32", fmoe=True, ubatch=64)
    assert rel_err(eng.logits(tokens), ref) <= e["tol"]
    # decode token by token through the gather form: last 8 positions
    logits, cache = eng.prefill(eng.new_cache(1), tokens[:88], 0)
    got = []
    for pos in range(88, 96):
        out, cache = eng.step(cache, tokens[None, pos:pos + 1], np.array([pos]))
        got.append(np.asarray(out)[0])
    ref_dec = ref[88:96]
    assert rel_err(np.stack(got), ref_dec) <= e["tol"]


def test_router_top_k_by_rank_equals_lax_top_k():
    """The decode router's top-k by rank (fusible loops) picks what lax.top_k picks: ties to the
    lower index, -inf entries (experts of dropped groups) last, any leading shape."""
    import jax
    import jax.numpy as jnp
    from ikjax.model.moe import top_k
    rng = np.random.default_rng(0)
    for shape, k in [((1, 64), 6), ((3, 256), 8), ((5, 8), 2), ((2, 4, 16), 3), ((1, 8), 8)]:
        x = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        x = x.at[..., 3].set(x[..., 5]).at[..., 0].set(-jnp.inf)  # a tie and a dropped expert
        v, i = jax.jit(top_k, static_argnums=1)(x, k)  # as the step runs it: one compile a shape
        v2, i2 = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(np.asarray(i), np.asarray(i2))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(v2))
