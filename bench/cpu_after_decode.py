"""A CPU prompt step timed back to back against the same step right after a decode loop (issue 26).

sweep-bench times each row's prompt step once, right after the row's decode loop; on the device
host's 16 cores its S_PP came out 15-20 % below `cpu_prompt_profile.py`'s steady-state step
(RESULTS §26ad). This alternates the two orders in one process at sweep-bench's shape (-c 1024
-ub 512, a 32-token decode loop) and prints the best and median of each.

    python bench/cpu_after_decode.py FILE [THREADS] [ROUNDS]
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

import ikjax  # noqa: E402


def main():
    path = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    eng = ikjax.load(path, ctx=1024, ubatch=512, mla=3, fa=True, threads=threads)
    rng = np.random.default_rng(0)
    vocab = eng.config.vocab_size
    st = {"cache": eng.new_cache(1)}

    def prompt():
        t = time.perf_counter()
        out, st["cache"] = eng.step(st["cache"], rng.integers(0, vocab, (1, 512)), np.array([0]))
        out.block_until_ready()
        return time.perf_counter() - t

    def decode():
        out, st["cache"] = eng.decode(st["cache"], rng.integers(0, vocab, (1,)), [512], 32)
        out.block_until_ready()

    prompt(), decode(), prompt()
    after, back = [], []
    for _ in range(rounds):
        decode()
        after.append(prompt())
        back.append(prompt())
    f = lambda xs: f"best {min(xs) * 1e3:.1f} ms, median {np.median(xs) * 1e3:.1f} ms"  # noqa: E731
    print(f"{os.path.basename(path)} -t {threads}: prompt step back to back {f(back)}; right after a 32-token "
          f"decode loop {f(after)}")
    # sweep-bench's own loop (ikjax.tools.sweep_bench.run) in this process: its rows' prompt steps
    from ikjax.tools import sweep_bench as sb
    for rep in range(2):
        rows = list(sb.run(eng, 32, seed=rep))
        print("sweep_bench.run in this process: " + ", ".join(
            f"N_KV {r.n_kv}: PP {r.t_pp * 1e3:.1f} ms, TG {r.t_tg * 1e3:.1f} ms" for r in rows))


if __name__ == "__main__":
    main()
