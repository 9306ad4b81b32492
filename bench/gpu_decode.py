"""Where a decode step's time goes, on the GPU: host dispatch vs device work, and the effect of
XLA's command buffers (CUDA graphs) on the many small kernels of a batch-1 step.

    PYTHONPATH=$PWD python bench/gpu_decode.py [--model /tmp/v2lite-Q4_0.gguf] [--out $OUT]

Each variant runs in its own process (XLA_FLAGS are read at start): 300 decode steps at N_KV
~1000 of the 27-layer V2-Lite-shape Q4_0 model, -mla 3 -fa, kernels auto.
- blocked: every step waits for its logits (what sweep-bench and ik time)
- pipelined: steps are queued back to back, one wait at the end (device time + overlap)
- dispatch: time until `step` returns (host cost per step)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CMD_BUFFERS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
               "--xla_gpu_graph_min_graph_size=1")
VARIANTS = {  # name: (XLA_FLAGS, IKJAX_KERNELS); ikjax turns XLA's command buffers off by default
    "kernels auto": ("", "auto"),
    "kernels auto + command buffers": (CMD_BUFFERS, "auto"),
    "XLA only (jnp)": ("", "jnp"),
}


def measure(model: str, ctk: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import ikjax
    eng = ikjax.load(model, mla=3, fa=True, ctx=4096, ubatch=512, ctk=ctk)
    cache = eng.new_cache(1)
    rng = np.random.default_rng(0)
    _, cache = eng.prefill(cache, rng.integers(0, eng.config.vocab_size, 1000), 0)
    tok = lambda: rng.integers(0, eng.config.vocab_size, (1, 1))
    for i in range(5):  # compile + warm
        out, cache = eng.step(cache, tok(), np.array([1000 + i]))
        out.block_until_ready()
    n = 300
    t0 = time.perf_counter()
    for i in range(n):
        out, cache = eng.step(cache, tok(), np.array([1000 + i]))
        out.block_until_ready()
    blocked = (time.perf_counter() - t0) / n
    disp = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        t1 = time.perf_counter()
        out, cache = eng.step(cache, tok(), np.array([1000 + i]))
        disp += time.perf_counter() - t1
    out.block_until_ready()
    pipelined = (time.perf_counter() - t0) / n
    import jax
    import jax.numpy as jnp
    from ikjax.runtime.executables import _jitted_forward
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
    hlo = _jitted_forward.lower(eng.weights, jax.eval_shape(lambda: eng.new_cache(1)),
                                jax.ShapeDtypeStruct((1, 1), jnp.int32), i32, i32, cfg=eng.config,
                                plan=eng._plan(eng.kv_bucket(1001, 1), False)).compile().as_text()
    ops = {k: hlo.count(k) for k in (" fusion(", " custom-call(", " while(", " copy(", " dynamic-update-slice(",
                                     " dynamic-slice(", " sort(", " gather(")}
    return {"ops": ops, "blocked_ms": blocked * 1e3, "pipelined_ms": pipelined * 1e3, "dispatch_ms": disp / n * 1e3,
            "tg_tps": 1 / blocked}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/v2lite-Q4_0.gguf")
    ap.add_argument("--ctk", default="f16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.model, args.ctk)), flush=True)
        return
    if not Path(args.model).exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from ikjax.tools import synthetic
        synthetic.make_model(args.model, "v2-lite", "Q4_0")
    lines = ["| variant | blocked ms/token | S_TG t/s | pipelined ms/token | host dispatch ms | ops in the step |",
             "|---|---:|---:|---:|---:|---|"]
    for name, (flags, kernels) in VARIANTS.items():
        env = dict(os.environ, XLA_FLAGS=flags, IKJAX_KERNELS=kernels)
        p = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--ctk", args.ctk],
                           env=env, capture_output=True, text=True)
        res = next((json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
        if res is None:
            lines.append(f"| {name} | failed: {p.stderr.strip().splitlines()[-1][:150] if p.stderr else '?'} | | | |")
        else:
            lines.append(f"| {name} | {res['blocked_ms']:.3f} | {res['tg_tps']:.1f} | {res['pipelined_ms']:.3f} | "
                         f"{res['dispatch_ms']:.3f} | {res['ops']} |")
        print(lines[-1], flush=True)
    Path(args.out, "gpu_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
