"""The C++ CPU quantized matmul (cpu_kernel.cc) as a JAX op: y = x · Wᵀ reading GGUF blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_quant_matmul"
TYPES = ("F32", "Q8_0")  # types with a C++ path; others go through the reference


def supported(type_name: str) -> bool:
    return _cpu.available() and type_name in TYPES


def quant_matmul(x, w, *, n_threads: int = 0):
    """x [..., K] float32, w a QuantArray [N, K] -> [..., N] float32 (f32 activations)."""
    _cpu.register()
    K = w.shape[-1]
    N = int(np.prod(w.shape[:-1]))
    data = jnp.asarray(w.data).reshape(N, -1)
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (N,), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32).reshape(*x.shape[:-1], K), data,
                                         type=np.int64(w.qtype.type_id), n_threads=np.int64(n_threads))
