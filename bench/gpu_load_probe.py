"""How fast a GGUF's tensors can reach the GPU from the page cache, and whether JAX's backend start
can run beside Python work (issue 22's warm start: ~3 s of JAX start, then a 2 s load of 8.5 GB).

    python bench/gpu_load_probe.py FILE [--threads 1,2,4,8]

1. `jax.devices()` on a thread while this thread counts in a Python loop: the count against the
   same loop's rate alone says whether the backend's start holds the GIL.
2. Every tensor of FILE (a memory-mapped slice each, page-cached by a first pass) put on the GPU:
   one after the other, from N threads, and as one batched `jax.device_put(list)`: GiB/s each.
"""
from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

T0 = time.perf_counter()
import jax  # noqa: E402
import numpy as np  # noqa: E402

T_IMPORT = time.perf_counter() - T0


def spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2,4,8")
    a = ap.parse_args()
    box = {}
    th = threading.Thread(target=lambda: box.update(t=(time.perf_counter(), jax.devices(), time.perf_counter())))
    t = time.perf_counter()
    th.start()
    count, loops = 0, 0
    while th.is_alive():
        count += spin(0.05)
        loops += 1
    busy = time.perf_counter() - t
    alone = spin(0.5) / 0.5
    t_start, _, t_end = box["t"]
    print(f"import jax {T_IMPORT:.2f} s; jax.devices() on a thread {t_end - t_start:.2f} s; this thread meanwhile "
          f"ran its loop at {count / busy / alone * 100:.0f} % of its rate alone")

    from gguf import GGUFReader
    r = GGUFReader(a.model)
    arrs = [np.asarray(t.data).view(np.uint8).reshape(-1) for t in r.tensors]
    total = sum(x.nbytes for x in arrs)
    for x in arrs:  # page cache
        x.sum(dtype=np.uint64) if x.nbytes < 0 else np.frombuffer(x, np.uint8)[::4096].sum()
    dev = jax.devices()[0]

    def timed(label, fn):
        fn()  # warm (allocator, copy engines)
        jax.clear_caches()
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        dt = time.perf_counter() - t
        print(f"{label}: {total / 2**30:.2f} GiB in {dt:.2f} s, {total / 2**30 / dt:.2f} GiB/s")
        del out

    timed("one by one", lambda: [jax.device_put(x, dev) for x in arrs])
    for n in [int(s) for s in a.threads.split(",") if int(s) > 1]:
        with ThreadPoolExecutor(n) as ex:
            timed(f"{n} threads", lambda: list(ex.map(lambda x: jax.device_put(x, dev), arrs)))
    timed("one batched device_put", lambda: jax.device_put(arrs, dev))


if __name__ == "__main__":
    main()
