"""x f32 -> bf16 (round to nearest even, as XLA's convert) over the C++ pool's threads: the C++ op
ikjax_cpu_cast_bf16 (cpu_ffi.cc). XLA:CPU's converts did not grow with threads (RESULTS §26q)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_cast_bf16"


def supported(x, dtype) -> bool:
    return _cpu.available() and x.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)


def cast_bf16(x, *, n_threads: int = 0):
    if not supported(x, jnp.bfloat16):
        raise ValueError(f"cast_bf16 (cpu): unsupported call x {x.shape} {x.dtype}"
                         + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))(x, n_threads=np.int64(n_threads))
