"""Issue 22 on a GPU: the prompt step's kv_b expansion over the whole cache, bounded at run time
(pallas_kernels.quant_matmul.kernel.quant_matmul_live), against XLA's dequantize-then-dot over a
bucket of the same rows (what a step per KV bucket computes) and over the whole cache.
    python3 bench/gpu_live_kv.py [--types Q4_0 Q8_0] [--heads 16 128]"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.bench_util import call_times
from pallas_kernels.quant_matmul import prepare, quant_matmul_ref
from pallas_kernels.quant_matmul.kernel import quant_matmul_live
from pallas_kernels.testing import random_quant_array


def timed(f, *args, n=20):
    return float(np.median(call_times(f, *args, reps=n))) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"])
    ap.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    ap.add_argument("--ctx", nargs="+", type=int, default=[4096, 16384, 65536])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}: kv_b [H*256, 512] x latent rows, bf16, median of 20, us")
    print("| type | heads | cache rows S | live rows | XLA over live rows (a bucket) | XLA over S | live kernel over S | kernel / XLA bucket |")
    print("|---|---|---|---|---|---|---|---|")
    for t in a.types:
        for h in a.heads:
            w = prepare(random_quant_array(t, (h * 256, 512), rng, fast=True))
            xla = jax.jit(lambda x, w: quant_matmul_ref(x, w, jnp.bfloat16).astype(jnp.bfloat16))
            live = jax.jit(lambda x, w, n: quant_matmul_live(x, w, n, jnp.bfloat16))
            for S in a.ctx:
                if h * 256 * S * 2 > 8 << 30:
                    continue
                x = jnp.asarray(rng.standard_normal((1, S, 512)), jnp.bfloat16)
                full = timed(xla, x, w)
                for n in sorted({512, 2048, S // 2, S}):
                    if n > S:
                        continue
                    bucket = timed(xla, x[:, :n], w)
                    k = timed(live, x, w, jnp.int32(n))
                    print(f"| {t} | {h} | {S} | {n} | {bucket:.0f} | {full:.0f} | {k:.0f} | {k / bucket:.2f} |", flush=True)


if __name__ == "__main__":
    main()
