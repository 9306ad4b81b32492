"""The small pieces every layer uses: RMSNorm, quantized linear, SwiGLU FFN."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ikjax import ops


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight, float32 (the `rms_norm` op: XLA's, or one row per
    program where a batch-invariant decode step needs it)."""
    return ops.rms_norm(x, weight, eps)


def linear(x, w, dtype):
    """x [..., in] @ W[out, in]^T, float32 result: the dequantizing Pallas kernel on GPU, XLA's
    dequantize-then-dot elsewhere (ikjax.ops picks)."""
    return ops.quant_linear(x, w, dtype)


def norm_linear(x, norm_weight, eps: float, w, dtype):
    """linear(rms_norm(x, norm_weight, eps), w, dtype): on a GPU's decode step one kernel, the
    norm folded into the product (ikjax.ops picks; the two ops apart everywhere else)."""
    return ops.norm_linear(x, norm_weight, eps, w, dtype)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def split_linear(x, layer: dict, fused: str, keys: tuple[str, ...], sizes: tuple[int, ...], dtype,
                 norm: tuple | None = None):
    """The products of x with layer[keys...]: one product with the row-stacked `fused` matrix when
    the file's types allowed stacking them at load (ikjax.model.weights.fuse_rows), else one each.
    `norm` (weight, eps): of rms_norm(x) instead (`norm_linear`)."""
    prod = (lambda w: linear(x, w, dtype)) if norm is None else (lambda w: norm_linear(x, *norm, w, dtype))
    if fused in layer:
        y = prod(layer[fused])
        cuts = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        return tuple(jnp.split(y, cuts, axis=-1))
    return tuple(prod(layer[k]) for k in keys)


# (stacked gate|up, gate, up, down) names of the two SwiGLU FFNs of a layer
DENSE_FFN = ("ffn_gate_up", "ffn_gate", "ffn_up", "ffn_down")
SHARED_EXPERTS = ("shexp_gate_up", "gate_shexp", "up_shexp", "down_shexp")


def dense_ffn(x, layer: dict, names: tuple[str, str, str, str], dtype):
    """SwiGLU FFN: down(silu(gate x) * up x), gate and up in one product where stored stacked, else
    the `swiglu_ffn` op (on the CPU the fused kernel for prompt-sized x)."""
    fused, gate, up, down = names
    if fused not in layer:
        return ops.swiglu_ffn(x, layer[gate], layer[up], layer[down], dtype)
    f = layer[down].shape[-1]
    g, u = split_linear(x, layer, fused, (gate, up), (f, f), dtype)
    return linear(swiglu(g, u), layer[down], dtype)
