"""The -mla 2/3 prompt's attention on the CPU at V2-Lite's shape (RESULTS §9h): XLA's flash form
against the C++ kernel (ops.attention / attention_kv), one layer, 512 queries at N_KV 0 and 512.

    python bench/cpu_attention.py [--threads 2] [--reps 7]

Rows: `xla` = ikjax/model/attention.py's attend (flash, kv_block 256) on bf16 K/V built from the
kv_b product (the concatenate / converts included, as the graph ran them); `C++ f32` = the kernel
with f32 queries (f32 products); `C++ bf16` = bf16 q/K/V (vdpbf16ps pairs); `C++ kv` = the op the
model calls now, K and V read in place from the f32 kv_b product and the bf16 rope part. GFLOP/s
count the causal half: 2·H·T·(D + Dv)·(N_KV + T/2).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    B, T, H, nope, R, Dv = 1, 512, 16, 128, 64, 128
    D = nope + R
    print("| N_KV | path | ms (best) | GFLOP/s |\n|---|---|---:|---:|")
    for n_kv in (0, 512):
        S = n_kv + T
        q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((B, S, H, nope + Dv)), jnp.float32)
        kr = jnp.asarray(rng.standard_normal((B, S, R)), jnp.bfloat16)
        q_pos = jnp.asarray(n_kv + np.arange(T)[None], jnp.int32)

        def run(backend, form, q, kv, kr, q_pos):
            with ops.kernel_context(backend, a.threads):
                if form == "kv":
                    return ops.attention_kv(q, kv, kr, q_pos, 0.1, nope=nope, flash=True)
                k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(kr[:, :, None, :].astype(jnp.float32),
                                                                       (B, S, H, R))], -1)
                qq = q if form == "bf16" else q.astype(jnp.float32)
                dt = jnp.bfloat16 if form == "bf16" else jnp.float32
                return ops.attention(qq, k.astype(dt), kv[..., nope:].astype(dt), q_pos, 0.1, flash=True)

        paths = {"xla": ("xla", "bf16"), "C++ f32": ("cpu", "f32"), "C++ bf16": ("cpu", "bf16"),
                 "C++ kv (the model's op)": ("cpu", "kv")}
        fns = {k: jax.jit(lambda *x, b=b, f=f: run(b, f, *x)) for k, (b, f) in paths.items()}
        for f in fns.values():
            f(q, kv, kr, q_pos).block_until_ready()
        best = {k: float("inf") for k in fns}
        for _ in range(a.reps):  # interleaved, so a slow moment of the machine hits every path
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(q, kv, kr, q_pos).block_until_ready()
                best[k] = min(best[k], time.perf_counter() - t0)
        flop = 2 * H * T * (D + Dv) * (n_kv + T / 2)
        for k, t in best.items():
            print(f"| {n_kv} | {k} | {t * 1e3:.1f} | {flop / t / 1e9:.0f} |")


if __name__ == "__main__":
    main()
