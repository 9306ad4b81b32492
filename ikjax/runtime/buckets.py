"""KV-length buckets: how many cache rows a compiled step attends over.

Why buckets: a step's KV length is a static shape, so every distinct length is one more compile; the
length a step needs (its start + its tokens) is rounded up to a bucket and the causal mask hides
the rows past it. The rounding is paid on every step: a prompt step that needs 10240 rows and runs
with 16384 does 60 % more attention work (issue 11: S_PP at N_KV 8192 of `-c 16384 -ub 2048`).

The old rule was the next power of two (at least `kv_block`). The rule here spends the same number
of compiles, placed where the lengths are. Prompts run in `ubatch` chunks, so the lengths prompt
steps need are (k+1)·ub for chunk k (every row of sweep-bench, every full chunk of a long prompt),
up to the context. The buckets are multiples of ub, as many as the power-of-two rule has over
those lengths (so a run never compiles more prompt steps than before), the first one ub (the N_KV 0
row and one-chunk prompts waste nothing), placed so that over the lengths ub, 2ub, ...,
ceil(ctx/ub)·ub the worst bucket/needed is least (S_PP is compared with ik_llama.cpp row by row),
and among those placements the sum of bucket/needed (each row alike). Bisection with a greedy check
finds the worst ratio, a small dynamic programme the placement (exact, linear in ctx/ub:
milliseconds even at -c 1000000 -ub 64, cached per shape). Below the first bucket (a short prompt, a decode step at small
N_KV when no split-KV decode kernel runs) the power-of-two rule stays. Decode steps that run the
split-KV kernel are not bucketed at all (one bucket: the whole cache; `Engine.kv_bucket`).

At ik's standard shapes (kv_block 256): buckets old -> new, prompt-step compiles of a sweep-bench
run, the worst bucket/needed over its rows, and the rows its prompt steps attend over in all beyond
the rows they need (tests/test_kv_buckets.py recomputes every number here):

    -c 16384 -ub 2048: 2048 4096 8192 16384 -> 2048 6144 10240 16384, 4 compiles either way;
                       worst 1.60 (N_KV 8192: 10240 -> 16384) -> 1.50 (N_KV 2048: 4096 -> 6144);
                       rows +19.4 % -> +13.9 %
    -c 4096 -ub 512:   512 1024 2048 4096 -> 512 1536 2560 4096: the same, scaled by 1/4
    -c 1024 -ub 512:   512 1024 either way, no waste
    -c 32768 -ub 2048: 5 compiles either way; worst 1.78 -> 1.50; rows +25.7 % -> +18.4 %

Decode steps without the split-KV kernel (-mla 2, -mla 0, -fa 0) use the same buckets; at these
shapes a sweep compiles no more of them than before either (the test checks it).
"""
from __future__ import annotations

import functools
import math

import numpy as np


def pow2_at_least(n: int, lo: int = 1) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def pow2_bucket(needed: int, kv_block: int, capacity: int) -> int:
    """The old rule: the next power of two, at least kv_block, at most the cache."""
    return min(capacity, pow2_at_least(needed, kv_block))


@functools.lru_cache(maxsize=64)
def prompt_buckets(ctx: int, ubatch: int, kv_block: int, capacity: int) -> tuple[int, ...]:
    """The buckets (cache rows) of prompt lengths from one ubatch up to the context, ascending.

    Multiples of ubatch (rounded up to kv_block, capped at the cache), as many as the power-of-two
    rule has over the lengths a sweep meets, ub, 2ub, ..., M·ub (M = ctx // ub), placed as the
    module says; and the context itself when it is not a multiple of ub (a prompt filling it)."""
    M = ctx // ubatch
    budget = len({pow2_bucket(m * ubatch, kv_block, capacity) for m in range(1, M + 1)})
    units = _best_units(M, budget) if M else ()
    rows = {min(capacity, _round_up(u * ubatch, kv_block)) for u in units}
    rows.add(min(capacity, _round_up(ctx, kv_block)))
    return tuple(sorted(rows))


@functools.lru_cache(maxsize=64)
def _best_units(M: int, budget: int) -> tuple[int, ...]:
    """At most `budget` integers in 1..M, 1 and M among them (M alone for a budget of 1), lengths in
    units of ub, bucket(m) the least chosen >= m: first the least worst ratio bucket(m)/m, then the
    least sum of them.

    The worst ratio comes first because S_PP is compared with ik's row by row. The least one is a
    ratio j/(i+1) (a bucket at j after one at i); a greedy chain (each bucket as far as the ratio
    allows from the last) tells whether a ratio fits the budget, and fitting is monotone in the
    ratio, so bisection on the real line down to a gap below any two such ratios' distance
    (1/(M+1)^2) and the chain's own worst step give it exactly. Then f[k, j], the least sum
    covering 1..j with k buckets, the last at j (a bucket at j after one at i covers i+1..j at
    j * (H_j - H_i), H the harmonic numbers), over the steps that keep the ratio.

    Linear in M, not quadratic: that cost is Monge ((c-d)(H_b-H_a) <= 0), so the best i for j
    never decreases with j and each layer is solved by divide and conquer over j (M log M), and
    only the j from which M is still reachable within the budget are visited. The quadratic
    form (every ratio enumerated, every (i, j) tried) took 4.5 GiB and 19 s at -c 1000000 -ub 64;
    tests/test_faults.py checks both give the same buckets."""
    k_max = min(budget, M)
    if k_max == 1:
        return (M,)

    def step(b: int, rho: float) -> int:
        return min(M, int(rho * (b + 1) + 1e-9))

    def chain(rho: float) -> list[int] | None:
        b, out = 1, [1]
        while b < M:
            nxt = step(b, rho)
            if nxt <= b or len(out) == k_max:
                return None
            out.append(nxt)
            b = nxt
        return out

    lo, hi = 1.0, float(M)  # 1 never fits (M > 1); M does: buckets 1 and M
    while hi - lo > 0.5 / (M + 1) ** 2:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if chain(mid) else (mid, hi)
    c = chain(hi)
    rho = max(j / (i + 1.0) for i, j in zip(c, c[1:])) + 1e-9

    def reaches(b: int, r: int) -> bool:  # M within r more buckets after one at b
        while b < M and r > 0:
            nxt = step(b, rho)
            if nxt <= b:
                return False
            b, r = nxt, r - 1
        return b >= M

    def first_reaching(r: int) -> int:
        lo_, hi_ = 1, M
        while lo_ < hi_:
            mid = (lo_ + hi_) // 2
            lo_, hi_ = (lo_, mid) if reaches(mid, r) else (mid + 1, hi_)
        return lo_

    def lowest(j: int) -> int:  # the least i with j <= rho * (i + 1)
        i = max(0, int(math.ceil(j / rho - 1)) - 1)
        while not j <= rho * (i + 1):
            i += 1
        return i

    H = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, M + 1))])
    f = np.full((k_max + 1, M + 1), np.inf)
    arg = np.zeros((k_max + 1, M + 1), np.int64)
    f[1, 1] = 1.0  # the first bucket is one ubatch: the N_KV 0 row and one-chunk prompts waste nothing
    for k in range(2, k_max + 1):
        prev = f[k - 1]
        fin = np.flatnonzero(np.isfinite(prev))
        if not len(fin):
            break
        fk, ak = f[k], arg[k]
        todo = [(max(k, int(fin[0]) + 1, first_reaching(k_max - k)), step(int(fin[-1]), rho), 0, M)]
        while todo:  # divide and conquer: j in [a, b], its best i in [ilo, ihi]
            a, b, ilo, ihi = todo.pop()
            if a > b:
                continue
            j = (a + b) // 2
            i0, i1 = max(ilo, lowest(j)), min(ihi, j - 1)
            best = None
            if i0 <= i1:
                cand = prev[i0:i1 + 1] + j * (H[j] - H[i0:i1 + 1])
                t = int(np.argmin(cand))  # the first least, as a full scan would pick
                if cand[t] < np.inf:
                    fk[j], ak[j] = cand[t], i0 + t
                    best = i0 + t
            todo.append((a, j - 1, ilo, ihi if best is None else best))
            todo.append((j + 1, b, ilo if best is None else best, ihi))
    k = int(np.argmin(f[1:, M])) + 1
    units, j = [], M
    while k > 0:
        units.append(j)
        j, k = int(arg[k, j]), k - 1
    return tuple(sorted(units))


def kv_bucket(needed: int, ctx: int, ubatch: int, kv_block: int, capacity: int) -> int:
    """Cache rows a step that needs `needed` rows reads: the next prompt bucket, or below the first
    one the next power of two (at least kv_block); the whole cache past the last one."""
    buckets = prompt_buckets(ctx, ubatch, kv_block, capacity)
    if needed <= buckets[0]:
        return min(buckets[0], pow2_bucket(needed, kv_block, capacity))
    for b in buckets:
        if b >= needed:
            return b
    return capacity
