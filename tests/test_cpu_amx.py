"""The amx level's prompt engine (issue 26 item 2; pallas_kernels/quant_matmul/cpu_amx.h,
cpu_kernel_amx.cc), in its int8 form (tdpbusd) and its bf16 form (tdpbf16ps, the default where the
CPU has amx_bf16; IKJAX_AMX=int8 keeps the int8 one), against the dequantize-and-multiply reference
(gguf.quants.dequantize).

Two halves:
- the engine on an exact scalar emulation of the AMX tile instructions (`_cpu.qmatmul_amx_emulated`,
  any CPU): its tile config, the tiles' shapes and addresses, the partial tiles (M, N not multiples of
  16 / 32), the VNNI panel layout and the per-block scaling, for every type it takes, on odd shapes.
  The emulation refuses what the hardware would fault on or compute wrongly (no config, palette not
  1, disagreeing tdpbusd shapes, tiles not released), which fails the call.
- the hardware (IKJAX_CPU_ISA=amx through the public product), only where the CPU has AMX and Linux
  grants its tile state; skipped elsewhere with the reason `ikjax info` gives.

The int8 form against f32 x @ dequantize(W).T of x rounded as the int8 paths round it (blocks of
32, scale max|x| / 127, nearest even): the int32 sums are exact, so 1e-5 of sum_k |x||w|; the bf16
form against bf16(x) @ bf16(dequantize(W)).T (f32 sums in another order, and a weight whose f32 value
lies on a bf16 rounding tie may round the other way: 1e-4 of sum_k |x||w|); both against x itself
within the int8 mode's X8_TOL (tests/test_cpu_quant_matmul.py).
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import ikjax  # noqa: F401  (first: the quant_matmul package imports ikjax, which imports it back)
from ikjax.quant import by_name
from pallas_kernels import cpu as _cpu
from pallas_kernels.testing import random_bytes

pytestmark = pytest.mark.skipif(not _cpu.available(), reason=_cpu.unavailable_reason() or "no C++ kernels")

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS"]
X8_TOL = 1e-2
# (M, N, K): M across one / two A tiles, partial tiles and several 32-row groups; N across partial
# 16-column B tiles and several 32-row panels; K odd block counts (K-quants: super-blocks of 256)
SHAPES = [(1, 7, 96), (17, 45, 160), (50, 33, 32), (33, 16, 224)]
SHAPES_K = [(1, 7, 256), (17, 45, 512), (50, 33, 256), (33, 16, 768)]


def _weights(name, N, K, rng):
    raw = random_bytes(name, (N,), K, rng, fast=True).reshape(N, -1)
    if name in ("Q4_1", "Q5_1"):  # a realistic minimum (random f16 bits can be huge)
        qt = by_name(name)
        blocks = raw.reshape(N, K // 32, qt.block_bytes)
        m = rng.uniform(-0.05, 0.05, (N, K // 32)).astype(np.float16)
        blocks[..., 2:4] = m[..., None].view(np.uint8).reshape(N, K // 32, 2)
    raw = np.ascontiguousarray(raw)
    wf = dequantize(raw, GGMLQuantizationType[name]).astype(np.float64).reshape(N, K)
    return raw, wf


def _x8(x):
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * iscale)
    return (q * (amax / np.float32(127))).astype(np.float32).reshape(x.shape)


def _bf16(a):
    import ml_dtypes
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _check(got, x, wf, what, bf16=False):
    """Against the form's own rounding of the operands (int8 form: x to 8 bits a block, 1e-5 of
    sum |x||w|; bf16 form: x and w to bf16, 1e-4), and against f32 within X8_TOL."""
    ref = _bf16(x) @ _bf16(wf).T if bf16 else _x8(x).astype(np.float64) @ wf.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wf).T
    err = (np.abs(got - ref) / (scale + 1e-30)).max()
    assert np.isfinite(got).all() and err < (1e-4 if bf16 else 1e-5), (what, err)
    err32 = (np.abs(got - x.astype(np.float64) @ wf.T) / (scale + 1e-30)).max()
    assert err32 < X8_TOL, (what, err32)




def _emulated(x, raw, name, N, bf16=False):
    M, K = x.shape
    tid = int(GGMLQuantizationType[name])
    y = _cpu._cpu.qmatmul_amx_emulated(x.tobytes(), M, K, raw.tobytes(), raw.shape[1], tid, N, bf16=bf16)
    return np.frombuffer(y, np.float32).reshape(M, N)


@pytest.mark.parametrize("name", TYPES)
def test_emulated_engine_every_type_odd_shapes(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    for M, N, K in SHAPES_K if name.endswith(("_K", "_XS")) else SHAPES:
        raw, wf = _weights(name, N, K, rng)
        x = rng.standard_normal((M, K)).astype(np.float32)
        x[0, :32] *= 40  # blocks of very different scales in one row
        _check(_emulated(x, raw, name, N), x, wf, (name, M, N, K))


@pytest.mark.parametrize("name", TYPES)
def test_emulated_bf16_form_every_type_odd_shapes(name):
    """The bf16 form: the int8 panel's values converted to dw * v + mw in bf16 pairs (B tiles of
    [k / 2][n][k % 2]), x in bf16 rows, C in f32 tiles over the whole K (partial groups of rows and
    panels of columns through the store buffer)."""
    rng = np.random.default_rng(sum(map(ord, name)) + 7)
    for M, N, K in SHAPES_K if name.endswith(("_K", "_XS")) else SHAPES + [(64, 32, 64)]:
        raw, wf = _weights(name, N, K, rng)
        x = rng.standard_normal((M, K)).astype(np.float32)
        x[0, :32] *= 40
        _check(_emulated(x, raw, name, N, bf16=True), x, wf, (name, M, N, K), bf16=True)


def test_emulated_engine_refuses_other_types():
    rng = np.random.default_rng(0)
    raw = random_bytes("Q6_K", (4,), 256, rng, fast=True).reshape(4, -1)
    x = np.ones((16, 256), np.float32)
    with pytest.raises(RuntimeError, match="not an AMX engine type"):
        _cpu._cpu.qmatmul_amx_emulated(x.tobytes(), 16, 256, raw.tobytes(), raw.shape[1],
                                       int(GGMLQuantizationType.Q6_K), 4)


def test_amx_level_reported_with_its_reason(monkeypatch):
    """Where AMX does not run, `ikjax info`'s line says why ("amx: cpu has no amx_int8", "amx: kernel
    refused XTILEDATA (...)"); IKJAX_CPU_ISA=amx then runs the best level there is."""
    monkeypatch.delenv("IKJAX_CPU_ISA", raising=False)
    best, why = _cpu.isa(), _cpu._cpu.amx_unavailable_reason()
    assert (best == "amx") == (why == ""), (best, why)
    monkeypatch.setenv("IKJAX_CPU_ISA", "amx")
    assert _cpu.isa() == best
    rep = _cpu.isa_report()
    if best != "amx":
        assert "; amx: " + why in rep, rep
    else:
        monkeypatch.setenv("IKJAX_AMX", "int8")
        assert "AMX int8 tiles" in _cpu.isa_report()
        monkeypatch.delenv("IKJAX_AMX")
        assert rep.startswith("amx (the best level compiled in)") and "AMX " in rep, rep
        monkeypatch.setenv("IKJAX_CPU_ISA", "avx512")
        assert _cpu.isa() == "avx512" and "capped by IKJAX_CPU_ISA=avx512; this CPU runs amx" in _cpu.isa_report()


def _has_amx():
    return _cpu.available() and _cpu._cpu.amx_unavailable_reason() == ""


@pytest.mark.skipif(not _has_amx(), reason="no AMX here: " + (_cpu._cpu.amx_unavailable_reason()
                                                             if _cpu.available() else "no C++ kernels"))
@pytest.mark.parametrize("min_rows", ["16", ""])
@pytest.mark.parametrize("form", ["int8", "bf16"])
@pytest.mark.parametrize("name", TYPES)
def test_hardware_amx_matches_reference_and_emulation(name, form, min_rows, monkeypatch):
    """The public product at the amx level (M >= IKJAX_AMX_MIN_ROWS on tiles: 16, and the default 32;
    fewer rows: the avx512 vpdpbusd kernel on the same panels, which for the K-quants come from the
    amx level's portable builder), 1 and 3 threads
    (tile state is per thread), against the reference and the emulated engine (int8: the same int32
    sums; bf16: the same bf16 operands, f32 sums in the tiles' order). The bf16 form where the CPU
    has amx_bf16 (else IKJAX_AMX=bf16 runs the int8 one, checked as such)."""
    import jax.numpy as jnp

    from ikjax.quant import QuantArray
    from pallas_kernels.quant_matmul import cpu
    monkeypatch.setenv("IKJAX_CPU_ISA", "amx")
    monkeypatch.setenv("IKJAX_AMX", form)
    if min_rows:
        monkeypatch.setenv("IKJAX_AMX_MIN_ROWS", min_rows)
    else:
        monkeypatch.delenv("IKJAX_AMX_MIN_ROWS", raising=False)
    assert _cpu.isa() == "amx"
    bf16 = form == "bf16" and "AMX bf16 tiles" in _cpu.isa_report()
    on_tiles = int(_cpu.isa_report().split("prompt products of ")[1].split("+")[0])
    assert on_tiles == (int(min_rows) if min_rows else 32)
    rng = np.random.default_rng(sum(map(ord, name)) + 1)
    kq = name.endswith(("_K", "_XS"))
    for M, N, K in [(5, 37, 256), (16, 32, 512), (17, 45, 256), (48, 100, 2048), (77, 300, 512)]:
        if not kq:
            K = K - 32 if K > 256 else K + 32  # odd block counts
        raw, wf = _weights(name, N, K, rng)
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = QuantArray.from_bytes(raw, by_name(name), (N, K))
        for n_threads in (1, 3):
            got = np.asarray(cpu.quant_matmul(jnp.asarray(x), w, n_threads=n_threads, compute="bf16"))
            tiles_bf16 = bf16 and M >= on_tiles  # (fewer rows: the int8 vpdpbusd kernel in both forms)
            _check(got, x, wf, (name, M, N, K, n_threads), bf16=tiles_bf16)
            emu = _emulated(x, raw, name, N, bf16=tiles_bf16)
            scale = np.abs(x).astype(np.float64) @ np.abs(wf).T
            tol = 1e-5 if tiles_bf16 else 1e-6
            assert (np.abs(got - emu) / (scale + 1e-30)).max() < tol, (name, M, N, K, n_threads)


@pytest.mark.skipif(not _has_amx(), reason="no AMX here: " + (_cpu._cpu.amx_unavailable_reason()
                                                             if _cpu.available() else "no C++ kernels"))
@pytest.mark.parametrize("name", TYPES)
def test_fused_bf16_panels_same_bits_as_two_passes(name, monkeypatch):
    """The bf16 tiles' panels built straight from the blocks (the default) give the bits of the two
    passes (int8 panel, then bf16: IKJAX_AMX_FUSED=0), every engine type, odd rows, columns (a last
    panel of fewer than 32 rows) and block counts, 1 and 3 threads; and the tiles' loop with its
    prefetch of x's rows (the default) the bits of the loop without it (IKJAX_AMX_PREFETCH=0)."""
    import jax.numpy as jnp

    from ikjax.quant import QuantArray
    from pallas_kernels.quant_matmul import cpu
    monkeypatch.setenv("IKJAX_CPU_ISA", "amx")
    monkeypatch.setenv("IKJAX_AMX", "bf16")
    monkeypatch.setenv("IKJAX_AMX_MIN_ROWS", "16")
    if "AMX bf16 tiles" not in _cpu.isa_report():
        pytest.skip("this CPU's AMX has no bf16 tiles (amx_bf16)")
    rng = np.random.default_rng(sum(map(ord, name)) + 7)
    kq = name.endswith(("_K", "_XS"))
    for M, N, K in [(16, 45, 256), (33, 70, 512), (77, 300, 2048), (130, 40, 512)]:
        if not kq:
            K = K - 32 if K > 256 else K + 32
        raw, _ = _weights(name, N, K, rng)
        x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
        w = QuantArray.from_bytes(raw, by_name(name), (N, K))
        for n_threads in (1, 3):
            monkeypatch.setenv("IKJAX_AMX_FUSED", "0")
            two = np.asarray(cpu.quant_matmul(x, w, n_threads=n_threads, compute="bf16"))
            monkeypatch.delenv("IKJAX_AMX_FUSED")
            fused = np.asarray(cpu.quant_matmul(x, w, n_threads=n_threads, compute="bf16"))
            monkeypatch.setenv("IKJAX_AMX_PREFETCH", "0")
            plain = np.asarray(cpu.quant_matmul(x, w, n_threads=n_threads, compute="bf16"))
            monkeypatch.delenv("IKJAX_AMX_PREFETCH")
            assert np.isfinite(fused).all()
            np.testing.assert_array_equal(fused, two, err_msg=str((name, M, N, K, n_threads)))
            np.testing.assert_array_equal(plain, fused, err_msg=str(("prefetch", name, M, N, K, n_threads)))


@pytest.mark.skipif(not _has_amx(), reason="no AMX here: " + (_cpu._cpu.amx_unavailable_reason()
                                                             if _cpu.available() else "no C++ kernels"))
@pytest.mark.parametrize("level", ["amx", "avx512"])
@pytest.mark.parametrize("name", TYPES)
def test_vector_scales_same_bits_as_row_by_row(name, level, monkeypatch):
    """The panel builders' scales gathered for 16 rows at once (wscale16, the default) give the bits
    of the scales read row by row (IKJAX_AMX_VSCALE=0): both panel forms (the amx level's bf16 tiles,
    the avx512 level's int8 panels for vpdpbusd), a last panel of fewer than 16 and of 16-31 rows
    (masked gathers), K-quant blocks in both halves of a super-block, 1 and 3 threads. A gather at a
    wrong offset, a wrong shift or an unmasked missing row fails it."""
    import jax.numpy as jnp

    from ikjax.quant import QuantArray
    from pallas_kernels.quant_matmul import cpu
    monkeypatch.setenv("IKJAX_CPU_ISA", level)
    monkeypatch.setenv("IKJAX_AMX_MIN_ROWS", "16")
    rng = np.random.default_rng(sum(map(ord, name)) + 11)
    kq = name.endswith(("_K", "_XS"))
    for M, N, K in [(20, 7, 256), (33, 45, 512), (40, 300, 1024)]:
        if not kq:
            K = K + 32
        raw, wf = _weights(name, N, K, rng)
        x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
        w = QuantArray.from_bytes(raw, by_name(name), (N, K))
        for n_threads in (1, 3):
            vec = np.asarray(cpu.quant_matmul(x, w, n_threads=n_threads, compute="bf16"))
            monkeypatch.setenv("IKJAX_AMX_VSCALE", "0")
            rows = np.asarray(cpu.quant_matmul(x, w, n_threads=n_threads, compute="bf16"))
            monkeypatch.delenv("IKJAX_AMX_VSCALE")
            _check(vec, np.asarray(x), wf, (name, M, N, K, n_threads), bf16=level == "amx")
            np.testing.assert_array_equal(vec, rows, err_msg=str((name, level, M, N, K, n_threads)))


def test_a_cap_that_is_no_level_is_named_so(monkeypatch):
    """IKJAX_CPU_ISA set to no level's name (AVX2, bogus) leaves the best level running, and the
    report says the value is not a level (it said the value "asks for more than the CPU has");
    an engine's load refuses it earlier (env.check_native)."""
    monkeypatch.delenv("IKJAX_CPU_ISA", raising=False)
    best = _cpu.isa()
    for bad in ("AVX2", "bogus"):
        monkeypatch.setenv("IKJAX_CPU_ISA", bad)
        assert _cpu.isa() == best
        rep = _cpu.isa_report()
        assert f"IKJAX_CPU_ISA={bad} is not a level" in rep and "asks for more" not in rep, rep
