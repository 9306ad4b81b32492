"""Which loaded program slows the scanned GPU decode loop (issue 22, RESULTS §22aq / §22as): one
process, the decode loop timed plain, then with each candidate "neighbour" program compiled, run
once and kept alive, then again after the neighbour is dropped (the control that the decode comes
back). §22aq found the prompt step's program, for as long as it is loaded, costs the decode ~11 %;
this bisects it into its parts (a two-row product on the Pallas row kernels, XLA's fusions, ...).

    python3 bench/decode_neighbour_probe.py MODEL.gguf [--only step2,head2,...]
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--kv", type=int, default=512)
    ap.add_argument("--only", default="", help="comma-separated neighbours (default: all)")
    a = ap.parse_args()
    os.environ.setdefault("IKJAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="cc-neigh-"))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ikjax
    from ikjax import ops

    eng = ikjax.load(a.model, ctx=a.ctx, mla=3, flash_attn=True)
    eng.precompile_decode(1, a.tg, a.kv + a.tg)
    rng = np.random.default_rng(0)
    state = {"cache": eng.new_cache(1)}
    vocab = eng.config.vocab_size

    def measure(reps: int = 5) -> float:
        """µs a token of the decode loop (3 calls to warm, `reps` timed back to back)."""
        spent = 0.0
        for i in range(3 + reps):
            t = time.perf_counter()
            out, state["cache"] = eng.decode(state["cache"], rng.integers(0, vocab, (1,)), [a.kv], a.tg)
            jax.block_until_ready(out)
            if i >= 3:
                spent += time.perf_counter() - t
        return spent / reps / a.tg * 1e6

    def drop_prompt_steps() -> None:
        steps = eng._steps
        with steps._lock:
            for k in [k for k in steps.table if k[3] is None]:
                del steps.table[k]
        jax.clear_caches()
        gc.collect()
        eng.precompile_decode(1, a.tg, a.kv + a.tg)

    def reload() -> None:
        eng._steps.forget_all()
        jax.clear_caches()
        gc.collect()
        eng.precompile_decode(1, a.tg, a.kv + a.tg)

    w_out = eng.weights["output"]
    d = eng.config.d_model

    def kept(fn, *args):
        """fn compiled for args, run once; the compiled object returned (alive while held)."""
        c = jax.jit(fn).lower(*args).compile()
        jax.block_until_ready(c(*args))
        return c

    def own_step(t: int, **kw):
        out, _ = eng.step(eng.new_cache(1), rng.integers(0, vocab, (1, t)), np.array([0]), **kw)
        out.block_until_ready()
        return None  # the step's program lives in eng's step table: dropped by drop_prompt_steps

    neighbours = {
        "step1": lambda: own_step(1),
        "step2": lambda: own_step(2),
        "step2idle": lambda: own_step(2, last=np.array([-1])),  # its tokens route to no expert (an idle row)
        "step2all": lambda: own_step(2, all_logits=True),  # the head on both rows
        "head2": lambda: kept(lambda v: ops.quant_linear(v, w_out, jnp.bfloat16), jnp.ones((2, d), jnp.bfloat16)),
        "head8": lambda: kept(lambda v: ops.quant_linear(v, w_out, jnp.bfloat16), jnp.ones((8, d), jnp.bfloat16)),
        "head512": lambda: kept(lambda v: ops.quant_linear(v, w_out, jnp.bfloat16), jnp.ones((512, d), jnp.bfloat16)),
        "softmax": lambda: kept(lambda v: jax.nn.softmax(v * 3.0, -1).sum(-1), jnp.ones((2, 16, 2048), jnp.float32)),
        "dot2": lambda: kept(lambda u, v: jnp.einsum("thd,shd->hts", u, v), jnp.ones((2, 16, 192), jnp.bfloat16),
                             jnp.ones((512, 16, 192), jnp.bfloat16)),
        # device memory held (no program): does the decode's speed follow where its buffers land?
        "pad1m": lambda: jax.block_until_ready(jnp.zeros((1 << 20,), jnp.uint8)),
        "pad7m": lambda: jax.block_until_ready(jnp.zeros((7 << 20,), jnp.uint8)),
        "pad64m": lambda: jax.block_until_ready(jnp.zeros((64 << 20,), jnp.uint8)),
        "pad1g": lambda: jax.block_until_ready(jnp.zeros((1 << 30,), jnp.uint8)),
        # every step dropped and the decode compiled / loaded again (its graph recorded anew)
        "reload": lambda: reload(),
        "dynslice": lambda: kept(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, 0, False) * 2.0,
                                 jnp.ones((27, 2048, 1024), jnp.bfloat16), jnp.int32(3)),
    }
    chosen = [n for n in (a.only.split(",") if a.only else neighbours) if n]
    print(f"plain: {measure():.0f} us a token")
    for name in chosen:
        held = neighbours[name]()
        with_it = measure()
        del held
        if name.startswith("step"):
            drop_prompt_steps()
        else:
            gc.collect()
        after = measure()
        print(f"{name}: {with_it:.0f} us a token while held, {after:.0f} after dropping it", flush=True)


if __name__ == "__main__":
    main()
