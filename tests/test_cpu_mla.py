"""C++ CPU absorbed-MLA attention (pallas_kernels/mla_decode/cpu.py) against the references:
mla_decode_ref for decode, the model's attend_materialized / attend_flash in absorbed form for
prompts, on the same stored cache values (f32, f16, bf16, q8_0), every instruction-set level and
thread count; ragged positions, positions short of the cache end and past it, padded q8_0 rows.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikjax.model import cache as kvcache
from ikjax.ops.attn import attend_flash, attend_materialized
from pallas_kernels import cpu as _cpu
from pallas_kernels.mla_decode.reference import mla_decode_ref

pytestmark = pytest.mark.skipif(not _cpu.available(), reason=_cpu.unavailable_reason() or "no C++ kernels")

if _cpu.available():
    from pallas_kernels.mla_decode import cpu as mla_cpu

CTKS = ("f32", "f16", "bf16", "q8_0")


def _cpu_amx() -> bool:
    """The amx level runs here (its prompt attention's bf16 tiles: tested as one more level)."""
    return _cpu.available() and _cpu._cpu.amx_unavailable_reason() == ""


ISAS = ("generic", "avx2", "avx512") + (("amx",) if _cpu_amx() else ())
FLOAT = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


# the references, jitted: one compile per shape, shared by the four cache types of a case
_quantize = jax.jit(kvcache.quantize_q8_0)
_decode_ref = jax.jit(mla_decode_ref, static_argnames=("v_dim", "dtype"))
_materialized = jax.jit(attend_materialized, static_argnames=("amb_bytes",))
_flash = jax.jit(attend_flash, static_argnames=("kv_block",))


def make_cache(c, ctk):
    return _quantize(c) if ctk == "q8_0" else c.astype(FLOAT[ctk])


def stored_values(cache, D):
    """The cache's values as stored, f32 [B, S, D] (q8_0: int8 times its f16 scale, as ikjax/model/cache.py)."""
    if isinstance(cache, dict):
        x = np.asarray(cache["q"], np.float32) * np.asarray(cache["d"], np.float32)[..., None]
        return jnp.asarray(x.reshape(*x.shape[:2], -1)[..., :D])
    return jnp.asarray(np.asarray(cache, np.float32)[..., :D])


def check(y, ref, what):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    assert y.shape == ref.shape, (what, y.shape, ref.shape)
    assert np.isfinite(y).all(), what
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    worst = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < 1e-5 and worst < 1e-4, (what, rel, worst)


def shapes():
    """(B, T, S, H, D, v_dim): every T x S, each with B, H and D varied; a few at R1's 128 heads.
    Each runs with all four cache types."""
    out = []
    for i, (T, S) in enumerate((T, S) for T in (1, 3, 17, 64) for S in (1, 5, 300, 1000)):
        B = 1 + i % 2
        H = (1, 16)[(i // 2) % 2]
        D, v = ((48, 32), (576, 512))[(i // 3) % 2]
        if D == 576 and T * S * H > 17 * 300 * 16:   # keep the generic-level runs short
            D, v = 48, 32
        out.append((B, T, S, H, D, v))
    return out + [(2, 1, 1000, 128, 576, 512), (1, 3, 300, 128, 576, 512)]


def positions(rng, B, T, S):
    """Ragged starts: one sequence ends at the last cache row, others short of it; T > S runs past."""
    hi = max(S - T, 0)
    starts = [hi] + [int(rng.integers(0, hi + 1)) for _ in range(B - 1)]
    return jnp.asarray(np.array(starts)[:, None] + np.arange(T)[None], jnp.int32)


@pytest.mark.parametrize("shape", shapes(), ids=lambda c: "B{}-T{}-S{}-H{}-D{}-v{}".format(*c))
def test_matches_reference(shape, monkeypatch):
    B, T, S, H, D, v = shape
    rng = np.random.default_rng(sum(x * 7919 ** i for i, x in enumerate(shape)) % 2**32)
    scale = 1.3 / np.sqrt(D)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    q_pos = positions(rng, B, T, S)
    for ctk in CTKS:
        cache = make_cache(c, ctk)
        lat = stored_values(cache, D)
        k, vv = lat[:, :, None], lat[:, :, None, :v]
        if T == 1:
            ref = _decode_ref(q[:, 0], cache, q_pos[:, 0] + 1, scale, v_dim=v, dtype=jnp.float32)[:, None]
            if ctk == "f32":
                check(ref, _materialized(q, k, vv, q_pos, scale), "decode oracles agree")
        elif (T + S) % 2:
            ref = _flash(q, k, vv, q_pos, scale, kv_block=64)
        else:
            ref = _materialized(q, k, vv, q_pos, scale)
        for n_threads in (1, 2):
            for isa in ISAS:
                monkeypatch.setenv("IKJAX_CPU_ISA", isa)
                y = mla_cpu.mla_attention(q, cache, q_pos, scale, v_dim=v, n_threads=n_threads)
                check(y, ref, (ctk, isa, n_threads))
                if T == 1 and isa == "avx512":
                    y1 = mla_cpu.mla_decode(q[:, 0], cache, q_pos[:, 0] + 1, scale, v_dim=v, n_threads=n_threads)
                    check(y1[:, None], ref, (ctk, "mla_decode", n_threads))


@pytest.mark.parametrize("ctk", CTKS)
def test_reads_only_visible_keys(ctk, monkeypatch):
    """Rows past every query's position are never read: NaN there (in the values, or the q8_0
    scales) must not reach the output. This is what makes the cost follow the real length."""
    rng = np.random.default_rng(3)
    B, T, H, S, D, v = 2, 5, 16, 700, 576, 512
    clean = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    q_pos = jnp.asarray([[100, 101, 102, 103, 104], [3, 4, 5, 6, 7]], jnp.int32)
    seen = (jnp.arange(S)[None, :] <= q_pos[:, -1:])[..., None]
    cache = make_cache(clean, ctk)
    if ctk == "q8_0":
        poisoned = {"q": cache["q"], "d": jnp.where(seen, cache["d"], jnp.float16(jnp.nan))}
    else:
        poisoned = jnp.where(seen, cache, jnp.nan).astype(cache.dtype)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    lat = stored_values(cache, D)
    ref = _materialized(q, lat[:, :, None], lat[:, :, None, :v], q_pos, 0.05)
    for n_threads in (1, 2):
        for isa in ISAS:
            monkeypatch.setenv("IKJAX_CPU_ISA", isa)
            check(mla_cpu.mla_attention(q, poisoned, q_pos, 0.05, v_dim=v, n_threads=n_threads), ref,
                  (ctk, isa, n_threads))
            d = mla_cpu.mla_decode(q[:, 0], poisoned, q_pos[:, 0] + 1, 0.05, v_dim=v, n_threads=n_threads)
            check(d, ref[:, 0], (ctk, isa, "decode"))   # query rows are independent


@pytest.mark.parametrize("T", [1, 6])
def test_nan_query_row_stays_nan(T, monkeypatch):
    """A NaN in one query row gives that row NaN at every level (its scores' e^NaN is NaN, as the
    reference's softmax; the avx2 exp once clamped NaN to e^-87, a finite row) and no other row."""
    rng = np.random.default_rng(5)
    B, H, S, D, v = 2, 4, 40, 48, 32
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    q[1, T - 1, 2, 7] = np.nan
    c = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    q_pos = jnp.asarray(np.array([[S - T], [S - T - 3]]) + np.arange(T)[None], jnp.int32)
    bad = np.zeros((B, T, H), bool)
    bad[1, T - 1, 2] = True
    qc = jnp.asarray(np.where(bad[..., None], 0.0, q))
    ref = _materialized(qc, c[:, :, None], c[:, :, None, :v], q_pos, 0.2)
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        y = np.asarray(mla_cpu.mla_attention(jnp.asarray(q), c, q_pos, 0.2, v_dim=v, n_threads=2))
        assert np.isnan(y[bad]).all(), isa
        check(y[~bad], np.asarray(ref)[~bad], isa)


def test_wider_cache_row_and_f32_scales_and_jit():
    """q narrower than the cache row (only the first D values are keys), q8_0 with f32 scales,
    inside jit with bf16 queries (converted to f32 by the wrapper)."""
    rng = np.random.default_rng(5)
    B, T, H, S, W, D, v = 2, 3, 16, 90, 96, 80, 64
    c = jnp.asarray(rng.standard_normal((B, S, W)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    q_pos = jnp.asarray([[87, 88, 89], [10, 11, 12]], jnp.int32)
    qq = kvcache.quantize_q8_0(c)
    for cache in (c.astype(jnp.float16), {"q": qq["q"], "d": qq["d"].astype(jnp.float32)}):
        lat = stored_values(cache, D)
        ref = _materialized(q.astype(jnp.float32), lat[:, :, None], lat[:, :, None, :v], q_pos, 0.1)
        f = jax.jit(lambda q, cache, p: mla_cpu.mla_attention(q, cache, p, 0.1, v_dim=v, n_threads=2))
        check(f(q, cache, q_pos), ref, "jit")


def test_supported_and_refusals():
    q = (1, 1, 16, 576)
    f16 = jnp.zeros((1, 8, 576), jnp.float16)
    q8 = kvcache.quantize_q8_0(jnp.zeros((1, 8, 576)))
    assert mla_cpu.supported(q, f16, 512) and mla_cpu.supported(q, q8, 512)
    assert mla_cpu.supported((1, 16, 576), f16, 512)                      # decode form [B, H, D]
    assert not mla_cpu.supported(q, f16.astype(jnp.int32), 512)           # not a cache dtype
    assert not mla_cpu.supported(q, f16, 600)                             # v_dim > D
    assert not mla_cpu.supported((1, 1, 16, 600), f16, 512)               # D > row width
    assert not mla_cpu.supported((2, 1, 16, 576), f16, 512)               # batch mismatch
    assert not mla_cpu.supported(q, {"q": q8["q"], "d": q8["d"].astype(jnp.int8)}, 512)
    with pytest.raises(ValueError, match="unsupported"):
        mla_cpu.mla_attention(jnp.zeros(q), f16, jnp.zeros((1, 1), jnp.int32), 0.1, v_dim=600)


# -- standard attention over keys and values of their own (the -mla 0/2/3 prompt steps) ------------

_attend_mat = jax.jit(attend_materialized)


def head_shapes():
    """(B, T, S, H, Hk, D, Wk, Dv): per-head K/V (Hk = H) over T x S, V2-Lite's 192/128 heads, one
    shared K/V head (Hk = 1) and a K row wider than q."""
    out = []
    for i, (T, S) in enumerate((T, S) for T in (1, 3, 17, 64) for S in (1, 5, 130)):
        B = 1 + i % 2
        H = (1, 3, 16)[i % 3]
        D, Dv = ((24, 16), (192, 128))[(i // 2) % 2]
        out.append((B, T, S, H, H, D, D, Dv))
    return out + [(2, 9, 70, 5, 1, 40, 43, 8), (1, 100, 100, 2, 2, 20, 20, 20)]


@pytest.mark.parametrize("shape", head_shapes(), ids=lambda c: "B{}-T{}-S{}-H{}-Hk{}-D{}-W{}-v{}".format(*c))
def test_attention_matches_reference(shape, monkeypatch):
    B, T, S, H, Hk, D, Wk, Dv = shape
    rng = np.random.default_rng(sum(x * 7919 ** i for i, x in enumerate(shape)) % 2**32)
    scale = 1.3 / np.sqrt(D)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, Hk, Wk)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, Hk, Dv)), jnp.float32)
    q_pos = positions(rng, B, T, S)
    for dt in ("f32", "f16", "bf16"):
        kd, vd = k.astype(FLOAT[dt]), v.astype(FLOAT[dt])
        kf, vf = kd[..., :D].astype(jnp.float32), vd.astype(jnp.float32)
        ref = (_flash(q, kf, vf, q_pos, scale, kv_block=64) if (T + S) % 2
               else _attend_mat(q, kf, vf, q_pos, scale))
        for n_threads in (1, 2, 3):
            for isa in ISAS:
                monkeypatch.setenv("IKJAX_CPU_ISA", isa)
                check(mla_cpu.attention(q, kd, vd, q_pos, scale, n_threads=n_threads), ref, (dt, isa, n_threads))


@pytest.mark.parametrize("shape", [(1, 64, 130, 16, 16, 192, 192, 128), (2, 17, 40, 3, 3, 24, 24, 16),
                                   (1, 9, 33, 4, 1, 21, 21, 20), (1, 5, 70, 2, 2, 30, 30, 37)],
                         ids=lambda c: "B{}-T{}-S{}-H{}-Hk{}-D{}-W{}-v{}".format(*c))
def test_attention_bf16_inputs(shape, monkeypatch):
    """q, k and v all bf16 (the fast mode): p rounded to bf16 before p·v as XLA's bf16 `attend`
    does, products in bf16 (AVX512_BF16 pairs where the CPU has them; D odd and the other levels
    round alike in f32). Held to the XLA form on the same bf16 inputs, and the levels to each other."""
    B, T, S, H, Hk, D, Wk, Dv = shape
    rng = np.random.default_rng(sum(x * 31 ** i for i, x in enumerate(shape)) % 2**32)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, S, Hk, Wk)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, Hk, Dv)), jnp.bfloat16)
    q_pos = positions(rng, B, T, S)
    ref = _flash(q, k[..., :D], v, q_pos, 0.11, kv_block=64)   # XLA's bf16 form (p rounded per block)
    outs = {}
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        outs[isa] = np.asarray(mla_cpu.attention(q, k, v, q_pos, 0.11, n_threads=2), np.float64)
        assert np.isfinite(outs[isa]).all()
        rel = np.linalg.norm(outs[isa] - np.asarray(ref)) / np.linalg.norm(ref)
        assert rel < 5e-3, (isa, rel)
    for isa in ISAS[:-1]:
        assert np.linalg.norm(outs[isa] - outs["avx512"]) / np.linalg.norm(outs["avx512"]) < 1e-3, isa


def test_attention_reads_only_visible_keys(monkeypatch):
    """Per-head K and V rows past every query's position are never read (NaN there stays out)."""
    rng = np.random.default_rng(4)
    B, T, H, S, D, Dv = 2, 5, 4, 300, 192, 128
    q_pos = jnp.asarray([[100, 101, 102, 103, 104], [3, 4, 5, 6, 7]], jnp.int32)
    seen = (jnp.arange(S)[None, :] <= q_pos[:, -1:])[..., None, None]
    k = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, S, H, Dv)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    ref = _attend_mat(q, k.astype(jnp.float32), v.astype(jnp.float32), q_pos, 0.07)
    kp, vp = (jnp.where(seen, x, jnp.nan).astype(x.dtype) for x in (k, v))
    ref16 = _attend_mat(q.astype(jnp.bfloat16), k, v, q_pos, 0.07)
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        check(mla_cpu.attention(q, kp, vp, q_pos, 0.07, n_threads=2), ref, isa)
        y16 = np.asarray(mla_cpu.attention(q.astype(jnp.bfloat16), kp, vp, q_pos, 0.07, n_threads=2))
        assert np.isfinite(y16).all() and np.linalg.norm(y16 - ref16) / np.linalg.norm(ref16) < 5e-3, isa


def test_attention_supported_and_refusals():
    q = (1, 4, 16, 192)
    k, v = jnp.zeros((1, 8, 16, 192), jnp.bfloat16), jnp.zeros((1, 8, 16, 128), jnp.bfloat16)
    assert mla_cpu.attention_supported(q, k, v)
    assert mla_cpu.attention_supported(q, k[:, :, :1], v[:, :, :1])        # one shared head
    assert not mla_cpu.attention_supported(q, k[:, :, :4], v[:, :, :4])    # heads neither 1 nor H
    assert not mla_cpu.attention_supported(q, k, v.astype(jnp.float32))    # k, v of two types
    assert not mla_cpu.attention_supported(q, k[..., :100], v)             # k narrower than q
    assert not mla_cpu.attention_supported(q, k.astype(jnp.int8), v.astype(jnp.int8))
    assert not mla_cpu.attention_supported((2, 4, 16, 192), k, v)          # batch mismatch
    assert not mla_cpu.attention_supported((1, 4, 16, 0), k, v)            # no query width (fuzzing)
    with pytest.raises(ValueError, match="unsupported"):
        mla_cpu.attention(jnp.zeros(q), k[:, :, :4], v[:, :, :4], jnp.zeros((1, 4), jnp.int32), 0.1)


@pytest.mark.parametrize("scale", [0.0, -0.3])
def test_nonpositive_scale_masks_after_scaling(scale, monkeypatch):
    """A masked score is -inf whatever the scale (the kernel scales, then masks): scale 0 gives the
    mean of the visible values, a negative scale no NaN or +inf (found by fuzzing: masking first
    made -inf·0 = NaN)."""
    rng = np.random.default_rng(6)
    B, T, H, S, D = 1, 3, 2, 70, 16
    c = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    pos = jnp.asarray([[40, 41, 67]], jnp.int32)
    ref = _materialized(q, c[:, :, None], c[:, :, None], pos, scale)
    k = jnp.broadcast_to(c[:, :, None], (B, S, H, D))
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        check(mla_cpu.mla_attention(q, c, pos, scale, v_dim=D, n_threads=2), ref, (isa, "latent"))
        check(mla_cpu.attention(q, k, k, pos, scale, n_threads=2), ref, (isa, "per head"))


def _kv_reference(q, kv, k_rope, q_pos, scale, nope):
    """K = kv[..., :nope] ++ k_rope broadcast over the heads, V = kv[..., nope:], both at q's dtype,
    as the model built them before the op took the parts (XLA's flash form)."""
    B, S, H, _ = kv.shape
    R = q.shape[-1] - nope
    k = jnp.concatenate([kv[..., :nope].astype(jnp.float32),
                         jnp.broadcast_to(k_rope[:, :, None, :R], (B, S, H, R)).astype(jnp.float32)], -1)
    return _flash(q, k.astype(q.dtype), kv[..., nope:].astype(q.dtype), q_pos, scale, kv_block=64)


@pytest.mark.parametrize("case", [
    (1, 64, 130, 16, 128, 64, 64, 128, "bf16", "f32", "bf16"),   # V2-Lite's prompt: bf16 q, the f32 kv_b product
    (2, 7, 40, 3, 16, 8, 10, 16, "f32", "f32", "f32"),           # exact mode, rope row wider than R
    (1, 37, 90, 5, 12, 7, 7, 20, "bf16", "f16", "f32"),           # D odd: the f32 loop rounding as bf16
    (2, 1, 70, 4, 32, 16, 16, 24, "bf16", "bf16", "bf16"),        # a decode-shaped call
    (1, 20, 33, 2, 9, 5, 6, 3, "f32", "bf16", "f16")],
    ids=lambda c: "B{}-T{}-S{}-H{}-nope{}-R{}-Rw{}-v{}-q{}-kv{}-r{}".format(*c))
def test_attention_kv_matches_reference(case, monkeypatch):
    B, T, S, H, nope, R, Rw, Dv, qd, kvd, rd = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    q = jnp.asarray(rng.standard_normal((B, T, H, nope + R)), FLOAT[qd])
    kv = jnp.asarray(rng.standard_normal((B, S, H, nope + Dv)), FLOAT[kvd])
    kr = jnp.asarray(rng.standard_normal((B, S, Rw)), FLOAT[rd])
    q_pos = positions(rng, B, T, S)
    ref = _kv_reference(q, kv, kr, q_pos, 0.1, nope)
    for isa in ISAS:
        for n_threads in (1, 2):
            monkeypatch.setenv("IKJAX_CPU_ISA", isa)
            y = np.asarray(mla_cpu.attention_kv(q, kv, kr, q_pos, 0.1, nope=nope, n_threads=n_threads), np.float64)
            rel = np.linalg.norm(y - np.asarray(ref)) / np.linalg.norm(ref)
            assert np.isfinite(y).all() and rel < (1e-5 if qd == "f32" else 5e-3), (isa, n_threads, rel)


def test_attention_kv_f32_rows_round_as_xla(monkeypatch):
    """bf16 q with the f32 kv_b product: the kernel rounds K and V to bf16 as it loads them (8 / 16
    at a time), and the model now converts them before the op: both must give the same bits, ties
    (low half exactly 0x8000, even and odd) and values near the f32 maximum included, at every level."""
    B, T, S, H, nope, R, Dv = 1, 19, 45, 3, 40, 8, 24  # widths not multiples of 8 / 16: the scalar tails too
    rng = np.random.default_rng(26)
    q = jnp.asarray(rng.standard_normal((B, T, H, nope + R)), jnp.bfloat16)
    bits = rng.standard_normal((B, S, H, nope + Dv)).astype(np.float32).view(np.uint32)
    ties = rng.random(bits.shape) < 0.3
    bits = np.where(ties, (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000), bits)  # exact halves
    # powers of two keep the ties: a few rows' values scaled up to ~2^100 (scores stay finite)
    kv32 = np.ldexp(bits.view(np.float32), np.where(rng.random(bits.shape) < 0.02, 100, 0))
    kv = jnp.asarray(kv32)
    kr = jnp.asarray(rng.standard_normal((B, S, R)), jnp.bfloat16)
    q_pos = positions(rng, B, T, S)
    for isa in ISAS:
        monkeypatch.setenv("IKJAX_CPU_ISA", isa)
        y32 = np.asarray(mla_cpu.attention_kv(q, kv, kr, q_pos, 0.1, nope=nope, n_threads=2))
        y16 = np.asarray(mla_cpu.attention_kv(q, kv.astype(jnp.bfloat16), kr, q_pos, 0.1, nope=nope, n_threads=2))
        assert np.isfinite(y32).all()
        np.testing.assert_array_equal(y32, y16, err_msg=isa)


def test_attention_kv_refusals():
    q, kv, kr = (1, 4, 16, 192), jnp.zeros((1, 8, 16, 256), jnp.float32), jnp.zeros((1, 8, 64), jnp.bfloat16)
    assert mla_cpu.attention_kv_supported(q, kv, kr, 128)
    assert not mla_cpu.attention_kv_supported(q, kv, kr[..., :32], 128)          # rope part too narrow
    assert not mla_cpu.attention_kv_supported(q, kv, kr, 256)                    # no value columns left
    assert not mla_cpu.attention_kv_supported(q, kv[:, :, :4], kr, 128)          # heads differ from q's
    assert not mla_cpu.attention_kv_supported(q, kv.astype(jnp.int32), kr, 128)  # not a float type
    assert not mla_cpu.attention_kv_supported((1, 4, 16, 0), kv, kr, 0)          # no query width
    with pytest.raises(ValueError, match="unsupported"):
        mla_cpu.attention_kv(jnp.zeros(q), kv, kr[..., :32], jnp.zeros((1, 4), jnp.int32), 0.1, nope=128)


def test_flash_reference_past_the_cache_end():
    """attend_flash pads K/V to whole blocks: a query whose position is past S must not count the
    padding rows (found by fuzzing the kernels against it); it equals the materialized form."""
    rng = np.random.default_rng(8)
    B, T, H, S, D = 1, 3, 2, 65, 16
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
    q_pos = jnp.asarray([[63, 64, 90]], jnp.int32)
    check(_flash(q, k, k, q_pos, 0.2, kv_block=64), _attend_mat(q, k, k, q_pos, 0.2), "past S")
