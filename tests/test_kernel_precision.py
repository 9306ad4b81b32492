"""The Pallas GPU kernels' tile products at float32 are IEEE products, not TF32 (Triton's default
for float32 operands): with `--dtype f32` the GPU's logits must agree with the CPU's to float32's
accuracy. On this machine the kernels are lowered for CUDA and the precision each `tt.dot` is
built with is recorded; on a GPU the compiled kernels are compared with float32 CPU references."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.model import cache as kvcache
from pallas_kernels.mla_decode import mla_decode, mla_decode_ref
from pallas_kernels.prompt_attention import attention_kv_flash, attention_kv_ref
from pallas_kernels.quant_matmul import prepare, quant_matmul, quant_matmul_ref
from pallas_kernels.testing import cuda_lowering, random_quant_array


def _inputs(rng, dtype):
    """One call of each kernel with float products: (name, fn(dtype), args)."""
    pw = prepare(random_quant_array("Q8_0", (128, 512), rng))
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)          # 16 rows: the tl.dot schedule
    q = jnp.asarray(rng.standard_normal((1, 64, 16, 192)), dtype)
    kv = jnp.asarray(rng.standard_normal((1, 256, 16, 256)), dtype)
    kr = jnp.asarray(rng.standard_normal((1, 256, 64)), dtype)
    pos = jnp.asarray((100 + np.arange(64))[None], jnp.int32)
    qd = jnp.asarray(rng.standard_normal((2, 16, 576)), jnp.float32)
    cd = jnp.asarray(rng.standard_normal((2, 256, 576)), dtype)
    lengths = jnp.asarray([100, 256], jnp.int32)
    return [
        ("quant_matmul", lambda x: quant_matmul(x, pw, dtype), (x,)),
        ("prompt_attention", lambda q, kv, kr, pos: attention_kv_flash(q, kv, kr, pos, 0.1, 128), (q, kv, kr, pos)),
        ("mla_decode", lambda q, c, n: mla_decode(q, c, n, 0.1, dtype=dtype), (qd, cd, lengths)),
    ]


@contextlib.contextmanager
def _recorded_dot_precisions():
    """Each `tt.dot` the Pallas Triton lowering builds, by its input precision."""
    import jax._src.pallas.triton.lowering as lowering
    seen: list = []
    orig = lowering.tt_dialect.dot

    def spy(*args, **kwargs):
        seen.append(str(kwargs.get("input_precision")))
        return orig(*args, **kwargs)
    lowering.tt_dialect.dot = spy
    try:
        yield seen
    finally:
        lowering.tt_dialect.dot = orig


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_float32_tiles_lower_to_ieee_products(dtype):
    """f32: every tile product IEEE; bf16: the matrix unit's own (no precision set)."""
    rng = np.random.default_rng(3)
    for name, fn, args in _inputs(rng, dtype):
        with _recorded_dot_precisions() as seen:
            cuda_lowering(fn, *args)
        assert seen, name
        if dtype == jnp.float32:
            assert all("ieee" in s.lower() for s in seen), (name, seen)
        else:
            assert all(s == "None" for s in seen), (name, seen)


@pytest.mark.gpu
def test_gpu_float32_kernels_match_cpu_float32():
    """On the GPU, at float32: each kernel within float32 rounding of the reference computed on the
    CPU (TF32 tiles were ~1e-4-1e-3 off)."""
    assert jax.default_backend() == "gpu"
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(5)
    pw = prepare(random_quant_array("Q4_0", (2048, 1408), rng, fast=True))
    # 16 rows: the tile-product schedule the model runs at f32 (larger row counts take XLA's
    # path at f32: ikjax.ops.quant_matmul)
    x = rng.standard_normal((16, 1408)).astype(np.float32)
    got = np.asarray(quant_matmul(jnp.asarray(x), pw, jnp.float32), np.float64)
    with jax.default_device(cpu):
        want = np.asarray(quant_matmul_ref(jnp.asarray(x), jax.device_put(pw, cpu), jnp.float32), np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 2e-6, ("quant_matmul", err)

    q = rng.standard_normal((1, 256, 16, 192)).astype(np.float32)
    kv = rng.standard_normal((1, 1024, 16, 256)).astype(np.float32)
    kr = rng.standard_normal((1, 1024, 64)).astype(np.float32)
    pos = (700 + np.arange(256))[None].astype(np.int32)
    got = np.asarray(attention_kv_flash(*map(jnp.asarray, (q, kv, kr, pos)), 0.07, 128), np.float64)
    with jax.default_device(cpu):
        want = np.asarray(attention_kv_ref(*map(jnp.asarray, (q, kv, kr, pos)), 0.07, 128), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    qd = rng.standard_normal((2, 16, 576)).astype(np.float32)
    c = rng.standard_normal((2, 4096, 576)).astype(np.float32)
    lengths = np.asarray([1000, 4096], np.int32)
    for cache in (c, kvcache.quantize_q8_0(jnp.asarray(c))):
        got = np.asarray(mla_decode(jnp.asarray(qd), jnp.asarray(cache) if isinstance(cache, np.ndarray) else cache,
                                    jnp.asarray(lengths), 0.07, dtype=jnp.float32), np.float64)
        with jax.default_device(cpu):
            cc = jax.device_put(cache, cpu)
            want = np.asarray(mla_decode_ref(jnp.asarray(qd), cc, jnp.asarray(lengths), 0.07, dtype=jnp.float32),
                              np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 2e-6, ("mla_decode", cache.dtype if hasattr(cache, "dtype") else "q8_0", err)
