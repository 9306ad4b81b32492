"""Start JAX's backend on a thread as the command line starts (issue 22's start-up).

The first `jax.devices()` creates the backend: on a GPU host 1.6-1.8 s, most of it in CUDA's and
the PJRT client's C++ with the GIL released (bench/gpu_load_probe.py: a Python loop beside it
kept 64 % of its pace). A command used to pay it after its imports, its flag parsing and the
GGUF's metadata; begun on a thread as soon as the `ikjax` package has imported JAX
(`ikjax/__init__`, before gguf, the package's modules and the command's), it runs beside them, and the main thread's first `jax.devices()` waits on JAX's own
backend lock for what is left. Started from the package, not from `ikjax.cli`, it begins about
0.25 s sooner on a CPU's timeline (gguf's and the package's imports come after JAX's).

Only when this process is the command line: the `ikjax` console script, or `python -m ikjax.cli`
(Python's `sys.argv[0]` is `-m` while it imports the module's packages), never a script or a
test that imports ikjax.

Only for the commands that run a model (never `info`, `make-model`, `plot`, or `run`, whose
config may name a coordinator), and never with `--coordinator`: `jax.distributed.initialize`
must come before any backend. `IKJAX_EARLY_BACKEND=0` turns it off."""
from __future__ import annotations

import atexit
import os
import sys
import threading

from ikjax import env
from ikjax.errors import OptionError

COMMANDS = frozenset({"sweep-bench", "bench", "generate", "chat", "perplexity", "serve"})
_thread: threading.Thread | None = None
began_after_gguf = False  # whether gguf was already imported when the thread began (tests: it is not)


def _start(jax) -> None:
    try:
        jax.devices()
    except Exception:  # noqa: BLE001 - the command's own first use reports it, as one line
        pass


def wanted(args: list[str]) -> bool:
    """Whether the command line `args` (sys.argv[1:]) runs a model on this process's own backend."""
    try:
        off = env.choice("IKJAX_EARLY_BACKEND") == "0"
    except OptionError:  # a bad value: no early start; the command refuses it in one line (env.check_all)
        return False
    if off or not args or args[0] not in COMMANDS:
        return False
    return not any(a == "--coordinator" or a.startswith("--coordinator=") or a in ("-h", "--help") for a in args)


def is_cli(argv: list[str]) -> bool:
    """Whether `argv` (sys.argv as the package starts importing) is the command line's process."""
    return bool(argv) and (argv[0] == "-m" or os.path.basename(argv[0]) == "ikjax")


def start_for_cli() -> bool:
    """`start(sys.argv[1:])` when this process is the command line (`is_cli`)."""
    return is_cli(sys.argv) and start(sys.argv[1:])


def start(args: list[str]) -> bool:
    """Begin the backend's start on a daemon thread when `wanted(args)`; whether it did."""
    global _thread, began_after_gguf
    if _thread is not None or not wanted(args):
        return False
    began_after_gguf = "gguf" in sys.modules
    # JAX is imported here, on the calling thread: two threads importing NumPy's C extension at
    # once break it ("partially initialized module numpy._core._multiarray_umath")
    import jax
    _thread = threading.Thread(target=_start, args=(jax,), name="ikjax-backend-start", daemon=True)
    _thread.start()
    atexit.register(join, 10.0)
    return True


def join(timeout: float | None = None) -> None:
    """Wait for the thread (at exit: a command that failed early leaves no thread inside CUDA's
    initialisation while the interpreter shuts down)."""
    if _thread is not None:
        _thread.join(timeout)
