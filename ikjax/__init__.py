"""ikjax: compiled JAX inference for DeepSeek-family GGUF models, with ik_llama.cpp's options.

    import ikjax
    eng = ikjax.load("model.gguf", mla=3, fa=True, ctk="q8_0")
    eng.logits(token_ids)          # [n_tokens, n_vocab] float32
    for tok in eng.generate(prompt_ids, 32): ...
"""
import os as _os

from ikjax import interrupt as _interrupt

_interrupt.install_for_cli()  # Ctrl-C while the CLI starts: one line, status 130 (ikjax/interrupt.py)
# XLA's GPU command buffers (CUDA graphs) cost more than they save on a batch-1 decode step,
# whose buffers change every call: measured on an H200, 7.7 -> 5.8 ms per V2-Lite token with
# them off (bench/RESULTS.md). Set before JAX starts its backend; an explicit user flag wins.
if "xla_gpu_enable_command_buffer" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()


def _host_ram_gib() -> int:
    try:
        return -(-_os.sysconf("SC_PHYS_PAGES") * _os.sysconf("SC_PAGE_SIZE") // (1 << 30))
    except (ValueError, OSError, AttributeError):  # no sysconf names here: XLA's default stays
        return 0


def _pinned_host_limit(environ, ram_gib: int) -> str | None:
    """XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to set, or None. Routed experts in host RAM next to a GPU
    (-ot exps=CPU) live in the GPU's pinned host memory, which XLA's host allocator caps at 64 GB a
    device unless told otherwise: R1-16's 78 GB of experts on one GPU failed to load ("Out of host
    memory ... xla_gpu_host_bfc", RESULTS §25g), and a real R1's 350 GB never could. The cap becomes
    the machine's RAM (the allocator grows on demand: nothing is reserved; the memory plan checks
    that the experts fit). A user's value wins."""
    return None if environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB") or ram_gib <= 64 else str(ram_gib)


if (_limit := _pinned_host_limit(_os.environ, _host_ram_gib())) is not None:
    _os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = _limit

# the command line's JAX backend starts on a thread here, once the settings above are in the
# environment and before JAX, gguf and the package are imported (ikjax/early_backend.py)
from ikjax import early_backend as _early  # noqa: E402

_early.start_for_cli()

from ikjax import quant as _quant  # noqa: F401  (registers ik_llama.cpp's types)
from ikjax.errors import DoesNotFitError, IkjaxError, ModelFileError, OptionError
from ikjax.options import RunOptions
from ikjax.version import __version__


def _import_whole(module: str):
    """`module`, imported; an import that did not finish (Ctrl-C while a notebook's first `ikjax.load`
    imports the runtime) takes the package's modules it started out of `sys.modules` again, so the
    next call imports them afresh: left half-made, every later `ikjax.load` failed with "module
    'ikjax.ops' has no attribute 'registry'" until the process restarted."""
    import importlib
    import sys
    before = set(sys.modules)
    try:
        return importlib.import_module(module)
    except BaseException:
        for m in set(sys.modules) - before:
            # (Python modules only: a C++ extension loads once a process, and is whole once loaded)
            if m.split(".")[0] in ("ikjax", "pallas_kernels") and str(getattr(sys.modules[m], "__file__", "")).endswith(".py"):
                sys.modules.pop(m, None)
        raise


def __getattr__(name):
    # The facade: the runtime (and through it the kernels) loads on first use, so importing a low
    # layer (`ikjax.quant`, which `pallas_kernels` reads) never drags the engine in. Nothing inside
    # the package imports this module (tests/test_architecture.py).
    if name in ("Engine", "load"):
        return getattr(_import_whole("ikjax.runtime.engine"), name)
    if name == "MemoryPlan":
        from ikjax.runtime.memory_plan import MemoryPlan
        return MemoryPlan
    if name == "distributed":  # `ikjax.distributed.initialize(...)`, as the README has it
        from ikjax.runtime import distributed
        return distributed
    raise AttributeError(f"module 'ikjax' has no attribute {name!r}")

__all__ = ["load", "Engine", "MemoryPlan", "RunOptions", "IkjaxError", "ModelFileError", "OptionError",
           "DoesNotFitError", "__version__"]
