"""Issue 22: where one cold step's compile goes on a GPU. Each step of `sweep-bench -c CTX -ub UB
-n TG` compiled alone, one after the other, in a fresh compile cache, under jax.profiler: per step
the seconds spent tracing+lowering (Python, under the GIL) against XLA's compile (GIL released), and
the XLA compiler's own trace events (HLO passes, autotuning, Triton / LLVM / ptxas) summed by name.

    python3 bench/gpu_compile_profile.py MODEL.gguf [--ctx 4096 --ubatch 512 --tg 64] [--top 18]

--cprofile: the steps under cProfile instead (no jax.profiler): the Python functions that the
trace + lower spends its time in, by own time and by cumulative time (cProfile's overhead inflates
the Python share; the ranking is what it is for).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--steps", default="", help="indices of the sweep's steps to profile (default all)")
    ap.add_argument("--longest", type=int, default=0, help="also list this many single longest events, with args")
    ap.add_argument("--cprofile", action="store_true", help="Python functions under cProfile, not XLA's events")
    a = ap.parse_args()
    os.environ.setdefault("IKJAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="cc-prof-"))
    import jax
    import jax._src.stages as stages

    import ikjax
    from ikjax.tools import sweep_bench as sb

    spent = {"compile": 0.0}
    orig = stages.Lowered.compile

    def timed_compile(self, *args, **kw):  # XLA's share of a step: the rest is tracing + lowering
        t = time.perf_counter()
        try:
            return orig(self, *args, **kw)
        finally:
            spent["compile"] += time.perf_counter() - t
    stages.Lowered.compile = timed_compile

    t = time.perf_counter()
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ubatch, mla=3, flash_attn=True)
    print(f"load {time.perf_counter() - t:.1f} s; {jax.devices()[0].device_kind}; jax {jax.__version__}")
    shapes = sb._shapes(eng, a.tg, None, None, 1)
    pick = {int(i) for i in a.steps.split(",") if i} or set(range(len(shapes)))
    for i, (kind, n, kv) in enumerate(shapes):
        if i not in pick:
            continue
        logdir = tempfile.mkdtemp(prefix="prof-")
        spent["compile"] = 0.0
        t = time.perf_counter()
        if a.cprofile:
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            eng.precompile_decode(1, a.tg, kv) if kind == "loop" else eng.precompile(1, n, kv)
            prof.disable()
            total = time.perf_counter() - t
            print(f"\n### step {i}: {kind} T={n} kv_needed={kv}: {total:.2f} s under cProfile "
                  f"(XLA compile {spent['compile']:.2f} s of it)")
            for order in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(a.top)
                lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
                start = next((k for k, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
                print(f"  by {order}:")
                print("\n".join("    " + ln[:160] for ln in lines[start:start + a.top + 1]))
            continue
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0  # Python's own frames would slow the tracing being measured
        with jax.profiler.trace(logdir, create_perfetto_trace=True, profiler_options=opts):
            eng.precompile_decode(1, a.tg, kv) if kind == "loop" else eng.precompile(1, n, kv)
        total = time.perf_counter() - t
        print(f"\n### step {i}: {kind} T={n} kv_needed={kv} bucket={eng.kv_bucket(kv, n)}: {total:.2f} s "
              f"= trace+lower {total - spent['compile']:.2f} s + XLA compile {spent['compile']:.2f} s")
        files = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            print("  (no perfetto trace written)")
            continue
        with gzip.open(files[0], "rt") as f:
            events = json.load(f)
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for e in events:
            if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$"):
                s = by_name[e["name"][:90]]
                s[0] += e["dur"] / 1e6
                s[1] += 1
        for name, (sec, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:a.top]:
            print(f"  {sec:8.3f} s  x{cnt:<5d} {name}")
        if a.longest:
            # the single longest events, when they ran (from the trace's first event) and what they
            # carry (a kernel module's name): one long ptxas / LLVM job is a serial floor of the step
            xs = [e for e in events if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$")]
            t_first = min((e["ts"] for e in xs), default=0)
            print(f"  longest {a.longest} single events (start..end s from the trace's first event, thread):")
            for e in sorted(xs, key=lambda e: -e["dur"])[:a.longest]:
                args = json.dumps(e.get("args", {}))[:150]
                print(f"  {e['dur'] / 1e6:8.3f} s  {(e['ts'] - t_first) / 1e6:6.2f}..{(e['ts'] + e['dur'] - t_first) / 1e6:6.2f}"
                      f"  tid {e.get('tid')}  {e['name'][:60]}  {args}")


if __name__ == "__main__":
    main()
