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

from .dequant import F32, IQ4NL_VALUES, f16_array, f16_at, f32_at, lookup, nibbles, register_decoder, u16_at
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
    ("Q8_0_X4", 98, None, None, 0, 1),
    ("Q8_1_X4", 99, None, None, 0, 1),
    ("Q6_0", 133, 32, 26, 0, 1),          # half d; qh[8]; qs[16]
    ("IQ1_BN", 134, None, None, 0, 1),
    ("IQ2_BN", 135, None, None, 0, 1),
    ("Q8_K64", 136, None, None, 0, 1),
    ("IQ2_K", 137, QK_K, 76, 0, 1),       # half d; u16 extra; scales[8]; qs[64]
    ("IQ3_K", 138, QK_K, 110, 0, 1),      # half d; u16 extra; u16 scales_h; scales_l[8]; qs[64]; qh[32]
    ("IQ4_K", 139, QK_K, 144, 0, 1),      # half d; u16 extra; scales_h[4]; scales_l[8]; qs[128]
    ("IQ5_K", 140, QK_K, 176, 0, 1),      # as IQ4_K + qh[32]
    ("IQ6_K", 141, QK_K, 212, 0, 1),      # half d; u16 extra; int8 scales[16]; qs[128]; qh[64]
    ("IQ4_KS", 144, QK_K, 136, 4, 1),     # row: float d; blocks: scales[8]; qs[128]
    ("IQ2_KS", 145, QK_K, 70, 2, 1),      # row: half d; blocks: u16 extra; scales[4]; qs[64]
    ("IQ4_KSS", 146, None, None, 0, 1),
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


DECODERS = {"IQ2_K": _iq2_k, "IQ4_K": _iq4_k, "IQ4_KS": _iq4_ks, "Q4_K_R4": _q4_k_r4}

_register_all()
for _n, _f in DECODERS.items():
    register_decoder(_n, _f)
