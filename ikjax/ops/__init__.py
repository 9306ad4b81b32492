"""Ops: what the model computes, each through one registry that picks an implementation.

`registry` resolves the backend and dispatches; one module per op family holds the op, its XLA
reference and its rules (`quant_matmul`, `moe`, `attention`, `ffn`, `embed`, `rope`, `cast`). The model imports
the names below (`ops.quant_linear(...)`), never a kernel.
"""
from ikjax.ops.attn import (attend, attention, attention_kv, mla_decode_attention, mla_decode_supported,
                                  mla_prompt_attention, mla_prompt_supported, prompt_kernel_bounded, split_heads_kv)
from ikjax.ops.cast import cast
from ikjax.ops.embed import embed_rows
from ikjax.ops.ffn import FUSED_FFN_MIN_ROWS, swiglu_ffn
from ikjax.ops.norm import rms_norm
from ikjax.ops.moe import (STREAM_MODES, STREAM_ORDERS, gather_form, host_computes, host_experts_unavailable, stream_mode, moe_experts, moe_rounds, stream_slots,
                           stream_slots_for, chunk_experts, stream_ahead, stream_form, streamed_bytes_counted, host_kernel_stats)
from ikjax.ops.quant_matmul import (AUTO_MAX_ROWS, PackedWeight, head_linear, layer_view, needs_repack, pallas_stack_limit, prepare_weight,
                                    prepare_weights, norm_linear, quant_linear, quant_linear_live, router_logits)
from ikjax.ops.rope import apply_rope, rope_q
from ikjax.ops.registry import (BACKENDS, HIGHEST, auto_dtype, cpu_kernel_report, kernel_context, live_rows, live_rows_mask, precision_for,
                                register_native_targets, resolve_backend, selected, seq_tokens)

__all__ = ["cpu_kernel_report", "attend", "attention", "attention_kv", "mla_decode_attention", "mla_decode_supported",
           "mla_prompt_attention", "mla_prompt_supported", "prompt_kernel_bounded", "split_heads_kv", "cast", "embed_rows", "FUSED_FFN_MIN_ROWS",
           "swiglu_ffn", "STREAM_MODES", "STREAM_ORDERS", "gather_form", "host_computes", "host_experts_unavailable", "stream_mode", "moe_experts", "moe_rounds", "stream_slots",
           "stream_slots_for", "chunk_experts", "stream_ahead", "stream_form", "streamed_bytes_counted", "host_kernel_stats", "AUTO_MAX_ROWS", "PackedWeight", "head_linear", "layer_view", "needs_repack", "pallas_stack_limit", "prepare_weight", "prepare_weights",
           "norm_linear", "quant_linear", "quant_linear_live", "apply_rope", "rope_q", "rms_norm", "router_logits", "BACKENDS", "HIGHEST", "auto_dtype", "kernel_context", "live_rows", "live_rows_mask", "precision_for", "register_native_targets", "resolve_backend",
           "selected", "seq_tokens"]
