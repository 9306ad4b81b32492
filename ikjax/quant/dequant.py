"""Vectorized, jit-able dequantization of GGML blocks in pure jax.numpy.

`dequantize(raw, qtype, n_per_row)` takes the bytes of a tensor exactly as they lie in the GGUF file,
shaped `[..., rows, qtype.row_bytes(n_per_row)]` (uint8), and returns `[..., rows, n_per_row]`.

Standard types are bit-exact against `gguf.quants.dequantize`: every value is computed in float32
with the same operations in the same order (f16 scales widened exactly, products formed before the
subtraction/addition), then cast to the requested dtype.

Each per-type decoder receives blocks `[..., nblocks, block_bytes]` (uint8) and returns
`[..., nblocks, block_elems]` float32; row metadata (ik's per-row scales) is passed separately.
Decoders for ik_llama.cpp's own types live in `ikjax.quant.ik_types` and register themselves with
`register_decoder`.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import quants as gguf_quants
from jax import lax

from .types import QuantType, UnsupportedQuantType

F32 = jnp.float32

# ---------------------------------------------------------------------------------------------
# byte helpers


def u8(x):
    return x.astype(jnp.uint8)


# Scalars inside a block are assembled from their bytes with shifts, then bitcast at the same
# width: elementwise, so XLA fuses the read into the op that uses it. A bitcast of u8[..., 2] to
# f16 changes the rank and stays a kernel of its own (on the GPU, one per scale field per matrix
# per step: 54 of the 727 launches of a V2-Lite decode step, RESULTS §13).

def u16_at(b, off: int):
    """Little-endian u16 at byte offset `off` of the last axis."""
    return b[..., off].astype(jnp.uint16) | (b[..., off + 1].astype(jnp.uint16) << 8)


def u32_at(b, off: int):
    return (b[..., off].astype(jnp.uint32) | (b[..., off + 1].astype(jnp.uint32) << 8)
            | (b[..., off + 2].astype(jnp.uint32) << 16) | (b[..., off + 3].astype(jnp.uint32) << 24))


def f16_at(b, off: int):
    """Little-endian f16 at byte offset `off` of the last axis, widened (exactly) to f32."""
    return lax.bitcast_convert_type(u16_at(b, off), jnp.float16).astype(F32)


def f32_at(b, off: int):
    return lax.bitcast_convert_type(u32_at(b, off), jnp.float32)


def f16_array(b, off: int, n: int):
    """n consecutive f16 values starting at `off` -> [..., n] f32."""
    x = b[..., off:off + 2 * n].reshape(*b.shape[:-1], n, 2)
    return lax.bitcast_convert_type(x, jnp.float16).astype(F32)


def nibbles(qs):
    """[..., m] bytes -> [..., 2, m]: low nibbles then high nibbles."""
    return jnp.stack([qs & 0xF, qs >> 4], axis=-2)


def bits_of(x, nbits: int):
    """Unsigned integer [...] -> [..., nbits] of its bits (LSB first), same dtype."""
    shifts = jnp.arange(nbits, dtype=x.dtype)
    return (x[..., None] >> shifts) & 1


def crumbs(qs, n: int = 4):
    """[..., m] bytes -> [..., 4, m]: 2-bit fields at shifts 0,2,4,6."""
    shifts = jnp.array([0, 2, 4, 6], dtype=jnp.uint8)[:n]
    return (qs[..., None, :] >> shifts[:, None]) & 3


def lookup(table: np.ndarray, idx):
    """Constant table lookup (table values exact in f32)."""
    return jnp.asarray(table, dtype=F32)[idx.astype(jnp.int32)]


def lookup2(table: np.ndarray, idx):
    """Row lookup in a constant 2-D table: idx [...] -> [..., table.shape[1]]."""
    return jnp.asarray(table, dtype=F32)[idx.astype(jnp.int32)]


def _d_scale_1(blocks):
    return f16_at(blocks, 0)[..., None]


# ---------------------------------------------------------------------------------------------
# standard types


def _f32(b, meta):
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 4), jnp.float32)


def _f16(b, meta):
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 2), jnp.float16).astype(F32)


def _bf16(b, meta):
    h = lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 2), jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(h << 16, jnp.float32)


def _q4_0(b, meta):
    d = _d_scale_1(b)
    q = nibbles(b[..., 2:18]).reshape(*b.shape[:-1], 32).astype(jnp.int32) - 8
    return d * q.astype(F32)


def _q4_1(b, meta):
    d = _d_scale_1(b)
    m = f16_at(b, 2)[..., None]
    q = nibbles(b[..., 4:20]).reshape(*b.shape[:-1], 32).astype(F32)
    return d * q + m


def _q5_hi(qh_u32):
    return bits_of(qh_u32, 32).astype(jnp.uint8)


def _q5_0(b, meta):
    d = _d_scale_1(b)
    qh = _q5_hi(u32_at(b, 2))
    ql = nibbles(b[..., 6:22]).reshape(*b.shape[:-1], 32)
    q = (ql | (qh << 4)).astype(jnp.int32) - 16
    return d * q.astype(F32)


def _q5_1(b, meta):
    d = _d_scale_1(b)
    m = f16_at(b, 2)[..., None]
    qh = _q5_hi(u32_at(b, 4))
    ql = nibbles(b[..., 8:24]).reshape(*b.shape[:-1], 32)
    q = (ql | (qh << 4)).astype(F32)
    return d * q + m


def _q8_0(b, meta):
    d = _d_scale_1(b)
    x = lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(F32)
    return x * d


def _q2_k(b, meta):
    lead = b.shape[:-1]
    scales = b[..., 0:16]
    qs = b[..., 16:80]
    d = f16_at(b, 80)[..., None]
    dmin = f16_at(b, 82)[..., None]
    dl = (d * (scales & 0xF).astype(F32))[..., None]          # [..., 16, 1]
    ml = (dmin * (scales >> 4).astype(F32))[..., None]
    q = crumbs(qs.reshape(*lead, 2, 32))                       # [..., 2, 4, 32]
    q = q.reshape(*lead, 16, 16).astype(F32)
    return (dl * q - ml).reshape(*lead, 256)


def _q3_k(b, meta):
    lead = b.shape[:-1]
    hmask = b[..., 0:32]
    qs = b[..., 32:96]
    sc = b[..., 96:108]
    d = f16_at(b, 108)[..., None]
    lsc = nibbles(sc[..., 0:8]).reshape(*lead, 16)
    hsc = crumbs(sc[..., 8:12]).reshape(*lead, 16)
    scales = ((lsc & 0xF) | (hsc << 4)).astype(jnp.int32) - 32
    dl = (d * scales.astype(F32))[..., None]                   # [..., 16, 1]
    ql = crumbs(qs.reshape(*lead, 2, 32)).reshape(*lead, 16, 16)
    qh = ((hmask[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1).reshape(*lead, 16, 16)
    q = ql.astype(jnp.int32) - ((qh ^ 1).astype(jnp.int32) << 2)
    return (dl * q.astype(F32)).reshape(*lead, 256)


def k_scale_min(sc):
    """The 12 packed bytes of Q4_K/Q5_K scales -> (scales[..., 8], mins[..., 8]) as uint8."""
    d_, m_, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    s = jnp.concatenate([d_ & 0x3F, (md & 0x0F) | ((d_ >> 2) & 0x30)], axis=-1)
    m = jnp.concatenate([m_ & 0x3F, (md >> 4) | ((m_ >> 2) & 0x30)], axis=-1)
    return s, m


def _q4_k(b, meta):
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    dmin = f16_at(b, 2)[..., None]
    s, m = k_scale_min(b[..., 4:16])
    dl = (d * s.astype(F32))[..., None]
    ml = (dmin * m.astype(F32))[..., None]
    q = nibbles(b[..., 16:144].reshape(*lead, 4, 32)).reshape(*lead, 8, 32).astype(F32)
    return (dl * q - ml).reshape(*lead, 256)


def _q5_k(b, meta):
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    dmin = f16_at(b, 2)[..., None]
    s, m = k_scale_min(b[..., 4:16])
    dl = (d * s.astype(F32))[..., None]
    ml = (dmin * m.astype(F32))[..., None]
    qh = b[..., 16:48]
    ql = nibbles(b[..., 48:176].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)
    qh = ((qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1)   # [..., 8, 32]
    q = (ql | (qh << 4)).astype(F32)
    return (dl * q - ml).reshape(*lead, 256)


def _q6_k(b, meta):
    lead = b.shape[:-1]
    ql = b[..., 0:128]
    qh = b[..., 128:192]
    scales = lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(F32)
    d = f16_at(b, 208)[..., None]
    dl = (d * scales)[..., None]                                # [..., 16, 1]
    lo = nibbles(ql.reshape(*lead, 2, 64)).reshape(*lead, 8, 32)
    hi = crumbs(qh.reshape(*lead, 2, 32)).reshape(*lead, 8, 32)
    q = (lo | (hi << 4)).astype(jnp.int32) - 32
    q = q.reshape(*lead, 16, 16).astype(F32)
    return (dl * q).reshape(*lead, 256)


IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=np.float32)


def _iq4_nl(b, meta):
    d = _d_scale_1(b)
    q = nibbles(b[..., 2:18]).reshape(*b.shape[:-1], 32)
    return d * lookup(IQ4NL_VALUES, q)


def _iq4_xs(b, meta):
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    sh = u16_at(b, 2)
    sl = nibbles(b[..., 4:8])                                   # [..., 2, 4]
    sl = jnp.swapaxes(sl, -1, -2).reshape(*lead, 8)             # low, high of byte 0, then byte 1...
    shv = ((sh[..., None] >> (2 * jnp.arange(8, dtype=jnp.uint16))) & 3).astype(jnp.uint8)
    scales = (sl | (shv << 4)).astype(jnp.int32) - 32
    dl = (d * scales.astype(F32))[..., None]                    # [..., 8, 1]
    q = nibbles(b[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 8, 32)
    return (dl * lookup(IQ4NL_VALUES, q)).reshape(*lead, 256)


# ---------------------------------------------------------------------------------------------
# ggml's grid-based i-quants (IQ2_XXS ... IQ1_M) and the ternary TQ types.
# Grids and the sign table are taken from the `gguf` package (library data, not retyped here);
# arithmetic follows `gguf.quants` operation by operation so results are bit-identical.


def _gguf_grid(name: str) -> np.ndarray:
    """The unpacked value grid of a gguf i-quant class: [n_entries, entry_len] float32."""
    cls = getattr(gguf_quants, name)
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)


def _sign_table() -> np.ndarray:
    """ksigns: 7 stored sign bits -> 8 signs (the 8th is the parity), as +-1.0: [128, 8]."""
    ks = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)
    bits = (ks[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, 1.0, -1.0).astype(np.float32)


IQ2XXS_GRID = _gguf_grid("IQ2_XXS")   # [256, 8]
IQ2XS_GRID = _gguf_grid("IQ2_XS")     # [512, 8]
IQ2S_GRID = _gguf_grid("IQ2_S")       # [1024, 8]
IQ3XXS_GRID = _gguf_grid("IQ3_XXS")   # [256, 4]
IQ3S_GRID = _gguf_grid("IQ3_S")       # [512, 4]
IQ1S_GRID = _gguf_grid("IQ1_S")       # [2048, 8] in {-1, 0, 1}
KSIGNS = _sign_table()
IQ1_DELTA = np.float32(0.125)


def sign_bits(b):
    """[..., m] bytes -> [..., m, 8] of +-1.0 (bit set: negative)."""
    return 1.0 - 2.0 * bits_of(b, 8).astype(F32)


def _grid_scale(b, lo: int, hi: int, mul: float):
    """f16 d at byte 0 times (0.5 + nibble) times mul, per nibble of bytes lo:hi (low nibble first)."""
    d = f16_at(b, 0)[..., None]
    s = nibbles(b[..., lo:hi])                                       # [..., 2, m]
    s = jnp.swapaxes(s, -1, -2).reshape(*b.shape[:-1], -1).astype(F32)
    return d * (0.5 + s) * np.float32(mul)


def _iq2_xxs(b, meta):
    """block_iq2_xxs: half d; 8 x (u32 4 grid bytes, u32 4x7 sign bits | 4-bit scale << 28)."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    q = b[..., 2:66].reshape(*lead, 8, 8)
    aux = lax.bitcast_convert_type(q[..., 4:8], jnp.uint32)                      # [..., 8]
    db = (d * (0.5 + (aux >> 28).astype(F32)) * np.float32(0.25))[..., None, None]
    grid = lookup2(IQ2XXS_GRID, q[..., 0:4])                                      # [..., 8, 4, 8]
    sidx = (aux[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 127
    return (db * grid * lookup2(KSIGNS, sidx)).reshape(*lead, 256)


def _iq2_xs(b, meta):
    """block_iq2_xs: half d; u16 qs[32] (9-bit grid index | 7-bit sign index); scales[8] (16 nibbles)."""
    lead = b.shape[:-1]
    db = _grid_scale(b, 66, 74, 0.25)[..., None, None]                           # [..., 16, 1, 1]
    qs = lax.bitcast_convert_type(b[..., 2:66].reshape(*lead, 32, 2), jnp.uint16).reshape(*lead, 16, 2)
    grid = lookup2(IQ2XS_GRID, qs & 511)
    return (db * grid * lookup2(KSIGNS, qs >> 9)).reshape(*lead, 256)


def _iq2_s(b, meta):
    """block_iq2_s: half d; qs[32] grid low bits; signs[32]; qh[8] (2 high bits each); scales[8]."""
    lead = b.shape[:-1]
    db = _grid_scale(b, 74, 82, 0.25)[..., None, None]                           # [..., 16, 1, 1]
    qh = jnp.swapaxes(crumbs(b[..., 66:74]), -1, -2).reshape(*lead, 32)
    idx = b[..., 2:34].astype(jnp.int32) | (qh.astype(jnp.int32) << 8)
    grid = lookup2(IQ2S_GRID, idx.reshape(*lead, 16, 2))
    signs = sign_bits(b[..., 34:66]).reshape(*lead, 16, 2, 8)
    return (db * grid * signs).reshape(*lead, 256)


def _iq3_xxs(b, meta):
    """block_iq3_xxs: half d; qs[64] grid bytes; 8 x u32 (4x7 sign bits | 4-bit scale << 28)."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    aux = lax.bitcast_convert_type(b[..., 66:98].reshape(*lead, 8, 4), jnp.uint32)   # [..., 8]
    db = (d * (0.5 + (aux >> 28).astype(F32)) * np.float32(0.5))[..., None, None]
    grid = lookup2(IQ3XXS_GRID, b[..., 2:66]).reshape(*lead, 8, 4, 8)
    sidx = (aux[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 127
    return (db * grid * lookup2(KSIGNS, sidx)).reshape(*lead, 256)


def _iq3_s(b, meta):
    """block_iq3_s: half d; qs[64]; qh[8] (9th index bit); signs[32]; scales[4] (d * (1 + 2*nibble))."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    s = jnp.swapaxes(nibbles(b[..., 106:110]), -1, -2).reshape(*lead, 8)
    db = (d * (1 + 2 * s).astype(F32))[..., None, None]                          # [..., 8, 1, 1]
    qh = bits_of(b[..., 66:74], 8).reshape(*lead, 64).astype(jnp.int32)
    idx = b[..., 2:66].astype(jnp.int32) | (qh << 8)
    grid = lookup2(IQ3S_GRID, idx).reshape(*lead, 8, 4, 8)
    signs = sign_bits(b[..., 74:106]).reshape(*lead, 8, 4, 8)
    return (db * grid * signs).reshape(*lead, 256)


def _iq1_s(b, meta):
    """block_iq1_s: half d; qs[32] grid low bytes; u16 qh[8] (4x3 high bits, 3-bit scale, delta sign)."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    qh = lax.bitcast_convert_type(b[..., 34:50].reshape(*lead, 8, 2), jnp.uint16)   # [..., 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).astype(F32))[..., None, None]
    delta = jnp.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA)[..., None, None]
    hi = (qh[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint16)) & 7                  # [..., 8, 4]
    idx = b[..., 2:34].reshape(*lead, 8, 4).astype(jnp.int32) | (hi.astype(jnp.int32) << 8)
    return (dl * (lookup2(IQ1S_GRID, idx) + delta)).reshape(*lead, 256)


def _iq1_m(b, meta):
    """block_iq1_m: qs[32]; qh[16] (per nibble: 3 high index bits, delta sign); u16 scales[4]
    (4 x 3-bit scales each; their top nibbles form the f16 d). Nibble bit 3 set: -delta."""
    lead = b.shape[:-1]
    sc = lax.bitcast_convert_type(b[..., 48:56].reshape(*lead, 4, 2), jnp.uint16)   # [..., 4]
    dbits = (sc & 0xF000) >> jnp.array([12, 8, 4, 0], jnp.uint16)
    dbits = dbits[..., 0] | dbits[..., 1] | dbits[..., 2] | dbits[..., 3]
    d = lax.bitcast_convert_type(dbits, jnp.float16).astype(F32)[..., None]
    s = ((sc[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint16)) & 7).reshape(*lead, 16)
    dl = (d * (2 * s + 1).astype(F32)).reshape(*lead, 8, 2, 1, 1)
    qh = jnp.swapaxes(nibbles(b[..., 32:48]), -1, -2).reshape(*lead, 32)             # one nibble per index
    idx = b[..., 0:32].astype(jnp.int32) | ((qh & 7).astype(jnp.int32) << 8)
    delta = jnp.where((qh & 8) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(*lead, 8, 2, 2, 1)
    grid = lookup2(IQ1S_GRID, idx).reshape(*lead, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(*lead, 256)


def _tq1_0(b, meta):
    """block_tq1_0: qs[48] (5 base-3 digits per byte), qh[4] (4 digits per byte); half d."""
    lead = b.shape[:-1]
    d = f16_at(b, 52)[..., None]
    pow3 = jnp.array([1, 3, 9, 27, 81], jnp.uint8)
    q0 = (b[..., None, 0:32] * pow3[:, None]).reshape(*lead, 160)       # uint8 products wrap as in C
    q1 = (b[..., None, 32:48] * pow3[:, None]).reshape(*lead, 80)
    q2 = (b[..., None, 48:52] * pow3[:4, None]).reshape(*lead, 16)
    q = jnp.concatenate([q0, q1, q2], axis=-1).astype(jnp.uint16)
    t = ((q * 3) >> 8).astype(jnp.int32) - 1
    return d * t.astype(F32)


def _tq2_0(b, meta):
    """block_tq2_0: qs[64] (2-bit digits, value - 1); half d."""
    lead = b.shape[:-1]
    d = f16_at(b, 64)[..., None]
    q = crumbs(b[..., 0:64].reshape(*lead, 2, 32)).reshape(*lead, 256).astype(jnp.int32) - 1
    return d * q.astype(F32)


Decoder = Callable  # (blocks [..., nb, block_bytes] uint8, meta [..., row_meta_bytes] uint8 | None) -> f32

DECODERS: dict[str, Decoder] = {
    "F32": _f32, "F16": _f16, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
    "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "TQ1_0": _tq1_0, "TQ2_0": _tq2_0,
}

# Decoders whose meta argument is used take meta [..., 1, row_meta_bytes] (broadcast over blocks).
# Interleaved decoders take [..., rows/R, nblocks, R*block_bytes] and return
# [..., rows/R, nblocks, R, block_elems].


def register_decoder(name: str, fn: Decoder) -> None:
    DECODERS[name] = fn


def supports(qtype: QuantType) -> bool:
    return qtype.name in DECODERS


# ---------------------------------------------------------------------------------------------


def dequantize(raw, qtype: QuantType, n_per_row: int, dtype=jnp.float32) -> jax.Array:
    """Bytes `[..., rows, row_bytes]` of `qtype` -> values `[..., rows, n_per_row]` in `dtype`."""
    fn = DECODERS.get(qtype.name)
    if fn is None:
        raise UnsupportedQuantType(f"tensor type {qtype.name} (id {qtype.type_id}) cannot be dequantized")
    rb = qtype.row_bytes(n_per_row)
    if raw.ndim < 2 or raw.shape[-1] != rb:
        raise ValueError(f"{qtype.name}: expected bytes shaped [..., rows, {rb}] for rows of {n_per_row},"
                         f" got {tuple(raw.shape)}")
    if raw.dtype != jnp.uint8:
        raise ValueError(f"{qtype.name}: expected uint8 bytes, got {raw.dtype}")
    if qtype.interleave > 1 and raw.shape[-2] % qtype.interleave:
        raise ValueError(f"{qtype.name}: {raw.shape[-2]} rows is not a multiple of the interleave {qtype.interleave}")
    return _dequantize_jit(raw, qtype, n_per_row, np.dtype(dtype))


@partial(jax.jit, static_argnums=(1, 2, 3))
def _dequantize_jit(raw, qtype: QuantType, n_per_row: int, dtype):
    fn = DECODERS[qtype.name]
    rb = qtype.row_bytes(n_per_row)
    lead, rows = raw.shape[:-2], raw.shape[-2]
    nb = n_per_row // qtype.block_elems
    R = qtype.interleave
    if R > 1:
        if rows % R:
            raise ValueError(f"{qtype.name}: {rows} rows is not a multiple of the interleave {R}")
        # R consecutive rows hold nb interleaved super-blocks of R*block_bytes each.
        if qtype.row_meta_bytes:
            g = raw.reshape(*lead, rows // R, R * rb)
            meta = g[..., :R * qtype.row_meta_bytes]
            blocks = g[..., R * qtype.row_meta_bytes:].reshape(*lead, rows // R, nb, R * qtype.block_bytes)
            out = fn(blocks, meta[..., None, :])
        else:
            blocks = raw.reshape(*lead, rows // R, nb, R * qtype.block_bytes)
            out = fn(blocks, None)
        # [..., rows/R, nb, R, be] -> [..., rows/R, R, nb, be]
        out = jnp.swapaxes(out, -3, -2)
        out = out.reshape(*lead, rows, n_per_row)
    else:
        meta = None
        if qtype.row_meta_bytes:
            meta = raw[..., :qtype.row_meta_bytes][..., None, :]
            raw = raw[..., qtype.row_meta_bytes:]
        blocks = raw.reshape(*lead, rows, nb, qtype.block_bytes)
        out = fn(blocks, meta).reshape(*lead, rows, n_per_row)
    return out.astype(dtype)
