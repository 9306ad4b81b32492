"""The 512-token prompt step with and without this round's CPU prompt ops, side by side in one
process (RESULTS §9h): `before` traces the step with the C++ `attention` / `attention_kv` /
`swiglu_ffn` implementations switched off (their `supported` checks patched to False while it
compiles), which gives the graph of commit deee9ff (XLA's flash attention on concatenated K/V,
three products and XLA's SiLU for the dense FFN); `after` is the product as it is. The two
engines share the file's pages; steps alternate so the machine's slow moments hit both.

    python bench/cpu_prompt_ab.py -m FILE [--reps 6] [--threads 2]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import jax
import numpy as np

import ikjax
from ikjax import ops


@contextlib.contextmanager
def before_ops():
    saved = (ops.attn._attend_cpu_supported, ops.attn._attend_kv_cpu_supported, ops.ffn._ffn_cpu_supported)
    ops.attn._attend_cpu_supported = ops.attn._attend_kv_cpu_supported = ops.ffn._ffn_cpu_supported = \
        lambda *a: False
    try:
        yield
    finally:
        ops.attn._attend_cpu_supported, ops.attn._attend_kv_cpu_supported, ops.ffn._ffn_cpu_supported = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    opts = dict(ctx=1024, ubatch=512, mla=3, fa=True, threads=a.threads)
    engines = {"before": ikjax.load(a.model, **opts), "after": ikjax.load(a.model, **opts)}
    T = 512
    for name, eng in engines.items():
        jax.clear_caches()  # the engines share one jitted step: no trace of the other variant reused
        with before_ops() if name == "before" else contextlib.nullcontext():
            for kv in (T, 2 * T):
                eng.precompile(1, T, kv)
    caches = {k: e.new_cache(1) for k, e in engines.items()}
    rng = np.random.default_rng(0)
    times = {(k, n_kv): [] for k in engines for n_kv in (0, T)}
    for rep in range(a.reps + 1):
        for n_kv in (0, T):
            tok = rng.integers(0, engines["after"].config.vocab_size, (1, T))
            for k, eng in engines.items():
                t0 = time.perf_counter()
                logits, caches[k] = eng.step(caches[k], tok, np.array([n_kv]))
                logits.block_until_ready()
                if rep:  # the first round warms up
                    times[(k, n_kv)].append(time.perf_counter() - t0)
    print(f"{a.model}: 512-token prompt step, -mla 3 -fa 1 -t {a.threads}, {a.reps} alternated reps")
    print("| N_KV | before ms (median, best) | after ms (median, best) | S_PP before / after t/s (median) | ratio |")
    print("|---|---|---|---|---|")
    for n_kv in (0, T):
        b, f = np.array(times[("before", n_kv)]), np.array(times[("after", n_kv)])
        print(f"| {n_kv} | {np.median(b) * 1e3:.0f}, {b.min() * 1e3:.0f} | {np.median(f) * 1e3:.0f}, {f.min() * 1e3:.0f} "
              f"| {T / np.median(b):.0f} / {T / np.median(f):.0f} | {np.median(b) / np.median(f):.2f}x |")


if __name__ == "__main__":
    main()
