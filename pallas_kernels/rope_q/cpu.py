"""The query's rope and cast in one pass, as the C++ op ikjax_cpu_rope_q (cpu_ffi.cc): q f32 [B, T,
H, D] -> out [B, T, H, D] of f32 or bf16, the first `nope` values of each head as they are, the
rest rotated as adjacent pairs by cos / sin [B, T, (D - nope) / 2] (ikjax.ops.rope's reference).

Why: XLA:CPU ran it as a slice, a pair-stack, a concatenate and a convert, four slow passes that
did not grow with threads (~10 ms of a 164 ms amx prompt step at -t 16, bench/RESULTS.md §26q).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_rope_q"


def supported(q, cos, sin, nope: int, dtype) -> bool:
    """Whether the C++ op takes this call: the extension built, f32 q [B, T, H, D] and cos / sin
    [B, T, (D - nope) / 2] in f32, an even rope part, an f32 or bf16 result."""
    if not _cpu.available() or q.ndim != 4 or cos.ndim != 3 or sin.shape != cos.shape:
        return False
    R = q.shape[-1] - nope
    return (q.dtype == jnp.float32 and cos.dtype == sin.dtype == jnp.float32 and 0 <= nope and R >= 0
            and R % 2 == 0 and cos.shape == (*q.shape[:2], R // 2)
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)))


def rope_q(q, cos, sin, *, nope: int, dtype, n_threads: int = 0):
    if not supported(q, cos, sin, nope, dtype):
        raise ValueError(f"rope_q (cpu): unsupported call q {q.shape} {q.dtype}, cos {cos.shape} {cos.dtype}, "
                         f"nope {nope}, out {jnp.dtype(dtype)}"
                         + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    out = jax.ShapeDtypeStruct(q.shape, jnp.dtype(dtype))
    return jax.ffi.ffi_call(TARGET, out)(q, cos, sin, nope=np.int64(nope), n_threads=np.int64(n_threads))
