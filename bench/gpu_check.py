"""One GPU script: check every Pallas kernel at real sizes against the jnp/XLA path and time both.

    PYTHONPATH=$PWD python bench/gpu_check.py [--quick] [--only qm,moe,mla] [--out FILE]
    python bench/gpu_check.py --small --interpret      # harness smoke test on CPU

Fresh random inputs (generated on the device) for every case; before each kernel run the device
allocator is handed a NaN-filled buffer of the output's size (poison), and the result must be
finite and within tolerance of the reference. Timing: R distinct weight sets (as many as make
>= 512 MB, so the weights stream from HBM rather than L2) in one jitted call, median of 7 calls,
divided by R. Bandwidth counts the fewest bytes a kernel must move (weights + activations +
outputs; for attention the cache rows up to the length). Copy bandwidth: a 1 GiB device-to-device
elementwise copy, bytes read + written.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from ikjax.model import cache as kvcache
from ikjax.model.moe import experts_gather, experts_grouped
from ikjax.quant import QuantArray, by_name
from pallas_kernels.mla_decode import mla_decode, mla_decode_ref
from pallas_kernels.moe_matmul import moe_experts
from pallas_kernels.quant_matmul import prepare, quant_matmul, quant_matmul_ref

ARGS = None
ROWS = []
F16_FIELDS = {"Q4_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0], "Q4_0": [0], "Q8_0": [0]}


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def device_quant(key, name, shape):
    """Random valid GGUF blocks generated on the device -> QuantArray."""
    qt = by_name(name)
    lead, K = tuple(shape[:-1]), shape[-1]
    if name == "BF16":
        x = jax.random.normal(key, shape, jnp.float32) * 0.05
        raw = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint8).reshape(*lead, -1)
        return QuantArray(raw, qt, tuple(shape))
    nb = K // qt.block_elems
    k1, k2 = jax.random.split(key)
    raw = jax.random.bits(k1, (*lead, nb, qt.block_bytes), jnp.uint8)
    for i, off in enumerate(F16_FIELDS[name]):
        s = jax.random.uniform(jax.random.fold_in(k2, i), (*lead, nb), jnp.float32, -0.05, 0.05)
        sb = jax.lax.bitcast_convert_type(s.astype(jnp.float16), jnp.uint8)
        raw = raw.at[..., off:off + 2].set(sb)
    return QuantArray(raw.reshape(*lead, -1), qt, tuple(shape))


def poison(shape_dtype_list):
    """Hand the allocator NaN-filled buffers of the outputs' sizes, then free them."""
    bufs = [jnp.full(s.shape, jnp.nan, s.dtype) for s in shape_dtype_list]
    jax.block_until_ready(bufs)
    del bufs


def time_call(fn, *args, n=7):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def time_looped(f, x, rest, n_inner=16):
    """Median time of one f(x, rest) inside a jitted loop of n_inner iterations (each depends on the
    previous through a zero-valued scalar, so nothing is hoisted and Python dispatch is amortized)."""
    def run(x, rest):
        def body(i, c):
            ys = f(x + c.astype(x.dtype), rest)
            tot = sum(jnp.sum(l.astype(jnp.float32)) for l in jax.tree.leaves(ys))
            return c + tot * 0.0
        return jax.lax.fori_loop(0, n_inner, body, jnp.float32(0))
    return time_call(jax.jit(run), x, rest) / n_inner


def copy_bandwidth():
    x = jnp.arange(2 ** 28, dtype=jnp.uint32)               # 1 GiB
    f = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    t = time_call(f, x, n=10)
    g = jax.jit(lambda a: jax.lax.fori_loop(0, 8, lambda i, b: b ^ jnp.uint32(i + 1), a))
    t2 = time_call(g, x, n=5) / 8
    return 2 * x.nbytes / min(t, t2)


def reps_for(nbytes):
    if ARGS.small:
        return 2
    return int(min(64, max(2, -(-512 * 2 ** 20 // max(nbytes, 1)))))


def record(op, shape, qtype, t_k, t_j, nbytes, err, tol, finite):
    gbs = nbytes / t_k / 1e9
    ok = finite and err < tol
    ROWS.append(dict(op=op, shape=shape, type=qtype, us=t_k * 1e6, us_jnp=t_j * 1e6, gbs=gbs,
                     pct=100 * gbs * 1e9 / BW, speedup=t_j / t_k, err=err, ok=ok))
    r = ROWS[-1]
    print(f"  {op:12s} {shape:28s} {qtype:7s} {r['us']:9.1f} us  jnp {r['us_jnp']:9.1f} us  "
          f"{gbs:7.0f} GB/s {r['pct']:5.1f}%  x{r['speedup']:.2f}  err {err:.1e} {'ok' if ok else 'FAIL'}",
          flush=True)


# ------------------------------------------------------------------------------------------ cases

def case_quant_matmul(name, N, K, M, key):
    interp = ARGS.interpret
    qa = device_quant(key, name, (N, K))
    pw = prepare(qa)
    x = jax.random.normal(jax.random.fold_in(key, 1), (M, K), jnp.float32)
    poison([jax.ShapeDtypeStruct((M, N), jnp.float32)])
    y = jax.jit(lambda x, w: quant_matmul(x, w, interpret=interp))(x, pw)
    # exact reference: x rounded to bf16 as both paths do, float32 weights, float32 HIGHEST matmul
    r = jax.jit(lambda x, w: quant_matmul_ref(x.astype(jnp.bfloat16).astype(jnp.float32), w, jnp.float32))(x, qa)
    err, finite = rel(y, r), bool(jnp.isfinite(y).all())
    nbytes = pw.nbytes + M * K * 2 + M * N * 4
    R = reps_for(pw.nbytes)
    pws = [pw] + [prepare(device_quant(jax.random.fold_in(key, 10 + i), name, (N, K))) for i in range(R - 1)]
    qas = [None] * R
    del qa
    n_in = 2 if ARGS.small else 8
    t_k = time_looped(lambda x, ws: [quant_matmul(x, w, interpret=interp) for w in ws], x, pws, n_in) / R
    # the jnp path reads the GGUF blocks: rebuild R QuantArrays for it
    del pws
    qas = [device_quant(jax.random.fold_in(key, 10 + i), name, (N, K)) for i in range(R)]
    t_j = time_looped(lambda x, ws: [quant_matmul_ref(x, w) for w in ws], x, qas, n_in) / R
    del qas
    record("linear", f"M{M} N{N} K{K}", name, t_k, t_j, nbytes, err, 5e-3, finite)


def case_moe(name, N, E, F, d, k, key):
    interp = ARGS.interpret
    ks = jax.random.split(key, 6)
    qas = [device_quant(ks[0], name, (E, F, d)), device_quant(ks[1], name, (E, F, d)),
           device_quant(ks[2], name, (E, d, F))]
    pws = [prepare(q) for q in qas]
    x = jax.random.normal(ks[3], (N, d), jnp.float32)
    ids = jnp.argsort(jax.random.uniform(ks[4], (N, E)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(ks[5], (N, k), jnp.float32, 0.05, 0.3)
    layer = {"gate_exps": qas[0], "up_exps": qas[1], "down_exps": qas[2]}
    gather = N * k <= 2 * E
    jfn = experts_gather if gather else experts_grouped
    fj = jax.jit(lambda x, w, ids, layer: jfn(x, w, ids, layer, jnp.bfloat16, True))
    fk = jax.jit(lambda x, w, ids, g, u, dn: moe_experts(x, w, ids, g, u, dn, interpret=interp))
    poison([jax.ShapeDtypeStruct((N, d), jnp.float32)])
    y = fk(x, w, ids, *pws)
    r = fj(x, w, ids, layer)
    err, finite = rel(y, r), bool(jnp.isfinite(y).all())
    per_expert = sum(p.nbytes for p in pws) // E
    n_used = len(np.unique(np.asarray(ids))) if gather else E
    nbytes = per_expert * n_used + N * d * 6
    n_in = 2 if ARGS.small else 16
    t_k = time_looped(lambda x, a: moe_experts(x, a[0], a[1], *a[2], interpret=interp), x, (w, ids, pws), n_in)
    t_j = time_looped(lambda x, a: jfn(x, a[0], a[1], a[2], jnp.bfloat16, True), x, (w, ids, layer), n_in)
    form = "moe-gather" if gather else "moe-grouped"
    record(form, f"N{N} E{E} k{k} F{F} d{d}", name, t_k, t_j, nbytes, err, 2e-2, finite)


def case_mla(ctk, B, H, S, key):
    interp = ARGS.interpret
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (B, H, 576), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(ks[1], (B, S, 576), jnp.float32)
    cache = kvcache.quantize_q8_0(c) if ctk == "q8_0" else c.astype(jnp.bfloat16)
    del c
    lengths = jnp.full((B,), S, jnp.int32)
    scale = 0.0722
    fk = jax.jit(lambda q, c, l: mla_decode(q, c, l, scale, interpret=interp))
    fj = jax.jit(lambda q, c, l: mla_decode_ref(q, c, l, scale))
    poison([jax.ShapeDtypeStruct((B, H, 512), jnp.float32)])
    y = fk(q, cache, lengths)
    r = fj(q, cache, lengths)
    err, finite = rel(y, r), bool(jnp.isfinite(y).all())
    # ragged lengths check as well (correctness only)
    l2 = jax.random.randint(ks[2], (B,), 1, S + 1).astype(jnp.int32)
    err = max(err, rel(fk(q, cache, l2), fj(q, cache, l2)))
    cbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))
    nbytes = cbytes + B * H * 576 * 2 + B * H * 512 * 4
    n_in = 2 if ARGS.small else 16
    t_k = time_looped(lambda q, a: mla_decode(q, a[0], a[1], scale, interpret=interp), q, (cache, lengths), n_in)
    t_j = time_looped(lambda q, a: mla_decode_ref(q, a[0], a[1], scale), q, (cache, lengths), n_in)
    record("mla-decode", f"B{B} H{H} S{S}", ctk, t_k, t_j, nbytes, err, 1e-2, finite)


def sweep_quant_matmul(name, N, K, M, configs, key):
    """Time alternative schedules of one case (prints only; picks defaults for pick_config)."""
    from pallas_kernels.quant_matmul.kernel import pick_config
    pw = prepare(device_quant(key, name, (N, K)))
    R = reps_for(pw.nbytes)
    pws = [pw] + [prepare(device_quant(jax.random.fold_in(key, 10 + i), name, (N, K))) for i in range(R - 1)]
    x = jax.random.normal(key, (M, K), jnp.float32)
    base = pick_config(name, M, N, K)
    for c in [base] + [dict(base, **c) for c in configs]:
        try:
            t = time_looped(lambda x, ws: [quant_matmul(x, w, config=c) for w in ws], x, pws, 4) / R
            print(f"  sweep {name} M{M} N{N} K{K} {c}: {t * 1e6:.1f} us, {pw.nbytes / t / 1e9:.0f} GB/s", flush=True)
        except Exception as e:
            print(f"  sweep {name} {c}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def sweep_mla(ctk, B, H, S, configs, key):
    from pallas_kernels.mla_decode.kernel import pick_config
    q = jax.random.normal(key, (B, H, 576), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(jax.random.fold_in(key, 1), (B, S, 576), jnp.float32)
    cache = kvcache.quantize_q8_0(c) if ctk == "q8_0" else c.astype(jnp.bfloat16)
    del c
    lengths = jnp.full((B,), S, jnp.int32)
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))
    base = pick_config(B, H, S)
    for cf in [base] + [dict(base, **c) for c in configs]:
        try:
            t = time_looped(lambda q, a: mla_decode(q, a[0], a[1], 0.07, config=cf), q, (cache, lengths), 8)
            print(f"  sweep mla {ctk} B{B} H{H} S{S} {cf}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s", flush=True)
        except Exception as e:
            print(f"  sweep mla {cf}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def main():
    global ARGS, BW
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test of the harness)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--only", default="sweep,qm,moe,mla")
    ap.add_argument("--out", default=os.environ.get("OUT", "") and os.path.join(os.environ["OUT"], "gpu_check.md"))
    ARGS = ap.parse_args()
    only = set(ARGS.only.split(","))
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, device {dev.device_kind} ({jax.default_backend()}), {platform.node()}")
    BW = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {BW / 1e9:.0f} GB/s (read + write)", flush=True)
    key = jax.random.key(int(time.time()))
    nxt = iter(range(10 ** 6))

    def K():
        return jax.random.fold_in(key, next(nxt))

    def run(fn, *a):
        try:
            fn(*a, K())
        except Exception as e:  # keep going: one failing case must not hide the others
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            print(f"  ERROR {fn.__name__}{a}: {type(e).__name__}: {msg}", flush=True)
            ROWS.append(dict(op=fn.__name__, shape=str(a), type="", us=float("nan"), us_jnp=float("nan"),
                             gbs=float("nan"), pct=float("nan"), speedup=float("nan"), err=float("nan"),
                             ok=False, error=f"{type(e).__name__}: {msg}"))

    if ARGS.small:
        qm = [("Q4_0", 64, 512, 1), ("Q4_K", 64, 512, 3), ("Q8_0", 64, 512, 20)]
        moe = [("Q4_0", 1, 8, 256, 256, 2), ("Q4_0", 20, 8, 256, 256, 2)]
        mla = [("bf16", 1, 16, 128), ("q8_0", 2, 16, 128)]
    else:
        types = ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "BF16"]
        qm = [(t, 2048, 2048, 1) for t in types]                                  # V2-Lite attn_output
        qm += [(t, 2048, 7168, 1) for t in types]                                 # R1 expert gate/up
        qm += [(t, 102400, 2048, 1) for t in (["Q4_0", "Q8_0"] if ARGS.quick else types)]  # V2-Lite output
        qm += [("Q4_0", 2048, 2048, 4), ("Q8_0", 2048, 2048, 4), ("Q4_0", 2048, 2048, 16)]
        qm += [("Q4_0", 1408, 2048, 512), ("Q4_0", 2048, 2048, 2048), ("Q8_0", 2048, 2048, 2048),
               ("Q4_K", 2048, 2048, 2048), ("BF16", 2048, 2048, 2048), ("Q4_0", 18432, 7168, 512)]
        moe = [("Q4_0", 1, 64, 1408, 2048, 6), ("Q8_0", 1, 64, 1408, 2048, 6), ("Q4_0", 4, 64, 1408, 2048, 6),
               ("Q4_0", 1, 256, 2048, 7168, 8), ("Q4_K", 1, 256, 2048, 7168, 8),
               ("Q4_0", 512, 64, 1408, 2048, 6), ("Q4_0", 2048, 64, 1408, 2048, 6)]
        mla = [("bf16", 1, 16, 4096), ("bf16", 1, 16, 16384), ("q8_0", 1, 16, 16384),
               ("bf16", 1, 128, 16384), ("q8_0", 1, 128, 16384), ("bf16", 8, 16, 4096)]
    if "sweep" in only:
        print("schedule sweep", flush=True)
        run(sweep_quant_matmul, "Q4_0", 102400, 2048, 1, [dict(bn=16, bk=512, num_stages=5), dict(num_warps=2, bn=16)])
        run(sweep_quant_matmul, "Q4_K", 102400, 2048, 1, [dict(bn=16), dict(num_stages=4)])
        run(sweep_quant_matmul, "Q8_0", 102400, 2048, 1, [dict(bn=16, bk=512, num_warps=8)])
        run(sweep_mla, "bf16", 1, 16, 16384, [dict(bs=64), dict(bs=64, split=64)])
        run(sweep_mla, "q8_0", 1, 128, 16384, [dict(bh=32), dict(bh=64), dict(bh=32, num_warps=4)])
    if "qm" in only:
        print("quant_matmul", flush=True)
        for c in qm:
            run(case_quant_matmul, *c)
    if "moe" in only:
        print("moe_matmul", flush=True)
        for c in moe:
            run(case_moe, *c)
    if "mla" in only:
        print("mla_decode", flush=True)
        for c in mla:
            run(case_mla, *c)

    head = (f"card: {dev.device_kind}; jax {jax.__version__}; copy bandwidth {BW / 1e9:.0f} GB/s; "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; command: python bench/gpu_check.py "
            + " ".join(sys.argv[1:]))
    lines = [head, "", "| op | shape | type | Pallas µs | jnp µs | GB/s | % copy BW | speedup vs jnp | rel err | check |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in ROWS:
        chk = "ok" if r["ok"] else ("FAIL " + r.get("error", "")).strip()
        lines.append(f"| {r['op']} | {r['shape']} | {r['type']} | {r['us']:.1f} | {r['us_jnp']:.1f} | "
                     f"{r['gbs']:.0f} | {r['pct']:.1f} | {r['speedup']:.2f} | {r['err']:.1e} | {chk} |")
    table = "\n".join(lines)
    print("\n" + table)
    if ARGS.out:
        Path(ARGS.out).write_text(table + "\n")
    n_bad = sum(not r["ok"] for r in ROWS)
    print(f"\n{len(ROWS) - n_bad}/{len(ROWS)} cases ok")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
