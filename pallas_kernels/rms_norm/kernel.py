"""Pallas (Triton) RMSNorm, one program per row.

Why a kernel for a norm XLA fuses well: XLA:GPU picks a reduction's thread layout from the whole
shape, so a row's sum of squares is added in another order in a batch of 8 than alone (2.4e-7
apart on an H200, bench/gpu_bisect_rows.py), and a last-bit difference before a bf16 product is
enough to flip a greedy token some steps later. Here each program reduces one whole row in
registers with the same code whatever the row count: every row gets the bits it gets alone
(`ikjax.ops.registry.batch_invariant`). The row is padded with zeros to a power of two (Triton's
block sizes); the zeros add nothing and are the same for every row count.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quant_matmul.kernel import _compiler_params


def _kernel(x_ref, w_ref, o_ref, *, eps: float, d: int):
    x = x_ref[...].astype(jnp.float32)
    ss = jnp.sum(x * x, axis=-1, keepdims=True)
    o_ref[...] = x * jax.lax.rsqrt(ss / d + eps) * w_ref[...]


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm_rows(x, weight, eps: float, interpret: bool = False):
    """x [..., d] (any float dtype), weight [d] -> float32 [..., d], each row alone."""
    lead, d = x.shape[:-1], x.shape[-1]
    R = 1
    for s in lead:
        R *= s
    D = 1 << (d - 1).bit_length()
    x2 = x.reshape(R, d)
    w2 = weight.astype(jnp.float32).reshape(1, d)
    if D != d:
        x2 = jnp.pad(x2, ((0, 0), (0, D - d)))
        w2 = jnp.pad(w2, ((0, 0), (0, D - d)))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), d=d),
        grid=(R,),
        in_specs=[pl.BlockSpec((1, D), lambda i: (i, 0)), pl.BlockSpec((1, D), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((1, D), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((R, D), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(4 if D <= 4096 else 8, 1),
        name="rms_norm_rows",
    )(x2, w2)
    return out[:, :d].reshape(*lead, d)
