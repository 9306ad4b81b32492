"""Where a batched decode step's row 0 first parts from the same row alone (issue 23: greedy
answers equal to `generate` on a GPU).

    IKJAX_LAYERS=unroll IKJAX_BATCH_INVARIANT=1 python bench/gpu_bisect_rows.py MODEL [--np 8]

Every op the layers call (ikjax.ops' products, attention, experts, router; RMSNorm, RoPE, the
attention block, the FFNs) is wrapped so that its output is also returned from the jitted step
(the layers unrolled: a scan's body cannot hand values out). The [np, 1] step and the [1, 1] step
run on the same cache row; the first tap whose row 0 differs names the op (or the fusion around
it) that is not row-invariant. Taps force their values into memory, which can itself change XLA's
fusions: the step's logits are compared both with and without the taps.
"""
from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

import ikjax
from ikjax import ops
from ikjax.model import deepseek2, layers, moe
from ikjax.runtime import scheduler as sched

TAPS: list = []
ON = [False]


def _wrap(owner, name: str, label: str | None = None):
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        out = f(*a, **k)
        if ON[0]:
            first = out[0] if isinstance(out, tuple) else out
            TAPS.append((label or name, first))
        return out
    setattr(owner, name, g)


def install() -> None:
    for n in ("quant_linear", "head_linear", "mla_decode_attention", "moe_experts", "router_logits",
              "attention", "attention_kv", "swiglu_ffn"):
        if hasattr(ops, n):
            _wrap(ops, n)
    _wrap(deepseek2, "rms_norm")
    _wrap(deepseek2, "apply_rope")
    _wrap(deepseek2, "attention_block")
    _wrap(deepseek2, "moe_ffn")
    _wrap(deepseek2, "dense_ffn")
    _wrap(moe, "route")
    _wrap(layers, "swiglu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--np", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--pos", type=int, default=300)
    a = ap.parse_args()
    eng = ikjax.load(a.model, ctx=a.ctx * a.np, ubatch=512, mla=3, fa=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, eng.config.vocab_size, a.pos)
    _, one = eng.prefill(eng.new_cache(1), ids)
    big = sched._put_row(eng.new_cache(a.np), one, 0)
    # the other rows: other prompts at other lengths, as in a server batch
    for b in range(1, a.np):
        _, c = eng.prefill(eng.new_cache(1), rng.integers(100, eng.config.vocab_size, 50 + 97 * b))
        big = sched._put_row(big, c, b)
    tok0 = int(ids[-1])

    def inputs(B):
        toks = rng.integers(100, eng.config.vocab_size, (B, 1)).astype(np.int32)
        toks[0, 0] = tok0
        starts = np.asarray([a.pos] + [50 + 97 * b for b in range(1, B)], np.int32)
        return toks, starts

    # the engine's own steps first (no taps)
    t8, s8 = inputs(a.np)
    fresh = lambda: jax.tree.map(lambda x: x.copy(), big)  # steps donate their cache
    l1, _ = eng.step(sched._take_row(fresh(), 0), t8[:1], s8[:1])
    l8, _ = eng.step(fresh(), t8, s8)
    d = float(np.abs(np.asarray(l8, np.float32)[0] - np.asarray(l1, np.float32)[0]).max())
    print(f"Engine.step logits: row 0 of [{a.np},1] vs [1,1]: max |diff| {d:.3g}", flush=True)

    install()

    def run(cache, toks, starts):
        B = toks.shape[0]
        plan = eng._plan(eng.kv_bucket(int(starts.max()) + 1, 1), False, 1)
        last = np.zeros(B, np.int32)

        names: list[str] = []  # the taps' names, filled while tracing

        def f(w, c, t, s, l_):
            TAPS.clear()
            ON[0] = True
            try:
                logits, _ = deepseek2.forward(w, c, t, s, l_, cfg=eng.config, plan=plan)
            finally:
                ON[0] = False
            names[:] = [n for n, _ in TAPS]
            return logits, [v for _, v in TAPS]
        logits, vals = jax.jit(f)(eng.weights, cache, toks, starts, last)
        return np.asarray(logits, np.float32), [np.asarray(v, np.float32) for v in vals], names

    L1, V1, N1 = run(sched._take_row(fresh(), 0), t8[:1], s8[:1])
    L8, V8, N8 = run(fresh(), t8, s8)
    assert N1 == N8, "the taps differ between the two traces"
    d = float(np.abs(L8[0] - L1[0]).max())
    print(f"tapped step logits: row 0 vs alone: max |diff| {d:.3g}; {len(N1)} taps", flush=True)
    shown = 0
    for i, (n, v1, v8) in enumerate(zip(N1, V1, V8)):
        r8 = v8.reshape(a.np, -1)[:1] if v8.shape[0] == a.np else v8[:1]
        r1 = v1.reshape(1, -1) if v8.shape[0] == a.np else v1[:1]
        if r8.size != r1.size:
            print(f"  tap {i} {n}: shapes {v1.shape} / {v8.shape}")
            continue
        dd = float(np.abs(r8.reshape(-1) - r1.reshape(-1)).max())
        if dd or i < 3:
            print(f"  tap {i:3d} {n:22s} {str(v8.shape):22s} max |diff| {dd:.3g}")
            shown += dd > 0
        if shown >= 12:
            break
    if not shown:
        print("  every tap bitwise equal")


if __name__ == "__main__":
    main()
