"""Attention: the XLA reference (plain jnp, first) and the registry entries that pick an implementation.

One reference function (`attend`) serves both MLA forms. Standard: q [B,T,H,192], k [B,S,H,192],
v [B,S,H,128]. Absorbed: q [B,T,H,576], k = v = the latent cache [B,S,1,576] (v is its first 512
values), one KV stream shared by all heads. `flash=False` materializes scores, in head chunks that
keep the K·Q buffer under `amb_bytes` (ik's `-amb`); `flash=True` is the blocked online softmax: KV
in blocks of `kv_block`, never an S × H × T buffer.

Ops: `mla_decode_attention` (absorbed MLA decode on the latent cache: `xla` = pallas_kernels/
mla_decode/reference.py, `pallas`, `cpu`), `mla_prompt_attention` (absorbed prompt, `cpu`),
`attention` and `attention_kv` (decompressed K/V: `xla` = `attend` below, `cpu` = the C++ flash kernel).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ikjax import env
from ikjax.ops import registry
from ikjax.ops.registry import precision_for
from pallas_kernels import cpu as _cpu
from pallas_kernels.mla_decode import cpu as _mla_cpu_mod
from pallas_kernels.mla_decode import kernel as _mla
from pallas_kernels.mla_decode.reference import mla_decode_ref
from pallas_kernels.prompt_attention import attention_kv_flash, supports as _prompt_kernel_supports

# -- the XLA reference ------------------------------------------------------------------------------

NEG_INF = float("-inf")


def _scores(q, k, scale):
    # q [B,T,Hq,D], k [B,S,Hk,D] with Hk in {1, Hq} -> [B,Hq,T,S] float32
    if k.shape[2] == 1:
        s = jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], precision=precision_for(q.dtype),
                       preferred_element_type=jnp.float32)
    else:
        s = jnp.einsum("bthd,bshd->bhts", q, k, precision=precision_for(q.dtype),
                       preferred_element_type=jnp.float32)
    return s * scale


def _weighted_values(p, v):
    # p [B,Hq,T,S] float32, v [B,S,Hk,Dv] -> [B,T,Hq,Dv] float32
    p = p.astype(v.dtype)
    if v.shape[2] == 1:
        return jnp.einsum("bhts,bsd->bthd", p, v[:, :, 0], precision=precision_for(v.dtype),
                          preferred_element_type=jnp.float32)
    return jnp.einsum("bhts,bshd->bthd", p, v, precision=precision_for(v.dtype), preferred_element_type=jnp.float32)


def _causal_mask(q_pos, n_kv):
    # q_pos [B,T] -> [B,1,T,S]: key s is visible to a query at position p iff s <= p
    return (jnp.arange(n_kv)[None, None, :] <= q_pos[:, :, None])[:, None]


def attend_materialized(q, k, v, q_pos, scale, amb_bytes: int = 0):
    """Softmax(q·k) v with the scores in memory; heads in chunks bounded by `amb_bytes` (0: no bound)."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    per_head = B * T * S * 4
    chunk = H if amb_bytes <= 0 else max(1, min(H, amb_bytes // per_head))
    mask = _causal_mask(q_pos, S)
    outs = []
    for h0 in range(0, H, chunk):
        hs = slice(h0, min(H, h0 + chunk))
        kh = k if k.shape[2] == 1 else k[:, :, hs]
        vh = v if v.shape[2] == 1 else v[:, :, hs]
        s = jnp.where(mask, _scores(q[:, :, hs], kh, scale), NEG_INF)
        p = jax.nn.softmax(s, axis=-1)
        outs.append(_weighted_values(p, vh))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def attend_flash(q, k, v, q_pos, scale, kv_block: int):
    """Online-softmax attention over KV blocks (FlashAttention's recurrence), float32 accumulators.

    The loop runs over the blocks some query sees, up to the block of the last query position, a
    count known only when the step runs: a step compiled for a KV bucket of S rows pays for the
    context it has, not for the bucket (a scan over all S / kv_block blocks made a prompt step's
    time flat across a bucket, its first rows as slow as its last: R1 under -sm layer at 0.75-0.94x
    ik in the deep rows, RESULTS §25b; V2-Lite's S_PP 39 % down from the 4096 row to the 6144
    row, §25). The blocks left out are masked for every query, where they added exactly nothing
    (p = 0, the correction 1): the result is bit-identical to the scan over all blocks."""
    B, T, H, _ = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    blk = min(kv_block, S)
    n_blocks = -(-S // blk)
    pad = n_blocks * blk - S
    if pad:
        k = jnp.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)])
        v = jnp.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)])
    # blocks 0 .. the last query position's (at least one, at most all); IKJAX_FLASH_LOOP=bucket: all,
    # a trip count XLA knows (on a GPU a loop of unknown count waits for its predicate on the host
    # every iteration, ~10-20 us: the A/B for the device, where the skipped blocks should pay more)
    if env.choice("IKJAX_FLASH_LOOP") == "bucket":
        n_live = n_blocks
    else:
        n_live = jnp.clip(jnp.max(q_pos) // blk + 1, 1, n_blocks).astype(jnp.int32)

    def step(j, carry):
        m, l, acc = carry
        kj = jax.lax.dynamic_slice_in_dim(k, j * blk, blk, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(v, j * blk, blk, axis=1)
        kv_pos = j * blk + jnp.arange(blk)
        visible = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B,T,blk]
        if pad:  # the rows padding S to whole blocks are never visible (a query past the end would count them)
            visible = visible & (kv_pos < S)[None, None, :]
        visible = visible[:, None]  # [B,1,T,blk]
        s = jnp.where(visible, _scores(q, kj, scale), NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l_new = l * corr + p.sum(axis=-1)
        acc_new = acc * corr.transpose(0, 2, 1)[..., None] + _weighted_values(p, vj)
        return m_new, l_new, acc_new

    init = (jnp.full((B, H, T), -1e30, jnp.float32), jnp.zeros((B, H, T), jnp.float32),
            jnp.zeros((B, T, H, Dv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_live, step, init)
    return acc / l.transpose(0, 2, 1)[..., None]


def split_heads_kv(kv, k_rope, nope: int):
    """Standard attention's K and V from each head's k_nope | v, kv [B, S, H, nope + v], and the
    rope part k_rope [B, S, R] every head shares: K = k_nope ++ k_rope as float32 [B, S, H, nope +
    R], V = kv[..., nope:]. The -mla 0 cache entries and the XLA form of kernels.attention_kv."""
    B, S, H, _ = kv.shape
    R = k_rope.shape[-1]
    k = jnp.concatenate([kv[..., :nope].astype(jnp.float32),
                         jnp.broadcast_to(k_rope[:, :, None, :], (B, S, H, R)).astype(jnp.float32)], -1)
    return k, kv[..., nope:]


# On a GPU the blocked form's scan over KV blocks is a while loop the host steps through, each
# iteration a handful of small kernels and copies of its carry: at 256-row blocks a 64-token step
# at 4000 tokens of context ran 16 iterations a layer, 2.2x its time at context 0 (RESULTS §23b).
# There the blocks are as large as this many bytes of f32 scores allow: one block (no loop, the
# scores in memory) up to 8k of context for a 512-token ubatch of 16 heads.
GPU_SCORES_BYTES = 256 << 20


# The largest KV block a prompt step's blocked attention takes on a GPU when its cache is longer: the
# loop then reads only the blocks some query sees (attend_flash's live count).
GPU_LIVE_ROWS = 2048


def gpu_kv_block(B: int, T: int, H: int, S: int, kv_block: int) -> int:
    """The KV block of the blocked form on a GPU: the largest power of two of rows (at least
    `kv_block`) whose [B, H, T, rows] f32 scores fit GPU_SCORES_BYTES; S when all of it fits, up to
    GPU_LIVE_ROWS for a prompt step (T > 1) over a longer cache. Why that bound: a prompt step is
    compiled once for every depth (its KV length the whole cache), so one block of all S rows
    made a 64-token step at position 0 attend over all 8192 rows of an 8k slot, 26 of its 50 ms on
    an H200 (RESULTS §23ao); in blocks, the loop stops at the last query's block. One-token steps
    keep one block (their loop would step through the cache on the host, inside the decode)."""
    rows = max(kv_block, GPU_SCORES_BYTES // max(1, B * T * H * 4))
    if T > 1 and S > GPU_LIVE_ROWS:
        rows = min(rows, GPU_LIVE_ROWS)
    if rows >= S:
        return S
    return max(kv_block, 1 << (rows.bit_length() - 1))


def attend(q, k, v, q_pos, scale, *, flash: bool, amb_bytes: int, kv_block: int):
    if flash:
        if jax.default_backend() == "gpu":
            B, T, H, _ = q.shape
            kv_block = gpu_kv_block(B, T, H, k.shape[1], kv_block)
            if kv_block >= k.shape[1]:
                return attend_materialized(q, k, v, q_pos, scale)
        return attend_flash(q, k, v, q_pos, scale, kv_block)
    return attend_materialized(q, k, v, q_pos, scale, amb_bytes)


# -- MLA attention on the latent cache --------------------------------------------------------------

def mla_decode_supported(n_head: int, n_kv: int, width: int, v_dim: int, backend: str | None = None) -> bool:
    """Whether the decode kernel of the resolved backend takes this geometry and reads each sequence
    only up to its own length (so decode steps can share one KV bucket)."""
    b = registry.resolve_backend(backend)
    if b == "cpu":  # the C++ kernel takes any geometry with v_dim <= width (it reads the cache as stored)
        return _cpu.available() and 1 <= v_dim <= width
    if b in ("pallas", "interpret"):
        return _mla.supports(_heads_padded(n_head), n_kv, width, v_dim)
    return False


def _heads_padded(n_head: int) -> int:
    """The Pallas decode kernel works on blocks of 16 heads (its dot tiles): fewer heads (a device's
    share under -sm graph, e.g. 16 / 4) are padded with zero queries, which cost no cache reads
    (the cache rows are read once per head block) and whose outputs are dropped."""
    return -(-n_head // 16) * 16


def _one_layer(cache, layer):
    """Layer `layer` of a cache stack (the XLA form: XLA fuses the slice into the products reading it)."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), cache)


def _cache_rows(cache) -> int:
    """S of a cache stack [L, B, S, ...] (float or q8_0)."""
    return (cache["q"] if isinstance(cache, dict) else cache).shape[2]


def _mla_xla(q, cache, lengths, layer, scale, v_dim, dtype):
    return mla_decode_ref(q, _one_layer(cache, layer), lengths, scale, v_dim=v_dim, dtype=dtype)


def _mla_pallas_supported(q, cache, lengths, layer, scale, v_dim, dtype) -> bool:
    B, H, D = q.shape
    return _mla.supports(_heads_padded(H), _cache_rows(cache), D, v_dim)


def _mla_pallas(interpret: bool):
    def run(q, cache, lengths, layer, scale, v_dim, dtype):
        H = q.shape[1]
        pad = _heads_padded(H) - H
        if pad:
            q = jnp.pad(q, ((0, 0), (0, pad), (0, 0)))
        if max(a.size for a in jax.tree_util.tree_leaves(cache)) >= 2**31:
            # the Triton kernel's offsets are 32-bit: a stack this big is read as its one layer (a copy)
            cache, layer = _one_layer(cache, layer), None
        out = _mla.mla_decode(q, cache, lengths, scale, v_dim=v_dim, dtype=dtype, interpret=interpret, layer=layer,
                              row_invariant=registry.batch_invariant())
        return out[:, :H] if pad else out
    return run


def _mla_cpu_supported(q, cache, lengths, layer, scale, v_dim, dtype) -> bool:
    return _mla_cpu_mod.supported(q.shape, cache, v_dim, stacked=True)


def _mla_cpu(q, cache, lengths, layer, scale, v_dim, dtype):
    return _mla_cpu_mod.mla_decode(q, cache, lengths, scale, v_dim=v_dim, n_threads=registry.threads(), layer=layer)


def _stack_of(cache, layer):
    """(stack, index): a one-layer cache as a stack of one (a reshape), or the stack as given."""
    if layer is None:
        return jax.tree_util.tree_map(lambda a: a[None], cache), 0
    return cache, layer


def mla_decode_attention(q, cache, lengths, scale, *, v_dim: int = 512, dtype=jnp.bfloat16,
                         backend: str | None = None, layer=None):
    """Absorbed-MLA decode: one query per sequence over latent cache entries 0..lengths[b]-1.
    `cache`: one layer's [B, S, W] (or q8_0), or with `layer` (int or traced int32: a scanned layer
    group's index) the group's stack [L, B, S, W], of which the kernels read that layer in place."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _mla_xla),
        "pallas": registry.Impl(_mla_pallas_supported, _mla_pallas(False)),
        "interpret": registry.Impl(_mla_pallas_supported, _mla_pallas(True)),
        "cpu": registry.Impl(_mla_cpu_supported, _mla_cpu),
    }
    cache, layer = _stack_of(cache, layer)
    return registry.dispatch("mla_decode", impls, registry.resolve_backend(backend), q, cache, lengths, layer, scale,
                             v_dim, dtype)


def mla_prompt_supported(q_shape, cache, v_dim: int, backend: str | None = None, stacked: bool = False) -> bool:
    """Whether absorbed attention for prompt steps (T > 1) has a kernel on this backend (CPU only)."""
    if registry.resolve_backend(backend) != "cpu":
        return False
    return _mla_cpu_mod.supported(q_shape, cache, v_dim, stacked)


def mla_prompt_attention(q, cache, q_pos, scale, *, v_dim: int, backend: str | None = None, layer=None):
    """Absorbed MLA over the latent cache for T queries at positions q_pos [B, T] (causal by position);
    only keys up to each query's position are read. q [B, T, H, D] -> [B, T, H, v_dim] float32.
    `cache`/`layer` as `mla_decode_attention`."""
    registry.ran("mla_prompt", "cpu")
    return _mla_cpu_mod.mla_attention(q, cache, q_pos, scale, v_dim=v_dim, n_threads=registry.threads(), layer=layer)



# -- attention over decompressed keys and values ------------------------------------------------

def _attend_xla(q, k, v, q_pos, scale, flash, amb_bytes, kv_block):
    return attend(q, k, v, q_pos, scale, flash=flash, amb_bytes=amb_bytes, kv_block=kv_block)


def _attend_cpu_supported(q, k, v, q_pos, scale, flash, amb_bytes, kv_block) -> bool:
    # flash only: without -fa the user asked for materialized scores in -amb chunks (ik's
    # non-FA path), which the XLA form is
    return flash and _mla_cpu_mod.attention_supported(q.shape, k, v)


def _attend_cpu(q, k, v, q_pos, scale, flash, amb_bytes, kv_block):
    return _mla_cpu_mod.attention(q, k, v, q_pos, scale, n_threads=registry.threads())


def attention(q, k, v, q_pos, scale, *, flash: bool, amb_bytes: int = 0, kv_block: int = 256,
              backend: str | None = None):
    """Causal attention over keys and values of their own: q [B, T, H, D], k [B, S, Hk, D], v [B, S,
    Hk, Dv] (Hk = 1 or H), the query at position p seeing keys 0..p -> [B, T, H, Dv] float32. The
    `-mla 0/2/3` prompt steps (decompressed K/V) and `-mla 0` decode. `xla`: attention.attend
    (flash: the blocked online softmax; else scores in `-amb` chunks). `cpu` (flash only): the C++
    flash kernel, which reads only the keys a query sees (XLA's scan reads every block of the
    bucket and materializes each block's scores: 59-79 GFLOP/s at V2-Lite's prompt shape against
    168-215 for the kernel, RESULTS §9h)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _attend_xla),
        "cpu": registry.Impl(_attend_cpu_supported, _attend_cpu),
    }
    return registry.dispatch("attention", impls, registry.resolve_backend(backend), q, k, v, q_pos, scale, flash, amb_bytes,
                     kv_block)



def _attend_kv_xla(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block):
    k, v = split_heads_kv(kv, k_rope[..., :q.shape[-1] - nope], nope)
    return _attend_xla(q, k.astype(q.dtype), v.astype(q.dtype), q_pos, scale, flash, amb_bytes, kv_block)


def _attend_kv_cpu_supported(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block) -> bool:
    return flash and _mla_cpu_mod.attention_kv_supported(q.shape, kv, k_rope, nope)


def _attend_kv_cpu(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block):
    return _mla_cpu_mod.attention_kv(q, kv, k_rope, q_pos, scale, nope=nope, n_threads=registry.threads())


def _attend_kv_pallas_supported(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block) -> bool:
    # flash only; IKJAX_PROMPT_ATTN=xla keeps XLA's form (the kernel measured 1.09-1.49x its S_PP
    # on an H200, growing with the context: RESULTS §25c)
    return flash and q.shape[1] > 1 and _prompt_kernel_on(nope, q.shape[-1] - nope, kv.shape[-1] - nope)


def _prompt_kernel_on(nope: int, rope: int, v_dim: int) -> bool:
    return env.choice("IKJAX_PROMPT_ATTN") == "pallas" and _prompt_kernel_supports(nope, rope, v_dim)


def prompt_kernel_bounded(backend: str, nope: int, rope: int, v_dim: int) -> bool:
    """Whether -mla 2/3 -fa prompt steps on `backend` attend with the Pallas kernel, which reads keys
    only up to each query block's last position (never the rows past the context): the engine's
    condition for one prompt step over the whole cache (ikjax.runtime.engine.Engine.kv_bucket)."""
    return backend in ("pallas", "interpret") and _prompt_kernel_on(nope, rope, v_dim)


def _attend_kv_pallas(interpret: bool):
    def run(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block):
        return attention_kv_flash(q, kv.astype(q.dtype), k_rope.astype(q.dtype), q_pos, scale, nope,
                                  interpret=interpret)
    return run


def attention_kv(q, kv, k_rope, q_pos, scale, *, nope: int, flash: bool, amb_bytes: int = 0, kv_block: int = 256,
                 backend: str | None = None):
    """`attention` over the keys and values as the -mla 2/3 prompt's kv_b product gives them: kv [B,
    S, H, nope + Dv] (each head's k_nope | v) and the rope part k_rope [B, S, >= R] shared by the
    heads; K = kv[..., :nope] ++ k_rope[..., :R], V = kv[..., nope:], both taken at q's dtype.
    `xla` builds K and V (concatenate, broadcast, converts) and runs `attend`; `cpu` (flash) reads
    them in place (RESULTS §9h: those copies were ~40 ms of a 512-token V2-Lite step); `pallas`
    (flash, T > 1; the default, IKJAX_PROMPT_ATTN=xla turns it off): pallas_kernels/prompt_attention, which walks each
    query block's keys up to its last position only (XLA's form pays for the whole bucket, §25b)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, _attend_kv_xla),
        "cpu": registry.Impl(_attend_kv_cpu_supported, _attend_kv_cpu),
        "pallas": registry.Impl(_attend_kv_pallas_supported, _attend_kv_pallas(False)),
        "interpret": registry.Impl(_attend_kv_pallas_supported, _attend_kv_pallas(True)),
    }
    return registry.dispatch("attention", impls, registry.resolve_backend(backend), q, kv, k_rope, q_pos, scale, nope, flash,
                     amb_bytes, kv_block)
