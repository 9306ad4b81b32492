"""Which threads a CPU decode loop runs on, and how long each waited for a core (issue 26).

ikjax's avx2 Q4_0 decode at -t 16 halved on two of seven device leases (RESULTS §26ai call 10,
§26ak call 7) while other processes on other leases ran it at 190-250 t/s, and a process that was slow
was slow for its whole run. One guess: a thread that calls the C++ kernels (an XLA worker) sharing a
core with a spinning pool worker, which the scheduler cannot move while every core looks busy. This
loads FILE, runs one 512-token prompt step, then ROUNDS decode loops of 32 tokens at N_KV 512 (as
sweep-bench's second row), and around each loop reads every thread's on-CPU time, run-queue wait
and time slices (/proc/self/task/*/schedstat) and the CPU it last ran on. It prints each loop's t/s,
the busy threads (on CPU for more than 10 % of the loop) with their waits, and how many busy threads
last ran on a CPU another busy thread also last ran on. Run it as several processes on a lease where
the rows are slow and on one where they are not.

    IKJAX_CPU_ISA=avx2 taskset -c 0-15 python bench/cpu_decode_threads.py FILE [THREADS] [ROUNDS]
"""
from __future__ import annotations

import collections
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import ikjax  # noqa: E402


def _threads() -> dict[int, tuple[str, int, int, int, int]]:
    """tid -> (name, ns on CPU, ns waiting to run, time slices, the CPU it last ran on)."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            run, wait, n = map(int, open(f"/proc/self/task/{t}/schedstat").read().split())
            cpu = int(open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[36])
        except (OSError, ValueError, IndexError):
            continue
        out[int(t)] = (name, run, wait, n, cpu)
    return out


def main():
    path = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    eng = ikjax.load(path, ctx=1024, ubatch=512, mla=3, fa=True, threads=threads)
    rng = np.random.default_rng(0)
    vocab = eng.config.vocab_size
    cache = eng.new_cache(1)
    out, cache = eng.step(cache, rng.integers(0, vocab, (1, 512)), np.array([0]))
    out.block_until_ready()
    out, cache = eng.decode(cache, rng.integers(0, vocab, (1,)), [512], 32)  # compile and warm
    out.block_until_ready()
    for r in range(rounds):
        a, t = _threads(), time.perf_counter()
        out, cache = eng.decode(cache, rng.integers(0, vocab, (1,)), [512], 32)
        out.block_until_ready()
        dt, b = time.perf_counter() - t, _threads()
        busy = []
        for tid, (name, run, wait, n, cpu) in b.items():
            r0, w0, n0 = a.get(tid, (name, 0, 0, 0, 0))[1:4]
            if run - r0 > 0.1 * dt * 1e9:
                busy.append((tid, name, (run - r0) / 1e6, (wait - w0) / 1e6, n - n0, cpu))
        by_cpu = collections.Counter(c for *_, c in busy)
        shared = sum(1 for *_, c in busy if by_cpu[c] > 1)
        waits = sorted((w for _, _, _, w, _, _ in busy), reverse=True)
        print(f"decode 32 at N_KV 512: {dt * 1e3:.0f} ms ({32 / dt:.1f} t/s); {len(busy)} busy threads on "
              f"{len(by_cpu)} CPUs, {shared} sharing a last CPU; run-queue waits (ms) "
              f"{' '.join(f'{w:.1f}' for w in waits[:6])}; slices {sum(x[4] for x in busy)}")
        if len(sys.argv) > 4 and sys.argv[4] == "-v":
            for tid, name, run, wait, n, cpu in sorted(busy, key=lambda x: -x[2]):
                print(f"    {tid} {name} cpu {cpu}: on CPU {run:.0f} ms, waited {wait:.1f} ms, {n} slices")


if __name__ == "__main__":
    main()
