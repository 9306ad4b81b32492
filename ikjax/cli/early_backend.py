"""Start JAX's backend on a thread as the command line starts (issue 22's start-up).

The first `jax.devices()` creates the backend: on a GPU host 1.6-1.8 s, most of it in CUDA's and
the PJRT client's C++ with the GIL released (bench/gpu_load_probe.py: a Python loop beside it
kept 64 % of its pace). A command used to pay it after its imports, its flag parsing and the
GGUF's metadata; begun on a thread as `ikjax.cli` is imported, it runs beside them, and the
main thread's first `jax.devices()` waits on JAX's own backend lock for what is left.

Only for the commands that run a model (never `info`, `make-model`, `plot`, or `run`, whose
config may name a coordinator), and never with `--coordinator`: `jax.distributed.initialize`
must come before any backend. `IKJAX_EARLY_BACKEND=0` turns it off."""
from __future__ import annotations

import threading

from ikjax import env

COMMANDS = frozenset({"sweep-bench", "bench", "generate", "chat", "perplexity", "serve"})
_thread: threading.Thread | None = None


def _start() -> None:
    try:
        import jax
        jax.devices()
    except Exception:  # noqa: BLE001 - the command's own first use reports it, as one line
        pass


def wanted(args: list[str]) -> bool:
    """Whether the command line `args` (sys.argv[1:]) runs a model on this process's own backend."""
    if env.choice("IKJAX_EARLY_BACKEND") == "0" or not args or args[0] not in COMMANDS:
        return False
    return not any(a == "--coordinator" or a.startswith("--coordinator=") or a in ("-h", "--help") for a in args)


def start(args: list[str]) -> bool:
    """Begin the backend's start on a daemon thread when `wanted(args)`; whether it did."""
    global _thread
    if _thread is not None or not wanted(args):
        return False
    _thread = threading.Thread(target=_start, name="ikjax-backend-start", daemon=True)
    _thread.start()
    return True


def join(timeout: float | None = None) -> None:
    """Wait for the thread (at exit: a command that failed early leaves no thread inside CUDA's
    initialisation while the interpreter shuts down)."""
    if _thread is not None:
        _thread.join(timeout)
