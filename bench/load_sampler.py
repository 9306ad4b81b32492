"""Where `ikjax.load` spends its time, by sampling the loading thread's stack (issue 22's warm start:
a 2.0 s load of 8.5 GB that the link moves in 0.3 s, bench/gpu_load_probe.py).

Loads FILE twice with the load alone (IKJAX_LOAD_OVERLAP=0; the first fills JAX's cache with the
load's small programs, as a warm run finds it), the second with a thread sampling the main thread's
stack every 2 ms: the innermost ikjax frame and the innermost frame of each sample, counted.

    python bench/load_sampler.py FILE [--ctx 4096 --ub 512]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
import traceback
from pathlib import Path

os.environ.setdefault("IKJAX_LOAD_OVERLAP", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import ikjax  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ub", type=int, default=512)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    opts = dict(ctx=a.ctx, ubatch=a.ub, mla=3, fa=True)
    t = time.perf_counter()
    eng = ikjax.load(a.model, **opts)
    jax.block_until_ready(eng.weights)
    print(f"first load {time.perf_counter() - t:.2f} s")
    del eng
    main_id = threading.get_ident()
    own, leaf, stop = collections.Counter(), collections.Counter(), threading.Event()

    def sample():
        while not stop.is_set():
            f = sys._current_frames().get(main_id)
            if f is not None:
                st = traceback.extract_stack(f)
                mine = [fr for fr in st if "/ikjax/" in fr.filename]
                if mine:
                    own[f"{Path(mine[-1].filename).name}:{mine[-1].name}:{mine[-1].lineno}"] += 1
                leaf[f"{Path(st[-1].filename).name}:{st[-1].name}"] += 1
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    eng = ikjax.load(a.model, **opts)
    jax.block_until_ready(eng.weights)
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    n = sum(own.values()) or 1
    print(f"second load {dt:.2f} s; {n} samples; innermost ikjax frame (% of samples):")
    for k, v in own.most_common(a.top):
        print(f"  {100 * v / n:5.1f}  {k}")
    print("innermost frame:")
    for k, v in leaf.most_common(12):
        print(f"  {100 * v / n:5.1f}  {k}")


if __name__ == "__main__":
    main()
