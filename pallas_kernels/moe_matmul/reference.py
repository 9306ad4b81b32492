"""Plain-jnp routed experts: the oracle of the MoE kernels and the model's XLA path
(ikjax.model.moe calls these). Weights: QuantArray or PackedWeight, dequantized in the graph.

- gather form (decode): only the selected experts' rows are gathered and dequantized;
- grouped form (prompt): assignments sorted by expert, one `ragged_dot` per projection.
`fused` (ik's -fmoe) contracts gate and up in one product and applies SiLU·mul to its halves.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _prec(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _take(w, ids, dtype):
    """Rows of the experts ids [N, k] -> [N, k, out, in] in dtype."""
    if hasattr(w, "take"):
        return w.take(ids).dequantize(dtype)
    return type(w)(w.data[ids], w.qtype, ids.shape + w.shape[1:]).dequantize(dtype)


def moe_experts_ref(x, w, ids, gate, up, down, dtype=jnp.bfloat16, *, fused: bool = False):
    """x [N, d]; w [N, k] float32 routing weights; ids [N, k] int; gate/up [E, F, d], down [E, d, F].
    -> [N, d] float32 = sum_j w[n,j] * down_e(silu(gate_e x) * up_e x), e = ids[n,j]."""
    p = _prec(dtype)
    xc = x.astype(dtype)

    def proj(m):
        return jnp.einsum("nd,nkfd->nkf", xc, m, precision=p, preferred_element_type=jnp.float32)
    if fused:
        g, u = jnp.split(proj(jnp.concatenate([_take(gate, ids, dtype), _take(up, ids, dtype)], axis=2)), 2, -1)
    else:
        g, u = proj(_take(gate, ids, dtype)), proj(_take(up, ids, dtype))
    h = (jax.nn.silu(g) * u).astype(dtype)
    y = jnp.einsum("nkf,nkdf->nkd", h, _take(down, ids, dtype), precision=p, preferred_element_type=jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, w, precision=jax.lax.Precision.HIGHEST)


def moe_experts_grouped_ref(x, w, ids, gate, up, down, dtype=jnp.bfloat16, *, fused: bool = False):
    """The same function for prompt-sized N: every expert dequantized once."""
    N, k = ids.shape
    E = gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    xs = x.astype(dtype)[tok]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    p = _prec(dtype)

    def rdot(lhs, rhs):  # rhs [E, out, in]
        return jax.lax.ragged_dot(lhs, rhs.swapaxes(1, 2), sizes, precision=p, preferred_element_type=jnp.float32)
    if fused:
        g, u = jnp.split(rdot(xs, jnp.concatenate([gate.dequantize(dtype), up.dequantize(dtype)], axis=1)), 2, -1)
    else:
        g, u = rdot(xs, gate.dequantize(dtype)), rdot(xs, up.dequantize(dtype))
    h = (jax.nn.silu(g) * u).astype(dtype)
    y = rdot(h, down.dequantize(dtype))
    # token order by a gather (no scatter-add: atomics on a GPU add in a different order each run)
    return combine_slots(y[slot_rank(order)].reshape(N, k, -1), w)


def slot_rank(order):
    """The inverse of the permutation `order`: where each slot landed in the sorted order."""
    A = order.shape[0]
    return jnp.zeros(A, jnp.int32).at[order].set(jnp.arange(A, dtype=jnp.int32))


def combine_slots(y, w):
    """y [N, k, d] f32, w [N, k] -> each token's k weighted outputs added in slot order, term by
    term (elementwise), not a batched dot or a reduction, whose algorithm and order XLA picks by
    the whole shape: a token's sum must not depend on how many tokens came with it."""
    yw = y * w[..., None]
    out = yw[:, 0]
    for j in range(1, y.shape[1]):
        out = out + yw[:, j]
    return out
