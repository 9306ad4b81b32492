"""Plain-jnp routed experts, the same math as ikjax.model.moe.experts_gather (oracle and CPU path)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _prec(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def moe_experts_ref(x, w, ids, gate, up, down, dtype=jnp.bfloat16):
    """x [N, d]; w [N, k] float32 routing weights; ids [N, k] int; gate/up [E, F, d], down [E, d, F]
    (PackedWeight or QuantArray). -> [N, d] float32 = sum_j w[n,j] * down_e(silu(gate_e x) * up_e x)."""
    def take(pw):
        return pw.take(ids).dequantize(dtype) if hasattr(pw, "take") else \
            type(pw)(pw.data[ids], pw.qtype, ids.shape + pw.shape[1:]).dequantize(dtype)
    p = _prec(dtype)
    xc = x.astype(dtype)
    g = jnp.einsum("nd,nkfd->nkf", xc, take(gate), precision=p, preferred_element_type=jnp.float32)
    u = jnp.einsum("nd,nkfd->nkf", xc, take(up), precision=p, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(dtype)
    y = jnp.einsum("nkf,nkdf->nkd", h, take(down), precision=p, preferred_element_type=jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, w, precision=jax.lax.Precision.HIGHEST)


def moe_experts_grouped_ref(x, w, ids, gate, up, down, dtype=jnp.bfloat16):
    """Prompt-size form of the same function: assignments sorted by expert, one ragged_dot per
    projection, every expert dequantized once (as ikjax.model.moe.experts_grouped)."""
    N, k = ids.shape
    E = gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    xs = x.astype(dtype)[tok]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    p = _prec(dtype)

    def rdot(lhs, pw):
        return jax.lax.ragged_dot(lhs, pw.dequantize(dtype).swapaxes(1, 2), sizes, precision=p,
                                  preferred_element_type=jnp.float32)
    h = (jax.nn.silu(rdot(xs, gate)) * rdot(xs, up)).astype(dtype)
    y = rdot(h, down) * w.reshape(-1)[order][:, None]
    return jnp.zeros((N, y.shape[-1]), jnp.float32).at[tok].add(y)
