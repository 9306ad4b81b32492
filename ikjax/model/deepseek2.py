"""The deepseek2 forward step: tokens at given positions in, logits and the updated cache out.

`h = x + Attn(RMSNorm(x)); out = h + FFN(RMSNorm(h))` per layer; dense FFN for the first
`n_dense_lead` layers, routed + shared experts after. Attention is MLA in ik's four modes:

- mla 0: per-head K/V from `W_kv_b · c`, cached as K and V.
- mla 1: absorbed: queries move into the latent space (`W_kb^T q_nope`), scores against the cached
  latent `[c | k_pe]`, output `W_vb · (Σ p·c)`.
- mla 2/3: prompt steps (T > 1) decompress the latent cache to per-head K/V and run standard
  attention; generation steps (T = 1) are absorbed, mla 3 with the flash path.

Which weights each path reads follows ik: `attn_kv_b` for standard attention, `attn_k_b`/`attn_v_b`
for absorbed; a file lacking one form gets it from the other, exactly, inside the graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ikjax import env, ops
from ikjax.gguf_io.config import ModelConfig
from ikjax.model import cache as kvcache
from ikjax.model.groups import LayerGroup, unroll_scan
from ikjax.model.layers import DENSE_FFN, dense_ffn, linear, norm_linear, rms_norm, split_linear
from ikjax.model.moe import count_experts, counting as moe_counting, flush_counts, moe_ffn
from ikjax.model.rope import apply_rope, inverse_frequencies, rope_tables
from ikjax.ops import precision_for, split_heads_kv
from ikjax.options import SmartExpertReduction
from ikjax.placement.host import fetch, fetch_all
from ikjax.quant.array import QuantArray

_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


@dataclass(frozen=True)
class StepPlan:
    """Everything static about one compiled step (hashable: part of the jit cache key)."""
    mla: int
    fa: bool
    amb_bytes: int
    kv_block: int
    kv_len: int  # cache rows attention reads (the KV-length bucket)
    dtype: str
    fmoe: bool
    ser: SmartExpertReduction | None
    all_logits: bool  # False: logits of the token at `last` only
    backend: str = "xla"  # kernels backend at trace time (ikjax.ops); part of the compile key
    threads: int = 0  # CPU kernels' threads: -t for generation steps, -tb for prompt steps (0 = all)
    # -sm graph: the mesh and the split groups (ikjax.runtime.mesh.TensorSplit); the step then
    # runs on each device's part inside shard_map and completes each split group with a psum
    tp: Any = None
    # an ikjax.model.moe.ExpertCounts: MoE layers hand their routing to it (count_experts); None: off
    expert_stats: Any = None
    # the IKJAX_* settings a trace may read (name, value), as the engine saw them: part of the jit
    # cache key, so a setting changed between two engines in one process is never served the
    # other's trace (ikjax.runtime.executables.trace_variables)
    settings: tuple = ()
    # a prompt step over the whole cache (Engine.prompt_whole_cache): the kv_b expansion computes
    # only the rows up to the step's last position (ops.quant_linear_live), the only ones its
    # attention (the Pallas kernel, which stops at each query block's last position) reads
    kv_live: bool = False

    def split_axis(self, key: str) -> str | None:
        """The mesh axis a split group's partial sums are joined over, or None (not split)."""
        return self.tp.axis if self.tp is not None and self.tp.has(key) else None

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]


def reads_kv_b(layer: dict, prefer_kv_b: bool) -> bool:
    """Whether the head matrices come from attn_kv_b (ik's choice per path, or the only form the
    file has) rather than attn_k_b/attn_v_b."""
    return "kv_b" in layer and (prefer_kv_b or not ("k_b" in layer and "v_b" in layer))


def head_matrices(layer: dict, cfg: ModelConfig, prefer_kv_b: bool, dtype):
    """W_k [H, nope, r] and W_v [H, v, r] from attn_kv_b, or from attn_k_b/attn_v_b."""
    H, nope, v, r = cfg.n_head, cfg.nope_dim, cfg.v_dim, cfg.kv_lora_rank
    if reads_kv_b(layer, prefer_kv_b):
        kvb = layer["kv_b"].dequantize(dtype).reshape(H, nope + v, r)
        return kvb[:, :nope], kvb[:, nope:]
    return layer["k_b"].dequantize(dtype).swapaxes(1, 2), layer["v_b"].dequantize(dtype)


def _projections(x, layer, cfg: ModelConfig, dtype):
    """Queries [.., H, qk] and the kv_a output [.., r + rope] of RMSNorm(x) (attn_norm). Each norm
    that feeds a product is that product's (`norm_linear`: folded into it on a GPU's decode step)."""
    q_key = "q_a" if cfg.q_lora_rank else "q"
    q_rows = cfg.q_lora_rank or cfg.n_head * cfg.qk_dim
    q, kv = split_linear(x, layer, "attn_in", (q_key, "kv_a_mqa"), (q_rows, cfg.latent_dim), dtype,
                         norm=(layer["attn_norm"], cfg.rms_eps))
    if cfg.q_lora_rank:
        q = norm_linear(q, layer["q_a_norm"], cfg.rms_eps, layer["q_b"], dtype)
    return q.reshape(*x.shape[:-1], cfg.n_head, cfg.qk_dim), kv


def absorbed_pays(T: int, cfg: ModelConfig) -> bool:
    """Whether a -mla 3 step of T tokens attends in absorbed form (as decode does) rather than
    expanded (as prompts do). The expanded form first multiplies every cached row by kv_b, S·r·H·
    (nope + v) multiply-adds, then attends, T·S·H·(qk + v); the absorbed form attends over the
    latent rows as they are, T·S·H·(2r + rope) (plus T·H·r·(nope + v) for q and the output, no S
    in it). So it does less while T·(2r + rope − qk − v) < r·(nope + v): T < 171 at DeepSeek's
    dimensions, whatever the context. Those are a server's short steps: a chat turn after a cached
    history, a prompt's tail (SHORT_CHUNK = 64 on a GPU), where the expanded form's kv_b product
    over the history was most of the step (a second turn over 4k tokens of history took 1.26x a
    64-token prompt's time, RESULTS §23c). IKJAX_SHORT_STEPS=expanded keeps the expanded form."""
    if env.choice("IKJAX_SHORT_STEPS") != "absorbed":
        return False
    r = cfg.kv_lora_rank
    return T * (2 * r + cfg.rope_dim - cfg.qk_dim - cfg.v_dim) < r * (cfg.nope_dim + cfg.v_dim)


def attention_block(x, layer, group_cache, j, start, q_pos, cos, sin, cfg: ModelConfig, plan: StepPlan):
    """x [B,T,d] the layer's input (attn_norm applied here, by its products) -> (attention output
    [B,T,d], updated group cache). `group_cache`:
    the layer group's stacked cache entries (ikjax.model.cache), this layer's at index j."""
    dtype = plan.compute_dtype
    prec = precision_for(dtype)
    B, T, _ = x.shape
    H, nope, r = cfg.n_head, cfg.nope_dim, cfg.kv_lora_rank
    q, kv = _projections(x, layer, cfg, dtype)
    c = rms_norm(kv[..., :r], layer["kv_a_norm"], cfg.rms_eps)
    k_pe = apply_rope(kv[..., r:], cos, sin)
    scale = cfg.softmax_scale
    attn = dict(amb_bytes=plan.amb_bytes, kv_block=plan.kv_block)

    def head_kv(c_rows):
        """Each head's k_nope | v of the latent rows, [B, S, H, nope + v] float32."""
        if reads_kv_b(layer, True):
            # one product with attn_kv_b as stored (the quantized-matmul op: on the CPU the C++
            # GEMM, no per-step dequantized copy of the matrix; elsewhere the same dequantize-dot)
            return linear(c_rows, layer["kv_b"], dtype).reshape(*c_rows.shape[:2], H, nope + cfg.v_dim)
        wk, wv = head_matrices(layer, cfg, True, dtype)
        k_nope = jnp.einsum("bsr,hnr->bshn", c_rows.astype(dtype), wk, precision=prec,
                            preferred_element_type=jnp.float32)
        vals = jnp.einsum("bsr,hvr->bshv", c_rows.astype(dtype), wv, precision=prec,
                          preferred_element_type=jnp.float32)
        return jnp.concatenate([k_nope, vals], -1)

    if plan.mla == 0:
        k_new, v_new = split_heads_kv(head_kv(c), k_pe, nope)
        new_cache = {"k": kvcache.write(group_cache["k"], j, k_new.reshape(B, T, -1), start),
                     "v": kvcache.write(group_cache["v"], j, v_new.reshape(B, T, -1), start)}
        S = plan.kv_len
        k_all = kvcache.read(new_cache["k"], j, S, H * cfg.qk_dim, dtype).reshape(B, S, H, cfg.qk_dim)
        v_all = kvcache.read(new_cache["v"], j, S, H * cfg.v_dim, dtype).reshape(B, S, H, cfg.v_dim)
        q_full = ops.rope_q(q, cos, sin, nope=nope, dtype=dtype)  # q_nope ++ roped q_pe at dtype, one op
        o = ops.attention(q_full, k_all, v_all, q_pos, scale, flash=plan.fa, **attn)
    else:
        entry = jnp.concatenate([c, k_pe], -1)
        new_cache = {"latent": kvcache.write(group_cache["latent"], j, entry, start)}
        lat = kvcache.read(new_cache["latent"], j, plan.kv_len, cfg.latent_dim, dtype)
        if plan.mla in (2, 3) and T > 1 and not (plan.mla == 3 and absorbed_pays(T, cfg)):
            # K = each head's k_nope ++ the cached rope part, V its v part: the attention op takes
            # them as they are (on the CPU read in place, no concatenated copies)
            if plan.kv_live and reads_kv_b(layer, True):
                live = jnp.max(q_pos) + 1  # rows some query of the step sees
                kvh = ops.quant_linear_live(lat[..., :r], layer["kv_b"], dtype, live)
                kvh = kvh.reshape(B, plan.kv_len, H, nope + cfg.v_dim)
            else:
                kvh = head_kv(lat[..., :r])
            # K and V at q's dtype before the op (every form takes them so): the C++ kernel then
            # reads half the bytes a key, each head's keys a row of all heads apart (its f32 rows
            # cost ~20 % of the kernel at N_KV 512, AVX2; RESULTS §26r)
            q_full = ops.rope_q(q, cos, sin, nope=nope, dtype=dtype)
            o = ops.attention_kv(q_full, ops.cast(kvh, q_full.dtype), lat[..., r:], q_pos, scale, nope=nope,
                                 flash=plan.fa, **attn)
        else:
            # a -mla 3 prompt step in absorbed form (absorbed_pays) reads attn_kv_b as the expanded
            # form does, so a prompt's logits do not depend on the form its steps took (the
            # separately quantized attn_k_b / attn_v_b are decode's, as in ik's -mla 3)
            prompt_kv_b = plan.mla == 3 and T > 1 and "kv_b" in layer
            per_head = "k_b" in layer and "v_b" in layer and not prompt_kv_b  # one op, no dequantized copy
            # those short steps' head products in f32: a few tokens' worth (XLA:CPU has no bf16 x bf16
            # -> f32 dot, which the per-head C++ op otherwise covers)
            hdtype = jnp.float32 if prompt_kv_b else dtype
            hprec = precision_for(hdtype)
            q_nope, q_pe = q[..., :nope], apply_rope(q[..., nope:], cos[:, :, None], sin[:, :, None])
            if per_head:
                q_lat = ops.head_linear(q_nope, layer["k_b"], dtype)
            else:
                wk, wv = head_matrices(layer, cfg, prefer_kv_b=prompt_kv_b, dtype=hdtype)
                q_lat = jnp.einsum("bthn,hnr->bthr", q_nope.astype(hdtype), wk, precision=hprec,
                                   preferred_element_type=jnp.float32)
            q_abs = jnp.concatenate([q_lat, q_pe], -1).astype(dtype)
            flash = plan.fa and plan.mla != 2
            if flash and T == 1 and ops.mla_decode_supported(H, plan.kv_len, cfg.latent_dim, r):
                # split-KV flash decoding over the whole cache, each sequence up to its own length
                lengths = start + 1
                if (live := ops.live_rows_mask(B)) is not None:
                    # an idle slot (a server's free row) keeps its cached history for the prompt
                    # cache; its throw-away token attends to one row, not to that whole history
                    lengths = jnp.where(live != 0, lengths, 1)
                o_lat = ops.mla_decode_attention(q_abs[:, 0], new_cache["latent"], lengths, scale,
                                                 v_dim=r, dtype=dtype, layer=j)[:, None]
            elif flash and ops.mla_prompt_supported(q_abs.shape, new_cache["latent"], r, stacked=True):
                # prompt steps in absorbed form (mla 1): the kernel reads keys up to each query's position
                o_lat = ops.mla_prompt_attention(q_abs, new_cache["latent"], q_pos, scale, v_dim=r, layer=j)
            else:
                o_lat = ops.attention(q_abs, lat[:, :, None, :], lat[:, :, None, :r], q_pos, scale, flash=flash,
                                          **attn)
                if T == 1:
                    # XLA:GPU computes p·V as split-K partials and fuses their sum into the v_b
                    # product below, where it is recomputed for every output row (35 us a layer,
                    # -mla 2 decode, RESULTS §13b): the barrier keeps the sum its own kernel
                    o_lat = jax.lax.optimization_barrier(o_lat)
            if per_head:
                o = ops.head_linear(o_lat, layer["v_b"], dtype)
            else:
                o = jnp.einsum("bthr,hvr->bthv", o_lat.astype(hdtype), wv, precision=hprec,
                               preferred_element_type=jnp.float32)
    out = linear(o.reshape(B, T, H * cfg.v_dim), layer["attn_output"], dtype)
    return out, new_cache


def embed(token_embd: QuantArray, tokens, dtype=jnp.float32, axis: str | None = None):
    """Gather the token rows' blocks, then dequantize only those rows. `axis`: the table is split
    by vocabulary rows over that mesh axis (-sm graph): each device gathers the rows it holds,
    zeros for the others, and a psum assembles them."""
    if axis is not None:
        n_local = token_embd.shape[0]
        local = tokens - jax.lax.axis_index(axis) * n_local
        mine = (local >= 0) & (local < n_local)
        x = embed(token_embd, jnp.where(mine, local, 0), dtype)
        return jax.lax.psum(jnp.where(mine[..., None], x, 0.0), axis)
    token_embd = fetch(token_embd)  # a host-placed table moves to the device (next to an accelerator)
    rows = QuantArray(ops.embed_rows(token_embd.data, tokens), token_embd.qtype, tokens.shape + (token_embd.shape[-1],))
    return rows.dequantize(jnp.float32)


def forward(weights, cache, tokens, start, last, *, cfg: ModelConfig, plan: StepPlan):
    """tokens [B,T] at positions start[b].. ; returns (logits, cache).

    Logits are [B,T,V] if plan.all_logits, else [B,V] for the token at index last[b].
    """
    with ops.kernel_context(plan.backend, plan.threads, seq_tokens=tokens.shape[1]):
        return _forward(weights, cache, tokens, start, last, cfg=cfg, plan=plan)


def trims_last_layer(plan: StepPlan, n_tokens: int) -> bool:
    """Whether a step computes its last layer's FFN for the token at `last` only (ik's
    inp_out_ids: a prompt step that keeps one token's logits needs no other row past the last
    attention; 1 / n_layer of the FFN work, a quarter of a 4-layer test model's). The C++ CPU
    kernels' steps only: the GPU steps would compile one more layer body (their compile time is
    what RESULTS §22 measures); not with expert statistics (they count every token's routing)."""
    return (plan.backend == "cpu" and not plan.all_logits and n_tokens > 1 and plan.expert_stats is None
            and plan.tp is None)


def _forward(weights, cache, tokens, start, last, *, cfg: ModelConfig, plan: StepPlan):
    # a decode step's idle rows (last -1: a server's free slots) skipped by the row-by-row kernels
    live = (last >= 0).astype(jnp.int32) if last is not None and tokens.shape[1] == 1 else None
    with ops.live_rows(live):
        x = embed(weights["token_embd"], tokens, axis=plan.split_axis("embd"))
        trim = trims_last_layer(plan, tokens.shape[1])
        x, new_cache = run_layers(weights["groups"], cache, x, start, cfg=cfg, plan=plan, last=last, trim_last=trim)
        if trim:  # x is [B, 1, d]: the rows at `last` already
            last = jnp.zeros_like(last)
        return output_head(weights, x, last, cfg=cfg, plan=plan), new_cache


def run_layers(groups: list[LayerGroup], cache, x, start, *, cfg: ModelConfig, plan: StepPlan, last=None,
               trim_last: bool = False):
    """The layers of `groups` (ikjax.model.groups) on x [B,T,d]; `cache` holds those groups'
    entries (lists in the same order). Returns (x, their updated cache). A whole step runs every
    group; `-sm layer` runs each device's groups (ikjax.runtime.pipeline.Pipeline). With
    `trim_last` (`trims_last_layer`) the last layer's FFN runs on the rows at `last` only and x
    comes back [B,1,d].

    A group of several layers is one `lax.scan` whose body is one layer: x and the group's KV stack
    are carried, the scan's index j picks layer j of every stacked weight (`ops.layer_view`: the
    kernels read it in place) and of the KV stack (its new rows written in place), so XLA compiles
    one layer per group, not one per layer."""
    B, T = x.shape[:2]
    q_pos = start[:, None] + jnp.arange(T, dtype=start.dtype)[None, :]
    cos, sin = rope_tables(inverse_frequencies(cfg), q_pos)
    # the real tokens: a prompt chunk's rows up to `last` (the rest pad its token bucket), and no
    # row of a sequence whose `last` is -1 (an idle slot of the server's decode batch). The routed
    # experts of the others are skipped (their weights zeroed: no kernel reads those experts' bytes,
    # which is what a host-experts decode step is made of: RESULTS §23f) and the expert statistics
    # count only the real ones.
    valid = None if last is None else (jnp.arange(T)[None, :] <= last[:, None]).reshape(-1)
    counts = plan.expert_stats is not None and valid is not None
    with (moe_counting() if counts else contextlib.nullcontext((None, False))) as (pending, owner):
        x, new_cache = _run_groups(groups, cache, x, start, q_pos, cos, sin, valid, pending, cfg=cfg, plan=plan,
                                   last=last, trim_last=trim_last)
    if owner:  # the step's (or this pipeline stage's) expert counts: one call to the host
        flush_counts(plan.expert_stats, pending, jnp.sum(valid.astype(jnp.int32)),
                     plan.tp.axis if plan.tp is not None else None)
    return x, new_cache


def _run_groups(groups, cache, x, start, q_pos, cos, sin, valid, pending, *, cfg: ModelConfig, plan: StepPlan,
                last, trim_last: bool):
    """run_layers' loop over the groups. `pending` (expert statistics, else None): the MoE layers'
    counts; a scanned group's come out of its scan as stacked outputs (a value made in the scan's
    body exists only there)."""
    T = x.shape[1]
    new_cache = {name: list(entries) for name, entries in cache.items()}
    for g, group in enumerate(groups):
        gcache = {name: entries[g] for name, entries in cache.items()}
        out_rows = jnp.maximum(last, 0) if trim_last and g == len(groups) - 1 else None  # the model's last layer
        if not group.stacked:
            x, gcache = _layer(x, fetch_all(group.tensors), gcache, 0, group.first, start, q_pos, cos, sin,
                               cfg=cfg, plan=plan, valid=valid, out_rows=out_rows)
        else:
            def body(carry, _, group=group):
                x, gc, j = carry
                layer = ops.layer_view(group.tensors, j)  # each kernel reads layer j of the stacks in place
                n0 = len(pending) if pending is not None else 0
                x, gc = _layer(x, layer, gc, j, group.first, start, q_pos, cos, sin, cfg=cfg, plan=plan,
                               valid=valid)
                mine = None
                if pending is not None and len(pending) > n0:  # this layer's counts leave as the scan's ys
                    mine = (jnp.stack([l for l, _ in pending[n0:]]), jnp.stack([c for _, c in pending[n0:]]))
                    del pending[n0:]
                return (x, gc, j + 1), mine
            n_scan = group.count - (out_rows is not None)  # a trimmed last layer runs after the scan
            (x, gcache, _), ys = jax.lax.scan(body, (x, gcache, jnp.int32(0)), None, length=n_scan,
                                              unroll=unroll_scan(T, plan.backend, n_scan))
            if ys is not None:
                pending.append(ys)
            if out_rows is not None:
                j = jnp.int32(n_scan)
                x, gcache = _layer(x, ops.layer_view(group.tensors, j), gcache, j, group.first, start, q_pos,
                                   cos, sin, cfg=cfg, plan=plan, valid=valid, out_rows=out_rows)
        for name, value in gcache.items():
            new_cache[name][g] = value
    return x, new_cache


def _layer(x, layer, gcache, j, i: int, start, q_pos, cos, sin, *, cfg: ModelConfig, plan: StepPlan, valid=None,
           out_rows=None):
    """One layer: `layer` its tensors, `gcache` its group's cache (its entries at index j), `i`
    the group's first layer (what the step does is the same for every layer of a group).
    `out_rows` [B]: after the attention (every row's KV written), only row out_rows[b] of each
    sequence goes on, through the FFN, as a decode step's token would (returns [B,1,d])."""
    heads_axis = plan.split_axis(f"{i}.attn")  # -sm graph: this device's heads only
    lcfg = dataclasses.replace(cfg, n_head=cfg.n_head // plan.tp.n) if heads_axis else cfg
    a, gcache = attention_block(x, layer, gcache, j, start, q_pos, cos, sin, lcfg, plan)
    if heads_axis:
        a = jax.lax.psum(a, heads_axis)
    if out_rows is not None:
        pick = out_rows[:, None, None]
        x, a = jnp.take_along_axis(x, pick, axis=1), jnp.take_along_axis(a, pick, axis=1)
        with ops.seq_tokens(1):
            return _ffn_part(x, a, layer, gcache, j, i, cfg=cfg, plan=plan, valid=None)
    return _ffn_part(x, a, layer, gcache, j, i, cfg=cfg, plan=plan, valid=valid)


def _ffn_part(x, a, layer, gcache, j, i: int, *, cfg: ModelConfig, plan: StepPlan, valid=None):
    """The layer's second half: h = x + a, h + FFN(RMSNorm(h)); returns it and gcache."""
    B, T = x.shape[:2]
    dtype = plan.compute_dtype
    h = x + a
    hn = rms_norm(h, layer["ffn_norm"], cfg.rms_eps)
    if cfg.is_moe_layer(i):
        f = moe_ffn(hn.reshape(B * T, -1), layer, cfg, dtype=dtype, fused=plan.fmoe, ser=plan.ser,
                    experts_axis=plan.split_axis(f"{i}.exps"),
                    shared_axis=plan.split_axis(f"{i}.shexp"),
                    n_parts=plan.tp.n if plan.tp is not None else 1,
                    valid=valid,
                    on_route=None if valid is None or plan.expert_stats is None else functools.partial(
                        count_experts, plan.expert_stats, i + j, valid=valid, axis=plan.tp.axis if plan.tp is not None else None)
                    ).reshape(B, T, -1)
    else:
        f = dense_ffn(hn, layer, DENSE_FFN, dtype)
        if (ffn_axis := plan.split_axis(f"{i}.ffn")) is not None:
            f = jax.lax.psum(f, ffn_axis)
    return h + f, gcache


def output_head(weights, x, last, *, cfg: ModelConfig, plan: StepPlan, gather: bool = True):
    """x [B,T,d] -> logits [B,T,V] (plan.all_logits) or [B,V] of the token at `last`. With the
    head split by vocabulary rows (-sm graph) and `gather=False`: this device's rows only, [.., V/n]
    (the -sm graph decode loop picks its token from them without gathering the logits)."""
    if not plan.all_logits:
        x = jnp.take_along_axis(x, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]  # -1: an idle row
    logits = norm_linear(x, fetch(weights["output_norm"]), cfg.rms_eps, fetch(weights["output"]), plan.compute_dtype)
    if gather and (axis := plan.split_axis("out")) is not None:  # each device's vocabulary rows, in device order
        logits = jax.lax.all_gather(logits, axis, axis=logits.ndim - 1, tiled=True)
    return logits
