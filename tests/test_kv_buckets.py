"""KV-length buckets (ikjax.runtime.buckets): no more compiles than the power-of-two rule at ik's sweep
shapes, less waste, and the numbers its docstring states."""
from __future__ import annotations

import pytest

import ikjax
from ikjax.runtime import buckets as kb
from ikjax.tools import sweep_bench as sb
from ikjax.runtime.memory_plan import cache_capacity
from ikjax.options import RunOptions

KV_BLOCK = 256


def capacity(ctx: int, ub: int, kv_block: int = KV_BLOCK) -> int:
    return cache_capacity(RunOptions.from_kwargs(ctx=ctx, ubatch=ub, kv_block=kv_block))


def sweep(ctx: int, ub: int, rule, tg: int, decode_kernel: bool):
    """(prompt buckets, decode buckets) a sweep-bench run hits under `rule`, as sweep_bench.step_shapes walks it."""
    pp, dec = [], set()
    for n_kv in sb.sweep_points(ctx, ub):
        if not decode_kernel:
            dec.update(rule(n_kv + i + 1) for i in range(tg))
        pp.append((n_kv + ub, rule(n_kv + ub)))
    return pp, dec


def rules(ctx: int, ub: int, kv_block: int = KV_BLOCK):
    cap = capacity(ctx, ub, kv_block)
    return (lambda n: kb.pow2_bucket(n, kv_block, cap)), (lambda n: kb.kv_bucket(n, ctx, ub, kv_block, cap))


# ik's standard shapes and the docstring's numbers: new buckets, worst ratio old/new, extra rows old/new
STANDARD = {
    (16384, 2048): ((2048, 6144, 10240, 16384), 1.60, 1.50, 0.194, 0.139),
    (4096, 512): ((512, 1536, 2560, 4096), 1.60, 1.50, 0.194, 0.139),
    (1024, 512): ((512, 1024), 1.00, 1.00, 0.0, 0.0),
    (32768, 2048): ((2048, 6144, 12288, 20480, 32768), 1.78, 1.50, 0.257, 0.184),
}


@pytest.mark.parametrize("shape", list(STANDARD))
def test_standard_shapes_no_more_compiles_less_waste(shape):
    ctx, ub = shape
    buckets, worst_old, worst_new, extra_old, extra_new = STANDARD[shape]
    assert kb.prompt_buckets(ctx, ub, KV_BLOCK, capacity(ctx, ub)) == buckets
    old, new = rules(ctx, ub)
    for mla2 in (False, True):  # -mla 3 -fa 1 runs the split-KV decode kernel; -mla 2 buckets decode steps too
        for tg in (ub // 4, 128, 32):
            pp_old, dec_old = sweep(ctx, ub, old, tg, decode_kernel=not mla2)
            pp_new, dec_new = sweep(ctx, ub, new, tg, decode_kernel=not mla2)
            assert len({b for _, b in pp_new}) <= len({b for _, b in pp_old}), (shape, tg)
            assert len(dec_new) <= len(dec_old), (shape, tg, sorted(dec_old), sorted(dec_new))
    need = [n for n, _ in pp_old]
    assert all(b >= n for n, b in pp_new)
    assert max(b / n for n, b in pp_old) == pytest.approx(worst_old, abs=0.005)
    assert max(b / n for n, b in pp_new) == pytest.approx(worst_new, abs=0.005)
    assert sum(b for _, b in pp_old) / sum(need) - 1 == pytest.approx(extra_old, abs=0.0005)
    assert sum(b for _, b in pp_new) / sum(need) - 1 == pytest.approx(extra_new, abs=0.0005)
    assert pp_new[0][1] == ub  # the N_KV 0 row reads one ubatch


@pytest.mark.parametrize("ctx,ub,kv_block", [(256, 32, 64), (1000, 512, 256), (3000, 2048, 256), (65536, 2048, 256),
                                             (131072, 512, 256), (16384, 384, 128), (8192, 8192, 256)])
def test_rule_covers_every_length_within_the_cache(ctx, ub, kv_block):
    old, new = rules(ctx, ub, kv_block)
    cap = capacity(ctx, ub, kv_block)
    buckets = kb.prompt_buckets(ctx, ub, kv_block, cap)
    assert buckets[0] == min(cap, -(-ub // kv_block) * kv_block) and buckets[-1] <= cap
    assert all(b % kv_block == 0 or b == cap for b in buckets)
    pp_old, _ = sweep(ctx, ub, old, 0, True)
    pp_new, _ = sweep(ctx, ub, new, 0, True)
    assert len({b for _, b in pp_new}) <= len({b for _, b in pp_old})
    assert max(b / n for n, b in pp_new) <= max(b / n for n, b in pp_old) + 1e-9
    step = max(1, (cap + ub) // 997)
    for n in range(1, cap + 1, step):
        b = new(n)
        assert n <= b <= cap, (n, b)
        if n <= ub:  # short prompts and early decode steps: the power-of-two rule, capped at one ubatch
            assert b == min(buckets[0], old(n))


def test_best_units_is_optimal_on_small_cases():
    """The bisection + DP against brute force over every set of buckets (1 and M included)."""
    from itertools import combinations

    def cost(units, M):
        cover = [min(u for u in units if u >= m) for m in range(1, M + 1)]
        return (max(c / m for m, c in zip(range(1, M + 1), cover)), sum(c / m for m, c in zip(range(1, M + 1), cover)))
    for M in range(1, 13):
        assert kb._best_units(M, 1) == (M,)
        for budget in range(2, 6):
            best = min((cost((1, *mid, M) if M > 1 else (1,), M), (1, *mid, M) if M > 1 else (1,))
                       for k in range(0, max(0, min(budget, M) - 2) + 1)
                       for mid in combinations(range(2, M), k))
            got = kb._best_units(M, budget)
            assert len(got) <= budget and got[0] == 1 and got[-1] == M
            assert cost(got, M) == pytest.approx(best[0]), (M, budget, got, best)


def test_engine_sweep_compiles_no_more_steps(tiny_model):
    """A real engine at a small shape: sweep_bench.step_shapes under the new rule has no more
    shapes than under powers of two, and its prompt steps attend over fewer rows."""
    eng = ikjax.load(tiny_model, ctx=1024, ubatch=64, kv_block=64, mla=2)
    assert not eng.decode_kernel
    shapes = sb.step_shapes(eng, 16)
    cap = eng.capacity
    old = {(t, kb.pow2_bucket(kv, 64, cap)) for t, kv in
           [(1, n_kv + i + 1) for n_kv in sb.sweep_points(1024, 64) for i in range(16)]
           + [(64, n_kv + 64) for n_kv in sb.sweep_points(1024, 64)]}
    new = {(t, eng.kv_bucket(kv, t)) for t, kv in shapes}
    assert len(shapes) == len(new) <= len(old)
    pp_rows_new = sum(eng.kv_bucket(n + 64, 64) for n in sb.sweep_points(1024, 64))
    pp_rows_old = sum(kb.pow2_bucket(n + 64, 64, cap) for n in sb.sweep_points(1024, 64))
    assert pp_rows_new < pp_rows_old
    assert eng.compile_count == 0  # nothing compiled to find this out


@pytest.mark.parametrize("ctx,ub,kv_block", [(4096, 2048, 256), (1024, 256, 256), (1000, 256, 256), (1000, 300, 8),
                                             (16384, 2048, 256), (3000, 2048, 256), (256, 512, 64)])
def test_buckets_never_read_past_the_context(ctx, ub, kv_block):
    """The cache is -c in whole KV blocks (no micro-batch on top) and no bucket reads past it: every
    prompt bucket, every length a step may need up to the cache's end, and a need past the end
    (a decode loop compiled for more steps than are left) read at most the cache."""
    cap = capacity(ctx, ub, kv_block)
    assert cap == -(-ctx // kv_block) * kv_block and cap - ctx < kv_block
    buckets = kb.prompt_buckets(ctx, ub, kv_block, cap)
    assert buckets[-1] == cap and all(b <= cap for b in buckets)
    for n in range(1, cap + 2 * ub):
        b = kb.kv_bucket(n, ctx, ub, kv_block, cap)
        assert b <= cap and (b >= n or b == cap), (n, b)


def test_engine_steps_stay_within_the_cache(tiny_model):
    """A real engine: every step a sweep (with a TG count that fills the last row up to the cache's
    end) and a prefill of a full context run reads at most `capacity` = -c rows and writes none
    past them (`Engine.prompt_tokens`)."""
    eng = ikjax.load(tiny_model, ctx=1000, ubatch=300, mla=2)
    assert eng.capacity == 1024 and not eng.decode_kernel
    last = sb.sweep_points(1000, 300)[-1]
    for t, kv in sb.step_shapes(eng, eng.capacity - last):
        assert kv <= eng.capacity and eng.kv_bucket(kv, t) <= eng.capacity
    for n in range(1, 1001):  # every prompt length, chunk by chunk as prefill feeds it
        for c0 in range(0, n, 300):
            real = min(300, n - c0)
            t = eng.prompt_tokens(real, c0)
            assert real <= t <= eng.capacity - c0 and eng.kv_bucket(c0 + t, t) <= eng.capacity
            assert t == eng.token_bucket(real) or (c0 == 900 and t == 124)  # one extra step shape at most
