"""KV caches: per-head K and V (mla=0) or one latent entry per token (mla=1/2/3).

Every cache tensor is stored as rows `[count, batch, capacity, width]`, one list entry per layer
group (ikjax.model.groups: a scanned run of `count` layers carries its stack, indexed by the
layer's place in it; a layer of its own has count 1), in the `-ctk` type: f32, f16, bf16, or q8_0 (ggml's block of 32 int8 with one f16 scale, quantized on
write; a width that is not a multiple of 32 ends with a zero-padded block). The latent entry is
`[c (kv_lora_rank) | k_pe (rope)]`: V is the first kv_lora_rank values of the same entry.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.gguf_io.config import ModelConfig
from ikjax.model.rope import inverse_frequencies
from ikjax.ops.rope import apply_rope

Q8_BLOCK = 32
_FLOAT_TYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


@dataclass(frozen=True)
class CacheLayout:
    """Shapes and type of a cache; hashable so it can be a static jit argument."""
    kind: str  # "kv" (mla=0) or "latent"
    ctk: str
    n_layer: int
    batch: int
    capacity: int
    widths: tuple[tuple[str, int], ...]  # ("k", H*qk), ("v", H*v)  or  ("latent", r+rope)
    groups: tuple[int, ...] = ()  # layers per group, in order (ikjax.model.groups); () = one per layer

    @property
    def group_counts(self) -> tuple[int, ...]:
        return self.groups or (1,) * self.n_layer

    @classmethod
    def for_model(cls, cfg: ModelConfig, mla: int, ctk: str, batch: int, capacity: int,
                  groups: tuple[int, ...] = ()) -> "CacheLayout":
        if groups and sum(groups) != cfg.n_layer:
            raise ValueError(f"cache layout: groups {groups} do not add up to {cfg.n_layer} layers")
        if mla == 0:
            widths = (("k", cfg.n_head * cfg.qk_dim), ("v", cfg.n_head * cfg.v_dim))
            return cls("kv", ctk, cfg.n_layer, batch, capacity, widths, tuple(groups))
        return cls("latent", ctk, cfg.n_layer, batch, capacity, (("latent", cfg.latent_dim),), tuple(groups))

    @staticmethod
    def bytes_per_value_row(ctk: str, width: int) -> int:
        if ctk == "q8_0":
            return -(-width // Q8_BLOCK) * (Q8_BLOCK + 2)
        return width * jnp.dtype(_FLOAT_TYPES[ctk]).itemsize

    def bytes_per_token(self) -> int:
        """Cache bytes one token costs over all layers (R1, f16 latent: 61 * 576 * 2 = 70,272)."""
        return self.n_layer * sum(self.bytes_per_value_row(self.ctk, w) for _, w in self.widths)

    def total_bytes(self) -> int:
        return self.bytes_per_token() * self.batch * self.capacity


def init_cache(layout: CacheLayout) -> dict:
    def one(n: int, width: int):
        B, S = layout.batch, layout.capacity
        if layout.ctk == "q8_0":
            nb = -(-width // Q8_BLOCK)
            return {"q": jnp.zeros((n, B, S, nb, Q8_BLOCK), jnp.int8), "d": jnp.zeros((n, B, S, nb), jnp.float16)}
        return jnp.zeros((n, B, S, width), _FLOAT_TYPES[layout.ctk])
    return {name: [one(n, w) for n in layout.group_counts] for name, w in layout.widths}


def quantize_q8_0(x: jax.Array) -> dict:
    """ggml's quantize_row_q8_0: d = amax/127 (stored f16), q = round(x / d) with the f32 d."""
    width = x.shape[-1]
    nb = -(-width // Q8_BLOCK)
    x = x.astype(jnp.float32)
    if nb * Q8_BLOCK != width:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * Q8_BLOCK - width)])
    blocks = x.reshape(*x.shape[:-1], nb, Q8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    d = amax / 127.0
    inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    scaled = blocks * inv[..., None]
    whole = jnp.trunc(scaled)  # C roundf: halves away from zero (jnp.round would go to even)
    q = whole + jnp.where(jnp.abs(scaled - whole) >= 0.5, jnp.sign(scaled), 0.0)
    return {"q": q.astype(jnp.int8), "d": d.astype(jnp.float16)}


def dequantize_q8_0(entry: dict, width: int, dtype) -> jax.Array:
    x = entry["q"].astype(jnp.float32) * entry["d"].astype(jnp.float32)[..., None]
    x = x.reshape(*x.shape[:-2], -1)[..., :width]
    return x.astype(dtype)


def write(stack, j, new: jax.Array, start: jax.Array):
    """Store new rows [B, T, width] at positions start[b] .. start[b]+T-1 of each sequence, in
    layer j of the group's stack [count, B, S, ...] (j an int, or the scan's traced index): only
    those rows are written, in place."""
    def put(buf, rows):
        # one dynamic_update_slice per sequence, at (j, b, start[b]): a vmap over the batch axis
        # made XLA keep the stack in a transposed layout and copy all of it at every scanned layer
        for b in range(rows.shape[0]):
            idx = (j, b, start[b]) + (0,) * (buf.ndim - 3)
            buf = jax.lax.dynamic_update_slice(buf, rows[b][None, None].astype(buf.dtype), idx)
        return buf
    if isinstance(stack, dict):
        q = quantize_q8_0(new)
        return {"q": put(stack["q"], q["q"]), "d": put(stack["d"], q["d"])}
    return put(stack, new)


def read(stack, j, length: int, width: int, dtype) -> jax.Array:
    """The first `length` rows of every sequence of layer j, as [B, length, width] in `dtype`."""
    def rows(a):
        if isinstance(j, int):
            return a[j, :, :length]
        return jax.lax.dynamic_slice(a, (j,) + (0,) * (a.ndim - 1), (1, a.shape[1], length) + a.shape[3:])[0]
    if isinstance(stack, dict):
        return dequantize_q8_0({k: rows(v) for k, v in stack.items()}, width, dtype)
    return rows(stack).astype(dtype)


def rope_columns(name: str, cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The column spans of cache `name`'s rows that hold roped keys: the latent entry's k_pe, each
    head's rope part of a per-head K row (mla 0); none in V."""
    if name == "latent":
        return ((cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.rope_dim),)
    if name == "k":
        return tuple((h * cfg.qk_dim + cfg.nope_dim, (h + 1) * cfg.qk_dim) for h in range(cfg.n_head))
    return ()


@functools.partial(jax.jit, static_argnames=("width", "spans"), donate_argnums=0)
def _shift_leaf(buf, b, keep, discard, cos, sin, *, width: int, spans: tuple):
    """Row b of a group's stack [count, B, S, ...] (float or q8_0 {"q", "d"}) with positions
    keep + discard .. moved down to keep .. and their roped spans turned back by `discard`
    positions; rows below `keep` as they were, the last `discard` rows copies nobody reads."""
    quant = isinstance(buf, dict)
    row = ({k: v[:, b] for k, v in buf.items()} if quant else buf[:, b])
    S = (row["q"] if quant else row).shape[1]
    idx = jnp.arange(S)
    moved = idx >= keep
    src = jnp.where(moved, jnp.minimum(idx + discard, S - 1), idx)
    x = dequantize_q8_0({k: v[:, src] for k, v in row.items()}, width, jnp.float32) if quant \
        else row[:, src].astype(jnp.float32)
    for lo, hi in spans:
        turned = apply_rope(x[..., lo:hi], cos, sin)
        x = x.at[..., lo:hi].set(jnp.where(moved[None, :, None], turned, x[..., lo:hi]))
    if quant:
        q = quantize_q8_0(x)
        return {k: buf[k].at[:, b].set(q[k]) for k in buf}
    return buf.at[:, b].set(x.astype(buf.dtype))


def shift_row(cache: dict, cfg: ModelConfig, b: int, keep: int, discard: int) -> dict:
    """llama-server's context shift on row b of a cache (donated; the new one returned): the
    entries of positions keep + discard, keep + discard + 1, ... now at keep, keep + 1, ..., their
    roped keys turned back by `discard` positions (RoPE is a rotation by position times each pair's
    frequency, YaRN's included: R(p - d) = R(-d) R(p)), so a sequence that outgrew its context goes
    on with its first `keep` tokens and the later part, as ik_llama.cpp's K-shift does. The c part of
    a latent entry and V carry no position and move as they are. Each group's stack where it lives
    (a -sm layer stage's device)."""
    angles = -float(discard) * inverse_frequencies(cfg)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    widths = {"latent": cfg.latent_dim, "k": cfg.n_head * cfg.qk_dim, "v": cfg.n_head * cfg.v_dim}
    out = {}
    for name, stacks in cache.items():
        spans = rope_columns(name, cfg)
        out[name] = [_shift_leaf(buf, np.int32(b), np.int32(keep), np.int32(discard), cos, sin, width=widths[name],
                                 spans=spans) for buf in stacks]
    return out


def host_nbytes(cache: dict) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
