"""Can the whole decode step, or a run of decode steps, become one CUDA graph? (issue 11)

Each variant runs in its own process (XLA_FLAGS are read at start) on the 27-layer V2-Lite-shape
Q4_0 model (-mla 3 -fa 1), N_KV ~1000. A variant is a step form, a number of decode steps per
dispatch (K: a lax.fori_loop whose body is the forward pass plus an on-device argmax feeding the
next step) and the XLA command-buffer setting. For each it reports ms per token (blocked on each
dispatch) and, from XLA's optimized HLO, how many command buffers the executable holds and which
launched ops stay outside them (what cuts the graph).

    PYTHONPATH=$PWD python bench/gpu_graph.py [--model /tmp/v2l27-Q4_0.gguf] [--only NAME] [--out $OUT]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gpu_decode_hlo import _where  # the op's jax name and source line

CB_ALL = "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"
CB_NOWHILE = "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL"
FLAGS = "--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer="
VARIANTS = {  # name: (K, command buffer types, IKJAX_TOPK)
    "K=1 off": (1, "", "rank"),
    "K=1 cb lax-topk": (1, CB_NOWHILE, "lax"),
    "K=1 cb": (1, CB_NOWHILE, "rank"),
    "K=16 off": (16, "", "rank"),
    "K=16 cb+while lax-topk": (16, CB_ALL, "lax"),
    "K=16 cb+while": (16, CB_ALL, "rank"),
    "K=64 cb+while": (64, CB_ALL, "rank"),
}
N_CALLS, N_KV = 200, 1000
TRIVIAL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "call"}


def outside_graphs(hlo: str) -> tuple[int, collections.Counter]:
    """(command buffers, launched ops left outside them by kind) in the entry computation and in
    the bodies of while loops that are not themselves inside a command buffer."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            name, body = ("ENTRY" if m.group(1) else m.group(2)), []
            continue
        if line.startswith("}"):
            if name:
                comps[name] = body
            name = None
            continue
        if name:
            body.append(line)
    n_cb, left = 0, collections.Counter()

    def walk(comp: str) -> None:
        nonlocal n_cb
        for line in comps.get(comp, []):
            line = re.sub(r"/\*.*?\*/", "", line)
            m = re.search(r"= [^=]*? ([a-z\-]+)\(", line)
            if not m:
                continue
            op = m.group(1)
            if op == "call" and "command_buffer" in line:
                n_cb += 1
                continue
            if op == "while":
                b = re.search(r"body=%?([\w.\-]+)", line)
                left["while (host loop)"] += 1
                if b:
                    walk(b.group(1))
                continue
            if op in TRIVIAL:
                continue
            if op == "custom-call":
                t = re.search(r'custom_call_target="([^"]+)"', line)
                left[f"custom-call {t.group(1) if t else '?'}"] += 1
            elif op == "fusion":
                k = re.search(r"kind=(\w+)", line)
                c = re.search(r"calls=%?([\w.\-]+)", line)
                callee = re.sub(r"[._]\d+$", "", c.group(1)) if c else ""
                left[f"fusion {k.group(1) if k else '?'} {_where(line) or callee}"] += 1
            else:
                left[op] += 1
    walk("ENTRY")
    return n_cb, left


def measure(model: str, K: int, out: str, tag: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import jax
    import jax.numpy as jnp
    import ikjax
    from ikjax.model.deepseek2 import forward
    eng = ikjax.load(model, mla=int(os.environ.get("GRAPH_MLA", "3")), fa=True, ctx=4096, ubatch=512, ctk="f16")
    cache = eng.new_cache(1)
    plan = eng._plan(eng.kv_bucket(N_KV + N_CALLS * K + 8, 1), False, 1)

    def one_step(weights, cache, st):
        logits, cache = forward(weights, cache, st[0].reshape(1, 1), st[1:2], jnp.zeros((1,), jnp.int32),
                                cfg=eng.config, plan=plan)
        return cache, jnp.stack([jnp.argmax(logits[0]).astype(jnp.int32), st[1] + 1, st[2]])

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def run(weights, cache, st):
        if K == 1:
            cache, st = one_step(weights, cache, st)
        else:
            cache, st = jax.lax.fori_loop(0, K, lambda i, c: one_step(weights, *c), (cache, st))
        return st, cache

    st = jax.device_put(np.array([1, N_KV, 0], np.int32))
    t0 = time.perf_counter()
    exe = run.lower(eng.weights, cache, st).compile()
    res = {"compile_s": time.perf_counter() - t0}
    hlo = exe.as_text()
    Path(out, f"graph_{tag}.hlo.txt").write_text(hlo)
    n_cb, left = outside_graphs(hlo)
    res["command_buffers"] = n_cb
    res["outside"] = dict(left.most_common(12))
    res["outside_total"] = sum(left.values())
    for _ in range(3):
        st, cache = exe(eng.weights, cache, st)
    st.block_until_ready()
    n = max(4, N_CALLS // K)
    t0 = time.perf_counter()
    for _ in range(n):
        st, cache = exe(eng.weights, cache, st)
        st.block_until_ready()
    res["ms_per_token"] = (time.perf_counter() - t0) / (n * K) * 1e3
    res["tg_tps"] = 1e3 / res["ms_per_token"]
    if os.environ.get("GRAPH_TRACE"):  # a profile of a few dispatches (perfetto json: device kernels)
        import shutil
        import tempfile
        tmp = tempfile.mkdtemp()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(3):
                st, cache = exe(eng.weights, cache, st)
                st.block_until_ready()
        for f in Path(tmp).rglob("perfetto_trace.json.gz"):
            shutil.copy(f, Path(out, f"trace_{tag}.json.gz"))
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/v2l27-Q4_0.gguf")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", default="")
    ap.add_argument("--budget", type=float, default=480, help="seconds for all variants")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    args = ap.parse_args()
    if args.child:
        K = VARIANTS[args.child][0]
        tag = re.sub(r"\W+", "_", args.child)
        print("RESULT " + json.dumps(measure(args.model, K, args.out, tag)), flush=True)
        return
    if not Path(args.model).exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from ikjax.tools import synthetic
        synthetic.make_model(args.model, "v2-lite", "Q4_0")
    t_end = time.time() + args.budget
    only = [s for s in args.only.split(",") if s]
    lines = ["| variant | ms/token | S_TG t/s | command buffers | launched ops outside them | compile s |",
             "|---|---:|---:|---:|---|---:|"]
    for name, (K, cb, topk) in VARIANTS.items():
        if only and name not in only:
            continue
        left = t_end - time.time()
        if left < 30:
            lines.append(f"| {name} | not run (budget) | | | | |")
            continue
        env = dict(os.environ, XLA_FLAGS=FLAGS + cb, IKJAX_TOPK=topk)
        try:
            p = subprocess.run([sys.executable, __file__, "--child", name, "--model", args.model, "--out", args.out],
                               env=env, capture_output=True, text=True, timeout=left)
            res = next((json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            err = p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else "?"
        except subprocess.TimeoutExpired:
            res, err = None, "timed out"
        if res is None:
            lines.append(f"| {name} | failed: {err} | | | | |")
        else:
            outside = ", ".join(f"{k} x{v}" for k, v in res["outside"].items())
            lines.append(f"| {name} | {res['ms_per_token']:.3f} | {res['tg_tps']:.1f} | {res['command_buffers']} | "
                         f"{res['outside_total']}: {outside} | {res['compile_s']:.1f} |")
        print(lines[-1], flush=True)
    Path(args.out, "gpu_graph.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
