"""sweep-bench on the CPU at ik's CPU shape, C++ kernels vs the XLA path side by side (issue 9).

    python bench/cpu_sweep.py [--models DIR] [--runs 2] [--out bench/cpu_sweep.md]

Makes (once) the 4-layer V2-Lite shape with q_lora 1536 in Q8_0 and Q4_0 (SPEC §5: the file ik
accepts), then runs `ikjax sweep-bench -c 1024 -ub 512 -n 32 -mla 3 -fa 1 -t 2` on each with
`IKJAX_KERNELS=cpu` and `IKJAX_KERNELS=xla`, each `--runs` times (this 2-core machine is noisy:
SPEC §5 reports ik's spread the same way), and the floor: bytes a generated token must read over
the measured read bandwidth of all cores. Also records each run's peak RSS (the kernel path must
stay within the file + KV cache + 10 %).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
IK = {"Q8_0": {"S_PP": "552-629", "S_TG": "54-82"}, "Q4_0": {"S_PP": "570-623", "S_TG": "90-93"}}
FLAGS = ["-c", "1024", "-ub", "512", "-n", "32", "-mla", "3", "-fa", "1", "-t", "2"]


def _read(n_bytes: int) -> float:
    a = np.ones(n_bytes // 8, np.int64)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, n_bytes / (time.perf_counter() - t0))
    return best


def read_bandwidth_gbs(procs: int) -> float:
    """Aggregate read bandwidth of `procs` processes each summing its own 1 GiB array (best of 5)."""
    with Pool(procs) as p:
        return sum(p.map(_read, [1 << 30] * procs)) / 1e9


def tg_bytes(path: str) -> int:
    """Bytes one generated token reads: every weight except the routed experts, plus the 6 used of
    the 64 routed experts per MoE layer, minus the embedding table (one row is gathered)."""
    sys.path.insert(0, str(ROOT))
    from ikjax.gguf_io.reader import GGUFModelFile
    from ikjax.gguf_io.config import ModelConfig
    gf = GGUFModelFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, source=path)
    total = 0
    for name, info in gf.tensors.items():
        if name.startswith("token_embd"):
            continue
        if "_exps" in name:
            total += info.nbytes * cfg.n_expert_used // cfg.n_expert
        else:
            total += info.nbytes
    return total


def ensure_model(models: Path, qtype: str) -> Path:
    path = models / f"v2l4-q{qtype[1:].lower()}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "ikjax.cli", "make-model", "--preset", "v2-lite", "--layers", "4",
                        "--q-lora-rank", "1536", "--type", qtype, "-o", str(path)], check=True)
    return path


def sweep(path: Path, backend: str, embed_rows: bool = False) -> tuple[list[dict], float, float]:
    """One sweep-bench run in its own process: (jsonl rows, wall seconds, peak RSS GiB).
    `embed_rows`: the model's embedding gather patched to the C++ pread op (bench/cpu_rss.py)."""
    env = dict(os.environ, IKJAX_KERNELS=backend)
    t0 = time.perf_counter()
    # a fresh interpreter per run, which reports its own peak RSS (VmHWM) after the sweep
    patch = (f"sys.path.insert(0, {str(ROOT / 'bench')!r}); import cpu_rss; cpu_rss.patch_embed_rows()\n"
             if embed_rows else "")
    code = ("import sys, runpy; sys.argv = sys.argv[1:]\n" + patch +
            "try:\n    runpy.run_module('ikjax.cli', run_name='__main__')\n"
            "finally:\n    print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0], file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, "ikjax", "sweep-bench", "-m", str(path), *FLAGS,
                        "--output-format", "jsonl"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    hwm = [line for line in p.stderr.splitlines() if line.startswith("VmHWM")]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"sweep-bench failed ({backend}, {path}): {p.stderr.strip().splitlines()[-3:]}")
    rss = int(hwm[0].split()[1]) / 2**20 if hwm else float("nan")
    return rows, wall, rss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=str(ROOT / "build" / "models"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--backends", default="cpu,xla")
    ap.add_argument("--out", default=None)
    ap.add_argument("--embed-rows", action="store_true", help="patch the model's embedding gather to the C++ "
                                                               "pread op (bench/cpu_rss.py; RESULTS §9e)")
    a = ap.parse_args()
    models = Path(a.models)
    models.mkdir(parents=True, exist_ok=True)
    lines = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    cores = len(os.sched_getaffinity(0))
    bw = read_bandwidth_gbs(cores)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    say(f"CPU: {cores} cores; measured read bandwidth {bw:.1f} GB/s ({cores} processes, 1 GiB each); "
        f"commit {commit}; flags `{' '.join(FLAGS)}`")
    say()
    say("| type | backend | run | S_PP t/s (N_KV 0 / 512) | S_TG t/s (N_KV 0 / 512) | TG floor t/s | peak RSS GiB | file GiB |")
    say("|---|---|---|---|---|---|---|---|")
    for qtype in a.types.split(","):
        path = ensure_model(models, qtype)
        floor = bw * 1e9 / tg_bytes(str(path))
        for backend in a.backends.split(","):
            for r in range(a.runs if backend == "cpu" else 1):
                rows, wall, rss = sweep(path, backend, a.embed_rows and backend == "cpu")
                pp = " / ".join(f"{row['speed_pp']:.1f}" for row in rows)
                tg = " / ".join(f"{row['speed_tg']:.2f}" for row in rows)
                say(f"| {qtype} | {backend} | {r + 1} | {pp} | {tg} | {floor:.0f} | {rss:.2f} | "
                    f"{path.stat().st_size / 2**30:.2f} |")
        say(f"| {qtype} | ik_llama.cpp (SPEC §5) | | {IK[qtype]['S_PP']} | {IK[qtype]['S_TG']} | | | |")
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
