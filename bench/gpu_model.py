"""The whole model on the GPU, checked and timed in one run (issue 5).

    PYTHONPATH=$PWD python bench/gpu_model.py --fixtures .gpufix --out $OUT [--skip-jnp]

1. Correctness: real-converter fixtures through `ikjax.load(...).logits` on the GPU, kernels on
   (f32 compute: must match the reference within its tolerance; bf16 compute: reported).
2. Speed: a 27-layer V2-Lite-shape Q4_0 model from `make-model`, sweep-bench
   `-mla 3 -fa -c 16384 -ub 2048` with the Pallas kernels and, in the same run, with the XLA (jnp)
   path; compile time apart. The TG roofline: bytes one token must read (attention, dense and
   shared FFN, the 6 of 64 experts, output row matrix) over the measured copy bandwidth.
Results go to stdout and to $OUT/gpu_model.md (+ one .jsonl per sweep).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ikjax  # noqa: F401  (first: it sets XLA flags before the backend starts)
import jax
import jax.numpy as jnp
import numpy as np

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB through XLA, bytes read + written, best of 10."""
    x = jnp.ones((256, 1 << 20), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best / 1e9


def check_fixtures(folder: Path) -> bool:
    entries = json.loads((folder / "MANIFEST.json").read_text())
    say("## Fixtures on the GPU (kernels on)")
    say("")
    say("| file | mla | dtype | rel err | tol | ok |")
    say("|---|---:|---|---:|---:|---|")
    all_ok = True
    for e in entries:
        tokens = np.load(folder / e["tokens"])
        for mla in (0, 3):
            for dtype in ("f32", "bf16") if e["file"].startswith("v3dense") else ("f32",):
                ref = np.load(folder / e["ref"])
                try:
                    got = ikjax.load(folder / e["file"], mla=mla, ctk="f32" if dtype == "f32" else "f16",
                                     dtype=dtype).logits(tokens)
                    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                except Exception as ex:  # report and go on: one broken case must not hide the rest
                    say(f"| {e['file']} | {mla} | {dtype} | {type(ex).__name__}: {str(ex)[:120]} | | FAIL |")
                    all_ok = False
                    continue
                ok = err <= e["tol"] if dtype == "f32" else bool(np.isfinite(err))
                all_ok &= ok
                say(f"| {e['file']} | {mla} | {dtype} | {err:.2e} | {e['tol'] if dtype == 'f32' else '-'} | "
                    f"{'ok' if ok else 'FAIL'} |")
    say("")
    return all_ok


def tg_bytes_per_token(gf, cfg) -> int:
    """Weight bytes one generated token reads: every tensor once, but routed experts only
    n_expert_used / n_expert of each, and one row of the embedding."""
    total = 0
    for name, t in gf.tensors.items():
        if "_exps" in name:
            total += t.nbytes * cfg.n_expert_used // cfg.n_expert
        elif name == "token_embd.weight":
            total += t.nbytes // t.shape[0]
        else:
            total += t.nbytes
    return total


def sweep(path: str, backend: str, args, out: Path, budget: float) -> list:
    os.environ["IKJAX_KERNELS"] = backend
    from ikjax.tools import sweep_bench as sb
    eng = ikjax.load(path, mla=3, fa=True, ctx=args.ctx, ubatch=args.ub, batch=args.ub, ctk=args.ctk)
    t0 = time.perf_counter()
    comp = sb.precompile(eng, args.ub // 4)
    say(f"### {backend}: sweep-bench -mla 3 -fa 1 -c {args.ctx} -ub {args.ub} -ctk {args.ctk} "
        f"(compile {comp:.1f}s for {len(sb.step_shapes(eng, args.ub // 4))} step shapes)")
    say("")
    info = sb.RunInfo.of(eng)
    say(sb.HEADER)
    say(sb.SEPARATOR)
    rows = []
    with open(out / f"sweep_{backend}.jsonl", "w") as f:
        for row in sb.run(eng, args.ub // 4):
            rows.append(row)
            say(row.markdown())
            f.write(row.jsonl(info) + "\n")
            if time.perf_counter() - t0 > budget:
                say(f"(stopped after {budget:.0f}s)")
                break
    say("")
    del eng
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=".gpufix")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="/tmp/v2lite-Q4_0.gguf")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--ub", type=int, default=2048)
    ap.add_argument("--ctk", default="f16")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds per sweep before it stops early")
    ap.add_argument("--jnp-budget", type=float, default=60.0, help="the same for the (slow) XLA-only sweep")
    ap.add_argument("--skip-jnp", action="store_true")
    ap.add_argument("--skip-fixtures", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    say(f"# ikjax on {dev.device_kind} (jax {jax.__version__}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    bw = copy_bandwidth_gbs()
    say(f"copy bandwidth (XLA, read+write): {bw:.0f} GB/s")
    say("")
    if not args.skip_fixtures:
        check_fixtures(Path(args.fixtures))
    from ikjax.tools import synthetic
    if not Path(args.model).exists():
        t0 = time.perf_counter()
        synthetic.make_model(args.model, "v2-lite", "Q4_0")
        say(f"made {args.model} in {time.perf_counter() - t0:.0f}s")
    from ikjax.gguf_io.config import ModelConfig
    from ikjax.gguf_io.reader import GGUFModelFile
    gf = GGUFModelFile(args.model)
    cfg = ModelConfig.from_metadata(gf.metadata)
    per_token = tg_bytes_per_token(gf, cfg)
    roof = bw * 1e9 / per_token
    say(f"model: {sum(t.nbytes for t in gf.tensors.values()) / 1e9:.2f} GB; one token reads {per_token / 1e9:.3f} GB "
        f"-> TG roofline {roof:.0f} t/s at {bw:.0f} GB/s")
    say("")
    results = {"pallas": sweep(args.model, "auto", args, out, args.budget)}  # auto: Pallas where it wins
    if not args.skip_jnp:
        results["jnp"] = sweep(args.model, "jnp", args, out, args.jnp_budget)
    say("## Summary")
    for name, rows in results.items():
        if not rows:
            continue
        tg0, tgN = rows[0].speed_tg, rows[-1].speed_tg
        pp = [r.speed_pp for r in rows]
        say(f"- {name}: S_TG {tg0:.1f} t/s at N_KV 0 ({100 * tg0 / roof:.1f} % of roofline), {tgN:.1f} at "
            f"N_KV {rows[-1].n_kv} ({100 * tgN / tg0:.0f} % of N_KV 0); S_PP {min(pp):.0f}-{max(pp):.0f} t/s")
    (out / "gpu_model.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
