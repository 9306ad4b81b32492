"""ikjax.ops: backend selection and fallbacks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from pallas_kernels.quant_matmul import PackedWeight
from pallas_kernels.testing import random_quant_array


def test_resolve_backend(monkeypatch):
    monkeypatch.delenv("IKJAX_KERNELS", raising=False)
    # auto: the C++ kernels on a CPU (a pip install always builds them), Pallas on a GPU
    assert ops.resolve_backend() == ("pallas" if jax.default_backend() == "gpu" else "cpu")
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    assert ops.resolve_backend() == "interpret"
    assert ops.resolve_backend("jnp") == "xla"  # the old name of the reference path
    assert ops.resolve_backend("xla") == "xla"
    with ops.kernel_context("cpu", threads=1):
        assert ops.resolve_backend() == "cpu"
    assert ops.resolve_backend() == "interpret"
    with pytest.raises(ValueError):
        ops.resolve_backend("cuda")


def test_dispatch_paths_agree():
    rng = np.random.default_rng(0)
    qa = random_quant_array("Q8_0", (32, 256), rng)
    pw = ops.prepare_weight(qa)
    assert isinstance(pw, PackedWeight)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    a = ops.quant_linear(x, qa, jnp.bfloat16, backend="jnp")
    b = ops.quant_linear(x, pw, jnp.bfloat16, backend="interpret")
    c = ops.quant_linear(x, pw, jnp.bfloat16, backend="jnp")
    assert np.allclose(a, c, rtol=0, atol=0) and float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 5e-3


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "IQ4_XS"])
def test_quant_linear_live_every_form(qtype):
    """ops.quant_linear_live: each form's live rows (xla, interpret, the C++ kernels) equal the
    plain product's, at an odd live count, two sequences of 48 rows; the forms that compute every
    row give zeros past it."""
    rng = np.random.default_rng(2)
    qa = random_quant_array(qtype, (64, 256), rng)
    pw = ops.prepare_weight(qa)
    x = jnp.asarray(rng.standard_normal((2, 48, 256)), jnp.float32)
    live = jnp.int32(21)
    want = np.asarray(ops.quant_linear(x, qa, jnp.float32, backend="xla"))
    for backend, w in (("xla", qa), ("interpret", pw), ("cpu", qa)):
        y = np.asarray(ops.quant_linear_live(x, w, jnp.float32, live, backend=backend), np.float32)
        assert ops.selected("quant_linear_live") == backend
        assert y.shape == (2, 48, 64)
        err = np.linalg.norm(y[:, :21] - want[:, :21]) / np.linalg.norm(want[:, :21])
        assert err < 2e-2, (backend, qtype, err)
        if backend != "interpret":
            assert not y[:, 21:].any()


def test_unsupported_type_falls_back():
    rng = np.random.default_rng(1)
    qa = random_quant_array("Q5_0", (32, 256), rng)
    assert ops.prepare_weight(qa) is qa
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.float32)
    y = ops.quant_linear(x, qa, jnp.bfloat16, backend="pallas")     # no kernel: jnp reference
    assert ops.selected("quant_linear") == "xla"
    assert y.shape == (1, 32) and np.isfinite(np.asarray(y)).all()


def test_moe_and_mla_dispatch():
    rng = np.random.default_rng(2)
    E, F, d = 4, 256, 256
    qas = [random_quant_array("Q4_0", s, rng) for s in [(E, F, d), (E, F, d), (E, d, F)]]
    pws = [ops.prepare_weight(q) for q in qas]
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.float32)
    ids = jnp.array([[0, 3]], jnp.int32)
    w = jnp.array([[0.6, 0.4]], jnp.float32)
    a = ops.moe_experts(x, w, ids, *qas, jnp.bfloat16, backend="jnp")
    b = ops.moe_experts(x, w, ids, *pws, jnp.bfloat16, backend="interpret")
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 6e-3
    q = jnp.asarray(rng.standard_normal((1, 16, 576)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((1, 32, 576)), jnp.bfloat16)
    L = jnp.array([20], jnp.int32)
    a = ops.mla_decode_attention(q, c, L, 0.1, dtype=jnp.float32, backend="jnp")
    b = ops.mla_decode_attention(q, c, L, 0.1, dtype=jnp.float32, backend="interpret")
    assert np.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_attention_dispatch():
    """Decompressed-K/V attention: the C++ flash kernel for flash calls on the cpu backend, the XLA
    form otherwise (without -fa the scores are materialized in -amb chunks, as asked); both agree."""
    rng = np.random.default_rng(3)
    B, T, S, H, D, Dv = 1, 6, 20, 4, 24, 16
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, H, Dv)), jnp.bfloat16)
    q_pos = jnp.asarray(7 + np.arange(T)[None], jnp.int32)
    ref = ops.attention(q, k, v, q_pos, 0.2, flash=True, kv_block=8, backend="xla")
    assert ops.selected("attention") == "xla"
    out = {}
    for flash in (True, False):
        out[flash] = ops.attention(q, k, v, q_pos, 0.2, flash=flash, kv_block=8, backend="cpu")
        assert ops.selected("attention") == ("cpu" if flash else "xla")
        assert out[flash].shape == (B, T, H, Dv)
        # bf16 inputs: both round p to bf16 for p·v (the kernel per block of keys, as the XLA flash form)
        assert float(jnp.linalg.norm(out[flash] - ref) / jnp.linalg.norm(ref)) < 5e-3


@pytest.mark.parametrize("types", [("Q4_0", "Q4_0", "Q8_0"), ("Q8_0", "Q6_K", "Q4_K")])
def test_swiglu_ffn_dispatch(types):
    """The dense FFN: the C++ fused kernel (one expert, weight 1) for prompt-sized x, the three
    GEMVs below FUSED_FFN_MIN_ROWS; both equal XLA's form within the fast mode's 8-bit error."""
    rng = np.random.default_rng(4)
    d, F = 256, 512
    gate, up = (random_quant_array(t, (F, d), rng) for t in types[:2])
    down = random_quant_array(types[2], (d, F), rng)
    for rows in (1, 3, 5, 17, 130):
        x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
        for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
            ref = ops.swiglu_ffn(x, gate, up, down, jnp.float32, backend="xla")
            with ops.kernel_context("cpu", threads=2):
                y = ops.swiglu_ffn(x, gate, up, down, dtype)
            assert ops.selected("swiglu_ffn") == ("cpu" if rows >= ops.FUSED_FFN_MIN_ROWS else "xla")
            assert y.shape == (rows, d)
            err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            assert err < tol, (types, rows, dtype, err)
