"""C++ row dequantizers of the K-quants and ik_llama.cpp's types (quant_matmul/cpu_kernel_kquants.cc).

They are reached through the CPU quantized matmul: y = eye(K) · Wᵀ picks every weight out once
(1·w plus exact zeros), so y must equal the jnp reference dequantization bit for bit (same f32
operations in the same order), at every instruction-set level this CPU runs (IKJAX_CPU_ISA caps
it per call: the generic, AVX2 and AVX-512 code paths are separate code)."""
from __future__ import annotations

import os

import ikjax  # noqa: F401  (type table first: pallas_kernels.quant_matmul imports it)
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.quant import QuantArray, by_name
from pallas_kernels import cpu as cpu_lib
from pallas_kernels.quant_matmul import cpu as qm_cpu
from pallas_kernels.testing import random_quant_array

if not cpu_lib.available():
    pytest.skip(cpu_lib.unavailable_reason(), allow_module_level=True)

# byte offsets of the f16 scales inside one block (random bytes there could be inf/NaN)
F16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
              "IQ4_XS": [0], "IQ2_K": [0], "IQ3_K": [0], "IQ4_K": [0], "IQ5_K": [0], "IQ6_K": [0],
              "Q6_0": [0]}
ROW_SCALED = ("IQ4_KS", "IQ5_KS", "IQ4_KSS", "IQ2_KS", "IQ3_KS")   # a scale at the start of each row
TYPES = list(F16_FIELDS) + list(ROW_SCALED)
SHAPES = [(17, 256), (3, 512), (1, 2048)]                          # odd row counts
LEVELS = ("generic", "avx2", "avx512", "amx")  # amx: an AMX host's best level (its own build)


def _best_level() -> str:
    old = os.environ.pop("IKJAX_CPU_ISA", None)
    try:
        return cpu_lib.isa()
    finally:
        if old is not None:
            os.environ["IKJAX_CPU_ISA"] = old


LEVELS_HERE = LEVELS[:LEVELS.index(_best_level()) + 1]


def random_weights(name: str, shape, rng, wild: bool = False) -> QuantArray:
    """Random valid weights. Types with a per-row scale are built here (their row starts with an f32
    or f16 scale before the blocks). wild=True: every f16 scale is random finite bits (subnormals,
    zeros, signs, up to 65504), which the generic level converts without F16C."""
    qt = by_name(name)
    N, K = shape
    if not wild and name not in ROW_SCALED:
        return random_quant_array(name, shape, rng, fast=True)
    nb = K // qt.block_elems
    raw = rng.integers(0, 256, (N, nb, qt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS.get(name, []):
        if wild:
            bits = rng.integers(0, 1 << 16, (N, nb), dtype=np.uint16)
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)   # no inf / NaN
            f = bits.view(np.float16)
        else:
            f = rng.uniform(-0.05, 0.05, (N, nb)).astype(np.float16)
        raw[..., off:off + 2] = f[..., None].view(np.uint8).reshape(N, nb, 2)
    raw = raw.reshape(N, -1)
    if qt.row_meta_bytes:
        dt = np.float32 if qt.row_meta_bytes == 4 else np.float16
        d = rng.uniform(-0.02, 0.02, (N, 1)).astype(dt)
        if wild and dt == np.float16:
            d[0, 0] = np.float16(3e-6)                                  # a subnormal f16 row scale
        raw = np.concatenate([d.view(np.uint8), raw], axis=1)
    assert raw.shape == (N, qt.row_bytes(K))
    return QuantArray.from_bytes(np.ascontiguousarray(raw), qt, shape)


_matmul = jax.jit(qm_cpu.quant_matmul)


def dequant_through_matmul(w: QuantArray, level: str) -> np.ndarray:
    os.environ["IKJAX_CPU_ISA"] = level
    try:
        assert cpu_lib.isa() == level
        K = w.shape[1]
        return np.asarray(_matmul(jnp.eye(K, dtype=jnp.float32), w)).T
    finally:
        del os.environ["IKJAX_CPU_ISA"]


def test_every_type_has_a_cpu_path():
    missing = [n for n in TYPES if not qm_cpu.supported(n)]
    assert not missing, f"no C++ dequantizer for {missing}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", TYPES)
def test_bit_exact_vs_reference(name, shape):
    rng = np.random.default_rng([TYPES.index(name), shape[1]])
    w = random_weights(name, shape, rng)
    ref = np.asarray(w.dequantize())
    assert np.isfinite(ref).all() and np.count_nonzero(ref) > ref.size // 2
    for level in LEVELS_HERE:
        y = dequant_through_matmul(w, level)
        bad = np.flatnonzero(y != ref)
        assert bad.size == 0, (f"{name} {shape} at {level}: {bad.size} values differ, first at "
                               f"{np.unravel_index(bad[0], y.shape)}: {y.flat[bad[0]]!r} vs {ref.flat[bad[0]]!r}")


@pytest.mark.parametrize("name", TYPES)
def test_bit_exact_with_extreme_scales(name):
    """Subnormal / huge / negative / zero f16 scales: the generic level's f16 conversion and every
    level's scale products stay exact."""
    rng = np.random.default_rng([TYPES.index(name), 99])
    w = random_weights(name, (5, 512), rng, wild=True)
    ref = np.asarray(w.dequantize())
    assert np.isfinite(ref).all()
    for level in LEVELS_HERE:
        np.testing.assert_array_equal(dequant_through_matmul(w, level), ref, err_msg=f"{name} at {level}")


def test_rows_of_a_row_scaled_type_use_their_own_scale():
    """The per-row header is read at each row's start: two rows equal but for their scale dequantize
    to values in that ratio (a kernel reading one scale for the whole tensor fails this)."""
    rng = np.random.default_rng(7)
    w = random_weights("IQ4_KS", (2, 512), rng)
    raw = np.array(w.data)
    raw[1] = raw[0]
    raw[1, :4] = (np.frombuffer(raw[0, :4].tobytes(), np.float32) * 2).view(np.uint8)
    w2 = QuantArray.from_bytes(raw, w.qtype, w.shape)
    y = dequant_through_matmul(w2, LEVELS_HERE[-1])
    assert np.count_nonzero(y[0]) > 400
    np.testing.assert_array_equal(y[1], 2 * y[0])
