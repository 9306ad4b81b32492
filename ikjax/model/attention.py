"""Scaled dot-product attention over a cache, in plain jnp: the XLA backend and kernel reference.

One function serves both MLA forms. Standard: q [B,T,H,192], k [B,S,H,192], v [B,S,H,128].
Absorbed: q [B,T,H,576], k = v = the latent cache [B,S,1,576] (v is its first 512 values), one KV
stream shared by all heads. `flash=False` materializes scores, in head chunks that keep the
K·Q buffer under `amb_bytes` (ik's `-amb`); `flash=True` is the blocked online softmax: KV in
blocks of `kv_block`, never an S × H × T buffer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ikjax.model.layers import precision_for as _precision

NEG_INF = float("-inf")


def _scores(q, k, scale):
    # q [B,T,Hq,D], k [B,S,Hk,D] with Hk in {1, Hq} -> [B,Hq,T,S] float32
    if k.shape[2] == 1:
        s = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], precision=_precision(q.dtype),
                       preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("bthd,bshd->bhts", q, k, precision=_precision(q.dtype),
                       preferred_element_type=jnp.float32)
    return s * scale


def _weighted_values(p, v):
    # p [B,Hq,T,S] float32, v [B,S,Hk,Dv] -> [B,T,Hq,Dv] float32
    p = p.astype(v.dtype)
    if v.shape[2] == 1:
        return jnp.einsum("bhts,bsd->bthd", p, v[:, :, 0], precision=_precision(v.dtype),
                          preferred_element_type=jnp.float32)
    return jnp.einsum("bhts,bshd->bthd", p, v, precision=_precision(v.dtype), preferred_element_type=jnp.float32)


def _causal_mask(q_pos, n_kv):
    # q_pos [B,T] -> [B,1,T,S]: key s is visible to a query at position p iff s <= p
    return (jnp.arange(n_kv)[None, None, :] <= q_pos[:, :, None])[:, None]


def attend_materialized(q, k, v, q_pos, scale, amb_bytes: int = 0):
    """Softmax(q·k) v with the scores in memory; heads in chunks bounded by `amb_bytes` (0: no bound)."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    per_head = B * T * S * 4
    chunk = H if amb_bytes <= 0 else max(1, min(H, amb_bytes // per_head))
    mask = _causal_mask(q_pos, S)
    outs = []
    for h0 in range(0, H, chunk):
        hs = slice(h0, min(H, h0 + chunk))
        kh = k if k.shape[2] == 1 else k[:, :, hs]
        vh = v if v.shape[2] == 1 else v[:, :, hs]
        s = jnp.where(mask, _scores(q[:, :, hs], kh, scale), NEG_INF)
        p = jax.nn.softmax(s, axis=-1)
        outs.append(_weighted_values(p, vh))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def attend_flash(q, k, v, q_pos, scale, kv_block: int):
    """Online-softmax attention over KV blocks (FlashAttention's recurrence), float32 accumulators."""
    B, T, H, _ = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    blk = min(kv_block, S)
    n_blocks = -(-S // blk)
    pad = n_blocks * blk - S
    if pad:
        k = jnp.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)])
        v = jnp.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)])
    kb = k.reshape(B, n_blocks, blk, *k.shape[2:]).swapaxes(0, 1)
    vb = v.reshape(B, n_blocks, blk, *v.shape[2:]).swapaxes(0, 1)

    def step(carry, xs):
        m, l, acc = carry
        kj, vj, j = xs
        kv_pos = j * blk + jnp.arange(blk)
        visible = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B,T,blk]
        if pad:  # the rows padding S to whole blocks are never visible (a query past the end would count them)
            visible = visible & (kv_pos < S)[None, None, :]
        visible = visible[:, None]  # [B,1,T,blk]
        s = jnp.where(visible, _scores(q, kj, scale), NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l_new = l * corr + p.sum(axis=-1)
        acc_new = acc * corr.transpose(0, 2, 1)[..., None] + _weighted_values(p, vj)
        return (m_new, l_new, acc_new), None

    init = (jnp.full((B, H, T), -1e30, jnp.float32), jnp.zeros((B, H, T), jnp.float32),
            jnp.zeros((B, T, H, Dv), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, jnp.arange(n_blocks)))
    return acc / l.transpose(0, 2, 1)[..., None]


def split_heads_kv(kv, k_rope, nope: int):
    """Standard attention's K and V from each head's k_nope | v, kv [B, S, H, nope + v], and the
    rope part k_rope [B, S, R] every head shares: K = k_nope ++ k_rope as float32 [B, S, H, nope +
    R], V = kv[..., nope:]. The -mla 0 cache entries and the XLA form of kernels.attention_kv."""
    B, S, H, _ = kv.shape
    R = k_rope.shape[-1]
    k = jnp.concatenate([kv[..., :nope].astype(jnp.float32),
                         jnp.broadcast_to(k_rope[:, :, None, :], (B, S, H, R)).astype(jnp.float32)], -1)
    return k, kv[..., nope:]


def attend(q, k, v, q_pos, scale, *, flash: bool, amb_bytes: int, kv_block: int):
    if flash:
        return attend_flash(q, k, v, q_pos, scale, kv_block)
    return attend_materialized(q, k, v, q_pos, scale, amb_bytes)
