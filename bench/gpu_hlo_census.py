"""Issue 22: what XLA compiles for each first-row step on a GPU. Each step of the deep first row
compiled alone (a fresh compile cache); its optimized HLO read back (`Compiled.as_text`): fusions by
emitter (XLA's own loop / reduction kernels, Triton GEMM and softmax fusions, cuBLAS calls, Pallas
kernels), each Pallas kernel by name with the size of its Triton module, and the sort kernels. A
census of what the kernel compile (LLVM, ptxas: most of a cold step's CPU time) is spent on.

    python3 bench/gpu_hlo_census.py MODEL.gguf [--ctx 16384 --ubatch 2048 --tg 128] [--steps 0,1]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import tempfile
import time


def census(text: str) -> None:
    kinds = collections.Counter()
    pallas = collections.Counter()
    pallas_size: dict[str, int] = {}
    calls = collections.Counter()
    for line in text.splitlines():
        line = line.strip()
        if " fusion(" in line and "calls=" in line:
            k = re.search(r"kind=(k\w+)", line)
            be = re.search(r'"kind":"(__\w+)"', line)
            kinds[(k.group(1) if k else "?") + (":" + be.group(1) if be else "")] += 1
        m = re.search(r'custom_call_target="([^"]+)"', line)
        if m:
            calls[m.group(1)] += 1
            if "triton" in m.group(1):
                name = re.search(r'"name":\s*"([^"]+)"', line) or re.search(r"name=\\?\"?(\w+)", line)
                key = name.group(1) if name else line.split("=")[0]
                pallas[key] += 1
                pallas_size[key] = max(pallas_size.get(key, 0), len(line))
        if re.search(r"= \S+ sort\(", line):
            kinds["sort (unfused)"] += 1
    print("  fusions by kind:", dict(kinds.most_common()))
    print("  custom calls:", dict(calls.most_common()))
    print(f"  Pallas / Triton custom calls: {sum(pallas.values())} ({len(pallas)} distinct names)")
    for k, n in sorted(pallas.items(), key=lambda kv: -pallas_size[kv[0]]):
        print(f"    x{n:<3d} {pallas_size[k] / 1e3:8.1f} kB  {k[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--ubatch", type=int, default=2048)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--steps", default="0,1")
    ap.add_argument("--save", default="", help="folder to write each step's optimized HLO into")
    a = ap.parse_args()
    os.environ.setdefault("IKJAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="cc-census-"))
    import jax._src.stages as stages

    import ikjax
    from ikjax.tools import sweep_bench as sb

    got = []
    orig = stages.Lowered.compile

    def keep(self, *args, **kw):
        c = orig(self, *args, **kw)
        got.append(c)
        return c
    stages.Lowered.compile = keep
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ubatch, mla=3, flash_attn=True)
    pick = {int(i) for i in a.steps.split(",") if i}
    for i, (kind, n, kv) in enumerate(sb._shapes(eng, a.tg, None, None, 1)):
        if i not in pick:
            continue
        got.clear()
        t = time.perf_counter()
        eng.precompile_decode(1, a.tg, kv) if kind == "loop" else eng.precompile(1, n, kv)
        print(f"\n### step {i}: {kind} T={n} kv_needed={kv}: {time.perf_counter() - t:.2f} s, {len(got)} executables")
        for j, c in enumerate(got):
            text = c.as_text()
            print(f" executable {j}: {len(text) / 1e6:.2f} MB of optimized HLO")
            census(text)
            if a.save:
                os.makedirs(a.save, exist_ok=True)
                with open(os.path.join(a.save, f"step{i}-{j}.hlo.txt"), "w") as f:
                    f.write(text)


if __name__ == "__main__":
    main()
