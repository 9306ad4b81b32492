"""Pallas (Triton) quantized matmul: y = x @ W^T, W planar-packed GGUF blocks (packing.py),
dequantized in registers tile by tile; the dequantized weights never touch device memory.

Two schedules over one kernel body:
- "rows" (decode, 1-4 rows of x, bandwidth-bound GEMV): each program owns `bn` output columns and
  streams its weights once, multiply-accumulating every x row elementwise in float32 (no padding
  of x to a matrix-unit tile); optional split-K when there are too few column tiles to fill the GPU.
  Scales are factored out of the inner sums (sum w x = d * sum q x + bias * sum x), and the weights
  stay float32 (x is rounded to the compute dtype, as the reference): this is slightly *more* exact
  than the jnp reference, which rounds dequantized weights to bf16 (difference ~1e-3 relative).
- "dot" (5+ rows, prompt): `bm x bn` output tiles, `tl.dot` on compute-dtype tiles, f32 accumulation.

Both take an optional per-m-tile expert index: the weights then carry a leading expert axis and
each m-tile reads only its expert (the gather MoE form uses one row per tile, the grouped form
`bm` rows of tokens sorted by expert). `swiglu=True` takes two weights (gate, up) and writes
`silu(x W_g^T) * (x W_u^T)` (ik's fused `-fmoe`). The rows schedule also takes an RMSNorm folded
in (`quant_matmul_normed`: x times the norm's weight, the squares summed beside, 1/rms on the sum).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash import tile_dot

from .packing import GEOMETRY, PART_AXIS, PackedWeight, decode_part, decode_part_factored, x_view

F32 = jnp.float32
_SUPER_ARRAYS = ("d", "dmin")


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _compiler_params(num_warps, num_stages):
    try:
        from jax.experimental.pallas import triton as plgpu
        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except Exception:  # pragma: no cover
        return None


def _load_tiles(qtype: str, wrefs: dict, lead: tuple, n0, bn: int, t, ng: int, R: int, p: int,
                cache: dict | None = None):
    """Load part p's tiles: rows n0..n0+bn, groups t*ng..(t+1)*ng (the part axis indexed in the load).
    `cache` (one per weight and k-step) keeps tiles that several parts share (Q4_0's bytes hold both
    nibbles), so each byte is loaded once."""
    sel = PART_AXIS.get(qtype, {})
    out = {}
    for name, ref in wrefs.items():
        key = (name, sel[name](p) if name in sel else None)
        if cache is not None and key in cache:
            out[name] = cache[key]
            continue
        extra = len(ref.shape) - len(lead) - 2
        if R > 1 and name in _SUPER_ARRAYS:
            idx = (*lead, pl.ds(n0, bn), pl.ds(t * (ng // R), ng // R))
        else:
            rest = (slice(None),) * extra
            if name in sel:
                rest = (sel[name](p),) + rest[1:]
            idx = (*lead, pl.ds(n0, bn), pl.ds(t * ng, ng)) + rest
        out[name] = ref[idx]
        if cache is not None:
            cache[key] = out[name]
    return out


def _silu_mul(g, u):
    return g / (1.0 + jnp.exp(-g)) * u


def _kernel(*refs, qtype, names, n_w, has_expert, has_layer, mode, bm, bn, bk, nt, nt_all, n_out, cdt, swiglu,
            seq_rows=0, has_row_live=False, swap=False, has_norm=False):
    G, P, L, R = GEOMETRY[qtype]
    ng = bk // G
    it = iter(refs)
    x_ref = next(it)
    # has_norm (rows schedule): x is the RMSNorm's input; nw_ref [layers, K/G, P, L] its weights,
    # norm_layer_ref [1] which layer's; ss_ref [split, rows, 16] takes each row's sum of squares
    nw_ref = next(it) if has_norm else None
    norm_layer_ref = next(it) if has_norm else None
    e_ref = next(it) if has_expert else None
    layer_ref = next(it) if has_layer else None
    live_ref = next(it) if seq_rows else None
    row_live_ref = next(it) if has_row_live else None
    wrefs = [{n: next(it) for n in names} for _ in range(n_w)]
    o_ref = next(it)
    ss_ref = next(it) if has_norm else None
    # the rows schedule's grid is (row tiles, column tiles, splits): a column tile's programs for
    # every row are launched side by side (the fastest grid axis), so its weights come from memory
    # once and from L2 for the other rows; the dot schedule's (column tiles, row tiles[, splits])
    row_axis_first = mode == "rows" and ROWS_FIRST
    i, j = (pl.program_id(0), pl.program_id(1)) if row_axis_first else (pl.program_id(1), pl.program_id(0))
    n0, m0 = j * bn, i * bm
    # expert -1: a dead tile (a slot whose weight is 0, e.g. another device's expert under -sm
    # graph): its loop runs no iteration, reads no weights, and writes zeros
    alive = e_ref[i] >= 0 if has_expert else True
    if has_row_live and mode == "rows":  # one-row tiles: a dead row (an idle slot) runs no k-step and writes zeros
        alive = row_live_ref[i] != 0
    elif has_row_live:  # matrix-unit tiles: one of dead rows only runs no k-step
        row_mask = row_live_ref[pl.ds(m0, bm)] != 0
        alive = jnp.logical_and(alive, jnp.max(row_mask.astype(jnp.int32)) > 0)
    lead = (jnp.maximum(e_ref[i], 0),) if has_expert else ()
    if has_layer:  # a stack of layers' weights (a scanned layer group): this layer's, in place
        lead = (layer_ref[0],) + lead
    width = ng * L

    if mode == "rows":
        s = pl.program_id(2)

        def body(t, carry):
            accs, sss = carry
            new = [list(a) for a in accs]
            new_ss = list(sss)
            caches = [dict() for _ in range(n_w)]
            for p in range(P):
                # x rows rounded to the compute dtype as the reference does, then float32
                xs = [x_ref[m0 + r, pl.ds(t * ng, ng), p, :].astype(F32) for r in range(bm)]
                if has_norm:
                    # RMSNorm folded in: products of x * weight here, the rows' 1/rms applied to
                    # the summed partials (_call); each row's sum of squares on the side
                    nw = nw_ref[norm_layer_ref[0], pl.ds(t * ng, ng), p, :]
                    new_ss = [a + xr * xr for a, xr in zip(new_ss, xs)]
                    xs = [xr * nw for xr in xs]
                xs = [xr.astype(cdt).astype(F32) for xr in xs]
                for wi in range(n_w):
                    tiles = _load_tiles(qtype, wrefs[wi], lead, n0, bn, t, ng, R, p, caches[wi])
                    q, scale, bias, sub = decode_part_factored(qtype, tiles, p)
                    for r in range(bm):
                        xr = xs[r]
                        if sub:
                            prod = jnp.sum(q.reshape(bn, ng, 2, L // 2) * xr.reshape(1, ng, 2, L // 2), axis=3)
                            xsum = jnp.sum(xr.reshape(ng, 2, L // 2), axis=2)[None]
                            c = jnp.sum(scale * prod + bias * xsum, axis=2)
                        else:
                            c = jnp.sum(q * xr[None], axis=2)
                            if scale is not None:
                                c = c * scale
                            if bias is not None:
                                c = c + bias * jnp.sum(xr, axis=1)[None]
                        new[wi][r] = new[wi][r] + c
            return tuple(tuple(a) for a in new), tuple(new_ss)

        init = tuple(tuple(jnp.zeros((bn, ng), F32) for _ in range(bm)) for _ in range(n_w))
        ss0 = tuple(jnp.zeros((ng, L), F32) for _ in range(bm)) if has_norm else ()
        lo = s * nt
        end = jnp.minimum(lo + nt, nt_all)  # the last split may have fewer k-steps
        hi = jnp.where(alive, end, lo).astype(lo.dtype) if has_expert or has_row_live else end
        accs, sss = lax.fori_loop(lo, hi, body, (init, ss0))
        if has_norm:
            @pl.when(j == 0)  # every column tile sums the same squares: the first one writes them
            def _():
                for r in range(bm):
                    ss_ref[s, m0 + r, :] = jnp.broadcast_to(jnp.sum(sss[r]), (16,))
        for r in range(bm):
            ys = [jnp.sum(accs[wi][r], axis=1) for wi in range(n_w)]
            if swiglu and nt < nt_all:  # split-K: gate and up partial sums side by side, SiLU after the sum
                o_ref[s, m0 + r, pl.ds(n0, bn)] = ys[0]
                o_ref[s, m0 + r, pl.ds(n_out + n0, bn)] = ys[1]
            else:
                o_ref[s, m0 + r, pl.ds(n0, bn)] = _silu_mul(ys[0], ys[1]) if swiglu else ys[0]
        return

    def body(t, accs):
        xs = [x_ref[pl.ds(m0, bm), pl.ds(t * ng, ng), p, :].reshape(bm, width) for p in range(P)]
        new = []
        for wi in range(n_w):
            acc = accs[wi]
            cache = {}
            for p in range(P):
                tiles = _load_tiles(qtype, wrefs[wi], lead, n0, bn, t, ng, R, p, cache)
                w = decode_part(qtype, tiles, p).reshape(bn, width).astype(cdt)
                if swap:  # the decoded weight as the matrix unit's first operand: [bn, bm]
                    acc = acc + tile_dot(w, xs[p], ((1,), (1,)))
                else:
                    acc = acc + tile_dot(xs[p], w, ((1,), (1,)))
            new.append(acc)
        return tuple(new)

    init = tuple(jnp.zeros((bn, bm) if swap else (bm, bn), F32) for _ in range(n_w))
    rows_first = (lambda a: a.T) if swap else (lambda a: a)  # accumulators as [bm, bn]
    if seq_rows:
        # rows at or past the live count of their sequence (x is [sequences x seq_rows] rows, a
        # tile never straddles two): neither computed nor written, their output left as it was
        @pl.when((m0 % seq_rows) < live_ref[0])
        def _():
            accs = lax.fori_loop(0, nt, body, init)
            o_ref[0, pl.ds(m0, bm), pl.ds(n0, bn)] = rows_first(accs[0]).astype(o_ref.dtype)
        return
    if nt == nt_all and not has_row_live:
        # both bounds of one integer type (Triton's scf.for requires it)
        hi = jnp.where(alive, jnp.int32(nt), jnp.int32(0)) if has_expert else nt
        accs = tuple(rows_first(a) for a in lax.fori_loop(jnp.int32(0) if has_expert else 0, hi, body, init))
        y = _silu_mul(accs[0], accs[1]) if swiglu else accs[0]
        o_ref[0, pl.ds(m0, bm), pl.ds(n0, bn)] = y
        return
    # split-K (the batch-invariant decode schedule, invariant_config) and/or live rows: this
    # program's k-steps, partial sums out, added in order by chain_sum; a tile of dead rows (or a
    # dead expert) runs none
    s = pl.program_id(2)
    lo = s * nt
    end = jnp.minimum(lo + nt, nt_all)
    hi = jnp.where(alive, end, lo).astype(lo.dtype) if has_expert or has_row_live else end
    accs = tuple(rows_first(a) for a in lax.fori_loop(lo, hi, body, init))
    if has_row_live:  # a dead row (an idle slot) beside live ones: computed, written as zeros
        accs = tuple(jnp.where(row_mask[:, None], a, 0.0) for a in accs)

    if swiglu and nt < nt_all:  # gate and up partial sums side by side, SiLU after the sum
        o_ref[s, pl.ds(m0, bm), pl.ds(n0, bn)] = accs[0]
        o_ref[s, pl.ds(m0, bm), pl.ds(n_out + n0, bn)] = accs[1]
    else:
        o_ref[s, pl.ds(m0, bm), pl.ds(n0, bn)] = _silu_mul(accs[0], accs[1]) if swiglu else accs[0]


def _split_k(tiles: int, nt_all: int) -> int:
    """Split-K for `tiles` output tiles of `nt_all` k-steps: until about 4 waves of programs, each
    with >= 2 k-steps. The splits need not divide the k-steps evenly (a down projection's K is
    often 11 * 2^n: with even splits only, V2-Lite's 2048 x 10944 ran on 64 programs, 143 us for
    12.6 MB)."""
    split = 1
    while tiles * split < 528 and -(-nt_all // (split * 2)) >= 2:
        split *= 2
    return -(-nt_all // -(-nt_all // split))  # no empty split


def pick_config(qtype: str, M: int, N: int, K: int, *, rows_max: int = 4, tile_rows: int | None = None,
                split_rows: int | None = None):
    """Static schedule for one call (mode, bm, bn, bk, split, warps, stages).

    `split_rows` (rows mode): size the split-K for this many rows instead of M. With `tile_rows=1`
    every row is then computed by the same program, with the same k-order and the same partial
    sums, whatever M is: a batch's decode step gives each sequence the bits it gets alone
    (`ikjax.ops.registry.batch_invariant`)."""
    G, P, L, R = GEOMETRY[qtype]
    kmin = G * R
    if tile_rows is not None and tile_rows <= rows_max or tile_rows is None and M <= rows_max:
        bm = tile_rows or M
        # each x row keeps a float32 accumulator tile [bn, width] in registers: <= 32 values a thread
        budget = 4096 // bm
        width_target = max(16, budget // 32)
        bk = max(kmin, _pow2_divisor(K, P * width_target))
        width = bk // P
        bn = max(1, min(_pow2_divisor(N, 32), _pow2_floor(max(1, budget // width))))
        tiles = N // bn * max(1, (M if split_rows is None else split_rows) // bm)
        return dict(mode="rows", bm=bm, bn=bn, bk=bk, split=_split_k(tiles, K // bk), num_warps=4, num_stages=3)
    bm = tile_rows or (16 if M <= 16 else 64 if M <= 128 else 128)
    wide = bm >= 128 and qtype not in ("F32", "F16", "BF16")     # float tiles: 256 wide overflows smem
    bn = _pow2_divisor(N, 64 if M <= 16 else 256 if wide else 128)
    bk = max(kmin, _pow2_divisor(K, 128))
    warps = 8 if bm * bn >= 128 * 128 else 4
    return dict(mode="dot", bm=bm, bn=bn, bk=bk, split=1, num_warps=warps, num_stages=3 if bk <= 128 else 2)


# The rows schedule's launch order: the row tiles the fastest grid axis (`_call`). False: the column
# tiles fastest, the order before RESULTS §23ao (bench scripts set it, before anything compiles, to
# measure the two side by side).
ROWS_FIRST = True

# The batch-invariant decode schedule's tile height: every row count pads to tiles of this many
# rows (the matrix unit's smallest), so a row's instructions never depend on how many came with it.
INVARIANT_BM = 16


def invariant_config(qtype: str, N: int, K: int, *, split_rows: int = 1):
    """The batch-invariant decode schedule: `tl.dot` tiles of INVARIANT_BM rows, tile, k-steps and
    split-K from (N, K) alone, split sized as if `split_rows` one-row tiles shared the columns
    (an MoE token's k slots, a row's heads). Each row's result is a fixed sequence of matrix-unit
    products and in-order adds, whatever the other rows hold and however many there are: a batch's
    row gets the bits it gets alone, and eight rows cost one weight decode, not eight (the one-row
    rows schedule paid per row in arithmetic: RESULTS §23k). The decoded weight tile is the
    product's first operand ([bn, bk] x [bk, rows], `swap`), the rows' tile the second: the same
    per-row independence, 5-12 % faster than the other order on V2-Lite's matrices at 1 and 8 rows
    (H200, RESULTS §23aa)."""
    G, P, L, R = GEOMETRY[qtype]
    bk = max(G * R, _pow2_divisor(K, 128))
    bn = _pow2_divisor(N, 64)
    split = _split_k(N // bn * max(1, split_rows), K // bk)
    return dict(mode="dot", bm=INVARIANT_BM, bn=bn, bk=bk, split=split, num_warps=4, num_stages=3 if bk <= 128 else 2,
                swap=True)


def invariant_dot(qtype: str, dtype) -> bool:
    """Whether the batch-invariant decode takes the matrix-unit schedule (invariant_config): not in
    f32 compute (no TF32 there) nor for f32 weights (the router, whose logits stay f32)."""
    return jnp.dtype(dtype) != F32 and qtype != "F32"


def chain_sum(parts):
    """parts[0] + parts[1] + ... in that order (elementwise, f32): the split-K partial sums added
    the same way whatever the other dims are. A reduction over the leading axis would be XLA's
    column reduction, whose tiling (and so its order of additions) follows the whole shape: a
    row's result would then depend on how many rows came with it."""
    y = parts[0]
    for i in range(1, parts.shape[0]):
        y = y + parts[i]
    return y


def kernel_supports(qtype: str, N: int, K: int) -> bool:
    if qtype not in GEOMETRY:
        return False
    G, P, L, R = GEOMETRY[qtype]
    return K % (G * R) == 0 and N % 16 == 0


@functools.partial(jax.jit, static_argnames=("dtype", "swiglu", "config", "interpret", "seq_rows", "out_dtype",
                                             "norm_eps"))
def _call(x, ws, expert, layer, live=None, row_live=None, norm=None, *, dtype, swiglu, config, interpret, seq_rows=0,
          out_dtype=F32, norm_eps=None):
    cfg = dict(config)
    w0: PackedWeight = ws[0]
    qtype = w0.qtype
    N, K = w0.shape[-2], w0.shape[-1]
    M = x.shape[0]
    mode, bm, bn, bk, split = cfg["mode"], cfg["bm"], cfg["bn"], cfg["bk"], cfg["split"]
    Mp = -(-M // bm) * bm
    xc = x.astype(dtype) if mode == "dot" else x
    if Mp != M:
        xc = jnp.pad(xc, ((0, Mp - M), (0, 0)))
    xv = x_view(xc, qtype)
    names = tuple(sorted(w0.arrays))
    args = [xv]
    has_norm = norm is not None
    if has_norm:
        if mode != "rows" or swiglu or expert is not None or seq_rows:
            raise ValueError(f"a folded RMSNorm needs the plain rows schedule, got {mode}")
        nw, norm_layer = norm  # [layers, K] float32, int32 scalar
        args += [x_view(nw.astype(F32), qtype), jnp.reshape(norm_layer, (1,)).astype(jnp.int32)]
    has_expert = expert is not None
    if has_expert:
        e = expert.astype(jnp.int32)
        if e.shape[0] * bm != Mp:
            raise ValueError(f"expert index has {e.shape[0]} tiles for {Mp} rows of {bm}")
        args.append(e)
    has_layer = layer is not None
    if has_layer:
        args.append(jnp.reshape(layer, (1,)).astype(jnp.int32))
    if seq_rows:
        if mode != "dot" or has_expert or swiglu or M % seq_rows or seq_rows % bm:
            raise ValueError(f"live rows need the dot schedule over whole sequences of {seq_rows} rows in tiles "
                             f"of {bm}, got {mode} over {M} rows")
        args.append(jnp.reshape(live, (1,)).astype(jnp.int32))
    has_row_live = row_live is not None
    if has_row_live:
        if (mode == "rows" and (bm != 1 or has_expert)) or seq_rows or row_live.shape[0] != M:
            raise ValueError(f"live rows need one-row tiles of the rows schedule or the dot schedule over {M} rows, "
                             f"got {mode} with bm {bm} over {row_live.shape[0]}")
        args.append(jnp.pad(row_live.astype(jnp.int32), (0, Mp - M)))
    for w in ws:
        args += [w.arrays[n] for n in names]
    nt = -(-(K // bk) // split)
    # rows: each column tile's programs for all rows launched together (its weights read once from
    # memory, the other rows' reads from L2); a program computes what it did before, so every row
    # keeps its bits. The 8-row decode step's GPU time 9.25 -> 9.00 ms on an H200 (RESULTS §23ao):
    # what 8 rows cost beyond one is each row's program decoding the same tile, not the reads
    grid = (Mp // bm, N // bn, split) if mode == "rows" and ROWS_FIRST else \
        (N // bn, Mp // bm, split) if mode == "rows" or split > 1 or has_row_live else (N // bn, Mp // bm)
    kern = functools.partial(_kernel, qtype=qtype, names=names, n_w=len(ws), has_expert=has_expert, has_layer=has_layer,
                             mode=mode, bm=bm, bn=bn, bk=bk, nt=nt, nt_all=K // bk, n_out=N, cdt=jnp.dtype(dtype),
                             swiglu=swiglu, seq_rows=seq_rows, has_row_live=has_row_live,
                             swap=bool(cfg.get("swap", False)), has_norm=has_norm)
    late = swiglu and nt < K // bk  # split-K SwiGLU: the kernel writes [gate | up] partial sums
    out_shape = jax.ShapeDtypeStruct((split, Mp, 2 * N if late else N), out_dtype)
    if has_norm:
        out_shape = (out_shape, jax.ShapeDtypeStruct((split, Mp, 16), F32))
    out = pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=grid,
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(cfg["num_warps"], cfg["num_stages"]),
        name=f"quant_matmul_{qtype.lower()}_{mode}{'_normed' if has_norm else ''}",
    )(*args)
    if has_norm:
        # the rows' 1/rms, as the reference's x * rsqrt(mean(x^2) + eps), on the summed partials
        # (x * weight was rounded to the compute dtype in its place): one fusion with the sum
        out, ss = out
        inv = lax.rsqrt(chain_sum(ss)[:, :1] / K + norm_eps)
        return (chain_sum(out) * inv)[:M]
    y = chain_sum(out)
    if late:
        y = _silu_mul(y[:, :N], y[:, N:])
    return y[:M] if Mp != M else y


def quant_matmul(x, w: PackedWeight, dtype=jnp.bfloat16, *, interpret: bool = False, config: dict | None = None,
                 layer=None, row_invariant: bool = False, live_rows=None, matrix_unit: bool = False):
    """x [..., K] @ W[N, K]^T -> [..., N] float32 (W a PackedWeight without expert axis; with `layer`,
    an int32 scalar, W's arrays are a stack of layers' [L, ...] and layer `layer` is read in place).
    `row_invariant`: every row computed by the program a single row gets (one-row tiles, the
    one-row split), so each row's result is the same whatever the row count (see pick_config);
    with `matrix_unit`, by the matrix-unit schedule of invariant_config instead.
    `live_rows` (with row_invariant; [rows] int, nonzero = live): the other rows are not computed
    (zeros): a server's idle slots."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    N, K = w.shape[-2], w.shape[-1]
    if row_invariant and matrix_unit and invariant_dot(w.qtype, dtype):
        cfg = config or invariant_config(w.qtype, N, K)
    elif row_invariant:
        cfg = config or pick_config(w.qtype, x2.shape[0], N, K, rows_max=1, tile_rows=1, split_rows=1)
    else:
        cfg = config or pick_config(w.qtype, x2.shape[0], N, K)
    if live_rows is not None and not row_invariant:
        live_rows = None
    y = _call(x2, (w,), None, layer, None, live_rows, dtype=jnp.dtype(dtype), swiglu=False,
              config=tuple(sorted(cfg.items())), interpret=interpret)
    return y.reshape(*lead, N)


def quant_matmul_normed(x, norm_weight, eps: float, w: PackedWeight, dtype=jnp.bfloat16, *, interpret: bool = False,
                        layer=None, norm_layer=None, config: dict | None = None, row_invariant: bool = False,
                        live_rows=None):
    """RMSNorm(x) @ W[N, K]^T -> [..., N] float32, the norm folded into the decode schedule: the
    kernel multiplies x by the norm's weight where it rounds x to the compute dtype, sums each
    row's squares beside its products, and the rows' 1/rms scales the summed result
    (linear(rms_norm(x)) = rsqrt(mean(x^2) + eps) * (W (weight * x))). Why: a decode token's norms
    were two XLA kernels each (the sum of squares, then the scaled copy the product reads), ~1.5 us
    of launch a kernel at one row; folded, the norm costs one multiply-add per x element.
    `norm_weight` [K] float, or a stack [layers, K] read at `norm_layer` in place (a scanned
    group's, as `layer` is W's). Rows schedule only (<= 4 rows; pick_config).
    `row_invariant` (and `live_rows`, as quant_matmul's): the batch-invariant decode's one-row
    programs, for any row count: a row's products, its sum of squares (one split's, in the
    split's k order) and its scale depend on that row alone, so it gets the bits it gets alone."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    N, K = w.shape[-2], w.shape[-1]
    if row_invariant:
        cfg = config or pick_config(w.qtype, x2.shape[0], N, K, rows_max=1, tile_rows=1, split_rows=1)
    else:
        cfg = config or pick_config(w.qtype, x2.shape[0], N, K)
        live_rows = None
    if cfg["mode"] != "rows":
        raise ValueError(f"a folded RMSNorm needs the rows schedule (<= 4 rows), got {x2.shape[0]} rows")
    nw = norm_weight.reshape(-1, K)
    nl = jnp.int32(0) if norm_layer is None else norm_layer
    y = _call(x2, (w,), None, layer, None, live_rows, (nw, nl), dtype=jnp.dtype(dtype), swiglu=False,
              config=tuple(sorted(cfg.items())), interpret=interpret, norm_eps=float(eps))
    return y.reshape(*lead, N)


def quant_matmul_live(x, w: PackedWeight, live, dtype=jnp.bfloat16, *, interpret: bool = False, layer=None,
                      config: dict | None = None):
    """x [B, S, K] @ W[N, K]^T -> [B, S, N] in `dtype`, computed only for each sequence's rows
    0 .. live - 1 (live: an int32 scalar known when the step runs); the other rows are neither
    computed nor written (their values are unspecified: callers read live rows only).

    Why: a prompt step that expands the latent cache by kv_b (-mla 2/3) over a static number of
    rows pays for every row of it. With this bound one step serves every depth of the cache at the
    cost of the rows in use: one compiled prompt step instead of one per KV bucket (issue 22), the
    rows past the context neither read nor written."""
    B, S, K = x.shape
    N = w.shape[-2]
    cfg = dict(config or pick_config(w.qtype, B * S, N, K))
    if cfg["mode"] != "dot":
        cfg = pick_config(w.qtype, max(B * S, 128), N, K)
    while S % cfg["bm"]:
        cfg["bm"] //= 2
    y = _call(x.reshape(B * S, K), (w,), None, layer, jnp.asarray(live, jnp.int32), dtype=jnp.dtype(dtype),
              swiglu=False, config=tuple(sorted(cfg.items())), interpret=interpret, seq_rows=S,
              out_dtype=jnp.dtype(dtype))
    return y.reshape(B, S, N)


def quant_matmul_experts(x, ws, expert, dtype=jnp.bfloat16, *, tile_rows: int = 1, swiglu: bool = False,
                         interpret: bool = False, config: dict | None = None, layer=None,
                         split_rows: int | None = None, live_rows=None):
    """Rows of x [M, K], M = len(expert) * tile_rows; tile i multiplies by expert[i]'s weight
    (PackedWeight [E, N, K]); expert -1 marks a dead tile (zeros, no weight read). `ws` = (w,) or,
    with swiglu, (gate, up). -> [M, N] float32. `config`="invariant": the batch-invariant
    decode schedule (invariant_config, tiles of INVARIANT_BM rows, split for `split_rows`), where
    `live_rows` ([M] int, nonzero = live) marks rows whose output is kept (the others zeros)."""
    w0 = ws[0]
    N, K = w0.shape[-2], w0.shape[-1]
    if config == "invariant":
        cfg = invariant_config(w0.qtype, N, K, split_rows=split_rows or 1)
        if tile_rows != cfg["bm"]:
            raise ValueError(f"the invariant schedule takes tiles of {cfg['bm']} rows, got {tile_rows}")
    else:
        cfg = config or pick_config(w0.qtype, x.shape[0], N, K, tile_rows=tile_rows, split_rows=split_rows)
        live_rows = None
        if swiglu and cfg["mode"] != "rows":
            cfg = dict(cfg, split=1)
    return _call(x, tuple(ws), expert, layer, None, live_rows, dtype=jnp.dtype(dtype), swiglu=swiglu,
                 config=tuple(sorted(cfg.items())), interpret=interpret)
