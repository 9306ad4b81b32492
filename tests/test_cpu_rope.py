"""The query's rope + cast (ikjax.ops.rope_q): the C++ pass (pallas_kernels/rope_q) against the
XLA form the model used before, on the same inputs, f32 and bf16 results, odd shapes and special
values; the calls it refuses fall to the XLA form."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from pallas_kernels import cpu as _cpu
from pallas_kernels.rope_q import cpu as rope_cpu

pytestmark = pytest.mark.skipif(not _cpu.available(), reason="the C++ kernel extension is not built")


def _inputs(B, T, H, nope, R, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, nope + R)).astype(np.float32) * 3
    ang = rng.uniform(-40, 40, (B, T, R // 2)).astype(np.float32)
    return jnp.asarray(q), jnp.cos(jnp.asarray(ang)), jnp.sin(jnp.asarray(ang))


@pytest.mark.parametrize("shape", [(1, 512, 16, 128, 64), (2, 7, 3, 5, 6), (1, 1, 1, 0, 2), (3, 2, 4, 9, 0)],
                         ids=lambda c: "B{}-T{}-H{}-nope{}-R{}".format(*c))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rope_q_matches_xla(shape, dtype):
    B, T, H, nope, R = shape
    q, cos, sin = _inputs(B, T, H, nope, R, sum(shape))
    if q.size:  # the values XLA's convert keeps as they are: NaN, infinities, a bf16 tie
        q = q.at[0, 0, 0, -1].set(jnp.nan).at[0, -1, -1, 0].set(jnp.inf)
        q = q.at[-1, -1, 0, -1].set(np.float32(np.uint32(0x3F808000).view(np.float32)))
    ref = ops.rope_q(q, cos, sin, nope=nope, dtype=dtype, backend="xla")
    assert rope_cpu.supported(q, cos, sin, nope, dtype)
    got = rope_cpu.rope_q(q, cos, sin, nope=nope, dtype=dtype, n_threads=3)
    assert got.dtype == ref.dtype and got.shape == ref.shape == q.shape
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
    # and through the op's dispatch on the cpu backend
    with ops.kernel_context("cpu", 2):
        via = ops.rope_q(q, cos, sin, nope=nope, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(via.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))


def test_rope_q_refusals_fall_to_xla():
    q, cos, sin = _inputs(1, 3, 2, 4, 4, 1)
    assert not rope_cpu.supported(q, cos, sin, 5, jnp.float32)             # an odd rope part
    assert not rope_cpu.supported(q.astype(jnp.float16), cos, sin, 4, jnp.float32)
    assert not rope_cpu.supported(q, cos[..., :1], sin[..., :1], 4, jnp.float32)
    assert not rope_cpu.supported(q, cos, sin, 4, jnp.float16)             # f32 or bf16 results only
    with pytest.raises(ValueError, match="rope_q \\(cpu\\): unsupported call"):
        rope_cpu.rope_q(q, cos, sin, nope=5, dtype=jnp.float32)
    with ops.kernel_context("cpu", 2):
        out = ops.rope_q(q.astype(jnp.float16), cos, sin, nope=4, dtype=jnp.float32)
    ref = ops.rope_q(q.astype(jnp.float16), cos, sin, nope=4, dtype=jnp.float32, backend="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("shape", [(1, 1024, 16, 256), (3, 5, 7), (0, 4), (40001,)], ids=str)
def test_cast_bf16_matches_xla(shape):
    """ops.cast's C++ f32 -> bf16 (multithreaded) gives XLA's convert's bits: random values over many
    exponents, exact ties (even and odd), NaN, infinities, subnormals, sizes across the parts' edges."""
    from pallas_kernels.cast import cpu as cast_cpu
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-130, 120, shape))).astype(np.float32)
    if x.size:
        flat = x.reshape(-1).view(np.uint32)
        ties = rng.random(flat.shape) < 0.2
        flat[:] = np.where(ties, (flat & np.uint32(0xFFFF0000)) | np.uint32(0x8000), flat)
        x.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, np.float32(1e-41)]
    x = jnp.asarray(x)
    ref = ops.cast(x, jnp.bfloat16, backend="xla")
    assert cast_cpu.supported(x, jnp.bfloat16) and not cast_cpu.supported(x, jnp.float16)
    for n_threads in (1, 3):
        got = cast_cpu.cast_bf16(x, n_threads=n_threads)
        assert got.dtype == jnp.bfloat16 and got.shape == x.shape
        nan = np.isnan(np.asarray(ref, np.float32))
        np.testing.assert_array_equal(np.isnan(np.asarray(got, np.float32)), nan)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16)[~nan], np.asarray(ref).view(np.uint16)[~nan])
    with ops.kernel_context("cpu", 2):
        via = ops.cast(x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(via, np.float32), np.asarray(ref, np.float32))
