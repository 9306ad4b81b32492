"""ik_llama.cpp's own tensor types without a Python oracle.

Each decoder is checked against a plain-Python transcription of ik's scalar `dequantize_row_*` loop
(ggml/src/iqk/iqk_quantize.cpp), written element by element from the block layout, on random blocks
(every field random: scales, high bits, sign/extra bits, table shifts). Interleaved `_R4`/`_R8` types
are built by repacking rows of the plain type (repack functions transcribed from ik's `repack_*`) and
must decode to exactly the plain rows. A scrambled-bits check shows each comparison has teeth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.quant import by_name, dequantize
from ikjax.quant.ik_types import (IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES)

_jit_deq = jax.jit(dequantize, static_argnums=(1, 2))
f32 = np.float32


def _f16(x):
    return f32(np.float16(x))


def _h(b, o):
    return f32(b[o:o + 2].view(np.float16)[0])


def _i(a):
    return a.astype(np.int64)


def _u16(b, o):
    return int(b[o:o + 2].view(np.uint16)[0])


# ---------------------------------------------------------------------------- scalar references
# Each takes one row's bytes (meta + blocks) and n, returns float32[n], following ik's loops.


def ref_q6_0(row, n):
    y = np.zeros(n, f32)
    for i in range(n // 32):
        b = row[26 * i:26 * i + 26]
        d = _h(b, 0)
        for j in range(16):
            h = int(b[2 + j % 8]) >> (4 * (j // 8))
            y[32 * i + j] = f32(((int(b[10 + j]) & 0xF) | ((h & 3) << 4)) - 32) * d
            y[32 * i + j + 16] = f32(((int(b[10 + j]) >> 4) | ((h & 0xC) << 2)) - 32) * d
    return y


def ref_iq3_k(row, n):
    y = np.zeros(n, f32)
    for i in range(n // 256):
        b = row[110 * i:110 * i + 110]
        d, extra, sh = _h(b, 0), _u16(b, 2), _u16(b, 4)
        sl, qs, qh = _i(b[6:14]), _i(b[14:78]), _i(b[78:110])
        for ib in range(8):
            dl1 = d * f32((2 * (sl[ib] & 0xF) + 1) * (-1 if sh & 1 else 1))
            dl2 = d * f32((2 * (sl[ib] >> 4) + 1) * (-1 if sh & 2 else 1))
            sh >>= 2
            v1 = IQ3NL_VALUES[8:] if extra & 1 else IQ3NL_VALUES[:8]
            v2 = IQ3NL_VALUES[8:] if extra & 2 else IQ3NL_VALUES[:8]
            extra >>= 2
            q = qs[32 * (ib // 4):]
            for j in range(16):
                y[256 * i + 32 * ib + j] = dl1 * v1[((q[j] >> 2 * (ib % 4)) & 3) | (((qh[j] >> ib) & 1) << 2)]
                y[256 * i + 32 * ib + j + 16] = dl2 * v2[((q[j + 16] >> 2 * (ib % 4)) & 3)
                                                         | (((qh[j + 16] >> ib) & 1) << 2)]
    return y


def ref_iq5_k(row, n):
    y = np.zeros(n, f32)
    for i in range(n // 256):
        b = row[176 * i:176 * i + 176]
        d, extra = _h(b, 0), _u16(b, 2)
        sh, sl, qs, qh = _i(b[4:8]), _i(b[8:16]), _i(b[16:144]), _i(b[144:176])
        for ib64 in range(4):
            s0, s1, h = int(sl[2 * ib64]), int(sl[2 * ib64 + 1]), int(sh[ib64])
            dls = [d * f32(((s0 & 0xF) | ((h << 4) & 0x30)) - 32), d * f32(((s0 >> 4) | ((h << 2) & 0x30)) - 32),
                   d * f32(((s1 & 0xF) | (h & 0x30)) - 32), d * f32(((s1 >> 4) | ((h >> 2) & 0x30)) - 32)]
            vals = [IQ5NL_VALUES[32 * ((extra >> k) & 1):] for k in range(4)]
            sft = 2 * ib64
            q = qs[32 * ib64:]
            base = 256 * i + 64 * ib64
            for j in range(16):
                y[base + j] = dls[0] * vals[0][(q[j] & 0xF) | (((qh[j] >> sft) & 1) << 4)]
                y[base + j + 16] = dls[1] * vals[1][(q[j + 16] & 0xF) | (((qh[j + 16] >> sft) & 1) << 4)]
                y[base + j + 32] = dls[2] * vals[2][(q[j] >> 4) | (((qh[j] >> sft) & 2) << 3)]
                y[base + j + 48] = dls[3] * vals[3][(q[j + 16] >> 4) | (((qh[j + 16] >> sft) & 2) << 3)]
            extra >>= 4
    return y


def ref_iq6_k(row, n):
    y = np.zeros(n, f32)
    for i in range(n // 256):
        b = row[212 * i:212 * i + 212]
        d, extra = _h(b, 0), _u16(b, 2)
        sc, qs, qh0 = b[4:20].view(np.int8), _i(b[20:148]), _i(b[148:212])
        for ib64 in range(4):
            dls = [d * f32(sc[4 * ib64 + k]) for k in range(4)]
            m = [64 * ((extra >> k) & 1) for k in range(4)]
            sft = 4 * (ib64 % 2)
            q, qh = qs[32 * ib64:], qh0[32 * (ib64 // 2):]
            base = 256 * i + 64 * ib64
            for j in range(16):
                q1 = (q[j] & 0xF) | (((qh[j] >> sft) & 3) << 4)
                q2 = (q[j + 16] & 0xF) | (((qh[j + 16] >> sft) & 3) << 4)
                q3 = (q[j] >> 4) | (((qh[j] >> sft) & 0xC) << 2)
                q4 = (q[j + 16] >> 4) | (((qh[j + 16] >> sft) & 0xC) << 2)
                for off, dl, mm, qq in ((0, dls[0], m[0], q1), (16, dls[1], m[1], q2),
                                        (32, dls[2], m[2], q3), (48, dls[3], m[3], q4)):
                    y[base + j + off] = dl * IQ6NL_VALUES[qq + mm]
            extra >>= 4
    return y


def ref_iq2_ks(row, n):
    y = np.zeros(n, f32)
    d = _h(row, 0)
    for i in range(n // 256):
        b = row[2 + 70 * i:2 + 70 * i + 70]
        extra, sc, qs = _u16(b, 0), _i(b[2:6]), _i(b[6:70])
        for ib64 in range(4):
            dl1 = d * f32(((sc[ib64] & 0xF) | ((extra >> 4) & 0x10)) - 16)
            dl2 = d * f32(((sc[ib64] >> 4) | ((extra >> 5) & 0x10)) - 16)
            v1 = IQ2NL_VALUES[4:] if extra & 1 else IQ2NL_VALUES[:4]
            v2 = IQ2NL_VALUES[4:] if extra & 2 else IQ2NL_VALUES[:4]
            extra >>= 2
            sft, q = 4 * (ib64 % 2), qs[32 * (ib64 // 2):]
            for j in range(32):
                y[256 * i + 64 * ib64 + j] = dl1 * v1[(q[j] >> sft) & 3]
                y[256 * i + 64 * ib64 + j + 32] = dl2 * v2[(q[j] >> (sft + 2)) & 3]
    return y


def ref_iq3_ks(row, n):
    y = np.zeros(n, f32)
    d = _h(row, 0)
    for ibl in range(n // 256):
        b = row[2 + 102 * ibl:2 + 102 * ibl + 102]
        extra, sc, qs, qh = _u16(b, 0), _i(b[2:6]), _i(b[6:70]), _i(b[70:102])
        dl = [0.0] * 8
        for j in range(4):
            dl[j] = d * f32(((sc[j] & 0xF) | (((extra >> j) & 1) << 4)) - 16)
            dl[j + 4] = d * f32(((sc[j] >> 4) | (((extra >> (j + 4)) & 1) << 4)) - 16)
        for i128 in range(2):
            for ib in range(4):
                vals = IQ3NL_VALUES[8 * ((extra >> (8 + 4 * i128 + ib)) & 1):]
                for j in range(32):
                    y[256 * ibl + 128 * i128 + 32 * ib + j] = dl[4 * i128 + ib] * vals[
                        ((qs[32 * i128 + j] >> 2 * ib) & 3) | (((qh[j] >> (4 * i128 + ib)) & 1) << 2)]
    return y


def ref_iq5_ks(row, n):
    y = np.zeros(n, f32)
    d = row[0:4].view(np.float32)[0]
    for ibl in range(n // 256):
        b = row[4 + 168 * ibl:4 + 168 * ibl + 168]
        sc, qs, qh = _i(b[0:8]), _i(b[8:136]), _i(b[136:168])
        for ib64 in range(4):
            dl1 = d * f32(int(sc[2 * ib64] & 254) - 127)
            dl2 = d * f32(int(sc[2 * ib64 + 1] & 254) - 127)
            v1 = IQ5NL_VALUES[32 * (sc[2 * ib64] & 1):]
            v2 = IQ5NL_VALUES[32 * (sc[2 * ib64 + 1] & 1):]
            q = qs[32 * ib64:]
            for j in range(32):
                y[256 * ibl + 64 * ib64 + j] = dl1 * v1[(q[j] & 0xF) | (((qh[j] >> (2 * ib64)) & 1) << 4)]
                y[256 * ibl + 64 * ib64 + j + 32] = dl2 * v2[(q[j] >> 4) | (((qh[j] >> (2 * ib64 + 1)) & 1) << 4)]
    return y


def ref_iq4_kss(row, n):
    y = np.zeros(n, f32)
    d = row[0:4].view(np.float32)[0]
    for ibl in range(n // 256):
        q16 = row[4 + 128 * ibl:4 + 128 * ibl + 128].view(np.uint16)
        for ib in range(8):
            aux = np.zeros(8, np.uint16)
            ls = 0
            for k in range(8):
                a = int(q16[8 * ib + k]) & 0xFFFE
                aux[k] = a ^ (a >> 1)
                ls |= (int(q16[8 * ib + k]) & 1) << k
            aux8 = aux.view(np.uint8)
            vals = IQ4K_VALUES[16 * (ls & 1):]
            dl = d * f32((ls & 254) - 127)
            for j in range(16):
                y[256 * ibl + 32 * ib + j] = dl * vals[aux8[j] & 0xF]
                y[256 * ibl + 32 * ib + j + 16] = dl * vals[aux8[j] >> 4]
    return y


REFS = {"Q6_0": (ref_q6_0, [0], None), "IQ3_K": (ref_iq3_k, [0], None), "IQ5_K": (ref_iq5_k, [0], None),
        "IQ6_K": (ref_iq6_k, [0], None), "IQ2_KS": (ref_iq2_ks, [], "f16"), "IQ3_KS": (ref_iq3_ks, [], "f16"),
        "IQ5_KS": (ref_iq5_ks, [], "f32"), "IQ4_KSS": (ref_iq4_kss, [], "f32")}


def random_rows(name, rows, n, rng):
    """Random bytes for `rows` rows of type `name`, with finite f16/f32 scale fields."""
    qt = by_name(name)
    _, f16_offs, meta = REFS[name]
    nb = n // qt.block_elems
    blocks = rng.integers(0, 256, (rows, nb, qt.block_bytes), dtype=np.uint8)
    for o in f16_offs:
        blocks[..., o:o + 2] = rng.uniform(-0.05, 0.05, (rows, nb)).astype(np.float16)[..., None].view(np.uint8)
    parts = []
    if meta == "f16":
        parts.append(rng.uniform(-0.05, 0.05, (rows, 1)).astype(np.float16).view(np.uint8))
    elif meta == "f32":
        parts.append(rng.uniform(-0.01, 0.01, (rows, 1)).astype(np.float32).view(np.uint8))
    parts.append(blocks.reshape(rows, -1))
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == qt.row_bytes(n)
    return out


def _ref_rows(name, raw, n):
    return np.stack([REFS[name][0](r, n) for r in raw.reshape(-1, raw.shape[-1])]).reshape(*raw.shape[:-1], n)


@pytest.mark.parametrize("name", list(REFS))
def test_ik_plain_type_matches_scalar_reference(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    qt = by_name(name)
    n = 2 * qt.block_elems if qt.block_elems == 256 else 128
    raw = random_rows(name, 3, n, rng)                                  # odd row count
    want = _ref_rows(name, raw, n)
    got = np.asarray(_jit_deq(jnp.asarray(raw), qt, n))
    assert np.isfinite(want).all()
    assert np.array_equal(got, want), f"{name}: max diff {np.abs(got - want).max()}"
    # 3-D expert-shaped tensor
    raw3 = random_rows(name, 2 * 3, n, rng).reshape(2, 3, -1)
    assert np.array_equal(np.asarray(_jit_deq(jnp.asarray(raw3), qt, n)), _ref_rows(name, raw3, n))


@pytest.mark.parametrize("name", list(REFS))
def test_ik_plain_type_scrambled_bits_detected(name):
    """Flipping bits in each region of a block (scales, quants, high bits, extra) changes the decode,
    and the decoder still agrees with the reference there: no field is ignored."""
    rng = np.random.default_rng(11)
    qt = by_name(name)
    n = qt.block_elems
    raw = random_rows(name, 1, n, rng)
    base = np.asarray(_jit_deq(jnp.asarray(raw), qt, n))
    meta = qt.row_meta_bytes
    start = meta + (2 if REFS[name][1] else 0)             # skip the f16 d (flipping it may give inf)
    for pos in range(start, raw.shape[1]):
        for bit in (0, 3, 6) if qt.block_bytes > 40 else range(8):
            mut = raw.copy()
            mut[0, pos] ^= np.uint8(1 << bit)
            got = np.asarray(_jit_deq(jnp.asarray(mut), qt, n))
            if pos % 7 == 0 and bit == 3:                  # full reference on a sample (speed)
                assert np.array_equal(got, _ref_rows(name, mut, n)), (name, pos, bit)
            if not np.array_equal(got, base):
                continue
            # an unchanged decode is only legitimate where the flipped bit is dead in the reference too
            assert np.array_equal(_ref_rows(name, mut, n), _ref_rows(name, raw, n)), (name, pos, bit)


# ---------------------------------------------------------------------------- row-interleaved types


def repack_q4_0_r8(rows8):
    """ik's repack_q4_0: 8 rows of block_q4_0 [8, nb, 18] -> nb x block_iq4_nl_r8 (144 bytes)."""
    nb = rows8.shape[1]
    y = np.zeros((nb, 144), np.uint8)
    for ib in range(nb):
        for k in range(8):
            y[ib, 2 * k:2 * k + 2] = rows8[k, ib, 0:2]
            for l in range(4):
                for i in range(4):
                    y[ib, 16 + 32 * l + 4 * k + i] = rows8[k, ib, 2 + 4 * l + i]
    return y


def repack_q8_0_r8(rows8):
    """ik's repack_q8_0: 8 rows of block_q8_0 [8, nb, 34] -> nb x block_q8_0_r8 (272 bytes)."""
    nb = rows8.shape[1]
    y = np.zeros((nb, 272), np.uint8)
    for ib in range(nb):
        for k in range(8):
            y[ib, 2 * k:2 * k + 2] = rows8[k, ib, 0:2]
        for l in range(4):
            for k in range(8):
                for i in range(4):
                    y[ib, 16 + 32 * l + 4 * k + i] = rows8[k, ib, 2 + i + 4 * l]
                    y[ib, 16 + 32 * l + 4 * k + i + 128] = rows8[k, ib, 2 + i + 4 * l + 16]
    return y


R8 = {"Q4_0_R8": ("Q4_0", repack_q4_0_r8), "Q8_0_R8": ("Q8_0", repack_q8_0_r8)}


def _interleaved_from_plain(plain_name, repack, R, rows, n, rng):
    """Random plain rows [rows, row_bytes] and the same rows repacked as laid in the file."""
    import gguf
    from gguf import GGMLQuantizationType as T
    pq = by_name(plain_name)
    nb = n // pq.block_elems
    x = rng.standard_normal((rows, n)).astype(np.float32)
    plain = np.ascontiguousarray(gguf.quants.quantize(x, T[plain_name])).view(np.uint8).reshape(rows, nb, -1)
    inter = np.concatenate([repack(plain[g:g + R]).reshape(1, -1) for g in range(0, rows, R)])
    return plain.reshape(rows, -1), inter.reshape(rows, -1)   # R consecutive rows share R*row_bytes


@pytest.mark.parametrize("name", list(R8))
def test_row_interleaved_equals_plain_rows(name):
    import gguf
    from gguf import GGMLQuantizationType as T
    plain_name, repack = R8[name]
    qt = by_name(name)
    rng = np.random.default_rng(3)
    rows, n = 16, 128
    plain, inter = _interleaved_from_plain(plain_name, repack, qt.interleave, rows, n, rng)
    want = gguf.quants.dequantize(plain, T[plain_name])
    got = np.asarray(_jit_deq(jnp.asarray(inter), qt, n))
    assert np.array_equal(got, want)
    # expert-shaped: [2, 8, row_bytes]
    got3 = np.asarray(_jit_deq(jnp.asarray(inter.reshape(2, 8, -1)), qt, n))
    assert np.array_equal(got3.reshape(rows, n), want)
    # negative: decoding the un-repacked bytes as the interleaved type does not give the plain rows
    bad = np.asarray(_jit_deq(jnp.asarray(plain), qt, n))
    assert not np.array_equal(bad, want)
