"""What a prompt step of T tokens holds that a one-token step does not (RESULTS §22aq): each step's
optimized HLO dumped by XLA, its custom-call targets and fusion kinds counted, and the kinds one has
and the other lacks listed. The scanned decode runs ~11 % slower while a run T >= 2 step's program is
loaded (dropping that program restores it; a T = 1 step's program never slows it).

    python3 bench/gpu_step_hlo_diff.py MODEL.gguf [--tokens 2 --other 1 --kv 512]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path


def summary(d: Path, tag: str) -> collections.Counter:
    files = sorted(d.glob("*jit_forward*after_optimizations.txt")) or sorted(d.glob("*after_optimizations.txt"))
    c = collections.Counter()
    for f in files:
        text = f.read_text(errors="replace")
        for m in re.finditer(r'custom_call_target="([^"]+)"', text):
            c["custom_call " + m.group(1)] += 1
        for m in re.finditer(r'"kind":"([^"]+)"', text):  # custom fusions' kinds (triton gemm, cudnn, dynamic slices)
            c["custom fusion " + m.group(1)] += 1
        for m in re.finditer(r"kind=(k\w+)", text):
            c["fusion " + m.group(1)] += 1
        for m in re.finditer(r'"name":"([A-Za-z_]+)', text):  # Triton / Pallas kernel names in backend configs
            c["kernel " + m.group(1)] += 1
        for op in ("dot(", "sort(", "scatter(", "gather(", "dynamic-update-slice(", "dynamic-slice(", "while(",
                   "conditional(", "copy(", "all-reduce("):
            n = text.count(" " + op)
            if n:
                c["op " + op[:-1]] += n
    print(f"{tag}: {len(files)} module file(s)")
    return c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--other", type=int, default=1)
    ap.add_argument("--kv", type=int, default=512)
    a = ap.parse_args()
    if "--child" in sys.argv:
        return
    import subprocess
    out = {}
    for t in (a.tokens, a.other):
        d = Path(tempfile.mkdtemp(prefix=f"hlo-T{t}-"))
        env = dict(os.environ, IKJAX_COMPILE_CACHE="0",
                   XLA_FLAGS=f"--xla_dump_to={d} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*forward.*")
        code = ("import ikjax; eng = ikjax.load(%r, ctx=4096, ubatch=512, mla=3, flash_attn=True); "
                "eng.precompile(1, %d, %d)" % (a.model, t, a.kv))
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=300)
        out[t] = summary(d, f"T={t}")
        if os.environ.get("OUT"):  # the optimized modules themselves, for reading off the device
            import shutil
            for f in d.glob("*after_optimizations.txt"):
                shutil.copy(f, Path(os.environ["OUT"]) / f"T{t}-{f.name[-80:]}")
    big, small = out[a.tokens], out[a.other]
    print(f"in the T={a.tokens} step, not (or more than) in the T={a.other} step:")
    for k in sorted(set(big) | set(small)):
        if big[k] != small[k]:
            print(f"  {k}: {big[k]} vs {small[k]}")


if __name__ == "__main__":
    main()
