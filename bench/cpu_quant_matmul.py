"""Micro-benchmark of the C++ CPU quantized matmul against XLA's dequantize-then-dot and the floor.

    python bench/cpu_quant_matmul.py [--types Q8_0,Q4_0] [--threads 2] [--reps 5]

Shapes are DeepSeek-V2-Lite's: an expert's gate/up (2048 -> 1408) and down (1408 -> 2048), the
attention output projection (2048 x 2048), the dense layer's gate/up (2048 -> 10944) and down, and
the vocabulary projection (102400 x 2048); M = 1 (decode) and M = 512 (a prompt micro-batch). The
small matrices stay in L3 across repetitions (the model reads them from DRAM once per token): their
GB/s is the kernel's compute speed; `output` (209 MB of Q8_0) and the dense FFN show DRAM's.
--compute f32,bf16 runs both modes in one process (bf16 decode = 8-bit activations and VNNI int8
dot products where the CPU has them). The floor of decode is reading the weight bytes at
the machine's measured read bandwidth; the floor of the prompt is its FLOPs at the f32 FMA peak
(cores x clock x 32 flop/cycle for AVX-512 as Zen 4 issues it, or the --peak given). Both floors
are measured/estimated here, in this process, so the table is only as quiet as the machine.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu
from pallas_kernels.cpu.bench_util import fma_peak, read_bandwidth
from pallas_kernels.quant_matmul import cpu
from pallas_kernels.quant_matmul.reference import quant_matmul_ref
from pallas_kernels.testing import random_quant_array
from ikjax.quant import by_name

SHAPES = [("ffn_up_exps", 1408, 2048), ("ffn_down_exps", 2048, 1408), ("attn_output", 2048, 2048),
          ("ffn_up", 10944, 2048), ("ffn_down", 2048, 10944), ("output", 102400, 2048),
          # ffn_down's K (10944) is not a multiple of the K-quants' 256: the nearest that is, for them
          ("ffn_down_256", 2048, 10752)]


def timeit(fn, x, wds, reps: int) -> float:
    """Best time of fn(x, wd), wd cycling through the weight copies wds (one unless --cold)."""
    for wd in wds:
        jax.block_until_ready(fn(x, wd))
    best = float("inf")
    for i in range(max(reps, len(wds))):
        wd = wds[i % len(wds)]
        t = time.perf_counter()
        jax.block_until_ready(fn(x, wd))
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--threads", type=int, default=0, help="0 = every core")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="1,512")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--xla-max-gflop", type=float, default=50.0,
                    help="skip XLA's reference where the product exceeds this (it is slow)")
    ap.add_argument("--peak", type=float, default=0.0, help="f32 GFLOP/s peak (default: clock x 32 x threads)")
    ap.add_argument("--compute", default="f32", help=f"comma-separated, of {sorted(cpu.COMPUTE)}")
    ap.add_argument("--cold", action="store_true",
                    help="cycle through copies of each weight (>= 128 MiB in all) so every call reads it from "
                         "DRAM as a decode step does, not from L3")
    args = ap.parse_args()
    computes = args.compute.split(",")
    bad = [c for c in computes if c not in cpu.COMPUTE]
    if bad:
        ap.error(f"--compute: unknown mode(s) {bad}; choose from {sorted(cpu.COMPUTE)}")
    nth = args.threads or _cpu.available_cores()
    bw = read_bandwidth(nth)
    peak = args.peak or fma_peak(nth)
    print(f"ISA {_cpu.isa()}, {nth} threads, read bandwidth {bw:.1f} GB/s, f32 FMA peak {peak:.0f} GFLOP/s")
    print(f"{'type':6} {'shape':14} {'mode':>4} {'M':>4} {'cpu ms':>9} {'xla ms':>9} {'speedup':>8} "
          f"{'GB/s':>7} {'%bw':>5} {'GFLOP/s':>8} {'%peak':>6}")
    rng = np.random.default_rng(0)
    wanted = set(args.shapes.split(","))
    for t in args.types.split(","):
        for name, N, K in SHAPES:
            if name not in wanted:
                continue
            if K % by_name(t).block_elems:
                print(f"{t:6} {name:14} skipped: K = {K} is not a multiple of the type's block", flush=True)
                continue
            w = random_quant_array(t, (N, K), rng, fast=True)
            w = type(w)(jnp.asarray(w.data), w.qtype, w.shape)
            copies = [w.data]
            if args.cold:  # distinct buffers, together well past the 32 MiB L3 of this class of CPU
                copies += [jnp.asarray(np.asarray(w.data).copy()) for _ in range(max(0, -(-(128 << 20) // w.nbytes) - 1))]
            f_xla = jax.jit(lambda x, wd: quant_matmul_ref(x, type(w)(wd, w.qtype, w.shape), jnp.float32))
            for M in (int(m) for m in args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
                flop = 2.0 * M * N * K
                tx = timeit(f_xla, x, [w.data], reps=max(1, args.reps // 2)) if flop / 1e9 <= args.xla_max_gflop else None
                for mode in computes:
                    f_cpu = jax.jit(lambda x, wd, mode=mode: cpu.quant_matmul(
                        x, type(w)(wd, w.qtype, w.shape), n_threads=args.threads, compute=mode))
                    tc = timeit(f_cpu, x, copies, reps=args.reps)
                    gbs = w.nbytes / tc / 1e9
                    gfl = flop / tc / 1e9
                    xs = f"{tx * 1e3:9.2f} {tx / tc:7.1f}x" if tx else f"{'-':>9} {'-':>8}"
                    print(f"{t:6} {name:14} {mode:>4} {M:4d} {tc * 1e3:9.2f} {xs} {gbs:7.1f} {100 * gbs / bw:4.0f}% "
                          f"{gfl:8.1f} {100 * gfl / peak:5.0f}%", flush=True)


if __name__ == "__main__":
    main()
