"""Synthetic deepseek2 GGUF models with real shapes and random weights (`ikjax make-model`).

Weights are written directly as random quantized blocks: a pool of a few thousand random blocks is
built per (type, row length) with its f16 scale fields set so the dequantized weights have mean ~0
and std ~1/sqrt(fan_in) (activations stay in range through any depth), and every tensor is a random
draw of pool blocks. Nothing is quantized from floats, nothing is held in RAM: tensors are streamed
to disk chunk by chunk after the GGUF header (gguf.GGUFWriter writes header, metadata, tensor
table). Metadata and the tokenizer block come from `ikjax.gguf_io.writer` (ik's converter's keys).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ikjax import env
from ikjax.atomic_file import atomic_write
from ikjax.errors import OptionError
from ikjax.gguf_io import writer as gw

# HF-style configs (the keys ikjax.gguf_io.writer.deepseek2_metadata reads)
_V2_LITE: dict[str, Any] = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
    num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
    intermediate_size=10944, first_k_dense_replace=1, vocab_size=102400, scoring_func="softmax",
    topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
    rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
    bos_token_id=0, eos_token_id=1,
)
_V3: dict[str, Any] = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
    num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
    intermediate_size=18432, first_k_dense_replace=3, vocab_size=129280, scoring_func="sigmoid",
    topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
    rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
    bos_token_id=0, eos_token_id=1,
)
_TINY: dict[str, Any] = dict(
    _V2_LITE, num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
    kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
    n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2, moe_intermediate_size=256,
    intermediate_size=1024, vocab_size=1024, max_position_embeddings=16384,
    rope_scaling=None,
)
# The other models people run as deepseek2 GGUFs (issue 27), with their published configs' shapes,
# routing and rope; `tokenizer_pre` is the pre-tokenizer their converters write.
_KIMI_K2: dict[str, Any] = dict(
    _V3, model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
    num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.827, vocab_size=163840, max_position_embeddings=131072, rope_theta=50000.0,
    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, mscale=1.0,
                      mscale_all_dim=1.0, beta_fast=1.0, beta_slow=1.0),
    bos_token_id=0, eos_token_id=1, tokenizer_pre="kimi-k2",
)
_GLM_47_FLASH: dict[str, Any] = dict(
    model_type="glm4_moe_lite", architectures=["Glm4MoeLiteForCausalLM"],
    num_hidden_layers=47, num_nextn_predict_layers=1, hidden_size=2048, num_attention_heads=20,
    num_key_value_heads=20, q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
    v_head_dim=256, n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=1536,
    intermediate_size=10240, first_k_dense_replace=1, vocab_size=154880, scoring_func="sigmoid",
    topk_method="noaux_tc", n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
    max_position_embeddings=202752, rope_theta=1000000.0, rms_norm_eps=1e-5, rope_scaling=None,
    bos_token_id=0, eos_token_id=1, tokenizer_pre="glm4",
)
_MOONLIGHT: dict[str, Any] = dict(
    _V2_LITE, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], intermediate_size=11264,
    scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.446,
    vocab_size=163840, max_position_embeddings=8192, rope_theta=50000.0, rms_norm_eps=1e-5, rope_scaling=None,
    tokenizer_pre="kimi-k2",
)
_V2: dict[str, Any] = dict(
    _V2_LITE, num_hidden_layers=60, hidden_size=5120, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, n_routed_experts=160, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1536,
    intermediate_size=12288, topk_method="group_limited_greedy", n_group=8, topk_group=3,
    routed_scaling_factor=16.0, max_position_embeddings=163840, tokenizer_pre="deepseek-llm",
)
PRESETS: dict[str, dict[str, Any]] = {"tiny": _TINY, "v2-lite": _V2_LITE, "v3": _V3, "r1": _V3, "kimi-k2": _KIMI_K2,
                                      "glm-4.7-flash": _GLM_47_FLASH, "moonlight": _MOONLIGHT, "v2": _V2}
PRESET_NAMES = {"tiny": "tiny", "v2-lite": "DeepSeek-V2-Lite (synthetic)", "v3": "DeepSeek-V3 (synthetic)",
                "r1": "DeepSeek-R1 (synthetic)", "kimi-k2": "Kimi-K2 (synthetic)",
                "glm-4.7-flash": "GLM-4.7-Flash (synthetic)", "moonlight": "Moonlight-16B-A3B (synthetic)",
                "v2": "DeepSeek-V2 (synthetic)"}

# Byte offsets of the f16 scale fields inside one block: ("d", off) multiplies the quants,
# ("m", off) the min/offset term (dequantized value = d*A + m*B, linear in both).
_SCALE_FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    "Q4_0": (("d", 0),), "Q5_0": (("d", 0),), "Q8_0": (("d", 0),),
    "Q4_1": (("d", 0), ("m", 2)), "Q5_1": (("d", 0), ("m", 2)),
    "Q2_K": (("d", 80), ("m", 82)), "Q3_K": (("d", 108),), "Q4_K": (("d", 0), ("m", 2)),
    "Q5_K": (("d", 0), ("m", 2)), "Q6_K": (("d", 208),),
    "IQ4_NL": (("d", 0),), "IQ4_XS": (("d", 0),), "IQ2_XXS": (("d", 0),), "IQ2_XS": (("d", 0),),
    "IQ2_S": (("d", 0),), "IQ3_XXS": (("d", 0),), "IQ3_S": (("d", 0),), "IQ1_S": (("d", 0),),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(_SCALE_FIELDS)
_POOL_BLOCKS = 4096
_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # NumPy order: [..., rows, n_per_row]
    qtype: QT
    std: float  # target std of the dequantized values (0: constant `fill`)
    fill: float = 0.0
    derive: str = ""  # "k_b" / "v_b": computed from the layer's attn_kv_b as written (`derived_bytes`)

    @property
    def nbytes(self) -> int:
        be, bb = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // be * bb


# bounds of a synthetic model's shape, far past any real one (R1 61 layers, Kimi K2 384 experts)
MAX_LAYERS, MAX_EXPERTS = 1024, 4096


def preset_config(preset: str, layers: int | None = None, experts: int | None = None,
                  q_lora_rank: int | None = None) -> dict[str, Any]:
    """The preset's HF-style config with the overrides applied. `q_lora_rank`: N >= 1 gives the
    low-rank q projection (attn_q_a, attn_q_a_norm, attn_q_b) of width N, as V3/R1 have; 0 gives
    the direct attn_q of V2-Lite; None keeps the preset's (ik_llama.cpp refuses a q_lora-less
    model unless it has 27 layers, so a shortened V2-Lite for ik needs a rank)."""
    if preset not in PRESETS:
        raise OptionError(f"preset: {preset!r} is not one of {', '.join(PRESETS)}")
    cfg = dict(PRESETS[preset])
    if layers is not None:
        if not 1 <= layers <= MAX_LAYERS:  # (10^12 layers planned a tensor list until 24 GB ran out)
            raise OptionError(f"layers: need 1 to {MAX_LAYERS} (DeepSeek models have 27-61), got {layers}")
        cfg["num_hidden_layers"] = layers
        # at least one MoE layer: a shortened R1 (3 dense lead layers) of 1-3 layers had none, a
        # file with expert counts in its header and not one expert (an outside probe)
        cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], layers - 1)
    if experts is not None:
        used = cfg["num_experts_per_tok"]
        groups = cfg.get("n_group") or 1
        topk_groups = cfg.get("topk_group") or groups
        # the router picks `used` experts from `topk_groups` of the groups: those must hold that many
        # (R1: 8 of 4 groups of 8, so >= 2 a group: 16 experts, not 8; a file the loader refuses)
        least = groups * max(1, -(-used // topk_groups)) if groups > 1 else used
        if experts < least or experts % groups or experts > MAX_EXPERTS:
            raise OptionError(f"experts: need a multiple of {groups} groups from {least} (the router picks "
                              f"{used} from {topk_groups} groups) to {MAX_EXPERTS}, got {experts}")
        cfg["n_routed_experts"] = experts
    if q_lora_rank is not None:
        if isinstance(q_lora_rank, bool) or not isinstance(q_lora_rank, int) or q_lora_rank < 0:
            raise OptionError(f"q-lora-rank: need an integer >= 0 (0 = direct attn_q), got {q_lora_rank!r}")
        cfg["q_lora_rank"] = q_lora_rank or None
    return cfg


def _fallback(qt: QT, n_per_row: int) -> QT:
    """A type whose block divides the row (ik's rule for 128-wide rows: Q8_0), else F16."""
    if n_per_row % gguf.GGML_QUANT_SIZES[qt][0] == 0:
        return qt
    return QT.Q8_0 if n_per_row % 32 == 0 else QT.F16


# types gguf-py can quantize (attn_k_b / attn_v_b are quantized from attn_kv_b's values); the
# others' k_b / v_b are Q8_0, as ik_llama.cpp's quantization recipes for R1 keep them
_QUANTIZABLE = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)


def _derived_type(qt: QT, n_per_row: int) -> QT:
    t = _fallback(qt, n_per_row)
    if t in _QUANTIZABLE:
        return t
    return QT.Q8_0 if n_per_row % 32 == 0 else QT.F16


def derived_bytes(t: TensorPlan, kv_b: np.ndarray, heads: int, nope: int, v: int) -> np.ndarray:
    """attn_k_b / attn_v_b's bytes from attn_kv_b's dequantized values [H * (nope + v), r], as ik's
    converter derives them: per head h, kv_b's first nope rows are W_k[h] (k_b holds its transpose,
    [H * r, nope]) and the next v rows W_v[h] (v_b, [H * v, r]). Random k_b / v_b of their own
    made a file whose -mla 2/3 decode (absorbed: k_b, v_b) and prompt steps (kv_b) computed two
    different models, so a decode-filled cache never matched a fresh prompt's (the server's
    prompt cache, a greedy decode against the prompt's argmax)."""
    r = kv_b.shape[-1]
    kvb = kv_b.reshape(heads, nope + v, r)
    if t.derive == "k_b":
        x = np.ascontiguousarray(kvb[:, :nope].transpose(0, 2, 1)).reshape(heads * r, nope)
    elif t.derive == "v_b":
        x = np.ascontiguousarray(kvb[:, nope:]).reshape(heads * v, r)
    else:
        raise ValueError(f"{t.name}: nothing to derive ({t.derive!r})")
    if x.shape != t.shape:
        raise RuntimeError(f"{t.name}: derived shape {x.shape}, planned {t.shape}")
    return np.asarray(gguf.quants.quantize(x.astype(np.float32), t.qtype)).view(np.uint8).ravel()


# attn_output drawn at half the spread the fan-in rule gives. Random attention is nearly uniform over
# the positions it sees, so its output is close to one average shared by the tokens of a sequence:
# added at full scale, that common part grew layer by layer (mean cosine of the router inputs of a
# 512-token batch 0.06 -> 0.28 over a 61-layer R1-routed model, 86 % of the experts used, the
# busiest at 10x the mean); at half it stays at 0.01 through 61 layers, every expert used, none
# above 2.7x the mean (tests/test_synthetic.py). The step's work is the same either way.
ATTN_OUT_GAIN = 0.5


def plan_tensors(cfg: dict[str, Any], qtype: str) -> list[TensorPlan]:
    qt = QT[qtype]
    d, H, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    r, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    ql, E, fe, fs = cfg.get("q_lora_rank"), cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    sigmoid = cfg["scoring_func"] == "sigmoid"

    def w(name: str, *shape: int, gain: float = 1.0) -> TensorPlan:
        return TensorPlan(name, tuple(shape), _fallback(qt, shape[-1]), gain / math.sqrt(shape[-1]))

    def f32(name: str, n: int, std: float = 0.0, fill: float = 1.0) -> TensorPlan:
        return TensorPlan(name, (n,), QT.F32, std, fill)

    out = [TensorPlan("token_embd.weight", (cfg["vocab_size"], d), _fallback(qt, d), 1.0)]
    # the MTP layers after the main ones (GLM-4.7-Flash's layer 47, as mainline's converter writes
    # it): a MoE layer plus its nextn.* tensors; ikjax loads past them with a note
    n_mtp = gw.mtp_layer_count(cfg)
    for i in range(L + n_mtp):
        p = f"blk.{i}."
        if i >= L:
            out += [w(p + "nextn.eh_proj.weight", d, 2 * d), f32(p + "nextn.enorm.weight", d),
                    f32(p + "nextn.hnorm.weight", d), f32(p + "nextn.shared_head_norm.weight", d)]
        out.append(f32(p + "attn_norm.weight", d))
        if ql:
            out += [w(p + "attn_q_a.weight", ql, d), f32(p + "attn_q_a_norm.weight", ql),
                    w(p + "attn_q_b.weight", H * (nope + rope), ql)]
        else:
            out.append(w(p + "attn_q.weight", H * (nope + rope), d))
        out += [w(p + "attn_kv_a_mqa.weight", r + rope, d), f32(p + "attn_kv_a_norm.weight", r),
                w(p + "attn_kv_b.weight", H * (nope + v), r),
                TensorPlan(p + "attn_k_b.weight", (H * r, nope), _derived_type(qt, nope), 0.0, derive="k_b"),
                TensorPlan(p + "attn_v_b.weight", (H * v, r), _derived_type(qt, r), 0.0, derive="v_b"),
                w(p + "attn_output.weight", d, H * v, gain=ATTN_OUT_GAIN), f32(p + "ffn_norm.weight", d)]
        if i < cfg["first_k_dense_replace"] or not E:
            f = cfg["intermediate_size"]
            out += [w(p + "ffn_gate.weight", f, d), w(p + "ffn_up.weight", f, d), w(p + "ffn_down.weight", d, f)]
            continue
        out.append(TensorPlan(p + "ffn_gate_inp.weight", (E, d), QT.F32, 1.0 / math.sqrt(d)))
        if sigmoid:
            out.append(f32(p + "exp_probs_b.bias", E, std=0.01, fill=0.0))
        out += [w(p + "ffn_gate_exps.weight", E, fe, d), w(p + "ffn_up_exps.weight", E, fe, d),
                w(p + "ffn_down_exps.weight", E, d, fe)]
        if fs:
            out += [w(p + "ffn_gate_shexp.weight", fe * fs, d), w(p + "ffn_up_shexp.weight", fe * fs, d),
                    w(p + "ffn_down_shexp.weight", d, fe * fs)]
    out += [f32("output_norm.weight", d), w("output.weight", cfg["vocab_size"], d)]
    return out


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def block_pool(qt: QT, std: float, rng: np.random.Generator, n_blocks: int = _POOL_BLOCKS) -> np.ndarray:
    """`n_blocks` random blocks of type `qt` [n, block_bytes] whose values have mean ~0 and std ~`std`."""
    be, bb = gguf.GGML_QUANT_SIZES[qt]
    fields = _SCALE_FIELDS.get(qt.name)
    if fields is None:
        raise OptionError(f"type: cannot synthesize {qt.name} blocks (use one of {', '.join(SUPPORTED_TYPES)})")
    pool = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    if qt.name in _SUBBLOCK_MINS:
        _center_subblocks(pool, qt)

    def with_scales(d: np.ndarray, m: np.ndarray) -> np.ndarray:
        b = pool.copy()
        for role, off in fields:
            b[:, off:off + 2] = _f16_bytes(d if role == "d" else m)
        return gguf.quants.dequantize(b, qt).reshape(n_blocks, be).astype(np.float64)

    ones, zeros = np.ones(n_blocks), np.zeros(n_blocks)
    a = with_scales(ones, zeros)
    k = zeros
    if any(role == "m" for role, _ in fields):
        b = with_scales(zeros, ones)
        mb = b.mean(1)
        k = np.where(np.abs(mb) > 1e-12, -a.mean(1) / np.where(np.abs(mb) > 1e-12, mb, 1.0), 0.0)
        a = a + k[:, None] * b
    s = float(np.sqrt(np.mean(a * a))) or 1.0
    jitter = rng.uniform(0.75, 1.25, n_blocks)
    # half the blocks negated (a negative scale): a block of random quants is not zero-mean where
    # the type has no min to centre it (Q4_0's d * (q - 8) over q in 0..15 averages -d/2, 11 % of
    # its spread), and a matrix whose every entry leans one way adds the same vector, mu * sum(x),
    # to every token: at R1's width three such layers made every token's hidden state the same
    # (mean cosine 1.000) and routed a 512-token batch to 8 of 256 experts. With the signs mixed a
    # row's mean is a random ~1/sqrt(blocks) of its spread, as a trained matrix's.
    sign = np.where(rng.random(n_blocks) < 0.5, -1.0, 1.0)
    d = std / s * jitter * sign
    return _set_scales(pool, fields, d, k * d)


# K-quants whose sub-blocks each have their own min code: (sub-blocks a block, largest min code)
_SUBBLOCK_MINS = {"Q4_K": (8, 63), "Q5_K": (8, 63), "Q2_K": (16, 15)}


def _center_subblocks(pool: np.ndarray, qt: QT) -> None:
    """Set each sub-block's min code so that the sub-block's values average ~0 (in place). Why:
    random bytes give every 32-value sub-block of a Q4_K block a random offset, 58 % of the
    tensor's variance (Q2_K's 25 %) in a pattern the embedding and every weight share (blocks come
    from one pool): layer 0's products added up coherently and the residual stream jumped 8.5x
    there (an outside probe, stop 69), where a trained file's sub-blocks are centred by its
    quantizer. The block-wide dmin is fitted after (`block_pool`)."""
    n_sub, top = _SUBBLOCK_MINS[qt.name]
    fields = dict(_SCALE_FIELDS[qt.name])
    b = pool.copy()
    b[:, fields["d"]:fields["d"] + 2] = _f16_bytes(np.ones(len(pool)))
    b[:, fields["m"]:fields["m"] + 2] = _f16_bytes(np.zeros(len(pool)))
    mu = gguf.quants.dequantize(b, qt).reshape(len(pool), n_sub, -1).astype(np.float64).mean(-1)  # >= 0
    step = mu.max(1, keepdims=True) / top
    m = np.rint(np.divide(mu, step, out=np.zeros_like(mu), where=step > 0)).clip(0, top).astype(np.uint8)
    if qt.name == "Q2_K":  # scales[16] at byte 0: low nibble the scale, high nibble the min
        pool[:, :16] = (pool[:, :16] & 0x0F) | (m << 4)
        return
    q = pool[:, 4:16]  # Q4_K / Q5_K: 8 six-bit (scale, min) pairs packed in 12 bytes (a view)
    q[:, 4:8] = (q[:, 4:8] & 0xC0) | m[:, :4]                                  # mins 0-3: low 6 bits
    q[:, 8:12] = (q[:, 8:12] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)                 # mins 4-7: low 4 bits
    q[:, 4:8] = (q[:, 4:8] & 0x3F) | ((m[:, 4:] >> 4) << 6)                     # ... and high 2 bits


def _set_scales(pool, fields, d, m) -> np.ndarray:
    for role, off in fields:
        pool[:, off:off + 2] = _f16_bytes(d if role == "d" else m)
    return pool


def tensor_chunks(t: TensorPlan, rng: np.random.Generator, pools: dict) -> Iterator[np.ndarray]:
    """The tensor's bytes, in chunks of about 64 MiB."""
    total = t.nbytes
    if t.qtype == QT.F32 and t.std == 0.0:
        yield np.full(t.shape, t.fill, np.float32).view(np.uint8).ravel()
        return
    if t.qtype.name in FLOAT_TYPES:
        item = 2 if t.qtype != QT.F32 else 4
        n = total // item
        step = _CHUNK_BYTES // 4
        for s in range(0, n, step):
            x = rng.standard_normal(min(step, n - s), dtype=np.float32) * np.float32(t.std) + np.float32(t.fill)
            if t.qtype == QT.F16:
                yield x.astype(np.float16).view(np.uint8)
            elif t.qtype == QT.BF16:
                yield (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            else:
                yield x.view(np.uint8)
        return
    key = (t.qtype, round(t.std, 12))
    if key not in pools:
        pools[key] = block_pool(t.qtype, t.std, rng)
    pool = pools[key]
    bb = pool.shape[1]
    n_blocks = total // bb
    step = max(1, _CHUNK_BYTES // bb)
    for s in range(0, n_blocks, step):
        idx = rng.integers(0, len(pool), min(step, n_blocks - s), dtype=np.int32)
        yield pool[idx].ravel()


def make_model(path: str | os.PathLike, preset: str = "tiny", qtype: str = "Q8_0", *, layers: int | None = None,
               experts: int | None = None, q_lora_rank: int | None = None, seed: int = 0,
               progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write a synthetic model; returns the path. `progress(name, bytes_done, bytes_total)` per tensor."""
    qtype = qtype.upper()
    if qtype not in SUPPORTED_TYPES:
        raise OptionError(f"type: {qtype!r} is not one of {', '.join(SUPPORTED_TYPES)}")
    cfg = preset_config(preset, layers, experts, q_lora_rank)
    plans = plan_tensors(cfg, qtype)
    total = sum(t.nbytes for t in plans)
    # header + metadata (the vocab strings) + alignment padding: well under this for every preset
    overhead = (1 << 20) + 64 * cfg["vocab_size"] + 32 * len(plans)
    with atomic_write(path, total + overhead, what="output") as tmp:
        _write_model(tmp, cfg, plans, preset, qtype, layers, q_lora_rank, seed, progress)
    return Path(path)


def _write_model(tmp: Path, cfg: dict, plans: list[TensorPlan], preset: str, qtype: str, layers, q_lora_rank,
                 seed: int, progress) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(None, gw.ARCH)
    # 64-byte aligned tensors: XLA's CPU runtime aliases the file's pages instead of copying them
    # (ikjax.model.weights.default_placer), so a CPU run holds each weight once, in the page cache
    writer.add_custom_alignment(64)
    name = PRESET_NAMES[preset] + (f" {cfg['num_hidden_layers']}L" if layers else "") + \
        (f" q_lora {cfg['q_lora_rank']}" if q_lora_rank is not None and cfg["q_lora_rank"] else "")
    label = gw._size_label([(t.name, t.shape) for t in plans])
    kv = gw.deepseek2_metadata(cfg, layout="all", qtype=QT[qtype], name=name, size_label=label, mtp_layers=True)
    kv += gw.tokenizer_metadata(cfg["vocab_size"], None, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                pre=cfg.get("tokenizer_pre", "deepseek-v3"))
    kv += gw._trailing_metadata(cfg, "all", mtp_layers=True)
    for key, val, vtype in kv:
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, val)
        else:
            writer.add_key_value(key, val, vtype)
    for t in plans:
        be, bb = gguf.GGML_QUANT_SIZES[t.qtype]
        byte_shape = (*t.shape[:-1], t.shape[-1] // be * bb)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        align = writer.data_alignment
        total = sum(t.nbytes for t in plans)
        done = 0
        pools: dict = {}
        kv_b = None  # the current layer's attn_kv_b values, for its attn_k_b / attn_v_b
        dims = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"])
        for t in plans:
            writer.write_padding(fout, fout.tell())
            written = 0
            keep = t.name.endswith("attn_kv_b.weight")
            chunks = [derived_bytes(t, kv_b, *dims)] if t.derive else tensor_chunks(t, rng, pools)
            kept = []
            for chunk in chunks:
                fout.write(memoryview(np.ascontiguousarray(chunk)))
                written += chunk.nbytes
                if keep:
                    kept.append(np.asarray(chunk, np.uint8))
            if keep:
                be, bb = gguf.GGML_QUANT_SIZES[t.qtype]
                raw = np.concatenate(kept).reshape(t.shape[0], t.shape[1] // be * bb)
                kv_b = np.asarray(gguf.quants.dequantize(raw, t.qtype), np.float32).reshape(t.shape)
            if written != t.nbytes:  # a bug here, not a user error: never publish such a file
                raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            done += t.nbytes
            if progress:
                progress(t.name, done, total)
        writer.write_padding(fout, fout.tell(), align)
    except OSError as e:  # disk full, I/O error: one line; atomic_write removes the temporary file
        raise OptionError(f"output: writing {tmp.name} failed: {e.strerror or e}") from None
    finally:
        writer.close()


# bumped whenever the generator's output changes, so a cached default model is made again
# (2: zero-mean blocks and attn_output at half spread, issue 24; 3: DeepSeek's tool-call tokens in
# the vocabulary, gguf_io.writer.TOOL_TOKENS; 4: attn_k_b / attn_v_b derived from attn_kv_b; 5: K-quants'
# sub-blocks centred, `_center_subblocks`)
GENERATOR = 5


def default_model_path() -> Path:
    return env.cache_home() / f"tiny-Q8_0-g{GENERATOR}.gguf"


def ensure_default_model(progress: Callable[[str, int, int], None] | None = None) -> Path:
    """The built-in default model (tiny preset, Q8_0), made on first use and cached."""
    p = default_model_path()
    if not p.exists():
        make_model(p, "tiny", "Q8_0", progress=progress)
    return p
