"""RMSNorm of f32 rows over the C++ pool's threads: the C++ op ikjax_cpu_rms_norm (cpu_ffi.cc).
XLA:CPU's norms ran in a few partitions and did not grow with threads (RESULTS §26ag)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_rms_norm"


def supported(x, weight, eps) -> bool:
    return (_cpu.available() and x.dtype == jnp.float32 and weight.dtype == jnp.float32 and x.ndim >= 1
            and weight.shape == (x.shape[-1],))


def rms_norm(x, weight, eps: float, *, n_threads: int = 0):
    """x [..., d] f32 -> x / sqrt(mean(x^2) + eps) * weight, f32."""
    if not supported(x, weight, eps):
        raise ValueError(f"rms_norm (cpu): unsupported call x {x.shape} {x.dtype}, weight {weight.shape} {weight.dtype}"
                         + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x, weight, eps=np.float32(eps), n_threads=np.int64(n_threads))
