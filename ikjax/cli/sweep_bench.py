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

from ikjax import interrupt
from ikjax.cli.common import Progress, app, compiled_line, handle, load_engine, log, setup_compile_cache
from ikjax.cli.parser import ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, takes_run_options
from ikjax.errors import OptionError
from ikjax.options import RunOptions


def check_plot_target(plot: str) -> None:
    """--plot is checked before the sweep, not after it: matplotlib importable, a format it writes,
    a directory that exists and is writable. One line naming the problem."""
    import os
    try:
        import matplotlib
    except ImportError:
        raise OptionError("--plot: matplotlib is not installed (pip install matplotlib), or leave --plot out") from None
    target = Path(plot)
    fmt = target.suffix.lstrip(".").lower() or "png"
    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise OptionError(f"--plot {plot}: matplotlib cannot write .{fmt} files "
                          f"(use one of {', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))})")
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise OptionError(f"--plot {plot}: is a directory")
    if not parent.is_dir():
        raise OptionError(f"--plot {plot}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OptionError(f"--plot {plot}: not writable")


@app.command("sweep-bench", cls=ExactCommand)
@handle
@takes_run_options(after={"n_gen": "ubatch", "output_format": "fit"})
def sweep_bench(
    run: RunArgs,
    n_gen: Annotated[Optional[int], typer.Option("-n", "--n-gen", "--n-predict",
                                                 help="TG tokens per row (default, and 0 or less as ik: ub/4)")] = None,
    output_format: Annotated[str, typer.Option("--output-format", "-of", help="md (ik's table) or jsonl")] = "md",
    sweep_stride: Annotated[int, typer.Option("--sweep-stride", help="measure and print every Nth row (ik's)")] = 1,
    sweep_memory: Annotated[bool, typer.Option("--sweep-memory", help="add ik's RSS HWM and VRAM delta (MiB) to "
                                               "each row: the process's peak resident memory, and accelerator "
                                               "memory in use since the start (n/a on CPU)")] = False,
    plot: Annotated[Optional[str], typer.Option("--plot", help="also draw S_PP and S_TG vs N_KV to this PNG")] = None,
    seed: Annotated[int, typer.Option("-s", "--seed", help="seed of the random tokens")] = 0,
) -> None:
    """PP and TG speed as the KV cache fills (ik_llama.cpp's llama-sweep-bench).

    For N_KV = 0, ub, 2ub, ... while N_KV + ub <= c: generate TG tokens one at a time (timed), drop them, then process ub random tokens at N_KV (timed), in steps of min(ub, b) tokens (ik's -b-sized decode calls). All steps are compiled before timing; compile progress and time go to stderr, the table (or JSONL) alone to stdout.

    Example: ikjax sweep-bench -m model.gguf -c 16384 -ub 2048 -mla 3 -fa --output-format jsonl --plot sweep.png
    """
    from ikjax import ops
    from ikjax.runtime.memory_plan import cache_capacity
    from ikjax.tools import sweep_bench as sb
    if output_format not in ("md", "jsonl"):
        raise OptionError(f"output-format: {output_format!r} is not md or jsonl")
    if sweep_stride < 1:
        raise OptionError(f"--sweep-stride: need >= 1, got {sweep_stride}")
    if plot:
        check_plot_target(plot)
    run_opts, checked = check_options(run, "sweep-bench")
    reps = int(run.nrep) if run.nrep else 1  # checked by check_options
    warmup = not (run.no_warmup is not None and RunOptions.from_kwargs(fa=run.no_warmup).fa)
    pp = int(run.ubatch)  # ik's -ub as given: the PP column; the engine's steps are min(ub, b) tokens
    n_ctx = sb.sweep_ctx(checked)  # ik's n_ctx: -c padded
    if not sb.sweep_points(n_ctx, pp):
        raise OptionError(f"ubatch {pp} is larger than the context c={n_ctx}: nothing to sweep")
    tg = pp // 4 if n_gen is None or n_gen <= 0 else n_gen  # ik: n_predict > 0 ? n_predict : n_ubatch / 4
    sb.check_tg_room(n_ctx, cache_capacity(checked), pp, tg, sweep_stride)
    memory = sb.MemoryTracker() if sweep_memory else None
    if memory is not None:
        memory.start()  # before the model loads, as ik's baseline
    setup_compile_cache(run.compile_cache_dir)
    shape_args = dict(pp=pp, stride=sweep_stride)
    first_compile: dict = {}

    def compile_first(eng) -> None:
        """Outside every row's timings, while the weights stream in (Engine._overlaps_load): where
        steps compile side by side (an accelerator) all of them at once before the first row
        (they take about as long as the longest: V2-Lite on an H100, 5 steps 22.5 s one row after
        the other, RESULTS §22); else the first row's steps before it and each later row's before
        that row, so the first row comes as soon as its own steps exist. Compiling the later rows'
        steps in a thread while the first rows run was tried (RESULTS §22g): the compiles' Python
        tracing holds the GIL the timed rows' dispatches need, and their first rows' S_PP fell to
        0.3-0.6x."""
        count0, hits0 = eng.compile_count, eng.compile_cache_hits
        n_shapes = len(sb.step_shapes(eng, tg, **shape_args))
        all_at_once = eng.compile_in_parallel()
        first = sb.step_shapes(eng, tg, None if all_at_once else 0, **shape_args)
        t0 = time.perf_counter()
        what = "" if all_at_once else " of the first row"
        with Progress("steps", total=len(first)) as prog:
            sb.precompile(eng, tg, n_kv=None if all_at_once else 0, on_shape=lambda *_: prog.update(advance=1),
                          on_begin=lambda k, n, t, kv: prog.status(f"preparing step {k}/{n}{what} "
                                                                   f"({t} tokens, KV bucket {kv})"), **shape_args)
        compile_s = time.perf_counter() - t0
        later = f" for the first row; the other {n_shapes - len(first)} before their rows" \
            if n_shapes > len(first) else ""
        log(compiled_line(eng, count0, hits0, compile_s) + later
            + (" (the weights loading meanwhile)" if eng.loading else ""))
        first_compile.update(count0=count0, hits0=hits0, compile_s=compile_s, n_shapes=n_shapes,
                             n_first=len(first))

    eng = load_engine(run.model, run.verbose, while_loading=compile_first, **run_opts)
    count0, hits0, compile_s = first_compile["count0"], first_compile["hits0"], first_compile["compile_s"]
    n_shapes, n_first = first_compile["n_shapes"], first_compile["n_first"]
    for what, c in eng.collectives():  # -sm graph: what each step pays between the devices
        log(f"-sm graph {what}: {c.line()}")
    info = sb.RunInfo.of(eng, ubatch=pp)
    rows = []
    later = [0.0]

    def before_row(n_kv: int) -> None:
        t1 = time.perf_counter()
        sb.precompile(eng, tg, n_kv=n_kv, **shape_args)
        later[0] += time.perf_counter() - t1

    streams = sb.streamed_bytes(eng, eng.options.ubatch)
    if streams is not None and streams[1] == "active":
        ops.streamed_bytes_counted(reset=True)
    ops.host_kernel_stats(reset=True)
    t0 = time.perf_counter()
    with Progress("sweep-bench", total=sb.total_work(eng, tg, reps, **shape_args), eta=True) as prog:
        if output_format == "md":
            header = (sb.HEADER_MEMORY, sb.SEPARATOR_MEMORY) if memory is not None else (sb.HEADER, sb.SEPARATOR)
            for line in ("", info.banner(), "", *header):
                prog.echo(line)
        for row in sb.run(eng, tg, seed=seed, nrep=reps, before_row=before_row, warmup=warmup, memory=memory,
                          # (after every step: a Ctrl-C that JAX swallowed ends the sweep there, ikjax/interrupt.py)
                          on_progress=lambda done, _: (interrupt.check(), prog.update(completed=done)), **shape_args):
            rows.append(row)
            prog.update(description=f"sweep-bench N_KV {row.n_kv + pp}")
            prog.echo(row.markdown() if output_format == "md" else row.jsonl(info))
    if n_shapes > n_first:
        log(compiled_line(eng, count0, hits0, compile_s + later[0]) + " in all")
    log(f"sweep took {time.perf_counter() - t0 - later[0]:.2f}s (+ {compile_s + later[0]:.2f}s compile)")
    if streams is not None:  # issue 24: what the link carried, against what it can carry
        line = sb.stream_report(eng, pp, rows, ops.streamed_bytes_counted() if streams[1] == "active" else 0)
        if line:
            log(line)
    line = sb.host_decode_report(eng, rows, ops.host_kernel_stats())
    if line:  # -ot exps=CPU next to a GPU: the host kernel's share of a TG token
        log(line)
    from ikjax.runtime import distributed
    if plot and distributed.is_primary():  # (every process wrote it, each from its own timings)
        import json
        from ikjax.tools.plot import plot_runs
        recs = [json.loads(r.jsonl(info)) for r in rows]
        label = f"{Path(str(eng.file.path)).stem} mla={eng.options.mla} fa={int(eng.options.fa)}"
        out = plot_runs([(label, recs)], plot, title=f"sweep-bench c={eng.options.ctx} ub={pp}")
        log(f"plot written to {out}")
