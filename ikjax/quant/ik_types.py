"""ik_llama.cpp's own tensor types: ids, geometry and (for some) decoders.

Type ids: ik_llama.cpp `ggml/include/ggml.h` (`enum ggml_type`). Block layouts and lookup values:
`ggml/src/ggml-common.h`; decoding rules: `ggml/src/iqk/iqk_quantize.cpp` (dequantize_row_*,
repack_* for the interleaved `_R4`/`_R8` types). Reimplemented here with jax.numpy.

Geometry convention (as ik's `ggml_row_size`): `block_bytes` is the size of one block of ONE row,
also for interleaved types, so `row_bytes(n)` is the per-row share of the file's bytes; an `_R4`
super-block covering 4 rows is 4*block_bytes long. `row_meta_bytes` is ik's per-row prefix
(a float scale for the *_KS types).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .dequant import F32, IQ4NL_VALUES, bits_of, f16_array, f16_at, f32_at, lookup, nibbles, register_decoder, u16_at
from .types import QUANT_TYPES, QuantType, register

QK_K = 256

# (name, id, block_elems, block_bytes, row_meta_bytes, interleave); block_bytes per row.
# Sizes from the block structs of ggml-common.h; None: geometry not recorded (not decodable).
IK_TYPES: list[tuple] = [
    # ik's removed / arm-repacked ids that mainline dropped
    ("Q4_0_4_4", 31, 32, 18, 0, 1),
    ("Q4_0_4_8", 32, 32, 18, 0, 1),
    ("Q4_0_8_8", 33, 32, 18, 0, 1),
    ("I2_S", 36, None, None, 0, 1),
    ("Q8_0_X4", 97, None, None, 0, 1),  # (ggml.h's internal ids: 97 / 98 / 99, named one off before)
    ("Q8_1_X4", 98, None, None, 0, 1),
    ("Q8_2_X4", 99, None, None, 0, 1),
    ("Q6_0", 133, 32, 26, 0, 1),          # half d; qh[8]; qs[16]
    ("IQ1_BN", 134, None, None, 0, 1),
    ("IQ2_BN", 135, None, None, 0, 1),
    ("Q8_K64", 136, None, None, 0, 1),
    ("IQ2_K", 137, QK_K, 76, 0, 1),       # half d; u16 extra; scales[8]; qs[64]
    ("IQ3_K", 138, QK_K, 110, 0, 1),      # half d; u16 extra; u16 scales_h; scales_l[8]; qs[64]; qh[32]
    ("IQ4_K", 139, QK_K, 144, 0, 1),      # half d; u16 extra; scales_h[4]; scales_l[8]; qs[128]
    ("IQ5_K", 140, QK_K, 176, 0, 1),      # as IQ4_K + qh[32]
    ("IQ6_K", 141, QK_K, 212, 0, 1),      # half d; u16 extra; int8 scales[16]; qs[128]; qh[64]
    ("IQ2_TN", 142, None, None, 0, 1),
    ("IQ1_TN", 143, None, None, 0, 1),
    ("IQ4_KS", 144, QK_K, 136, 4, 1),     # row: float d; blocks: scales[8]; qs[128]
    ("IQ2_KS", 145, QK_K, 70, 2, 1),      # row: half d; blocks: u16 extra; scales[4]; qs[64]
    ("IQ4_KSS", 146, QK_K, 128, 4, 1),    # row: float d; blocks: u16 qs[64] (scrambled, scale bits in bit 0)
    ("Q8_K16", 147, None, None, 0, 1),
    ("Q8_K32", 148, None, None, 0, 1),
    ("Q8_KR8", 149, None, None, 0, 1),
    ("Q8_K128", 150, None, None, 0, 1),
    ("Q8_KV", 151, None, None, 0, 1),
    ("IQ5_KS", 152, QK_K, 168, 4, 1),     # row: float d; blocks: scales[8]; qs[128]; qh[32]
    ("IQ2_KT", 153, None, None, 0, 1),
    ("IQ3_KT", 154, None, None, 0, 1),
    ("IQ4_KT", 155, None, None, 0, 1),
    ("IQ3_KS", 156, QK_K, 102, 2, 1),
    ("IQ2_KL", 157, QK_K, 86, 2, 1),
    ("IQ1_KT", 158, None, None, 0, 1),
    ("Q4_0_R8", 202, 32, 18, 0, 8),
    ("Q5_0_R4", 206, 32, 22, 0, 4),
    ("Q8_0_R8", 208, 32, 34, 0, 8),
    ("Q2_K_R4", 210, QK_K, 84, 0, 4),
    ("Q3_K_R4", 211, QK_K, 110, 0, 4),
    ("Q4_K_R4", 212, QK_K, 144, 0, 4),    # block_q4_k_r4: half d[8]; scales_h[16]; scales_l[32]; qs[512]
    ("Q5_K_R4", 213, QK_K, 176, 0, 4),
    ("Q6_K_R4", 214, QK_K, 210, 0, 4),
    ("IQ2_XXS_R4", 216, QK_K, 66, 0, 4),
    ("IQ2_XS_R4", 217, QK_K, 74, 0, 4),
    ("IQ3_XXS_R4", 218, QK_K, 98, 0, 4),
    ("IQ1_S_R4", 219, None, None, 0, 1),
    ("IQ4_NL_R4", 220, 32, 18, 0, 4),
    ("IQ3_S_R4", 221, QK_K, 110, 0, 4),
    ("IQ2_S_R4", 222, QK_K, 82, 0, 4),
    ("IQ4_XS_R8", 223, QK_K, 136, 0, 8),
    ("IQ1_M_R4", 229, None, None, 0, 1),
    ("BF16_R16", 230, 1, 2, 0, 16),
    ("Q6_0_R4", 233, 32, 26, 0, 4),
    ("IQ2_BN_R4", 335, None, None, 0, 1),
    ("IQ2_K_R4", 337, QK_K, 76, 0, 4),
    ("IQ3_K_R4", 338, QK_K, 110, 0, 4),
    ("IQ4_K_R4", 339, QK_K, 144, 0, 4),
    ("IQ5_K_R4", 340, QK_K, 176, 0, 4),
    ("IQ4_KS_R4", 344, QK_K, 136, 4, 4),
    ("IQ5_KS_R4", 352, QK_K, 168, 4, 4),
    ("MXFP4_R8", 353, None, None, 0, 1),
    ("Q8_K_R16", 397, None, None, 0, 1),
    ("Q8_KV_R8", 398, None, None, 0, 1),
    ("Q8_K_R8", 399, None, None, 0, 1),
]


def _register_all() -> None:
    for name, tid, be, bb, meta, r in IK_TYPES:
        if tid in QUANT_TYPES and QUANT_TYPES[tid].name != name:
            # an id the gguf package already assigns differently (mainline reuse): keep mainline's.
            continue
        if be is None:
            # Unknown geometry: a row of any length is refused by row_bytes; the name still reports.
            be, bb = 1 << 30, 0
        register(QuantType(name, tid, be, bb, meta, r))


# ---------------------------------------------------------------------------------------------
# decoders

IQ4K_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                        -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117],
                       dtype=np.float32)
assert (IQ4K_VALUES[:16] == IQ4NL_VALUES).all()


IQ2NL_VALUES = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=np.float32)


def _iq2_k(b, meta):
    """block_iq2_k: half d; u16 extra; scales[8]; qs[64]. Weight 32*ib + t: 2-bit field ib%4 of
    qs[32*(ib//4) + t]; 16-sub-block s = 2*ib + t//16: scale nibble s%2 of scales[ib], minus 8;
    extra bit s selects the shifted half of iq2nl_values."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    extra = u16_at(b, 2)
    s = jnp.arange(16)
    ls = ((b[..., 4:12][..., s // 2] >> (4 * (s % 2)).astype(jnp.uint8)) & 0xF).astype(jnp.int32) - 8
    dl = (d * ls.astype(F32))[..., None]                                   # [..., 16, 1]
    shift = ((extra[..., None] >> s.astype(jnp.uint16)) & 1).astype(jnp.int32) * 4
    qs = b[..., 12:76].reshape(*lead, 2, 32)
    q = ((qs[..., None, :] >> jnp.array([0, 2, 4, 6], dtype=jnp.uint8)[:, None]) & 3)   # [..., 2, 4, 32]
    q = q.reshape(*lead, 16, 16).astype(jnp.int32)
    return (dl * lookup(IQ2NL_VALUES, q + shift[..., None])).reshape(*lead, 256)


def _iq4_k(b, meta):
    """block_iq4_k: half d; u16 extra; scales_h[4]; scales_l[8]; qs[128] (16 sub-blocks of 16)."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    extra = u16_at(b, 2)
    s = jnp.arange(16)
    sh = b[..., 4:8]
    sl = b[..., 8:16]
    # sub-block s = 2*ib + h: low 4 bits from scales_l[s//2] nibble h, high 2 bits at scales_h[s//4] >> 2*(s%4)
    lo = (sl[..., s // 2] >> (4 * (s % 2)).astype(jnp.uint8)) & 0xF
    hi = (sh[..., s // 4] >> (2 * (s % 4)).astype(jnp.uint8)) & 0x3
    ls = (lo | (hi << 4)).astype(jnp.int32) - 32
    dl = (d * ls.astype(F32))[..., None]                                   # [..., 16, 1]
    shift = ((extra[..., None] >> s.astype(jnp.uint16)) & 1).astype(jnp.int32) * 16   # [..., 16]
    q = nibbles(b[..., 16:144].reshape(*lead, 8, 16)).reshape(*lead, 16, 16).astype(jnp.int32)
    return (dl * lookup(IQ4K_VALUES, q + shift[..., None])).reshape(*lead, 256)


def _iq4_ks(b, meta):
    """Row: float d. block_iq4_ks: scales[8]; qs[128]. scale = (s & 254) - 127, table = s & 1."""
    lead = b.shape[:-1]
    d = f32_at(meta, 0)[..., None]                                           # [..., 1, 1]
    sc = b[..., 0:8]
    ls = (sc & 254).astype(jnp.int32) - 127
    dl = (d * ls.astype(F32))[..., None]                                     # [..., 8, 1]
    shift = (sc & 1).astype(jnp.int32)[..., None] * 16
    q = nibbles(b[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 8, 32).astype(jnp.int32)
    return (dl * lookup(IQ4K_VALUES, q + shift)).reshape(*lead, 256)


def _q4_k_r4(b, meta):
    """block_q4_k_r4 (4 rows): half d[8] (d of rows 0-3, then dmin); scales_h[16]; scales_l[32]; qs[512].

    For row k, 32-block ib (is = 4*ib + k): scales_l[is] = (sc & 15) | (mn & 15) << 4;
    (scales_h[is % 16] >> 4*(is // 16)) & 15 = sc >> 4 | (mn >> 4) << 2.
    qs[64*ib + 4*k + i + 16*j] (i < 4) holds, low | high nibble, the weights
    j=0: (i, i+8); j=1: (i+16, i+24); j=2: (i+4, i+12); j=3: (i+20, i+28) of that 32-block.
    Returns [..., nb, 4, 256].
    """
    lead = b.shape[:-1]
    dd = f16_array(b, 0, 8)
    d = dd[..., 0:4]                                                       # [..., 4] (row k)
    dmin = dd[..., 4:8]
    sh = b[..., 16:32]
    sl = b[..., 32:64]
    k = jnp.arange(4)
    ib = jnp.arange(8)
    is_ = 4 * ib[None, :] + k[:, None]                                     # [4, 8]
    low = sl[..., is_]                                                     # [..., 4, 8]
    high = (sh[..., is_ % 16] >> (4 * (is_ // 16)).astype(jnp.uint8)) & 0xF
    sc = (low & 0xF) | ((high & 3) << 4)
    mn = (low >> 4) | ((high >> 2) << 4)
    dl = (d[..., :, None] * sc.astype(F32))[..., None]                     # [..., 4, 8, 1]
    ml = (dmin[..., :, None] * mn.astype(F32))[..., None]
    qs = b[..., 64:576].reshape(*lead, 8, 4, 4, 4)                         # [ib, j, k, i]
    nib = jnp.stack([qs & 0xF, qs >> 4], axis=-3)                          # [..., ib, j, h, k, i]
    # weight position within the 32-block: i + 4*pos, pos = (0,2),(4,6),(1,3),(5,7) for j, h
    pos_of = np.array([[0, 2], [4, 6], [1, 3], [5, 7]])
    order = np.argsort(pos_of.reshape(-1))                                 # (j,h) flat for pos 0..7
    nib = nib.reshape(*lead, 8, 8, 4, 4)                                   # [ib, jh, k, i]
    nib = nib[..., order, :, :]                                            # [ib, pos, k, i]
    q = jnp.moveaxis(nib, -2, -4)                                          # [k, ib, pos, i]
    q = q.reshape(*lead, 4, 8, 32).astype(F32)
    return (dl * q - ml).reshape(*lead, 4, 256)


IQ3NL_VALUES = np.array([-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51], dtype=np.float32)
IQ5NL_VALUES = np.array([-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
                         -1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121,
                         -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
                         1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123], dtype=np.float32)
# iq6nl_values: ik's kernels (CUDA dequantize, iqk_mul_mat) and its quantizer use this integer table, the
# second half being the first plus one. ik's CPU reference dequantize_row_iq6_k instead evaluates the cubic
# A + q*(B + q*(-C + q*D)) that this table rounds; we follow the kernels.
_IQ6NL_BASE = [-127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
               -51, -47, -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5,
               -2, 0, 3, 6, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 40, 44,
               47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115, 121]
IQ6NL_VALUES = np.array(_IQ6NL_BASE + [v + 1 for v in _IQ6NL_BASE], dtype=np.float32)


def _bit(x, pos):
    """Bit `pos` (array or int) of unsigned x, as int32."""
    return ((x >> jnp.asarray(pos, dtype=x.dtype)) & 1).astype(jnp.int32)


def _sub32_bits(qs, nbits: int, per_byte_group: int):
    """Bit fields of 8 sub-blocks of 32 weights packed `per_byte_group` fields per 32-byte group:
    sub-block s, weight t = field s % per_byte_group of qs[32 * (s // per_byte_group) + t] -> [..., 8, 32]."""
    lead = qs.shape[:-1]
    g = qs.reshape(*lead, 8 // per_byte_group, 1, 32)
    sh = (nbits * jnp.arange(per_byte_group, dtype=jnp.uint8))[:, None]
    return ((g >> sh) & ((1 << nbits) - 1)).reshape(*lead, 8, 32).astype(jnp.int32)


def _qh_bits(qh):
    """qh[32]: bit s of qh[t] belongs to sub-block s, weight t -> [..., 8, 32] int32."""
    return jnp.swapaxes(bits_of(qh, 8), -1, -2).astype(jnp.int32)


def _q6_0(b, meta):
    """block_q6_0: half d; qh[8]; qs[16]. h = qh[j%8] >> 4*(j//8) gives bits 4-5 of weight j (h & 3)
    and of weight j+16 (h >> 2 & 3); value (q - 32) * d."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    h = nibbles(b[..., 2:10]).reshape(*lead, 16)
    qs = b[..., 10:26]
    lo = (qs & 0xF) | ((h & 3) << 4)
    hi = (qs >> 4) | ((h >> 2) << 4)
    q = jnp.concatenate([lo, hi], axis=-1).astype(jnp.int32) - 32
    return q.astype(F32) * d


def _iq3_k(b, meta):
    """block_iq3_k: half d; u16 extra; u16 scales_h; scales_l[8]; qs[64]; qh[32] (16 sub-blocks of 16).
    Sub-block s: scale d * (2*nibble(s%2 of scales_l[s//2]) + 1), negated if scales_h bit s; extra bit s
    selects the shifted table. Weight t of 32-block ib: 2 low bits from qs[32*(ib//4) + t] >> 2*(ib%4),
    third bit qh[t] bit ib."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    s = jnp.arange(16)
    extra, sh = u16_at(b, 2), u16_at(b, 4)
    ls = 2 * ((b[..., 6:14][..., s // 2] >> (4 * (s % 2)).astype(jnp.uint8)) & 0xF).astype(jnp.int32) + 1
    ls = ls * (1 - 2 * _bit(sh[..., None], s))
    dl = (d * ls.astype(F32)).reshape(*lead, 8, 2, 1)
    q = _sub32_bits(b[..., 14:78], 2, 4) | (_qh_bits(b[..., 78:110]) << 2)
    q = q.reshape(*lead, 8, 2, 16) + 8 * _bit(extra[..., None], s).reshape(*lead, 8, 2, 1)
    return (dl * lookup(IQ3NL_VALUES, q)).reshape(*lead, 256)


def _k_scales16(sh, sl):
    """IQ4_K/IQ5_K 6-bit scales of 16 sub-blocks: low nibble s%2 of sl[s//2], 2 high bits at
    sh[s//4] >> 2*(s%4); minus 32 -> [..., 16] int32."""
    s = jnp.arange(16)
    lo = (sl[..., s // 2] >> (4 * (s % 2)).astype(jnp.uint8)) & 0xF
    hi = (sh[..., s // 4] >> (2 * (s % 4)).astype(jnp.uint8)) & 0x3
    return (lo | (hi << 4)).astype(jnp.int32) - 32


def _iq5_k(b, meta):
    """block_iq5_k: half d; u16 extra; scales_h[4]; scales_l[8]; qs[128]; qh[32].
    32-block ib (of 64-block ib//2): nibble ib%2 of qs[32*(ib//2) + t], fifth bit qh[t] bit ib;
    16-sub-block s = 2*ib + t//16: 6-bit scale as IQ4_K, extra bit s: shifted table (+32)."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    extra = u16_at(b, 2)
    dl = (d * _k_scales16(b[..., 4:8], b[..., 8:16]).astype(F32)).reshape(*lead, 8, 2, 1)
    q = _sub32_bits(b[..., 16:144], 4, 2) | (_qh_bits(b[..., 144:176]) << 4)
    q = q.reshape(*lead, 8, 2, 16) + 32 * _bit(extra[..., None], jnp.arange(16)).reshape(*lead, 8, 2, 1)
    return (dl * lookup(IQ5NL_VALUES, q)).reshape(*lead, 256)


def _iq6_k(b, meta):
    """block_iq6_k: half d; u16 extra; int8 scales[16]; qs[128]; qh[64].
    32-block ib (64-block ib64 = ib//2, nibble h = ib%2): low 4 bits nibble h of qs[32*ib64 + t], high 2 bits
    (qh[32*(ib64//2) + t] >> (4*(ib64%2) + 2*h)) & 3; 16-sub-block s: scale d*scales[s], extra bit s: +1."""
    lead = b.shape[:-1]
    d = f16_at(b, 0)[..., None]
    extra = u16_at(b, 2)
    sc = lax.bitcast_convert_type(b[..., 4:20], jnp.int8).astype(F32)
    dl = (d * sc).reshape(*lead, 8, 2, 1)
    lo = _sub32_bits(b[..., 20:148], 4, 2)
    hi = _sub32_bits(b[..., 148:212], 2, 4)
    q = (lo | (hi << 4)).reshape(*lead, 8, 2, 16)
    q = q + 64 * _bit(extra[..., None], jnp.arange(16)).reshape(*lead, 8, 2, 1)
    return (dl * lookup(IQ6NL_VALUES, q)).reshape(*lead, 256)


def _iq2_ks(b, meta):
    """Row: half d. block_iq2_ks: u16 extra; scales[4]; qs[64]. 32-block s: scale nibble s%2 of
    scales[s//2] | extra bit 8+s << 4, minus 16; extra bit s: shifted table; 2-bit field s%4 of
    qs[32*(s//4) + t]."""
    lead = b.shape[:-1]
    d = f16_at(meta, 0)[..., None]
    extra = u16_at(b, 0)
    s = jnp.arange(8)
    ls = ((b[..., 2:6][..., s // 2] >> (4 * (s % 2)).astype(jnp.uint8)) & 0xF).astype(jnp.int32)
    ls = (ls | (_bit(extra[..., None], 8 + s) << 4)) - 16
    dl = (d * ls.astype(F32))[..., None]
    q = _sub32_bits(b[..., 6:70], 2, 4) + 4 * _bit(extra[..., None], s)[..., None]
    return (dl * lookup(IQ2NL_VALUES, q)).reshape(*lead, 256)


def _iq3_ks(b, meta):
    """Row: half d. block_iq3_ks: u16 extra; scales[4]; qs[64]; qh[32]. 32-block s: scale nibble s//4 of
    scales[s%4] | extra bit s << 4, minus 16; extra bit 8+s: shifted table; 2 bits field s%4 of
    qs[32*(s//4) + t], third bit qh[t] bit s."""
    lead = b.shape[:-1]
    d = f16_at(meta, 0)[..., None]
    extra = u16_at(b, 0)
    s = jnp.arange(8)
    ls = ((b[..., 2:6][..., s % 4] >> (4 * (s // 4)).astype(jnp.uint8)) & 0xF).astype(jnp.int32)
    ls = (ls | (_bit(extra[..., None], s) << 4)) - 16
    dl = (d * ls.astype(F32))[..., None]
    q = _sub32_bits(b[..., 6:70], 2, 4) | (_qh_bits(b[..., 70:102]) << 2)
    q = q + 8 * _bit(extra[..., None], 8 + s)[..., None]
    return (dl * lookup(IQ3NL_VALUES, q)).reshape(*lead, 256)


def _iq5_ks(b, meta):
    """Row: float d. block_iq5_ks: scales[8]; qs[128]; qh[32]. 32-block s: scale (sc & 254) - 127,
    sc & 1: shifted table (+32); nibble s%2 of qs[32*(s//2) + t], fifth bit qh[t] bit s."""
    lead = b.shape[:-1]
    d = f32_at(meta, 0)[..., None]
    sc = b[..., 0:8]
    dl = (d * ((sc & 254).astype(jnp.int32) - 127).astype(F32))[..., None]
    q = _sub32_bits(b[..., 8:136], 4, 2) | (_qh_bits(b[..., 136:168]) << 4)
    q = q + 32 * (sc & 1).astype(jnp.int32)[..., None]
    return (dl * lookup(IQ5NL_VALUES, q)).reshape(*lead, 256)


def _iq4_kss(b, meta):
    """Row: float d. block_iq4_kss: u16 q[128], 8 per 32-block. Bit 0 of q[k] is bit k of the block's
    scale byte ls (dl = d*((ls & 254) - 127), ls & 1: shifted table); v = (q & ~1) ^ ((q & ~1) >> 1)
    holds, as little-endian bytes j, weight j (low nibble) and j+16 (high nibble)."""
    lead = b.shape[:-1]
    d = f32_at(meta, 0)[..., None]
    q = lax.bitcast_convert_type(b.reshape(*lead, 8, 8, 2), jnp.uint16)          # [..., 8, 8]
    ls = jnp.sum((q & 1).astype(jnp.int32) << jnp.arange(8), axis=-1)            # [..., 8]
    v = q & 0xFFFE
    v = v ^ (v >> 1)
    v8 = lax.bitcast_convert_type(v, jnp.uint8).reshape(*lead, 8, 16)
    idx = nibbles(v8).reshape(*lead, 8, 32).astype(jnp.int32) + 16 * (ls & 1)[..., None]
    dl = (d * ((ls & 254) - 127).astype(F32))[..., None]
    return (dl * lookup(IQ4K_VALUES, idx)).reshape(*lead, 256)


def _q4_0_r8(b, meta):
    """block_iq4_nl_r8 (8 rows of Q4_0): half d[8]; qs[128]. Row k, weight 4*l + i (+16):
    low (high) nibble of qs[32*l + 4*k + i]. Returns [..., nb, 8, 32]."""
    lead = b.shape[:-1]
    d = f16_array(b, 0, 8)[..., None]                                            # [..., 8, 1]
    qs = b[..., 16:144].reshape(*lead, 4, 8, 4)                                  # [l, k, i]
    q = jnp.moveaxis(nibbles(qs.reshape(*lead, 128)).reshape(*lead, 2, 4, 8, 4), -2, -4)  # [k, h, l, i]
    q = q.reshape(*lead, 8, 32).astype(jnp.int32) - 8
    return d * q.astype(F32)


def _q8_0_r8(b, meta):
    """block_q8_0_r8 (8 rows of Q8_0): half d[8]; int8 qs[256]. Row k, weight 16*h + 4*l + i:
    qs[128*h + 32*l + 4*k + i]. Returns [..., nb, 8, 32]."""
    lead = b.shape[:-1]
    d = f16_array(b, 0, 8)[..., None]
    qs = lax.bitcast_convert_type(b[..., 16:272], jnp.int8).reshape(*lead, 2, 4, 8, 4)   # [h, l, k, i]
    q = jnp.moveaxis(qs, -2, -4).reshape(*lead, 8, 32)
    return q.astype(F32) * d


DECODERS = {"IQ2_K": _iq2_k, "IQ4_K": _iq4_k, "IQ4_KS": _iq4_ks, "Q4_K_R4": _q4_k_r4,
            "Q6_0": _q6_0, "IQ3_K": _iq3_k, "IQ5_K": _iq5_k, "IQ6_K": _iq6_k, "IQ2_KS": _iq2_ks,
            "IQ3_KS": _iq3_ks, "IQ5_KS": _iq5_ks, "IQ4_KSS": _iq4_kss, "Q4_0_R8": _q4_0_r8, "Q8_0_R8": _q8_0_r8}

_register_all()
for _n, _f in DECODERS.items():
    register_decoder(_n, _f)
