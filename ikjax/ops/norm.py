"""RMSNorm. Reference: XLA's fused reduction (pallas_kernels/rms_norm/reference.py); `pallas`: one
program per row, in batch-invariant decode steps only (`registry.batch_invariant`), where a row
must get the bits it gets alone: XLA lays a reduction's threads out by the whole shape, so its
sum of squares differs in the last bit between a batch of 8 and one row. `cpu`: f32 rows over the
C++ pool's threads (pallas_kernels/rms_norm/cpu_ffi.cc): XLA:CPU ran a prompt's norms in a few
partitions that did not grow with threads (RESULTS §26ag); a row's sum in one fixed order, so the
same bits alone or batched. Everywhere else XLA's norm fuses into its neighbours and stays."""
from __future__ import annotations

from ikjax.ops import registry
from ikjax.quant.array import LayerSlice
from pallas_kernels.rms_norm import cpu as _norm_cpu
from pallas_kernels.rms_norm import rms_norm_ref, rms_norm_rows


def _rows_supported(x, weight, eps) -> bool:
    return registry.batch_invariant() and registry.rows(x) <= registry.INVARIANT_MAX_ROWS


def rms_norm(x, weight, eps: float, *, backend: str | None = None):
    """x [..., d] -> float32 x / sqrt(mean(x^2) + eps) * weight (weight [d], or a LayerSlice of a
    scanned group's stack: sliced here, XLA fuses the slice into the norm)."""
    if isinstance(weight, LayerSlice):
        weight = weight.get()
    impls = {
        "xla": registry.Impl(lambda *a: True, rms_norm_ref),
        "pallas": registry.Impl(_rows_supported, lambda x, w, e: rms_norm_rows(x, w, e)),
        "interpret": registry.Impl(_rows_supported, lambda x, w, e: rms_norm_rows(x, w, e, interpret=True)),
        "cpu": registry.Impl(_norm_cpu.supported, lambda x, w, e: _norm_cpu.rms_norm(x, w, e, n_threads=registry.threads())),
    }
    return registry.dispatch("rms_norm", impls, registry.resolve_backend(backend), x, weight, eps)
