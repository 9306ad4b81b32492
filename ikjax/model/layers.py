"""The small pieces every layer uses: RMSNorm, quantized linear, SwiGLU FFN."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ikjax import kernels
from ikjax.quant.array import QuantArray

HIGHEST = jax.lax.Precision.HIGHEST


def precision_for(dtype):
    """f32 compute means true f32 matmuls (no TF32 on GPU); lower dtypes use the default."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def rms_norm(x, weight, eps: float):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def linear(x, w, dtype):
    """x [..., in] @ W[out, in]^T, float32 result: the dequantizing Pallas kernel on GPU, XLA's
    dequantize-then-dot elsewhere (ikjax.kernels picks)."""
    return kernels.quant_linear(x, w, dtype)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def dense_ffn(x, gate: QuantArray, up: QuantArray, down: QuantArray, dtype):
    return linear(swiglu(linear(x, gate, dtype), linear(x, up, dtype)), down, dtype)
