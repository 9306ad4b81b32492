"""The GPU kernels' decode form gives each row the bits it gets alone (ikjax.ops.registry.batch_invariant).

A server's batched decode step must answer each sequence greedily as `generate` does for it alone;
on a GPU a kernel whose schedule (split-K, tiles) is sized by the batch rounds a row differently
in a batch of 8 than alone (RESULTS §23: logits apart by 0.09, 0 of 4 answers equal). Here the
Pallas kernels run in interpret mode: the schedule, not the hardware, is what decides the order of
the sums, so equal schedules and equal bits here are the property the GPU inherits (the GPU check
is bench/gpu_batch_invariance.py)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ikjax import ops
from ikjax.ops import registry
from pallas_kernels.mla_decode import kernel as mla
from pallas_kernels.moe_matmul import moe_experts
from pallas_kernels.quant_matmul import prepare, quant_matmul, quant_matmul_ref
from pallas_kernels.quant_matmul.kernel import pick_config
from pallas_kernels.testing import random_quant_array


def rows_alone(f, x, *rest):
    """f on each row of x (with its rows of `rest`) alone, stacked."""
    return np.concatenate([np.asarray(f(x[i:i + 1], *(r[i:i + 1] for r in rest))) for i in range(x.shape[0])])


def test_schedules_do_not_depend_on_the_batch():
    """The one-row schedule for any row count: same tiles, k-steps and split (the bits follow)."""
    for qtype, N, K in [("Q4_0", 2048, 10944), ("Q8_0", 102400, 2048), ("Q4_K", 1536, 2048)]:
        one = pick_config(qtype, 1, N, K)
        for M in (2, 5, 8, 48):
            cfg = pick_config(qtype, M, N, K, rows_max=1, tile_rows=1, split_rows=1)
            assert cfg == one, (qtype, M, cfg, one)
            # and the batch-sized schedule does differ (what the invariant form is for)
        assert pick_config(qtype, 4, N, K) != one
    # experts: the split sized for one token's k slots whatever the tokens
    one = pick_config("Q4_0", 6, 1408, 2048, tile_rows=1)
    assert all(pick_config("Q4_0", 6 * n, 1408, 2048, tile_rows=1, split_rows=6) == one for n in (2, 8, 16))
    assert pick_config("Q4_0", 48, 1408, 2048, tile_rows=1) != one
    # attention: the KV split of one sequence for any batch
    one = mla.pick_config(1, 16, 8192)
    assert all(mla.pick_config(B, 16, 8192, split_batch=1) == one for B in (2, 8, 32))
    assert mla.pick_config(8, 16, 8192) != one


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("matrix_unit", [False, True])
def test_quant_matmul_rows_equal_alone(name, matrix_unit):
    """A program per row, or the matrix-unit schedule (tiles of 16 rows, split-K by (N, K) alone,
    the weight tile as the first operand): each row as alone, 13 rows as their first 13 of 40,
    close to the reference."""
    rng = np.random.default_rng(abs(hash(name + "inv")) % 2**32)
    N, K = 48, 512
    pw = prepare(random_quant_array(name, (N, K), rng))
    x = jnp.asarray(rng.standard_normal((13, K)), jnp.float32)
    f = lambda x: quant_matmul(x, pw, jnp.bfloat16, interpret=True, row_invariant=True, matrix_unit=matrix_unit)
    y = np.asarray(f(x))
    assert np.array_equal(y, rows_alone(f, x))
    x40 = jnp.concatenate([x, jnp.asarray(rng.standard_normal((27, K)), jnp.float32)])
    assert np.array_equal(np.asarray(f(x40))[:13], y)
    ref = np.asarray(quant_matmul_ref(x, pw, jnp.bfloat16))
    assert np.abs(y - ref).max() <= 2e-2 * np.abs(ref).max()
    if not matrix_unit:  # the plain form of one row is the row form (decode at batch 1 keeps its schedule)
        assert np.array_equal(y[:1], np.asarray(quant_matmul(x[:1], pw, jnp.bfloat16, interpret=True)))


def test_moe_gather_tokens_equal_alone():
    rng = np.random.default_rng(5)
    E, F, d, k, N = 8, 256, 256, 3, 5
    pws = [prepare(random_quant_array("Q4_0", s, rng)) for s in ((E, F, d), (E, F, d), (E, d, F))]
    x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (N, k)), jnp.float32)
    f = lambda x, w, ids: moe_experts(x, w, ids, *pws, interpret=True, row_invariant=True)
    y = np.asarray(f(x, w, ids))
    assert np.array_equal(y, rows_alone(f, x, w, ids))
    assert np.array_equal(y[:1], np.asarray(moe_experts(x[:1], w[:1], ids[:1], *pws, interpret=True)))


@pytest.mark.parametrize("swap", [False, True])
def test_invariant_schedules_lower_to_triton(swap):
    """The matrix-unit invariant schedule (either operand order) lowers to Triton: a dense product
    with split-K and live rows, and the per-head form (a head's rows one tile, heads as experts)."""
    from pallas_kernels.quant_matmul.kernel import invariant_config
    from pallas_kernels.quant_matmul.kernel import quant_matmul_experts
    from pallas_kernels.testing import cuda_lowering
    rng = np.random.default_rng(9)
    pw = prepare(random_quant_array("Q4_0", (576, 2048), rng, fast=True))
    cfg = dict(invariant_config("Q4_0", 576, 2048), swap=swap)
    cuda_lowering(lambda x, w, m: quant_matmul(x, w, row_invariant=True, live_rows=m, matrix_unit=True, config=cfg),
                  jnp.zeros((8, 2048), jnp.bfloat16), pw, jnp.ones((8,), jnp.int32))
    ph = prepare(random_quant_array("Q4_0", (16, 128, 512), rng, fast=True))
    cuda_lowering(lambda x, w, e, m: quant_matmul_experts(x, (w,), e, tile_rows=16, split_rows=16, config="invariant",
                                                          live_rows=m),
                  jnp.zeros((256, 512), jnp.bfloat16), ph, jnp.arange(16, dtype=jnp.int32), jnp.ones((256,), jnp.int32))


def test_mla_decode_sequences_equal_alone():
    rng = np.random.default_rng(9)
    B, H, S = 4, 16, 256
    q = jnp.asarray(rng.standard_normal((B, H, 576)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((B, S, 576)), jnp.bfloat16)
    lengths = jnp.array([1, 90, 256, 17], jnp.int32)
    f = lambda q, c, n: mla.mla_decode(q, c, n, 0.06, interpret=True, row_invariant=True)
    y = np.asarray(f(q, cache, lengths))
    assert np.array_equal(y, rows_alone(f, q, cache, lengths))
    assert np.array_equal(y[:1], np.asarray(mla.mla_decode(q[:1], cache[:1], lengths[:1], 0.06, interpret=True)))


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setenv("IKJAX_BATCH_INVARIANT", "1")


def test_registry_decode_steps_only(invariant):
    """The invariant form is a decode step's (< 4 tokens a sequence), asked for with IKJAX_BATCH_INVARIANT=1."""
    with ops.kernel_context("pallas", 1, seq_tokens=1):
        assert registry.batch_invariant()
    with ops.kernel_context("pallas", 1, seq_tokens=512):
        assert not registry.batch_invariant()
    # the CPU kernels are row-invariant in their own way (decode_groups): the variable changes nothing there
    for backend in ("cpu", "xla"):
        with ops.kernel_context(backend, 1, seq_tokens=1):
            assert not registry.batch_invariant()


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("IKJAX_BATCH_INVARIANT", raising=False)
    with ops.kernel_context("pallas", 1, seq_tokens=1):
        assert not registry.batch_invariant()


@pytest.mark.parametrize("form", ["rows", "dot"])
def test_head_products_rows_equal_alone(invariant, monkeypatch, form):
    """MLA's per-head products in a decode step: each (row, head) a one-row tile of the rows kernel
    or (IKJAX_INVARIANT_FORM=dot) a head's rows one matrix-unit tile (interpret mode), each row's
    bits as alone, close to XLA's dot; a prompt step keeps the dot."""
    monkeypatch.setenv("IKJAX_INVARIANT_FORM", form)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((6, 1, 4, 32)), jnp.float32)
    w = prepare(random_quant_array("Q8_0", (4, 64, 32), rng))
    with ops.kernel_context("interpret", 1, seq_tokens=1):
        f = lambda x: ops.head_linear(x, w, jnp.bfloat16)
        y = np.asarray(f(x))
        assert np.array_equal(y, rows_alone(f, x))
        assert registry.selected("head_linear") == "interpret"
    with ops.kernel_context("interpret", 1, seq_tokens=64):
        ref = np.asarray(ops.head_linear(x, w, jnp.bfloat16))
        assert registry.selected("head_linear") == "xla"
    assert np.abs(y - ref).max() <= 2e-2 * np.abs(ref).max()


@pytest.mark.parametrize("form", ["rows", "dot"])
def test_head_products_skip_idle_rows(invariant, monkeypatch, form):
    """Under the decode step's live-rows mask (a server's idle slots), the per-head products give
    the live rows' bits unchanged and zeros for the idle rows' heads (dead tiles: no weight read)."""
    monkeypatch.setenv("IKJAX_INVARIANT_FORM", form)
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((3, 1, 4, 32)), jnp.float32)
    w = prepare(random_quant_array("Q8_0", (4, 64, 32), rng))
    with ops.kernel_context("interpret", 1, seq_tokens=1):
        full = np.asarray(ops.head_linear(x, w, jnp.bfloat16))
        with ops.live_rows(jnp.asarray([1, 0, 1], jnp.int32)):
            got = np.asarray(ops.head_linear(x, w, jnp.bfloat16))
        assert registry.selected("head_linear") == "interpret"
    assert np.array_equal(got[[0, 2]], full[[0, 2]])
    assert not got[1].any() and full[1].any()


def test_router_rows_equal_alone(invariant):
    """The router's f32 logits in a decode step: the rows kernel's F32 form, each token's bits as
    alone and equal to the f32 dot within f32 rounding."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)
    with ops.kernel_context("interpret", 1, seq_tokens=1):
        y = np.asarray(ops.router_logits(x, router))
        assert np.array_equal(y, rows_alone(lambda x: ops.router_logits(x, router), x))
        assert registry.selected("router_logits") == "interpret"
    ref = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


def test_softmax_and_small_sums_rows_equal_alone(invariant):
    """The router's softmax (fixed-point denominator) and the top-k weights' sum (in order) in a
    decode step: each row's bits as alone, within f32 rounding of the plain forms."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((7, 160)) * 4, jnp.float32)
    w = jnp.asarray(rng.uniform(0, 1, (7, 8)), jnp.float32)
    with ops.kernel_context("interpret", 1, seq_tokens=1):
        assert registry.batch_invariant()
        p = np.asarray(registry.softmax_rows(x))
        assert np.array_equal(p, rows_alone(registry.softmax_rows, x))
        s = np.asarray(registry.sum_rows_small(w))
        assert np.array_equal(s, rows_alone(registry.sum_rows_small, w))
    import jax
    assert np.abs(p - np.asarray(jax.nn.softmax(x, axis=-1))).max() < 1e-6
    assert np.abs(s - np.asarray(w).sum(-1)).max() < 1e-6


@pytest.mark.parametrize("form", ["rows", "dot"])
def test_idle_rows_skipped_and_live_rows_as_alone(tiny4_model, monkeypatch, form):
    """A batch-invariant decode step (interpret mode; products a program per row, or on the
    matrix unit) with an idle row (last -1, a server's free slot): the products get the live-rows
    mask, and the live rows' logits are bit for bit those of the same step with every row live
    (and finite)."""
    import ikjax
    from pallas_kernels.quant_matmul import kernel as qk
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    monkeypatch.setenv("IKJAX_BATCH_INVARIANT", "1")
    monkeypatch.setenv("IKJAX_INVARIANT_FORM", form)
    seen = []
    call = qk._call

    def spy(*a, **k):
        seen.append((a[5] if len(a) > 5 else k.get("row_live")) is not None)
        return call(*a, **k)
    monkeypatch.setattr(qk, "_call", spy)
    eng = ikjax.load(tiny4_model, ctx=64, ubatch=16)
    tokens = np.asarray([[5, 9, 2, 7], [11, 3, 8, 4], [6, 6, 1, 9]], np.int32)
    nxt = np.asarray([[3], [0], [7]], np.int32)
    out = {}
    for name, last in (("all", [0, 0, 0]), ("idle", [0, -1, 0])):
        _, cache = eng.step(eng.new_cache(3), tokens, np.zeros(3, np.int32))
        seen.clear()
        logits, _ = eng.step(cache, nxt, np.full(3, 4, np.int32), last=np.asarray(last, np.int32))
        out[name] = np.asarray(logits)
        if name == "all":  # traced (and compiled) once: `last` is an argument of the step, the mask of it
            assert any(seen), "no product got the live-rows mask"
    assert np.array_equal(out["idle"][[0, 2]], out["all"][[0, 2]])
    assert np.isfinite(out["idle"]).all()
    # and as the row alone (a batch of one; decode steps from position 0: prompts are not batch-invariant),
    # the row form's norms folded into its products
    batch, _ = eng.step(eng.new_cache(3), nxt, np.zeros(3, np.int32))
    alone, _ = eng.step(eng.new_cache(1), nxt[2:], np.zeros(1, np.int32))
    assert np.array_equal(np.asarray(alone)[0], np.asarray(batch)[2])
    assert registry.selected("norm_linear") == ("interpret" if form == "rows" else "xla")


def test_idle_rows_attend_to_one_key(tiny4_model, monkeypatch):
    """A decode step's idle row (last -1) keeps its slot's cached history (the prompt cache) but
    its throw-away token attends to one key, not to that history; the live row's logits are those
    of the same step with both rows live."""
    import jax
    import ikjax
    from ikjax.model import deepseek2
    seen = []
    attend = deepseek2.ops.mla_decode_attention

    def spy(q, cache, lengths, *a, **k):
        jax.debug.callback(lambda n: seen.append(np.asarray(n).tolist()), lengths)
        return attend(q, cache, lengths, *a, **k)
    monkeypatch.setattr(deepseek2.ops, "mla_decode_attention", spy)
    eng = ikjax.load(tiny4_model, ctx=64, ubatch=16, mla=3, fa=True)
    if not eng.decode_kernel:
        pytest.skip("no split-KV decode kernel on this backend")
    tokens = np.asarray([[5, 9, 2, 7, 1, 3], [11, 3, 8, 4, 2, 6]], np.int32)
    out = {}
    for name, last in (("both", [0, 0]), ("idle", [0, -1])):
        _, cache = eng.step(eng.new_cache(2), tokens, np.zeros(2, np.int32))
        seen.clear()
        logits, _ = eng.step(cache, np.asarray([[3], [4]], np.int32), np.full(2, 6, np.int32),
                             last=np.asarray(last, np.int32))
        out[name] = np.asarray(logits)
        jax.effects_barrier()
        assert seen and all(s == ([7, 7] if name == "both" else [7, 1]) for s in seen), (name, seen)
    assert np.array_equal(out["idle"][0], out["both"][0])
