"""ik_llama.cpp's flag grammar on click: exact option names, bare switches, one-line usage errors.

ik's short flags are words (`-mg`, `-ctv`, `-tb`), which click would read as clustered one-letter
options (`-m g`, `-c tv`); its switches may be given bare (`-fa` means `-fa 1`). `ExactCommand`
is the click command class every `ikjax` subcommand uses for both, and `Group` turns every usage
error into one line on stderr with exit code 1. `Group.__call__` is the process's entry (the
console script and `python -m ikjax.cli` call it; tests call `main`): it owns what only a whole
process may do — the exit on Ctrl-C, on a closed or broken standard output, and the last flush.
Nothing here knows about any particular command.
"""
from __future__ import annotations

import errno
import io
import os
import re
import signal
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from ikjax import interrupt
from ikjax.options import BARE_PARAMS

try:  # typer >= 0.24 carries its own click
    from typer._click.exceptions import ClickException as _ClickException
except ImportError:  # pragma: no cover
    from click import ClickException as _ClickException
try:
    import click as _click
    _CLICK_ERRORS: tuple = (_ClickException, _click.ClickException)
except ImportError:  # pragma: no cover
    _CLICK_ERRORS = (_ClickException,)

try:  # typer >= 0.24 carries its own click
    from typer._click.exceptions import NoSuchOption as _NoSuchOption
    from typer._click.exceptions import UsageError as _UsageError
    from typer._click.parser import _normalize_opt, _OptionParser
except ImportError:  # pragma: no cover
    from click.exceptions import NoSuchOption as _NoSuchOption
    from click.exceptions import UsageError as _UsageError
    from click.parser import _normalize_opt
    from click.parser import OptionParser as _OptionParser

_FLAG_VALUE = re.compile(r"(?i)^(0|1|on|off|true|false|yes|no|auto)(,(0|1|on|off|true|false|yes|no|auto))*$")
# ik's switches that may be given bare (`-fa`, `-rtr`) on the commands that take them; `_rewrite`'s default
_BARE_FLAGS = {"-fa", "--fa", "--flash-attn", "-fmoe", "--fmoe", "--fused-moe"}


def _rewrite(args: list[str], bare: set[str] | frozenset[str] = frozenset(_BARE_FLAGS),
             has_positional: bool = False, valued: set[str] | frozenset[str] = frozenset(),
             options: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """ik's bare switches: `-fa` alone means `-fa 1`; `auto` means on.

    A bare switch followed by another option (or nothing) gets the value 1. Followed by a word that
    is not 0/1/on/off/auto, it is refused naming the switch (`-fa 2`), unless the command takes a
    positional argument (`ikjax info -fa model.gguf`), where the word is that argument.
    `valued`: the command's options that take a value; the word after one is its value, as is,
    and an option name of the command there (`options`) is refused: `-op -muge` lacks -op's value
    (it was read as `-op '-muge'` and a stray `1`).
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
        if a in valued and a not in bare:
            if i < len(args):
                if args[i] in options:
                    raise _UsageError(f"{a}: needs a value, got the option {args[i]}")
                out.append(args[i])
                i += 1
            continue
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
            raise _NoSuchOption(name, message=unknown_option_message(name, close), ctx=self.ctx)
        super()._process_opts(arg, state)


def unknown_option_message(name: str, close) -> str:
    """The one wording of an unknown option, whichever parser found it (ik's "unknown option"; click
    would say "No such option: ... (Possible options: ...)" for long ones)."""
    close = sorted(close or ())
    return f"unknown option {name}" + (f" (did you mean {', '.join(close)}?)" if close else "")


_GIVEN: list = [frozenset(), frozenset(), frozenset()]  # the last parsed command's parameters, those given, twice


def given_options() -> tuple[frozenset, frozenset]:
    """(the parameter names of the command parsed last, those of them its command line gave): an
    option given on the line, as against its default (`-fa 1` and the default "1" look alike)."""
    return _GIVEN[0], _GIVEN[1]


def repeated_options() -> frozenset:
    """The parameters the last parsed command line gave more than once (a single-valued option's
    last value is the one typer keeps, as ik's own parser does)."""
    return _GIVEN[2]


class ExactCommand(TyperCommand):
    """A command whose options are matched exactly (ik's flags) and whose bare switches get 1."""

    def make_parser(self, ctx) -> _OptionParser:
        parser = _ExactParser(ctx)
        for param in self.get_params(ctx):
            param.add_to_parser(parser, ctx)
        return parser

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args = self.prepare(list(args))
        flags = {o: p.name for p in self.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}
        given = [flags[a.split("=", 1)[0]] for a in args if isinstance(a, str) and a.split("=", 1)[0] in flags]
        _GIVEN[:] = [frozenset(p.name for p in self.params), frozenset(given),
                     frozenset(n for n in given if given.count(n) > 1)]
        return super().parse_args(ctx, args)

    def prepare(self, args: list[str]) -> list[str]:
        """The command line as the parser reads it: a bare switch given its 1."""
        bare = {o for p in self.params if p.name in BARE_PARAMS for o in (*p.opts, *p.secondary_opts)}
        has_positional = any(p.param_type_name == "argument" for p in self.params)
        opts = [p for p in self.params if p.param_type_name == "option"]
        options = {o for p in opts for o in (*p.opts, *p.secondary_opts)}
        valued = {o for p in opts if not p.is_flag and not p.count and p.nargs == 1 for o in p.opts}
        return _rewrite(args, bare, has_positional, valued, options)


class ListCommand(ExactCommand):
    """llama-bench's command line: a swept option given several times adds its values to one list
    (`-p 16 -p 32` is `-p 16,32`; `-ot A -ot B` one rule list `A,B`), as llama-bench reads "the
    parameter specified multiple times". Before, the last value won silently. `LIST_JOIN`: the
    parameters so read and how their occurrences join."""

    LIST_JOIN: dict[str, str] = {}

    def prepare(self, args: list[str]) -> list[str]:
        args = super().prepare(args)
        flag_of = {o: p.name for p in self.params if p.name in self.LIST_JOIN for o in (*p.opts, *p.secondary_opts)}
        values: dict[str, list[str]] = {}
        out: list = []
        i = 0
        while i < len(args):
            a = args[i]
            name, value, step = None, None, 1
            if a == "--":
                out.extend(args[i:])
                break
            if a in flag_of and i + 1 < len(args):
                name, value, step = flag_of[a], args[i + 1], 2
            elif "=" in a and a.split("=", 1)[0] in flag_of:
                name, value = flag_of[a.split("=", 1)[0]], a.split("=", 1)[1]
            if name is None:
                out.append(a)
            else:
                if name not in values:
                    values[name] = []
                    out.append((a.split("=", 1)[0], name))  # the first occurrence's place
                values[name].append(value)
            i += step
        merged: list[str] = []
        for a in out:
            if isinstance(a, tuple):
                merged += [a[0], self.LIST_JOIN[a[1]].join(values[a[1]])]
            else:
                merged.append(a)
        return merged


# Exit statuses the command wrapper (`common.handle`) hands to the process entry (`Group.__call__`).
EXIT_INTERRUPTED = interrupt.EXIT_INTERRUPTED  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141; the process entry turns it into a real SIGPIPE death


class _Stdout(io.TextIOWrapper):
    """sys.stdout as the process entry installs it: the same text stream, whose write and flush
    errors carry `ikjax_stdout = True`. An OSError from anywhere else (a model file, the
    compilation cache) is not mistaken for a broken pipe or a full disk on the output."""

    def write(self, s):
        try:
            return super().write(s)
        except OSError as e:
            e.ikjax_stdout = True
            raise

    def flush(self):
        try:
            return super().flush()
        except OSError as e:
            e.ikjax_stdout = True
            raise


def _install_stdout() -> None:
    out = sys.stdout
    if type(out) is not io.TextIOWrapper:  # already replaced (a test harness, an embedding program)
        return
    out.flush()
    sys.stdout = _Stdout(out.detach(), encoding=out.encoding, errors=out.errors,
                         line_buffering=out.line_buffering)


def is_stdout_error(e: BaseException) -> bool:
    """Whether `e` came from writing standard output (see `_Stdout`)."""
    return isinstance(e, OSError) and getattr(e, "ikjax_stdout", False)


def output_error(e: OSError) -> int:
    """The exit status for an error writing standard output, after its one line: a reader that went
    away is EXIT_BROKEN_PIPE and no line (a Unix tool dies of SIGPIPE silently); anything else
    (a full disk: `> /dev/full`) is `error: cannot write output: ...` and 1. Stdout then points at
    /dev/null, so the interpreter's last flush cannot fail again."""
    _quiet_stdout()
    if e.errno == errno.EPIPE:
        return EXIT_BROKEN_PIPE
    typer.echo(f"error: cannot write output: {e.strerror or e}", err=True)
    return 1


def _quiet_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so the interpreter's last flush of what a broken stdout
    still buffers writes nowhere instead of printing "Exception ignored ... BrokenPipeError"."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def _die_of_sigpipe() -> None:
    """End as a C program (ik's tools, `yes`, `cat`) ends when its reader is gone: killed by SIGPIPE,
    silently, which the shell reports as 141 and `set -o pipefail` sees. Python ignores SIGPIPE
    and raises BrokenPipeError instead; the default action is restored for this one signal."""
    _quiet_stdout()
    _flush_std()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(EXIT_BROKEN_PIPE)  # not reached


_AT_END: list = []  # what `at_end` registered, not yet run


def at_end(fn) -> None:
    """Run `fn()` once when the command ends, however it ends: at the interpreter's exit (atexit),
    and at Ctrl-C's or SIGTERM's exit, which leaves by os._exit and skips atexit (`_interrupted_exit`,
    `terminate_on_sigterm`). Why: --expert-stats' file is what the run counted; written only at
    atexit, a sweep or a generation stopped by Ctrl-C lost all of it (a probe, RESULTS §24l)."""
    import atexit
    _AT_END.append(fn)
    atexit.register(_run_one, fn)


def _run_one(fn) -> None:
    if fn in _AT_END:
        _AT_END.remove(fn)
        fn()


def run_at_end() -> None:
    """Every `at_end` function not run yet, in the order registered; one that fails is skipped
    (its own message printed)."""
    for fn in list(_AT_END):
        try:
            _run_one(fn)
        except Exception:  # noqa: BLE001 - the exit goes on: a failed save says so itself
            pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is (`terminate_on_sigterm`):
    the command unwinds by the interrupt's path, and the process then dies of the signal."""


_TERMINATED: list = []  # set once SIGTERM arrived (`_interrupted_exit` then dies of it)


def terminated() -> bool:
    """Whether SIGTERM arrived (its interrupt may have been swallowed and found by interrupt.check)."""
    return bool(_TERMINATED)


def terminate_on_sigterm() -> None:
    """SIGTERM (a `kill`, a job scheduler's stop) where it would end the process at once: raised as
    `Terminated` where the main thread is, so the command leaves by Ctrl-C's path (`at_end`'s
    functions run there, outside any step), then the process dies of the signal (status 143, as
    any tool). Why not the work in the handler itself: a handler runs between two bytecodes of
    the main thread, which may be inside a step's host callback (the expert counting), whose step
    the statistics' read then waited for: a deadlock. Only where SIGTERM still has its default
    action (a server installs its own)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        _TERMINATED.append(True)
        # flagged as Ctrl-C is: raised inside JAX's gc callback it was swallowed ("Exception ignored"
        # and its traceback), and `serve` came up and served on (an outside probe, stop 68)
        interrupt.request()
        raise Terminated()
    interrupt.quiet_swallowed()
    signal.signal(signal.SIGTERM, on_term)


def _interrupted_exit() -> None:
    """After Ctrl-C's one line: leave at once. XLA may still be compiling on its own threads (and
    sweep-bench compiles a row's steps on a thread pool); letting the interpreter finalize under
    them ended in SIGSEGV (exit 139) every time Ctrl-C came during compilation. What `at_end`
    registered runs first (the counted expert statistics); other output files are atomic (removed
    on the interrupt), stdout/stderr are flushed here."""
    run_at_end()
    _flush_std()
    if _TERMINATED:  # SIGTERM's path: the death by the signal it asked for
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(EXIT_INTERRUPTED)


class Group(TyperGroup):
    """Every usage error as one line on stderr with exit code 1."""

    def __call__(self, *args, **kwargs):
        """The process entry: run `main`, then end the process as a Unix tool would.

        A closed file descriptor 1 (`ikjax ... >&-`) is refused before anything runs (every
        command's result goes to stdout, and fd 1 would be reused by the next file opened). At the
        end stdout is flushed here, where its errors can still be reported: a full disk or a failed
        device is `error: cannot write output: ...` and status 1, a reader that went away is a
        SIGPIPE death. Ctrl-C (status 130 from `common.handle`, or an interrupt outside it) exits
        without finalizing the interpreter (`_interrupted_exit`)."""
        if sys.stdout is None:
            typer.echo("error: cannot write output: standard output is closed", err=True)
            _flush_std()
            os._exit(1)
        _install_stdout()
        try:
            self.main(*args, **kwargs)
            code: object = 0
        except SystemExit as e:
            code = e.code
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            code = EXIT_INTERRUPTED
        except OSError as e:  # outside a command's `handle` (--version, --help)
            if not is_stdout_error(e):
                raise
            code = output_error(e)
        if code == EXIT_INTERRUPTED:
            _interrupted_exit()
        if code != EXIT_BROKEN_PIPE:
            try:
                sys.stdout.flush()
            except OSError as e:
                code = output_error(e) if code in (0, None) or code == EXIT_BROKEN_PIPE else code
        if code == EXIT_BROKEN_PIPE:
            _die_of_sigpipe()
        sys.exit(code)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except _CLICK_ERRORS as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `ikjax` alone: the help was printed
                sys.exit(0)
            if type(e).__name__ == "NoSuchOption" and getattr(e, "option_name", None):
                import difflib  # click offers anything 60% alike (`--mlock`: --ctk, --kv-block, --mla)
                close = difflib.get_close_matches(e.option_name, list(getattr(e, "possibilities", None) or ()),
                                                  n=3, cutoff=0.75)
                msg = unknown_option_message(e.option_name, close)
            else:
                msg = e.format_message()
            typer.echo(f"error: {msg}".splitlines()[0], err=True)
            sys.exit(1)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)
