"""Which of a prompt step's XLA kernels cost its GPU time, and what they compute (RESULTS §23ao: a 64-token
step of the 27-layer V2-Lite shape spent 26 of its 50 ms in two XLA Triton GEMM fusions). One process: each
step's optimized HLO dumped by XLA, the step traced, and for the most expensive kernels their fusion's
instruction line (operand and result shapes) and the dots inside it printed.

    python3 bench/gpu_fusion_show.py MODEL.gguf [--tokens 64,256] [--ctx 8192] [--ub 512] [--top 6]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="ikjax-hlo-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()

import jax  # noqa: E402  (XLA_FLAGS first)
import numpy as np  # noqa: E402

import ikjax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gpu_trace import gpu_kernels  # noqa: E402


def fusion_text(name: str) -> list[str]:
    """The instruction defining HLO value `name` (a kernel's name with its last '_' as '.') and the dot /
    custom-call lines of the computation it calls, from the dumped optimized modules."""
    hlo = re.sub(r"_(\d+)$", r".\1", name)
    out = []
    for f in sorted(Path(DUMP).glob("*after_optimizations.txt")):
        text = f.read_text(errors="replace")
        m = re.search(rf"^\s*(ROOT )?%?{re.escape(hlo)} = .*$", text, re.M)
        if not m:
            continue
        line = m.group(0).strip()
        out.append(f"[{f.name[:60]}] {line[:600]}")
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            body = re.search(rf"^%?{re.escape(called.group(1))} .*?\n\}}", text, re.M | re.S)
            if body:
                out += ["    " + ln.strip()[:400] for ln in body.group(0).splitlines()
                        if " dot(" in ln or "custom-call(" in ln or "ROOT" in ln][:8]
        break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ub", type=int, default=512)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--start", type=int, default=0)
    a = ap.parse_args()
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ub)
    rng = np.random.default_rng(0)
    for T in (int(t) for t in a.tokens.split(",")):
        cache = eng.new_cache(1)
        toks = rng.integers(100, eng.config.vocab_size, (1, T)).astype(np.int32)
        st = np.full(1, a.start, np.int32)
        logits, cache = eng.step(cache, toks, st)
        jax.block_until_ready(logits)
        tmp = tempfile.mkdtemp()
        t = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(3):
                logits, cache = eng.step(cache, toks, st)
            jax.block_until_ready(logits)
        wall = (time.perf_counter() - t) / 3
        busy, count = collections.Counter(), collections.Counter()
        for e in gpu_kernels(tmp):
            busy[e["name"]] += e["dur"] * 1e-3 / 3
            count[e["name"]] += 1
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"== [1,{T}] at {a.start}: wall {wall * 1e3:.2f} ms (traced), kernels {sum(busy.values()):.2f} ms")
        for name, ms in busy.most_common(a.top):
            print(f"  {ms:7.3f} ms  x{count[name] // 3:4d}  {name[:70]}")
            if not name.startswith(("quant_matmul", "Memcpy", "mla_", "prompt_")):
                for ln in fusion_text(name):
                    print("      " + ln)
    shutil.rmtree(DUMP, ignore_errors=True)


if __name__ == "__main__":
    main()
