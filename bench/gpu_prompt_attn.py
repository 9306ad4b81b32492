"""The -mla 3 prompt attention on a GPU: XLA's form (whole KV bucket) against the Pallas flash
kernel (keys up to each query's position), at R1's and V2-Lite's head counts, one 2048-token chunk
at several starts inside a 16k bucket; checks they agree, prints ms per layer.
    python3 bench/gpu_prompt_attn.py [--heads 128 16] [--bucket 16384] [--ub 2048]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import ops
from pallas_kernels.prompt_attention import attention_kv_flash


CPU = jax.default_backend() == "cpu"  # a rehearsal: the kernel in interpret mode


def timed(fn, *args, reps=5):
    out = fn(*args)
    out.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e3, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--bucket", type=int, default=16384)
    ap.add_argument("--ub", type=int, default=2048)
    ap.add_argument("--bq", type=int, nargs="+", default=[64])
    ap.add_argument("--bk", type=int, nargs="+", default=[64])
    a = ap.parse_args()
    nope, rope, dv, S, T = 128, 64, 128, a.bucket, a.ub
    print(f"device: {jax.devices()[0].device_kind}; T {T}, bucket {S}, bf16")
    for H in a.heads:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, T, H, nope + rope)), jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((1, S, H, nope + dv)) * 0.5, jnp.bfloat16)
        kr = jnp.asarray(rng.standard_normal((1, S, rope)), jnp.bfloat16)
        xla = jax.jit(lambda q, kv, kr, p: ops.attention_kv(q, kv, kr, p, 0.07, nope=nope, flash=True,
                                                             backend="xla"))
        for start in (0, S // 2 - T, S - T):
            pos = jnp.asarray(start + np.arange(T)[None], jnp.int32)
            tx, ox = timed(xla, q, kv, kr, pos)
            row = f"H {H:3d} start {start:5d}: xla {tx:7.2f} ms"
            for bq in a.bq:
                for bk in a.bk:
                    f = jax.jit(lambda q, kv, kr, p, bq=bq, bk=bk: attention_kv_flash(
                        q, kv, kr, p, 0.07, nope, bq=bq, bk=bk, interpret=CPU))
                    tp, op = timed(f, q, kv, kr, pos)
                    err = float(jnp.abs(op - ox).max() / jnp.abs(ox).max())
                    row += f" | pallas bq {bq} bk {bk}: {tp:7.2f} ms ({tx / tp:4.1f}x, rel err {err:.1e})"
            print(row, flush=True)


if __name__ == "__main__":
    main()
