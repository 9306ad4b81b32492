"""Plain-jnp absorbed-MLA decode attention (oracle and CPU path); same math as
ikjax.model.attention.attend_materialized with one query token per sequence."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _prec(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def latent_values(cache, dtype):
    """Cache [B, S, W] float, or q8_0 {"q": int8 [B,S,nb,32], "d": f16 [B,S,nb]} -> [B, S, nb*32|W] dtype."""
    if isinstance(cache, dict):
        x = cache["q"].astype(jnp.float32) * cache["d"].astype(jnp.float32)[..., None]
        return x.reshape(*x.shape[:-2], -1).astype(dtype)
    return cache.astype(dtype)


def mla_decode_ref(q, cache, lengths, scale, *, v_dim: int = 512, dtype=jnp.bfloat16):
    """q [B, H, D] (absorbed queries, D = r + rope = 576), cache [B, S, D] (or q8_0), lengths [B]
    (entries 0..len-1 are visible) -> [B, H, v_dim] float32."""
    D = q.shape[-1]
    kv = latent_values(cache, dtype)[..., :D]
    s = jnp.einsum("bhd,bsd->bhs", q.astype(dtype), kv, precision=_prec(dtype),
                   preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(kv.shape[1])[None, None, :] < lengths[:, None, None]
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhs,bsd->bhd", p.astype(dtype), kv[..., :v_dim], precision=_prec(dtype),
                      preferred_element_type=jnp.float32)
