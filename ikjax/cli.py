"""The `ikjax` command line: ik_llama.cpp's flags and tables on a JAX engine.

    ikjax sweep-bench -m model.gguf -c 16384 -ub 2048 -mla 3 -fa
    ikjax bench -m model.gguf -p 512 -n 128 -mla 2,3 -ub 512,2048 -r 3
    ikjax generate -m model.gguf -p "Once upon a time" -n 64
    ikjax info model.gguf -c 32768 -ctk q8_0
    ikjax make-model --preset v2-lite --type Q4_0 -o v2lite.gguf
    ikjax run --config configs/tiny-cpu.json
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.24 carries its own click
    from typer._click.exceptions import ClickException as _ClickException
except ImportError:  # pragma: no cover
    from click import ClickException as _ClickException
try:
    import click as _click
    _CLICK_ERRORS: tuple = (_ClickException, _click.ClickException)
except ImportError:  # pragma: no cover
    _CLICK_ERRORS = (_ClickException,)

from ikjax.errors import IkjaxError, OptionError
from ikjax.memory_plan import plan_memory
from ikjax.options import BARE_PARAMS, RunOptions, switch_notes

try:  # typer >= 0.24 carries its own click
    from typer._click.exceptions import NoSuchOption as _NoSuchOption
    from typer._click.exceptions import UsageError as _UsageError
    from typer._click.parser import _normalize_opt, _OptionParser
except ImportError:  # pragma: no cover
    from click.exceptions import NoSuchOption as _NoSuchOption
    from click.exceptions import UsageError as _UsageError
    from click.parser import _normalize_opt
    from click.parser import OptionParser as _OptionParser

_D = RunOptions()

_FLAG_VALUE = re.compile(r"(?i)^(0|1|on|off|true|false|yes|no|auto)(,(0|1|on|off|true|false|yes|no|auto))*$")
# ik's switches that may be given bare (`-fa`, `-rtr`) on the commands that take them; `_rewrite`'s default
_BARE_FLAGS = {"-fa", "--fa", "--flash-attn", "-fmoe", "--fmoe", "--fused-moe"}


def _rewrite(args: list[str], bare: set[str] | frozenset[str] = frozenset(_BARE_FLAGS),
             has_positional: bool = False) -> list[str]:
    """ik's bare switches: `-fa` alone means `-fa 1`; `auto` means on.

    A bare switch followed by another option (or nothing) gets the value 1. Followed by a word that
    is not 0/1/on/off/auto, it is refused naming the switch (`-fa 2`), unless the command takes a
    positional argument (`ikjax info -fa model.gguf`), where the word is that argument.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        out.append(a)
        i += 1
        if a == "--":
            out += args[i:]
            break
        if a not in bare:
            continue
        nxt = args[i] if i < len(args) else None
        if nxt is not None and _FLAG_VALUE.match(nxt):
            out.append(re.sub(r"(?i)auto", "1", nxt))
            i += 1
        elif nxt is None or nxt.startswith("-") or (has_positional and not re.fullmatch(r"[\d.,]+", nxt)):
            out.append("1")
        else:
            raise _UsageError(f"{a}: expected 0/1/on/off/auto, got {nxt}")
    return out


class _ExactParser(_OptionParser):
    """click's parser without short-option clustering: a token with one dash and more than one letter
    (`-mg`, `-ctv`, `-tb`) must be a declared option, never `-m g` or `-c tv`."""

    def _process_opts(self, arg: str, state) -> None:
        name = arg.split("=", 1)[0]
        if arg[:1] == "-" and arg[:2] != "--" and len(name) > 2 and _normalize_opt(name, self.ctx) not in self._long_opt:
            import difflib
            close = difflib.get_close_matches(name, list(self._long_opt) + list(self._short_opt), n=3, cutoff=0.75)
            raise _NoSuchOption(name, message=f"unknown option {name}"
                                + (f" (did you mean {', '.join(close)}?)" if close else ""), ctx=self.ctx)
        super()._process_opts(arg, state)


class _ExactCommand(TyperCommand):
    """A command whose options are matched exactly (ik's flags) and whose bare switches get 1."""

    def make_parser(self, ctx) -> _OptionParser:
        parser = _ExactParser(ctx)
        for param in self.get_params(ctx):
            param.add_to_parser(parser, ctx)
        return parser

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        bare = {o for p in self.params if p.name in BARE_PARAMS for o in (*p.opts, *p.secondary_opts)}
        has_positional = any(p.param_type_name == "argument" for p in self.params)
        return super().parse_args(ctx, _rewrite(list(args), bare, has_positional))


class _Group(TyperGroup):
    """Every usage error as one line on stderr with exit code 1."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except _CLICK_ERRORS as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `ikjax` alone: the help was printed
                sys.exit(0)
            typer.echo(f"error: {e.format_message()}".splitlines()[0], err=True)
            sys.exit(1)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_Group, name="ikjax", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="JAX inference for DeepSeek GGUF models (deepseek2) with ik_llama.cpp's flags: "
         "sweep-bench, llama-bench style runs, generation, file info, synthetic models.",
    context_settings={"help_option_names": ["-h", "--help"]})

# ---------------------------------------------------------------------------------------------
# shared options (ik_llama.cpp names first, long names beside)

ModelOpt = Annotated[Optional[str], typer.Option(
    "-m", "--model", help="GGUF file (any shard of a split model), or synthetic:PRESET[:TYPE[:LAYERS]] "
    "(made once, cached in ~/.cache/ikjax). Default: the built-in tiny synthetic model.")]
CtxOpt = Annotated[int, typer.Option("-c", "--ctx", "--ctx-size", help="context size in tokens (KV cache length)")]
BatchOpt = Annotated[int, typer.Option("-b", "--batch", "--batch-size", help="logical batch size")]
UbatchOpt = Annotated[int, typer.Option("-ub", "--ubatch", "--ubatch-size",
                                        help="micro-batch: tokens per prompt-processing step")]
MlaOpt = Annotated[int, typer.Option("-mla", "--mla", "--mla-use", help="MLA mode: 0 standard attention (per-head "
                                     "K/V cache), 1 absorbed, 2 PP decompressed + TG absorbed, 3 as 2 with the "
                                     "flash kernel for TG (best)")]
FaOpt = Annotated[str, typer.Option("-fa", "--fa", "--flash-attn", help="flash attention 0|1 (bare -fa = 1)")]
AmbOpt = Annotated[int, typer.Option("-amb", "--amb", "--attention-max-batch",
                                     help="without FA: cap the K*Q buffer at N MiB (attention in head chunks); 0 = off")]
CtkOpt = Annotated[str, typer.Option("-ctk", "--ctk", "--cache-type-k", help="KV cache type: f32, f16, bf16, q8_0")]
FmoeOpt = Annotated[str, typer.Option("-fmoe", "--fmoe", "--fused-moe", help="fused MoE 0|1 (bare -fmoe = 1; "
                                      "default on, as ik)")]
SerOpt = Annotated[Optional[str], typer.Option("-ser", "--ser", "--smart-expert-reduction",
                                               help="smart expert reduction 'Kmin,t'")]
OtOpt = Annotated[Optional[list[str]], typer.Option("-ot", "--ot", "--override-tensor",
                                                    help="tensor placement REGEX=DEVICE[,...], first match wins "
                                                    "(e.g. exps=CPU); may repeat")]
NglOpt = Annotated[int, typer.Option("-ngl", "--ngl", "--n-gpu-layers", "--gpu-layers",
                                     help="layers on accelerators")]
ThreadsOpt = Annotated[int, typer.Option("-t", "--threads", help="CPU threads for generation (0 = all cores)")]
ThreadsBatchOpt = Annotated[int, typer.Option("-tb", "--threads-batch",
                                              help="CPU threads for prompt processing (0 = same as -t)")]
CtvOpt = Annotated[Optional[str], typer.Option("-ctv", "--ctv", "--cache-type-v", help="V cache type (default: the "
                                               "-ctk type). With -mla 1-3 there is no V cache: a different type is "
                                               "noted and has no effect; with -mla 0 it must equal -ctk")]
NoFmoeOpt = Annotated[Optional[str], typer.Option("-no-fmoe", "--no-fused-moe", help="fused MoE off (same as -fmoe 0)")]
CpuMoeOpt = Annotated[Optional[str], typer.Option("-cmoe", "--cpu-moe", help="routed experts of all layers in host "
                                                  "memory (shorthand for -ot 'ffn_(up|down|gate)_exps=CPU')")]
NCpuMoeOpt = Annotated[int, typer.Option("-ncmoe", "--n-cpu-moe", help="routed experts of the first N layers in host "
                                         "memory (shorthand for -ot 'blk\\.(0|...|N-1)\\.ffn_(up|down|gate)_exps=CPU')")]
# ik switches that change nothing here: accepted with a one-line note (or refused), see options.switch_notes
_NOTE = "accepted; a note says why it has no effect here"
_ONE = "; with one device a note says it has no effect"
SmOpt = Annotated[Optional[str], typer.Option("-sm", "--split-mode", help="none|layer|graph: one device, whole layers "
                                              "per device (pipeline), or every layer split over a mesh" + _ONE)]
MgOpt = Annotated[Optional[str], typer.Option("-mg", "--main-gpu", help="the device of -sm none" + _ONE)]
TsOpt = Annotated[Optional[str], typer.Option("-ts", "--ts", "--tensor-split", help="shares per device for -sm layer, "
                                              "e.g. 3,1 (equal if not given)" + _ONE)]
RtrOpt = Annotated[Optional[str], typer.Option("-rtr", "--run-time-repack", help="run-time repack: " + _NOTE)]
ThpOpt = Annotated[Optional[str], typer.Option("-thp", "--transparent-huge-pages", help="huge pages: " + _NOTE)]
NoMmapOpt = Annotated[Optional[str], typer.Option("--no-mmap", help=_NOTE)]
NumaOpt = Annotated[Optional[str], typer.Option("--numa", help="distribute|isolate|numactl: " + _NOTE)]
NkvoOpt = Annotated[Optional[str], typer.Option("-nkvo", "--no-kv-offload", help="KV cache in host memory: no effect "
                                                "on CPU; refused on an accelerator (not implemented)")]
OoaeOpt = Annotated[Optional[str], typer.Option("-ooae", "--offload-only-active-experts", help=_NOTE)]
NoOoaeOpt = Annotated[Optional[str], typer.Option("-no-ooae", "--no-offload-only-active-experts", help=_NOTE)]
OpOpt = Annotated[Optional[str], typer.Option("-op", "--offload-policy", help="per-op offload policy: " + _NOTE)]
CudaOpt = Annotated[Optional[str], typer.Option("-cuda", "--cuda-params", help="ggml-cuda tuning: " + _NOTE)]
MugeOpt = Annotated[Optional[str], typer.Option("-muge", "--merge-up-gate-experts", help=_NOTE)]
MqkvOpt = Annotated[Optional[str], typer.Option("-mqkv", "--merge-qkv", help=_NOTE)]
GerOpt = Annotated[Optional[str], typer.Option("-ger", "--grouped-expert-routing", help=_NOTE
                                               + " (expert groups are always applied)")]
WbOpt = Annotated[Optional[str], typer.Option("-wb", "--warmup-batch", help=_NOTE + " (steps are always warmed up)")]
NrepOpt = Annotated[Optional[str], typer.Option("-nrep", "--n-repetitions", help="sweep-bench: repetitions of the "
                                                "first row, averaged (ik's -nrep); noted elsewhere")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="matmul dtype: auto (f32 on CPU, bf16 on GPU), f32, bf16, f16 (not an ik flag)")]
KvBlockOpt = Annotated[int, typer.Option("--kv-block", help="KV chunk of the blocked attention / KV bucket size")]
VerboseOpt = Annotated[bool, typer.Option("-v", "--verbose", help="log loading and compilation")]
CompileCacheOpt = Annotated[Optional[str], typer.Option(
    "--compile-cache", metavar="DIR", help="keep compiled steps in DIR across runs (0: off); default "
    "$IKJAX_COMPILE_CACHE, else ~/.cache/ikjax/xla (not an ik flag)")]
# several processes (hosts) on jax.distributed: ikjax.distributed
CoordOpt = Annotated[Optional[str], typer.Option("--coordinator", help="HOST:PORT of process 0's coordinator: run "
                                                 "this command on every process (hosts) with -sm graph; the mesh spans "
                                                 "all their devices, process 0 prints (see README)")]
NprocOpt = Annotated[Optional[int], typer.Option("--num-processes", help="processes in all (with --coordinator)")]
PidOpt = Annotated[Optional[int], typer.Option("--process-id", help="this process's index 0..N-1 (with --coordinator)")]


def _err(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)


def _handle(func: Callable) -> Callable:
    """Run a command body: IkjaxError -> one line on stderr, exit 1 (no traceback)."""
    import functools

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            _join_processes(kwargs)
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except IkjaxError as e:
            _err(str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            _err("interrupted")
            raise typer.Exit(130)
        except Exception as e:  # noqa: BLE001
            if os.environ.get("IKJAX_DEBUG"):
                raise
            first = (str(e).splitlines() or [""])[0]
            _err(f"{type(e).__name__}: {first} (set IKJAX_DEBUG=1 for a traceback)")
            raise typer.Exit(1)
    return wrapper


def _join_processes(params: dict[str, Any]) -> None:
    """--coordinator/--num-processes/--process-id: join the other processes before any JAX backend
    starts; every process but 0 then computes silently (its stdout goes nowhere). The collectives'
    C++ libraries (gloo) print connection lines on file descriptor 1: it is pointed at stderr, and
    Python's stdout keeps the real one, so stdout holds only the table."""
    from ikjax import distributed
    if not distributed.check_args(params.get("coordinator"), params.get("num_processes"), params.get("process_id")):
        return
    distributed.initialize(params["coordinator"], params["num_processes"], params["process_id"])
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w") if distributed.is_primary() else open(os.devnull, "w")


def _stderr_console():
    from rich.console import Console
    return Console(stderr=True, highlight=False)


def _log(msg: str) -> None:
    typer.echo(msg, err=True)


def _setup_logging(verbose: bool) -> None:
    import logging
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def resolve_model(spec: Optional[str]) -> str:
    """A path, or the built-in default / a synthetic:PRESET[:TYPE[:LAYERS]] model (made once, cached)."""
    from ikjax import synthetic
    if spec and not spec.startswith("synthetic:"):
        return os.path.expanduser(spec)
    parts = (spec or "synthetic:tiny").split(":")[1:]
    preset = parts[0] if parts and parts[0] else "tiny"
    qtype = (parts[1] if len(parts) > 1 and parts[1] else "Q8_0").upper()
    layers = None
    if len(parts) > 2 and parts[2]:
        if not parts[2].isdigit():
            raise OptionError(f"model: bad layer count {parts[2]!r} in {spec!r} (synthetic:PRESET[:TYPE[:LAYERS]])")
        layers = int(parts[2])
    if preset not in synthetic.PRESETS:
        raise OptionError(f"model: unknown preset {preset!r} in {spec!r} (one of {', '.join(synthetic.PRESETS)})")
    path = synthetic.default_model_path().with_name(f"{preset}-{qtype}{f'-{layers}L' if layers else ''}.gguf")
    if not path.exists():
        _log(f"making synthetic model {preset} {qtype} -> {path} (first use)")
        t0 = time.perf_counter()
        synthetic.make_model(path, preset, qtype, layers=layers)
        _log(f"made in {time.perf_counter() - t0:.1f}s")
    return str(path)


RUN_OPTION_PARAMS = ("ctx", "batch", "ubatch", "mla", "fa", "amb", "ctk", "ctv", "fmoe", "ser", "ot", "ngl", "threads",
                     "threads_batch", "cpu_moe", "n_cpu_moe", "dtype", "kv_block", "split_mode", "main_gpu", "ts")
SWITCH_PARAMS = ("split_mode", "main_gpu", "ts", "rtr", "thp", "no_mmap", "numa", "nkvo", "ooae", "no_ooae", "op",
                 "cuda", "muge", "mqkv", "ger", "wb", "nrep")


def _run_options(params: dict[str, Any]) -> dict[str, Any]:
    """A command's parameters (its `locals()`) -> ikjax.load keyword arguments (RunOptions names)."""
    kw = {k: params[k] for k in RUN_OPTION_PARAMS if k in params}
    ot = kw.pop("ot", None)
    if ot:
        kw["ot"] = ",".join(ot) if isinstance(ot, list) else ot
    no_fmoe = params.get("no_fmoe")
    if no_fmoe is not None and RunOptions.from_kwargs(fmoe=no_fmoe).fmoe:  # ik's -no-fmoe: fused MoE off
        kw["fmoe"] = "0"
    return {k: v for k, v in kw.items() if v is not None}


def _backend() -> str:
    import jax
    return jax.default_backend()


def _check_options(params: dict[str, Any], command: str) -> tuple[dict[str, Any], RunOptions]:
    """Validate a command's run options and ik switches before anything is loaded; print one note per
    option that has no effect here. Returns (ikjax.load keyword arguments, the checked RunOptions)."""
    run_opts = _run_options(params)
    checked = RunOptions.from_kwargs(**run_opts)
    switches = {k: params[k] for k in SWITCH_PARAMS if k in params}
    for line in switch_notes(switches, command, _backend()) + checked.notes():
        _log("note: " + line)
    return run_opts, checked


def _load(model: Optional[str], verbose: bool = False, **opts: Any):
    import ikjax
    _setup_logging(verbose)
    # validate the options before (possibly) making the default model
    RunOptions.from_kwargs(**opts)
    path = resolve_model(model)
    t0 = time.perf_counter()
    eng = ikjax.load(path, **opts)
    _log(f"loaded {path} in {time.perf_counter() - t0:.2f}s")
    _log("memory plan:")
    for line in eng.memory_plan().lines():
        _log("  " + line)
    return eng


def _setup_compile_cache(spec: Optional[str]) -> None:
    """--compile-cache (or $IKJAX_COMPILE_CACHE): set before the first compile (ikjax.compile_cache)."""
    from ikjax import compile_cache
    compile_cache.setup(spec)


def _compiled_line(eng, count0: int, hits0: int, seconds: float) -> str:
    """What compiling cost: steps compiled, steps loaded from the persistent cache, and where it is."""
    from ikjax import compile_cache
    n, hits = eng.compile_count - count0, eng.compile_cache_hits - hits0
    if compile_cache.directory() is None:
        return f"compiled {n} steps in {seconds:.2f}s (compilation cache off; not in the timings)"
    return (f"compiled {n - hits} steps, {hits} from the cache in {seconds:.2f}s "
            f"({compile_cache.describe()}; not in the timings)")


# ---------------------------------------------------------------------------------------------
# sweep-bench


class _Progress:
    """A rich progress bar on stderr that never shares a line with what goes to stdout.

    On a terminal the bar is taken off the screen before each stdout line and drawn again after it;
    `log` prints a line above the bar. When stderr is not a terminal no bar is drawn and `status`
    lines are printed as plain lines, so a log file still shows what the run is doing."""

    def __init__(self, title: str, total: int, *, eta: bool = False):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        self.console = _stderr_console()
        self.terminal = self.console.is_terminal
        cols = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn()] + ([TimeRemainingColumn()] if eta else [])
        self.prog = Progress(*cols, console=self.console, transient=True, redirect_stdout=False,
                             redirect_stderr=False)
        self.task = self.prog.add_task(title, total=total)

    def __enter__(self) -> "_Progress":
        if self.terminal:  # a log file gets the status lines only (a stopped bar would leave blank lines)
            self.prog.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.terminal:
            self.prog.stop()

    def update(self, **kw) -> None:
        self.prog.update(self.task, **kw)

    def status(self, text: str) -> None:
        if self.terminal:
            self.prog.update(self.task, description=text)
        else:
            self.log(text)

    def log(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def echo(self, line: str) -> None:
        """One line to stdout, never on the bar's line."""
        live = self.prog.live.is_started
        if live:
            self.prog.stop()
        sys.stdout.flush()
        typer.echo(line)
        sys.stdout.flush()
        if live:
            self.prog.start()


@app.command("sweep-bench", cls=_ExactCommand)
@_handle
def sweep_bench(
    model: ModelOpt = None,
    ctx: CtxOpt = _D.ctx,
    batch: BatchOpt = _D.batch,
    ubatch: UbatchOpt = _D.ubatch,
    n_gen: Annotated[Optional[int], typer.Option("-n", "--n-gen", "--n-predict",
                                                 help="TG tokens per row (default ub/4)")] = None,
    mla: MlaOpt = _D.mla,
    fa: FaOpt = str(int(_D.fa)),
    amb: AmbOpt = _D.amb,
    ctk: CtkOpt = _D.ctk,
    ctv: CtvOpt = None,
    fmoe: FmoeOpt = str(int(_D.fmoe)),
    no_fmoe: NoFmoeOpt = None,
    ser: SerOpt = None,
    ot: OtOpt = None,
    cpu_moe: CpuMoeOpt = None,
    n_cpu_moe: NCpuMoeOpt = _D.n_cpu_moe,
    ngl: NglOpt = _D.ngl,
    threads: ThreadsOpt = _D.threads,
    threads_batch: ThreadsBatchOpt = _D.threads_batch,
    dtype: DtypeOpt = _D.dtype,
    kv_block: KvBlockOpt = _D.kv_block,
    nrep: NrepOpt = None,
    split_mode: SmOpt = None, main_gpu: MgOpt = None, ts: TsOpt = None, rtr: RtrOpt = None, thp: ThpOpt = None,
    no_mmap: NoMmapOpt = None, numa: NumaOpt = None, nkvo: NkvoOpt = None, ooae: OoaeOpt = None,
    no_ooae: NoOoaeOpt = None, op: OpOpt = None, cuda: CudaOpt = None, muge: MugeOpt = None, mqkv: MqkvOpt = None,
    ger: GerOpt = None, wb: WbOpt = None,
    output_format: Annotated[str, typer.Option("--output-format", "-of", help="md (ik's table) or jsonl")] = "md",
    plot: Annotated[Optional[str], typer.Option("--plot", help="also draw S_PP and S_TG vs N_KV to this PNG")] = None,
    seed: Annotated[int, typer.Option("-s", "--seed", help="seed of the random tokens")] = 0,
    verbose: VerboseOpt = False,
    compile_cache_dir: CompileCacheOpt = None,
    coordinator: CoordOpt = None, num_processes: NprocOpt = None, process_id: PidOpt = None,
) -> None:
    """PP and TG speed as the KV cache fills (ik_llama.cpp's llama-sweep-bench).

    For N_KV = 0, ub, 2ub, ... while N_KV + ub <= c: generate TG tokens one at a time (timed), drop them, then process ub random tokens at N_KV (timed). All steps are compiled before timing; compile progress and time go to stderr, the table (or JSONL) alone to stdout.

    Example: ikjax sweep-bench -m model.gguf -c 16384 -ub 2048 -mla 3 -fa --output-format jsonl --plot sweep.png
    """
    from ikjax import sweep_bench as sb
    if output_format not in ("md", "jsonl"):
        raise OptionError(f"output-format: {output_format!r} is not md or jsonl")
    if n_gen is not None and n_gen < 0:
        raise OptionError(f"n: need >= 0, got {n_gen}")
    run_opts, checked = _check_options(locals(), "sweep-bench")
    reps = int(nrep) if nrep else 1  # checked by _check_options
    if not sb.sweep_points(checked.ctx, checked.ubatch):
        raise OptionError(f"ubatch {checked.ubatch} is larger than the context c={checked.ctx}: nothing to sweep")
    _setup_compile_cache(compile_cache_dir)
    eng = _load(model, verbose, **run_opts)
    count0, hits0 = eng.compile_count, eng.compile_cache_hits
    ub = eng.options.ubatch
    tg = ub // 4 if n_gen is None else n_gen
    # the first row's steps compile (or load from the persistent cache) before it, each later
    # row's before that row, outside its timings: the first row comes as soon as its own steps exist
    n_shapes = len(sb.step_shapes(eng, tg))
    first = sb.step_shapes(eng, tg, 0)
    t0 = time.perf_counter()
    with _Progress("compiling", total=len(first)) as prog:
        sb.precompile(eng, tg, n_kv=0, on_shape=lambda *_: prog.update(advance=1),
                      on_begin=lambda k, n, t, kv: prog.status(f"compiling step {k}/{n} of the first row "
                                                               f"({t} tokens, KV bucket {kv})"))
    compile_s = time.perf_counter() - t0
    _log(_compiled_line(eng, count0, hits0, compile_s)
         + (f" for the first row; the other {n_shapes - len(first)} before their rows" if n_shapes > len(first) else ""))
    info = sb.RunInfo.of(eng)
    rows = []
    later = [0.0]

    def before_row(n_kv: int) -> None:
        t1 = time.perf_counter()
        sb.precompile(eng, tg, n_kv=n_kv)
        later[0] += time.perf_counter() - t1

    t0 = time.perf_counter()
    with _Progress("sweep-bench", total=sb.total_work(eng, tg, reps), eta=True) as prog:
        if output_format == "md":
            for line in ("", info.banner(), "", sb.HEADER, sb.SEPARATOR):
                prog.echo(line)
        for row in sb.run(eng, tg, seed=seed, nrep=reps, before_row=before_row,
                          on_progress=lambda done, _: prog.update(completed=done)):
            rows.append(row)
            prog.update(description=f"sweep-bench N_KV {row.n_kv + ub}")
            prog.echo(row.markdown() if output_format == "md" else row.jsonl(info))
    if n_shapes > len(first):
        _log(_compiled_line(eng, count0, hits0, compile_s + later[0]) + " in all")
    _log(f"sweep took {time.perf_counter() - t0 - later[0]:.2f}s (+ {compile_s + later[0]:.2f}s compile)")
    if plot:
        import json
        from ikjax.plot import plot_runs
        recs = [json.loads(r.jsonl(info)) for r in rows]
        label = f"{Path(str(eng.file.path)).stem} mla={eng.options.mla} fa={int(eng.options.fa)}"
        out = plot_runs([(label, recs)], plot, title=f"sweep-bench c={eng.options.ctx} ub={ub}")
        _log(f"plot written to {out}")


@app.command("plot", cls=_ExactCommand)
@_handle
def plot_cmd(
    files: Annotated[list[str], typer.Argument(help="sweep-bench JSONL files to overlay")],
    output: Annotated[str, typer.Option("-o", "--output", help="PNG to write")] = "sweep-bench.png",
    labels: Annotated[Optional[str], typer.Option("--labels", help="comma-separated legend labels")] = None,
    title: Annotated[Optional[str], typer.Option("--title")] = None,
) -> None:
    """Plot S_PP and S_TG against N_KV for several sweep-bench --output-format jsonl runs (like sweep-bench-plot)."""
    from ikjax.plot import plot_files
    out = plot_files(files, output, labels.split(",") if labels else None, title)
    typer.echo(str(out))


# ---------------------------------------------------------------------------------------------
# bench (llama-bench)


BENCH_FIXED = ("threads_batch", "cpu_moe", "n_cpu_moe", "kv_block", "split_mode", "main_gpu", "ts")


def _check_bench_options(params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """bench's ik switches and the run options it does not sweep, checked and noted once.
    Returns (the fixed run options, the -fmoe list after -no-fmoe)."""
    fixed = {k: params[k] for k in BENCH_FIXED if params.get(k) is not None}
    RunOptions.from_kwargs(**fixed)
    switches = {k: params[k] for k in SWITCH_PARAMS if k in params}
    notes = switch_notes(switches, "bench", _backend())
    if params.get("ctx") is not None:
        notes.append(f"-c {params['ctx']} has no effect in bench: each test's context is sized to its tokens "
                     "(prompt + generated + depth), as llama-bench does")
    for line in notes:
        _log("note: " + line)
    fmoe = params.get("fmoe")
    if params.get("no_fmoe") is not None and RunOptions.from_kwargs(fmoe=params["no_fmoe"]).fmoe:
        fmoe = "0"
    return fixed, fmoe


def _note_combinations(params: dict[str, Any]) -> None:
    """The notes of every swept combination (e.g. -ctv with mla 3), each once; a combination that
    does not validate is left to its 'skipped' row."""
    from ikjax import llama_bench as lb
    seen: set[str] = set()
    for combo in lb.combinations(params):
        try:
            notes = RunOptions.from_kwargs(**{lb.SWEPT[k]: v for k, v in combo.items()}).notes()
        except OptionError:
            continue
        for line in notes:
            if line not in seen:
                seen.add(line)
                _log("note: " + line)


@app.command("bench", cls=_ExactCommand)
@_handle
def bench(
    model: Annotated[Optional[list[str]], typer.Option("-m", "--model", help="GGUF file(s); repeat or comma list")] = None,
    n_prompt: Annotated[str, typer.Option("-p", "--n-prompt", help="prompt sizes, e.g. 512 or 128,512")] = "512",
    n_gen: Annotated[str, typer.Option("-n", "--n-gen", help="generation lengths, e.g. 128")] = "128",
    pg: Annotated[Optional[list[str]], typer.Option("-pg", "--pg", help="PP,TG: PP prompt tokens then TG generated "
                                                    "ones, timed together, printed ppPP+tgTG (may repeat)")] = None,
    gp: Annotated[Optional[list[str]], typer.Option("-gp", "--gp", "--n-gen-prompt",
                                                    help="PP,TG: TG tokens timed after an untimed PP-token prompt, "
                                                    "printed tgTG@ppPP (may repeat)")] = None,
    depth: Annotated[str, typer.Option("-d", "--n-depth", help="KV depth for the -p/-n tests, e.g. 0,4096")] = "0",
    ctx: Annotated[Optional[str], typer.Option("-c", "--ctx-size", help="accepted with a note: bench sizes the "
                                               "context to each test, as llama-bench does")] = None,
    reps: Annotated[int, typer.Option("-r", "--repetitions", help="timed repetitions per test")] = 5,
    output: Annotated[str, typer.Option("-o", "--output", help="md, json, jsonl or csv (llama-bench's keys)")] = "md",
    mla: Annotated[str, typer.Option("-mla", "--mla", "--mla-attn", help="MLA mode(s), e.g. 2,3")] = str(_D.mla),
    fa: FaOpt = str(int(_D.fa)),
    ubatch: Annotated[str, typer.Option("-ub", "--ubatch", "--ubatch-size", help="micro-batch(es)")] = str(_D.ubatch),
    batch: Annotated[str, typer.Option("-b", "--batch", "--batch-size", help="batch size(s)")] = str(_D.batch),
    ctk: Annotated[str, typer.Option("-ctk", "--ctk", "--cache-type-k", help="KV cache type(s)")] = _D.ctk,
    ctv: Annotated[Optional[str], typer.Option("-ctv", "--ctv", "--cache-type-v", help="V cache type(s) (see "
                                               "sweep-bench -ctv)")] = None,
    amb: Annotated[str, typer.Option("-amb", "--amb", "--attn-max-batch", "--attention-max-batch",
                                     help="MiB cap(s)")] = str(_D.amb),
    fmoe: FmoeOpt = str(int(_D.fmoe)),
    no_fmoe: NoFmoeOpt = None,
    ser: Annotated[Optional[str], typer.Option("-ser", "--ser", help="'Kmin,t'; several separated by ';'")] = None,
    ot: Annotated[Optional[str], typer.Option("-ot", "--ot", "--override-tensor",
                                              help="REGEX=DEV[,...]; several rule lists separated by ';'")] = None,
    cpu_moe: CpuMoeOpt = None,
    n_cpu_moe: NCpuMoeOpt = _D.n_cpu_moe,
    ngl: Annotated[str, typer.Option("-ngl", "--ngl", "--n-gpu-layers", help="GPU layers")] = str(_D.ngl),
    threads: Annotated[str, typer.Option("-t", "--threads", help="thread count(s)")] = str(_D.threads),
    threads_batch: ThreadsBatchOpt = _D.threads_batch,
    dtype: Annotated[str, typer.Option("--dtype", help="compute dtype(s)")] = _D.dtype,
    kv_block: KvBlockOpt = _D.kv_block,
    nrep: NrepOpt = None,
    split_mode: SmOpt = None, main_gpu: MgOpt = None, ts: TsOpt = None, rtr: RtrOpt = None, thp: ThpOpt = None,
    no_mmap: NoMmapOpt = None, numa: NumaOpt = None, nkvo: NkvoOpt = None, ooae: OoaeOpt = None,
    no_ooae: NoOoaeOpt = None, op: OpOpt = None, cuda: CudaOpt = None, muge: MugeOpt = None, mqkv: MqkvOpt = None,
    ger: GerOpt = None, wb: WbOpt = None,
    seed: Annotated[int, typer.Option("-s", "--seed")] = 0,
    verbose: VerboseOpt = False,
    compile_cache_dir: CompileCacheOpt = None,
    coordinator: CoordOpt = None, num_processes: NprocOpt = None, process_id: PidOpt = None,
) -> None:
    """llama-bench: pp512 / tg128 / pp512+tg128 / tg64@pp8192 tests over the Cartesian product of comma lists.

    Example: ikjax bench -m m.gguf -p 512 -n 128 -pg 512,128 -gp 8192,64 -mla 2,3 -ub 512,2048 -r 3 -o md

    Each result is mean ± sd of tokens/s over -r runs (after an untimed warm-up that compiles). -pg P,T times P prompt tokens and T generated ones together (t/s = (P+T)/time); -gp P,T times only the T generated tokens after P untimed prompt tokens. A combination that fails to load or run is printed as a 'skipped: reason' row; the rest goes on.
    """
    from ikjax import llama_bench as lb
    _setup_logging(verbose)
    if output not in ("md", "json", "jsonl", "csv"):
        raise OptionError(f"output: {output!r} is not md, json, jsonl or csv")
    if reps < 1:
        raise OptionError(f"repetitions: need >= 1, got {reps}")
    fixed, fmoe = _check_bench_options(locals())
    models = []
    for m in model or [None]:
        for part in (m.split(",") if m else [None]):
            models.append(resolve_model(part))

    def pairs(values: Optional[list[str]], flag: str) -> list[tuple[int, int]]:
        out = []
        for g in values or []:
            vals = lb.int_list(g, flag)
            if len(vals) != 2 or min(vals) < 0:
                raise OptionError(f"{flag}: expected PP,TG, got {g!r}")
            out.append((vals[0], vals[1]))
        return out
    tests = lb.make_tests(lb.int_list(n_prompt, "p"), lb.int_list(n_gen, "n"), pairs(gp, "gp"),
                          lb.int_list(depth, "d") or [0], pairs(pg, "pg"))
    if not tests:
        raise OptionError("no tests: give -p, -n, -pg or -gp")
    params = dict(mla=mla, fa=fa, ubatch=ubatch, batch=batch, ctk=ctk, ctv=ctv, amb=amb, fmoe=fmoe, ser=ser, ot=ot,
                  ngl=ngl, threads=threads, dtype=dtype)
    _note_combinations(params)
    shown = ["ngl", "threads", "ubatch", "mla", "fa"]
    defaults = dict(batch=str(_D.batch), ctk=_D.ctk, amb=str(_D.amb), fmoe=str(int(_D.fmoe)), dtype=_D.dtype)
    for k in ("batch", "ctk", "ctv", "amb", "fmoe", "ser", "ot", "dtype"):
        if params[k] not in (None, "") and params[k] != defaults.get(k):
            shown.append(k)
    for k, v in params.items():  # anything swept is shown
        if k not in shown and v and len(lb.split_list(v, k)) > 1:
            shown.append(k)
    table = lb.MarkdownTable(shown, _backend().upper())
    console = _stderr_console()
    first = []

    def emit(line: str) -> None:
        status.stop()  # the spinner (stderr) never shares a line with a result (stdout)
        typer.echo(line)
        sys.stdout.flush()
        status.start()

    def on_result(r):
        if output == "md":
            if not first:
                first.append(1)
                for line in table.header():
                    emit(line)
            emit(table.row(r))
        elif output == "jsonl":
            emit(lb.to_jsonl(r))
        if r.error:
            console.print(f"skipped {os.path.basename(r.model)} {r.params}: {r.error}", markup=False, highlight=False)

    _setup_compile_cache(compile_cache_dir)
    with console.status("bench") as status:
        results = lb.run_bench(models, params, tests, reps, on_result, lambda s: status.update(s),
                               extra_options=fixed, seed=seed)
    if output == "json":
        typer.echo(lb.to_json(results))
    elif output == "csv":
        typer.echo(lb.to_csv(results), nl=False)


# ---------------------------------------------------------------------------------------------
# generate


@app.command("generate", cls=_ExactCommand)
@_handle
def generate(
    model: ModelOpt = None,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="prompt text")] = "",
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="tokens to generate")] = 128,
    temp: Annotated[float, typer.Option("--temp", "--temperature", help="temperature (0 = greedy)")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="top-k sampling (0 = off)")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", help="top-p sampling (1 = off)")] = 0.95,
    min_p: Annotated[float, typer.Option("--min-p", help="min-p sampling (0 = off)")] = 0.05,
    seed: Annotated[Optional[int], typer.Option("-s", "--seed", help="RNG seed")] = None,
    ctx: CtxOpt = _D.ctx,
    batch: BatchOpt = _D.batch,
    ubatch: UbatchOpt = _D.ubatch,
    mla: MlaOpt = _D.mla,
    fa: FaOpt = str(int(_D.fa)),
    amb: AmbOpt = _D.amb,
    ctk: CtkOpt = _D.ctk,
    ctv: CtvOpt = None,
    fmoe: FmoeOpt = str(int(_D.fmoe)),
    no_fmoe: NoFmoeOpt = None,
    ser: SerOpt = None,
    ot: OtOpt = None,
    cpu_moe: CpuMoeOpt = None,
    n_cpu_moe: NCpuMoeOpt = _D.n_cpu_moe,
    ngl: NglOpt = _D.ngl,
    threads: ThreadsOpt = _D.threads,
    threads_batch: ThreadsBatchOpt = _D.threads_batch,
    dtype: DtypeOpt = _D.dtype,
    kv_block: KvBlockOpt = _D.kv_block,
    nrep: NrepOpt = None,
    split_mode: SmOpt = None, main_gpu: MgOpt = None, ts: TsOpt = None, rtr: RtrOpt = None, thp: ThpOpt = None,
    no_mmap: NoMmapOpt = None, numa: NumaOpt = None, nkvo: NkvoOpt = None, ooae: OoaeOpt = None,
    no_ooae: NoOoaeOpt = None, op: OpOpt = None, cuda: CudaOpt = None, muge: MugeOpt = None, mqkv: MqkvOpt = None,
    ger: GerOpt = None, wb: WbOpt = None,
    no_echo: Annotated[bool, typer.Option("--no-echo", "--no-display-prompt", help="don't print the prompt")] = False,
    verbose: VerboseOpt = False,
    compile_cache_dir: CompileCacheOpt = None,
    coordinator: CoordOpt = None, num_processes: NprocOpt = None, process_id: PidOpt = None,
) -> None:
    """Generate text from a prompt, streamed to stdout (like llama-cli -p ... -n ...).

    The steps the run needs are compiled first (progress on stderr); the speed line on stderr times
    the prompt and the generated tokens apart, without compilation."""
    from ikjax.tokenizer import GGUFTokenizer
    if n_predict < 0:
        raise OptionError(f"n-predict: need >= 0, got {n_predict}")
    run_opts, _ = _check_options(locals(), "generate")
    _setup_compile_cache(compile_cache_dir)
    eng = _load(model, verbose, **run_opts)
    count0, hits0 = eng.compile_count, eng.compile_cache_hits
    tok = GGUFTokenizer(eng.file.metadata, source=str(eng.file.path))
    ids = tok.encode(prompt)
    if not ids:
        raise OptionError("prompt: empty (and the model has no BOS token)")
    if len(ids) + n_predict > eng.options.ctx:
        raise OptionError(f"prompt ({len(ids)} tokens) + n-predict ({n_predict}) exceed the context c={eng.options.ctx}")
    shapes = _generate_shapes(eng, len(ids), n_predict)
    sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    t0 = time.perf_counter()
    with _Progress("compiling", total=len(shapes)) as prog:
        for k, (n_tok, kv, chunk) in enumerate(shapes, 1):
            what = f"decode loop of {chunk} steps" if chunk else f"{n_tok} tokens"
            prog.status(f"compiling step {k}/{len(shapes)} ({what}, KV bucket {eng.kv_bucket(kv, n_tok)})")
            _precompile_shape(eng, n_tok, kv, chunk, sampling)
            prog.update(advance=1)
    _log(_compiled_line(eng, count0, hits0, time.perf_counter() - t0))
    if not no_echo:
        typer.echo(prompt, nl=False)
    n = 0
    t_first = None
    t0 = time.perf_counter()

    def counted():
        nonlocal n, t_first
        for t in eng.generate(ids, n_predict, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed):
            if t_first is None:
                t_first = time.perf_counter()
            n += 1
            if t == tok.eos_id:
                return
            yield t

    for piece in tok.stream(counted()):
        sys.stdout.write(piece)
        sys.stdout.flush()
    typer.echo("")
    t_end = time.perf_counter()
    if t_first is not None:
        pp_s, tg_s = t_first - t0, t_end - t_first
        _log(f"prompt: {len(ids)} tokens in {pp_s:.3f}s ({len(ids) / pp_s:.2f} t/s, first token included); "
             f"generated {n} tokens" + (f", {n - 1} after the first in {tg_s:.3f}s ({(n - 1) / tg_s:.2f} t/s)"
                                        if n > 1 and tg_s > 0 else "") + " (compilation not included)")


def _generate_shapes(eng, n_prompt: int, n_predict: int) -> list[tuple[int, int, int]]:
    """(tokens, KV needed, decode-loop length or 0) of every step `eng.generate` runs for this
    prompt: its ubatch chunks, then the decode loops of DECODE_CHUNK steps from the first generated
    position (or, without the loop, one-token steps up to the last); Engine.prefill / _generate
    chunk the same way."""
    from ikjax.engine import DECODE_CHUNK
    seen: dict[tuple, tuple[int, int, int]] = {}
    ub = eng.options.ubatch
    for c0 in range(0, n_prompt, ub):
        t = eng.token_bucket(min(ub, n_prompt - c0))
        seen.setdefault((t, eng.kv_bucket(c0 + t, t)), (t, c0 + t, 0))
    loop = eng.decode_loop()
    for pos in range(n_prompt, n_prompt + max(n_predict - 1, 0), DECODE_CHUNK if loop else 1):
        kv = pos + DECODE_CHUNK if loop else pos + 1
        seen.setdefault((1, eng.kv_bucket(kv, 1), loop), (1, kv, DECODE_CHUNK if loop else 0))
    return list(seen.values())


def _precompile_shape(eng, n_tok: int, kv: int, chunk: int, sampling: dict) -> float:
    """Compile one of `_generate_shapes`' steps ahead of its use."""
    return eng.precompile_decode(1, chunk, kv, sampling) if chunk else eng.precompile(1, n_tok, kv)


# ---------------------------------------------------------------------------------------------
# info


def _mla_layout(names: set[str], n_layer: int) -> str:
    has = lambda t: any(f"blk.{i}.{t}.weight" in names for i in range(n_layer))  # noqa: E731
    kvb, kb, vb = has("attn_kv_b"), has("attn_k_b"), has("attn_v_b")
    if kvb and kb and vb:
        return "all three: attn_kv_b + attn_k_b + attn_v_b (ik_llama.cpp converter)"
    if kvb and not (kb or vb):
        return "attn_kv_b only (older converters; attn_k_b/attn_v_b derived from it in the graph)"
    if kb and vb and not kvb:
        return "attn_k_b + attn_v_b only (mainline llama.cpp; attn_kv_b derived from them in the graph)"
    return f"incomplete: attn_kv_b={'yes' if kvb else 'no'} attn_k_b={'yes' if kb else 'no'} attn_v_b={'yes' if vb else 'no'}"


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


@app.command("info", cls=_ExactCommand)
@_handle
def info(
    file: Annotated[Optional[str], typer.Argument(help="GGUF file (any shard of a split model)")] = None,
    model: ModelOpt = None,
    ctx: CtxOpt = _D.ctx,
    batch: BatchOpt = _D.batch,
    ubatch: UbatchOpt = _D.ubatch,
    mla: MlaOpt = _D.mla,
    fa: FaOpt = str(int(_D.fa)),
    amb: AmbOpt = _D.amb,
    ctk: CtkOpt = _D.ctk,
    ctv: CtvOpt = None,
    ot: OtOpt = None,
    cpu_moe: CpuMoeOpt = None,
    n_cpu_moe: NCpuMoeOpt = _D.n_cpu_moe,
    kv_block: KvBlockOpt = _D.kv_block,
    tensors: Annotated[bool, typer.Option("--tensors", help="also list every tensor")] = False,
) -> None:
    """Architecture, hyper-parameters, tensor types and sizes, MLA layout, and the memory plan for the given
    options (-c, -ctk, -mla, -ub, -fa, -ot) — from the header only, instant on any file size."""
    from ikjax.gguf_io.config import ModelConfig
    from ikjax.gguf_io.reader import GGUFModelFile
    _, opts = _check_options(locals(), "info")
    path = file or model
    if path is None or path.startswith("synthetic:"):
        path = resolve_model(path)
    f = GGUFModelFile(path)
    md = f.metadata
    emb = f.tensors.get("token_embd.weight")
    cfg = ModelConfig.from_metadata(md, source=path, vocab_from_tensor=emb.shape[0] if emb else None)
    opts = opts.with_model(cfg.n_expert_used, cfg.n_expert > 0)
    out = typer.echo
    n_params = sum(_prod(t.shape) for t in f.tensors.values())
    size = sum(t.nbytes for t in f.tensors.values())
    out(f"file           {path}" + (f" ({len(f.shards)} shards)" if len(f.shards) > 1 else ""))
    out(f"architecture   {f.architecture}   name: {md.get('general.name', '?')}   "
        f"size label: {md.get('general.size_label', '?')}")
    out(f"parameters     {n_params / 1e9:.3f} B   tensor data {_fmt_bytes(size)} "
        f"({size * 8 / max(n_params, 1):.2f} bits/weight)")
    out("")
    out("hyper-parameters")
    q = f"q_lora_rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "no q_lora (direct attn_q, V2-Lite style)"
    rows = [
        ("layers", f"{cfg.n_layer} ({min(cfg.n_dense_lead, cfg.n_layer)} dense leading)"),
        ("d_model", cfg.d_model), ("heads", cfg.n_head), ("q", q),
        ("kv_lora_rank r", cfg.kv_lora_rank), ("rope / nope / v", f"{cfg.rope_dim} / {cfg.nope_dim} / {cfg.v_dim}"),
        ("latent entry", f"{cfg.latent_dim} values (r + rope)"),
        ("vocab", cfg.vocab_size), ("dense ffn", cfg.ffn_dim),
        ("experts", f"{cfg.n_expert} routed, top-{cfg.n_expert_used}, {cfg.n_expert_shared} shared, ffn {cfg.expert_ffn_dim}"
         if cfg.n_expert else "none (dense)"),
        ("routing", (f"{'sigmoid' if cfg.gating == 2 else 'softmax'}"
                     + (f", {cfg.n_expert_group} groups top-{cfg.n_expert_group_used}" if cfg.n_expert_group > 1 else "")
                     + (", exp_probs_b" if any(n.endswith("exp_probs_b.bias") for n in f.tensors) else "")
                     + (", norm" if cfg.expert_weights_norm else "") + f", scale {cfg.expert_weights_scale:g}")
         if cfg.n_expert else "-"),
        ("rope", f"base {cfg.rope_base:g}" + (f", YaRN factor {cfg.yarn.factor:g} orig ctx {cfg.yarn.original_context} "
                                             f"log-mul {cfg.yarn.log_multiplier:g} (mscale {cfg.yarn.mscale:.4f})"
                                             if cfg.yarn else "")),
        ("softmax scale", f"{cfg.softmax_scale:.6f}"), ("rms eps", f"{cfg.rms_eps:g}"),
        ("context length", cfg.context_length),
        ("tokenizer", f"{md.get('tokenizer.ggml.model', '-')} / {md.get('tokenizer.ggml.pre', '-')}, "
                      f"bos {cfg.bos_token_id} eos {cfg.eos_token_id}"),
    ]
    for k, v in rows:
        out(f"  {k:<16} {v}")
    out("")
    out(f"MLA layout     {_mla_layout(set(f.tensors), cfg.n_layer)}")
    out("")
    by_type: dict[str, list[int]] = {}
    for t in f.tensors.values():
        e = by_type.setdefault(t.type_name, [0, 0, 0])
        e[0] += 1
        e[1] += t.nbytes
        e[2] += _prod(t.shape)
    out(f"{'tensor type':<12} {'count':>6} {'size':>12} {'weights':>14}")
    for name, (cnt, nb, ne) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        out(f"{name:<12} {cnt:>6} {_fmt_bytes(nb):>12} {ne:>14,}")
    out(f"{'total':<12} {len(f.tensors):>6} {_fmt_bytes(size):>12} {n_params:>14,}")
    if tensors:
        out("")
        for t in f.tensors.values():
            out(f"  {t.name:<40} {t.type_name:<8} {str(list(t.shape)):<24} {_fmt_bytes(t.nbytes)}")
    out("")
    plan = plan_memory(cfg, opts, ((t.name, t.nbytes) for t in f.tensors.values()))
    out(f"memory plan (-c {opts.ctx} -ub {opts.ubatch} -mla {opts.mla} -fa {int(opts.fa)} -ctk {opts.ctk}"
        + (f" -amb {opts.amb}" if opts.amb else "") + ")")
    for line in plan.lines():
        out("  " + line)
    total = plan.weights_bytes + plan.kv_bytes + plan.attention_buffer_bytes
    out(f"  total            {total / (1 << 20):10.2f} MiB")


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ---------------------------------------------------------------------------------------------
# make-model


@app.command("make-model", cls=_ExactCommand)
@_handle
def make_model(
    preset: Annotated[str, typer.Option("--preset", help="tiny, v2-lite, v3 or r1")] = "tiny",
    qtype: Annotated[str, typer.Option("--type", help="weight type: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K "
                                       "Q5_K Q6_K IQ4_NL IQ4_XS IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S BF16 F16 F32")] = "Q8_0",
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="GGUF file to write")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="override the layer count")] = None,
    experts: Annotated[Optional[int], typer.Option("--experts", help="override the routed expert count")] = None,
    q_lora_rank: Annotated[Optional[int], typer.Option("--q-lora-rank", help="low-rank q projection of this width "
                                                       "(attn_q_a/attn_q_b, as V3/R1); 0 = direct attn_q")] = None,
    seed: Annotated[int, typer.Option("-s", "--seed")] = 0,
) -> None:
    """Write a synthetic deepseek2 model with real shapes and random quantized weights (streamed to disk)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from ikjax import synthetic
    if output is None:
        raise OptionError("output: give -o FILE.gguf")
    cfg = synthetic.preset_config(preset, layers, experts, q_lora_rank)
    plans = synthetic.plan_tensors(cfg, qtype.upper()) if qtype.upper() in synthetic.SUPPORTED_TYPES else None
    if plans is None:
        raise OptionError(f"type: {qtype!r} is not one of {', '.join(synthetic.SUPPORTED_TYPES)}")
    total = sum(t.nbytes for t in plans)
    free = _free_bytes(Path(output).resolve().parent)
    if free is not None and free < total:
        raise OptionError(f"output: needs {_fmt_bytes(total)} but {Path(output).parent} has {_fmt_bytes(free)} free")
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=_stderr_console(), transient=True) as prog:
        task = prog.add_task(f"{preset} {qtype.upper()}", total=total)
        synthetic.make_model(output, preset, qtype, layers=layers, experts=experts, q_lora_rank=q_lora_rank, seed=seed,
                             progress=lambda name, done, tot: prog.update(task, completed=done))
    typer.echo(f"wrote {output}: {preset}, {cfg['num_hidden_layers']} layers, {qtype.upper()}, "
               f"{_fmt_bytes(total)} in {time.perf_counter() - t0:.1f}s")


def _free_bytes(d: Path) -> int | None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize
    except (OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# run --config

CONFIG_COMMANDS: dict[str, Callable] = {}


@app.command("run", cls=_ExactCommand)
@_handle
def run(
    config: Annotated[str, typer.Option("--config", "-C", help="JSON file: {\"command\": \"sweep-bench\", "
                                        "\"model\": ..., \"ctx\": ..., ...}")],
) -> None:
    """Run a subcommand with every option from a JSON config (keys = option names, e.g. ctx, ubatch, mla, fa, ot)."""
    from ikjax.run_config import parse_config
    name, func, kwargs = parse_config(config, CONFIG_COMMANDS)
    func(**kwargs)


CONFIG_COMMANDS.update({"sweep-bench": sweep_bench, "bench": bench, "generate": generate, "info": info,
                        "make-model": make_model})


def main() -> None:
    app()


if __name__ == "__main__":
    main()
