"""C++ CPU quantized matmul (pallas_kernels/quant_matmul/cpu*.{cc,py}) against the jnp reference.

Every type with a C++ path x odd shapes (M in 1, 3, 17, 512; N in 1, 7, 37, 300; K a multiple of the
block) x thread counts x instruction-set levels (IKJAX_CPU_ISA). The full cross product would take
minutes on 2 cores, so each type runs a fixed sample of it that still touches every M, N, K, thread
count and level (decode engine for M < 4, packed-panel engine above; partial panels from odd N; the
K-split decode path from N = 1).

compute="bf16" is the fast mode: bf16 products for prompt-sized calls (M >= 4, against the bf16
reference at 2e-3) and, at the avx512 (VNNI) and avx2 levels for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
IQ4_NL, 8-bit activations for decode-sized ones (M < 4): x quantized per block of 32 (dx = max|x| / 127,
round to nearest even) and int8 dot products; the K-quants and IQ4_XS likewise (X8_KQ_TYPES; at
avx2 with one x scale per 256 values, Q8_K's grouping: `_x8_group`; the avx2 IQ4_XS prompt engine
too with IKJAX_IQ4XS_K256=1). At the
avx512 and avx2 levels Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL prompt-sized calls take the same 8-bit
activations (the int8 prompt engine, X8_PROMPT_TYPES), and so do Q4_K, Q5_K and IQ4_XS
(X8_PROMPT_KQ). Each level runs where the CPU has it (IKJAX_CPU_ISA caps; _is_x8 asks the level
that actually ran). Those are checked twice: against the f32 reference of
the 8-bit-rounded x (`_x8`: the same function, so 1e-5), and against the f32 reference of x itself
with the mode's stated tolerance X8_TOL = 1e-2 of sum_k |x||w| per element (measured on these
Gaussian activations: <= 3e-3 at K = 32..96, ~5e-4 at K = 2048; norm-relative ~0.5-0.8 %). The
generic level and the other types compute decode in f32 in that mode (1e-5).
"""
from __future__ import annotations

import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ikjax  # noqa: F401  (first: the quant_matmul package imports ikjax, which imports it back)
from ikjax.quant import QuantArray, by_name
from pallas_kernels import cpu as _cpu
from pallas_kernels.quant_matmul import cpu
from pallas_kernels.quant_matmul.reference import quant_matmul_ref
from pallas_kernels.testing import random_bytes

pytestmark = pytest.mark.skipif(not _cpu.available(), reason=_cpu.unavailable_reason() or "no C++ kernels")

LEGACY = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"]
# issue 9's fast-path list beyond the legacy types (cpu_kernel_kquants.cc)
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_K", "IQ4_KS", "IQ2_K", "IQ3_K", "IQ5_K", "IQ6_K"]
ISAS = ["generic", "avx2", "avx512"]
MS, NS, THREADS = (1, 3, 17, 512), (1, 7, 37, 300), (1, 2)
X8_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}  # the int8 decode's types (cpu_kernel.cc)
X8_TOL = 1e-2
# the int8 prompt engine's types (avx512 VNNI and avx2 vpmaddubsw; Q4_1 / Q5_1 with the minimum's share
# from x's block sums)
X8_PROMPT_TYPES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"}
# K-quants in the int8 decode (avx512 VNNI and avx2 vpmaddubsw; f32 decode at generic)
X8_KQ_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
# K-quants in the avx2 int8 prompt engine (one scale per 32 weights; the avx512 level keeps bf16 for them)
X8_PROMPT_KQ = {"Q4_K", "Q5_K", "IQ4_XS"}


def _is_x8(name, M, compute):
    """Whether this call takes 8-bit activations at the current level (module doc)."""
    if compute == "bf16" and name in X8_KQ_TYPES:
        if M >= 4:  # every level's int8 prompt engine (the amx level's: tests/test_cpu_amx.py too)
            return _cpu.isa() in ("avx2", "avx512", "amx") and name in X8_PROMPT_KQ
        return _cpu.isa() in ("avx2", "avx512", "amx")
    if compute != "bf16" or name not in X8_TYPES:
        return False
    if M < 4:
        return _cpu.isa() in ("avx2", "avx512", "amx")
    return _cpu.isa() in ("avx2", "avx512", "amx") and name in X8_PROMPT_TYPES


def _x8_group(name, M):
    """Values sharing one x scale in the int8 path this call takes: 256 in the avx2 K-quant /
    IQ4_XS decode (Q8_K's grouping, decode_kqa) and, with IKJAX_IQ4XS_K256=1, the avx2 IQ4_XS
    prompt engine (QM_Q8K); 32 elsewhere."""
    if _cpu.isa() != "avx2":
        return 32
    k256 = os.environ.get("IKJAX_IQ4XS_K256") == "1" and name == "IQ4_XS"
    return 256 if (M < 4 and name in X8_KQ_TYPES) or k256 else 32


def _x8(x, group=32):
    """x as the int8 paths see it: groups of `group` values scaled by 127 / max|x| in float32,
    rounded to nearest even, times max|x| / 127."""
    x = np.asarray(x, np.float32)
    b = x.reshape(*x.shape[:-1], -1, group)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * iscale)
    assert np.abs(q).max() <= 127
    return jnp.asarray((q * (amax / np.float32(127))).astype(np.float32).reshape(x.shape))


def _weights(name: str, N: int, K: int, rng) -> QuantArray:
    """Random valid blocks; every f16 field (scale and, for Q4_1/Q5_1, the minimum) a finite
    realistic value, so the reference is finite and a wrong field shows as a large error."""
    qt = by_name(name)
    raw = random_bytes(name, (N,), K, rng, fast=True)
    if qt.row_meta_bytes:  # ik's per-row prefix (a float32 row scale for the *_KS types)
        assert qt.row_meta_bytes == 4, name
        d = rng.uniform(0.5, 1.5, (N, 1)).astype(np.float32).view(np.uint8)
        raw = np.concatenate([d, raw.reshape(N, -1)], axis=1)
    if name in ("Q4_1", "Q5_1"):
        blocks = raw.reshape(N, K // 32, qt.block_bytes)
        m = rng.uniform(-0.05, 0.05, (N, K // 32)).astype(np.float16)
        blocks[..., 2:4] = m[..., None].view(np.uint8).reshape(N, K // 32, 2)
    return QuantArray.from_bytes(np.ascontiguousarray(raw.reshape(N, -1)), qt, (N, K))


def _ks(name: str):
    be = by_name(name).block_elems
    return [k for k in (32, 256, 2048) if k % be == 0] if be > 1 else [32, 256, 2048, 45]


def _cases(name: str):
    """A deterministic sample of M x N x K x threads x ISA: every value of each axis appears, with
    the large shapes (M = 512 with K = 2048 and N = 300) a few times only (2-core time budget)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    cases = []
    for i, (M, N) in enumerate(itertools.product(MS, NS)):
        # every level over the shapes; the cheap decode shapes at two levels each
        for isa in (ISAS[i % 3],) + ((ISAS[(i + 1) % 3],) if M < 17 else ()):
            ks = _ks(name)
            K = ks[rng.integers(len(ks))]
            if M * N * K > 512 * 37 * 2048 and rng.random() > 0.3:  # keep big products rare
                K = ks[0]
            cases.append((M, N, K, int(THREADS[rng.integers(2)]), isa))
    return cases


def _check(name, M, N, K, n_threads, isa, compute="f32", monkeypatch=None):
    rng = np.random.default_rng(M * 1_000_003 + N * 1009 + K)
    w = _weights(name, N, K, rng)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    monkeypatch.setenv("IKJAX_CPU_ISA", isa)
    got = np.asarray(cpu.quant_matmul(x, w, n_threads=n_threads, compute=compute))
    # bf16 mode: bf16 products for prompt-sized calls; decode-sized ones (fewer than 4 rows) take
    # 8-bit activations where the level and type have the int8 path, f32 elsewhere; Q8_0 / Q4_0
    # prompt-sized ones 8-bit activations at avx512 (module doc)
    x8 = _is_x8(name, M, compute)
    ref_dtype = jnp.float32 if compute == "f32" or M < 4 or x8 else jnp.bfloat16
    ref = np.asarray(quant_matmul_ref(_x8(x, _x8_group(name, M)) if x8 else x, w, ref_dtype))
    assert got.shape == (M, N)
    # error relative to sum_k |x||w| (what rounding scales with; a cancelling sum can be ~0)
    scale = np.abs(np.asarray(x)) @ np.abs(np.asarray(w.dequantize(jnp.float32))).T
    err = (np.abs(got - ref) / (scale + 1e-30)).max()
    tol = 1e-5 if ref_dtype == jnp.float32 else 2e-3
    assert np.isfinite(got).all() and err < tol, (name, M, N, K, n_threads, isa, compute, err)
    if x8:  # the mode's tolerance against the f32 function of x itself
        ref32 = np.asarray(quant_matmul_ref(x, w, jnp.float32))
        err32 = (np.abs(got - ref32) / (scale + 1e-30)).max()
        assert 1e-6 < err32 < X8_TOL, (name, M, N, K, n_threads, isa, err32)


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_types_every_shape_level_thread(name, monkeypatch):
    assert cpu.supported(name), name
    for M, N, K, nt, isa in _cases(name):
        _check(name, M, N, K, nt, isa, monkeypatch=monkeypatch)


@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_types(name, monkeypatch):
    assert cpu.supported(name), name
    for M, N, K, nt, isa in _cases(name)[::3]:
        _check(name, M, N, K, nt, isa, monkeypatch=monkeypatch)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "F16", "Q6_K", "Q4_K", "Q5_K",
                                  "IQ4_XS"])
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_compute(name, isa, monkeypatch):
    """compute='bf16': prompt-sized products (x and W rounded to bf16, f32 accumulation) against the
    bf16 reference; decode-sized ones against the 8-bit-activation function (int8 types at avx2 and
    avx512) or f32. Odd block counts (K = 96, 224, 448: the int8 path's one-block tail after 0, 1 and 3
    four-block steps; at M = 1 with an odd number of rows, so the two-rows-per-pass decode has a row
    left over) and the K-split decode (N = 1, K = 4096, 2 threads)."""
    for M, N, K, nt in [(1, 37, 256, 2), (3, 7, 2048, 2), (2, 300, 224, 1), (1, 64, 96, 2), (1, 1, 4096, 2),
                        (1, 45, 224, 2), (1, 9, 448, 1),
                        (2, 1, 8192, 1), (17, 300, 256, 2), (512, 37, 256, 2),
                        # the int8 prompt engine: odd block counts (a pair's missing second block),
                        # partial 32-row panels, 1-3 leftover x rows of its 4-row microkernel,
                        # more than one 8-block K chunk
                        (4, 1, 32, 1), (5, 33, 96, 2), (7, 31, 288, 1), (48, 64, 2048, 2), (18, 65, 544, 2),
                        # the avx2 engine's 8-row panels and 16-block K chunks for the super-block
                        # types too: partial panels (N = 9, 65), leftover rows (M = 7), 3 and 5
                        # super-blocks (K chunks ending inside one)
                        (7, 65, 768, 2), (4, 9, 1280, 1)]:
        if K % by_name(name).block_elems:
            continue
        _check(name, M, N, K, nt, isa, compute="bf16", monkeypatch=monkeypatch)


@pytest.mark.parametrize("form", ["1", "0"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_nibble_decode_groups_of_four(name, form, monkeypatch):
    """The avx2 level's nibble-type decode (IKJAX_NIB4=1: 4 blocks folded by vphaddw before one
    convert and FMA; =0: one block at a time) against the 8-bit-activation reference, with 0-3
    blocks left after the groups (K = 96, 224, 448, 2048) and an odd row count at M = 1 (the
    two-rows pass's leftover row), and each x row's result the same bits alone (M = 1) as in a
    batch of 3 (a server's rows must not depend on their neighbours)."""
    monkeypatch.setenv("IKJAX_NIB4", form)
    for M, N, K, nt in [(1, 37, 96, 2), (1, 45, 224, 1), (2, 9, 448, 2), (3, 64, 2048, 2), (1, 1, 4096, 2)]:
        _check(name, M, N, K, nt, "avx2", compute="bf16", monkeypatch=monkeypatch)
    rng = np.random.default_rng(7)
    w = _weights(name, 33, 224, rng)
    x = jnp.asarray(rng.standard_normal((3, 224)).astype(np.float32))
    batch = np.asarray(cpu.quant_matmul(x, w, n_threads=2, compute="bf16"))
    for m in range(3):
        alone = np.asarray(cpu.quant_matmul(x[m:m + 1], w, n_threads=2, compute="bf16"))
        assert np.array_equal(alone[0], batch[m]), (name, form, m)


@pytest.mark.parametrize("name", sorted(X8_KQ_TYPES))
@pytest.mark.parametrize("isa", ISAS)
def test_kquant_int8_decode(name, isa, monkeypatch):
    """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS decode in the fast mode: at avx512, 8-bit activations
    per block of 32 and VNNI dot products on the super-blocks' own quants (cpu_kernel.cc, decode_kq8;
    Q2_K / Q3_K decode_kq2, with x laid out to their 2-bit fields),
    checked against the f32 function of the 8-bit x (1e-5: the int32 sums are exact, so a wrong code,
    scale, minimum or offset share shows) and against the f32 product within X8_TOL (and > 1e-6 from
    it: the int8 path really ran); at avx2 and generic the f32 decode (1e-5). M = 1..3 (M = 4 is
    prompt-sized: bf16), odd N (the M = 1 two-rows-per-pass split has a row over), one and many
    super-blocks, the K-split decode (N = 1), 1 and 2 threads."""
    for M, N, K, nt in [(1, 37, 256, 2), (2, 5, 768, 1), (3, 9, 2048, 2), (4, 7, 512, 2), (1, 1, 4096, 2),
                        (1, 301, 2560, 2), (2, 33, 256, 2), (3, 1, 1280, 1)]:
        _check(name, M, N, K, nt, isa, compute="bf16", monkeypatch=monkeypatch)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_decode_nonfinite_x_propagates(isa, monkeypatch):
    """A NaN or inf in x reaches y as NaN/inf in the 8-bit-activation decode too (max|x| drops a NaN,
    so the kernel marks the block's scale), not a silently finite result; the same for prompt-sized
    calls (M = 5: the int8 prompt engine at avx512, bf16 elsewhere)."""
    monkeypatch.setenv("IKJAX_CPU_ISA", isa)
    rng = np.random.default_rng(5)
    for name in ("Q8_0", "Q4_0", "Q5_1", "Q4_K", "IQ4_XS"):  # (the last two: x per 256 at avx2)
        w = _weights(name, 7, 256, rng)
        for bad in (np.nan, np.inf):
            for M in (2, 5):
                x = rng.standard_normal((M, 256)).astype(np.float32)
                x[0, 37] = bad
                got = np.asarray(cpu.quant_matmul(jnp.asarray(x), w, n_threads=2, compute="bf16"))
                assert not np.isfinite(got[0]).any(), (name, bad, isa, M)
                assert np.isfinite(got[1:]).all(), (name, bad, isa, M)
                # an inf's row: NaN or the reference's own inf, never an inf of the other sign (its
                # codes were the integer-indefinite -128, scaled by inf: an outside probe, stop 68)
                ref = np.asarray(quant_matmul_ref(jnp.asarray(x[:1]), w, jnp.float32))[0]
                assert (np.isnan(got[0]) | (got[0] == ref)).all(), (name, bad, isa, M, got[0], ref)


def test_k_split_decode_and_threads_agree(monkeypatch):
    """N smaller than the threads' share takes the K-split path: same numbers as 1 thread."""
    rng = np.random.default_rng(1)
    w = _weights("Q8_0", 1, 4096, rng)
    x = jnp.asarray(rng.standard_normal((2, 4096)).astype(np.float32))
    ref = np.asarray(quant_matmul_ref(x, w, jnp.float32))
    for nt in (1, 2):
        got = np.asarray(cpu.quant_matmul(x, w, n_threads=nt))
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_0", "Q4_K", "IQ4_XS", "Q6_K"])
def test_row_split_same_bits_as_columns_only(name, monkeypatch):
    """A prompt product with few column units for the threads (a router: 64 columns at -t 16) splits
    x's rows too (IKJAX_CPU_ROW_SPLIT, the default), each part packed and run on its own: the same
    bits as the columns-only split (=0), at every level this CPU has (amx included), f32 and bf16
    compute, 1-3 threads, rows that are not a multiple of a part, a last partial column unit. A
    mutation that offsets a part's output rows or packs the wrong rows fails it. So do parts of at
    most 64 rows for any product (IKJAX_CPU_PART_ROWS=64)."""
    levels = [lv for lv in ISAS + ["amx"] if lv != "amx" or "amx" in _cpu.isa_report()]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    K = 512
    for M, N in [(200, 45), (513, 64), (130, 7)]:
        w = _weights(name, N, K, rng)
        x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
        for lv, compute, nt in itertools.product(levels, ("f32", "bf16"), (1, 2, 3)):
            monkeypatch.setenv("IKJAX_CPU_ISA", lv)
            monkeypatch.setenv("IKJAX_CPU_ROW_SPLIT", "0")
            cols = np.asarray(cpu.quant_matmul(x, w, n_threads=nt, compute=compute))
            monkeypatch.setenv("IKJAX_CPU_ROW_SPLIT", "1")
            rows = np.asarray(cpu.quant_matmul(x, w, n_threads=nt, compute=compute))
            monkeypatch.setenv("IKJAX_CPU_PART_ROWS", "64")
            parts = np.asarray(cpu.quant_matmul(x, w, n_threads=nt, compute=compute))
            monkeypatch.delenv("IKJAX_CPU_PART_ROWS")
            assert np.isfinite(rows).all()
            np.testing.assert_array_equal(rows, cols, err_msg=str((name, M, N, lv, compute, nt)))
            np.testing.assert_array_equal(parts, cols, err_msg=str(("parts", name, M, N, lv, compute, nt)))


def test_leading_dims_jit_and_vmap():
    """x [..., K] keeps its leading dims; works inside jit and under vmap (batched x)."""
    rng = np.random.default_rng(2)
    w = _weights("Q4_0", 37, 256, rng)
    x = jnp.asarray(rng.standard_normal((2, 5, 256)).astype(np.float32))
    ref = np.asarray(quant_matmul_ref(x, w, jnp.float32))
    got = np.asarray(jax.jit(lambda a: cpu.quant_matmul(a, w))(x))
    assert got.shape == (2, 5, 37)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    got_v = np.asarray(jax.vmap(lambda a: cpu.quant_matmul(a, w))(x))
    np.testing.assert_allclose(got_v, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_bad_calls_are_refused():
    rng = np.random.default_rng(3)
    w = _weights("Q8_0", 7, 64, rng)
    with pytest.raises(ValueError, match="compute"):
        cpu.quant_matmul(jnp.ones((1, 64)), w, compute="fp8")
    with pytest.raises(ValueError, match="columns"):
        cpu.quant_matmul(jnp.ones((1, 32)), w)
    assert not cpu.supported("NO_SUCH_TYPE")


def test_no_output_columns():
    """N = 0 gives an empty [.., 0] (its bytes have no rows to be reshaped by; found by fuzzing)."""
    w = QuantArray(np.zeros((0, 34), np.uint8), by_name("Q8_0"), (0, 32))
    y = cpu.quant_matmul(jnp.ones((3, 32)), w)
    assert y.shape == (3, 0) and y.dtype == jnp.float32


def test_issue_types_all_supported():
    """Issue 9's fast-path list: every type has a C++ path (legacy here, the rest in cpu_kernel_kquants.cc)."""
    missing = [t for t in LEGACY + KQUANTS if not cpu.supported(t)]
    assert not missing


def test_heads_product_with_no_columns():
    """N = 0 heads: an empty result of the right shape (it raised ZeroDivisionError), as
    quant_matmul gives for N = 0."""
    w = QuantArray.from_bytes(np.zeros((3, 0, 34), np.uint8), by_name("Q8_0"), (3, 0, 32))
    assert cpu.quant_matmul_heads(jnp.ones((2, 3, 32)), w).shape == (2, 3, 0)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q6_K", "IQ4_K"])
def test_heads_product(name, monkeypatch):
    """quant_matmul_heads (MLA's per-head W_kb / W_vb products, one call for all heads) against the
    einsum of the dequantized heads, f32 and bf16, 1 and 2 threads, odd head counts and row counts
    (5 x 37: the threads' chunks of the G * N rows straddle head boundaries)."""
    rng = np.random.default_rng(7)

    def heads(shape):  # [H, N, K] built from _weights' valid rows
        qa = _weights(name, shape[0] * shape[1], shape[2], rng)
        return QuantArray(qa.data.reshape(shape[0], shape[1], -1), qa.qtype, shape)
    K = 256
    for H, N, lead in ((1, 37, (1,)), (3, 64, (2, 5)), (5, 37, (1,)), (16, 128, (1, 1))):
        w = heads((H, N, K))
        x = jnp.asarray(rng.standard_normal((*lead, H, K)), jnp.float32)
        ref = np.asarray(jnp.einsum("...hk,hnk->...hn", x, w.dequantize(jnp.float32), precision="highest"))
        for nt in (1, 2):
            got = np.asarray(cpu.quant_matmul_heads(x, w, n_threads=nt))
            assert got.shape == ref.shape
            assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (name, H, N, lead, nt)
        got16 = np.asarray(cpu.quant_matmul_heads(x.reshape(-1, H, K), w, compute="bf16"))
        err = np.linalg.norm(got16 - ref.reshape(-1, H, N)) / np.linalg.norm(ref)
        assert err < 1e-2
    # prompt-sized rows in bf16 mode at every level (the avx512 int8 prompt engine for Q8_0 / Q4_0)
    H, N = 3, 64
    w = heads((H, N, K))
    x = jnp.asarray(rng.standard_normal((17, H, K)), jnp.float32)
    ref = np.asarray(jnp.einsum("mhk,hnk->mhn", x, w.dequantize(jnp.float32), precision="highest"))
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        got16 = np.asarray(cpu.quant_matmul_heads(x, w, compute="bf16"))
        err = np.linalg.norm(got16 - ref) / np.linalg.norm(ref)
        assert 1e-5 < err < 1e-2, (isa, err)
    with pytest.raises(ValueError, match="3-D"):
        cpu.quant_matmul_heads(x, _weights(name, N, K, rng))


@pytest.mark.parametrize("isa,ub", [("avx2", 1), ("avx512", 1), ("avx512", 512)])
def test_x8_decode_tolerance_on_dense_fixture(isa, ub, monkeypatch):
    """The 8-bit-activation decode through the whole model: the dense V3 fixture (every expert
    active, so the fused MoE's per-expert rows take it too) in Q8_0, its 96 tokens run one at a time
    (ub=1: every product has M = 1) with dtype="bf16". Measured 4.3e-2 of the logits' norm against
    the reference, the size of the fixtures README's 4.5 % for Q8_0 weight rounding on this d=256
    model (the same 8 bits, now on activations); the bf16 prompt mode on it is 1.8e-2. Stated
    tolerance 6e-2; and >1e-2 from the f32 run, so the int8 products really ran. ub=512 at avx512:
    the whole prompt in one step, every product through the int8 prompt engine (4.3e-2 as well)."""
    from conftest import fixture_entry, fixtures_dir, load_ref, rel_err  # skips without the fixtures
    monkeypatch.setenv("IKJAX_CPU_ISA", isa)
    entry = fixture_entry("v3dense-all-Q8_0.gguf")
    tokens, ref = load_ref(entry, "ref_kbvb")
    path = fixtures_dir() / entry["file"]
    fast = ikjax.load(path, mla=1, fa=True, ctk="f32", dtype="bf16", ub=ub).logits(tokens)
    exact = ikjax.load(path, mla=1, fa=True, ctk="f32", dtype="f32", ub=ub).logits(tokens)
    assert rel_err(exact, ref) <= entry["tol"]
    assert rel_err(fast, ref) <= 6e-2 and rel_err(fast, exact) > 1e-2, (rel_err(fast, ref), rel_err(fast, exact))


@pytest.mark.parametrize("cap", ["", "generic", "avx2", "avx512", "amx"])
def test_isa_report_names_the_level_and_why(cap, monkeypatch):
    """`ikjax info`'s "cpu kernels" line (issue 26): the level that runs (what the dispatch uses,
    _cpu.isa()), why (IKJAX_CPU_ISA's cap, or the features a higher compiled-in level needs that the
    CPU lacks) and whether the int8 paths run there."""
    from typer.testing import CliRunner

    from ikjax.cli import app
    monkeypatch.setenv("IKJAX_CPU_ISA", cap)
    level = _cpu.isa()
    monkeypatch.delenv("IKJAX_CPU_ISA")
    best = _cpu.isa()
    monkeypatch.setenv("IKJAX_CPU_ISA", cap)
    rep = _cpu.isa_report()
    assert rep.startswith(level + " ("), rep
    assert ("capped by IKJAX_CPU_ISA=" + cap in rep) == (level != best), rep
    if level == best and best not in ("avx512", "amx", "generic"):
        assert "avx512 compiled in, CPU lacks avx512" in rep, rep  # x86 builds compile every level
    assert ("int8 decode and prompt products" in rep) == (level != "generic"), rep
    res = CliRunner().invoke(app, ["info", "synthetic:tiny"])
    assert res.exit_code == 0, res.output
    assert f"cpu kernels    {rep}" in res.output, res.output


def _avx_vnni_runs() -> bool:
    import os
    saved = os.environ.get("IKJAX_CPU_ISA")
    os.environ["IKJAX_CPU_ISA"] = "avx2"
    try:
        return _cpu.available() and "AVX-VNNI" in _cpu.isa_report()
    finally:
        if saved is None:
            del os.environ["IKJAX_CPU_ISA"]
        else:
            os.environ["IKJAX_CPU_ISA"] = saved


@pytest.mark.skipif(not _avx_vnni_runs(), reason="the CPU has no AVX-VNNI (or the avxvnni objects are not built): "
                                                  "the avx2 level runs its plain AVX2 build here")
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_avx_vnni_build_gives_the_avx2_integers(name, monkeypatch):
    """The avx2 level's AVX-VNNI build (vpdpbusd where AVX2 takes vpmaddubsw + vpmaddwd +
    vpaddd) computes the same int32 sums, so every int8 product of the level, decode-sized (M = 1, 3)
    and prompt-sized (the int8 engine, M = 5, 48), is bit for bit the one without it
    (IKJAX_AVXVNNI=0), and `ikjax info` names the instructions."""
    monkeypatch.setenv("IKJAX_CPU_ISA", "avx2")
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    K = 512
    raw = random_bytes(name, (96,), K, rng, fast=True).reshape(96, -1)
    w = QuantArray.from_bytes(np.ascontiguousarray(raw), by_name(name), (96, K))
    for M in (1, 3, 5, 48):
        x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
        out = {}
        for vnni in ("1", "0"):
            monkeypatch.setenv("IKJAX_AVXVNNI", vnni)
            assert ("AVX-VNNI" in _cpu.isa_report()) == (vnni == "1")
            out[vnni] = np.asarray(cpu.quant_matmul(x, w, n_threads=2, compute="bf16"))
        assert np.isfinite(out["1"]).all()
        np.testing.assert_array_equal(out["1"], out["0"], err_msg=f"{name} M={M}")


def _avx2_runs() -> bool:
    import os
    saved = os.environ.get("IKJAX_CPU_ISA")
    os.environ["IKJAX_CPU_ISA"] = "avx2"
    try:
        return _cpu.available() and _cpu.isa() == "avx2"
    finally:
        if saved is None:
            del os.environ["IKJAX_CPU_ISA"]
        else:
            os.environ["IKJAX_CPU_ISA"] = saved


@pytest.mark.parametrize("vnni", ["1", "0"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "IQ4_NL", "Q4_K", "Q5_K", "IQ4_XS"])
def test_two_panel_kernel_same_bits_as_one_panel(name, vnni, monkeypatch):
    """The avx2 level's prompt products take their 8-row panels in pairs (micro_q8x2, IKJAX_Q8X2, the
    default), in the AVX-VNNI build (6 x rows a call) and the plain AVX2 one (IKJAX_AVXVNNI=0: 4 rows,
    the Q4 nibble types; the others stay one panel a call there): the same bits as one panel at a time (=0) for x rows that are not a multiple of
    the call's (1 .. 5 left over), panel groups with an odd panel and a partial last one (N = 88: 11
    panels; N = 100: 12 and 4 rows), several K chunks (K = 1024: the chunk sums added to C), 1-2
    threads; and close to the reference. The same for the loops with pinned accumulators (IKJAX_Q8_PINNED,
    the default) against the loops before them (=0), each way. A pair whose second panel's output lands on
    the first's columns, or a chunk's sum that replaces C, fails it."""
    if vnni == "1" and not _avx_vnni_runs():
        pytest.skip("the CPU has no AVX-VNNI (or the avxvnni objects are not built)")
    if not _avx2_runs():
        pytest.skip("the CPU has no AVX2")
    monkeypatch.setenv("IKJAX_CPU_ISA", "avx2")
    monkeypatch.setenv("IKJAX_AVXVNNI", vnni)
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 7)
    K = 1024
    for M, N in [(13, 88), (50, 100), (64, 64)]:
        w = _weights(name, N, K, rng)
        x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
        for nt in (1, 2):
            out = {}
            for v in ("0", "1"):
                for pinned in ("0", "1"):
                    monkeypatch.setenv("IKJAX_Q8X2", v)
                    monkeypatch.setenv("IKJAX_Q8_PINNED", pinned)
                    out[v + pinned] = np.asarray(cpu.quant_matmul(x, w, n_threads=nt, compute="bf16"))
            assert np.isfinite(out["11"]).all()
            for form in ("10", "01", "00"):
                np.testing.assert_array_equal(out["11"], out[form], err_msg=str((name, M, N, nt, form)))
            out["1"] = out["11"]
        ref = np.asarray(quant_matmul_ref(x, w, jnp.float32))
        scale = np.abs(np.asarray(x)) @ np.abs(np.asarray(quant_matmul_ref(jnp.eye(K, dtype=jnp.float32), w, jnp.float32)))
        assert (np.abs(out["1"] - ref) <= X8_TOL * scale + 1e-6).all(), (name, M, N)
