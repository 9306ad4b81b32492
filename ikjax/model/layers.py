"""The small pieces every layer uses: RMSNorm, quantized linear, SwiGLU FFN."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ikjax.quant.array import QuantArray

HIGHEST = jax.lax.Precision.HIGHEST


def precision_for(dtype):
    """f32 compute means true f32 matmuls (no TF32 on GPU); lower dtypes use the default."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def rms_norm(x, weight, eps: float):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def linear(x, w: QuantArray, dtype):
    """x [..., in] @ W[out, in]^T with W dequantized in the graph; float32 result."""
    return jnp.einsum("...i,oi->...o", x.astype(dtype), w.dequantize(dtype), precision=precision_for(dtype),
                      preferred_element_type=jnp.float32)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def dense_ffn(x, gate: QuantArray, up: QuantArray, down: QuantArray, dtype):
    return linear(swiglu(linear(x, gate, dtype), linear(x, up, dtype)), down, dtype)
