"""Where a CPU decode (and prompt) step's time goes: the whole step, then each piece of the graph
jitted alone on the model's real weights (issue 9).

    python bench/cpu_decode.py -m MODEL.gguf [-t 2] [--tokens 1] [--kv 512]

Pieces: embedding, per layer the attention block (projections, RoPE, cache write, MLA attention,
output projection), the dense FFN or the MoE (router + routed experts + shared experts), and the
output head. The sum of the pieces against the whole step shows the XLA runtime's own share.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import ikjax
from ikjax import ops
from ikjax.model import deepseek2 as ds
from ikjax.model.layers import DENSE_FFN, dense_ffn, linear, rms_norm
from ikjax.model.moe import moe_ffn
from ikjax.model.rope import inverse_frequencies, rope_tables
from ikjax.model.groups import all_layers
from pallas_kernels.cpu.bench_util import call_times


def best_ms(f, *args, reps: int = 7) -> float:
    return min(call_times(f, *args, reps=reps)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--kv", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("-mla", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    eng = ikjax.load(a.model, mla=a.mla, fa=True, ctx=max(1024, a.kv + a.tokens), threads=a.threads,
                     threads_batch=a.threads, dtype=a.dtype)
    cfg, W = eng.config, eng.weights
    T = a.tokens
    plan = eng._plan(eng.kv_bucket(a.kv + T, T), False, T)
    print(f"{a.model}: backend {plan.backend}, threads {plan.threads}, T={T}, KV {a.kv}, bucket {plan.kv_len}, "
          f"dtype {plan.dtype}, ISA {__import__('pallas_kernels.cpu', fromlist=['isa']).isa()}")
    cache = eng.new_cache(1)
    # random tokens, as sweep-bench: identical ones would all route to the same experts
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
    start = np.array([a.kv], np.int32)
    ts = []
    for _ in range(5):
        cache = eng.new_cache(1)
        t0 = time.perf_counter()
        jax.block_until_ready(eng.step(cache, tokens, start)[0])
        ts.append(time.perf_counter() - t0)
    whole = min(ts) * 1e3

    ctx = ops.kernel_context(plan.backend, plan.threads)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, T, cfg.d_model)), jnp.float32)
    q_pos = jnp.asarray(start[:, None] + np.arange(T)[None, :], jnp.int32)
    cos, sin = rope_tables(inverse_frequencies(cfg), q_pos)
    rows = []
    with ctx:
        rows.append(("embed", best_ms(jax.jit(lambda t: ds.embed(W["token_embd"], t)), jnp.asarray(tokens))))
        groups = W["groups"]
        for i, layer in enumerate(all_layers(W)):
            # the layer's group's cache stack (ikjax.model.cache) and its index in it
            g = next(n for n, grp in enumerate(groups) if i in grp.layers)
            lc = {name: entries[g] for name, entries in eng.new_cache(1).items()}
            j = jnp.int32(i - groups[g].first)
            f_att = jax.jit(lambda x, L, c, j, s: ds.attention_block(rms_norm(x, L["attn_norm"], cfg.rms_eps), L, c, j,
                                                                      s, q_pos, cos, sin, cfg, plan)[0])
            rows.append((f"layer {i} attention", best_ms(f_att, x, layer, lc, j, jnp.asarray(start))))
            if cfg.is_moe_layer(i):
                f = jax.jit(lambda x, L: moe_ffn(x.reshape(T, -1), L, cfg, dtype=plan.compute_dtype, fused=plan.fmoe,
                                                 ser=plan.ser))
                rows.append((f"layer {i} MoE (router+experts+shared)", best_ms(f, x, layer)))
            else:
                f = jax.jit(lambda x, L: dense_ffn(x, L, DENSE_FFN, plan.compute_dtype))
                rows.append((f"layer {i} dense FFN", best_ms(f, x, layer)))
        f_out = jax.jit(lambda x: linear(rms_norm(x[:, -1], W["output_norm"], cfg.rms_eps), W["output"],
                                         plan.compute_dtype))
        rows.append(("output head", best_ms(f_out, x)))
    total = sum(ms for _, ms in rows)
    print(f"whole step: {whole:.2f} ms ({T / whole * 1e3:.1f} tok/s); pieces sum {total:.2f} ms")
    for name, ms in rows:
        print(f"  {name:<40} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
