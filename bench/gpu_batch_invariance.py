"""Issue 23 on one GPU, in this process (no HTTP): the server's greedy answers against `generate`,
a batched step's row against the same row alone, what one server iteration costs, and where a
second turn's time goes.

    python bench/gpu_batch_invariance.py MODEL [--ctx 8192] [--ub 512] [--np 8] [--parts all]

Parts (comma list): greedy, logits, steps, turn. Run it once with IKJAX_BATCH_INVARIANT=1 (the
default) and once with =0 to see what the row-invariant decode kernels change (and cost).
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import jax
import numpy as np

import ikjax
from ikjax.runtime import scheduler as sched


def run_requests(s, prompts, max_tokens, ignore_eos=True):
    """Submit all at once to the scheduler; their generated ids when all are done."""
    done = threading.Semaphore(0)
    reqs = [s.submit(s.make_request(p, max_tokens, ignore_eos=ignore_eos,
                                    on_event=lambda k, v: done.release() if k in ("done", "error") else None))
            for p in prompts]
    for _ in reqs:
        done.acquire()
    return reqs


def greedy(eng, a, rng):
    s = sched.Scheduler(eng, a.np)
    s.warmup()
    s.start()
    tests = [rng.integers(100, eng.config.vocab_size, n) for n in (7, 300, 700, 1100)]
    fillers = [rng.integers(100, eng.config.vocab_size, 50) for _ in range(a.np - len(tests))]
    reqs = run_requests(s, tests + fillers, 32)
    s.stop()
    same = 0
    for p, r in zip(tests, reqs):
        want = list(eng.generate(p, 32, ignore_eos=True))
        got = r.generated
        same += got == want
        first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        print(f"  prompt {len(p)}: server == generate: {got == want}" + ("" if first is None else f" (parts at {first})"))
    print(f"greedy equal: {same}/{len(tests)}")


def logits_diff(eng, a, rng):
    """Row 0 of an [np, 1] step against a [1, 1] step on the same cache row."""
    ids = rng.integers(100, eng.config.vocab_size, 300)
    _, one = eng.prefill(eng.new_cache(1), ids)
    big = sched._put_row(eng.new_cache(a.np), one, 0)
    tok = np.array([[int(ids[-1])]], np.int32)
    l1, _ = eng.step(sched._take_row(big, 0), tok, np.array([300]))
    toks = np.zeros((a.np, 1), np.int32)
    toks[0, 0] = tok[0, 0]
    starts = np.full(a.np, 300, np.int32)
    lb, _ = eng.step(big, toks, starts)
    d = float(np.abs(np.asarray(lb, np.float32)[0] - np.asarray(l1, np.float32)[0]).max())
    print(f"logits: row 0 of [{a.np},1] vs [1,1]: max |diff| {d:.3g} (bitwise equal: {d == 0.0})")


def steps(eng, a, rng):
    """A server iteration's step: dispatch (until Engine.step returns) and the whole iteration
    (the argmax's ids on the host), for [np,1] and [1,1]; the decode loop per token at batch 1."""
    for B in sorted({1, a.np}):
        cache = eng.new_cache(B)
        toks = np.ones((B, 1), np.int32)
        start = np.full(B, 200, np.int32)
        eng.precompile(B, 1, 260)
        ts = []
        for i in range(40):
            t = time.perf_counter()
            logits, cache = eng.step(cache, toks, start + i)
            d = time.perf_counter()
            toks = np.asarray(sched._argmax_rows(logits)[0])[:, None]
            ts.append((d - t, time.perf_counter() - t))
        ts = ts[5:]
        print(f"Engine.step [{B},1]: {statistics.median(x[1] for x in ts) * 1e3:.2f} ms an iteration "
              f"(returns after {statistics.median(x[0] for x in ts) * 1e3:.2f} ms)")
    for B in sorted({1, a.np}):
        cache = eng.new_cache(B)
        tok = np.ones(B, np.int32)
        out, cache = eng.decode(cache, tok, np.full(B, 200), 16)
        t = time.perf_counter()
        for i in range(4):
            out, cache = eng.decode(cache, np.asarray(out)[:, -1], np.full(B, 216 + 16 * i), 16)
        np.asarray(out)
        print(f"decode loop [{B}] x16: {(time.perf_counter() - t) / 64 * 1e3:.2f} ms a token")


def turn(eng, a, rng):
    """Second turn over a 4000-token history vs a fresh 64-token prompt (prefix and exact)."""
    for mode in ("prefix", "exact"):
        s = sched.Scheduler(eng, a.np, prompt_cache=mode)
        s.warmup()
        ev = []
        f0 = s._prefill_chunk

        def traced():
            t = time.perf_counter()
            f0()
            ev.append(time.perf_counter() - t)
        s._prefill_chunk = traced
        s.start()
        short = []
        for _ in range(3):
            r = run_requests(s, [rng.integers(100, eng.config.vocab_size, 64)], 4)[0]
            short.append(r.t_first - r.t_submit)
        for _ in range(2):
            hist = rng.integers(100, eng.config.vocab_size, 4000)
            r1 = run_requests(s, [hist], 16)[0]
            follow = np.concatenate([hist, np.asarray(r1.generated, np.int32), rng.integers(100, eng.config.vocab_size, 48)])
            ev.clear()
            r2 = run_requests(s, [follow], 4)[0]
        s.stop()
        ts = statistics.median(short)
        print(f"turn ({mode}): second turn TTFT {(r2.t_first - r2.t_submit) * 1e3:.1f} ms ({r2.n_cached} cached, "
              f"chunks {[round(x * 1e3, 1) for x in ev]} ms) vs 64-token prompt {ts * 1e3:.1f} ms: "
              f"{(r2.t_first - r2.t_submit) / ts:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ub", type=int, default=512)
    ap.add_argument("--np", type=int, default=8)
    ap.add_argument("--parts", default="greedy,logits,steps,turn")
    a = ap.parse_args()
    t = time.perf_counter()
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ub)
    print(f"loaded in {time.perf_counter() - t:.1f} s on {jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    for part in a.parts.split(","):
        t = time.perf_counter()
        {"greedy": greedy, "logits": logits_diff, "steps": steps, "turn": turn}[part](eng, a, rng)
        print(f"[{part}: {time.perf_counter() - t:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
