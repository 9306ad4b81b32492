"""Ctrl-C while the command line starts: one line and status 130, before anything heavy is imported.

`import ikjax` imports JAX (through `ikjax.quant`), and the CLI starts JAX's backend: ~1.5 s in which
Python's KeyboardInterrupt lands wherever the main thread is. Raised inside an import it printed a
traceback; inside JAX's garbage-collection callback it was swallowed ("Exception ignored") and the
command ran on to status 0; during the backend's start the process died of the signal with no line.
So a process started as the CLI (`ikjax ...`, `python -m ikjax.cli ...`) gets this handler from
`ikjax/__init__` until `ikjax.cli` has imported its commands (`restore`), from where the commands'
own handling (`ikjax.cli.common.handle`) gives the same line and status (`check` finds a Ctrl-C that
JAX swallowed). A program that imports
ikjax as a library keeps its own SIGINT handling: nothing is installed there."""
from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


def _interrupted_while_starting(signum, frame) -> None:
    try:
        sys.stderr.write("error: interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_INTERRUPTED)


def is_cli_process(argv0: str | None = None, orig_argv: list[str] | None = None) -> bool:
    """Whether this process runs the command line: the `ikjax` console script, or `python [flags]
    -m ikjax.cli` (while its package imports, runpy has sys.argv[0] = "-m"; orig_argv says which)."""
    argv0 = sys.argv[0] if argv0 is None and sys.argv else (argv0 or "")
    orig = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if os.path.basename(argv0) == "ikjax":
        return True
    return "-m" in orig[:-1] and orig[orig.index("-m") + 1] in ("ikjax.cli", "ikjax.cli.__main__")


def install_for_cli() -> bool:
    """The starting handler, where this is the CLI's main thread and SIGINT is Python's default."""
    if (not is_cli_process() or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return False
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    return True


_requested = threading.Event()  # set by a command's Ctrl-C (`_interrupted_in_command`), read by `check`


def _interrupted_in_command(signum, frame) -> None:
    """A command's Ctrl-C: Python's KeyboardInterrupt, and a flag that outlives it. Why the flag:
    the interrupt lands between two bytecodes of whatever the main thread runs, and inside JAX's
    garbage-collection callback (`_xla_gc_callback`, run at any allocation of a generation loop)
    Python reports it as "Exception ignored" and drops it: the command ran on to the end and
    exited 0. The command's loops (`check`) and `common.handle` after the body find the flag."""
    _requested.set()
    raise KeyboardInterrupt


def request() -> None:
    """Mark an interrupt as asked for (SIGTERM's handler, `ikjax.cli.parser.terminate_on_sigterm`):
    `check` then raises it wherever it was swallowed, and its "Exception ignored" is not printed."""
    _requested.set()


def check() -> None:
    """Raise the KeyboardInterrupt a command's Ctrl-C raised, in case it was swallowed where it
    landed; called once a token / row / chunk by the CLI's loops and after a command's body."""
    if _requested.is_set():
        raise KeyboardInterrupt


def restore() -> None:
    """A command's Ctrl-C handling, where the starting handler is in place (the CLI's process):
    KeyboardInterrupt as Python's own, plus the flag that `check` reads."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, _interrupted_in_command)
        quiet_swallowed()


def quiet_swallowed() -> None:
    """A swallowed Ctrl-C's (or SIGTERM's) "Exception ignored ... Traceback" is not printed: `check`
    ends the command with its one line. Installed once, by `restore` and by the SIGTERM handler's
    setup (a SIGTERM during a load that came before `restore` printed it: a flaky test, stop 69)."""
    if getattr(sys.unraisablehook, "_ikjax_quiet", False):
        return
    previous = sys.unraisablehook

    def quiet_swallowed_interrupt(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _requested.is_set():
            return
        previous(unraisable)
    quiet_swallowed_interrupt._ikjax_quiet = True
    sys.unraisablehook = quiet_swallowed_interrupt
