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
from jax import lax

from .types import QuantType, UnsupportedQuantType

F32 = jnp.float32

# ---------------------------------------------------------------------------------------------
# byte helpers


def u8(x):
    return x.astype(jnp.uint8)


def f16_at(b, off: int):
    """Little-endian f16 at byte offset `off` of the last axis, widened (exactly) to f32."""
    return lax.bitcast_convert_type(b[..., off:off + 2], jnp.float16).astype(F32)


def f32_at(b, off: int):
    return lax.bitcast_convert_type(b[..., off:off + 4], jnp.float32)


def u16_at(b, off: int):
    return lax.bitcast_convert_type(b[..., off:off + 2], jnp.uint16)


def u32_at(b, off: int):
    return lax.bitcast_convert_type(b[..., off:off + 4], jnp.uint32)


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


Decoder = Callable  # (blocks [..., nb, block_bytes] uint8, meta [..., row_meta_bytes] uint8 | None) -> f32

DECODERS: dict[str, Decoder] = {
    "F32": _f32, "F16": _f16, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
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
