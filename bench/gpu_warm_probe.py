"""Where a warm start's seconds go (issue 11: < 10 s from the command to sweep-bench's first row).

Run twice with the same persistent cache (the first run fills it): for the first row's two steps
(the decode loop and the 2048-token prompt step) it times tracing + lowering to StableHLO (paid
even when the executable then comes from the cache: the cache key is a hash of that module) apart
from `.compile()` (the cache read and load), and then their first runs.

    PYTHONPATH=$PWD python bench/gpu_warm_probe.py --model /tmp/v2l27-Q4_0.gguf
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/v2l27-Q4_0.gguf")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import ikjax
    from ikjax.model import cache as kvcache
    from ikjax.runtime import compile_cache
    from ikjax.runtime.executables import _DECODE_GPU_OPTIONS, _jitted_decode, _jitted_forward
    t = {"import": time.perf_counter() - T0}
    t1 = time.perf_counter()
    eng = ikjax.load(args.model, ctx=16384, ubatch=2048, mla=3, fa=True)
    t["load"] = time.perf_counter() - t1
    compile_cache.setup()
    cache = jax.eval_shape(lambda: kvcache.init_cache(eng.cache_layout(1)))
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    plan_d = eng._decode_plan(0, 128)
    plan_p = eng._plan(eng.kv_bucket(2048, 2048), False, 2048)
    exes = {}
    for name, lower in (
        ("decode loop", lambda: _jitted_decode.lower(eng.weights, cache, i32((1,)), i32((1,)), i32(()),
                                                     jax.eval_shape(lambda: jax.random.key(0)), cfg=eng.config,
                                                     plan=plan_d, chunk=128, sampling=eng._sampling_key(None))),
        ("prompt step", lambda: _jitted_forward.lower(eng.weights, cache, i32((1, 2048)), i32((1,)), i32((1,)),
                                                      cfg=eng.config, plan=plan_p))):
        t1 = time.perf_counter()
        low = lower()
        t[f"{name}: trace+lower"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        txt = low.as_text()
        t[f"{name}: as_text ({len(txt) >> 20} MiB)"] = time.perf_counter() - t1
        hits = compile_cache.hits()
        t1 = time.perf_counter()
        exes[name] = low.compile(_DECODE_GPU_OPTIONS if name == "decode loop" else None)
        t[f"{name}: compile ({'cache hit' if compile_cache.hits() > hits else 'compiled'})"] = time.perf_counter() - t1
    c = eng.new_cache(1)
    t1 = time.perf_counter()
    out, c = exes["decode loop"](eng.weights, c, np.ones(1, np.int32), np.zeros(1, np.int32), np.int32(128),
                                 jax.random.key(0))
    out.block_until_ready()
    t["decode loop: first run"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    out, c = exes["prompt step"](eng.weights, c, np.ones((1, 2048), np.int32), np.zeros(1, np.int32),
                                 np.full(1, 2047, np.int32))
    out.block_until_ready()
    t["prompt step: first run"] = time.perf_counter() - t1
    t["total"] = time.perf_counter() - T0
    for k, v in t.items():
        print(f"{v:7.2f} s  {k}")


if __name__ == "__main__":
    main()
