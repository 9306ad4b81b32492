"""Rotary embedding of adjacent pairs (ggml's NORM mode, DeepSeek's rope), and the query's rope and
cast as one op (`rope_q`): on a CPU the C++ pass of pallas_kernels/rope_q, elsewhere XLA's form.

`apply_rope` lives here, below the model, so that the op's reference is the model's own math."""
from __future__ import annotations

import jax.numpy as jnp

from ikjax.ops import registry
from pallas_kernels.rope_q import cpu as _rope_cpu


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate adjacent pairs of x's last axis. cos/sin broadcast against x[..., ::2]."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _rope_q_xla(q, cos, sin, nope, dtype):
    q_pe = apply_rope(q[..., nope:], cos[:, :, None], sin[:, :, None])
    return jnp.concatenate([q[..., :nope], q_pe], -1).astype(dtype)


def _rope_q_cpu(q, cos, sin, nope, dtype):
    return _rope_cpu.rope_q(q, cos, sin, nope=nope, dtype=dtype, n_threads=registry.threads())


def rope_q(q, cos, sin, *, nope: int, dtype, backend: str | None = None):
    """q [B, T, H, nope + R] -> the same with each head's last R values rotated as pairs by cos /
    sin [B, T, R/2], all of it at `dtype`: the -mla 0/2/3 prompt's query. `xla`: slice, rope,
    concatenate, convert; `cpu`: one multithreaded pass (XLA:CPU's four passes were ~6 % of an
    amx prompt step at -t 16, bench/RESULTS.md §26q)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _rope_q_xla),
        "cpu": registry.Impl(lambda q, cos, sin, nope, dtype: _rope_cpu.supported(q, cos, sin, nope, dtype),
                             _rope_q_cpu),
    }
    return registry.dispatch("rope_q", impls, registry.resolve_backend(backend), q, cos, sin, nope, dtype)
