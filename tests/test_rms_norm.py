"""The `rms_norm` op: the one-row-per-program Pallas kernel (interpret mode here) against the
reference on odd widths and row counts, and the registry's rule for when it runs."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from ikjax.ops import registry
from pallas_kernels.rms_norm import rms_norm_ref, rms_norm_rows


@pytest.mark.parametrize("shape", [(1, 1, 2048), (8, 1, 1536), (3, 7168), (5, 2, 576), (1, 100)])
def test_rows_kernel_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), jnp.float32)
    got = np.asarray(rms_norm_rows(x, w, 1e-6, interpret=True))
    want = np.asarray(rms_norm_ref(x, w, 1e-6))
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    # each row as it is alone
    one = np.asarray(rms_norm_rows(x.reshape(-1, shape[-1])[:1], w, 1e-6, interpret=True))
    assert np.array_equal(got.reshape(-1, shape[-1])[:1], one)


def test_bf16_input_and_zero_row():
    x = jnp.zeros((2, 1024), jnp.bfloat16).at[1].set(1.0)
    w = jnp.ones(1024, jnp.float32)
    got = np.asarray(rms_norm_rows(x, w, 1e-6, interpret=True))
    assert np.all(got[0] == 0) and np.allclose(got[1], 1.0, atol=1e-5)


def test_kernel_only_in_batch_invariant_decode_steps(monkeypatch):
    x = jnp.ones((4, 1, 256), jnp.float32)
    w = jnp.ones(256, jnp.float32)
    with ops.kernel_context("interpret", 1, seq_tokens=1):
        monkeypatch.setenv("IKJAX_BATCH_INVARIANT", "0")
        ops.rms_norm(x, w, 1e-6)
        assert registry.selected("rms_norm") == "xla"
        monkeypatch.setenv("IKJAX_BATCH_INVARIANT", "1")
        ops.rms_norm(x, w, 1e-6)
        assert registry.selected("rms_norm") == "interpret"
    with ops.kernel_context("interpret", 1, seq_tokens=512):  # a prompt step: XLA's norm
        ops.rms_norm(x, w, 1e-6)
        assert registry.selected("rms_norm") == "xla"
