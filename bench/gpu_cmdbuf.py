"""Why XLA's command buffers (CUDA graphs) made batch-1 decode slower (issue 11, RESULTS §5), and
whether stable buffer addresses fix it.

A command buffer is recorded once and replayed; XLA records it again whenever a buffer it uses
has moved. A decode step's small inputs (token, position, last index) are fresh arrays every
call, and every layer reads the position (RoPE, cache row): if that forces a re-record of the
whole step each call, the host pays for recording ~800 commands instead of launching them, which
is what §5 measured (dispatch ~4 ms either way). This script times, each variant in its own
process (XLA_FLAGS are read at start), 300 decode steps at N_KV ~1000 of the 27-layer
V2-Lite-shape Q4_0 model (-mla 3 -fa 1, kernels auto):

- `engine`: `Engine.step` as sweep-bench calls it (fresh token / position arrays each call);
- `stable`: the same forward pass in a step whose small inputs live in one donated int32 state
  array that the step itself advances (next token = argmax of the logits, position + 1), so every
  buffer keeps its address from call to call and nothing crosses from the host per token.

    PYTHONPATH=$PWD python bench/gpu_cmdbuf.py [--model /tmp/v2lite-Q4_0.gguf] [--out $OUT]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CMD = "--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer="
VARIANTS = {  # name: (XLA_FLAGS, step form)
    "engine, command buffers off (ikjax default)": (CMD, "engine"),
    "engine, command buffers FUSION,CUSTOM_CALL": (CMD + "FUSION,CUSTOM_CALL", "engine"),
    "stable, command buffers off": (CMD, "stable"),
    "stable, command buffers FUSION,CUSTOM_CALL": (CMD + "FUSION,CUSTOM_CALL", "stable"),
}
N_STEPS, N_KV = 300, 1000


def measure(model: str, form: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import jax
    import jax.numpy as jnp
    import ikjax
    from ikjax.model.deepseek2 import forward
    eng = ikjax.load(model, mla=3, fa=True, ctx=4096, ubatch=512, ctk="f16")
    cache = eng.new_cache(1)  # zeros: decoding at N_KV reads the same rows whatever they hold (no prompt step
    rng = np.random.default_rng(0)  # to compile)
    plan = eng._plan(eng.kv_bucket(N_KV + N_STEPS + 8, 1), False, 1)
    if form == "engine":
        tok = lambda: rng.integers(0, eng.config.vocab_size, (1, 1))
        state = {"cache": cache, "pos": N_KV}

        def one():  # Engine.step as sweep-bench calls it
            out, state["cache"] = eng.step(state["cache"], tok(), np.array([state["pos"]]))
            state["pos"] += 1
            return out
    else:
        @functools.partial(jax.jit, donate_argnums=(1, 2))
        def step(weights, cache, st):
            logits, cache = forward(weights, cache, st[0].reshape(1, 1), st[1:2], jnp.zeros((1,), jnp.int32),
                                    cfg=eng.config, plan=plan)
            nxt = jnp.argmax(logits[0]).astype(jnp.int32)
            return jnp.stack([nxt, st[1] + 1, st[2]]), cache

        state = {"cache": cache, "st": jax.device_put(np.array([1, N_KV, 0], np.int32))}

        def one():  # the stable step: its inputs stay on the device
            state["st"], state["cache"] = step(eng.weights, state["cache"], state["st"])
            return state["st"]

    for _ in range(5):
        one().block_until_ready()
    res = {}
    t0 = time.perf_counter()
    for _ in range(N_STEPS):
        one().block_until_ready()
    res["blocked_ms"] = (time.perf_counter() - t0) / N_STEPS * 1e3
    disp = 0.0
    t0 = time.perf_counter()
    for _ in range(N_STEPS):
        t1 = time.perf_counter()
        out = one()
        disp += time.perf_counter() - t1
    out.block_until_ready()
    res["pipelined_ms"] = (time.perf_counter() - t0) / N_STEPS * 1e3
    res["dispatch_ms"] = disp / N_STEPS * 1e3
    res["tg_tps"] = 1e3 / res["blocked_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/v2lite-Q4_0.gguf")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", default="")
    ap.add_argument("--budget", type=float, default=400, help="seconds for all variants")
    ap.add_argument("--only", default="", help="run only the variants whose name contains this")
    ap.add_argument("--log", action="store_true",
                    help="instead: one `stable` run with command buffers and XLA's command-buffer logging, "
                         "the log's messages counted (does the step record its graphs again on every call?)")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.model, args.child)), flush=True)
        return
    if args.log:
        import collections
        import re
        env = dict(os.environ, XLA_FLAGS=CMD + "FUSION,CUSTOM_CALL", TF_CPP_MIN_LOG_LEVEL="0",
                   TF_CPP_VMODULE="command_buffer_thunk=3,command_buffer_cmd=2,command_buffer_cmd_emitter=2")
        p = subprocess.run([sys.executable, __file__, "--child", "stable", "--model", args.model], env=env,
                           capture_output=True, text=True, timeout=args.budget)
        msgs = collections.Counter()
        for line in p.stderr.splitlines():
            if "command_buffer" in line:
                body = line.split("] ", 1)[-1]
                msgs[re.sub(r"0x[0-9a-f]+|\d+", "N", body)[:140]] += 1
        res = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), "no result")
        out = [f"`stable` step, command buffers FUSION,CUSTOM_CALL, {2 * N_STEPS + 5} steps: {res}", "",
               "| count | message (numbers as N) |", "|---:|---|"]
        out += [f"| {n} | {m.replace('|', '/')} |" for m, n in msgs.most_common(25)]
        Path(args.out, "gpu_cmdbuf_log.md").write_text("\n".join(out) + "\n")
        print("\n".join(out))
        return
    if not Path(args.model).exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from ikjax.tools import synthetic
        synthetic.make_model(args.model, "v2-lite", "Q4_0")
    t_end = time.time() + args.budget
    lines = ["| variant | blocked ms/token | S_TG t/s | pipelined ms/token | host dispatch ms |", "|---|---:|---:|---:|---:|"]
    for name, (flags, form) in VARIANTS.items():
        if args.only not in name:
            continue
        left = t_end - time.time()
        if left < 30:
            lines.append(f"| {name} | not run (budget) | | | |")
            continue
        env = dict(os.environ, XLA_FLAGS=flags)
        try:
            p = subprocess.run([sys.executable, __file__, "--child", form, "--model", args.model], env=env,
                               capture_output=True, text=True, timeout=left)
            res = next((json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            err = p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else "?"
        except subprocess.TimeoutExpired:
            res, err = None, "timed out"
        if res is None:
            lines.append(f"| {name} | failed: {err} | | | |")
        else:
            lines.append(f"| {name} | {res['blocked_ms']:.3f} | {res['tg_tps']:.1f} | {res['pipelined_ms']:.3f} | "
                         f"{res['dispatch_ms']:.3f} |")
        print(lines[-1], flush=True)
    Path(args.out, "gpu_cmdbuf.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
