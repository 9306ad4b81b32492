"""One dispatch point per kernel operation: Pallas on GPU, plain jnp elsewhere.

Backend choice, per call: the `backend=` argument, else the environment variable
`IKJAX_KERNELS` (`auto` | `jnp` | `pallas` | `interpret`), else `auto`: Pallas when
`jax.default_backend() == "gpu"` and the kernel supports the type and shape, jnp otherwise.
`interpret` runs the Pallas kernels in interpret mode (any backend; slow; for tests).
A forced `pallas` on an unsupported type/shape falls back to jnp for that call (the kernels
cover a subset; the reference covers everything).

Weights: the kernels read a planar repacking of the GGUF blocks (`PackedWeight`), made once at load
with `prepare_weight(qa)` (lossless, bit-exact with `QuantArray.dequantize`; roughly the same
bytes). Every function here also accepts a plain `QuantArray`; on the Pallas path that repacks
inside the step, which is correct but costs a pass over the weight: prepare at load.

Signatures (all results float32):
    prepare_weight(qa: QuantArray) -> PackedWeight | QuantArray       # QuantArray if no kernel layout
    quant_linear(x [..., K], w [N, K], dtype, *, backend=None) -> [..., N]
    moe_experts(x [N, d], weights [N, k] f32, ids [N, k] int, gate [E, F, d], up [E, F, d],
                down [E, d, F], dtype, *, backend=None) -> [N, d]     # routed part only, fused SiLU·mul
    mla_decode_attention(q [B, H, 576], cache [B, S, 576] | {"q","d"} q8_0, lengths [B] int, scale,
                         *, v_dim=512, dtype, backend=None) -> [B, H, v_dim]
"""
from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp

from ikjax.quant.array import QuantArray
from pallas_kernels.quant_matmul import packing as _qm_packing
from pallas_kernels.quant_matmul.packing import PackedWeight, prepare as _prepare
from pallas_kernels.quant_matmul.reference import quant_matmul_ref
from pallas_kernels.quant_matmul import kernel as _qm
from pallas_kernels.moe_matmul.reference import moe_experts_ref, moe_experts_grouped_ref
from pallas_kernels.moe_matmul import kernel as _moe
from pallas_kernels.mla_decode.reference import mla_decode_ref
from pallas_kernels.mla_decode import kernel as _mla

BACKENDS = ("auto", "jnp", "pallas", "interpret")
__all__ = ["BACKENDS", "resolve_backend", "prepare_weight", "quant_linear", "moe_experts",
           "mla_decode_supported", "mla_decode_attention", "PackedWeight"]


def resolve_backend(backend: str | None = None) -> str:
    """-> 'jnp' | 'pallas' | 'interpret' for this call."""
    b = (backend or os.environ.get("IKJAX_KERNELS", "auto")).lower()
    if b not in BACKENDS:
        raise ValueError(f"IKJAX_KERNELS/backend must be one of {', '.join(BACKENDS)}, got {b!r}")
    if b == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    return b


def prepare_weight(qa):
    """Load-time repack for the kernels; returns `qa` unchanged when its type has no kernel layout."""
    if isinstance(qa, PackedWeight) or not isinstance(qa, QuantArray):
        return qa
    if not _qm_packing.supported(qa.qtype.name):
        return qa
    G, P, L, R = _qm_packing.GEOMETRY[qa.qtype.name]
    if qa.shape[-1] % (G * R):
        return qa
    return _prepare(qa)


def _packed(w):
    if isinstance(w, PackedWeight):
        return w
    warnings.warn(f"ikjax.kernels: repacking {w!r} inside the step; call prepare_weight() at load",
                  stacklevel=3)
    return _prepare(w)


def _kernel_ok(w) -> bool:
    name = w.qtype if isinstance(w, PackedWeight) else w.qtype.name
    return _qm.kernel_supports(name, w.shape[-2], w.shape[-1])


# Under `auto`, the Pallas matmul serves decode (up to this many rows of x); larger batches
# (prompt processing) take XLA's dequantize-then-cuBLAS path, measured faster there (bench/RESULTS.md).
AUTO_MAX_ROWS = 4


def quant_linear(x, w, dtype, *, backend: str | None = None):
    """x [..., K] @ W[N, K]^T (W QuantArray or PackedWeight), computed in `dtype`, f32 result."""
    b = resolve_backend(backend)
    rows = 1
    for s_ in x.shape[:-1]:
        rows *= s_
    auto_jnp = backend is None and os.environ.get("IKJAX_KERNELS", "auto") == "auto" and rows > AUTO_MAX_ROWS
    auto_jnp |= b == "pallas" and rows > AUTO_MAX_ROWS and jnp.dtype(dtype) == jnp.float32  # no TF32 in f32 mode
    if b == "jnp" or auto_jnp or not _kernel_ok(w):
        return quant_matmul_ref(x, w, dtype)
    return _qm.quant_matmul(x, _packed(w), dtype, interpret=(b == "interpret"))


def moe_experts(x, weights, ids, gate, up, down, dtype, *, backend: str | None = None):
    """Routed experts of N tokens: sum_j weights[n,j] * down_e(silu(gate_e x) * up_e x), e = ids[n,j]."""
    b = resolve_backend(backend)
    N, k = ids.shape
    E = gate.shape[0]
    gather = N * k <= 2 * E
    # f32 compute is the exact reference mode: the grouped kernel's tile products (tl.dot) would
    # round through TF32, so prompt-sized f32 work stays on XLA's HIGHEST-precision path
    exact_grouped = not gather and jnp.dtype(dtype) == jnp.float32 and b == "pallas"
    if b == "jnp" or exact_grouped or not all(_kernel_ok(t) for t in (gate, up, down)):
        fn = moe_experts_ref if gather else moe_experts_grouped_ref
        return fn(x, weights, ids, gate, up, down, dtype, fused=True)
    return _moe.moe_experts(x, weights, ids, _packed(gate), _packed(up), _packed(down), dtype,
                            interpret=(b == "interpret"))


def mla_decode_supported(n_head: int, n_kv: int, width: int, v_dim: int) -> bool:
    """Whether the Pallas MLA decode kernel takes this geometry (else the jnp path runs)."""
    return _mla.supports(n_head, n_kv, width, v_dim)


def mla_decode_attention(q, cache, lengths, scale, *, v_dim: int = 512, dtype=jnp.bfloat16,
                         backend: str | None = None):
    """Absorbed-MLA decode: one query per sequence over latent cache entries 0..lengths[b]-1."""
    b = resolve_backend(backend)
    B, H, D = q.shape
    S = (cache["q"] if isinstance(cache, dict) else cache).shape[1]
    if b == "jnp" or not mla_decode_supported(H, S, D, v_dim):
        return mla_decode_ref(q, cache, lengths, scale, v_dim=v_dim, dtype=dtype)
    return _mla.mla_decode(q, cache, lengths, scale, v_dim=v_dim, dtype=dtype, interpret=(b == "interpret"))
