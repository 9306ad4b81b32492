"""What the kernels' micro-benchmarks share: the CPU's floor (measured read bandwidth, nominal FMA
peak) and the timing of a call (`call_times`)."""
from __future__ import annotations

import threading
import time

import numpy as np


def read_bandwidth(n_threads: int, gib: float = 1.0) -> float:
    """GB/s of reading a `gib` GiB array split over n_threads: an int64 OR-reduction (NumPy releases
    the GIL; cheaper per byte than a float sum, so it measures the memory, not the adder); best of 5."""
    a = np.ones(int(gib * (1 << 27)), np.int64)
    parts = np.array_split(a, n_threads)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        th = [threading.Thread(target=np.bitwise_or.reduce, args=(p,)) for p in parts]
        for h in th:
            h.start()
        for h in th:
            h.join()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def fma_peak(n_threads: int) -> float:
    """Nominal f32 GFLOP/s: threads x /proc/cpuinfo clock x 32 (one 16-lane FMA per cycle, AVX-512 on
    Zen 4; AVX2-only CPUs: two 8-lane FMAs per cycle, also 32). The listed clock is the base clock:
    boost runs higher (this 2-core Zen 4 VM: ~3.1 GHz, so up to ~120 % of this), and Intel cores
    with two AVX-512 FMA units double it; pass --peak with a measured value for a true ratio."""
    mhz = 0.0
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                mhz = max(mhz, float(line.split(":")[1]))
    return n_threads * mhz / 1e3 * 32


def call_times(fn, *args, reps: int) -> list[float]:
    """Seconds of `reps` calls of fn(*args), each waited for (jax.block_until_ready), after one
    untimed call (its compile)."""
    import jax
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return ts
