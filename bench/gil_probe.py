"""Issue 22: does `jax.device_put` of a host NumPy array hold the GIL while it copies, and do puts
from several threads add up? (The cold load's puts share the process with the steps' Python
lowering.) Prints, for a 512 MiB array (anonymous memory, and a memory map of FILE when given):
the put's GB/s alone; the rate of a pure-Python counting loop on the main thread while another
thread puts, against the loop alone (near 1.0: the copy releases the GIL); and the aggregate GB/s
of 1, 2, 4 threads putting at once.

    python3 bench/gil_probe.py [FILE]
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np


def main() -> None:
    import jax
    dev = jax.devices()[0]
    n = 512 << 20
    sources = {"anonymous": np.ones(n, np.uint8)}
    if len(sys.argv) > 1:
        mm = np.memmap(sys.argv[1], np.uint8, "r")
        sources["file map"] = mm[64 << 20:(64 << 20) + n]
    jax.device_put(np.ones(1024, np.uint8), dev).block_until_ready()

    def put(x, reps=4):
        for _ in range(reps):
            jax.device_put(x, dev).block_until_ready()

    def count(seconds: float) -> float:
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(1000):
                k += 1
        return k / (time.perf_counter() - t0)

    for name, x in sources.items():
        put(x, 1)
        t = time.perf_counter()
        put(x)
        alone = 4 * n / (time.perf_counter() - t) / 1e9
        base = count(0.5)
        th = threading.Thread(target=put, args=(x, 6))
        t = time.perf_counter()
        th.start()
        rate = count(0.3)
        th.join()
        busy = time.perf_counter() - t
        print(f"{name}: put alone {alone:.2f} GB/s; Python loop beside a putting thread at {rate / base:.2f}x "
              f"its rate alone (the puts took {busy:.2f} s)")
        for k in (1, 2, 4):
            parts = np.array_split(np.arange(n), k)
            views = [x[p[0]:p[-1] + 1] for p in parts]
            ths = [threading.Thread(target=put, args=(v, 4)) for v in views]
            t = time.perf_counter()
            for h in ths:
                h.start()
            for h in ths:
                h.join()
            print(f"   {k} threads putting at once: {4 * n / (time.perf_counter() - t) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
