"""`ikjax sweep-bench`: ik_llama.cpp's llama-sweep-bench, PP and TG speed as the KV cache fills.

The measuring loop lives in `ikjax.tools.sweep_bench`; this module is the command around it: the
flags (the shared run options plus -n, --output-format, --plot, -s), compiling every step before it
is timed, and keeping the table (or JSONL) alone on stdout while progress goes to stderr.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ikjax.cli.common import Progress, app, compiled_line, handle, load_engine, log, setup_compile_cache
from ikjax.cli.parser import ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, takes_run_options
from ikjax.errors import OptionError


@app.command("sweep-bench", cls=ExactCommand)
@handle
@takes_run_options(after={"n_gen": "ubatch", "output_format": "wb"})
def sweep_bench(
    run: RunArgs,
    n_gen: Annotated[Optional[int], typer.Option("-n", "--n-gen", "--n-predict",
                                                 help="TG tokens per row (default ub/4)")] = None,
    output_format: Annotated[str, typer.Option("--output-format", "-of", help="md (ik's table) or jsonl")] = "md",
    plot: Annotated[Optional[str], typer.Option("--plot", help="also draw S_PP and S_TG vs N_KV to this PNG")] = None,
    seed: Annotated[int, typer.Option("-s", "--seed", help="seed of the random tokens")] = 0,
) -> None:
    """PP and TG speed as the KV cache fills (ik_llama.cpp's llama-sweep-bench).

    For N_KV = 0, ub, 2ub, ... while N_KV + ub <= c: generate TG tokens one at a time (timed), drop them, then process ub random tokens at N_KV (timed). All steps are compiled before timing; compile progress and time go to stderr, the table (or JSONL) alone to stdout.

    Example: ikjax sweep-bench -m model.gguf -c 16384 -ub 2048 -mla 3 -fa --output-format jsonl --plot sweep.png
    """
    from ikjax.tools import sweep_bench as sb
    if output_format not in ("md", "jsonl"):
        raise OptionError(f"output-format: {output_format!r} is not md or jsonl")
    if n_gen is not None and n_gen < 0:
        raise OptionError(f"n: need >= 0, got {n_gen}")
    run_opts, checked = check_options(run, "sweep-bench")
    reps = int(run.nrep) if run.nrep else 1  # checked by check_options
    if not sb.sweep_points(checked.ctx, checked.ubatch):
        raise OptionError(f"ubatch {checked.ubatch} is larger than the context c={checked.ctx}: nothing to sweep")
    setup_compile_cache(run.compile_cache_dir)
    eng = load_engine(run.model, run.verbose, **run_opts)
    count0, hits0 = eng.compile_count, eng.compile_cache_hits
    ub = eng.options.ubatch
    tg = ub // 4 if n_gen is None else n_gen
    # the first row's steps compile (or load from the persistent cache) before it, each later
    # row's before that row, outside its timings: the first row comes as soon as its own steps exist
    n_shapes = len(sb.step_shapes(eng, tg))
    first = sb.step_shapes(eng, tg, 0)
    t0 = time.perf_counter()
    with Progress("compiling", total=len(first)) as prog:
        sb.precompile(eng, tg, n_kv=0, on_shape=lambda *_: prog.update(advance=1),
                      on_begin=lambda k, n, t, kv: prog.status(f"compiling step {k}/{n} of the first row "
                                                               f"({t} tokens, KV bucket {kv})"))
    compile_s = time.perf_counter() - t0
    log(compiled_line(eng, count0, hits0, compile_s)
        + (f" for the first row; the other {n_shapes - len(first)} before their rows" if n_shapes > len(first) else ""))
    info = sb.RunInfo.of(eng)
    rows = []
    later = [0.0]

    def before_row(n_kv: int) -> None:
        t1 = time.perf_counter()
        sb.precompile(eng, tg, n_kv=n_kv)
        later[0] += time.perf_counter() - t1

    t0 = time.perf_counter()
    with Progress("sweep-bench", total=sb.total_work(eng, tg, reps), eta=True) as prog:
        if output_format == "md":
            for line in ("", info.banner(), "", sb.HEADER, sb.SEPARATOR):
                prog.echo(line)
        for row in sb.run(eng, tg, seed=seed, nrep=reps, before_row=before_row,
                          on_progress=lambda done, _: prog.update(completed=done)):
            rows.append(row)
            prog.update(description=f"sweep-bench N_KV {row.n_kv + ub}")
            prog.echo(row.markdown() if output_format == "md" else row.jsonl(info))
    if n_shapes > len(first):
        log(compiled_line(eng, count0, hits0, compile_s + later[0]) + " in all")
    log(f"sweep took {time.perf_counter() - t0 - later[0]:.2f}s (+ {compile_s + later[0]:.2f}s compile)")
    if plot:
        import json
        from ikjax.tools.plot import plot_runs
        recs = [json.loads(r.jsonl(info)) for r in rows]
        label = f"{Path(str(eng.file.path)).stem} mla={eng.options.mla} fa={int(eng.options.fa)}"
        out = plot_runs([(label, recs)], plot, title=f"sweep-bench c={eng.options.ctx} ub={ub}")
        log(f"plot written to {out}")
