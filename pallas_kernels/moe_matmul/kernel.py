"""Routed experts through the dequantizing Pallas matmul (quant_matmul.kernel):

- gather form (decode: few tokens): one program row per (token, expert) assignment, reading only
  the selected experts' blocks; gate and up in one pass with SiLU·mul fused (ik's -fmoe), then down.
- grouped form (prompt): assignments sorted by expert, each expert's rows padded to a multiple of
  the tile height `bm`, every m-tile multiplies by one expert's weights (tl.dot tiles).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe_matmul.reference import combine_slots, slot_rank
from pallas_kernels.quant_matmul.kernel import quant_matmul_experts
from pallas_kernels.quant_matmul.packing import PackedWeight


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "row_invariant"))
def moe_experts_gather(x, w, ids, gate: PackedWeight, up: PackedWeight, down: PackedWeight,
                       dtype=jnp.bfloat16, interpret: bool = False, layer=None, row_invariant: bool = False):
    """One tile per (token, expert) slot. `row_invariant`: the split-K sized for one token's k
    slots whatever N is, so each token's experts compute the bits they do for it alone."""
    N, k = ids.shape
    e = ids.reshape(-1).astype(jnp.int32)
    xa = jnp.repeat(x.astype(dtype), k, axis=0)                       # [N*k, d]
    split_rows = k if row_invariant else None
    h = quant_matmul_experts(xa, (gate, up), e, dtype, tile_rows=1, swiglu=True, interpret=interpret, layer=layer,
                             split_rows=split_rows)
    y = quant_matmul_experts(h.astype(dtype), (down,), e, dtype, tile_rows=1, interpret=interpret, layer=layer,
                             split_rows=split_rows)
    return combine_slots(y.reshape(N, k, -1), w)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "bm"))
def moe_experts_grouped(x, w, ids, gate: PackedWeight, up: PackedWeight, down: PackedWeight,
                        dtype=jnp.bfloat16, interpret: bool = False, bm: int = 64, layer=None):
    N, k = ids.shape
    E = gate.shape[0]
    A = N * k
    # slots with id -1 (weight 0) form a last group E whose tiles, like the padding tiles past
    # the groups, are dead (-1): the kernel skips them
    flat = jnp.where(ids.reshape(-1) < 0, E, ids.reshape(-1)).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    sizes = jnp.bincount(flat, length=E + 1).astype(jnp.int32)
    padded = (sizes + bm - 1) // bm * bm
    ends_p = jnp.cumsum(padded)
    starts_p = ends_p - padded
    starts = jnp.cumsum(sizes) - sizes
    dest = starts_p[sorted_e] + (jnp.arange(A, dtype=jnp.int32) - starts[sorted_e])
    n_tiles = -(-(A + (E + 1) * (bm - 1)) // bm)
    Mp = n_tiles * bm
    tok = order // k
    xp = jnp.zeros((Mp, x.shape[-1]), dtype).at[dest].set(x.astype(dtype)[tok])
    tile_e = jnp.searchsorted(ends_p, jnp.arange(n_tiles, dtype=jnp.int32) * bm, side="right")
    tile_e = jnp.where(tile_e >= E, -1, tile_e).astype(jnp.int32)
    h = quant_matmul_experts(xp, (gate, up), tile_e, dtype, tile_rows=bm, swiglu=True, interpret=interpret,
                             layer=layer)
    y = quant_matmul_experts(h.astype(dtype), (down,), tile_e, dtype, tile_rows=bm, interpret=interpret,
                             layer=layer)
    # back to token order by a gather, then each token's k outputs added in slot order: a
    # scatter-add (`.at[tok].add`) runs as atomics on a GPU, whose order changes from run to
    # run, so the same prompt would leave other KV bits in the cache on every run
    return combine_slots(y[dest[slot_rank(order)]].reshape(N, k, -1), w)


def moe_experts(x, w, ids, gate, up, down, dtype=jnp.bfloat16, *, interpret: bool = False, layer=None,
                row_invariant: bool = False):
    """x [N, d], w [N, k] f32, ids [N, k] -> [N, d] f32. Gather form while N*k <= 2*E (as the model).
    With `layer` (int32 scalar) the experts are stacks of layers' and that layer is read in place.

    A slot of weight 0 adds nothing: it is computed by no tile and reads no weights (-ser drops
    experts this way, and -sm graph zeroes the slots of experts another device holds)."""
    N, k = ids.shape
    E = gate.shape[0]
    ids = jnp.where(w != 0, ids, -1)
    if N * k <= 2 * E:
        return moe_experts_gather(x, w, ids, gate, up, down, dtype=jnp.dtype(dtype), interpret=interpret, layer=layer,
                                  row_invariant=row_invariant)
    return moe_experts_grouped(x, w, ids, gate, up, down, dtype=jnp.dtype(dtype), interpret=interpret, layer=layer,
                               bm=grouped_tile_rows(N * k, E))


def grouped_tile_rows(assignments: int, n_expert: int) -> int:
    """The grouped form's tile height: 16 rows where an expert gets at most 8 tokens on average (a short
    prompt step: V2-Lite's 64 tokens give 6), else 64. Why: each k-step of a tile loads its rows' x
    with the weights, and at a few live rows a tile of 64 loaded mostly padding: a 64-token step's
    experts ran at ~0.65 TB/s on an H200, 12.5 of its 50 ms (RESULTS §23ao)."""
    return 16 if assignments <= 8 * n_expert else 64
