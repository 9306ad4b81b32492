"""Where a CPU prompt step's time goes, by op (issue 26: which parts scale with -t and which do not).

Loads FILE at ik's CPU shape (-c 1024 -ub 512 -mla 3 -fa 1 -t THREADS), runs the 512-token prompt
step a few times, then traces REPS more under jax.profiler and sums the XLA:CPU thunk events by
name; each `ffi_call.N` is named by its custom-call target and output shape from the compiled
module's HLO (dumped by XLA for this process). The step time beside the ops' sum shows what runs
outside them (XLA's own ops, thread hand-offs).

    IKJAX_CPU_ISA=avx2 python bench/cpu_prompt_profile.py FILE [--threads 16] [--reps 3]
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="ikjax-hlo-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()
os.environ.setdefault("IKJAX_COMPILE_CACHE", "0")  # a dump needs a real compile
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import ikjax  # noqa: E402


def op_names() -> dict:
    """{'ffi_call.N': 'target out-shape'} from the largest forward module XLA dumped."""
    mods = sorted(glob.glob(f"{DUMP}/*forward*cpu_after_optimizations.txt"), key=os.path.getsize)
    names = {}
    if not mods:
        return names
    for line in open(mods[-1]):
        m = re.match(r"\s*%?(ffi_call[.\d]*|custom-call[.\d]*) = (\S+) .*custom_call_target=\"([^\"]+)\"", line)
        if m:
            names[m.group(1)] = f"{m.group(3).replace('ikjax_cpu_', '')} -> {m.group(2)}"
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--start", type=int, default=0, help="the step's position (N_KV): 512 is sweep-bench's second row")
    ap.add_argument("--detail", type=int, default=0, help="also the N slowest of XLA's own ops one by one, with their HLO")
    a = ap.parse_args()
    eng = ikjax.load(a.model, ctx=1024, ubatch=a.tokens, mla=3, fa=True, threads=a.threads)
    T = a.tokens
    state = {"cache": eng.new_cache(1)}
    tok = np.random.default_rng(0).integers(0, eng.config.vocab_size, (1, T))

    def run():  # the step donates its cache: the next takes the one it returned
        logits, state["cache"] = eng.step(state["cache"], tok, np.array([a.start]))
        logits.block_until_ready()
    for _ in range(2):
        run()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        run()
    step = (time.perf_counter() - t0) / a.reps
    d = tempfile.mkdtemp(prefix="ikjax-prof-")
    with jax.profiler.trace(d):
        for _ in range(a.reps):
            run()
    ev = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    tot, cnt = collections.Counter(), collections.Counter()
    for e in ev:
        if e.get("ph") == "X" and not e["name"].startswith(("$", "ThunkExecutor", "Pjit")):
            tot[e["name"]] += e["dur"]
            cnt[e["name"]] += 1
    names = op_names()
    isa = os.environ.get("IKJAX_CPU_ISA", "best")
    print(f"{a.model}: {T}-token prompt step at N_KV {a.start}, -t {a.threads}, level {isa}: {step * 1e3:.1f} ms "
          f"({T / step:.0f} t/s)")
    # fold the ops by what they are (the calls inside the layer scan fire once per layer)
    by = collections.Counter()
    for n, t in tot.items():
        by[names.get(n, re.sub(r"[.\d]+$", "", n))] += t
    ffi = sum(t for n, t in tot.items() if n in names)
    xla = sum(t for n, t in tot.items() if n not in names)
    print(f"C++ kernels {ffi / a.reps / 1e3:.1f} ms of the step, XLA's own ops {xla / a.reps / 1e3:.1f} ms (summed: "
          f"ops that overlap count twice), the rest {step * 1e3 - (ffi + xla) / a.reps / 1e3:.1f} ms; top ops (ms a step):")
    for n, t in by.most_common(18):
        print(f"  {t / a.reps / 1e3:8.2f}  {n[:100]}")
    if a.detail:  # XLA's own ops (not the C++ kernels) one by one, each with its HLO line
        mods = sorted(glob.glob(f"{DUMP}/*forward*cpu_after_optimizations.txt"), key=os.path.getsize)
        hlo = open(mods[-1]).read().splitlines() if mods else []
        print(f"XLA's own ops, the {a.detail} slowest (ms a step, calls a step):")
        for n, t in sorted(((n, t) for n, t in tot.items() if n not in names), key=lambda x: -x[1])[:a.detail]:
            line = next((ln.strip() for ln in hlo if re.match(rf"\s*(ROOT )?%?{re.escape(n)} = ", ln)), "")
            print(f"  {t / a.reps / 1e3:8.2f} {cnt[n] / a.reps:4.0f}  {n}: {line[:260]}")


if __name__ == "__main__":
    main()
