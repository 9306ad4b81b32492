"""Plain-jnp quantized matmul: the CPU path and the oracle for the kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp



def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def quant_matmul_ref(x, w, dtype=jnp.bfloat16):
    """x [..., K] @ W[N, K]^T -> [..., N] float32; W a PackedWeight or QuantArray (as layers.linear)."""
    return jnp.einsum("...i,oi->...o", x.astype(dtype), w.dequantize(dtype), precision=_precision(dtype),
                      preferred_element_type=jnp.float32)
