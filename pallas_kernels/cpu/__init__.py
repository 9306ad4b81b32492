"""The C++ CPU kernels: load the compiled extension and register its XLA FFI targets.

`pip install` compiles `pallas_kernels/*/cpu_kernel.cc` (CMake, scikit-build-core) into the
extension `pallas_kernels._cpu`; its handlers are registered with `jax.ffi` for platform "cpu"
on first use. Each op's `cpu.py` calls `jax.ffi.ffi_call` on its target. `available()` says
whether the extension is there (it is after any `pip install` of this package); `isa()` names
the instruction-set level the kernels run at on this CPU (`IKJAX_CPU_ISA` caps it).
"""
from __future__ import annotations

import functools

import jax

_IMPORT_ERROR: str | None = None
try:
    from pallas_kernels import _cpu  # the compiled extension
except ImportError as e:  # pragma: no cover - only in a source tree that was never installed
    _cpu = None
    _IMPORT_ERROR = str(e)


def available() -> bool:
    return _cpu is not None


def unavailable_reason() -> str:
    return (f"the C++ CPU kernels are not built ({_IMPORT_ERROR}); reinstall with `pip install -e .`"
            if _cpu is None else "")


@functools.cache
def register() -> tuple[str, ...]:
    """Register every FFI target of the extension once per process; returns their names."""
    if _cpu is None:
        raise RuntimeError(unavailable_reason())
    names = []
    for name, capsule in _cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        names.append(name)
    return tuple(sorted(names))


def isa() -> str:
    return _cpu.isa() if _cpu is not None else "none"


def isa_report() -> str:
    """The level that runs and why, for `ikjax info`: e.g. "avx2 (avx512 compiled in, CPU lacks
    avx512f, ...); int8 decode and prompt products: AVX2 (vpmaddubsw/vpmaddwd)"."""
    if _cpu is None:
        return "not built: " + unavailable_reason()
    if not hasattr(_cpu, "isa_report"):  # an extension older than this source: reinstall
        return _cpu.isa() + " (reason unknown: the extension predates isa_report; reinstall)"
    return _cpu.isa_report()


def available_cores() -> int:
    import os
    return _cpu.available_cores() if _cpu is not None else len(os.sched_getaffinity(0))


def forget_file(dev: int, inode: int) -> bool:
    """Let go of the CPU row gather's open descriptor of file (st_dev, st_ino), if it has one (an
    engine closed: a deleted model file's space is freed; a later read of a live mapping of it opens it
    again). False where none was open or the extension predates it."""
    return bool(_cpu.forget_file(dev, inode)) if _cpu is not None and hasattr(_cpu, "forget_file") else False
