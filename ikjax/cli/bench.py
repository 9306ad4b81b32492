"""`ikjax bench`: llama-bench's tests (pp512, tg128, pp512+tg128, tg64@pp8192) over comma lists.

It takes the shared run options, but the ones llama-bench sweeps are comma lists here (`-mla 2,3
-ub 512,2048`), so bench declares its own variant of each — strings, with their own help and, as
llama-bench spells them, a few different long names — in its signature; `takes_run_options` lets
them replace the shared declarations. -c is accepted with a note: each test's context is sized to
its tokens. The options it does not sweep are checked once and passed to every run unchanged.
"""
from __future__ import annotations

import os
import sys
from typing import Annotated, Any, Optional

import typer

from ikjax.cli.common import app, backend, handle, is_interrupt, log, resolve_model, setup_compile_cache, \
    setup_logging, stderr_console
from ikjax import env, interrupt
from ikjax.cli.parser import ListCommand
from ikjax.cli.run_options import SWITCH_PARAMS, RunArgs, takes_run_options
from ikjax.errors import OptionError
from ikjax.options import CACHE_TYPES, COMPUTE_DTYPES, RunOptions, switch_notes

_D = RunOptions()
# ik_llama.cpp's other KV cache types (its `-ctk` list): known names, not stored by ikjax
IK_CACHE_TYPES = ("q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "q6_0", "q8_kv")

BENCH_FIXED = ("threads_batch", "cpu_moe", "n_cpu_moe", "kv_block", "split_mode", "main_gpu", "ts")


def _check_bench_options(params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """bench's ik switches and the run options it does not sweep, checked and noted once.
    Returns (the fixed run options, the -fmoe list after -no-fmoe)."""
    env.check_all()  # every IKJAX_* set: one line before anything loads, not a 'skipped' row each
    fixed = {k: params[k] for k in BENCH_FIXED if params.get(k) is not None}
    RunOptions.from_kwargs(**fixed)
    switches = {k: params[k] for k in SWITCH_PARAMS if k in params}
    notes = switch_notes(switches, "bench", backend())
    if params.get("ctx") is not None:
        notes.append(f"-c {params['ctx']} has no effect in bench: each test's context is sized to its tokens "
                     "(prompt + generated + depth), as llama-bench does")
    for line in notes:
        log("note: " + line)
    if params.get("no_fa") is not None and RunOptions.from_kwargs(fa=params["no_fa"]).fa:
        params["fa"] = "0"  # ik's -no-fa
    fmoe = params.get("fmoe")
    if params.get("no_fmoe") is not None and RunOptions.from_kwargs(fmoe=params["no_fmoe"]).fmoe:
        fmoe = "0"
    return fixed, fmoe


def _render(fmt: str, results: list, table) -> str:
    """The whole results in one of -o's formats (for -oe)."""
    from ikjax.tools import llama_bench as lb
    if fmt == "md":
        lines = ([*table.header(), *(table.row(r) for r in results), *lb.MarkdownTable.footer()] if results else [])
        return "".join(line + "\n" for line in lines)
    if fmt == "jsonl":
        return "".join(lb.to_jsonl(r) + "\n" for r in results)
    if fmt == "json":
        return lb.to_json(results) + "\n"
    return lb.to_csv(results) if fmt == "csv" else lb.to_sql(results)


def _note_combinations(params: dict[str, Any]) -> None:
    """The notes of every swept combination (e.g. -ctv with mla 3), each once; a combination that
    does not validate is left to its 'skipped' row."""
    from ikjax.tools import llama_bench as lb
    seen: set[str] = set()
    for combo in lb.combinations(params):
        try:
            notes = RunOptions.from_kwargs(**{lb.SWEPT[k]: v for k, v in combo.items()}).notes()
        except OptionError:
            continue
        for line in notes:
            if line not in seen:
                seen.add(line)
                log("note: " + line)


class BenchCommand(ListCommand):
    """bench's swept options add up when repeated, as llama-bench's (-ser settings join by ';', a
    repeated -ot adds rules to one list, as ik's)."""
    LIST_JOIN = {**{name: "," for name in ("n_prompt", "n_gen", "depth", "mla", "fa", "ubatch", "batch", "ctk", "ctv",
                                           "amb", "ot", "ngl", "threads", "dtype", "fmoe", "split_mode")},
                 "ser": ";", "tgb": ";"}


@app.command("bench", cls=BenchCommand)
@handle
@takes_run_options(after={"ubatch": "fa", "ser": "no_fmoe", "ngl": "n_cpu_moe", "dtype": "threads_batch",
                          "seed": "wb"})
def bench(
    run: RunArgs,
    # replaces the shared -m: several models
    model: Annotated[Optional[list[str]], typer.Option("-m", "--model", help="GGUF file(s); repeat or comma list")] = None,
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="prompt sizes, e.g. 512 or 128,512")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="generation lengths, e.g. 128")] = "128",
    pg: Annotated[Optional[list[str]], typer.Option("-pg", "--pg", help="PP,TG: PP prompt tokens then TG generated "
                                                    "ones, timed together, printed ppPP+tgTG (may repeat)")] = None,
    gp: Annotated[Optional[list[str]], typer.Option("-gp", "--gp", "--n-gen-prompt",
                                                    help="PP,TG: TG tokens timed after an untimed PP-token prompt, "
                                                    "printed tgTG@ppPP (may repeat)")] = None,
    depth: Annotated[str, typer.Option("-d", "--n-depth", help="KV depth for the -p/-n tests, e.g. 0,4096")] = "0",
    # replaces the shared -c: accepted, noted, unused
    ctx: Annotated[Optional[str], typer.Option("-c", "--ctx-size", "--ctx", help="accepted with a note: bench sizes the "
                                               "context to each test, as llama-bench does")] = None,
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="timed repetitions per test")] = 5,
    output: Annotated[str, typer.Option("-o", "--output", help="md, json, jsonl, csv or sql (llama-bench's keys)")] = "md",
    output_err: Annotated[Optional[str], typer.Option("-oe", "--output-err", help="also print the results to "
                                                      "stderr in this format (md, json, jsonl, csv or sql)")] = None,
    # replace the shared options of the same names: comma lists, swept
    mla: Annotated[str, typer.Option("-mla", "--mla", "--mla-use", "--mla-attn", help="MLA mode(s), e.g. 2,3")] = str(_D.mla),
    ubatch: Annotated[str, typer.Option("-ub", "--ubatch", "--ubatch-size", help="micro-batch(es)")] = str(_D.ubatch),
    batch: Annotated[str, typer.Option("-b", "--batch", "--batch-size", help="batch size(s)")] = str(_D.batch),
    ctk: Annotated[str, typer.Option("-ctk", "--ctk", "--cache-type-k", help="KV cache type(s)")] = _D.ctk,
    ctv: Annotated[Optional[str], typer.Option("-ctv", "--ctv", "--cache-type-v", help="V cache type(s) (see "
                                               "sweep-bench -ctv)")] = None,
    amb: Annotated[str, typer.Option("-amb", "--amb", "--attn-max-batch", "--attention-max-batch",
                                     help="MiB cap(s)")] = str(_D.amb),
    ser: Annotated[Optional[str], typer.Option("-ser", "--ser", "--smart-expert-reduction",
                                              help="'Kmin,t'; several separated by ';'")] = None,
    ot: Annotated[Optional[str], typer.Option("-ot", "--ot", "--override-tensor",
                                              help="REGEX=DEV[,...]; several rule lists separated by ';'")] = None,
    ngl: Annotated[str, typer.Option("-ngl", "--ngl", "--n-gpu-layers", help="GPU layers")] = str(_D.ngl),
    threads: Annotated[Optional[str], typer.Option("-t", "--threads", help="thread count(s)")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="compute dtype(s)")] = _D.dtype,
    seed: Annotated[int, typer.Option("-s", "--seed")] = 0,
    warmup: Annotated[str, typer.Option("-w", "--warmup", help="1: one untimed run of each test first (it "
                                        "compiles); 0: none, the first timed run pays compiling")] = "1",
    mmp: Annotated[Optional[str], typer.Option("-mmp", "--mmap", help="0|1: " + "accepted; -mmp 0 is noted (the "
                                               "GGUF is always mapped)")] = None,
    tgb: Annotated[Optional[str], typer.Option("-tgb", "--threads-gen-batch", help="T,TB: threads for generation "
                                               "and for prompts, one more entry of the -t list (several pairs by "
                                               "';'), as llama-bench")] = None,
    print_overrides: Annotated[str, typer.Option("--print-overrides", help="1: show the ot column in md")] = "0",
) -> None:
    """llama-bench: pp512 / tg128 / pp512+tg128 / tg64@pp8192 tests over the Cartesian product of comma lists.

    Example: ikjax bench -m m.gguf -p 512 -n 128 -pg 512,128 -gp 8192,64 -mla 2,3 -ub 512,2048 -r 3 -o md

    Each result is mean ± sd of tokens/s over -r runs (after an untimed warm-up that compiles). -pg P,T times P prompt tokens and T generated ones together (t/s = (P+T)/time); -gp P,T times only the T generated tokens after P untimed prompt tokens. A combination that fails to load or run is printed as a 'skipped: reason' row; the rest goes on.
    """
    from ikjax.tools import llama_bench as lb
    setup_logging(run.verbose)
    stats = _ExpertStats(run.expert_stats, run.gpu_experts) if run.expert_stats is not None else None
    for flag, fmt in (("output", output), ("output-err", output_err)):
        if fmt is not None and fmt not in ("md", "json", "jsonl", "csv", "sql"):
            raise OptionError(f"{flag}: {fmt!r} is not md, json, jsonl, csv or sql")
    if reps < 1:
        raise OptionError(f"repetitions: need >= 1, got {reps}")
    flags = {}
    for flag, value in (("-w", warmup), ("--print-overrides", print_overrides)):
        if str(value).strip() not in ("0", "1"):
            raise OptionError(f"{flag}: expected 0 or 1, got {value!r}")
        flags[flag] = str(value).strip() == "1"
    params_in = dict(run)
    params_in["mmp"] = mmp
    if tgb is not None:  # llama-bench's: each T,TB pair (several by ';') is one more entry of the -t list
        entries = [] if threads is None else [str(t) for t in lb.int_list(threads, "t")]
        for part in tgb.split(";"):
            pair = lb.int_list(part, "tgb")
            if len(pair) != 2 or min(pair) < 1:
                raise OptionError(f"-tgb: expected T,TB pairs of thread counts (e.g. 8,16 or 8,16;4,8), got {tgb!r}")
            entries.append(f"{pair[0]}/{pair[1]}")
        threads = ",".join(entries)
    elif threads is None:
        threads = str(_D.threads)
    sm_list = None
    if params_in.get("split_mode") is not None and "," in str(params_in["split_mode"]):
        # llama-bench's -sm list (swept, outside the batch sizes): each value checked and noted as one -sm is
        given = str(params_in["split_mode"])
        vals = [v.strip().lower() for v in given.split(",") if v.strip()]
        if not vals or any(v not in ("none", "layer", "graph") for v in vals):
            raise OptionError(f"-sm: expected none, layer or graph (or a comma list of them), got {given!r}")
        sm_list, params_in["split_mode"] = ",".join(vals), vals[0]
    fixed, fmoe = _check_bench_options(params_in)
    if stats is not None:
        fixed.update(stats.load_options())
    elif run.gpu_experts:
        RunOptions.from_kwargs(gpu_experts=run.gpu_experts)
        raise OptionError("gpu-experts: needs expert statistics: --expert-stats FILE.json written by an earlier "
                          "run (generate, bench, sweep-bench or serve with --expert-stats FILE.json)")
    no_warmup = run.no_warmup is not None and RunOptions.from_kwargs(fa=run.no_warmup).fa
    do_warmup = flags["-w"] and not no_warmup
    models = []
    for m in model or [None]:
        for part in (m.split(",") if m else [None]):
            models.append(resolve_model(part))

    def pairs(values: Optional[list[str]], flag: str) -> list[tuple[int, int]]:
        out = []
        for g in values or []:
            vals = lb.int_list(g, flag)
            if len(vals) != 2 or min(vals) < 0:
                raise OptionError(f"-{flag}: expected PP,TG (non-negative token counts), got {g!r}")
            out.append((vals[0], vals[1]))
        return out

    def counts(value: str, flag: str) -> list[int]:
        """A token-count list: 0 skips that test (as llama-bench), a negative count is refused."""
        vals = lb.int_list(value, flag)
        bad = [v for v in vals if v < 0]
        if bad:
            raise OptionError(f"-{flag}: token counts must be >= 0 (0 skips the test), got {value!r}")
        return vals
    for flag, value in (("ub", ubatch), ("b", batch), ("t", threads.replace("/", ",")), ("ngl", ngl), ("amb", amb),
                        ("mla", mla)):
        vals = lb.int_list(value, flag)
        low = 1 if flag in ("ub", "b") else -1 if flag == "ngl" else 0  # -ngl -1: every layer, as the other commands
        if any(v < low for v in vals):
            raise OptionError(f"-{flag}: values must be >= {low}{' (-1: every layer)' if flag == 'ngl' else ''}, "
                              f"got {value!r}")
        if flag == "mla" and any(v > 3 for v in vals):  # no such mode anywhere (ik's are 0-3): not a row's 'skipped'
            raise OptionError(f"-mla: modes are 0, 1, 2 or 3, got {value!r}")
    # a type no build knows is a bad flag, refused before anything runs (llama-bench's "invalid
    # parameter"), not a 'skipped' row per combination; a cache type of ik's that this build does
    # not store (q4_0, ...) stays a combination's 'skipped' row, as a backend's missing type there
    for flag, value, allowed in (("-ctk", ctk, CACHE_TYPES + IK_CACHE_TYPES), ("-ctv", ctv, CACHE_TYPES + IK_CACHE_TYPES),
                                 ("--dtype", dtype, COMPUTE_DTYPES)):
        for v in str(value).split(",") if value else ():
            if v.strip().lower() not in allowed:
                raise OptionError(f"{flag}: {v.strip()!r} is not one of {', '.join(allowed)} (got {value!r})")
    tests = lb.make_tests(counts(n_prompt, "p"), counts(n_gen, "n"), pairs(gp, "gp"),
                          counts(depth, "d") or [0], pairs(pg, "pg"))
    if not tests:
        raise OptionError("no tests: give -p, -n, -pg or -gp")
    params = dict(split_mode=sm_list, mla=mla, fa=params_in["fa"],  # -no-fa applied by _check_bench_options
                  ubatch=ubatch, batch=batch, ctk=ctk, ctv=ctv, amb=amb, fmoe=fmoe, ser=ser, ot=ot,
                  ngl=ngl, threads=threads, dtype=dtype)
    _note_combinations(params)
    switches = {k: params_in.get(k) for k in SWITCH_PARAMS}
    given = dict(params, ctk=None if ctk == _D.ctk else ctk,
                 fa=None if params["fa"] == str(int(_D.fa)) else params["fa"])
    table = lb.MarkdownTable(lb.markdown_fields(given, switches, lb.backend_name(), flags["--print-overrides"]))
    console = stderr_console()
    first = []

    def emit(line: str) -> None:
        status.stop()  # the spinner (stderr) never shares a line with a result (stdout)
        typer.echo(line)
        sys.stdout.flush()
        status.start()

    finished = []  # what the whole-output formats print if a Ctrl-C ends the run early

    def on_result(r):
        finished.append(r)
        interrupt.check()  # (ikjax/interrupt.py: a Ctrl-C JAX swallowed)
        if output == "md":
            if not first:
                first.append(1)
                for line in table.header():
                    emit(line)
            emit(table.row(r))
        elif output == "jsonl":
            emit(lb.to_jsonl(r))
        if r.error:
            combo = " ".join(f"{lb.COLUMN.get(k, k)}={v}" for k, v in r.params.items())
            console.print(f"skipped {os.path.basename(r.model)} {combo}: {r.error}", markup=False, highlight=False,
                          soft_wrap=True)

    setup_compile_cache(run.compile_cache_dir)
    try:
        with console.status("bench") as status:
            results = lb.run_bench(models, params, tests, reps, on_result, lambda s: status.update(s),
                                   extra_options=fixed, seed=seed, warmup=do_warmup, switches=switches,
                                   on_engine=stats.add if stats is not None else None)
    except BaseException as e:
        # Ctrl-C / SIGTERM: the tests that finished are printed whole in the formats written at the end
        # (json, csv, sql), then the interruption's line (llama-bench prints each test as it ends; an
        # interrupted run here printed nothing); md and jsonl rows went out as they came
        if output in ("json", "csv", "sql") and finished and (isinstance(e, KeyboardInterrupt) or is_interrupt(e)):
            typer.echo({"json": lb.to_json, "csv": lb.to_csv, "sql": lb.to_sql}[output](finished),
                       nl=output == "json")
        raise
    if output == "md" and first:
        for line in lb.MarkdownTable.footer():
            typer.echo(line)
    if output == "json":
        typer.echo(lb.to_json(results))
    elif output == "csv":
        typer.echo(lb.to_csv(results), nl=False)
    elif output == "sql":
        typer.echo(lb.to_sql(results), nl=False)
    if output_err is not None:  # llama-bench's -oe: the same results in a second format, on stderr
        typer.echo(_render(output_err, results, table), err=True, nl=False)
    failed = sum(1 for r in results if r.error)
    if failed:  # every row printed; the status says not all ran (llama-bench's 1 for a model that fails to load)
        typer.echo(f"error: {failed} of {len(results)} tests did not run (their rows say why)", err=True)
        raise typer.Exit(1)


class _ExpertStats:
    """bench --expert-stats FILE.json: every combination's engine counts (its timed runs and their
    context; not the warm-ups), the totals written when bench ends (also after Ctrl-C or SIGTERM),
    by the rule every command follows (`common.save_stats`). With --gpu-experts the file is read
    first and each engine keeps its most used experts on the GPU, as on the other commands."""

    def __init__(self, path: str, gpu_experts: Optional[str]):
        from ikjax.cli.common import check_stats_target
        from ikjax.cli.parser import at_end
        check_stats_target(path)
        self.path, self.gpu_experts = path, gpu_experts
        self.total: dict = {"tokens": 0, "layers": {}}
        self.engines = 0
        at_end(self.save)  # (SIGTERM unwinds every command to it: common.handle)

    def load_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"expert_stats": True}
        if self.gpu_experts:
            opts.update(gpu_experts=self.gpu_experts, expert_counts=self.path)
        RunOptions.from_kwargs(**opts)
        return opts

    def add(self, eng) -> None:
        """One combination's engine, done: its counts join the totals (models with other expert
        counts, several -m, are refused: not one profile)."""
        from ikjax.model.moe import add_stats
        add_stats(self.total, eng.expert_stats())
        self.engines += 1

    def save(self) -> None:
        from ikjax.cli.common import save_stats
        if self.engines:
            save_stats(self.path, self.total, merge=bool(self.gpu_experts))

