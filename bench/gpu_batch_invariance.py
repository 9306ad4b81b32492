"""Issue 23 on one GPU, in this process (no HTTP): the server's greedy answers against `generate`,
a batched step's row against the same row alone, what one server iteration costs, and where a
second turn's time goes.

    python bench/gpu_batch_invariance.py MODEL [--ctx 8192] [--ub 512] [--np 8] [--parts all]

Parts (comma list): greedy, logits, steps, turn, ops, profile, profile1, profile8, profile64, gil. Run it once with IKJAX_BATCH_INVARIANT=1 (the
default) and once with =0 to see what the row-invariant decode kernels change (and cost).
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import jax
import numpy as np

import ikjax
from ikjax.runtime import scheduler as sched


def run_requests(s, prompts, max_tokens, ignore_eos=True):
    """Submit all at once to the scheduler; their generated ids when all are done."""
    done = threading.Semaphore(0)
    reqs = [s.submit(s.make_request(p, max_tokens, ignore_eos=ignore_eos,
                                    on_event=lambda k, v: done.release() if k in ("done", "error") else None))
            for p in prompts]
    for _ in reqs:
        done.acquire()
    return reqs


def greedy(eng, a, rng):
    s = sched.Scheduler(eng, a.np)
    s.warmup()
    s.start()
    tests = [rng.integers(100, eng.config.vocab_size, n) for n in (7, 300, 700, 1100)]
    fillers = [rng.integers(100, eng.config.vocab_size, 50) for _ in range(a.np - len(tests))]
    reqs = run_requests(s, tests + fillers, 32)
    s.stop()
    same = 0
    for p, r in zip(tests, reqs):
        want = list(eng.generate(p, 32, ignore_eos=True))
        got = r.generated
        same += got == want
        first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
        print(f"  prompt {len(p)}: server == generate: {got == want}" + ("" if first is None else f" (parts at {first})"))
    print(f"greedy equal: {same}/{len(tests)}")


def logits_diff(eng, a, rng):
    """Row 0 of an [np, 1] step against a [1, 1] step on the same cache row."""
    ids = rng.integers(100, eng.config.vocab_size, 300)
    _, one = eng.prefill(eng.new_cache(1), ids)
    big = sched._put_row(eng.new_cache(a.np), one, 0)
    tok = np.array([[int(ids[-1])]], np.int32)
    l1, _ = eng.step(sched._take_row(big, 0), tok, np.array([300]))
    toks = np.zeros((a.np, 1), np.int32)
    toks[0, 0] = tok[0, 0]
    starts = np.full(a.np, 300, np.int32)
    lb, _ = eng.step(big, toks, starts)
    d = float(np.abs(np.asarray(lb, np.float32)[0] - np.asarray(l1, np.float32)[0]).max())
    print(f"logits: row 0 of [{a.np},1] vs [1,1]: max |diff| {d:.3g} (bitwise equal: {d == 0.0})")


def paths(eng, a, rng, n: int = 32):
    """Which executables give a prompt's greedy tokens the same bits: generate (the decode loop,
    chunk 16) against per-token steps and decode loops at batch 1 and batch np (row 0 the prompt,
    the other rows other prompts)."""
    from ikjax.runtime.scheduler import LOOP_STEPS
    V = eng.config.vocab_size
    for plen in (300, 1100):
        p = rng.integers(100, V, plen)
        others = [rng.integers(100, V, 40 + 60 * b) for b in range(1, a.np)]
        want = list(eng.generate(p, n, ignore_eos=True))

        def batch_cache(B):
            logits, one = eng.prefill(eng.new_cache(1), p)
            first = [int(np.argmax(np.asarray(logits, np.float32).reshape(-1)))]
            cache = sched._put_row(eng.new_cache(B), one, 0) if B > 1 else one
            starts = [plen]
            for b in range(1, B):
                lo, c = eng.prefill(eng.new_cache(1), others[b - 1])
                cache = sched._put_row(cache, c, b)
                first.append(int(np.argmax(np.asarray(lo, np.float32).reshape(-1))))
                starts.append(len(others[b - 1]))
            return cache, np.asarray(first, np.int32), np.asarray(starts, np.int32)

        def by_steps(B):
            cache, tok, start = batch_cache(B)
            out = [int(tok[0])]
            for i in range(n - 1):
                logits, cache = eng.step(cache, tok[:, None], start + i)
                tok = np.asarray(sched._argmax_rows(logits)[0]).astype(np.int32)
                out.append(int(tok[0]))
            return out

        def by_loop(B, chunk):
            cache, tok, start = batch_cache(B)
            out = [int(tok[0])]
            while len(out) < n:
                k = min(chunk, n - len(out))
                got, cache = eng.decode(cache, tok, start + len(out) - 1, k, chunk=chunk)
                got = np.asarray(got)[:, :k]
                out += [int(t) for t in got[0]]
                tok = got[:, -1].astype(np.int32)
            return out
        for name, f in (("generate again", lambda: list(eng.generate(p, n, ignore_eos=True))),
                        ("step B=1", lambda: by_steps(1)), (f"step B={a.np}", lambda: by_steps(a.np)),
                        (f"loop B=1 chunk {LOOP_STEPS}", lambda: by_loop(1, LOOP_STEPS)),
                        (f"loop B={a.np} chunk {LOOP_STEPS}", lambda: by_loop(a.np, LOOP_STEPS)),
                        (f"loop B={a.np} chunk 16", lambda: by_loop(a.np, 16))):
            got = f()
            first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
            print(f"  prompt {plen}: {name:22s} == generate: {got == want}" + ("" if first is None else f" (parts at {first})"))


def step_alone(eng, B: int, reps: int = 40) -> tuple[float, float]:
    """(median seconds until Engine.step returns, median seconds of a whole iteration: the step
    and its argmax's ids on the host) of [B, 1] steps in a loop, as the server's loop runs them."""
    cache = eng.new_cache(B)
    toks = np.ones((B, 1), np.int32)
    start = np.full(B, 200, np.int32)
    eng.precompile(B, 1, 200 + reps)
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        logits, cache = eng.step(cache, toks, start + i)
        d = time.perf_counter()
        toks = np.asarray(sched._argmax_rows(logits)[0])[:, None]
        ts.append((d - t, time.perf_counter() - t))
    ts = ts[5:]
    return statistics.median(x[0] for x in ts), statistics.median(x[1] for x in ts)


def steps(eng, a, rng):
    """A server iteration's step: dispatch (until Engine.step returns) and the whole iteration
    (the argmax's ids on the host), for [np,1] and [1,1]; the decode loop per token at batch 1."""
    for B in sorted({1, a.np}):
        ret, whole = step_alone(eng, B)
        print(f"Engine.step [{B},1]: {whole * 1e3:.2f} ms an iteration (returns after {ret * 1e3:.2f} ms)")
    for B in sorted({1, a.np}):
        cache = eng.new_cache(B)
        tok = np.ones(B, np.int32)
        out, cache = eng.decode(cache, tok, np.full(B, 200), 16)
        t = time.perf_counter()
        for i in range(4):
            out, cache = eng.decode(cache, np.asarray(out)[:, -1], np.full(B, 216 + 16 * i), 16)
        np.asarray(out)
        print(f"decode loop [{B}] x16: {(time.perf_counter() - t) / 64 * 1e3:.2f} ms a token")


def turn(eng, a, rng):
    """Second turn over a 4000-token history vs a fresh 64-token prompt (prefix and exact)."""
    for mode in ("prefix", "exact"):
        s = sched.Scheduler(eng, a.np, prompt_cache=mode)
        s.warmup()
        ev = []
        f0 = s._prefill_chunk

        def traced():
            t = time.perf_counter()
            f0()
            ev.append(time.perf_counter() - t)
        s._prefill_chunk = traced
        s.start()
        short = []
        for _ in range(3):
            r = run_requests(s, [rng.integers(100, eng.config.vocab_size, 64)], 4)[0]
            short.append(r.t_first - r.t_submit)
        for _ in range(2):
            hist = rng.integers(100, eng.config.vocab_size, 4000)
            r1 = run_requests(s, [hist], 16)[0]
            follow = np.concatenate([hist, np.asarray(r1.generated, np.int32), rng.integers(100, eng.config.vocab_size, 48)])
            ev.clear()
            r2 = run_requests(s, [follow], 4)[0]
        s.stop()
        ts = statistics.median(short)
        print(f"turn ({mode}): second turn TTFT {(r2.t_first - r2.t_submit) * 1e3:.1f} ms ({r2.n_cached} cached, "
              f"chunks {[round(x * 1e3, 1) for x in ev]} ms) vs 64-token prompt {ts * 1e3:.1f} ms: "
              f"{(r2.t_first - r2.t_submit) / ts:.2f}x")


def ops_rows(eng, a, rng):
    """Each decode op alone at V2-Lite's shapes: row 0 of a batch of np against the row alone
    (inside a decode step's kernel context, jitted as the step jits them)."""
    import jax.numpy as jnp

    from ikjax import ops
    from ikjax.model.layers import rms_norm
    from pallas_kernels.quant_matmul import prepare
    from pallas_kernels.testing import random_quant_array
    B = a.np
    bf = jnp.bfloat16
    gpu = jax.default_backend() == "gpu"
    backend, z = ("pallas", 1) if gpu else ("interpret", 16)  # a CPU smoke run: interpret mode, small shapes

    def check(name, f, *xs):
        def run(*args):
            with ops.kernel_context(backend, 1, seq_tokens=1):
                return f(*args)
        full = np.asarray(jax.jit(run)(*xs))
        one = np.asarray(jax.jit(run)(*(x[:1] for x in xs)))
        d = float(np.abs(full[:1].astype(np.float64) - one.astype(np.float64)).max())
        print(f"  {name}: row 0 of {B} vs alone: max |diff| {d:.3g}{'' if d else ' (bitwise)'}")

    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    for qt, N, K in [("Q4_0", 3072, 2048), ("Q4_0", 2048, 2048), ("Q6_K", 102400, 2048), ("Q8_0", 576, 2048)]:
        N, K = max(N // z, 64), max(K // z, 256)
        w = prepare(random_quant_array(qt, (N, K), rng, fast=True))
        check(f"quant_linear {qt} {N}x{K}", lambda x, w=w: ops.quant_linear(x, w, bf), r(B, K))
    kb = random_quant_array("Q8_0", (16, 512, 128), rng, fast=True)
    check("head_linear k_b", lambda x: ops.head_linear(x, kb, bf), r(B, 1, 16, 128))
    E, F, d, k = 64 // (z // 4 or 1), max(1408 // z, 256), max(2048 // z, 256), 6
    g, u, dn = (prepare(random_quant_array("Q4_0", s, rng, fast=True)) for s in ((E, F, d), (E, F, d), (E, d, F)))
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(B)]), jnp.int32)
    wt = jnp.asarray(rng.uniform(0.1, 1, (B, k)), jnp.float32)
    check("moe_experts", lambda x, w, i: ops.moe_experts(x, w, i, g, u, dn, bf), r(B, d), wt, ids)
    S = 8192 // z
    cache = r(B, 1, S, 576).astype(bf)  # batch first for check's slicing; the op takes [L, B, S, W]
    lens = jnp.asarray(rng.integers(1, S, B), jnp.int32)
    check("mla_decode", lambda q, n, c: ops.mla_decode_attention(q, jnp.moveaxis(c, 0, 1), n, 0.07, v_dim=512,
                                                                 dtype=bf, layer=0),
          r(B, 16, 576), lens, cache)
    for d in (2048, 512):
        nw = r(d)
        check(f"rms_norm {d}", lambda x, nw=nw: rms_norm(x, nw, 1e-6), r(B, 1, d))
    router = r(64, 2048)
    check("router_logits", lambda x: ops.router_logits(x, router), r(B, 2048))
    from ikjax.ops import registry
    check("softmax_rows (64)", registry.softmax_rows, r(B, 64))
    check("sum_rows_small (6)", registry.sum_rows_small, r(B, 6))


def kernel_profile(eng, a, rng):
    """GPU kernel time by kernel name (profiler trace, 5 calls each) of: a 64-token prompt step at
    position 0 and at 4000 (a second turn's step: what grows with the history), an [np,1] and a
    [1,1] decode step. Device busy time against wall time says launch-bound or kernel-bound."""
    import collections
    import shutil
    import tempfile

    from gpu_trace import gpu_kernels  # bench/ is the script's directory

    top = 8 if a.part not in ("profile1", "profile64", "profile8", "profileprompt") else 1000

    def trace(tag, B, T, start, reps=5, last=None):
        cache = eng.new_cache(B)
        # a token per row: rows alike would route alike (one row's experts for the whole batch)
        toks = rng.integers(100, eng.config.vocab_size, (B, T)).astype(np.int32)
        st = np.full(B, start, np.int32)
        eng.precompile(B, T, start + T)
        logits, cache = eng.step(cache, toks, st, last)
        jax.block_until_ready(logits)
        tmp = tempfile.mkdtemp()
        t = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(reps):
                logits, cache = eng.step(cache, toks, st, last)
            jax.block_until_ready(logits)
        wall = (time.perf_counter() - t) / reps
        busy = collections.Counter()
        count = collections.Counter()
        for e in gpu_kernels(tmp):
            busy[e["name"][:60]] += e["dur"] * 1e-3 / reps
            count[e["name"][:60]] += 1
        shutil.rmtree(tmp, ignore_errors=True)
        total = sum(busy.values())
        print(f"  {tag}: wall {wall * 1e3:.2f} ms a step (traced), kernels {total:.2f} ms, "
              f"{sum(count.values()) // reps} kernels")
        for name, ms in busy.most_common(top):
            print(f"      {ms:7.3f} ms  x{count[name] // reps:4d}  {name}")

    if a.part == "profile1":  # the batch-1 decode step alone, every kernel shown
        trace("[1,1] at 300", 1, 1, 300)
        return
    if a.part == "profile8":  # a server's decode batch: every slot live, one live, against [1,1]
        trace("[1,1] at 300", 1, 1, 300)
        trace(f"[{a.np},1] at 300, every row live", a.np, 1, 300)
        trace(f"[{a.np},1] at 300, one row live", a.np, 1, 300, last=np.array([0] + [-1] * (a.np - 1), np.int32))
        return
    if a.part == "profileprompt":  # a first prompt's step at each GPU prompt size: where its fixed cost lies
        for T in eng.prompt_step_sizes():
            trace(f"[1,{T}] at 0", 1, T, 0)
        return
    if a.part == "profile64":  # a second turn's 64-token step against a first prompt's, every kernel
        trace("[1,64] at 0", 1, 64, 0)
        trace("[1,64] at 4000", 1, 64, 4000)
        return
    trace("[1,64] at 0", 1, 64, 0)
    trace("[1,64] at 4000", 1, 64, 4000)
    trace(f"[{a.np},1] at 300", a.np, 1, 300)
    trace("[1,1] at 300", 1, 1, 300)


def gil(eng, a, rng):
    """Whether the scheduler's thread lets others run (the HTTP server's event loop shares the
    process): a watchdog thread sleeps 2 ms in a loop and records how late it wakes, while 7
    streams decode and while a 2048-token prompt is fed among them; the same with a 0.5 ms GIL
    switch interval."""
    import sys
    for interval in (sys.getswitchinterval(), 0.0005):
        sys.setswitchinterval(interval)
        s = sched.Scheduler(eng, a.np)
        s.warmup()
        s.start()
        late: list[tuple[float, float]] = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                t = time.perf_counter()
                time.sleep(0.002)
                late.append((t, time.perf_counter() - t - 0.002))
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        done = threading.Semaphore(0)
        cb = lambda k, v: done.release() if k in ("done", "error") else None
        streams = [s.submit(s.make_request(rng.integers(100, eng.config.vocab_size, 64), 300, ignore_eos=True,
                                           on_event=cb)) for _ in range(min(7, a.np - 1))]
        while sum(len(r.generated) for r in streams) < 20 * len(streams):
            time.sleep(0.01)
        t_long = time.perf_counter()
        long = s.submit(s.make_request(rng.integers(100, eng.config.vocab_size, 2048), 1, ignore_eos=True,
                                       on_event=cb))
        for _ in range(len(streams) + 1):
            done.acquire()
        stop.set()
        w.join()
        s.stop()
        steady = [x for t, x in late if t < t_long]
        during = [x for t, x in late if t_long <= t <= long.t_first]
        print(f"  switch interval {interval * 1e3:.1f} ms: a 2 ms sleep wakes late by median "
              f"{statistics.median(steady) * 1e3:.2f} / max {max(steady) * 1e3:.1f} ms while streams decode, "
              f"max {max(during, default=0) * 1e3:.1f} ms while the long prompt is fed "
              f"({(long.t_first - t_long) * 1e3:.0f} ms)")
    sys.setswitchinterval(0.005)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ub", type=int, default=512)
    ap.add_argument("--np", type=int, default=8)
    ap.add_argument("--parts", default="greedy,logits,steps,turn")
    a = ap.parse_args()
    if os.environ.get("ROWS_GRID") == "columns":  # the rows schedule's launch order before RESULTS §23ao
        import pallas_kernels.quant_matmul.kernel as qk
        qk.ROWS_FIRST = False
    t = time.perf_counter()
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ub)
    print(f"loaded in {time.perf_counter() - t:.1f} s on {jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    for part in a.parts.split(","):
        a.part = part  # (kernel_profile: which profile)
        t = time.perf_counter()
        {"greedy": greedy, "paths": paths, "logits": logits_diff, "steps": steps, "turn": turn, "ops": ops_rows,
         "profile": kernel_profile, "profile1": kernel_profile, "profile8": kernel_profile, "profile64": kernel_profile, "profileprompt": kernel_profile, "gil": gil}[part](eng, a, rng)
        print(f"[{part}: {time.perf_counter() - t:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
