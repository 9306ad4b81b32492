"""The C++ CPU absorbed-MLA attention (cpu_kernel.cc) as a JAX op, on the latent cache as stored.

`mla_attention` is the general form (decode and prompt): queries [B, T, H, D] at positions q_pos
[B, T] against the latent cache [B, S, W] (f32 / f16 / bf16, or q8_0 {"q": int8 [B, S, nb, 32],
"d": f16 [B, S, nb]} as ikjax/cache.py stores it); the query at position p sees keys 0..p, and
only those keys are read, so the cost follows the real KV length, not the bucket S. V is the first
v_dim values of each entry. Softmax and accumulation are f32; queries are taken in f32.
`mla_decode` has mla_decode_ref's signature (one query per sequence, lengths [B]).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_mla_attention"
CACHE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def _cache_parts(cache):
    """-> (data, scales, row width W): the FFI operands for a float or q8_0 cache."""
    if isinstance(cache, dict):
        q, d = cache["q"], cache["d"]
        return q, d, q.shape[-2] * q.shape[-1]
    # a float cache has no scales; the operand slot takes a 0-size placeholder
    return cache, jnp.zeros((0,), jnp.float32), cache.shape[-1]


def supported(q_shape, cache, v_dim: int) -> bool:
    """Whether the C++ kernel takes this call: extension built, cache f32/f16/bf16 [B, S, W] or q8_0
    (int8 [B, S, nb, 32] + f16/f32 scales [B, S, nb]), q [B, T, H, D] or [B, H, D] with D <= W and
    1 <= v_dim <= D."""
    if not _cpu.available():
        return False
    if isinstance(cache, dict):
        if set(cache) != {"q", "d"}:
            return False
        q, d = cache["q"], cache["d"]
        if (q.dtype != jnp.int8 or q.ndim != 4 or q.shape[-1] != 32 or d.ndim != 3
                or d.shape != q.shape[:3] or d.dtype not in (jnp.float16, jnp.float32)):
            return False
        B, W = q.shape[0], q.shape[2] * 32
    else:
        if cache.ndim != 3 or not any(cache.dtype == t for t in CACHE_DTYPES):
            return False
        B, W = cache.shape[0], cache.shape[-1]
    if len(q_shape) not in (3, 4) or q_shape[0] != B:
        return False
    D = q_shape[-1]
    return D <= W and 1 <= v_dim <= D


def mla_attention(q, cache, q_pos, scale, *, v_dim: int, n_threads: int = 0):
    """q [B, T, H, D], cache (see module doc), q_pos int [B, T], scale -> [B, T, H, v_dim] float32.

    n_threads: the user's -t (generation) / -tb (prompt); 0 = every core."""
    if not supported(q.shape, cache, v_dim):
        raise ValueError(f"mla_attention (cpu): unsupported call q {q.shape}, cache "
                         f"{jax.tree_util.tree_map(lambda x: (x.shape, str(x.dtype)), cache)}, v_dim {v_dim}"
                         + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    data, scales, _ = _cache_parts(cache)
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, H, v_dim), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(q.astype(jnp.float32), data, scales, q_pos.astype(jnp.int32),
                                         scale=np.float32(scale), v_dim=np.int64(v_dim),
                                         n_threads=np.int64(n_threads))


def mla_decode(q, cache, lengths, scale, *, v_dim: int = 512, dtype=None, n_threads: int = 0):
    """mla_decode_ref's signature: q [B, H, D], lengths [B] (entries 0..len-1 visible) -> [B, H, v_dim]
    float32. `dtype` is accepted for the registry's uniform call and ignored: this kernel computes
    in f32 on the stored cache values."""
    del dtype
    q_pos = (jnp.asarray(lengths).astype(jnp.int32) - 1)[:, None]
    return mla_attention(q[:, None], cache, q_pos, scale, v_dim=v_dim, n_threads=n_threads)[:, 0]
