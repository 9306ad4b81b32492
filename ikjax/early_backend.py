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


def _start(jax, allocate: bool) -> None:
    try:
        devices = jax.local_devices()
        if allocate:
            _first_allocation(jax, devices)
    except Exception:  # noqa: BLE001 - the command's own first use reports it, as one line
        pass


def _first_allocation(jax, devices) -> None:
    """Put one byte on each local accelerator, one thread a device, and wait for it.

    Why: with JAX 0.11.2 on an H200 the first `jax.devices()` takes 0.35 s, and the device's first
    allocation 1.5-1.8 s (XLA's allocator reserving 75 % of 141 GB up front; 0.18 s with
    XLA_PYTHON_CLIENT_PREALLOCATE=false: bench/backend_start_probe.py, RESULTS §22ak). Whoever puts
    the first array pays that: the command's own thread, after its imports, unless it is paid
    here, beside them. The reserve itself is unchanged."""
    import numpy as np
    accel = [d for d in devices if d.platform != "cpu"]
    one = np.zeros((1,), np.int8)

    def put(d) -> None:
        try:
            jax.device_put(one, d).block_until_ready()
        except Exception:  # noqa: BLE001 - as above
            pass
    threads = [threading.Thread(target=put, args=(d,), name=f"ikjax-first-allocation-{d.id}", daemon=True)
               for d in accel[1:]]
    for t in threads:
        t.start()
    if accel:
        put(accel[0])
    for t in threads:
        t.join()


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
    allocate = env.choice("IKJAX_EARLY_BACKEND") == "1"  # (`wanted` has read it: a bad value never gets here)
    _thread = threading.Thread(target=_start, args=(jax, allocate), name="ikjax-backend-start", daemon=True)
    _thread.start()
    atexit.register(join, 10.0)
    return True


def join(timeout: float | None = None) -> None:
    """Wait for the thread (at exit: a command that failed early leaves no thread inside CUDA's
    initialisation while the interpreter shuts down)."""
    if _thread is not None:
        _thread.join(timeout)
