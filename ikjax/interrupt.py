"""Ctrl-C while the command line starts: one line and status 130, before anything heavy is imported.

`import ikjax` imports JAX (through `ikjax.quant`), and the CLI starts JAX's backend: ~1.5 s in which
Python's KeyboardInterrupt lands wherever the main thread is. Raised inside an import it printed a
traceback; inside JAX's garbage-collection callback it was swallowed ("Exception ignored") and the
command ran on to status 0; during the backend's start the process died of the signal with no line.
So a process started as the CLI (`ikjax ...`, `python -m ikjax.cli ...`) gets this handler from
`ikjax/__init__` until `ikjax.cli` has imported its commands (`restore`), from where the commands'
own handling (`ikjax.cli.common.handle`) gives the same line and status. A program that imports
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


def restore() -> None:
    """Python's KeyboardInterrupt again, where the starting handler is in place."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
