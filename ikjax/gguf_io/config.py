"""ModelConfig: the deepseek2 hyper-parameters, read from GGUF metadata under either key convention.

Per-head convention (ik's converter, older files): `key_length = nope + rope`, `value_length = v`.
Mainline convention (llama.cpp since 2025): `head_count_kv = 1`, `key_length = r + rope`,
`value_length = r`, and the per-head sizes in `key_length_mla` / `value_length_mla`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ikjax.errors import ModelFileError

ARCH = "deepseek2"
GATING_SOFTMAX, GATING_SIGMOID = 1, 2


@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_context: int
    log_multiplier: float  # GGUF stores 0.1 * mscale_all_dim
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @property
    def mscale(self) -> float:
        """Attention temperature: 1 + log_multiplier * ln(factor) (transformers' yarn_get_mscale)."""
        if self.factor <= 1.0:
            return 1.0
        return 1.0 + self.log_multiplier * math.log(self.factor)


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    d_model: int
    n_head: int
    q_lora_rank: int  # 0: direct q projection (V2-Lite)
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    vocab_size: int
    ffn_dim: int  # dense layers
    expert_ffn_dim: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_expert_group: int
    n_expert_group_used: int
    n_dense_lead: int
    expert_weights_scale: float
    expert_weights_norm: bool
    gating: int
    rms_eps: float
    rope_base: float
    yarn: YarnConfig | None
    context_length: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache entry: kv_lora_rank + rope (576 for V2/V3/R1)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def softmax_scale(self) -> float:
        m = self.yarn.mscale if self.yarn else 1.0
        return m * m / math.sqrt(self.qk_dim)

    def is_moe_layer(self, i: int) -> bool:
        return self.n_expert > 0 and i >= self.n_dense_lead

    @classmethod
    def from_metadata(cls, md: dict[str, Any], *, source: str = "GGUF", vocab_from_tensor: int | None = None
                      ) -> "ModelConfig":
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise ModelFileError(f"{source}: unsupported architecture {arch!r} (ikjax runs {ARCH!r})")

        def get(key: str, default: Any = ModelFileError):
            full = f"{ARCH}.{key}"
            if full in md:
                return md[full]
            if default is ModelFileError:
                raise ModelFileError(f"{source}: missing metadata key {full}")
            return default

        n_head = int(get("attention.head_count"))
        rope_dim = int(get("rope.dimension_count"))
        r = int(get("attention.kv_lora_rank"))
        if f"{ARCH}.attention.key_length_mla" in md:
            qk_dim = int(get("attention.key_length_mla"))
            v_dim = int(get("attention.value_length_mla"))
        else:
            qk_dim = int(get("attention.key_length"))
            v_dim = int(get("attention.value_length"))
            if int(get("attention.head_count_kv", n_head)) == 1 and qk_dim == r + rope_dim:
                raise ModelFileError(f"{source}: head_count_kv = 1 layout without key_length_mla/value_length_mla")
        yarn = None
        if str(get("rope.scaling.type", "none")) == "yarn":
            yarn = YarnConfig(
                factor=float(get("rope.scaling.factor")),
                original_context=int(get("rope.scaling.original_context_length")),
                log_multiplier=float(get("rope.scaling.yarn_log_multiplier", 0.0)),
                beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            )
        n_expert = int(get("expert_count", 0))
        vocab = get("vocab_size", None)
        if vocab is None:
            toks = md.get("tokenizer.ggml.tokens")
            vocab = len(toks) if toks is not None else vocab_from_tensor
        if vocab is None:
            raise ModelFileError(f"{source}: cannot tell the vocabulary size")
        bos, eos = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
        cfg = cls(
            n_layer=int(get("block_count")),
            d_model=int(get("embedding_length")),
            n_head=n_head,
            q_lora_rank=int(get("attention.q_lora_rank", 0)),
            kv_lora_rank=r,
            rope_dim=rope_dim,
            nope_dim=qk_dim - rope_dim,
            v_dim=v_dim,
            vocab_size=int(vocab),
            ffn_dim=int(get("feed_forward_length")),
            expert_ffn_dim=int(get("expert_feed_forward_length", 0)),
            n_expert=n_expert,
            n_expert_used=int(get("expert_used_count", 0)),
            n_expert_shared=int(get("expert_shared_count", 0)),
            n_expert_group=int(get("expert_group_count", 1)) or 1,
            n_expert_group_used=int(get("expert_group_used_count", 1)) or 1,
            n_dense_lead=int(get("leading_dense_block_count", 0 if n_expert else 1 << 30)),
            expert_weights_scale=float(get("expert_weights_scale", 1.0)),
            expert_weights_norm=bool(get("expert_weights_norm", False)),
            gating=int(get("expert_gating_func", GATING_SOFTMAX)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_base=float(get("rope.freq_base", 10000.0)),
            yarn=yarn,
            context_length=int(get("context_length", 4096)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str) -> None:
        if self.nope_dim <= 0 or self.v_dim <= 0 or self.rope_dim % 2:
            raise ModelFileError(f"{source}: impossible head sizes nope={self.nope_dim} rope={self.rope_dim} v={self.v_dim}")
        if self.gating not in (GATING_SOFTMAX, GATING_SIGMOID):
            raise ModelFileError(f"{source}: unknown expert_gating_func {self.gating}")
        if self.n_expert:
            if not 0 < self.n_expert_used <= self.n_expert:
                raise ModelFileError(f"{source}: expert_used_count {self.n_expert_used} of {self.n_expert} experts")
            if self.n_expert % self.n_expert_group or self.n_expert_group_used > self.n_expert_group:
                raise ModelFileError(f"{source}: {self.n_expert} experts do not split into "
                                     f"{self.n_expert_group} groups (use {self.n_expert_group_used})")
