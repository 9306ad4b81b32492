"""Micro-benchmark of the C++ CPU fused MoE experts against XLA's jnp reference and the floors.

    python bench/cpu_moe_matmul.py [--types Q8_0,Q4_0] [--threads 0] [--compute f32,bf16]

One DeepSeek-V2-Lite MoE layer (E=64 experts, k=6 used, d=2048, F=1408): decode (N=1, the gather
reference moe_experts_ref) and a prompt micro-batch (N=512, the grouped reference
moe_experts_grouped_ref), both under jit, fused=True, at the same compute dtype. Decode is bound by
reading the selected experts' weight bytes once (6 x 3 matrices), so its floor is those bytes at
the machine's read bandwidth, measured here; the prompt is bound by FLOPs (2 x 3 x N x k x d x F)
against the f32 FMA peak (threads x clock x 32 flop/cycle, or --peak). All numbers come from this
process on a machine that may be shared: take the best of --reps. XLA's grouped reference takes
30-90 s per call at N=512 on 2 cores (--no-xla skips it).
"""
from __future__ import annotations

import argparse
import functools
import os
import time

# the C++ kernels run on the CPU backend only: on a GPU host JAX's default device is the GPU, and
# the custom call has no CUDA handler (the -ot decode's host part is what this script measures)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import cpu as _cpu  # noqa: E402
from pallas_kernels.cpu.bench_util import fma_peak, read_bandwidth  # noqa: E402
from pallas_kernels.moe_matmul import cpu as moe_cpu  # noqa: E402
from pallas_kernels.moe_matmul.reference import moe_experts_grouped_ref, moe_experts_ref  # noqa: E402
from pallas_kernels.testing import random_quant_array  # noqa: E402

E, K_USED, D, F = 64, 6, 2048, 1408  # DeepSeek-V2-Lite routed experts
# --shape r1: DeepSeek R1 / V3's routed experts (k=8 of 256, d=7168, F=2048); --experts cuts E (decode
# reads only the k picked experts, so fewer in RAM change nothing once they exceed the L3)
SHAPES = {"v2-lite": (64, 6, 2048, 1408), "r1": (256, 8, 7168, 2048)}


def timeit(fn, inputs, *weights, reps: int) -> float:
    """Best time of fn over reps calls, each on the next of `inputs` (x, w, ids): fresh routing per
    call, as successive layers read different experts; the same experts every call would be served
    partly from L3 and overstate decode bandwidth."""
    jax.block_until_ready(fn(*inputs[-1], *weights))
    best = float("inf")
    for i in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*inputs[i % len(inputs)], *weights))
        best = min(best, time.perf_counter() - t)
    return best


def routing(N, rng):
    ids = np.stack([rng.choice(E, K_USED, replace=False) for _ in range(N)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (N, K_USED)).astype(np.float32)
    return jnp.asarray(w), jnp.asarray(ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--threads", type=int, default=0, help="0 = every core")
    ap.add_argument("--compute", default="f32", help="comma list of f32, bf16")
    ap.add_argument("--tokens", default="1,512")
    ap.add_argument("--reps", type=int, default=10, help="decode reps (prompt: half, at least 1)")
    ap.add_argument("--shape", default="v2-lite", choices=sorted(SHAPES))
    ap.add_argument("--experts", type=int, default=0, help="E (default: the shape's)")
    ap.add_argument("--no-xla", action="store_true", help="skip XLA's reference (slow at N=512)")
    ap.add_argument("--peak", type=float, default=0.0, help="f32 GFLOP/s peak (default: clock x 32 x threads)")
    args = ap.parse_args()
    global E, K_USED, D, F
    E, K_USED, D, F = SHAPES[args.shape]
    E = args.experts or E
    nth = args.threads or _cpu.available_cores()
    bw = read_bandwidth(nth)
    peak = args.peak or fma_peak(nth)
    print(f"ISA {_cpu.isa()}, {nth} threads, read bandwidth {bw:.1f} GB/s, f32 FMA peak {peak:.0f} GFLOP/s; "
          f"layer E={E} k={K_USED} d={D} F={F}")
    print(f"{'type':6} {'dtype':5} {'N':>4} {'experts':>7} {'cpu ms':>9} {'xla ms':>9} {'speedup':>8} "
          f"{'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8} {'%peak':>6}")
    rng = np.random.default_rng(0)
    for t in args.types.split(","):
        if not moe_cpu.type_supported(random_quant_array(t, (1, 256), rng).qtype.type_id):
            print(f"{t:6} (no C++ path yet)")
            continue
        g, u, dn = (random_quant_array(t, s, rng, fast=True) for s in ((E, F, D), (E, F, D), (E, D, F)))
        g, u, dn = (type(a)(jnp.asarray(a.data), a.qtype, a.shape) for a in (g, u, dn))
        per_expert = (g.nbytes + u.nbytes + dn.nbytes) / E
        for compute in args.compute.split(","):
            dtype = jnp.float32 if compute == "f32" else jnp.bfloat16
            f_cpu = jax.jit(functools.partial(moe_cpu.moe_experts, n_threads=args.threads, compute=compute))
            for N in (int(n) for n in args.tokens.split(",")):
                reps = args.reps if N <= 8 else max(1, args.reps // 2)
                inputs = [(jnp.asarray(rng.standard_normal((N, D)), jnp.float32), *routing(N, rng))
                          for _ in range(reps + 1)]
                tc = timeit(f_cpu, inputs, g, u, dn, reps=reps)
                tx = None
                if not args.no_xla:
                    ref = moe_experts_ref if N * K_USED <= 2 * E else moe_experts_grouped_ref
                    f_xla = jax.jit(functools.partial(ref, dtype=dtype, fused=True))
                    tx = timeit(f_xla, inputs, g, u, dn, reps=max(1, reps // 2))
                used = np.mean([len(np.unique(np.asarray(ids))) for _, _, ids in inputs])
                gbs = used * per_expert / tc / 1e9
                gfl = 2.0 * 3 * N * K_USED * D * F / tc / 1e9
                xs = f"{tx * 1e3:9.2f} {tx / tc:7.1f}x" if tx else f"{'-':>9} {'-':>8}"
                print(f"{t:6} {compute:5} {N:4d} {used:7.1f} {tc * 1e3:9.2f} {xs} {gbs:7.1f} {100 * gbs / bw:4.0f}% "
                      f"{gfl:8.1f} {100 * gfl / peak:5.0f}%", flush=True)


if __name__ == "__main__":
    main()
