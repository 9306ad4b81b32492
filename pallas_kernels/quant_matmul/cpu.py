"""The C++ CPU quantized matmul (cpu_kernel.cc) as a JAX op: y = x · Wᵀ reading GGUF blocks.

The weight goes to the kernel as its stored bytes [N, row_bytes] (no repacking, no copy beyond
what XLA does with a constant); the kernel dequantizes rows with SIMD per type and picks its engine
by the number of activation rows (decode: dequantize-and-dot, bound by reading the weights;
prompt: dequantized panels and a register-blocked microkernel). `compute` says what the products
are rounded to:
- "f32" keeps float activations and weights (matches the f32 reference to rounding): the exact mode.
- "bf16" is the fast mode (the model's dtype="bf16"): bf16 products for prompts (x and W rounded to
  bf16, f32 accumulation, for calls of 4 or more rows) and 8-bit activations for decode (fewer
  than 4 rows): x quantized per block of 32 (scale max|x| / 127) and int8 dot products with the
  stored Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL blocks, as ik_llama.cpp generates tokens, at
  the avx2 and avx512 (VNNI) levels (within 1e-2 of sum|x||w| of the f32 result per element,
  ~0.5 % of its norm; tests/test_cpu_quant_matmul.py); the K-quants and IQ4_XS likewise, at the
  avx2 level with one x scale per 256 values (Q8_K's grouping: one float FMA per super-block).
  Other types, and the generic level, decode in f32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.quant.array import stacked_operands
from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_quant_matmul"
COMPUTE = {"f32": 0, "bf16": 1}


def supported(type_name: str) -> bool:
    """Whether the C++ kernels have a path for this GGUF type (asked of the compiled library, so
    types added in C++ appear here without a Python list to keep in step)."""
    if not _cpu.available():
        return False
    from ikjax.quant import by_name  # type table only (names -> ggml ids); kernels stay ikjax-free
    try:
        tid = by_name(type_name).type_id
    except Exception:
        return False
    return bool(_cpu._cpu.quant_type_supported(int(tid)))


def quant_matmul(x, w, *, n_threads: int = 0, compute: str = "f32"):
    """x [..., K] (any float dtype; computed from float32), w a QuantArray [N, K] (or a LayerSlice
    of a stack of them, read in place) -> [..., N] float32. n_threads: the -t / -tb thread count
    (0 = every core)."""
    if compute not in COMPUTE:
        raise ValueError(f"quant_matmul: compute must be one of {sorted(COMPUTE)}, not {compute!r}")
    if len(w.shape) != 2:
        raise ValueError(f"quant_matmul: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    N, K = int(w.shape[0]), int(w.shape[1])
    if x.shape[-1] != K:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} columns, weight has K = {K}")
    if not supported(w.qtype.name):
        raise ValueError(f"quant_matmul: no C++ path for type {w.qtype.name}")
    lead = x.shape[:-1]
    if N == 0:  # no output columns (and no rows to reshape the bytes by)
        return jnp.zeros(lead + (0,), jnp.float32)
    _cpu.register()
    data, layer = stacked_operands(w)
    data = data.reshape(data.shape[0], N, -1)  # uint8 [L, N, row_bytes], the blocks as stored
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(lead + (N,), jnp.float32),
                            vmap_method="expand_dims")  # vmap over x; the weight is not copied per batch
    return call(x.astype(jnp.float32), data, layer, type=np.int64(w.qtype.type_id),
                n_threads=np.int64(n_threads), compute=np.int64(COMPUTE[compute]))


def quant_matmul_heads(x, w, *, n_threads: int = 0, compute: str = "f32"):
    """One product per head: x [..., G, K] with w a QuantArray [G, N, K] -> [..., G, N] float32
    (y[.., g] = x[.., g] · W[g]ᵀ; MLA's absorbed W_kb / W_vb products). One call for all heads."""
    if compute not in COMPUTE:
        raise ValueError(f"quant_matmul_heads: compute must be one of {sorted(COMPUTE)}, not {compute!r}")
    if len(w.shape) != 3:
        raise ValueError(f"quant_matmul_heads: weight must be 3-D [G, N, K], got shape {tuple(w.shape)}")
    G, N, K = (int(s) for s in w.shape)
    if x.shape[-2:] != (G, K):
        raise ValueError(f"quant_matmul_heads: x [..., {G}, {K}] expected, got {tuple(x.shape)}")
    if not supported(w.qtype.name):
        raise ValueError(f"quant_matmul_heads: no C++ path for type {w.qtype.name}")
    _cpu.register()
    lead = x.shape[:-2]
    if N == 0:  # no output columns (the reshape below would divide by N)
        return jnp.zeros((*lead, G, 0), jnp.float32)
    M = int(np.prod(lead, dtype=np.int64))
    xg = jnp.moveaxis(x.astype(jnp.float32).reshape(M, G, K), 1, 0)       # [G, M, K]
    data, layer = stacked_operands(w)
    data = data.reshape(data.shape[0], G, N, -1)
    y = jax.ffi.ffi_call(TARGET + "_heads", jax.ShapeDtypeStruct((G, M, N), jnp.float32))(
        xg, data, layer, type=np.int64(w.qtype.type_id), n_threads=np.int64(n_threads),
        compute=np.int64(COMPUTE[compute]))
    return jnp.moveaxis(y, 0, 1).reshape(*lead, G, N)
