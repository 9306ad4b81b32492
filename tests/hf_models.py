"""Tiny random Hugging Face DeepSeek V2/V3 models: the oracle the tests compare ikjax against.

``make_model(variant, seed=...)`` returns ``(hf_model, hf_config_dict, state_dict_numpy)``:
- ``hf_model``: ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (transformers), f32, eval mode,
  eager attention, seeded random weights (normal std ``std``; RMSNorm weights ``1 + N(0, 0.1)``;
  V3 ``e_score_correction_bias`` ``N(0, 0.1)``, never zero).
- ``hf_config_dict``: ``config.to_dict()`` plus the legacy keys real checkpoints carry and ik's
  converter reads (``rope_theta``, ``rope_scaling`` with ``type``, ``scoring_func``, ``topk_method``).
- ``state_dict_numpy``: checkpoint-style names (routed experts per expert:
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``) -> float32 arrays.

Variants (see ``VARIANTS``):
- ``v2lite``: V2-Lite style: no q_lora_rank (direct ``q_proj``), softmax gating, greedy, no norm,
  2 shared experts, one leading dense layer, plain RoPE.
- ``v2group``: V2 (full) style routing: softmax, ``group_limited_greedy`` over 4 groups, top 2 groups.
- ``v3``: V3 style: q_lora_rank, sigmoid + ``e_score_correction_bias``, 4 groups / top 2,
  ``norm_topk_prob``, ``routed_scaling_factor`` 2.5, YaRN (factor 4, original context 1024 of 4096,
  mscale = mscale_all_dim = 0.707, as in DeepSeek-V2's config).
- ``v3dense2``: ``v3`` with ``first_k_dense_replace = 2`` and 4 layers.
- ``v3h128``: ``v3`` with 128 heads (tiny per-head sizes: nope 16, rope 16, v 16).
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # the tests run without ikjax installed
    sys.path.insert(0, _REPO)

_BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    attention_bias=False,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "v2lite": dict(
        arch="v2", q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "v2group": dict(
        arch="v2", q_lora_rank=None, n_shared_experts=1, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "v3": dict(
        arch="v3", q_lora_rank=96, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
}
VARIANTS["v3dense2"] = dict(VARIANTS["v3"], first_k_dense_replace=2, num_hidden_layers=4)

# The deepseek2-GGUF families beyond DeepSeek's own (issue 27), tiny, each with the dims that set it
# apart from V3 kept as they are where they are per-head sizes or ratios the kernels see:
# - kimi: Kimi K2 (DeepseekV3 class): 64 heads, 384 experts in one group, 8 used + 1 shared,
#   norm, x2.827, YaRN factor 32 with beta_fast = beta_slow = 1 (K2's config), rope base 50000.
# - glm47: GLM-4.7-Flash (transformers' own Glm4MoeLite class): 20 heads, q_lora, the latent of
#   every real model (512 + 64) and GLM's per-head sizes nope 192 / v 256 (v wider than nope),
#   64 experts, 4 used + 1 shared, sigmoid + bias, norm, x1.8, rope base 1e6, no YaRN.
# - moonlight: Moonlight-16B-A3B (DeepseekV3 class): V2-Lite's attention (no q_lora, 16 heads)
#   with V3 routing (sigmoid + bias, one group, norm), 2 shared, x2.446, rope base 50000.
# - v2full: DeepSeek V2 / V2.5 (DeepseekV2 class): q_lora, softmax routing over 160 experts in 8
#   groups (top 3 groups), 6 used + 2 shared, no norm, x16, YaRN factor 40 mscale 0.707.
# - v32: DeepSeek V3.2 (transformers' DeepseekV32 class, its lightning indexer included): with
#   fewer tokens than the indexer's top-k every key is selected, so dense attention is exact.
# - gigachat: GigaChat3 (DeepseekV3 class): no q_lora at a layer count other than 27, V3 routing.
VARIANTS["kimi"] = dict(
    arch="v3", q_lora_rank=96, num_attention_heads=64, num_key_value_heads=64, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=64, n_routed_experts=384, num_experts_per_tok=8,
    moe_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.827,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)
VARIANTS["glm47"] = dict(
    arch="glm4lite", q_lora_rank=96, num_attention_heads=20, num_key_value_heads=20, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, kv_lora_rank=512, n_routed_experts=64, num_experts_per_tok=4,
    moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.8, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
VARIANTS["moonlight"] = dict(
    arch="v3", q_lora_rank=None, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
    num_experts_per_tok=6, moe_intermediate_size=32, n_shared_experts=2, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
)
VARIANTS["v2full"] = dict(
    arch="v2", q_lora_rank=96, n_routed_experts=160, num_experts_per_tok=6, moe_intermediate_size=16,
    n_shared_experts=2, n_group=8, topk_group=3, topk_method="group_limited_greedy", norm_topk_prob=False,
    routed_scaling_factor=16.0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 0.707, "mscale_all_dim": 0.707},
)
VARIANTS["v32"] = dict(VARIANTS["v3"], arch="v32", index_n_heads=4, index_head_dim=32, index_topk=2048)
VARIANTS["gigachat"] = dict(
    arch="v3", q_lora_rank=None, num_hidden_layers=4, n_routed_experts=16, num_experts_per_tok=4,
    n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
VARIANTS["v3h128"] = dict(VARIANTS["v3"], num_attention_heads=128, num_key_value_heads=128, qk_nope_head_dim=16,
                          qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=64, q_lora_rank=64)


def _classes(arch: str):
    """(config class, model class) of transformers for a variant's `arch`."""
    import transformers as t
    return {"v2": (t.DeepseekV2Config, t.DeepseekV2ForCausalLM), "v3": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM),
            "v32": (t.DeepseekV32Config, t.DeepseekV32ForCausalLM),
            "glm4lite": (t.Glm4MoeLiteConfig, t.Glm4MoeLiteForCausalLM)}[arch]


_MODEL_TYPE_ARCH = {"deepseek_v2": "v2", "deepseek_v3": "v3", "deepseek_v32": "v32", "glm4_moe_lite": "glm4lite"}


def build_config(variant: str, **overrides: Any):
    """The transformers config object for a variant (overrides win)."""
    kw = dict(_BASE)
    kw.update(copy.deepcopy(VARIANTS[variant]))
    kw.update(overrides)
    arch = kw.pop("arch")
    kw.pop("topk_method", None) if arch != "v2" else None
    if arch == "glm4lite":  # its layer pattern is mlp_layer_types
        dense = kw.pop("first_k_dense_replace")
        kw["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (kw["num_hidden_layers"] - dense)
    cls = _classes(arch)[0]
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def config_dict(cfg) -> dict[str, Any]:
    """``cfg.to_dict()`` plus the legacy keys real DeepSeek checkpoints carry (what ik's converter reads)."""
    d = cfg.to_dict()
    is_v3 = d.get("model_type") == "deepseek_v3"
    rp = dict(d.get("rope_parameters") or {})
    d["rope_theta"] = rp.get("rope_theta", 10000.0)
    if rp.get("rope_type", "default") != "default":
        d["rope_scaling"] = {"type": rp["rope_type"], **{k: v for k, v in rp.items() if k not in ("rope_type", "rope_theta")}}
    is_v3 = is_v3 or d.get("model_type") in ("deepseek_v32", "glm4_moe_lite")
    d["scoring_func"] = "sigmoid" if is_v3 else "softmax"
    d["topk_method"] = "noaux_tc" if is_v3 else d.get("topk_method", "greedy")
    return d


@torch.no_grad()
def _randomize(model, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_model(variant: str = "v3", *, seed: int = 0, std: float = 0.05, **overrides: Any):
    """Build a seeded random tiny model. Returns ``(hf_model, hf_config_dict, state_dict_numpy)``."""
    cfg = build_config(variant, **overrides)
    torch.manual_seed(seed)
    cls = _classes(_MODEL_TYPE_ARCH[cfg.model_type])[1]
    model = cls(cfg).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    _randomize(model, seed, std)
    return model, config_dict(model.config), state_dict_numpy(model)


def make_model_from_config(hf_config: dict[str, Any], *, seed: int = 0, std: float = 0.05):
    """Like :func:`make_model` for a given ``config.json`` dict (e.g. a fixture's ``hf_config.json``);
    the returned config dict is the one given."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)
    v3 = hf_config.get("model_type") == "deepseek_v3"
    cfg = (DeepseekV3Config if v3 else DeepseekV2Config).from_dict(dict(hf_config))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM)(cfg).to(torch.float32).eval()
    _randomize(model, seed, std)
    return model, dict(hf_config), state_dict_numpy(model)


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    """Checkpoint-style state dict (per-expert names) as float32 NumPy arrays."""
    from ikjax.gguf_io.writer import unfuse_experts
    sd = {k: v.detach().to(torch.float32).cpu().numpy().copy() for k, v in model.state_dict().items()
          if not k.endswith("inv_freq")}
    return unfuse_experts(sd)


@torch.no_grad()
def set_weights(model, sd: dict[str, np.ndarray]) -> None:
    """Load a checkpoint-style NumPy state dict (per-expert or fused names) into ``model``; every
    model tensor must be given."""
    params = dict(model.state_dict())
    fused: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    done = set()
    for k, v in sd.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", k)
        if m:
            fused.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
            continue
        params[k].copy_(torch.from_numpy(np.asarray(v, dtype=np.float32)).reshape(params[k].shape))
        done.add(k)
    for prefix, per_e in fused.items():
        n = len(per_e)
        gate_up = np.stack([np.concatenate([per_e[e]["gate_proj"], per_e[e]["up_proj"]], 0) for e in range(n)])
        down = np.stack([per_e[e]["down_proj"] for e in range(n)])
        params[f"{prefix}.gate_up_proj"].copy_(torch.from_numpy(gate_up))
        params[f"{prefix}.down_proj"].copy_(torch.from_numpy(down))
        done |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    missing = [k for k in params if k not in done and not k.endswith("inv_freq")]
    if missing:
        raise KeyError(f"set_weights: no value for {missing[:5]}")


@torch.no_grad()
def hf_logits(model, token_ids) -> np.ndarray:
    """All-position logits ``[n_tokens, n_vocab]`` (float32) of a fresh sequence."""
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


# GGUF name (blk.N. stripped) -> HF module path, the inverse of the writer's map
_INV = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def gguf_state_dict(paths, hf_config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Read GGUF file(s) back into a checkpoint-style HF state dict, every tensor dequantized with
    ``gguf.quants.dequantize``. ``attn_kv_b`` is taken from the file, else rebuilt from
    ``attn_k_b``/``attn_v_b`` (2-D or 3-D)."""
    import gguf
    if not isinstance(paths, (list, tuple)):
        paths = [paths]
    raw: dict[str, np.ndarray] = {}
    for p in paths:
        for t in gguf.GGUFReader(p).tensors:
            shape = tuple(int(x) for x in reversed(t.shape))
            raw[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    H = int(hf_config["num_attention_heads"])
    nope, v = int(hf_config["qk_nope_head_dim"]), int(hf_config["v_head_dim"])
    r = int(hf_config["kv_lora_rank"])
    out: dict[str, np.ndarray] = {}
    glob = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
    for name, a in raw.items():
        if name in glob:
            out[glob[name]] = a
            continue
        bid, base, suffix = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name).groups()
        pre = f"model.layers.{bid}"
        if base == "exp_probs_b":
            out[f"{pre}.mlp.gate.e_score_correction_bias"] = a
        elif base.endswith("_exps"):
            w = base.split("_")[1]
            for e in range(a.shape[0]):
                out[f"{pre}.mlp.experts.{e}.{w}_proj.weight"] = a[e]
        elif base in ("attn_k_b", "attn_v_b"):
            continue
        else:
            out[f"{pre}.{_INV[base]}.{suffix}"] = a
    for bid in range(int(hf_config["num_hidden_layers"])):
        key = f"model.layers.{bid}.self_attn.kv_b_proj.weight"
        if key in out:
            continue
        k_b = raw[f"blk.{bid}.attn_k_b.weight"].reshape(H, r, nope)
        v_b = raw[f"blk.{bid}.attn_v_b.weight"].reshape(H, v, r)
        out[key] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(H * (nope + v), r)
    return out


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
