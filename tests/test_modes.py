"""Every attention mode against the plain reference (mla=0, fa=0, f32 cache).

Protocol (issue 3): a prompt fed in several ubatches, then greedy decode steps one token at a time
(teacher-forced with the reference's greedy continuation, so positions stay aligned). The prompt
path and each decode step's logits are compared with the reference's logits at the same positions.
f32 caches must agree to float rounding; f16/bf16/q8_0 caches within the bound their rounding
explains, judged on dense-routing models (no discrete expert choice to flip, see fixtures README).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import ikjax
from conftest import fixtures_dir, rel_err
from hf_models import make_model
from ikjax.gguf_io.writer import write_deepseek2_gguf

# Bound on rel. L2 logit error per cache type. Measured on v3dense-all-BF16 (96-token prompt, 8 decode
# steps, any mode): f32 ~3e-6, f16 7.3e-4, bf16 5.7e-3, q8_0 1.9e-2 (its weights alone in Q8_0 move
# these logits 4.5 %); a broken cache gives ~1.
TOLERANCE = {"f32": 1e-4, "f16": 3e-3, "bf16": 2e-2, "q8_0": 5e-2}
N_DECODE = 8
N_DECODE_LONG = 32


@pytest.fixture(scope="module")
def model_8_heads():
    return str(fixtures_dir() / "v3dense-all-BF16.gguf")


@pytest.fixture(scope="module")
def model_128_heads(tmp_path_factory):
    """A 128-head V3-style model with dense routing (every expert used), ik's layout, in BF16 so
    attn_kv_b and attn_k_b/attn_v_b hold the same values and every mode has one reference."""
    _, cfg, sd = make_model("v3h128", seed=3, n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)
    path = tmp_path_factory.mktemp("h128") / "h128-all-BF16.gguf"
    write_deepseek2_gguf(path, cfg, sd, layout="all", qtype="BF16")
    return str(path)


_REFERENCES: dict = {}


def reference(path: str, n_prompt: int, n_decode: int, ctx: int):
    """(sequence, logits [n_prompt + n_decode, V]) from mla=0, fa=0, f32: prompt + greedy continuation."""
    key = (path, n_prompt, n_decode)
    if key not in _REFERENCES:
        rng = np.random.default_rng(7)
        eng = ikjax.load(path, mla=0, fa=False, ctk="f32", ctx=ctx, ubatch=512)
        prompt = rng.integers(2, eng.config.vocab_size, n_prompt)
        cont = list(eng.generate(prompt, n_decode, stop=()))
        assert len(cont) == n_decode, "reference stopped early (EOS); pick another seed"
        seq = np.concatenate([prompt, cont]).astype(np.int32)
        _REFERENCES[key] = (seq, eng.logits(seq))
    return _REFERENCES[key]


def run_modes(path, *, mla, fa, ctk, amb=0, n_prompt, n_decode, ubatch, kv_block, ctx, **extra):
    """Prompt in ubatches then teacher-forced decode steps; returns logits at every position."""
    seq, _ = reference(path, n_prompt, n_decode, ctx)
    eng = ikjax.load(path, mla=mla, fa=fa, ctk=ctk, amb=amb, ctx=ctx, ubatch=ubatch, kv_block=kv_block, **extra)
    prompt_logits, cache = eng.prefill(eng.new_cache(1), seq[:n_prompt], 0, all_logits=True)
    out = [prompt_logits]
    for i in range(n_decode):
        pos = n_prompt + i
        logits, cache = eng.step(cache, seq[None, pos:pos + 1], np.array([pos]))
        out.append(np.asarray(logits, np.float32))
    return np.concatenate(out, 0)


def check(path, ctk, n_prompt, n_decode, ctx, **kw):
    _, ref = reference(path, n_prompt, n_decode, ctx)
    got = run_modes(path, ctk=ctk, n_prompt=n_prompt, n_decode=n_decode, ctx=ctx, **kw)
    err_prompt = rel_err(got[:n_prompt], ref[:n_prompt])
    err_decode = rel_err(got[n_prompt:], ref[n_prompt:])
    tol = TOLERANCE[ctk]
    assert err_prompt <= tol and err_decode <= tol, \
        f"{kw} ctk={ctk}: prompt err {err_prompt:.2e}, decode err {err_decode:.2e} (tol {tol:.0e})"
    return err_prompt, err_decode


# ---- default run: every mla x fa with f32, every cache type, amb, all on several ubatches ----------
SHORT = dict(n_prompt=96, n_decode=N_DECODE, ubatch=32, kv_block=64, ctx=160)


@pytest.mark.parametrize("mla,fa", list(itertools.product([0, 1, 2, 3], [False, True])))
def test_modes_f32_exact(model_8_heads, mla, fa):
    check(model_8_heads, "f32", mla=mla, fa=fa, **SHORT)


@pytest.mark.parametrize("ctk,mla,fa", [("f16", 0, True), ("bf16", 1, True), ("q8_0", 0, True),
                                         ("q8_0", 2, False), ("q8_0", 3, True)])
def test_cache_types(model_8_heads, ctk, mla, fa):
    check(model_8_heads, ctk, mla=mla, fa=fa, **SHORT)


@pytest.mark.parametrize("mla", [0, 1])
def test_amb_head_chunks(model_128_heads, mla):
    # -amb 1 (MiB): 128 heads x 32 tokens x 128 keys x 4 B = 2 MiB of scores -> two chunks of 64 heads
    check(model_128_heads, "f32", mla=mla, fa=False, amb=1, **SHORT)


def test_amb_chunking_is_exact():
    """attend_materialized in chunks of 1, 3 and all heads gives the same output."""
    import jax
    import jax.numpy as jnp
    from ikjax.ops.attn import attend_flash, attend_materialized
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    B, T, S, H = 2, 5, 37, 7
    q = jax.random.normal(k1, (B, T, H, 24))
    k = jax.random.normal(k2, (B, S, 1, 24))
    v = jax.random.normal(k3, (B, S, 1, 16))
    pos = jnp.array([[30, 31, 32, 33, 34], [0, 1, 2, 3, 4]])
    full = attend_materialized(q, k, v, pos, 0.3)
    per_head = B * T * S * 4
    for heads_per_chunk in (1, 3):
        chunked = attend_materialized(q, k, v, pos, 0.3, amb_bytes=heads_per_chunk * per_head)
        np.testing.assert_allclose(chunked, full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(attend_flash(q, k, v, pos, 0.3, kv_block=8), full, rtol=1e-5, atol=1e-5)


def test_flash_reads_only_the_blocks_a_query_sees(monkeypatch):
    """attend_flash's loop stops at the block of the last query position (a step compiled for a
    KV bucket pays for the context it has, RESULTS §25b): NaN rows of V in the blocks after it are
    never read (a scan over every block gave NaN there: 0 x NaN), and over the rows it reads it
    equals the materialized reference, for a batch whose sequences end in different blocks."""
    import jax
    import jax.numpy as jnp
    from ikjax.ops.attn import attend_flash, attend_materialized
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    B, T, S, H, blk = 2, 4, 96, 3, 16
    q = jax.random.normal(k1, (B, T, H, 24))
    k = jax.random.normal(k2, (B, S, H, 24))
    v = jax.random.normal(k3, (B, S, H, 16))
    pos = jnp.array([[40, 41, 42, 43], [5, 6, 7, 8]])  # last position 43: blocks 0-2 of 6
    v_nan = v.at[:, 48:].set(jnp.nan)
    out = jax.jit(attend_flash, static_argnames="kv_block")(q, k, v_nan, pos, 0.3, kv_block=blk)
    assert bool(jnp.isfinite(out).all())
    ref = attend_materialized(q, k[:, :48], v[:, :48], pos, 0.3)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # IKJAX_FLASH_LOOP=bucket: every block (a trip count XLA knows), the same bits where V is
    # finite, and the NaN rows past the last query's block read again (eager: the variable is read
    # at each call)
    monkeypatch.setenv("IKJAX_FLASH_LOOP", "bucket")
    whole = attend_flash(q, k, v, pos, 0.3, kv_block=blk)
    assert not bool(jnp.isfinite(attend_flash(q, k, v_nan, pos, 0.3, kv_block=blk)).all())
    monkeypatch.setenv("IKJAX_FLASH_LOOP", "context")
    np.testing.assert_array_equal(whole, attend_flash(q, k, v, pos, 0.3, kv_block=blk))
    # a query past every key (position >= S) still sees all S rows, and no more
    far = jnp.full((B, T), S + 7)
    np.testing.assert_allclose(attend_flash(q, k, v, far, 0.3, kv_block=40), attend_materialized(q, k, v, far, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_128_heads(model_128_heads):
    check(model_128_heads, "f32", mla=3, fa=True, **SHORT)
    check(model_128_heads, "q8_0", mla=3, fa=True, **SHORT)


# ---- slow: the full matrix on a >1000-token prompt, 8 and 128 heads ------------------------------
LONG = dict(n_prompt=1100, n_decode=N_DECODE_LONG, ubatch=256, kv_block=256, ctx=1200)
MATRIX = list(itertools.product([0, 1, 2, 3], [False, True], ["f32", "f16", "bf16", "q8_0"], [0, 1]))


@pytest.mark.slow
@pytest.mark.parametrize("mla,fa,ctk,amb", MATRIX)
@pytest.mark.parametrize("heads", [8, 128])
def test_full_matrix_long_prompt(request, heads, mla, fa, ctk, amb):
    import jax
    path = request.getfixturevalue("model_8_heads" if heads == 8 else "model_128_heads")
    check(path, ctk, mla=mla, fa=fa, amb=amb, **LONG)
    jax.clear_caches()  # 128 combinations of long-prompt steps would not fit in memory together
