"""Is the scanned decode loop's loss after a prompt step (RESULTS §22r-§22s) paid per call or per
token, and does it follow the addresses of the call's small inputs? (issue 22)

Loads MODEL at sweep-bench's shape and, with a 512-token prompt step before every decode call (as
sweep-bench's rows), times decode calls of each length in --tgs two ways: `fresh` = `eng.decode` as
sweep-bench calls it (tokens, positions, length and PRNG key copied to the device anew each call,
so their buffers may land elsewhere after the prompt step's allocations), `stable` = the same
executable called with device arrays made once (the same buffers every call). A cost per call
shows as the intercept of ms-a-call against the length; an address effect as fresh > stable.

    python3 bench/gpu_decode_inputs.py MODEL.gguf [--tgs 16 64 128] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tgs", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--kv", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-prompt", action="store_true", help="calls back to back (no prompt step between)")
    a = ap.parse_args()
    os.environ.setdefault("IKJAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="cc-dinp-"))
    import jax
    import numpy as np

    import ikjax
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=512, mla=3, flash_attn=True)
    rng = np.random.default_rng(0)
    state = {"cache": eng.new_cache(1)}
    rows = []
    for tg in a.tgs:
        eng.precompile_decode(1, tg, a.kv + tg)
        plan = eng._decode_plan(a.kv, tg)
        exe = eng._steps.get(eng._shapes, 1, 1, plan, (tg, eng._sampling_key(None)))
        dev = jax.devices()[0]
        fixed = (jax.device_put(np.array([7], np.int32), dev), jax.device_put(np.array([a.kv], np.int32), dev),
                 jax.device_put(np.int32(tg), dev), jax.random.key(0))

        def call(mode):
            if not a.no_prompt:
                out, state["cache"] = eng.step(state["cache"], rng.integers(0, eng.config.vocab_size, (1, 512)),
                                               np.array([0]))
                out.block_until_ready()
            t = time.perf_counter()
            if mode == "fresh":
                out, state["cache"] = eng.decode(state["cache"], rng.integers(0, eng.config.vocab_size, (1,)), [a.kv], tg)
            else:
                out, state["cache"] = eng.executor.run(exe, eng.weights, state["cache"], *fixed)
            jax.block_until_ready(out)
            return time.perf_counter() - t
        for mode in ("fresh", "stable", "fresh", "stable"):
            for _ in range(2):
                call(mode)
            dt = sorted(call(mode) for _ in range(a.reps))
            rows.append((mode, tg, dt[len(dt) // 2]))
    label = f"{os.environ.get('IKJAX_LAYERS', 'auto')}{' back to back' if a.no_prompt else ', a prompt step before each'}"
    for mode in ("fresh", "stable"):
        pts = [(tg, min(t for m, g, t in rows if m == mode and g == tg)) for tg in a.tgs]
        line = " ".join(f"tg {tg}: {t * 1e3:.2f} ms ({t / tg * 1e6:.0f} us a token)" for tg, t in pts)
        if len(pts) > 1:
            b, c = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
            line += f"; fit {c * 1e3:.2f} ms a call + {b * 1e6:.1f} us a token"
        print(f"{label}, {mode}: {line}")


if __name__ == "__main__":
    main()
