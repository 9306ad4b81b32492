"""The dense SwiGLU FFN (dense layers and shared experts): down(silu(gate x) * up x).

`xla` = three `quant_linear` products and XLA's SiLU·mul (the reference); `cpu` = the C++ fused MoE
kernel with one expert every row picks, for prompt-sized x.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ikjax.ops import registry
from ikjax.ops.quant_matmul import cpu_ok, quant_linear
from ikjax.quant.array import LayerSlice, QuantArray
from pallas_kernels.moe_matmul import cpu as _moe_cpu_mod

# -- dense SwiGLU FFN (the dense layers' FFN and the shared experts) -------------------------------

# The C++ fused MoE serves prompt-sized dense FFNs from this many rows of x (decode keeps the three
# tuned GEMVs of quant_linear)
FUSED_FFN_MIN_ROWS = 4


def _ffn_xla(x, gate, up, down, dtype, backend=None):
    # the three products take the caller's backend: `backend="xla"` is XLA throughout
    g, u = quant_linear(x, gate, dtype, backend=backend), quant_linear(x, up, dtype, backend=backend)
    return quant_linear(jax.nn.silu(g) * u, down, dtype, backend=backend)


def _expert_view(w):
    """[F, d] as one expert [1, F, d]: the same bytes, a leading axis (after the layers' axis of
    a LayerSlice's stack, which stays one)."""
    if isinstance(w, LayerSlice):
        d = w.stack.data
        return LayerSlice(QuantArray(d.reshape((d.shape[0], 1) + tuple(d.shape[1:])), w.qtype, (1,) + tuple(w.shape)),
                          w.index)
    return QuantArray(w.data.reshape((1,) + tuple(w.data.shape)), w.qtype, (1,) + tuple(w.shape))


def _ffn_cpu_supported(x, gate, up, down, dtype) -> bool:
    # not in a decode step of a batch: there each row takes the three decode-form products it
    # gets alone (registry.decode_groups)
    return (registry.rows(x) >= FUSED_FFN_MIN_ROWS and not registry.decode_step() and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
            and all(cpu_ok(w) and len(w.shape) == 2 for w in (gate, up, down))
            and _moe_cpu_mod.supported(*(_expert_view(w) for w in (gate, up, down))))


def _ffn_cpu(x, gate, up, down, dtype):
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    y = _moe_cpu_mod.moe_experts(rows, jnp.ones((n, 1), jnp.float32), jnp.zeros((n, 1), jnp.int32),
                                 *(_expert_view(w) for w in (gate, up, down)), n_threads=registry.threads(),
                                 compute=registry.compute(dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def swiglu_ffn(x, gate, up, down, dtype, *, backend: str | None = None):
    """down(silu(gate x) * up x): x [..., d], gate/up [F, d], down [d, F] -> [..., d] float32.
    `xla`: three quant_linear products and XLA's SiLU·mul. `cpu` (prompt-sized x): the fused MoE
    kernel with one expert every row picks at weight 1 — gate and up in one pass, SiLU·mul and
    down per column block, so the two [rows, F] f32 products never exist whole (42.75 MiB of a
    512-token V2-Lite step's XLA buffers, RESULTS §9e)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, functools.partial(_ffn_xla, backend=backend)),
        "cpu": registry.Impl(_ffn_cpu_supported, _ffn_cpu),
    }
    return registry.dispatch("swiglu_ffn", impls, registry.resolve_backend(backend), x, gate, up, down, dtype)
