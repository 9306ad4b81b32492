"""The online-softmax step both flash kernels take per key block (FlashAttention's recurrence),
written once: the Triton lowering and interpret mode trace it inside each kernel's loop body."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def tile_dot(a, b, dims):
    """A tile product with float32 accumulation, at the operands' own precision. Why HIGHEST:
    Triton's default input precision for float32 operands is TF32 (10-bit mantissas), so with
    `--dtype f32` the GPU kernels' products drifted ~1e-4 from the CPU's; HIGHEST lowers float32
    operands to IEEE products and leaves bf16 / f16 ones as they were (the matrix unit's own)."""
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=F32, precision=lax.Precision.HIGHEST)


def online_softmax_step(m, l, acc, s, v, cdt):
    """Running max `m` [r], sum `l` [r] and unnormalized output `acc` [r, dv] after one more block
    of masked scores `s` [r, bk] (float32) over values `v` [bk, dv] (products in `cdt`)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    l_new = l * corr + jnp.sum(p, axis=1)
    acc_new = acc * corr[:, None] + tile_dot(p.astype(cdt), v, ((1,), (0,)))
    return m_new, l_new, acc_new
