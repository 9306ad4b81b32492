"""Issue 22's start-up: where a GPU process's first ~2.7 s go before the first step can lower.

`import jax` (~1 s on the 16-core H200 host) and the first `jax.devices()` (~1.7 s, RESULTS §22k) come
before any step can trace. This times both in fresh processes under settings that might shorten
them, alternating, and prints what `python -X importtime` says the import spends its time on and how
long each CUDA library JAX loads takes to dlopen alone. Needs only the device's own JAX (no ikjax
install).

    python bench/backend_start_probe.py [--reps 3] [--variants default,noprealloc,...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = {
    "default": {},
    "noprealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "frac10": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.10"},
    "cuda_only": {"JAX_PLATFORMS": "cuda"},
    "eager_modules": {"CUDA_MODULE_LOADING": "EAGER"},
    "platform_alloc": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
}

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import numpy
t1 = time.perf_counter()
import jax
t2 = time.perf_counter()
d = jax.devices()
t3 = time.perf_counter()
import jax.numpy as jnp
x = jnp.ones((4,)) + 1
x.block_until_ready()
t4 = time.perf_counter()
print(json.dumps({"numpy": t1 - t0, "jax_import": t2 - t1, "devices": t3 - t2, "first_op": t4 - t3,
                  "n": len(d), "kind": d[0].device_kind}))
"""


def one(env_extra: dict) -> dict:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")  # as ikjax sets it
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not line:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["?"]}
    return json.loads(line[-1])


def importtime(top: int = 12) -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import jax"], capture_output=True, text=True)
    rows = []
    for ln in out.stderr.splitlines():
        parts = ln.split("|")
        if len(parts) == 3 and parts[0].strip().startswith("import time:") and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    print("# import jax: the largest cumulative imports (us cumulative, us self, module)")
    for cum, self_us, name in sorted(rows, reverse=True)[:top]:
        print(f"  {cum:9d} {self_us:9d} {name}")
    print("# the largest self times")
    for cum, self_us, name in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"  {cum:9d} {self_us:9d} {name}")


def dlopen_times() -> None:
    code = r"""
import ctypes, glob, os, time, json, site
res = {}
roots = site.getsitepackages()
pats = ["nvidia/*/lib/lib*.so*", "jax_plugins/*/*.so", "jaxlib/*.so"]
files = []
for r in roots:
    for p in pats:
        files += sorted(glob.glob(os.path.join(r, p)))
for f in files:
    t = time.perf_counter()
    try:
        ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL)
        res[os.path.relpath(f, roots[0])] = round(time.perf_counter() - t, 4)
    except OSError as e:
        res[os.path.relpath(f, roots[0])] = "fail"
print(json.dumps(res))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    try:
        res = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print("# dlopen: failed", out.stderr[-300:])
        return
    timed = sorted(((v, k) for k, v in res.items() if isinstance(v, float)), reverse=True)
    print(f"# dlopen of {len(res)} libraries alone, in order, first load: {sum(v for v, _ in timed):.3f} s; the largest:")
    for v, k in timed[:10]:
        print(f"  {v:.3f} s {k}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    names = a.variants.split(",")
    import importlib.metadata as md
    vers = {p: md.version(p) for p in ("jax", "jaxlib", "ml_dtypes", "numpy") if _has(md, p)}
    plugins = [d.metadata["Name"] + " " + d.version for d in md.distributions() if "jax" in (d.metadata["Name"] or "").lower()]
    print("# versions", vers, "plugins", sorted(set(plugins)))
    one({})  # discarded: the first process reads the binaries from disk
    res: dict[str, list] = {n: [] for n in names}
    for _ in range(a.reps):
        for n in names:
            res[n].append(one(VARIANTS[n]))
    print("# variant: import numpy / import jax / first jax.devices() / first op, seconds (each rep)")
    for n in names:
        rows = res[n]
        if any("error" in r for r in rows):
            print(f"  {n:15s} error {rows}")
            continue
        cols = [" ".join(f"{r[k]:.2f}" for r in rows) for k in ("numpy", "jax_import", "devices", "first_op")]
        mean_dev = sum(r["devices"] for r in rows) / len(rows)
        print(f"  {n:15s} numpy {cols[0]} | jax {cols[1]} | devices {cols[2]} (mean {mean_dev:.2f}) | op {cols[3]}")
    importtime()
    dlopen_times()


def _has(md, p: str) -> bool:
    try:
        md.version(p)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
