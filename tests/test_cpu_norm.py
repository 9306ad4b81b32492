"""The C++ RMSNorm (pallas_kernels/rms_norm/cpu_ffi.cc) against the model's definition
(rms_norm_ref), odd widths and row counts, 1 and 3 threads; a row's bits the same alone and in a
batch; ops.rms_norm on a CPU taking it, and refusing what it does not take."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from pallas_kernels import cpu as _cpu
from pallas_kernels.rms_norm import rms_norm_ref

pytestmark = pytest.mark.skipif(not _cpu.available(), reason=_cpu.unavailable_reason() or "no C++ kernels")


@pytest.mark.parametrize("shape", [(1, 512, 2048), (7, 1536), (3, 2, 13), (1, 512), (0, 64), (2050, 9)], ids=str)
def test_rms_norm_matches_reference(shape):
    from pallas_kernels.rms_norm import cpu as norm_cpu
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 30, shape[:-1] + (1,)), jnp.float32)
    w = jnp.asarray(rng.uniform(-2, 2, shape[-1]), jnp.float32)
    ref = np.asarray(rms_norm_ref(x, w, 1e-6), np.float64)
    for n_threads in (1, 3):
        got = np.asarray(norm_cpu.rms_norm(x, w, 1e-6, n_threads=n_threads))
        assert got.shape == x.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max(initial=0))
    with ops.kernel_context("cpu", 2):
        via = np.asarray(ops.rms_norm(x, w, 1e-6))
    np.testing.assert_array_equal(via, np.asarray(norm_cpu.rms_norm(x, w, 1e-6, n_threads=2)))


def test_rms_norm_rows_batch_invariant():
    """Each row is summed in one fixed order on one thread: the same bits alone, in a batch of 300
    and at any thread count (the server's batched decode rows stay as each alone)."""
    from pallas_kernels.rms_norm import cpu as norm_cpu
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((300, 2047)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 2047), jnp.float32)
    batch = np.asarray(norm_cpu.rms_norm(x, w, 1e-5, n_threads=3))
    for r in (0, 17, 299):
        alone = np.asarray(norm_cpu.rms_norm(x[r:r + 1], w, 1e-5, n_threads=1))
        np.testing.assert_array_equal(alone[0], batch[r])
    np.testing.assert_array_equal(np.asarray(norm_cpu.rms_norm(x, w, 1e-5, n_threads=1)), batch)


def test_rms_norm_refusals_fall_to_xla():
    from pallas_kernels.rms_norm import cpu as norm_cpu
    x = jnp.ones((4, 8), jnp.float32)
    assert norm_cpu.supported(x, jnp.ones(8, jnp.float32), 1e-6)
    assert not norm_cpu.supported(x.astype(jnp.bfloat16), jnp.ones(8, jnp.float32), 1e-6)
    assert not norm_cpu.supported(x, jnp.ones(7, jnp.float32), 1e-6)
    with pytest.raises(ValueError, match="rms_norm \\(cpu\\): unsupported call"):
        norm_cpu.rms_norm(x, jnp.ones(7, jnp.float32), 1e-6)
    xb = x.astype(jnp.bfloat16)
    with ops.kernel_context("cpu", 2):
        out = ops.rms_norm(xb, jnp.ones(8, jnp.float32), 1e-6)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rms_norm_ref(xb, jnp.ones(8, jnp.float32), 1e-6)))
