"""ikjax.quant: bit-exact dequantization against gguf, ik_llama.cpp types against other fixtures."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ikjax.quant import QuantArray, UnsupportedQuantType, by_name, dequantize, lookup
from ikjax.quant.ik_types import IQ2NL_VALUES, IQ4K_VALUES

STD_TYPES = ("F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS "
             "IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M TQ1_0 TQ2_0").split()

# byte offsets of the f16 scale fields inside one block, for types gguf cannot quantize
F16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
              "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0],
              "IQ3_S": [0], "IQ1_S": [0], "IQ1_M": [], "TQ1_0": [52], "TQ2_0": [64]}


def fixtures_dir() -> Path:
    env = os.environ.get("IKJAX_FIXTURES")
    for p in ([Path(env)] if env else []) + [Path(__file__).resolve().parents[2] / "shared" / "fixtures"]:
        if p.is_dir():
            return p
    pytest.skip(f"fixtures folder not found (IKJAX_FIXTURES={env!r}, "
                f"{Path(__file__).resolve().parents[2] / 'shared' / 'fixtures'}): "
                "the GGUF fixtures exist only in the project's workplace", allow_module_level=True)


_jit_deq = jax.jit(dequantize, static_argnums=(1, 2))


def random_bytes(name: str, lead: tuple, n: int, rng) -> np.ndarray:
    """Quantized bytes `[*lead, row_bytes]` of random data for a standard type."""
    t = T[name]
    be, bb = GGML_QUANT_SIZES[t]
    if name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        x = rng.standard_normal((*lead, n)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(x, t)).view(np.uint8).reshape(*lead, -1)
    raw = rng.integers(0, 256, (*lead, n // be, bb), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scale = rng.uniform(-0.05, 0.05, raw.shape[:-1]).astype(np.float16)
        raw[..., off:off + 2] = scale[..., None].view(np.uint8).reshape(*raw.shape[:-1], 2)
    if name == "IQ1_M":   # its f16 d is spread over the top nibbles of the 4 u16 scale words
        sc = raw[..., 48:56].copy().view(np.uint16)
        d = rng.uniform(-0.05, 0.05, raw.shape[:-1]).astype(np.float16).view(np.uint16)
        for k in range(4):
            sc[..., k] = (sc[..., k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[..., 48:56] = sc.view(np.uint8)
    return raw.reshape(*lead, -1)


# ------------------------------------------------------------------------------------------ standard


@pytest.mark.parametrize("name", STD_TYPES)
def test_standard_types_bit_exact(name):
    rng = np.random.default_rng(hash(name) % 2**32)
    qt = by_name(name)
    for lead, n in [((3,), 256), ((7,), 512), ((4, 5), 256)]:   # odd rows, 3-D expert tensor
        raw = random_bytes(name, lead, n, rng)
        assert raw.shape[-1] == qt.row_bytes(n)
        ref = gguf.quants.dequantize(raw, T[name])
        got = np.asarray(_jit_deq(jnp.asarray(raw), qt, n))
        assert got.shape == (*lead, n) and got.dtype == np.float32
        assert np.isfinite(ref).all()
        assert np.array_equal(got, ref), f"{name} {lead}: max diff {np.abs(got - ref).max()}"


def test_dtype_cast_and_eager_numpy():
    rng = np.random.default_rng(1)
    raw = random_bytes("Q4_K", (3,), 256, rng)
    ref = gguf.quants.dequantize(raw, T.Q4_K)
    got = dequantize(raw, by_name("Q4_K"), 256, dtype=jnp.bfloat16)   # numpy input, no jit
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got), ref.astype(jnp.bfloat16))


# ------------------------------------------------------------------------------------------ GGUF files


def read_gguf_tensors(path: Path):
    """Minimal GGUF reader (the gguf package rejects ik-only type ids).

    Returns {name: (type_id, numpy shape, uint8 memmap of the tensor's bytes)}."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("Q")
        s = bytes(buf[pos:pos + n]).decode()
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(vt):
        if vt in scalar:
            return take(scalar[vt])
        if vt == 8:
            return string()
        if vt == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        raise ValueError(f"bad GGUF value type {vt}")

    assert bytes(buf[0:4]) == b"GGUF"
    pos = 4
    _version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        k = string()
        meta[k] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = take("I")
        dims = [take("Q") for _ in range(nd)]
        tid, off = take("I"), take("Q")
        infos.append((name, tid, tuple(reversed(dims)), off))
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    out = {}
    for name, tid, shape, off in infos:
        qt = lookup(tid)
        assert qt is not None, f"{path.name}: {name} has unknown type id {tid}"
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        nbytes = rows * qt.row_bytes(shape[-1])
        out[name] = (tid, shape, mm[start + off:start + off + nbytes])
    return out


def _std_fixture_files():
    d = fixtures_dir()
    return sorted(d.glob("*.gguf"))


def test_fixture_dir_present():
    files = _std_fixture_files()
    assert files, "no .gguf fixtures found"


def test_fixtures_bit_exact_vs_gguf():
    checked = 0
    for path in _std_fixture_files():
        for name, (tid, shape, data) in read_gguf_tensors(path).items():
            qt = lookup(tid)
            if qt.name not in STD_TYPES:
                continue
            byte_rows = data.reshape(*shape[:-1], qt.row_bytes(shape[-1])) if len(shape) > 1 \
                else data.reshape(1, -1)
            ref = gguf.quants.dequantize(np.asarray(byte_rows), T(tid)).reshape(shape)
            qa = QuantArray.from_bytes(data, qt, shape)          # a memmap slice as the leaf
            got = np.asarray(qa.dequantize())
            assert np.array_equal(got, ref), f"{path.name}:{name} ({qt.name}) differs from gguf"
            checked += 1
    assert checked > 100


# ------------------------------------------------------------------------------------------ ik types

IK_FILES = {"IQ4_K": "v3tiny-all-IQ4_K.gguf", "IQ4_KS": "v3tiny-all-IQ4_KS.gguf",
            "Q4_K_R4": "v3tiny-all-Q4_K_R4.gguf"}
REF_FILE = "v3tiny-mainline-Q8_0.gguf"   # same f32 weights, 8-bit: the reference for 4-bit decodes

_cache = {}


def _tensors(fname):
    if fname not in _cache:
        _cache[fname] = read_gguf_tensors(fixtures_dir() / fname)
    return _cache[fname]


def _deq(entry):
    tid, shape, data = entry
    return np.asarray(QuantArray.from_bytes(data, lookup(tid), shape).dequantize())


_ref_cache = {}


def _deq_ref(name):
    if name not in _ref_cache:
        _ref_cache[name] = _deq(_tensors(REF_FILE)[name])
    return _ref_cache[name]


def _ik_tensor_errors(type_name, mutate=None):
    """Relative L2 error of each `type_name` tensor of its fixture against the Q8_0 fixture."""
    qt = by_name(type_name)
    ik, ref = _tensors(IK_FILES[type_name]), _tensors(REF_FILE)
    errs = {}
    for name, (tid, shape, data) in ik.items():
        if tid != qt.type_id or name not in ref or ref[name][1] != shape:
            continue
        if mutate is not None:
            data = mutate(np.array(data).reshape(*shape[:-1], -1))
        got = _deq((tid, shape, data))
        want = _deq_ref(name)
        assert got.shape == want.shape == shape and np.isfinite(got).all()
        errs[name] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return errs


@pytest.mark.parametrize("type_name", list(IK_FILES))
def test_ik_fixture_types_match_other_quantization(type_name):
    errs = _ik_tensor_errors(type_name)
    assert len(errs) >= 5, f"too few {type_name} tensors compared: {errs}"
    worst = max(errs, key=errs.get)
    assert errs[worst] < 0.15, f"{type_name}: {worst} rel err {errs[worst]:.3f}"
    # every ik-typed tensor in the file decodes to finite values
    for name, (tid, shape, data) in _tensors(IK_FILES[type_name]).items():
        if tid == by_name(type_name).type_id:
            assert np.isfinite(_deq((tid, shape, data))).all(), name


def _flip_nibbles(raw):
    return raw ^ np.uint8(0x33)


@pytest.mark.parametrize("type_name", list(IK_FILES))
def test_ik_broken_decode_is_detected(type_name):
    """The comparison has teeth: scrambled bits give errors far above quantization level."""
    errs = _ik_tensor_errors(type_name, mutate=_flip_nibbles)
    assert min(errs.values()) > 0.5, errs


def test_q4_k_r4_rows_not_swapped():
    """De-interleaving: each of the 4 rows matches its own row of the reference, not a neighbour."""
    ik, ref = _tensors(IK_FILES["Q4_K_R4"]), _tensors(REF_FILE)
    qt = by_name("Q4_K_R4")
    name = next(n for n, (tid, s, _) in ik.items() if tid == qt.type_id and n in ref and ref[n][1] == s)
    got, want = _deq(ik[name]), _deq(ref[name])
    shifted = np.roll(want.reshape(-1, 4, want.shape[-1]), 1, axis=1).reshape(want.shape)
    good = np.linalg.norm(got - want) / np.linalg.norm(want)
    bad = np.linalg.norm(got - shifted) / np.linalg.norm(want)
    assert good < 0.15 < bad


def test_ik_type_ids():
    # ik_llama.cpp ggml/include/ggml.h
    for name, tid in [("IQ4_K", 139), ("IQ4_KS", 144), ("Q4_K_R4", 212), ("IQ2_K", 137), ("IQ3_K", 138),
                      ("IQ5_K", 140), ("IQ6_K", 141), ("IQ2_KS", 145), ("IQ5_KS", 152), ("Q6_0", 133),
                      ("Q8_0_R8", 208), ("Q4_0_R8", 202), ("IQ4_K_R4", 339), ("Q8_K_R8", 399)]:
        assert by_name(name).type_id == tid and lookup(tid).name == name
    assert by_name("IQ4_KS").row_meta_bytes == 4 and by_name("IQ4_KS").row_bytes(512) == 4 + 2 * 136
    assert by_name("Q4_K_R4").interleave == 4 and by_name("Q4_K_R4").row_bytes(512) == 288


# hand-built blocks: each field's decoding


def _f16b(x):
    return np.array([x], dtype=np.float16).view(np.uint8)


def test_iq4_k_hand_block():
    blk = np.zeros(144, np.uint8)
    blk[0:2] = _f16b(0.5)
    extra = 0b10  # sub-block 1 (weights 16..31) uses the shifted table
    blk[2:4] = np.array([extra], np.uint16).view(np.uint8)
    # sub-block s scale: low 4 bits in scales_l[s//2] nibble s%2, high 2 bits scales_h[s//4] >> 2*(s%4)
    ls = np.arange(16) * 3 + 5                     # 6-bit scales 5..50
    for s in range(16):
        blk[8 + s // 2] |= (ls[s] & 15) << (4 * (s % 2))
        blk[4 + s // 4] |= (ls[s] >> 4) << (2 * (s % 4))
    q = np.arange(256) % 16                        # expected index per weight
    # weights 32*ib + j (j<16) in low nibble of qs[16*ib + j], 32*ib + 16 + j in its high nibble
    for ib in range(8):
        for j in range(16):
            blk[16 + 16 * ib + j] = q[32 * ib + j] | (q[32 * ib + 16 + j] << 4)
    got = np.asarray(dequantize(blk.reshape(1, 144), by_name("IQ4_K"), 256))[0]
    shift = np.zeros(256, int)
    shift[16:32] = 16
    want = np.float32(0.5) * (np.repeat(ls, 16) - 32).astype(np.float32) * IQ4K_VALUES[q + shift]
    assert np.array_equal(got, want.astype(np.float32))


def test_iq2_k_hand_block():
    rng = np.random.default_rng(5)
    blk = np.zeros(76, np.uint8)
    blk[0:2] = _f16b(-0.75)
    extra = int(rng.integers(0, 1 << 16))
    blk[2:4] = np.array([extra], np.uint16).view(np.uint8)
    ls = rng.integers(0, 16, 16)                   # sub-block s: nibble s%2 of scales[s//2]
    for s in range(16):
        blk[4 + s // 2] |= ls[s] << (4 * (s % 2))
    q = rng.integers(0, 4, 256)
    # weight 32*ib + t sits in bits 2*(ib%4) of qs[32*(ib//4) + t]
    for ib in range(8):
        for t in range(32):
            blk[12 + 32 * (ib // 4) + t] |= q[32 * ib + t] << (2 * (ib % 4))
    got = np.asarray(dequantize(blk.reshape(1, 76), by_name("IQ2_K"), 256))[0]
    sub = np.arange(256) // 16
    tab = 4 * ((extra >> sub) & 1)
    want = (np.float32(-0.75) * (ls[sub] - 8).astype(np.float32)) * IQ2NL_VALUES[q + tab]
    assert np.array_equal(got, want.astype(np.float32))


def test_iq4_ks_hand_block():
    row = np.zeros(4 + 2 * 136, np.uint8)
    row[0:4] = np.array([0.25], np.float32).view(np.uint8)
    sc = np.arange(16) * 15 + 7                     # bit0: table; (s & 254) - 127: scale
    q = (np.arange(512) * 7) % 16
    for ibl in range(2):
        b = 4 + 136 * ibl
        row[b:b + 8] = sc[8 * ibl:8 * ibl + 8]
        for ib in range(8):
            for j in range(16):
                w = 256 * ibl + 32 * ib
                row[b + 8 + 16 * ib + j] = q[w + j] | (q[w + 16 + j] << 4)
    got = np.asarray(dequantize(row.reshape(1, -1), by_name("IQ4_KS"), 512))[0]
    scb = np.repeat(sc, 32)
    want = (np.float32(0.25) * ((scb & 254) - 127).astype(np.float32)) * IQ4K_VALUES[q + 16 * (scb & 1)]
    assert np.array_equal(got, want.astype(np.float32))


def _pack_q4_k(d, dmin, sc, mn, L):
    """One standard block_q4_K (144 bytes) from 6-bit scales/mins and 4-bit quants."""
    b = np.zeros(144, np.uint8)
    b[0:2], b[2:4] = _f16b(d), _f16b(dmin)
    s = b[4:16]
    for j in range(8):
        if j < 4:
            s[j] = sc[j] & 63
            s[j + 4] = mn[j] & 63
        else:
            s[j + 4] = (sc[j] & 15) | ((mn[j] & 15) << 4)
            s[j - 4] |= (sc[j] >> 4) << 6
            s[j] |= (mn[j] >> 4) << 6
    for i64 in range(4):
        for j in range(32):
            b[16 + 32 * i64 + j] = L[64 * i64 + j] | (L[64 * i64 + 32 + j] << 4)
    return b


def _repack_q4_k_r4(blocks4):
    """4 block_q4_K (one per row) -> one 576-byte block_q4_k_r4 (the layout of ik's repack_q4_k)."""
    y = np.zeros(576, np.uint8)
    for k, (d, dmin, sc, mn, L) in enumerate(blocks4):
        y[2 * k:2 * k + 2] = _f16b(d)
        y[8 + 2 * k:8 + 2 * k + 2] = _f16b(dmin)
        for ib in range(8):
            is_ = 4 * ib + k
            y[32 + is_] = (sc[ib] & 15) | ((mn[ib] & 15) << 4)
            y[16 + is_ % 16] |= ((sc[ib] >> 4) | ((mn[ib] >> 4) << 2)) << (4 * (is_ // 16))
            for i in range(4):
                q = 64 + 64 * ib + 4 * k + i
                y[q + 0] = L[32 * ib + i + 0] | (L[32 * ib + i + 8] << 4)
                y[q + 16] = L[32 * ib + i + 16] | (L[32 * ib + i + 24] << 4)
                y[q + 32] = L[32 * ib + i + 4] | (L[32 * ib + i + 12] << 4)
                y[q + 48] = L[32 * ib + i + 20] | (L[32 * ib + i + 28] << 4)
    return y


def test_q4_k_r4_equals_repacked_q4_k():
    """A Q4_K_R4 tensor built by repacking random Q4_K rows decodes exactly as those Q4_K rows."""
    rng = np.random.default_rng(7)
    rows, nb = 8, 2
    std = np.zeros((rows, nb, 144), np.uint8)
    r4 = np.zeros((rows // 4, nb, 576), np.uint8)
    for g in range(rows // 4):
        for ibl in range(nb):
            quads = []
            for k in range(4):
                p = (np.float16(rng.uniform(0.001, 0.01)), np.float16(rng.uniform(0.001, 0.01)),
                     rng.integers(0, 64, 8), rng.integers(0, 64, 8), rng.integers(0, 16, 256))
                quads.append(p)
                std[4 * g + k, ibl] = _pack_q4_k(*p)
            r4[g, ibl] = _repack_q4_k_r4(quads)
    want = gguf.quants.dequantize(std.reshape(rows, -1), T.Q4_K)
    # as laid in the file: 4 consecutive row-slices of 288 bytes hold the interleaved super-blocks
    got = np.asarray(_jit_deq(jnp.asarray(r4.reshape(rows, -1)), by_name("Q4_K_R4"), 256 * nb))
    assert np.array_equal(got, want)


# ------------------------------------------------------------------------------------------ QuantArray


def test_quant_array_pytree_jit_and_errors():
    rng = np.random.default_rng(3)
    raw = random_bytes("Q8_0", (4, 6), 64, rng)          # 3-D: [experts, rows, row_bytes]
    qa = QuantArray.from_bytes(raw.reshape(-1), by_name("Q8_0"), (4, 6, 64))
    assert qa.data.shape == (4, 6, 68) and qa.nbytes == raw.size and qa.n_per_row == 64
    ref = gguf.quants.dequantize(raw, T.Q8_0)
    assert np.array_equal(np.asarray(qa.dequantize()), ref)
    leaves, tdef = jax.tree_util.tree_flatten(qa)
    assert len(leaves) == 1
    dev = jax.tree_util.tree_map(jnp.asarray, qa)
    f = jax.jit(lambda a, x: a.dequantize() @ x)
    x = jnp.ones((64, 2), jnp.float32)
    np.testing.assert_allclose(np.asarray(f(dev, x)), ref @ np.ones((64, 2), np.float32), rtol=1e-5)
    assert np.array_equal(np.asarray(jax.jit(lambda a: a.dequantize(jnp.bfloat16))(qa)).astype(np.float32),
                          ref.astype(jnp.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match="bytes"):
        QuantArray.from_bytes(raw.reshape(-1)[:-1], by_name("Q8_0"), (4, 6, 64))
    with pytest.raises(ValueError):
        QuantArray.from_bytes(raw, by_name("Q8_0"), (4, 6, 65))
    with pytest.raises(ValueError):
        dequantize(raw[..., :-2], by_name("Q8_0"), 64)


def test_unsupported_type_named():
    for name in ["Q8_K", "IQ2_KT", "IQ1_BN"]:
        qt = by_name(name)
        with pytest.raises(UnsupportedQuantType, match=name):
            dequantize(np.zeros((4, 64), np.uint8), qt, 256)
    with pytest.raises(UnsupportedQuantType):
        by_name("NOT_A_TYPE")
    # every id of ik's enum has a name
    for tid in [133, 134, 135, 137, 146, 151, 153, 156, 157, 158, 202, 219, 230, 335, 344, 352, 397, 398, 399]:
        assert lookup(tid) is not None, tid
