"""What every `ikjax` subcommand shares: the typer app, error handling, logging, the model.

The commands (one module each) register on `app` and wrap their bodies in `handle`, so an
`IkjaxError` is one line on stderr and exit code 1 on every command alike. Stdout carries only a
command's result (a table, JSONL, generated text); everything else — notes, progress, the memory
plan, timings — goes to stderr through `log`, `Progress` and `stderr_console`. `resolve_model` and
`load_engine` are the one way a command turns `-m` into a loaded engine.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Callable, NoReturn, Optional

import typer

from ikjax import env, interrupt
from ikjax.cli.parser import (EXIT_INTERRUPTED, Group, Terminated, at_end, is_stdout_error, output_error,
                              terminate_on_sigterm, terminated)
from ikjax.errors import IkjaxError, OptionError
from ikjax.options import RunOptions

app = typer.Typer(
    cls=Group, name="ikjax", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="JAX inference for DeepSeek GGUF models (deepseek2) with ik_llama.cpp's flags: "
         "sweep-bench, llama-bench style runs, generation, file info, synthetic models.",
    context_settings={"help_option_names": ["-h", "--help"]})


def err(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)


def _version(value: bool) -> None:
    """`ikjax --version`: what a bug report needs, as ik prints `version: N (commit)` first: the
    package, the JAX it runs on, and the instruction-set level of the C++ CPU kernels."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from ikjax.ops import registry
    from ikjax.version import __version__

    def of(dist: str) -> str:
        try:
            return dist_version(dist)
        except PackageNotFoundError:
            return "not installed"
    isa = registry.cpu_isa()
    try:
        typer.echo(f"ikjax {__version__}\njax {of('jax')}, jaxlib {of('jaxlib')}\nCPU kernels: {isa}")
    except OSError as e:  # as `handle` does for a command (click would turn EPIPE into a silent 1)
        if not is_stdout_error(e):
            raise
        raise typer.Exit(output_error(e)) from None
    raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="print the ikjax, jax and jaxlib versions and the CPU kernels' ISA level")
          ) -> None:
    """The group's own option (--version); every command is a subcommand."""


def handle(func: Callable) -> Callable:
    """Run a command body: IkjaxError -> one line on stderr, exit 1 (no traceback).

    Standard output that cannot be written is a property of the process, not of the command: a
    reader that went away (`| head -1`) ends it the way a Unix tool ends, silently with SIGPIPE's
    status (`parser.EXIT_BROKEN_PIPE`, made a real SIGPIPE death by `parser.Group.__call__`); a full
    or failing device is one line `cannot write output: ...`. Ctrl-C is one line and status 130."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with _sigterm_unwinds():
            return _handled(*args, **kwargs)

    def _handled(*args, **kwargs):
        try:
            _join_processes(func.__name__, kwargs)
            try:
                result = func(*args, **kwargs)
            except typer.Exit as e:
                if not e.exit_code:
                    interrupt.check()  # a Ctrl-C swallowed where it landed is still one (ikjax/interrupt.py)
                raise
            interrupt.check()
            return result
        except typer.Exit as e:
            _end_processes(e.exit_code)
            raise
        except IkjaxError as e:
            err(str(e).splitlines()[0] if str(e) else type(e).__name__)
            _end_processes(1)
            raise typer.Exit(1)
        except KeyboardInterrupt as e:  # (a SIGTERM found by interrupt.check is a plain KeyboardInterrupt)
            err("terminated" if isinstance(e, Terminated) or terminated() else "interrupted")
            _end_processes(EXIT_INTERRUPTED)
            raise typer.Exit(EXIT_INTERRUPTED)
        except OSError as e:
            if not is_stdout_error(e):
                _unexpected(e)
            code = output_error(e)
            _end_processes(code)
            raise typer.Exit(code)
        except Exception as e:  # noqa: BLE001
            if is_interrupt(e):
                err("terminated" if "Terminated" in str(e) else "interrupted")
                _end_processes(EXIT_INTERRUPTED)
                raise typer.Exit(EXIT_INTERRUPTED)
            _unexpected(e)
    return wrapper


@contextlib.contextmanager
def _sigterm_unwinds():
    """SIGTERM during a command unwinds it as Ctrl-C does (`parser.terminate_on_sigterm`): the
    atomic output files it was writing are removed (make-model killed by a job scheduler left its
    `.part` file, 210 MB), `at_end`'s work runs, then the process dies of the signal. Where SIGTERM
    had its default action on the main thread; the default comes back after the command (an
    in-process caller, a test, keeps its own)."""
    import signal
    import threading
    mine = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if mine:
        terminate_on_sigterm()
    try:
        yield
    finally:
        if mine and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def is_interrupt(e: BaseException) -> bool:
    """Ctrl-C that landed inside a host callback of a step (the expert statistics' counting runs
    on the calling thread on a CPU): JAX reports the callback's KeyboardInterrupt as a runtime
    error ("CpuCallback error calling callback: Traceback ... KeyboardInterrupt")."""
    return type(e).__name__ == "JaxRuntimeError" and ("KeyboardInterrupt" in str(e) or "Terminated" in str(e))


def _end_processes(code: int) -> None:
    """A failed process of a several-process run ends at once (`distributed.exit_now`)."""
    if code:
        from ikjax.runtime import distributed
        if distributed.several():  # what `at_end` registered first (the expert statistics counted), as
            from ikjax.cli.parser import run_at_end  # one process's exit runs it (it was skipped)
            run_at_end()
        distributed.exit_now(code, by_sigterm=code == EXIT_INTERRUPTED and terminated())


def _unexpected(e: BaseException) -> NoReturn:
    """Anything else: its type and first line, or the traceback under IKJAX_DEBUG."""
    if env.is_set("IKJAX_DEBUG"):
        raise e
    first = (str(e).splitlines() or [""])[0]
    from ikjax.runtime import distributed
    if distributed.several() and ("Gloo" in first or "GetKeyValue" in first or "DEADLINE_EXCEEDED" in first):
        first += " (another process of this run stopped, failed, or runs another step)"
    err(f"{type(e).__name__}: {first} (set IKJAX_DEBUG=1 for a traceback)")
    _end_processes(1)
    raise typer.Exit(1)


# commands that answer a person or a client in one process: several processes would each listen
# and read, and a request seen by one alone left the others' collectives waiting (a probe, §23w)
_ONE_PROCESS = {"serve": "a server answers its clients from one process",
                "chat": "a chat reads one terminal"}


def _join_processes(command: str, params: dict[str, Any]) -> None:
    """--coordinator/--num-processes/--process-id: join the other processes before any JAX backend
    starts, and check they run the same command; every process but 0 then computes silently (its
    stdout goes nowhere). The collectives' C++ libraries (gloo) print connection lines on file
    descriptor 1: it is pointed at stderr, and Python's stdout keeps the real one, so stdout holds
    only the table."""
    from ikjax.runtime import distributed
    if not distributed.check_args(params.get("coordinator"), params.get("num_processes"), params.get("process_id")):
        return
    if command in _ONE_PROCESS and params["num_processes"] > 1:
        raise OptionError(f"coordinator: {command} runs in one process ({_ONE_PROCESS[command]}); several hosts run "
                          f"sweep-bench, bench, generate and perplexity")
    distributed.initialize(params["coordinator"], params["num_processes"], params["process_id"])
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w") if distributed.is_primary() else open(os.devnull, "w")
    distributed.check_same_command(command, params)


def stderr_console():
    from rich.console import Console
    return Console(stderr=True, highlight=False)


def log(msg: str) -> None:
    typer.echo(msg, err=True)


def setup_logging(verbose: bool) -> None:
    import logging
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def backend() -> str:
    import jax
    return jax.default_backend()


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def resolve_model(spec: Optional[str]) -> str:
    """A path, or the built-in default / a synthetic:PRESET[:TYPE[:LAYERS]] model (made once, cached)."""
    from ikjax.tools import synthetic
    if spec is not None and not spec.strip():  # (an empty -m once loaded the default model quietly)
        raise OptionError("model: empty path (give -m FILE.gguf, or leave -m out for the built-in default)")
    if spec and not spec.startswith("synthetic:"):
        return os.path.expanduser(spec)
    parts = (spec or "synthetic:tiny").split(":")[1:]
    if not parts or not parts[0]:
        raise OptionError(f"model: no preset in {spec!r} (synthetic:PRESET[:TYPE[:LAYERS]], e.g. synthetic:tiny)")
    if len(parts) > 3 or (len(parts) > 1 and not parts[-1]):  # a field more, or a trailing ':' (were ignored)
        raise OptionError(f"model: {spec!r} is not synthetic:PRESET[:TYPE[:LAYERS]] (e.g. synthetic:tiny:Q4_0:8)")
    preset = parts[0]
    qtype = (parts[1] if len(parts) > 1 and parts[1] else "Q8_0").upper()
    layers = None
    if len(parts) > 2 and parts[2]:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise OptionError(f"model: bad layer count {parts[2]!r} in {spec!r} (synthetic:PRESET[:TYPE[:LAYERS]], "
                              f"LAYERS >= 1)")
        layers = int(parts[2])
    if preset not in synthetic.PRESETS:
        raise OptionError(f"model: unknown preset {preset!r} in {spec!r} (one of {', '.join(synthetic.PRESETS)})")
    if qtype not in synthetic.SUPPORTED_TYPES:  # before the "making ..." line
        raise OptionError(f"model: type {qtype!r} in {spec!r} is not one of {', '.join(synthetic.SUPPORTED_TYPES)}")
    synthetic.preset_config(preset, layers)  # the layer count's bound, before anything is planned
    path = synthetic.default_model_path().with_name(
        f"{preset}-{qtype}{f'-{layers}L' if layers else ''}-g{synthetic.GENERATOR}.gguf")
    if not path.exists():
        log(f"making synthetic model {preset} {qtype} -> {path} (first use)")
        note_long_make(_synthetic_size(preset, qtype, layers) or 0,
                       f"; made once, before the run starts, then reused from {path.parent}")
        t0 = time.perf_counter()
        synthetic.make_model(path, preset, qtype, layers=layers)
        log(f"made in {time.perf_counter() - t0:.1f}s")
    return str(path)


# a synthetic model at least this large gets a note before it is made (v2-lite and r1 are 8 GB)
LONG_MAKE_BYTES = 1 << 30


def note_long_make(nbytes: int, tail: str = "") -> None:
    """The note before a synthetic model of `nbytes` (at least LONG_MAKE_BYTES) is written."""
    if nbytes >= LONG_MAKE_BYTES:
        log(f"note: {fmt_bytes(nbytes)} of random weights to write: a minute or so (v2-lite Q4_0's 8.3 GiB: "
            f"40 s on a 2-core EPYC)" + tail)


def _synthetic_size(preset: str, qtype: str, layers: int | None) -> int | None:
    """Bytes the synthetic model will take (None for a type make_model will refuse by name)."""
    from ikjax.tools import synthetic
    if qtype not in synthetic.SUPPORTED_TYPES:
        return None
    cfg = synthetic.preset_config(preset, layers, None, None)
    return sum(t.nbytes for t in synthetic.plan_tensors(cfg, qtype))


# llama-cli's sampling flags, shared by `generate` and `chat` (`serve` words its help as defaults)
Temp = Annotated[float, typer.Option("--temp", "--temperature", help="temperature (0 or less = greedy, as llama-cli)")]
TopK = Annotated[int, typer.Option("--top-k", help="top-k sampling (0 = off)")]
TopP = Annotated[float, typer.Option("--top-p", help="top-p sampling (1 or more = off, as llama-cli)")]
MinP = Annotated[float, typer.Option("--min-p", help="min-p sampling (0 = off)")]
Seed = Annotated[Optional[int], typer.Option("-s", "--seed", help="RNG seed")]
Escape = Annotated[bool, typer.Option("--escape/--no-escape", "-e", help="process escapes (\\n, \\t, \\', \\\", "
                                     "\\\\, ...) in the given texts (-p, -f, -sys, -r; not typed lines), as llama-cli "
                                     "(default on)")]


_TOP_P_ONE = 1e-9  # a nucleus no larger than the most likely token
_RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's LLAMA_DEFAULT_SEED, and -1: a random seed


def ik_sampling(temp: float, top_k: int, top_p: float) -> tuple[float, int, float]:
    """llama-cli's readings of its sampling flags: a temperature of 0 or less is greedy, a top-k of
    0 or less is off, a top-p of 1 or more is off, one of 0 or less keeps the most likely token
    only (llama.cpp's min_keep = 1) (values the Python API, which keeps OpenAI's ranges, refuses).
    NaN stays for the checks."""
    return max(temp, 0.0), max(top_k, 0), (min(top_p, 1.0) if not top_p <= 0 else _TOP_P_ONE)


def ik_seed(seed: Optional[int]) -> tuple[int, bool]:
    """llama-cli's -s: a 32-bit seed, or -1 / 4294967295 / none for a random one, drawn here.
    Returns (seed, drawn): a drawn seed is for the command to print once the model has loaded
    (`announce_seed`: llama-cli's "sampler seed: N"), so that a run can be repeated with -s N."""
    if seed is None or seed in _RANDOM_SEEDS:
        import secrets
        from ikjax.runtime import distributed
        # several processes sample the same tokens only from one seed: process 0's
        return distributed.same_on_all(secrets.randbits(32) & 0x7FFFFFFF), True
    if not 0 <= seed < 0xFFFFFFFF:
        raise OptionError(f"seed: expected -1 (random) or 0..{0xFFFFFFFF - 1}, got {seed}")
    return seed, False


def announce_seed(seed: int, drawn: bool) -> None:
    if drawn:
        log(f"sampler seed: {seed}")


# llama-cli's penalty flags (sampling.check_penalty's rules), shared by `generate` and `chat`
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="penalize repeated tokens (1 = off)")]
RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", help="tokens the penalties look back over "
                                          "(0 = off, -1 = the context)")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="penalize tokens already in the "
                                                "window, once (0 = off)")]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty", help="penalize tokens by how often they "
                                                 "are in the window (0 = off)")]
PenalizeNl = Annotated[bool, typer.Option("--penalize-nl", help="the penalties count the newline token too "
                                          "(default: left alone, as llama-cli)")]


def load_engine(model: Optional[str], verbose: bool = False, while_loading: Optional[Callable] = None,
                plan_batch: int = 1, **opts: Any):
    """Load `-m` (after `resolve_model`) with these run options; the memory plan goes to stderr
    (for `plan_batch` sequences: serve's -np slots, whose KV cache the plan of one left out).
    `while_loading(engine)`: the command's first compiles, run while the weights still stream in
    where the engine loads them in a thread (Engine._overlaps_load), before the memory plan."""
    from ikjax.runtime.engine import (
        load,  # the runtime (and JAX's backend) only when a command runs
    )
    setup_logging(verbose)
    # --expert-stats FILE.json: the engine counts, and the file is written when the command ends
    stats_file = opts.pop("expert_stats", None)
    if isinstance(stats_file, str):
        check_stats_target(stats_file)
        opts["expert_stats"] = True
    # validate the options before (possibly) making the default model
    RunOptions.from_kwargs(**opts)
    path = resolve_model(model)
    if model is None:  # (ik's tools need -m; here the built-in default runs, which a forgotten -m should not hide)
        log("note: no -m given: the built-in synthetic model (random weights: its text is not language)")
    t0 = time.perf_counter()
    eng = load(path, **opts)
    if not eng.load_overlapped:
        log(f"loaded {path} in {time.perf_counter() - t0:.2f}s")
    if while_loading is not None:
        try:
            while_loading(eng)
        except BaseException:
            eng.cancel_load()  # the command's error (or Ctrl-C) now, the load stopped at its next layer
            raise
    eng.wait_loaded()
    if eng.load_overlapped:
        log(f"loaded {path} in {eng.loaded_at - t0:.2f}s, in a thread beside the compile")
    if isinstance(stats_file, str):
        at_end(functools.partial(_save_expert_stats, eng, stats_file))  # (SIGTERM too: `handle`)
    log("memory plan:" if plan_batch == 1 else f"memory plan ({plan_batch} sequences):")
    for line in eng.memory_plan(plan_batch).lines():
        log("  " + line)
    if eng.gpu_experts_note:
        log(eng.gpu_experts_note)
    return eng


def template_choice(chat_template: Optional[str], chat_template_file: Optional[str]) -> Optional[str]:
    """--chat-template NAME|FILE or --chat-template-file FILE (one of them) as the choice
    `ikjax.chat_template` reads: the file flag always names a file, given by its absolute path (a
    file `./chatml` given as `--chat-template-file chatml` was read as the builtin chatml)."""
    if chat_template_file is None:
        return chat_template
    if chat_template:
        raise OptionError("--chat-template and --chat-template-file: give one of them")
    path = Path(os.path.expanduser(chat_template_file))
    if not path.is_file():
        raise OptionError(f"--chat-template-file {chat_template_file}: "
                          + ("not a file" if path.exists() else "no such file"))
    return str(path.absolute())


def check_stats_target(path: str) -> None:
    """--expert-stats FILE: refused now, before anything loads, if it cannot be written or would
    replace a file that is not an earlier run's statistics."""
    from ikjax.atomic_file import check_target
    from ikjax.model.moe import refuse_overwrite
    check_target(path, 0, "expert-stats", parent_exists=True)
    refuse_overwrite(path)


_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
_HEX = b"0123456789abcdefABCDEF"


def _strtol16_2(x: bytes) -> int | None:
    """C's strtol(x, &end, 16) on two bytes, where it reads both (ik's test, `end == x + 2`): two
    hex digits, or one after a space or a sign. None where it stops short."""
    if len(x) != 2 or x[1] not in _HEX:
        return None
    if x[0] in _HEX:
        return int(x, 16)
    if x[0] in b" \t\n\v\f\r+":
        return int(x[1:], 16)
    return -int(x[1:], 16) if x[0] == ord("-") else None


def process_escapes(text: str) -> str:
    """llama-cli's -e, on by default there, byte for byte as ik's string_process_escapes: \\n \\r
    \\t \\' \\" \\\\ and \\xHH (any byte, both digits there) become what they
    name; any other backslash stays as written (LaTeX's \\frac, C:\\build). Why: the same
    `-p "User: hi\\nAssistant:"` must feed the same tokens here as in ik. Bytes that are not UTF-8
    (`\\xff`, or given so on the command line) come back as PEP 383's lone surrogates, which the
    prompt's check (`tokenizer.check_text`) names in one line: the tokenizer takes text."""
    try:
        src = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte stands for: left for the prompt's check to name
        return text
    out, i, n = bytearray(), 0, len(src)
    while i < n:
        c = src[i]
        if c == 0x5C and i + 1 < n:  # a backslash with something after it
            e = src[i + 1]
            if e in _ESCAPES:
                out += _ESCAPES[e]
                i += 2
                continue
            if e == ord("x") and i + 3 < n:
                v = _strtol16_2(src[i + 2:i + 4])
                if v is not None:
                    out.append(v & 0xFF)  # (char(val))
                    i += 4
                    continue
            out += src[i:i + 2]
            i += 2
            continue
        out.append(c)
        i += 1
    return out.decode("utf-8", "surrogateescape")


def read_prompt_file(path: str) -> str:
    """A -f prompt as llama-cli reads it: the file whole, one trailing newline dropped."""
    text = read_text_file(path)
    return text[:-1] if text.endswith("\n") else text


def read_text_file(path: str) -> str:
    """A -f file's text, whole: UTF-8, or one line naming the file (generate, chat, perplexity)."""
    try:
        data = Path(os.path.expanduser(path)).read_bytes()
    except OSError as e:
        raise OptionError(f"file {path}: cannot read it ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OptionError(f"file {path}: not UTF-8 text (byte {e.start})") from None


def _save_expert_stats(eng, path: str) -> None:
    """At the end of the command (also after Ctrl-C or SIGTERM): what the engine counted, to
    `path`; where --gpu-experts read `path` first, its counts plus this run's (a profile that grows
    run by run, never replaced by one short run's). A run that fed no token leaves an existing
    file as it is (an earlier profile is not wiped by `-n 0`)."""
    save_stats(path, eng.expert_stats(), merge=eng.options.expert_counts == path)


def save_stats(path: str, st: dict, *, merge: bool) -> None:
    """`_save_expert_stats`' rule for any run's statistics `st` (bench sums its engines')."""
    from ikjax.model.moe import add_stats
    from ikjax.runtime import distributed
    from ikjax.runtime.engine import write_expert_stats
    if not distributed.is_primary():  # process 0 counts and writes (the others wrote all-zero files)
        return
    if st["tokens"] == 0 and os.path.isfile(os.path.expanduser(path)):
        log(f"expert stats: no token counted; {path} kept as it was")
        return
    if merge:
        import json
        try:
            st = add_stats({"tokens": st["tokens"], "layers": dict(st["layers"])}, json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, AttributeError, KeyError):
            pass  # --gpu-experts checked the file when the run started; a file changed since is replaced
    try:
        write_expert_stats(path, st)
    except (OptionError, OSError) as e:  # (at exit: one line and a failing status, not a traceback)
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    log(f"expert stats: {st['tokens']} tokens over {len(st['layers'])} MoE layers -> {path}")


def setup_compile_cache(spec: Optional[str]) -> None:
    """--compile-cache (or $IKJAX_COMPILE_CACHE): set before the first compile (ikjax.runtime.compile_cache)."""
    from ikjax.runtime import compile_cache
    compile_cache.setup(spec)


def compiled_line(eng, count0: int, hits0: int, seconds: float) -> str:
    """What compiling cost: steps compiled, steps loaded from the persistent cache, and where it is."""
    from ikjax.runtime import compile_cache
    n, hits = eng.compile_count - count0, eng.compile_cache_hits - hits0
    if compile_cache.directory() is None:
        return f"compiled {n} steps in {seconds:.2f}s (compilation cache off; not in the timings)"
    return (f"compiled {n - hits} steps, {hits} from the cache in {seconds:.2f}s "
            f"({compile_cache.describe()}; not in the timings)")


class Progress:
    """A rich progress bar on stderr that never shares a line with what goes to stdout.

    On a terminal the bar is taken off the screen before each stdout line and drawn again after it;
    `log` prints a line above the bar. When stderr is not a terminal no bar is drawn and `status`
    lines are printed as plain lines, so a log file still shows what the run is doing."""

    def __init__(self, title: str, total: int, *, eta: bool = False):
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        self.console = stderr_console()
        self.terminal = self.console.is_terminal
        cols = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn()] + ([TimeRemainingColumn()] if eta else [])
        self.prog = Progress(*cols, console=self.console, transient=True, redirect_stdout=False,
                             redirect_stderr=False)
        self.task = self.prog.add_task(title, total=total)

    def __enter__(self) -> "Progress":
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


def batch_invariance(flag: bool | None, *, default: bool) -> bool:
    """A command's decode form (--batch-invariant / --no-batch-invariant), set before anything is
    traced: the flag, else IKJAX_BATCH_INVARIANT if the user set it, else `default` (on for
    `serve`, off for the one-sequence commands). Why on by default only there: a server batches
    requests, and a request's greedy answer must not depend on who it was batched with (a
    last-bit difference flips a near-tie some tokens later: RESULTS §23c); alone, a sequence has no
    batch to differ from and keeps the ~8 % faster kernels. `generate --batch-invariant` gives the
    server's answer bit for bit. The variable, not a private flag, carries it: the stored compiled
    steps are keyed on the IKJAX_* variables (ikjax.runtime.compile_cache), so a step compiled in
    one form is never loaded for the other."""
    from ikjax import env
    if flag is None:
        flag = env.choice("IKJAX_BATCH_INVARIANT") == "1" if env.is_set("IKJAX_BATCH_INVARIANT") else default
    env.set_choice("IKJAX_BATCH_INVARIANT", "1" if flag else "0")
    return flag
