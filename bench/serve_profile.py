"""Where a served token's time goes (issue 23): the scheduler in this process, no HTTP.

    python bench/serve_profile.py MODEL [--np 8] [--ctx 65536] [--ub 512] [--streams 1,8] [--tokens 64]

For each stream count S: S greedy requests (ignore_eos, as bench/serve_load.py sends) decode
`--tokens` tokens together; prints per decode iteration the wall time, the time inside Engine.step
(dispatch), the wait for the step's tokens, and the rest (the scheduler's Python), and the same
step alone in a loop (`Engine.step` on [np, 1] and [1, 1] batches, synced each step), so the
scheduler's overhead is the difference.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

import ikjax
from ikjax.runtime import scheduler as sched
from gpu_batch_invariance import step_alone  # bench/ is the script's directory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--np", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--ub", type=int, default=512)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    eng = ikjax.load(a.model, ctx=a.ctx // a.np, ubatch=a.ub)
    s = sched.Scheduler(eng, a.np)
    t = time.perf_counter()
    s.warmup()
    eng.precompile(1, eng.prompt_tokens(128, 0), 128)
    print(f"warm-up {time.perf_counter() - t:.1f} s")

    # the step alone: [np, 1] and [1, 1], synced every step
    for B in sorted({1, a.np}):
        ret, whole = step_alone(eng, B)
        print(f"Engine.step [{B},1] alone: {whole * 1e3:.2f} ms a step (dispatch {ret * 1e3:.2f} ms)")

    # instrument the scheduler's decode iteration
    rec: list[tuple[float, float, float]] = []
    step0 = eng.step

    def timed_step(*args, **kw):
        t = time.perf_counter()
        out = step0(*args, **kw)
        timed_step.dispatch = time.perf_counter() - t
        return out
    eng.step = timed_step
    dec0 = s._decode_step

    def timed_decode():
        t = time.perf_counter()
        dec0()
        rec.append((time.perf_counter() - t, timed_step.dispatch, 0.0))
    s._decode_step = timed_decode
    events: list[tuple[str, float, float]] = []  # (kind, start, end) of every prompt chunk and decode step

    def traced(kind: str, fn):
        def run():
            t = time.perf_counter()
            fn()
            events.append((kind, t, time.perf_counter()))
        return run
    s._prefill_chunk = traced("chunk", s._prefill_chunk)
    s._decode_step = traced("decode", s._decode_step)
    s.start()
    rng = np.random.default_rng(0)
    for S in [int(x) for x in a.streams.split(",")]:
        rec.clear()
        done = threading.Semaphore(0)
        reqs = []
        t0 = time.perf_counter()
        for _ in range(S):
            ids = rng.integers(100, eng.config.vocab_size, 128)
            r = s.make_request(ids, a.tokens, ignore_eos=True,
                               on_event=lambda kind, v: done.release() if kind in ("done", "error") else None)
            reqs.append(s.submit(r))
        for _ in range(S):
            done.acquire()
        wall = time.perf_counter() - t0
        it = [x[0] for x in rec[S:]]  # past the admissions
        disp = [x[1] for x in rec[S:]]
        gen = sum(len(r.generated) for r in reqs)
        print(f"{S} streams: {gen} tokens in {wall:.2f} s = {gen / wall:.1f} t/s; decode iteration "
              f"median {statistics.median(it) * 1e3:.2f} ms (Engine.step dispatch {statistics.median(disp) * 1e3:.2f} ms), "
              f"{len(rec)} iterations")
        print("  finish:", sorted({r.finish_reason for r in reqs}))
    # interference: 7 streams decode, a 2048-token prompt arrives; gaps between their tokens
    done = threading.Semaphore(0)
    streams = [s.submit(s.make_request(rng.integers(100, eng.config.vocab_size, 64), 400, ignore_eos=True,
                                       on_event=lambda k, v: done.release() if k in ("done", "error") else None))
               for _ in range(min(7, a.np - 1))]
    while sum(len(r.generated) for r in streams) < 20 * len(streams):
        time.sleep(0.01)
    events.clear()
    long = s.submit(s.make_request(rng.integers(100, eng.config.vocab_size, 2048), 1, ignore_eos=True,
                                   on_event=lambda k, v: done.release() if k in ("done", "error") else None))
    for _ in range(len(streams) + 1):
        done.acquire()
    ev = list(events)
    chunks = [e for e in ev if e[0] == "chunk"]
    if chunks:
        t0, t1 = chunks[0][1], chunks[-1][2]
        ends = [e[2] for e in ev if e[0] == "decode" and t0 - 0.5 < e[2] < t1 + 0.5]
        gaps = np.diff(ends) if len(ends) > 1 else np.array([0.0])
        print(f"interference: {len(chunks)} chunks, each {statistics.median(c[2] - c[1] for c in chunks) * 1e3:.1f} ms; "
              f"decode steps around them: median gap {np.median(gaps) * 1e3:.1f} ms, max gap {gaps.max() * 1e3:.1f} ms; "
              f"long prompt's first token {long.t_first - long.t_submit:.3f} s after submit")
    s.stop()


if __name__ == "__main__":
    main()
