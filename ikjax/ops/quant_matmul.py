"""Quantized products: x @ W^T with W in its GGUF blocks (`quant_linear`), per-head products for MLA's
absorbed matrices (`head_linear`), and the load-time repack the Pallas kernels read (`prepare_weight`).

Implementations: `xla` = pallas_kernels/quant_matmul/reference.py (dequantize, then one dot);
`pallas`/`interpret` = pallas_kernels/quant_matmul/kernel.py on the planar repack (`PackedWeight`);
`cpu` = the C++ kernels on the GGUF blocks as stored (pallas_kernels/quant_matmul/cpu.py).
"""
from __future__ import annotations

import warnings

import jax.numpy as jnp

from ikjax.ops import registry
from ikjax.quant.array import QuantArray
from pallas_kernels.quant_matmul import cpu as _qm_cpu
from pallas_kernels.quant_matmul import kernel as _qm
from pallas_kernels.quant_matmul import packing as _qm_packing
from pallas_kernels.quant_matmul.packing import PackedWeight, prepare as _prepare
from pallas_kernels.quant_matmul.reference import quant_matmul_ref

# -- weights --------------------------------------------------------------------------------------

def prepare_weight(qa):
    """Load-time repack for the Pallas kernels; returns `qa` unchanged when its type has no kernel layout."""
    if isinstance(qa, PackedWeight) or not isinstance(qa, QuantArray):
        return qa
    if not _qm_packing.supported(qa.qtype.name):
        return qa
    G, P, L, R = _qm_packing.GEOMETRY[qa.qtype.name]
    if qa.shape[-1] % (G * R):
        return qa
    return _prepare(qa)


def needs_repack(backend: str | None = None) -> bool:
    """Whether weights should be repacked at load (only the Pallas kernels read a repacked layout)."""
    return registry.resolve_backend(backend) in ("pallas", "interpret")


def packed(w):
    if isinstance(w, PackedWeight):
        return w
    warnings.warn(f"ikjax.ops: repacking {w!r} inside the step; call prepare_weight() at load",
                  stacklevel=3)
    return _prepare(w)


def pallas_ok(w) -> bool:
    name = w.qtype if isinstance(w, PackedWeight) else w.qtype.name
    return _qm.kernel_supports(name, w.shape[-2], w.shape[-1])


def cpu_ok(w) -> bool:
    return isinstance(w, QuantArray) and _qm_cpu.supported(w.qtype.name)





# -- quantized matmul -----------------------------------------------------------------------------

# Under `auto`, the Pallas matmul serves decode (up to this many rows of x); larger batches
# (prompt processing) take XLA's dequantize-then-cuBLAS path, measured faster there (bench/RESULTS.md).
AUTO_MAX_ROWS = 4


def _qm_pallas_supported(auto: bool):
    def supported(x, w, dtype) -> bool:
        rows = registry.rows(x)
        if auto and rows > AUTO_MAX_ROWS:
            return False
        if rows > AUTO_MAX_ROWS and jnp.dtype(dtype) == jnp.float32:  # no TF32 in f32 mode
            return False
        return pallas_ok(w)
    return supported


def _qm_cpu_supported(x, w, dtype) -> bool:
    return cpu_ok(w) and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def _in_decode_groups(fn, x, lead: int):
    """fn over x's rows in the groups `registry.decode_groups` gives (x [..., *tail], the first
    `lead` dims being the rows), or in one call where it gives none."""
    n = 1
    for d in x.shape[:lead]:
        n *= d
    groups = registry.decode_groups(n)
    if groups is None:
        return fn(x)
    flat = x.reshape((-1,) + x.shape[lead:])
    y = jnp.concatenate([fn(flat[a:b]) for a, b in groups], axis=0)
    return y.reshape(x.shape[:lead] + y.shape[1:])


def _qm_cpu_run(x, w, dtype):
    run = lambda x: _qm_cpu.quant_matmul(x, w, n_threads=registry.threads(), compute=registry.compute(dtype))
    return _in_decode_groups(run, x, x.ndim - 1)


def quant_linear(x, w, dtype, *, backend: str | None = None):
    """x [..., K] @ W[N, K]^T (W QuantArray or PackedWeight), computed in `dtype`, f32 result."""
    b = registry.resolve_backend(backend)
    auto = backend is None and registry.auto_backend()
    impls = {
        "xla": registry.Impl(lambda *a: True, quant_matmul_ref),
        "pallas": registry.Impl(_qm_pallas_supported(auto), lambda x, w, d: _qm.quant_matmul(x, packed(w), d)),
        "interpret": registry.Impl(_qm_pallas_supported(False),
                          lambda x, w, d: _qm.quant_matmul(x, packed(w), d, interpret=True)),
        "cpu": registry.Impl(_qm_cpu_supported, _qm_cpu_run),
    }
    return registry.dispatch("quant_linear", impls, b, x, w, dtype)


# -- per-head products (MLA's absorbed W_kb / W_vb) ----------------------------------------------------

def _heads_xla(x, w, dtype):
    prec = registry.precision_for(dtype)
    return jnp.einsum("...hk,hnk->...hn", x.astype(dtype), w.dequantize(dtype), precision=prec,
                      preferred_element_type=jnp.float32)


def _heads_cpu_supported(x, w, dtype) -> bool:
    return cpu_ok(w) and len(w.shape) == 3 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def _heads_cpu(x, w, dtype):
    run = lambda x: _qm_cpu.quant_matmul_heads(x, w, n_threads=registry.threads(),
                                                compute=registry.compute(dtype))
    return _in_decode_groups(run, x, x.ndim - 2)


def head_linear(x, w, dtype, *, backend: str | None = None):
    """Per-head products y[..., h, :] = x[..., h, :] @ W[h]^T: x [..., H, K], W [H, N, K] -> [..., H, N]
    float32 (MLA's absorbed form: q_lat = W_kb q_nope and o = W_vb o_lat, head by head)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _heads_xla),
        "cpu": registry.Impl(_heads_cpu_supported, _heads_cpu),
    }
    return registry.dispatch("head_linear", impls, registry.resolve_backend(backend), x, w, dtype)
