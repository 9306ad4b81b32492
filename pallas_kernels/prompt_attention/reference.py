"""Plain-jnp attention over keys and values as the -mla 2/3 prompt's kv_b product gives them:
K = each head's k_nope ++ the shared rope part, V = each head's v part; the query at position p
sees keys 0..p. Scores in memory, float32."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_kv_ref(q, kv, k_rope, q_pos, scale: float, nope: int):
    """q [B, T, H, nope + R], kv [B, S, H, nope + Dv], k_rope [B, S, >= R], q_pos [B, T] -> [B, T, H, Dv] f32."""
    R = q.shape[-1] - nope
    f = jnp.float32
    s = (jnp.einsum("bthd,bshd->bhts", q[..., :nope].astype(f), kv[..., :nope].astype(f))
         + jnp.einsum("bthr,bsr->bhts", q[..., nope:].astype(f), k_rope[..., :R].astype(f))) * scale
    visible = jnp.arange(kv.shape[1])[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    s = jnp.where(visible[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshv->bthv", p, kv[..., nope:].astype(f))
