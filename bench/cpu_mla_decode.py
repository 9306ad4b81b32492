"""Micro-benchmark of the C++ CPU MLA attention against XLA's reference under jit.

Decode (one query per sequence) at V2-Lite (16 heads) and R1 (128 heads) geometry, width 576 /
v 512, the cache full to S = 512, 4096, 16384 entries, f16 and q8_0: milliseconds per call, GB/s
of cache read (S x row bytes / time) against this machine's measured read bandwidth, and GFLOP/s
(2·S·H·(576 + 512) per call) — absorbed MLA decode does H·1088 FMAs per 1152-byte f16 row, so on a
CPU it is compute-bound well before memory-bound. `--prompt` adds 512-token causal prompt steps.
Times are the best of the repetitions (this machine is shared; the best is the least disturbed).

    python bench/cpu_mla_decode.py [--threads N] [--quick] [--prompt] [--no-xla]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu as _cpu
from pallas_kernels.cpu.bench_util import call_times
from pallas_kernels.mla_decode import cpu as mla_cpu
from pallas_kernels.mla_decode.reference import latent_values, mla_decode_ref

D, V = 576, 512


def measure_bandwidth(gib: float = 1.0) -> float:
    """Read bandwidth in GB/s: numpy sum over a `gib` GiB float32 array (one thread), best of 5."""
    a = np.ones(int(gib * 2**30) // 4, np.float32)
    a.sum()
    best = min(_time(lambda: a.sum()) for _ in range(5))
    return a.nbytes / best / 1e9


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timeit(fn, *args, reps: int):
    ts = call_times(fn, *args, reps=reps)
    return min(ts), statistics.median(ts)


def quantize_q8_0(x: np.ndarray) -> dict:
    """ggml's q8_0 as ikjax/model/cache.py stores it: {"q": int8 [.., nb, 32], "d": f16 [.., nb]}."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(-1) / 127.0
    q = np.round(blocks / np.where(d > 0, d, 1.0)[..., None]).astype(np.int8)
    return {"q": jnp.asarray(q), "d": jnp.asarray(d.astype(np.float16))}


def row_bytes(ctk: str) -> int:
    return D // 32 * 34 if ctk == "q8_0" else D * 2


def make(B, T, H, S, ctk, rng):
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    c = rng.standard_normal((B, S, D)).astype(np.float32)
    cache = quantize_q8_0(c) if ctk == "q8_0" else jnp.asarray(c, jnp.float16)
    return q, cache


def xla_prompt(q, cache, q_pos, scale):
    """Absorbed attention of T queries in plain jnp (scores materialized, causal by position)."""
    kv = latent_values(cache, jnp.float32)[..., :D]
    s = jnp.einsum("bthd,bsd->bhts", q, kv, precision="highest") * scale
    s = jnp.where(jnp.arange(kv.shape[1])[None, None, None] <= q_pos[:, None, :, None], s, -jnp.inf)
    return jnp.einsum("bhts,bsd->bthd", jax.nn.softmax(s, -1), kv[..., :V], precision="highest")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (-t); 0 = every core")
    ap.add_argument("--quick", action="store_true", help="S = 512 and 4096 only, fewer repetitions")
    ap.add_argument("--prompt", action="store_true", help="also 512-token causal prompt steps")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA reference timings")
    args = ap.parse_args()
    if not _cpu.available():
        raise SystemExit(_cpu.unavailable_reason())
    bw = measure_bandwidth()
    print(f"cpu kernels: isa {_cpu.isa()}, {_cpu.available_cores()} cores, threads {args.threads or 'all'}; "
          f"measured read bandwidth {bw:.1f} GB/s (numpy sum, 1 GiB, one thread)")
    rng = np.random.default_rng(0)
    sizes = (512, 4096) if args.quick else (512, 4096, 16384)
    reps = 5 if args.quick else 10
    print("| op | heads | cache | S | cpu ms | cache GB/s | % of bw | GFLOP/s | xla f32 ms | xla bf16 ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for H, name in ((16, "v2-lite"), (128, "r1")):
        for ctk in ("f16", "q8_0"):
            for S in sizes:
                q, cache = make(1, 1, H, S, ctk, rng)
                lengths = jnp.array([S], jnp.int32)
                scale = 0.1
                cpu_fn = jax.jit(lambda q, c, l: mla_cpu.mla_decode(q, c, l, scale, v_dim=V, n_threads=args.threads))
                t_cpu, _ = timeit(cpu_fn, q[:, 0], cache, lengths, reps=reps)
                gbs = S * row_bytes(ctk) / t_cpu / 1e9
                gflops = 2 * S * H * (D + V) / t_cpu / 1e9
                xs = ["-", "-"]
                if not args.no_xla:
                    for i, dt in enumerate((jnp.float32, jnp.bfloat16)):
                        ref = jax.jit(lambda q, c, l, dt=dt: mla_decode_ref(q, c, l, scale, v_dim=V, dtype=dt))
                        xs[i] = timeit(ref, q[:, 0], cache, lengths, reps=max(2, reps // 2))[0]
                speed = f"{xs[0] / t_cpu:.1f}x" if xs[0] != "-" else "-"
                xs = [f"{x * 1e3:.2f}" if x != "-" else x for x in xs]
                print(f"| decode | {H} ({name}) | {ctk} | {S} | {t_cpu * 1e3:.3f} | {gbs:.2f} | "
                      f"{100 * gbs / bw:.0f}% | {gflops:.1f} | {xs[0]} | {xs[1]} | {speed} |", flush=True)
    if args.prompt:
        T = 512
        for H in (16, 128):
            for ctk in ("f16", "q8_0"):
                for n_kv in (0, 3584):
                    S = n_kv + T
                    q, cache = make(1, T, H, S, ctk, rng)
                    q_pos = jnp.asarray(n_kv + np.arange(T)[None], jnp.int32)
                    cpu_fn = jax.jit(lambda q, c, p: mla_cpu.mla_attention(q, c, p, 0.1, v_dim=V, n_threads=args.threads))
                    t_cpu, _ = timeit(cpu_fn, q, cache, q_pos, reps=3)
                    keys = T * n_kv + T * (T + 1) / 2
                    gflops = 2 * keys * H * (D + V) / t_cpu / 1e9
                    x = "-"
                    if not args.no_xla:
                        ref = jax.jit(lambda q, c, p: xla_prompt(q, c, p, 0.1))
                        x = timeit(ref, q, cache, q_pos, reps=2)[0]
                    xs = f"{x * 1e3:.1f}" if x != "-" else x
                    speed = f"{x / t_cpu:.1f}x" if x != "-" else "-"
                    print(f"| prompt {T} @ {n_kv} | {H} | {ctk} | {S} | {t_cpu * 1e3:.1f} | - | - | {gflops:.1f} | "
                          f"{xs} | - | {speed} |", flush=True)


if __name__ == "__main__":
    main()
