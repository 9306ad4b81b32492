"""The CPU's floor for the kernels' micro-benchmarks: measured read bandwidth and nominal FMA peak."""
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
