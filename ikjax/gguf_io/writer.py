"""Write deepseek2 GGUF files from a Hugging Face config + state dict (tests and tools).

Mirrors ik_llama.cpp's ``convert_hf_to_gguf.py`` (class ``DeepseekV2Model``) for DeepseekV2/V3
checkpoints: the same metadata keys in the same order, the same tensor names, shapes and order
(HF names sorted as safetensors stores them, routed experts stacked into one 3-D tensor when the
last of them is seen), the same F32 rules (1-D tensors, norms, biases, ``ffn_gate_inp``).
On top of the converter:

- ``layout``: "all" (``attn_kv_b`` + 2-D ``attn_k_b``/``attn_v_b``, ik's converter), "kvb"
  (``attn_kv_b`` only, older converters), "mainline" (3-D ``attn_k_b``/``attn_v_b`` only,
  ``head_count_kv = 1``, ``key_length = r + rope``, ``value_length = r``, per-head sizes in
  ``key_length_mla``/``value_length_mla``, as mainline llama.cpp writes them).
- ``qtype``: any type ``gguf.quants.quantize`` implements, applied to weight matrices whose row
  length divides the block size (others stay F32).
- ``expert_group_count``/``expert_group_used_count`` when the model routes by groups.
- a small byte-level BPE tokenizer block (synthesized unless a vocab is given).
- split output (``-00001-of-0000N.gguf``, ``split.*`` keys as llama.cpp's gguf-split writes them).

Entry point: :func:`write_deepseek2_gguf`. Pieces: :func:`deepseek2_metadata` (keys),
:func:`deepseek2_tensors` (HF -> GGUF tensors per layout), :func:`tokenizer_metadata`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ikjax.atomic_file import atomic_write_dir
from ikjax.errors import OptionError

__all__ = [
    "LAYOUTS",
    "write_deepseek2_gguf",
    "deepseek2_metadata",
    "deepseek2_tensors",
    "tokenizer_metadata",
    "vocab_from_tokenizer_json",
    "quantize_tensor",
    "shard_paths",
    "unfuse_experts",
]

LAYOUTS = ("all", "kvb", "mainline")
ARCH = "deepseek2"

# HF module path (after "model.layers.N.") -> GGUF tensor base name (without "blk.N." / ".weight")
_LAYER_MAP = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    # DeepSeek V3.2's sparse-attention indexer (ik runs the model with dense attention, as ikjax)
    "self_attn.indexer.wq_b": "indexer.attn_q_b",
    "self_attn.indexer.wk": "indexer.attn_k",
    "self_attn.indexer.k_norm": "indexer.k_norm",
    "self_attn.indexer.weights_proj": "indexer.proj",
}
# an MTP layer's own modules (beside a full layer's): HF module path -> GGUF name after "blk.N."
_NEXTN_MAP = {
    "eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
    "shared_head.norm": "nextn.shared_head_norm", "shared_head.head": "nextn.shared_head_head",
    "embed_tokens": "nextn.embed_tokens",
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q3_K": "MOSTLY_Q3_K_M",
               "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}


# ----------------------------------------------------------------------------------------------
# config helpers


def _rope_scaling(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The YaRN dict whichever way the config spells it (``rope_scaling`` or 5.x ``rope_parameters``)."""
    for key in ("rope_scaling", "rope_parameters"):
        rs = cfg.get(key)
        if rs and (rs.get("type") or rs.get("rope_type")) not in (None, "default") and "factor" in rs:
            return dict(rs)
    return None


def _rope_theta(cfg: Mapping[str, Any]) -> float | None:
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    rp = cfg.get("rope_parameters") or {}
    return float(rp["rope_theta"]) if rp.get("rope_theta") is not None else None


# transformers model types (and architectures) that route as DeepSeek-V3 does: sigmoid scores with
# the selection bias `e_score_correction_bias` (their configs may not say `scoring_func`)
_V3_ROUTED_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite")
_V3_ROUTED_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "Glm4MoeLiteForCausalLM")


def _is_v3(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("model_type") in _V3_ROUTED_TYPES or any(
        a in _V3_ROUTED_ARCHS for a in (cfg.get("architectures") or []))


def leading_dense_layers(cfg: Mapping[str, Any]) -> int:
    """`first_k_dense_replace`, or (Glm4MoeLite, DeepseekV32 in transformers 5) the leading "dense"
    entries of `mlp_layer_types`: GGUF has one count of leading dense layers, so a pattern with a
    dense layer after a MoE layer cannot be written (refused, naming it)."""
    types = cfg.get("mlp_layer_types")
    if types:
        n = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t == "dense" for t in types[n:]):
            raise ValueError(f"mlp_layer_types {types}: a dense layer after a MoE layer has no GGUF form "
                             f"(deepseek2 has one leading_dense_block_count)")
        return n
    return int(cfg.get("first_k_dense_replace") or 0)


def _scoring_func(cfg: Mapping[str, Any]) -> str:
    # transformers' DeepseekV3 always uses sigmoid, DeepseekV2 softmax; real configs say it explicitly
    return cfg.get("scoring_func") or ("sigmoid" if _is_v3(cfg) else "softmax")


def _group_routing(cfg: Mapping[str, Any]) -> tuple[int, int] | None:
    """(n_group, topk_group) when the reference model routes by groups, else None."""
    n_group, topk_group = cfg.get("n_group"), cfg.get("topk_group")
    if not n_group or n_group <= 1 or not topk_group:
        return None
    if not _is_v3(cfg) and cfg.get("topk_method", "greedy") != "group_limited_greedy":
        return None
    return int(n_group), int(topk_group)


# Types the `gguf` package can quantize floats into (its K and IQ quantizers are not implemented).
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _qtype(qtype: str | QT) -> QT:
    if isinstance(qtype, QT):
        return qtype
    if str(qtype).upper() not in QT.__members__:
        raise OptionError(f"qtype {qtype!r}: not a GGML type name")
    return QT[str(qtype).upper()]


def _writable(qtype: str | QT) -> QT:
    qt = _qtype(qtype)
    if qt.name not in WRITABLE_TYPES:
        raise OptionError(f"qtype {qt.name}: the gguf package cannot quantize to it (use {'/'.join(WRITABLE_TYPES)})")
    return qt


def _file_type(qtype: QT) -> int:
    name = _FILE_TYPES.get(qtype.name, "MOSTLY_" + qtype.name)
    return int(gguf.LlamaFileType[name]) if name in gguf.LlamaFileType.__members__ else 0


# ----------------------------------------------------------------------------------------------
# metadata


def mtp_layer_count(cfg: Mapping[str, Any]) -> int:
    """The multi-token-prediction layers the config declares (`num_nextn_predict_layers`)."""
    return int(cfg.get("num_nextn_predict_layers") or 0)


def deepseek2_metadata(cfg: Mapping[str, Any], *, layout: str = "all", qtype: str | QT = "F32",
                       name: str | None = None, size_label: str | None = None, mtp_layers: bool = False
                       ) -> list[tuple[str, Any, VT]]:
    """Model metadata (without the tokenizer block), in the order ik's converter writes it.

    Returns ``[(key, value, GGUFValueType)]``. ``general.architecture`` is added by the writer.
    ``mtp_layers``: count the config's MTP layers in ``block_count`` (mainline's converter does for
    GLM-4.7-Flash; the layers themselves are written by :func:`deepseek2_tensors`), their number in
    ``nextn_predict_layers``; ik's converter leaves them out (the default).
    """
    if layout not in LAYOUTS:
        raise OptionError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    a = ARCH
    n_head = int(cfg["num_attention_heads"])
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    r = int(cfg["kv_lora_rank"])
    mainline = layout == "mainline"
    kv: list[tuple[str, Any, VT]] = [
        ("general.type", "model", VT.STRING),
        ("general.name", name or ("V3" if _is_v3(cfg) else "V2"), VT.STRING),
    ]
    if size_label:
        kv.append(("general.size_label", size_label, VT.STRING))
    kv += [
        (f"{a}.block_count", int(cfg["num_hidden_layers"]) + (mtp_layer_count(cfg) if mtp_layers else 0),
         VT.UINT32),
        (f"{a}.context_length", int(cfg["max_position_embeddings"]), VT.UINT32),
        (f"{a}.embedding_length", int(cfg["hidden_size"]), VT.UINT32),
        (f"{a}.feed_forward_length", int(cfg["intermediate_size"]), VT.UINT32),
        (f"{a}.attention.head_count", n_head, VT.UINT32),
        (f"{a}.attention.head_count_kv",
         1 if mainline else int(cfg.get("num_key_value_heads") or n_head), VT.UINT32),
    ]
    if (theta := _rope_theta(cfg)) is not None:
        kv.append((f"{a}.rope.freq_base", theta, VT.FLOAT32))
    kv += [
        (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.get("rms_norm_eps", 1e-6)), VT.FLOAT32),
        (f"{a}.expert_used_count", int(cfg["num_experts_per_tok"]), VT.UINT32),
        ("general.file_type", _file_type(_qtype(qtype)), VT.UINT32),
        (f"{a}.leading_dense_block_count", leading_dense_layers(cfg), VT.UINT32),
        (f"{a}.vocab_size", int(cfg["vocab_size"]), VT.UINT32),
    ]
    if cfg.get("q_lora_rank") is not None:
        kv.append((f"{a}.attention.q_lora_rank", int(cfg["q_lora_rank"]), VT.UINT32))
    kv += [
        (f"{a}.attention.kv_lora_rank", r, VT.UINT32),
        (f"{a}.attention.key_length", r + rope if mainline else nope + rope, VT.UINT32),
        (f"{a}.attention.value_length", r if mainline else v, VT.UINT32),
        (f"{a}.expert_feed_forward_length", int(cfg["moe_intermediate_size"]), VT.UINT32),
        (f"{a}.expert_count", int(cfg["n_routed_experts"]), VT.UINT32),
        (f"{a}.expert_shared_count", int(cfg.get("n_shared_experts") or 0), VT.UINT32),
        (f"{a}.expert_weights_scale", float(cfg.get("routed_scaling_factor", 1.0)), VT.FLOAT32),
        (f"{a}.expert_weights_norm", bool(cfg.get("norm_topk_prob", False)), VT.BOOL),
    ]
    scoring = _scoring_func(cfg)
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"Unsupported scoring_func value: {scoring}")
    kv.append((f"{a}.expert_gating_func", 2 if scoring == "sigmoid" else 1, VT.UINT32))
    kv.append((f"{a}.rope.dimension_count", rope, VT.UINT32))
    rs = _rope_scaling(cfg)
    if rs is not None and (rs.get("type") or rs.get("rope_type")) == "yarn":
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if not (m and m_all):
            # transformers then scales cos / sin by 0.1 * ln(factor) + 1 and leaves the softmax scale;
            # the GGUF has no key for that (yarn_log_multiplier scales the softmax): the file would
            # compute another model (6 % off on a tiny V3 at factor 4, an outside probe, RESULTS §23an)
            raise ValueError(f"unsupported rope scaling for deepseek2: YaRN without both mscale and mscale_all_dim "
                             f"(mscale {m}, mscale_all_dim {m_all}); GGUF keeps only yarn_log_multiplier = 0.1 * "
                             f"mscale_all_dim")
        if float(m) != float(m_all):
            # transformers then scales cos / sin by get_mscale(factor, mscale) / get_mscale(factor,
            # mscale_all_dim); the GGUF keeps 0.1 * mscale_all_dim only (as ik's converter), so the file
            # would compute another model's attention (0.7 % off on a tiny V3, RESULTS §22ai's probe).
            # Every released DeepSeek, Kimi and GLM config has the two equal.
            raise ValueError(f"unsupported rope scaling for deepseek2: mscale {m} differs from mscale_all_dim {m_all} "
                             f"(GGUF keeps only yarn_log_multiplier = 0.1 * mscale_all_dim)")
        kv += [
            (f"{a}.rope.scaling.type", "yarn", VT.STRING),
            (f"{a}.rope.scaling.factor", float(rs["factor"]), VT.FLOAT32),
            (f"{a}.rope.scaling.original_context_length", int(rs["original_max_position_embeddings"]), VT.UINT32),
            (f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * float(rs.get("mscale_all_dim") or 0.0), VT.FLOAT32),
        ]
        # mainline's converter writes the betas the config gives; here only where they differ from
        # YaRN's defaults (32, 1), so files of the usual DeepSeek configs stay byte for byte ik's.
        # Kimi K2 has beta_fast = beta_slow = 1: without the keys its rope would be another model's
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            if rs.get(key) is not None and float(rs[key]) != default:
                kv.append((f"{a}.rope.scaling.yarn_{key}", float(rs[key]), VT.FLOAT32))
    elif rs is not None:
        raise ValueError(f"unsupported rope scaling for deepseek2: {rs}")
    return kv


def _trailing_metadata(cfg: Mapping[str, Any], layout: str, mtp_layers: bool = False) -> list[tuple[str, Any, VT]]:
    """Keys written after the tokenizer block (where mainline / group-routing files carry them):
    the per-head MLA sizes (mainline layout), group routing, the MTP layer count, and DeepSeek
    V3.2's sparse-attention indexer sizes (`index_n_heads` in the config)."""
    a = ARCH
    kv: list[tuple[str, Any, VT]] = [("general.quantization_version", gguf.GGML_QUANT_VERSION, VT.UINT32)]
    if mtp_layers and mtp_layer_count(cfg):
        kv.append((f"{a}.nextn_predict_layers", mtp_layer_count(cfg), VT.UINT32))
    if cfg.get("index_n_heads"):
        kv += [(f"{a}.attention.indexer.head_count", int(cfg["index_n_heads"]), VT.UINT32),
               (f"{a}.attention.indexer.key_length", int(cfg["index_head_dim"]), VT.UINT32),
               (f"{a}.attention.indexer.top_k", int(cfg["index_topk"]), VT.UINT32)]
    if layout == "mainline":
        kv += [
            (f"{a}.attention.key_length_mla", int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]), VT.UINT32),
            (f"{a}.attention.value_length_mla", int(cfg["v_head_dim"]), VT.UINT32),
        ]
    if (groups := _group_routing(cfg)) is not None:
        kv += [
            (f"{a}.expert_group_count", groups[0], VT.UINT32),
            (f"{a}.expert_group_used_count", groups[1], VT.UINT32),
        ]
    return kv


# ----------------------------------------------------------------------------------------------
# tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map (insertion order = GPT-2's token order)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
# DeepSeek V3 / R1's tool-call tokens, control tokens as ik's converter types them (their text looks
# special: `<｜...｜>`), so a synthetic model's tool calls tokenize and detokenize as a real one's
TOOL_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
               "<｜tool▁output▁end｜>")


def _synth_vocab(vocab_size: int) -> dict[str, Any]:
    """Byte-level BPE vocab of exactly ``vocab_size`` tokens: 3 specials, 256 bytes, DeepSeek's tool
    tokens (control), then merges."""
    tokens = list(SPECIAL_TOKENS)
    types = [int(gguf.TokenType.CONTROL)] * len(tokens)
    byte_toks = list(bytes_to_unicode().values())
    tokens += byte_toks
    types += [int(gguf.TokenType.NORMAL)] * len(byte_toks)
    tokens += TOOL_TOKENS
    types += [int(gguf.TokenType.CONTROL)] * len(TOOL_TOKENS)
    merges: list[str] = []
    seen = set(tokens)
    want = vocab_size - len(tokens)
    for x in byte_toks:
        if len(merges) >= want:
            break
        for y in byte_toks:
            if len(merges) >= want:
                break
            if x + y in seen:
                continue
            seen.add(x + y)
            merges.append(f"{x} {y}")
            tokens.append(x + y)
            types.append(int(gguf.TokenType.NORMAL))
    return {"tokens": tokens[:vocab_size], "token_type": types[:vocab_size], "merges": merges}


def vocab_from_tokenizer_json(path: str | Path) -> dict[str, Any]:
    """Vocab dict (tokens, token_type, merges) from a Hugging Face byte-level BPE ``tokenizer.json``."""
    import json
    tj = json.loads(Path(path).read_text(encoding="utf-8"))
    model = tj["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(gguf.TokenType.UNUSED)] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "token_type": types, "merges": merges}


def tokenizer_metadata(vocab_size: int, vocab: Mapping[str, Any] | None = None, *,
                       bos_token_id: int | None = 0, eos_token_id: int | None = 1,
                       pad_token_id: int | None = 2, pre: str = "deepseek-v3") -> list[tuple[str, Any, VT]]:
    """``tokenizer.ggml.*`` keys: model gpt2, pre, tokens, token_type, merges, bos/eos/pad ids.

    ``vocab``: ``{"tokens": [...], "token_type": [...] (optional), "merges": [...] (optional)}``;
    padded with ``[PADi]`` (UNUSED) tokens up to ``vocab_size``. Default: synthesized byte-level BPE.
    """
    v = dict(vocab) if vocab is not None else _synth_vocab(vocab_size)
    tokens = list(v["tokens"])
    types = list(v.get("token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens))
    if len(tokens) < vocab_size:
        types += [int(gguf.TokenType.UNUSED)] * (vocab_size - len(tokens))
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    kv: list[tuple[str, Any, VT]] = [
        ("tokenizer.ggml.model", "gpt2", VT.STRING),
        ("tokenizer.ggml.pre", v.get("pre", pre), VT.STRING),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY),
        ("tokenizer.ggml.token_type", [int(t) for t in types], VT.ARRAY),
    ]
    if v.get("merges"):
        kv.append(("tokenizer.ggml.merges", list(v["merges"]), VT.ARRAY))
    for key, tid in (("bos", bos_token_id), ("eos", eos_token_id), ("padding", pad_token_id)):
        if tid is not None:
            kv.append((f"tokenizer.ggml.{key}_token_id", int(tid), VT.UINT32))
    return kv


# ----------------------------------------------------------------------------------------------
# tensors


def unfuse_experts(sd: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers 5.x in-memory experts (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj
    [E, H, I]``) -> checkpoint names ``experts.{e}.{gate,up,down}_proj.weight``."""
    out: dict[str, np.ndarray] = {}
    for k, t in sd.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", k)
        if m is None:
            out[k] = t
            continue
        prefix, what = m.groups()
        for e in range(t.shape[0]):
            if what == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                inter = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
    return out


def _split_kv_b(kv_b: np.ndarray, cfg: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``W_kv_b [H*(nope+v), r]`` -> ``k_b [H, r, nope]`` (transposed), ``v_b [H, v, r]``."""
    n_head = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    r = kv_b.shape[-1]
    assert kv_b.shape[0] == n_head * (nope + v), kv_b.shape
    per_head = kv_b.reshape(n_head, nope + v, r)
    k_b = np.ascontiguousarray(per_head[:, :nope, :].transpose(0, 2, 1))
    v_b = np.ascontiguousarray(per_head[:, nope:, :])
    return k_b, v_b


def deepseek2_tensors(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray], *,
                      layout: str = "all", mtp_layers: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(gguf_name, float32 array)`` in ik's converter order for the given MLA layout.

    Array shapes are NumPy (row-major) shapes: GGUF's ``ne`` is their reverse.
    ``state_dict`` maps HF names to arrays; experts may be per-expert (checkpoint names) or fused
    (transformers 5.x module names). ``mtp_layers``: the config's MTP layers (``model.layers.N`` for N
    past ``num_hidden_layers``) are written as ``blk.N.*`` with their ``nextn.*`` tensors; else skipped.
    """
    if layout not in LAYOUTS:
        raise OptionError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    sd = unfuse_experts(state_dict)
    n_layer = int(cfg["num_hidden_layers"]) + (mtp_layer_count(cfg) if mtp_layers else 0)
    n_main = int(cfg["num_hidden_layers"])
    n_expert = int(cfg["n_routed_experts"])
    pending: dict[int, dict[str, np.ndarray]] = {}
    for name in sorted(sd):  # safetensors stores tensors sorted by name
        data = np.asarray(sd[name], dtype=np.float32)
        if name.endswith(".rotary_emb.inv_freq"):
            continue
        if name in _GLOBAL_MAP:
            yield _GLOBAL_MAP[name], data
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"Can not map tensor {name!r}")
        bid, rest = int(m.group(1)), m.group(2)
        if bid >= n_layer:  # multi-token-prediction layers: skipped, as ik's converter does
            continue
        if re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest):
            pending.setdefault(bid, {})[rest] = data
            if len(pending[bid]) >= 3 * n_expert:
                exps = pending.pop(bid)
                for w in ("down_proj", "gate_proj", "up_proj"):
                    stacked = np.stack([exps[f"mlp.experts.{e}.{w}.weight"] for e in range(n_expert)])
                    yield f"blk.{bid}.ffn_{w.split('_')[0]}_exps.weight", stacked
            continue
        if rest == "mlp.gate.e_score_correction_bias":
            yield f"blk.{bid}.exp_probs_b.bias", data
            continue
        module, _, suffix = rest.rpartition(".")
        if bid >= n_main and module in _NEXTN_MAP and suffix == "weight":
            yield f"blk.{bid}.{_NEXTN_MAP[module]}.weight", data
            continue
        if module not in _LAYER_MAP or suffix not in ("weight", "bias"):
            raise ValueError(f"Can not map tensor {name!r}")
        base = f"blk.{bid}.{_LAYER_MAP[module]}"
        if _LAYER_MAP[module] != "attn_kv_b":
            yield f"{base}.{suffix}", data
            continue
        k_b, v_b = _split_kv_b(data, cfg)
        if layout in ("all", "kvb"):
            yield f"{base}.weight", data
        if layout == "all":  # ik's converter: 2-D [H*r, nope] and [H*v, r]
            yield f"blk.{bid}.attn_k_b.weight", k_b.reshape(-1, k_b.shape[-1])
            yield f"blk.{bid}.attn_v_b.weight", v_b.reshape(-1, v_b.shape[-1])
        elif layout == "mainline":  # 3-D [H, r, nope] and [H, v, r]
            yield f"blk.{bid}.attn_k_b.weight", k_b
            yield f"blk.{bid}.attn_v_b.weight", v_b
    if pending:
        raise ValueError(f"Unprocessed experts in blocks {sorted(pending)}")


def quantize_tensor(name: str, data: np.ndarray, qtype: str | QT,
                    keep_f32: tuple[str, ...] = ("ffn_gate_inp",)) -> tuple[np.ndarray, QT]:
    """Converter rules: 1-D, ``*_norm.weight``, non-``.weight`` and ``keep_f32`` tensors stay F32;
    block types apply only where the row length divides the block. Returns (raw data, type)."""
    qt = _writable(qtype)
    if (data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or any(f".{k}." in name for k in keep_f32)):
        qt = QT.F32
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if data.shape[-1] % block != 0:
        qt = QT.F32
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qt), qt


# ----------------------------------------------------------------------------------------------
# writing


SHARD_FORMAT = "{stem}-{no:05d}-of-{count:05d}.gguf"


def shard_paths(path: str | Path, n_shards: int) -> list[Path]:
    """File names gguf-split uses for ``n_shards`` shards of ``path`` (``path`` itself when 1)."""
    p = Path(path)
    if n_shards <= 1:
        return [p]
    return [p.with_name(SHARD_FORMAT.format(stem=p.stem, no=i + 1, count=n_shards)) for i in range(n_shards)]


def _size_label(tensors: list[tuple[str, tuple[int, ...]]]) -> str:
    total = shared = expert = 0
    n_exp_sum = n_exp_t = 0
    for name, shape in tensors:
        size = math.prod(shape)
        total += size
        if "_exps." in name and len(shape) >= 3:
            expert += size // shape[0]
            n_exp_sum += shape[0]
            n_exp_t += 1
        else:
            shared += size
    return gguf.size_label(total, shared, expert, n_exp_sum // n_exp_t if n_exp_t else 0)


def write_deepseek2_gguf(path: str | Path, hf_config: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                         *, layout: str = "all", qtype: str | QT = "F32",
                         vocab: Mapping[str, Any] | None = None, name: str | None = None,
                         split_max_tensors: int = 0, keep_f32: tuple[str, ...] = ("ffn_gate_inp",),
                         mtp_layers: bool = False, pre: str = "deepseek-v3") -> list[Path]:
    """Write a deepseek2 GGUF (one file, or gguf-split shards) and return the written paths.

    hf_config: the transformers config as a dict (``config.to_dict()`` or ``config.json``).
    state_dict: HF tensor name -> float32 NumPy array.
    layout: "all" | "kvb" | "mainline" (see module doc). qtype: "F32", "F16", "BF16", "Q8_0", "Q4_0", ...
    vocab: optional ``{"tokens", "token_type", "merges"}``; default a synthesized byte-level BPE.
    split_max_tensors: > 0 writes ``<stem>-0000i-of-0000N.gguf`` shards of at most that many tensors,
    the first holding all metadata, every shard ``split.no``/``split.count``/``split.tensors.count``.
    keep_f32: GGUF tensor base names that stay F32 whatever ``qtype`` (ik's converter: ffn_gate_inp).
    mtp_layers: write the config's MTP layers (``num_nextn_predict_layers``) as mainline's converter
    does for GLM-4.7-Flash. pre: ``tokenizer.ggml.pre`` (the model family's pre-tokenizer).
    """
    path = Path(path)
    cfg = dict(hf_config)
    _writable(qtype)  # refuse before any tensor is converted or any byte written
    tensors = [(n, *quantize_tensor(n, d, qtype, keep_f32), d.shape)
               for n, d in deepseek2_tensors(cfg, state_dict, layout=layout, mtp_layers=mtp_layers)]
    # size label as ik's converter computes it for layout "all" (the other layouts' fixtures are
    # rewrites of that file and keep its label): k_b + v_b hold as many weights as kv_b
    shapes = [(n, shape) for n, _, _, shape in tensors]
    if layout != "all":
        shapes += [(n, shape) for n, shape in shapes if n.endswith(".attn_kv_b.weight")]
        shapes += [(n.replace("attn_k_b", "attn_kv_b"), shape) for n, shape in shapes
                   if n.endswith((".attn_k_b.weight", ".attn_v_b.weight"))]
    label = _size_label(shapes)

    writer = gguf.GGUFWriter(None, ARCH, split_max_tensors=split_max_tensors)
    kv = deepseek2_metadata(cfg, layout=layout, qtype=qtype, name=name, size_label=label, mtp_layers=mtp_layers)
    kv += tokenizer_metadata(int(cfg["vocab_size"]), vocab, pre=pre,
                             bos_token_id=cfg.get("bos_token_id", 0),
                             eos_token_id=_first(cfg.get("eos_token_id", 1)),
                             pad_token_id=cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None
                             else (2 if vocab is None else None))
    kv += _trailing_metadata(cfg, layout, mtp_layers)
    for key, val, vtype in kv:
        if vtype == VT.ARRAY:
            writer.add_array(key, val)
        else:
            writer.add_key_value(key, val, vtype)
    for tname, raw, qt, _shape in tensors:
        writer.add_tensor(tname, raw, raw_dtype=qt)

    paths = shard_paths(path, len(writer.tensors))
    # all or nothing: shards are written in a temporary directory beside the target and moved
    # into place once the last byte is written; any failure or interrupt removes them
    needed = sum(raw.nbytes for _, raw, _, _ in tensors) + (1 << 20)
    with atomic_write_dir(path, needed, what="output") as tmpdir:
        try:
            writer.write_header_to_file(tmpdir / path.name)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        except OSError as e:
            raise OptionError(f"output: writing {path} failed: {e.strerror or e}") from None
        finally:
            writer.close()
    return paths


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) else x
