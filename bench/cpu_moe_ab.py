"""A/B of two settings of the C++ routed-experts call, alternated call by call in one process.

This workplace's 2-vCPU VMs spread 2x between processes and ±15 % between calls, so two forms of
one kernel are compared here the only way that holds: the same inputs, the forms taking turns
(ABBA), each call timed in process CPU time (a VM's stolen time is not counted; the wall time beside it,
which at several threads shows what the split loses), the best and the
median of each form reported. The setting is an environment variable the kernels read per call
(IKJAX_AMX_FUSED, IKJAX_AMX_MIN_ROWS, IKJAX_AMX, ...).

    python bench/cpu_moe_ab.py --type Q4_0 --shape r1 --experts 32 --tokens 256 --threads 1 \\
        --a IKJAX_AMX_FUSED=0 --b IKJAX_AMX_FUSED=1 --rounds 12
"""
from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the C++ kernels' custom call runs on the CPU backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.moe_matmul import cpu as moe_cpu  # noqa: E402
from pallas_kernels.testing import random_quant_array  # noqa: E402

SHAPES = {"v2-lite": (64, 6, 2048, 1408), "r1": (256, 8, 7168, 2048)}  # E, used, d, F


def _setting(s: str) -> tuple[str, str]:
    name, _, value = s.partition("=")
    return name, value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--down-type", default="", help="ffn_down's type (default: --type; a V2-Lite IQ4_XS file's is Q8_0)")
    ap.add_argument("--shape", default="r1", choices=sorted(SHAPES))
    ap.add_argument("--experts", type=int, default=0, help="E (default: the shape's)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--a", required=True, help="NAME=VALUE of form A")
    ap.add_argument("--b", required=True, help="NAME=VALUE of form B")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    E, used, D, F = SHAPES[args.shape]
    E = args.experts or E
    rng = np.random.default_rng(0)
    types = (args.type, args.type, args.down_type or args.type)
    g, u, dn = (random_quant_array(t, s, rng, fast=True) for t, s in zip(types, ((E, F, D), (E, F, D), (E, D, F))))
    g, u, dn = (type(a)(jnp.asarray(a.data), a.qtype, a.shape) for a in (g, u, dn))
    f = jax.jit(functools.partial(moe_cpu.moe_experts, n_threads=args.threads, compute="bf16"))
    inputs = []
    for _ in range(4):  # fresh routing per call, as successive layers route differently
        ids = np.stack([rng.choice(E, used, replace=False) for _ in range(args.tokens)]).astype(np.int32)
        inputs.append((jnp.asarray(rng.standard_normal((args.tokens, D)), jnp.float32),
                       jnp.asarray(rng.uniform(0.1, 1, (args.tokens, used)).astype(np.float32)), jnp.asarray(ids)))
    forms = {"A": _setting(args.a), "B": _setting(args.b)}
    times = {"A": [], "B": []}
    walls = {"A": [], "B": []}
    for r in range(args.rounds):
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            name, value = forms[k]
            os.environ[name] = value
            x = inputs[r % len(inputs)]
            jax.block_until_ready(f(*x, g, u, dn))  # the form's first call on these inputs untimed
            t, w = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*x, g, u, dn))
            times[k].append(time.process_time() - t)
            walls[k].append(time.perf_counter() - w)
    print(f"{'/'.join(types)} {args.shape} E={E} tokens={args.tokens} ({args.tokens * used / E:.0f} rows an expert) "
          f"-t {args.threads}, {args.rounds} rounds")
    for k in ("A", "B"):
        print(f"  {k} {forms[k][0]}={forms[k][1]}: best {1e3 * min(times[k]):.1f} ms, median {1e3 * np.median(times[k]):.1f} ms; "
              f"wall best {1e3 * min(walls[k]):.1f} ms, median {1e3 * np.median(walls[k]):.1f} ms")
    print(f"  A / B: best {min(times['A']) / min(times['B']):.3f}, median {np.median(times['A']) / np.median(times['B']):.3f}")


if __name__ == "__main__":
    main()
