"""Plain-jnp RMSNorm: the model's definition (x / sqrt(mean(x^2) + eps) * weight, in float32)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_ref(x, weight, eps: float):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight
