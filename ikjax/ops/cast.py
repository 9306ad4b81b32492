"""A float cast as one op: `cast(x, dtype)`. On a CPU, f32 -> bf16 runs over the C++ pool's threads
(pallas_kernels/cast): XLA:CPU's converts ran at a few GB/s and did not grow with threads on a
16-core host (bench/RESULTS.md §26q). Elsewhere, and for other types, XLA's convert."""
from __future__ import annotations

from ikjax.ops import registry
from pallas_kernels.cast import cpu as _cast_cpu


def cast(x, dtype, *, backend: str | None = None):
    """x at `dtype`, rounded to nearest even (NaN stays NaN) as XLA's convert, every backend."""
    impls = {
        "xla": registry.Impl(lambda *a: True, lambda x, dtype: x.astype(dtype)),
        "cpu": registry.Impl(_cast_cpu.supported, lambda x, dtype: _cast_cpu.cast_bf16(x, n_threads=registry.threads())),
    }
    return registry.dispatch("cast", impls, registry.resolve_backend(backend), x, dtype)
