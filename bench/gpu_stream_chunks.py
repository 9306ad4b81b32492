"""Probe (issue 24): can a jitted step move a pinned-host expert tensor to the GPU a slice at a time,
with XLA's own asynchronous copies, so that a prompt step streams a layer's experts through a small
double buffer instead of holding two whole layers (the `IKJAX_STREAM=layer` form's 24 GiB at R1's
size)? For each form: does it compile, is the result right, the executable's temporaries, the peak
device memory, the copies in the optimized HLO, and the time a step against the link's rate.

    python3 bench/gpu_stream_chunks.py [--layers 2] [--chunk 16 32] [--forms static dyn scan whole]

Synthetic bytes of R1's routed-expert shapes (Q4_0: gate / up [256, 2048, 4032], down [256, 7168, 1152]
bytes, 6.34 GB a layer); each chunk's "compute" is a mean over its bytes (the device reads all of them)."""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding

E = 256
SHAPES = [(E, 2048, 4032), (E, 2048, 4032), (E, 7168, 1152)]


def chunk_mean(blks):
    return sum(jnp.mean(b.astype(jnp.float32)) * (b.shape[0] / E) for b in blks)


def step_whole(host, x):
    acc, prev = x, x
    for layer in host:
        *data, _ = lax.optimization_barrier((*layer, prev))
        dev = [jax.device_put(d, jax.memory.Space.Device) for d in data]
        prev = acc
        acc = acc + chunk_mean(dev)
    return acc


def make_step_chunks(S: int, form: str, depth: int):
    n = E // S

    def take(d, c):
        if form == "static":
            return d[c * S:(c + 1) * S]
        return lax.dynamic_slice_in_dim(d, c * S, S, axis=0)

    def step(host, x):
        acc = x
        outs = []  # the accumulator after each chunk, for the buffer's ordering
        for layer in host:
            for c in range(n):
                dep = outs[-depth] if len(outs) >= depth else x
                *data, _ = lax.optimization_barrier((*layer, dep))
                dev = [jax.device_put(take(d, c), jax.memory.Space.Device) for d in data]
                acc = acc + chunk_mean(dev)
                outs.append(acc)
        return acc
    return step


def make_step_scan(S: int):
    n = E // S

    def step(host, x):
        acc = x
        for layer in host:
            def fetch(c, layer=layer):
                return [jax.device_put(lax.dynamic_slice_in_dim(d, c * S, S, axis=0), jax.memory.Space.Device)
                        for d in layer]
            first = fetch(0)

            def body(c, carry, fetch=fetch):
                acc, cur = carry
                nxt = fetch(jnp.minimum(c + 1, n - 1))
                return acc + chunk_mean(cur), nxt
            acc, _ = lax.fori_loop(0, n, body, (acc, first))
        return acc
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--depth", type=int, default=2, help="chunks in flight (the buffer)")
    ap.add_argument("--forms", nargs="+", default=["static", "dyn", "scan", "whole"])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    dev = jax.devices()[0]
    pinned = SingleDeviceSharding(dev, memory_kind="pinned_host")
    t0 = time.perf_counter()
    host, want = [], 0.0
    for layer in range(a.layers):
        ts = []
        for i, s in enumerate(SHAPES):
            v = 1 + layer * 3 + i
            ts.append(jax.device_put(np.full(s, v, np.uint8), pinned))
            want += v
        host.append(ts)
    jax.block_until_ready(host)
    nbytes = sum(t.nbytes for layer in host for t in layer)
    print(f"host tensors: {nbytes / 1e9:.2f} GB pinned in {time.perf_counter() - t0:.1f} s; device {dev.device_kind}")
    t0 = time.perf_counter()
    d = jax.device_put(host[0][0], SingleDeviceSharding(dev, memory_kind="device")).block_until_ready()
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    d = jax.device_put(host[0][1], SingleDeviceSharding(dev, memory_kind="device")).block_until_ready()
    dt = min(dt, time.perf_counter() - t0)
    print(f"plain device_put of one tensor: {host[0][0].nbytes / dt / 1e9:.1f} GB/s")
    del d
    x = jnp.zeros((), jnp.float32)
    cases = []
    for f in a.forms:
        if f == "whole":
            cases.append(("whole", step_whole))
        for S in a.chunk:
            if f in ("static", "dyn"):
                cases.append((f"{f}-{S}", make_step_chunks(S, f, a.depth)))
            elif f == "scan":
                cases.append((f"scan-{S}", make_step_scan(S)))
    for name, fn in cases:
        try:
            t0 = time.perf_counter()
            comp = jax.jit(fn).lower(host, x).compile()
            ct = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            print(f"{name}: compile failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        txt = comp.as_text()
        ops = {k: len(re.findall(k, txt)) for k in ("copy-start", "dynamic-slice", r" slice\(", "S\\(5\\)", "while")}
        ma = comp.memory_analysis()
        temp = getattr(ma, "temp_size_in_bytes", -1) / 1e9
        times, out = [], None
        try:
            for _ in range(a.reps):
                t0 = time.perf_counter()
                out = float(comp(host, x))
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: run failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        peak = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9
        best = min(times)
        print(f"{name}: compile {ct:.1f} s; result {out:.3f} (want {want:.3f}) {'OK' if abs(out - want) < 1e-2 * want else 'WRONG'}; "
              f"step {best * 1e3:.0f} ms = {nbytes / best / 1e9:.1f} GB/s; temp {temp:.2f} GB; peak so far {peak:.2f} GB; "
              f"hlo {ops}", flush=True)


if __name__ == "__main__":
    main()
