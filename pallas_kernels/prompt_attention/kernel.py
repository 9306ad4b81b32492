"""Pallas (Triton) causal flash attention for prompt steps on the decompressed MLA keys and values.

Why: XLA's form (`ikjax.ops.attn.attend`) attends to the whole KV bucket. On a GPU it either keeps
every score in memory or walks 256-row blocks in a while loop that the host steps through. For
R1's 128 heads at -ub 2048 that is 64 iterations a layer at a 16k bucket. So a prompt step costs
the same at every N_KV of a bucket and jumps at the next one: 0.44 s at N_KV 0, 1.03 s from 10240
to 14336 for the 16-layer R1 on 2 H200s, where ik_llama.cpp grows from 0.51 to 0.79 s (RESULTS
§25b).

Here one program takes `bq` queries of one head of one sequence and walks the key blocks up to
its last query's position, no further. The trip count is read from the positions at run time, so
the cost follows the context in use, not the bucket. The scores are q_nope·k_nope + q_rope·k_rope
(two products; the rope part is one row per key that every head shares, never broadcast). V is
each head's v part of the same kv rows. The online softmax (m, l, acc) stays in registers.

Layout: kv [B, S, H, nope + Dv] as the kv_b product leaves it. Every head dimension, `bq` and `bk`
is a power of two (Triton's blocks): the wrapper pads T to whole query blocks and S to whole key
blocks. Keys past S sit at positions no query reaches. Padded queries (position 0) are cut off.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash import online_softmax_step, tile_dot
from pallas_kernels.quant_matmul.kernel import _compiler_params

F32 = jnp.float32
NEG = -1e30


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(nope: int, rope: int, v_dim: int) -> bool:
    """Head dimensions the kernel takes as they are (DeepSeek's 128 / 64 / 128; tests' tiny ones)."""
    return _pow2(nope) and _pow2(rope) and _pow2(v_dim) and min(nope, rope, v_dim) >= 16


def _kernel(pos_ref, q_ref, kv_ref, kr_ref, o_ref, *, bq, bk, nope, rope, dv, scale, cdt):
    qi, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q0 = qi * bq
    qpos = pos_ref[b, pl.ds(q0, bq)]                                   # [bq]
    qn = q_ref[b, pl.ds(q0, bq), h, pl.ds(0, nope)].astype(cdt)        # [bq, nope]
    qr = q_ref[b, pl.ds(q0, bq), h, pl.ds(nope, rope)].astype(cdt)     # [bq, rope]
    n_blk = (jnp.max(qpos) + bk) // bk                                 # blocks up to the last query
    dn = ((1,), (1,))

    def body(j, carry):
        m, l, acc = carry
        k0 = j * bk
        kn = kv_ref[b, pl.ds(k0, bk), h, pl.ds(0, nope)].astype(cdt)
        v = kv_ref[b, pl.ds(k0, bk), h, pl.ds(nope, dv)].astype(cdt)
        kr = kr_ref[b, pl.ds(k0, bk), pl.ds(0, rope)].astype(cdt)
        s = (tile_dot(qn, kn, dn) + tile_dot(qr, kr, dn)) * scale
        kpos = k0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        s = jnp.where(kpos <= qpos[:, None], s, NEG)
        return online_softmax_step(m, l, acc, s, v, cdt)

    init = (jnp.full((bq,), NEG, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, dv), F32))
    m, l, acc = lax.fori_loop(0, n_blk, body, init)
    o_ref[b, pl.ds(q0, bq), h, :] = acc / l[:, None]


@functools.partial(jax.jit, static_argnames=("scale", "nope", "bq", "bk", "num_warps", "num_stages", "interpret"))
def _call(q, kv, k_rope, q_pos, *, scale, nope, bq, bk, num_warps, num_stages, interpret):
    B, T, H, D = q.shape
    S, dv, rope = kv.shape[1], kv.shape[-1] - nope, D - nope
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    cdt = jnp.bfloat16 if q.dtype == jnp.bfloat16 else F32
    if Tp != T:
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, Tp - T)))
    if Sp != S:
        kv = jnp.pad(kv, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
        k_rope = jnp.pad(k_rope, ((0, 0), (0, Sp - S), (0, 0)))
    kern = functools.partial(_kernel, bq=bq, bk=bk, nope=nope, rope=rope, dv=dv, scale=float(scale), cdt=cdt)
    out = pl.pallas_call(
        kern,
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, dv), F32),
        grid=(Tp // bq, B, H),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
        name="prompt_attention_kv",
    )(q_pos.astype(jnp.int32), q, kv, k_rope)
    return out[:, :T]


def attention_kv_flash(q, kv, k_rope, q_pos, scale: float, nope: int, *, bq: int = 64, bk: int = 64,
                       interpret: bool = False):
    """q [B, T, H, nope + R], kv [B, S, H, nope + Dv], k_rope [B, S, >= R] (its first R read),
    q_pos [B, T] (positions < S) -> [B, T, H, Dv] float32: each query over keys 0..its position.
    Query/key blocks shrink to the next power of two of T / S when those are smaller."""
    T, S = q.shape[1], kv.shape[1]
    bq = min(bq, 1 << max(4, (T - 1).bit_length()))
    bk = min(bk, 1 << max(4, (S - 1).bit_length()))
    return _call(q, kv, k_rope, q_pos, scale=float(scale), nope=int(nope), bq=bq, bk=bk,
                 num_warps=4, num_stages=2, interpret=interpret)
