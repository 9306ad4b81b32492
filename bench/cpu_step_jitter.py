"""How much one CPU prompt step's time moves from run to run, and where a slow run's time went (issue 26).

sweep-bench times each row's 512-token step once; on the device host's 16 cores ikjax's rows moved
2.1-4.1k t/s between runs of one file while ik's stayed within 5 % (RESULTS §26ai). This runs
sweep-bench's own order ROUNDS times in one process (a 32-token decode loop, then the prompt step
at N_KV 0, the loop, the step at N_KV 512; fresh random tokens each time) and prints each step's
time with the minor page faults and the voluntary / involuntary context switches it took, then
the quantiles. Compare settings across processes (IKJAX_SPIN, IKJAX_SPIN_LONG, malloc, ...).
With `--compare` (what bench/cpu_after_decode.py did, folded in here): then ROUNDS pairs of the
N_KV 0 step right after a decode loop and back to back, best and median of each, and two passes
of sweep-bench's own loop (ikjax.tools.sweep_bench.run) in this process.

    IKJAX_CPU_ISA=amx taskset -c 0-15 python bench/cpu_step_jitter.py FILE [THREADS] [ROUNDS] [--compare]
"""
from __future__ import annotations

import os
import resource
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import ikjax  # noqa: E402


def main():
    compare = "--compare" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--compare"]
    path = args[0]
    threads = int(args[1]) if len(args) > 1 else 2
    rounds = int(args[2]) if len(args) > 2 else 10
    eng = ikjax.load(path, ctx=1024, ubatch=512, mla=3, fa=True, threads=threads)
    rng = np.random.default_rng(0)
    vocab = eng.config.vocab_size
    st = {"cache": eng.new_cache(1)}

    def prompt(start):
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out, st["cache"] = eng.step(st["cache"], rng.integers(0, vocab, (1, 512)), np.array([start]))
        out.block_until_ready()
        dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        return dt, r1.ru_minflt - r0.ru_minflt, r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw

    def decode(start):
        out, st["cache"] = eng.decode(st["cache"], rng.integers(0, vocab, (1,)), [start], 32)
        out.block_until_ready()

    for s in (0, 512):  # sweep-bench's warm-up: each step once
        prompt(s), decode(s)
    runs = {0: [], 512: []}
    os.access("/ikjax-jitter-runs-start", os.F_OK)  # a marker for strace (lease_x4.sh STAGE=46)
    for i in range(rounds):
        for s in (0, 512):
            decode(s)
            runs[s].append(prompt(s))
    os.access("/ikjax-jitter-runs-end", os.F_OK)
    for s, rs in runs.items():
        ms = np.array([r[0] for r in rs]) * 1e3
        print(f"N_KV {s}: " + " ".join(f"{r[0] * 1e3:.0f}/{r[1]}f/{r[2]}v/{r[3]}i" for r in rs))
        q = np.percentile(ms, [0, 50, 90, 100])
        print(f"  ms min {q[0]:.1f} median {q[1]:.1f} p90 {q[2]:.1f} max {q[3]:.1f}; t/s at the median {512e3 / q[1]:.0f}")
    print(f"  RSS high-water mark {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if not compare:
        return
    after, back = [], []
    for _ in range(rounds):
        decode(0)
        after.append(prompt(0)[0])
        back.append(prompt(0)[0])
    f = lambda xs: f"best {min(xs) * 1e3:.1f} ms, median {np.median(xs) * 1e3:.1f} ms"  # noqa: E731
    print(f"{os.path.basename(path)} -t {threads}: prompt step back to back {f(back)}; right after a 32-token "
          f"decode loop {f(after)}")
    from ikjax.tools import sweep_bench as sb
    for rep in range(2):
        rows = list(sb.run(eng, 32, seed=rep))
        print("sweep_bench.run in this process: " + ", ".join(
            f"N_KV {r.n_kv}: PP {r.t_pp * 1e3:.1f} ms, TG {r.t_tg * 1e3:.1f} ms" for r in rows))


if __name__ == "__main__":
    main()
