"""Decode GEMV schedules (quant_matmul "rows" mode) on the GPU: each V2-Lite decode matrix, the
schedule pick_config gives against variations of tile width (bn), k-step (bk), warps, stages and
split-K (issue 11: after the decode loop, a decode step is device-bound and its GEMVs run at
~0.9 TB/s of weights, about a third of the card's rate).

Each timing runs `copies` distinct weights one after another in one executable (more bytes than
the 50 MB L2 holds), so it is the HBM rate of that schedule, split-K's reduction included.

    PYTHONPATH=$PWD python bench/gpu_gemv_tune.py [--out $OUT] [--budget 300]

`--form dot --rows M` (the dense matrices): the batch-invariant decode's matrix-unit schedule
(`invariant_config`, tiles of 16 rows: the same kernel for 1 to 16 rows) against variations of
its tile, k-step, split, warps and stages, beside the row form's one-program-a-row schedule for M
rows (what IKJAX_INVARIANT_FORM=rows runs): RESULTS §23l found the matrix unit ~1.3-1.5x the row
kernel at one row and the same at eight; this finds whether a schedule closes that.
`--interpret` runs the Pallas kernels in interpret mode on a CPU (a smoke test: no timings).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.quant_matmul.kernel import (invariant_config, pick_config, quant_matmul,  # noqa: E402
                                                quant_matmul_experts)
from pallas_kernels.quant_matmul.packing import prepare  # noqa: E402
from pallas_kernels.testing import random_quant_array  # noqa: E402

# name: (experts E or 0, N, K, rows M (expert tiles), swiglu)
SHAPES = {  # by their share of a V2-Lite decode step
    "exps gate+up 6x(1408x2048) swiglu": (8, 1408, 2048, 6, True),  # 6 of 8 experts: the same reads as of 64
    "exps down 6x(2048x1408)": (8, 2048, 1408, 6, False),
    "shexp gate|up 5632x2048": (0, 5632, 2048, 1, False),
    "q_a|kv_a 2112x2048": (0, 2112, 2048, 1, False),
    "shexp down 2048x2816": (0, 2048, 2816, 1, False),
    "attn_out 2048x2048": (0, 2048, 2048, 1, False),
    "output 102400x2048": (0, 102400, 2048, 1, False),
    "q_b 3072x1536": (0, 3072, 1536, 1, False),
}


def device_times(fns: list, args: tuple, reps: int = 5) -> dict:
    """{name: GPU kernel time per call (s)} from one profiler trace: every kernel the executable
    `jit_<name>` launched (the schedule's GEMV and its split-K sum), without host launch gaps."""
    import collections
    import shutil
    import tempfile

    from gpu_trace import gpu_kernels  # bench/ is the script's directory
    tmp = tempfile.mkdtemp()
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
        for _, f in fns:
            for _ in range(reps):
                out = f(*args)
            jax.block_until_ready(out)
    busy = collections.Counter()
    for e in gpu_kernels(tmp):
        busy[e.get("args", {}).get("hlo_module", "")] += e["dur"] * 1e-6
    shutil.rmtree(tmp, ignore_errors=True)
    return {name: busy.get(f"jit_{name}", float("nan")) / reps for name, _ in fns}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=300)
    ap.add_argument("--only", default="")
    ap.add_argument("--form", choices=("rows", "dot"), default="rows")
    ap.add_argument("--rows", type=int, default=1, help="--form dot: rows of x (the decode batch)")
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    t_stop = time.time() + args.budget
    rng = np.random.default_rng(0)
    lines = ["| matrix | schedule | us | GB/s of weights |", "|---|---|---:|---:|"]
    best = {}
    todo = [n for n in SHAPES if args.only in n and not (args.form == "dot" and SHAPES[n][0])]
    for k, name in enumerate(todo):
        E, N, K, M, swiglu = SHAPES[name]
        M = args.rows if args.form == "dot" else M
        t_end = time.time() + (t_stop - time.time()) / (len(todo) - k)  # an equal share of what is left
        lead = (E,) if E else ()
        one = prepare(random_quant_array("Q4_0", lead + (N, K), rng, fast=True))
        nbytes = one.nbytes * (M / E if E else 1) * (2 if swiglu else 1)
        copies = 2 if args.interpret else max(2, int(np.ceil(200e6 / nbytes)))  # bytes read per call, not stored
        ws = [prepare(random_quant_array("Q4_0", lead + (N, K), rng, fast=True)) for _ in range(copies)]
        us_ = [prepare(random_quant_array("Q4_0", lead + (N, K), rng, fast=True)) for _ in range(copies)] \
            if swiglu else [None] * copies
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        e = jnp.asarray(rng.choice(E, M, replace=False) if E else np.zeros(1), jnp.int32)
        base = pick_config("Q4_0", M, N, K, tile_rows=1 if E else None)
        cands = [base]
        notes = {id(base): "pick_config"}
        if args.form == "dot":
            wfirst = invariant_config("Q4_0", N, K)  # the weight as the first operand (swap)
            base = dict(wfirst, swap=False)
            row_form = pick_config("Q4_0", M, N, K, rows_max=1, tile_rows=1, split_rows=1)
            cands = [base, wfirst, row_form]
            notes = {id(base): "invariant_config, rows first", id(wfirst): "invariant_config (weight first)",
                     id(row_form): f"rows form, {M} programs a column tile"}
            # the weight-first form's variations first (the matrix unit's M of 64 a warp group)
            for bn, bk, w, st in itertools.product((64, 128), (128, 256), (4, 8), (2, 3)):
                if K % bk or N % bn:
                    continue
                nt = K // bk
                for split in sorted({1, wfirst["split"], 2 * wfirst["split"]}):
                    if split == 1 or nt >= 2 * split:
                        cands.append(dict(mode="dot", bm=16, bn=bn, bk=bk, split=split, num_warps=w, num_stages=st,
                                          swap=True))
            for bn, bk, w, st in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3)):
                if K % bk or N % bn:
                    continue
                nt = K // bk
                for split in (1, 2, 4, 8):
                    if split == 1 or nt >= 2 * split:
                        cands.append(dict(mode="dot", bm=16, bn=bn, bk=bk, split=split, num_warps=w, num_stages=st))
        for bn, bk, w, st in itertools.product((16, 32, 64), (64, 128, 256, 512), (4, 8), (3,)):
            if args.form == "dot":
                break
            if K % bk or N % bn or bn * bk // 2 > 16384:
                continue
            nt = K // bk
            for split in sorted({1 if swiglu else base["split"], base["split"], min(nt, base["split"] * 2)}):
                cands.append(dict(mode="rows", bm=1, bn=bn, bk=bk, split=split, num_warps=w, num_stages=st))
        fns, cfgs = [], {}
        for i, cfg in enumerate(cands[:3] if args.interpret else cands):
            if time.time() > t_end:
                break

            def run(x, ws, us_, e, cfg=cfg):
                if E:
                    return [quant_matmul_experts(x, (w, u) if swiglu else (w,), e, jnp.bfloat16, tile_rows=1,
                                                 swiglu=swiglu, config=cfg, interpret=args.interpret)
                            for w, u in zip(ws, us_)]
                return [quant_matmul(x, w, jnp.bfloat16, config=cfg, interpret=args.interpret) for w in ws]
            run.__name__ = f"c{i}"
            f = jax.jit(run)
            try:
                jax.block_until_ready(f(x, ws, us_, e))
            except Exception as ex:  # a schedule Triton refuses (shared memory, registers)
                print(f"{name} {cfg}: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            fns.append((f"c{i}", f))
            cfgs[f"c{i}"] = cfg
        times = device_times(fns, (x, ws, us_, e))
        results = sorted(((t / copies, cfgs[k], "") for k, t in times.items()), key=lambda r: r[0])
        show = [(next((r[0] for r in results if r[1] is c), float("nan")), c, notes[id(c)])
                for c in cands if id(c) in notes] + [r for r in results[:3]]
        for s, cfg, note in show:
            sched = f"bn {cfg['bn']} bk {cfg['bk']} split {cfg['split']} w{cfg['num_warps']} s{cfg['num_stages']}" \
                + (" wfirst" if cfg.get("swap") else "")
            lines.append(f"| {name} | {sched} {note} | {s * 1e6:.1f} | {nbytes / s / 1e9:.0f} |")
            print(lines[-1], flush=True)
        best[name] = results[0][1] if results else None
        if args.interpret:
            break
    Path(args.out, f"gemv_tune_{args.form}{args.rows if args.form == 'dot' else ''}.md").write_text("\n".join(lines) + "\n\nbest: " + repr(best) + "\n")


if __name__ == "__main__":
    main()
