"""Pallas (Triton) split-KV flash decoding on the MLA latent cache.

Grid (batch, head tiles of `bh`, KV splits). The sequence's length, read at run time, is cut
into `split` equal runs of `bs`-entry blocks; each program walks its own run (a dynamic loop
bound: splits past the length exit at once). Cutting the length, not the cache's capacity, keeps
every split busy at short context too (cutting the capacity left 2 of 8 programs working at
N_KV 1000 in a 4608-row cache: 30 us a layer, most of a decode step's attention time),
keeping the online-softmax state (m, l, acc [bh, 512]) in registers. K is the whole 576-wide entry
(scores = q_c·c + q_pe·k_pe, two tl.dot), V is its first 512 values: each cache block is loaded
once and used for both products. A q8_0 cache (32 int8 + one f16 scale per block, ikjax/model/cache.py)
is dequantized in registers. Splits are merged by a small log-sum-exp combine in XLA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash import online_softmax_step, tile_dot
from pallas_kernels.quant_matmul.kernel import _compiler_params, _pow2_divisor, chain_sum
from pallas_kernels.quant_matmul.packing import int8_to_f32

F32 = jnp.float32
NEG = -1e30


def _kernel(*refs, q8, bh, bs, split, dv, dpe, scale, cdt):
    if q8:
        len_ref, layer_ref, q_ref, cq_ref, cd_ref, o_ref, m_ref, l_ref = refs
    else:
        len_ref, layer_ref, q_ref, c_ref, o_ref, m_ref, l_ref = refs
    b, hi, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    li = layer_ref[0]  # which layer of the cache stack (a scanned layer group's index)
    h0 = hi * bh
    length = len_ref[b]
    n_all = (length + bs - 1) // bs                # blocks holding the sequence
    per = (n_all + split - 1) // split             # this split's run of blocks
    start = sp * per * bs
    n_blk = jnp.clip(n_all - sp * per, 0, per)
    qc = q_ref[b, pl.ds(h0, bh), pl.ds(0, dv)]
    qp = q_ref[b, pl.ds(h0, bh), pl.ds(dv, dpe)]
    nbv, nbp = dv // 32, dpe // 32

    def load(kv0):
        if q8:
            kc = int8_to_f32(cq_ref[li, b, pl.ds(kv0, bs), pl.ds(0, nbv), :]) * \
                cd_ref[li, b, pl.ds(kv0, bs), pl.ds(0, nbv)].astype(F32)[..., None]
            kp = int8_to_f32(cq_ref[li, b, pl.ds(kv0, bs), pl.ds(nbv, nbp), :]) * \
                cd_ref[li, b, pl.ds(kv0, bs), pl.ds(nbv, nbp)].astype(F32)[..., None]
            return kc.reshape(bs, dv).astype(cdt), kp.reshape(bs, dpe).astype(cdt)
        return (c_ref[li, b, pl.ds(kv0, bs), pl.ds(0, dv)].astype(cdt),
                c_ref[li, b, pl.ds(kv0, bs), pl.ds(dv, dpe)].astype(cdt))

    def body(j, carry):
        m, l, acc = carry
        kv0 = start + j * bs
        kc, kp = load(kv0)
        dn = ((1,), (1,))
        s = tile_dot(qc, kc, dn) + tile_dot(qp, kp, dn)
        s = s * scale
        pos = kv0 + lax.broadcasted_iota(jnp.int32, (bh, bs), 1)
        s = jnp.where(pos < length, s, NEG)
        return online_softmax_step(m, l, acc, s, kc, cdt)  # V: the entry's first 512 values

    init = (jnp.full((bh,), NEG, F32), jnp.zeros((bh,), F32), jnp.zeros((bh, dv), F32))
    m, l, acc = lax.fori_loop(0, n_blk, body, init)
    o_ref[b, sp, pl.ds(h0, bh), :] = acc
    m_ref[b, sp, pl.ds(h0, bh)] = m
    l_ref[b, sp, pl.ds(h0, bh)] = l


def pick_config(B: int, H: int, S: int, q8: bool = False, split_batch: int | None = None):
    """`split_batch`: size the KV split for this many sequences instead of B (1: every sequence cut
    as it is alone, so its partial sums, and its bits, do not depend on the batch)."""
    bh = _pow2_divisor(H, 16)
    bs = _pow2_divisor(S, 32 if q8 else 64)       # H100 sweep: bf16 cache 64 rows 31 us vs 32 rows 45 us
    n_blocks = S // bs
    tiles = (B if split_batch is None else split_batch) * (H // bh)
    # about one wave of programs (132 SMs) over the longest sequence, at most one block each;
    # every split writes a [bh, 512] f32 partial, so not more than that
    split = max(1, min(64, 132 // tiles, n_blocks))
    return dict(bh=bh, bs=bs, split=split, num_warps=8, num_stages=2)


def supports(H: int, S: int, D: int, v_dim: int) -> bool:
    return H % 16 == 0 and S % 16 == 0 and v_dim == 512 and D - v_dim in (32, 64, 128)


@functools.partial(jax.jit, static_argnames=("scale", "v_dim", "dtype", "config", "interpret"))
def _call(q, cache, lengths, layer, *, scale, v_dim, dtype, config, interpret):
    cfg = dict(config)
    B, H, D = q.shape
    q8 = isinstance(cache, dict)
    bh, bs, split = cfg["bh"], cfg["bs"], cfg["split"]
    kern = functools.partial(_kernel, q8=q8, bh=bh, bs=bs, split=split, dv=v_dim, dpe=D - v_dim,
                             scale=float(scale), cdt=jnp.dtype(dtype))
    args = [lengths.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), q.astype(dtype)]
    args += [cache["q"], cache["d"]] if q8 else [cache]
    o, m, l = pl.pallas_call(
        kern,
        out_shape=(jax.ShapeDtypeStruct((B, split, H, v_dim), F32),
                   jax.ShapeDtypeStruct((B, split, H), F32),
                   jax.ShapeDtypeStruct((B, split, H), F32)),
        grid=(B, H // bh, split),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(cfg["num_warps"], cfg["num_stages"]),
        name="mla_decode_q8" if q8 else "mla_decode",
    )(*args)
    if split == 1:
        return o[:, 0] / l[:, 0, :, None]
    mx = m.max(axis=1, keepdims=True)
    wgt = jnp.exp(m - mx)                                     # [B, split, H]
    # the splits added in order (f32), not a batched dot or a reduction, whose algorithm (and
    # order of additions) XLA picks by the whole shape, batch included (chain_sum)
    num = chain_sum(jnp.moveaxis(wgt[..., None] * o, 1, 0))
    return num / chain_sum(jnp.moveaxis(wgt * l, 1, 0))[..., None]


def mla_decode(q, cache, lengths, scale, *, v_dim: int = 512, dtype=jnp.bfloat16, interpret: bool = False,
               config: dict | None = None, layer=None, row_invariant: bool = False):
    """q [B, H, 576], cache [B, S, 576] f16/bf16/f32 or q8_0 {"q": int8 [B,S,18,32], "d": f16 [B,S,18]},
    lengths [B] int (entries 0..len-1 visible, len >= 1) -> [B, H, v_dim] float32. With `layer` (an
    int or traced int32 scalar: a scanned layer group's index) `cache` is a stack of layer caches
    [L, B, S, 576] (or q8_0 [L, ...]) and the kernel reads layer `layer` of it in place."""
    if layer is None:  # one layer: a stack of one (a reshape, no copy)
        cache, layer = jax.tree_util.tree_map(lambda a: a[None], cache), 0
    B, H, D = q.shape
    S = (cache["q"] if isinstance(cache, dict) else cache).shape[2]
    cfg = config or pick_config(B, H, S, isinstance(cache, dict), split_batch=1 if row_invariant else None)
    return _call(q, cache, lengths, jnp.asarray(layer, jnp.int32), scale=float(scale), v_dim=v_dim,
                 dtype=jnp.dtype(dtype), config=tuple(sorted(cfg.items())), interpret=interpret)
