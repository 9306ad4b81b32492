"""XLA's blocked flash attention (ikjax.ops.attn.attend_flash) at several contexts inside one KV
bucket, against the form of an older commit (default 2c: the scan over every block of the bucket),
loaded from git: the time should follow the context, not the bucket. Any backend; on a CPU it is
XLA:CPU's form (the C++ kernels are what a CPU step runs).

    python bench/flash_bucket.py [--old REV] [--T 256 --H 16 --S 4096 --block 512]
"""
import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def module_at(rev: str):
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:ikjax/ops/attn.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "attn_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("attn_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="b83d91b")
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--block", type=int, default=512)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from ikjax.ops import attn as new
    old = module_at(a.old)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, a.T, a.H, 192)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, a.S, a.H, 192)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, a.S, a.H, 128)), jnp.float32)
    fo = jax.jit(old.attend_flash, static_argnames="kv_block")
    fn = jax.jit(new.attend_flash, static_argnames="kv_block")
    print(f"T={a.T} H={a.H} bucket S={a.S} kv_block={a.block}, {jax.devices()[0].device_kind}, old = {a.old}")
    print("| N_KV | old ms | now ms | old / now |")
    print("|---|---|---|---|")
    for n_kv in sorted({0, a.S // 4, a.S // 2, a.S - a.T}):
        pos = jnp.asarray(n_kv + np.arange(a.T)[None], jnp.int32)
        res = []
        for f in (fo, fn):
            f(q, k, v, pos, 0.1, kv_block=a.block).block_until_ready()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                f(q, k, v, pos, 0.1, kv_block=a.block).block_until_ready()
                ts.append(time.perf_counter() - t0)
            res.append(min(ts) * 1e3)
        same = np.array_equal(np.asarray(fo(q, k, v, pos, 0.1, kv_block=a.block)),
                              np.asarray(fn(q, k, v, pos, 0.1, kv_block=a.block)))
        print(f"| {n_kv} | {res[0]:.1f} | {res[1]:.1f} | {res[0] / res[1]:.2f}x{'' if same else ' (outputs differ!)'} |")


if __name__ == "__main__":
    main()
