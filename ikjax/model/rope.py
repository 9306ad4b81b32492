"""Rotary position embedding for the rope part of q and k, with DeepSeek's YaRN scaling.

Pairs (x0,x1),(x2,x3)… rotate together (ggml's NORM mode). Transformers de-interleaves first and
rotates halves; q and k get the same permutation, so scores are identical. The inverse frequencies
follow transformers' `_compute_yarn_parameters` in float32, step by step.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ikjax.gguf_io.config import ModelConfig
from ikjax.ops.rope import apply_rope  # noqa: F401 - the model's rope, kept below it for the op's reference


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.rope_dim
    pos_freqs = np.float32(cfg.rope_base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = np.float32(1.0) / pos_freqs
    if cfg.yarn is None:
        return inv_extra.astype(np.float32)
    y = cfg.yarn
    inv_inter = np.float32(1.0) / (np.float32(y.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_context / (rotations * 2 * math.pi))) / (2 * math.log(cfg.rope_base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_factor = np.float32(1) - ramp.astype(np.float32)
    return (inv_inter * (np.float32(1) - extra_factor) + inv_extra * extra_factor).astype(np.float32)


def rope_tables(inv_freq: np.ndarray, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin of shape positions.shape + [rope/2], in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)
