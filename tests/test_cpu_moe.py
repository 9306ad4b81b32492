"""pallas_kernels.moe_matmul.cpu: the C++ fused routed experts vs the jnp oracles (f32 activations).

Every case is checked against both forms of the reference, moe_experts_ref (gather) and
moe_experts_grouped_ref (sorted + ragged_dot), with fused=True. Types: every storage type the C++
quant core reports as supported when the test runs, so new fast paths are covered as they land.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.quant import QuantArray  # first: pallas_kernels.moe_matmul's package init needs ikjax loaded
from ikjax.quant.types import QUANT_TYPES_BY_NAME
from pallas_kernels import cpu as _cpu
from pallas_kernels.moe_matmul.reference import moe_experts_grouped_ref, moe_experts_ref

pytestmark = pytest.mark.skipif(not _cpu.available(), reason=_cpu.unavailable_reason() or "no C++ kernels")

if _cpu.available():
    from pallas_kernels.moe_matmul import cpu as moe_cpu
    from pallas_kernels.testing import random_quant_array

    # real storage types (not the activation-only *_X4 / Q8_K* pseudo types) the core runs today
    TYPES = [n for n, q in QUANT_TYPES_BY_NAME.items() if q.block_elems < 1 << 20 and moe_cpu.type_supported(q.type_id)]
else:  # pragma: no cover
    TYPES = []
ISAS = ("generic", "avx2", "avx512")


def dims(name):
    """(d, F): odd block counts of the type (d = 1 or 2 blocks, F = 3), multiples of any row interleave."""
    q = QUANT_TYPES_BY_NAME[name]
    if q.block_elems == 1:
        return 48, 80
    if q.block_elems >= 256:
        return q.block_elems, 3 * q.block_elems
    return 2 * q.block_elems, 3 * q.block_elems


def random_experts_tensor(name, shape, rng):
    """random_quant_array, plus ik's per-row prefix (a float or half row scale) for the *_KS types."""
    q = QUANT_TYPES_BY_NAME[name]
    if not q.row_meta_bytes:
        return random_quant_array(name, shape, rng)
    from pallas_kernels.testing import random_bytes
    blocks = random_bytes(name, shape[:-1], shape[-1], rng)
    scale = rng.uniform(0.5, 1.5, (*shape[:-1], 1)).astype(np.float32 if q.row_meta_bytes == 4 else np.float16)
    raw = np.concatenate([scale.view(np.uint8), blocks], axis=-1)
    return QuantArray.from_bytes(np.ascontiguousarray(raw), q, shape)


@functools.cache
def experts(names, E, seed=0):
    """gate, up [E, F, d] and down [E, d, F] of the given (gate, up, down) types."""
    rng = np.random.default_rng(seed)
    d, F = dims(names[0])
    d2, F2 = dims(names[2])
    d, F = max(d, d2), max(F, F2)
    return (random_experts_tensor(names[0], (E, F, d), rng), random_experts_tensor(names[1], (E, F, d), rng),
            random_experts_tensor(names[2], (E, d, F), rng))


def routing(N, E, k, rng, zero_frac=0.25):
    """Distinct experts per token (as top_k gives), picks shared across tokens, some weights 0 (ser)
    and, when N > 2, one token whose weights are all 0."""
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (N, k)).astype(np.float32)
    w[rng.random((N, k)) < zero_frac] = 0.0
    if N > 2:
        w[1] = 0.0
    return jnp.asarray(w), jnp.asarray(ids)


_ref = jax.jit(functools.partial(moe_experts_ref, dtype=jnp.float32, fused=True))
_ref16 = jax.jit(functools.partial(moe_experts_ref, dtype=jnp.bfloat16, fused=True))
_gref = jax.jit(functools.partial(moe_experts_grouped_ref, dtype=jnp.float32, fused=True))


def check(x, w, ids, g, u, dn, n_threads, refs=("gather", "grouped")):
    y = np.asarray(moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=n_threads))
    assert y.shape == x.shape and y.dtype == np.float32
    for which in refs:
        r = np.asarray((_ref if which == "gather" else _gref)(x, w, ids, g, u, dn))
        assert np.isfinite(r).all()
        np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=which)
    return y


@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("E", [4, 64])
@pytest.mark.parametrize("N", [1, 3, 17, 512])
def test_shapes_q8_0(N, E, k):
    if k > E:
        pytest.skip("k > E")
    rng = np.random.default_rng(N * 1000 + E * 10 + k)
    g, u, dn = experts(("Q8_0",) * 3, E)
    x = jnp.asarray(rng.standard_normal((N, g.shape[2])), jnp.float32)
    w, ids = routing(N, E, k, rng)
    y = check(x, w, ids, g, u, dn, n_threads=2)
    if N > 2:
        assert not y[1].any()  # a token whose every weight is 0 gets exactly 0


@pytest.mark.parametrize("name", TYPES)
def test_types_isa_threads(name, monkeypatch):
    """Every supported type at every ISA level and 1 or 2 threads (3 tokens x 3 of 6 experts: some
    experts get one token, some several; the shapes test covers both references and N)."""
    rng = np.random.default_rng(1)
    g, u, dn = experts((name,) * 3, 6)
    x = jnp.asarray(rng.standard_normal((3, g.shape[2])), jnp.float32)
    w, ids = routing(3, 6, 3, rng, zero_frac=0.1)
    r = np.asarray(_ref(x, w, ids, g, u, dn))
    assert np.isfinite(r).all() and np.abs(r).max() > 0
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        for n_threads in (1, 2):
            y = np.asarray(moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=n_threads))
            np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-5 * np.abs(r).max(),
                                       err_msg=f"{name} {isa} t={n_threads}")


def _x8(v):
    """v as the quant core's int8 decode sees it (blocks of 32, 127 / max|v| in float32, round to
    nearest even); tests/test_cpu_quant_matmul.py's _x8."""
    b = np.asarray(v, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    return (np.rint(b * iscale) * (amax / np.float32(127))).astype(np.float32).reshape(np.shape(v))


def _bf16(v):
    return np.asarray(jnp.asarray(np.asarray(v, np.float32)).astype(jnp.bfloat16).astype(jnp.float32))


def _ref_x8(x, w, ids, g, u, dn, modes=("x8", "x8", "x8")):
    """Every token's experts with each of gate, up, down computed in its mode: "x8" = its input
    rounded by _x8 (8-bit activations, the weights exact), "bf16" = input and weights rounded to
    bf16; f64 sums."""
    mats = []
    for t, mode in zip((g, u, dn), modes):
        wt = t.dequantize(jnp.float32)
        mats.append(np.asarray(_bf16(wt) if mode == "bf16" else wt, np.float64))
    G, U, D = mats
    rnd = {"x8": _x8, "bf16": _bf16}
    out = np.zeros(x.shape)
    for n in range(x.shape[0]):
        xg = rnd[modes[0]](x[n]).astype(np.float64)
        xu = rnd[modes[1]](x[n]).astype(np.float64)
        for e, wt in zip(np.asarray(ids[n]), np.asarray(w[n])):
            if wt != 0:
                a = G[e] @ xg
                with np.errstate(over="ignore"):  # e^-a overflows to inf for a << 0: h -> 0
                    h = (a / (1 + np.exp(-a))) * (U[e] @ xu)
                out[n] += wt * (D[e] @ rnd[modes[2]](h.astype(np.float32)))
    return out


# Norm-relative error of the int8 decode against the f32 function on these Gaussian tokens (two
# quantized stages, x and h, at d = 64 / F = 96): measured 0.9-1.2 %.
X8_MOE_TOL = 2e-2


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_compute_matches_bf16_reference(isa, monkeypatch):
    """compute="bf16" is the references at dtype=bfloat16 (x, h, weights rounded; f32 sums) for
    prompt-sized products: only the summation order differs, which can flip a rare bf16 rounding of h.
    Decode-sized products (fewer than 4 rows per expert: one token's experts) take the quant core's
    8-bit activations at the avx2 and avx512 levels (x and h quantized per block of 32, int8 dot
    products), f32 at the generic one; at avx2 and avx512 the Q8_0 prompt-sized products take the same
    8-bit activations (the quant core's int8 prompt engine: vpmaddubsw / VNNI)."""
    monkeypatch.setenv("IKJAX_CPU_ISA", isa)
    rng = np.random.default_rng(4)
    g, u, dn = experts(("Q8_0",) * 3, 8)
    x = jnp.asarray(rng.standard_normal((1, g.shape[2])), jnp.float32)
    w, ids = routing(1, 8, 6, rng)
    y = np.asarray(moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=2, compute="bf16"))
    r32 = np.asarray(_ref(x, w, ids, g, u, dn))
    err32 = np.linalg.norm(y - r32) / np.linalg.norm(r32)
    if _cpu.isa() in ("avx2", "avx512"):  # decode: the 8-bit-activation function
        rx8 = _ref_x8(x, w, ids, g, u, dn)
        assert np.linalg.norm(y - rx8) / np.linalg.norm(rx8) < 1e-4
        assert 1e-4 < err32 < X8_MOE_TOL, err32
    else:
        assert err32 < 1e-5  # decode: the f32 function
    x = jnp.asarray(rng.standard_normal((64, g.shape[2])), jnp.float32)
    w, ids = routing(64, 8, 3, rng)  # ~24 rows per expert: every product prompt-sized
    y = np.asarray(moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=2, compute="bf16"))
    r32 = np.asarray(_ref(x, w, ids, g, u, dn))
    if _cpu.isa() in ("avx2", "avx512"):  # prompt: the 8-bit-activation function (a rare flip of h's rounding)
        rx8 = _ref_x8(x, w, ids, g, u, dn)
        errx8 = np.linalg.norm(y - rx8) / np.linalg.norm(rx8)
        err32 = np.linalg.norm(y - r32) / np.linalg.norm(r32)
        assert errx8 < 1e-3 and 2e-3 < err32 < X8_MOE_TOL, (errx8, err32)
    else:
        r16 = np.asarray(_ref16(x, w, ids, g, u, dn))
        err16 = np.linalg.norm(y - r16) / np.linalg.norm(r16)
        err32 = np.linalg.norm(r16 - r32) / np.linalg.norm(r32)
        assert err16 < 1e-4 and err32 > 1e-3, (err16, err32)  # the bf16 function, not the f32 one
    with pytest.raises(ValueError, match="compute"):
        moe_cpu.moe_experts(x, w, ids, g, u, dn, compute="f16")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("names", [("Q8_0", "Q4_0", "Q4_0"), ("Q8_0", "Q6_K", "Q8_0"), ("Q6_K", "Q4_0", "Q6_K")])
def test_bf16_prompt_mixed_engines(names, isa, monkeypatch):
    """Prompt-sized fused calls in bf16 mode where gate, up and down take different engines at
    avx2 and avx512 (Q8_0 / Q4_0: 8-bit activations; Q6_K: bf16), so x is packed once per distinct
    engine; tokens spread so experts get 1 (decode-sized), 2-3 and 17+ rows. Odd row counts per
    expert exercise the int8 microkernels' leftover rows (4-row microkernels at both levels)."""
    monkeypatch.setenv("IKJAX_CPU_ISA", isa)
    if _cpu.isa() != isa:
        pytest.skip(f"this CPU has no {isa} level")
    if not set(names) <= set(TYPES):
        pytest.skip(f"the quant core lacks one of {names}")
    rng = np.random.default_rng(11)
    d, F = 256, 768  # K chunks of the int8 engine: 8 blocks (gate, up), 24 (down)
    g, u = (random_experts_tensor(nm, (8, F, d), rng) for nm in names[:2])
    dn = random_experts_tensor(names[2], (8, d, F), rng)
    N = 37
    x = jnp.asarray(rng.standard_normal((N, g.shape[2])), jnp.float32)
    w, _ = routing(N, 8, 3, rng, zero_frac=0.0)
    n = np.arange(N)
    # expert 0: every token (37 rows); 7: tokens 0-2 (decode-sized); 1-3 and 4-6: 11-13 rows each
    ids = jnp.asarray(np.stack([np.zeros(N), np.where(n < 3, 7, 1 + n % 3), 4 + n % 3], 1).astype(np.int32))
    y = np.asarray(moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=2, compute="bf16"))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=8)
    assert counts[0] == N and counts[7] < 4, counts
    # per expert the engine depends on its row count: the decode-sized ones are 8-bit for the
    # int8 types and f32 for Q6_K; check against the mode of the big ones and the f32 function
    modes = tuple("x8" if n in ("Q8_0", "Q4_0") else "bf16" for n in names)
    rx = _ref_x8(x, w, ids, g, u, dn, modes)
    r32 = np.asarray(_ref(x, w, ids, g, u, dn))
    err = np.linalg.norm(y - rx) / np.linalg.norm(rx)
    err32 = np.linalg.norm(y - r32) / np.linalg.norm(r32)
    assert err < 5e-3 and err32 < X8_MOE_TOL, (err, err32)


def test_mixed_types_per_tensor():
    """gate/up and down of different types (as Q4_K_M files: Q4_K gate/up, Q6_K down)."""
    if len(TYPES) < 2:
        pytest.skip(f"the quant core supports only {TYPES}")
    rng = np.random.default_rng(3)
    a, b = ("Q4_K", "Q6_K") if {"Q4_K", "Q6_K"} <= set(TYPES) else (TYPES[0], TYPES[1])
    for names in ((a, a, b), (b, a, a)):
        g, u, dn = experts(names, 6)
        x = jnp.asarray(rng.standard_normal((5, g.shape[2])), jnp.float32)
        w, ids = routing(5, 6, 3, rng)
        check(x, w, ids, g, u, dn, n_threads=2)


def test_thread_counts_agree_and_jit():
    """Column splits do not change the answer; the op runs inside jit; 0 means all cores."""
    rng = np.random.default_rng(5)
    g, u, dn = experts(("Q8_0",) * 3, 64)
    x = jnp.asarray(rng.standard_normal((9, g.shape[2])), jnp.float32)
    w, ids = routing(9, 64, 6, rng)
    ys = [np.asarray(moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=t)) for t in (1, 2, 0, 7)]
    for y in ys[1:]:
        np.testing.assert_allclose(y, ys[0], rtol=1e-6, atol=1e-6 * np.abs(ys[0]).max())
    f = jax.jit(lambda x, w, ids: moe_cpu.moe_experts(x, w, ids, g, u, dn, n_threads=2))
    np.testing.assert_array_equal(np.asarray(f(x, w, ids)), ys[1])


def test_zero_weight_expert_is_not_read():
    """A zero-weight assignment is skipped, not multiplied by 0: an expert picked only with weight 0
    may hold NaNs without touching the output (ik's smart expert reduction does the same)."""
    rng = np.random.default_rng(11)
    E, d, _ = 4, 48, 80
    g, u, dn = experts(("F32",) * 3, E)
    poisoned = [QuantArray.from_bytes(np.array(t.data), t.qtype, t.shape) for t in (g, u, dn)]
    for t in poisoned:
        t.data.view(np.float32)[2] = np.nan  # expert 2 is all NaN
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    ids = jnp.asarray([[2, 0], [1, 2], [3, 1]], jnp.int32)
    w = jnp.asarray([[0.0, 0.5], [0.7, 0.0], [0.2, 0.3]], jnp.float32)
    y = np.asarray(moe_cpu.moe_experts(x, w, ids, *poisoned, n_threads=2))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, np.asarray(_ref(x, w, ids, g, u, dn)), rtol=1e-5, atol=1e-6)


def test_repeated_expert_within_a_token():
    rng = np.random.default_rng(2)
    g, u, dn = experts(("Q8_0",) * 3, 4)
    x = jnp.asarray(rng.standard_normal((2, g.shape[2])), jnp.float32)
    ids = jnp.asarray([[1, 1, 3], [0, 3, 3]], jnp.int32)
    w = jnp.asarray([[0.5, 0.25, 1.0], [0.3, 0.3, 0.4]], jnp.float32)
    check(x, w, ids, g, u, dn, n_threads=2)


def test_bad_expert_id_is_refused():
    g, u, dn = experts(("Q8_0",) * 3, 4)
    x = jnp.ones((1, g.shape[2]), jnp.float32)
    with pytest.raises(Exception, match=r"expert id 4 outside \[0, 4\)"):
        np.asarray(moe_cpu.moe_experts(x, jnp.ones((1, 2)), jnp.asarray([[0, 4]], jnp.int32), g, u, dn))


def test_supported_checks_types_and_shapes():
    g, u, dn = experts(("Q8_0",) * 3, 4)
    assert moe_cpu.supported(g, u, dn)
    assert not moe_cpu.supported(g, u, g)  # down must be [E, d, F]
    unsupported = [n for n, q in QUANT_TYPES_BY_NAME.items() if q.block_elems == 32 and q.interleave == 1
                   and not moe_cpu.type_supported(q.type_id)]
    if not unsupported:
        pytest.skip("every 32-block type has a C++ path")
    rng = np.random.default_rng(0)
    bad = random_quant_array(unsupported[0], dn.shape, rng, fast=True)
    assert not moe_cpu.supported(g, u, bad)
    with pytest.raises(ValueError, match=unsupported[0]):
        moe_cpu.moe_experts(jnp.ones((1, g.shape[2])), jnp.ones((1, 1)), jnp.zeros((1, 1), jnp.int32), g, u, bad)
