"""The C++ CPU absorbed-MLA attention (cpu_kernel.cc) as a JAX op, on the latent cache as stored.

`mla_attention` is the general form (decode and prompt): queries [B, T, H, D] at positions q_pos
[B, T] against the latent cache [B, S, W] (f32 / f16 / bf16, or q8_0 {"q": int8 [B, S, nb, 32],
"d": f16 [B, S, nb]} as ikjax/model/cache.py stores it); the query at position p sees keys 0..p, and
only those keys are read, so the cost follows the real KV length, not the bucket S. V is the first
v_dim values of each entry. Softmax and accumulation are f32; queries are taken in f32.
`mla_decode` has mla_decode_ref's signature (one query per sequence, lengths [B]).

`attention` is the same kernel with keys and values of their own, per head or shared ([B, S, Hk, .],
Hk = 1 or H): the standard attention of the `-mla 0/2/3` prompt steps over the decompressed K/V, as
ikjax/model/attention.py's `attend` with flash (causal by position, only visible keys read).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_mla_attention"
ATTENTION_TARGET = "ikjax_cpu_attention"
ATTENTION_KV_TARGET = "ikjax_cpu_attention_kv"
CACHE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def _cache_parts(cache):
    """-> (data, scales, row width W): the FFI operands for a float or q8_0 cache."""
    if isinstance(cache, dict):
        q, d = cache["q"], cache["d"]
        return q, d, q.shape[-2] * q.shape[-1]
    # a float cache has no scales; the operand slot takes a 0-size placeholder
    return cache, jnp.zeros((0,), jnp.float32), cache.shape[-1]


def supported(q_shape, cache, v_dim: int, stacked: bool = False) -> bool:
    """Whether the C++ kernel takes this call: extension built, cache f32/f16/bf16 [B, S, W] or q8_0
    (int8 [B, S, nb, 32] + f16/f32 scales [B, S, nb]) — with `stacked`, a stack of such caches
    ([L, B, S, W], ...) — q [B, T, H, D] or [B, H, D] with D <= W and 1 <= v_dim <= D."""
    if not _cpu.available():
        return False
    lead = 1 if stacked else 0
    if isinstance(cache, dict):
        if set(cache) != {"q", "d"}:
            return False
        q, d = cache["q"], cache["d"]
        if (q.dtype != jnp.int8 or q.ndim != 4 + lead or q.shape[-1] != 32 or d.ndim != 3 + lead
                or d.shape != q.shape[:3 + lead] or d.dtype not in (jnp.float16, jnp.float32)):
            return False
        B, W = q.shape[lead], q.shape[lead + 2] * 32
    else:
        if cache.ndim != 3 + lead or not any(cache.dtype == t for t in CACHE_DTYPES):
            return False
        B, W = cache.shape[lead], cache.shape[-1]
    if len(q_shape) not in (3, 4) or q_shape[0] != B:
        return False
    D = q_shape[-1]
    return D <= W and 1 <= v_dim <= D


def mla_attention(q, cache, q_pos, scale, *, v_dim: int, n_threads: int = 0, layer=None):
    """q [B, T, H, D], cache (see module doc), q_pos int [B, T], scale -> [B, T, H, v_dim] float32.
    With `layer` (an int or a traced int32 scalar, e.g. a scan's index) `cache` is a stack of layer
    caches [L, B, S, W] (ikjax/model/cache.py's group entries) and layer `layer` of it is read in
    place; without, one layer's cache.

    n_threads: the user's -t (generation) / -tb (prompt); 0 = every core."""
    stacked = layer is not None
    if not supported(q.shape, cache, v_dim, stacked):
        raise ValueError(f"mla_attention (cpu): unsupported call q {q.shape}, cache "
                         f"{jax.tree_util.tree_map(lambda x: (x.shape, str(x.dtype)), cache)}, v_dim {v_dim}"
                         + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    if not stacked:  # one layer: a stack of one (a reshape, no copy)
        cache, layer = jax.tree_util.tree_map(lambda a: a[None], cache), 0
    data, scales, _ = _cache_parts(cache)
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, H, v_dim), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(q.astype(jnp.float32), data, scales, q_pos.astype(jnp.int32),
                                         jnp.asarray(layer, jnp.int32),
                                         scale=np.float32(scale), v_dim=np.int64(v_dim),
                                         n_threads=np.int64(n_threads))


def mla_decode(q, cache, lengths, scale, *, v_dim: int = 512, dtype=None, n_threads: int = 0, layer=None):
    """mla_decode_ref's signature: q [B, H, D], lengths [B] (entries 0..len-1 visible) -> [B, H, v_dim]
    float32 (`layer`: as `mla_attention`). `dtype` is accepted for the registry's uniform call and
    ignored: this kernel computes in f32 on the stored cache values."""
    del dtype
    q_pos = (jnp.asarray(lengths).astype(jnp.int32) - 1)[:, None]
    return mla_attention(q[:, None], cache, q_pos, scale, v_dim=v_dim, n_threads=n_threads, layer=layer)[:, 0]


def attention_supported(q_shape, k, v) -> bool:
    """Whether `attention` takes this call: extension built, q [B, T, H, D], k [B, S, Hk, Wk >= D] and
    v [B, S, Hk, Dv] of one float type (f32 / f16 / bf16), Hk = 1 or H, 1 <= D <= Wk."""
    if not _cpu.available() or len(q_shape) != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    B, _, H, D = q_shape
    if k.dtype != v.dtype or not any(k.dtype == t for t in CACHE_DTYPES):
        return False
    return (k.shape[0] == v.shape[0] == B and k.shape[1:3] == v.shape[1:3] and k.shape[2] in (1, H)
            and 1 <= D <= k.shape[3] and v.shape[3] >= 1)


def attention(q, k, v, q_pos, scale, *, n_threads: int = 0):
    """q [B, T, H, D], k [B, S, Hk, Wk], v [B, S, Hk, Dv], q_pos int [B, T] -> [B, T, H, Dv] float32:
    softmax(scale q·k[:D]) v over the keys s <= q_pos (and s < S); f32 softmax and accumulation.
    With q, k and v all bf16, p is rounded to bf16 before p·v (as `attend` on bf16 inputs), and
    the products run in bf16 where the CPU has AVX512_BF16 (exact products, f32 sums)."""
    if not attention_supported(q.shape, k, v):
        raise ValueError(f"attention (cpu): unsupported call q {q.shape}, k {k.shape} {k.dtype}, "
                         f"v {v.shape} {v.dtype}" + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, H, v.shape[-1]), jnp.float32)
    # all bf16 (the fast mode): q as it is, p rounded to bf16 for p·v as XLA's bf16 attention
    # does, products in bf16; otherwise f32 queries and p
    bf16 = q.dtype == k.dtype == jnp.bfloat16
    q = q if bf16 else q.astype(jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_TARGET, out)(q, k, v, q_pos.astype(jnp.int32),
                                                   scale=np.float32(scale), n_threads=np.int64(n_threads))


def attention_kv_supported(q_shape, kv, k_rope, nope: int) -> bool:
    """Whether `attention_kv` takes this call: q [B, T, H, nope + R], kv [B, S, H, nope + Dv] and
    k_rope [B, S, >= R], float types (f32 / f16 / bf16), Dv >= 1."""
    if not _cpu.available() or len(q_shape) != 4 or kv.ndim != 4 or k_rope.ndim != 3:
        return False
    B, _, H, D = q_shape
    floats = all(any(t.dtype == c for c in CACHE_DTYPES) for t in (kv, k_rope))
    return (floats and kv.shape[0] == k_rope.shape[0] == B and kv.shape[2] == H and kv.shape[1] == k_rope.shape[1]
            and 0 <= nope < kv.shape[3] and nope <= D and D - nope <= k_rope.shape[2] and D >= 1)


def attention_kv(q, kv, k_rope, q_pos, scale, *, nope: int, n_threads: int = 0):
    """`attention` with K = kv[..., :nope] ++ k_rope (broadcast over the heads) and V = kv[..., nope:]
    read in place: the -mla 2/3 prompt's decompressed keys and values as the kv_b product gives
    them. q [B, T, H, D] -> [B, T, H, kv.shape[-1] - nope] float32. bf16 q takes K, V and p at
    bf16 (as the XLA form converts them), f32 q keeps them as stored."""
    if not attention_kv_supported(q.shape, kv, k_rope, nope):
        raise ValueError(f"attention_kv (cpu): unsupported call q {q.shape}, kv {kv.shape} {kv.dtype}, k_rope "
                         f"{k_rope.shape} {k_rope.dtype}, nope {nope}"
                         + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, H, kv.shape[-1] - nope), jnp.float32)
    q = q if q.dtype == jnp.bfloat16 else q.astype(jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_KV_TARGET, out)(q, kv, k_rope, q_pos.astype(jnp.int32), scale=np.float32(scale),
                                                      nope=np.int64(nope), n_threads=np.int64(n_threads))
