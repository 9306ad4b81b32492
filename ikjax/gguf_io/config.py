"""ModelConfig: the deepseek2 hyper-parameters, read from GGUF metadata under either key convention.

Per-head convention (ik's converter, older files): `key_length = nope + rope`, `value_length = v`.
Mainline convention (llama.cpp since 2025): `head_count_kv = 1`, `key_length = r + rope`,
`value_length = r`, and the per-head sizes in `key_length_mla` / `value_length_mla`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ikjax.errors import ModelFileError
from ikjax.gguf_io.tensors import all_specs, check_shapes, layer_specs

ARCH = "deepseek2"
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
_REQUIRED = object()  # marks a metadata key without a default


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
    n_nextn: int = 0  # trailing MTP layers of block_count (nextn_predict_layers), not run: n_layer excludes them

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
    def from_metadata(cls, md: dict[str, Any], *, source: str = "GGUF", vocab_from_tensor: int | None = None,
                      tensors: Mapping[str, Any] | None = None,
                      file_tensors: Mapping[str, Any] | None = None) -> "ModelConfig":
        """The config a file's metadata describes, every key checked for its GGUF type and range (the
        error names the key). With `tensors` (the file's tensor table), also checks that the table is
        exactly this model's: layers 0..block_count-1, every tensor it reads of the right shape, and
        nothing it would ignore. `file_tensors` (or `tensors`): the file's tensor table, unchecked, which
        settles what the metadata leaves open or gets wrong: the gating function of a file without
        the key, the per-head key size of a file whose key_length is the rope size."""
        table = tensors if tensors is not None else (file_tensors or {})
        arch = md.get("general.architecture")
        if arch != ARCH:
            raise ModelFileError(f"{source}: unsupported architecture {arch!r} (ikjax runs {ARCH!r})")
        _check_key_names(md, source)
        m = _Meta(md, source)
        n_head = m.int("attention.head_count", lo=1)
        rope_dim = m.int("rope.dimension_count", lo=2)
        r = m.int("attention.kv_lora_rank", lo=1)
        if m.has("attention.key_length_mla"):
            qk_dim = m.int("attention.key_length_mla", lo=1)
            v_dim = m.int("attention.value_length_mla", lo=1)
        else:
            qk_dim = m.int("attention.key_length", lo=1)
            v_dim = m.int("attention.value_length", lo=1)
            if m.int("attention.head_count_kv", n_head, lo=1) == 1 and qk_dim == r + rope_dim:
                raise ModelFileError(f"{source}: head_count_kv = 1 layout without key_length_mla/value_length_mla")
            if qk_dim <= rope_dim:
                qk_dim = _qk_dim_from_tensors(table, n_head) or qk_dim
        m.int("attention.head_count_kv", n_head, lo=1)
        yarn = None
        rope_base = m.float("rope.freq_base", 10000.0, positive=True)
        scaling = m.str("rope.scaling.type", "none")
        if scaling == "yarn":
            yarn = YarnConfig(
                factor=m.float("rope.scaling.factor", positive=True),
                original_context=m.int("rope.scaling.original_context_length", lo=1),
                log_multiplier=m.float("rope.scaling.yarn_log_multiplier", 0.0),
                # Kimi K2's config has beta_fast = beta_slow = 1; a file without the keys (ik's
                # converter drops them) would run it as another model with YaRN's 32 / 1
                beta_fast=m.float("rope.scaling.yarn_beta_fast", 1.0 if _kimi_without_betas(md) else 32.0,
                                  positive=True),  # (0 divided by zero, a negative one was a math domain error)
                beta_slow=m.float("rope.scaling.yarn_beta_slow", 1.0, positive=True),
            )
            if rope_base <= 1.0:  # YaRN's correction range divides by log(freq_base)
                raise ModelFileError(f"{source}: {ARCH}.rope.freq_base is {rope_base}: YaRN needs a base above 1")
        elif scaling != "none":
            raise ModelFileError(f"{source}: {ARCH}.rope.scaling.type {scaling!r} is not supported (none or yarn)")
        elif m.float("rope.scaling.factor", 1.0, positive=True) != 1.0:
            raise ModelFileError(f"{source}: {ARCH}.rope.scaling.factor is set but {ARCH}.rope.scaling.type is not")
        # absent: 0 (dense), unless the file has routed experts: their first dim then says how many
        n_expert = m.int("expert_count", _experts_in(table) or 0, lo=0)
        vocab = m.int("vocab_size", None, lo=1)
        toks = md.get("tokenizer.ggml.tokens")
        if toks is not None:
            if isinstance(toks, (str, bytes)) or not hasattr(toks, "__len__") or (
                    len(toks) and not isinstance(toks[0], str)):
                raise ModelFileError(f"{source}: tokenizer.ggml.tokens: expected an array of strings, "
                                     f"got {_kind(toks)}")
            if vocab is not None and len(toks) != vocab:
                raise ModelFileError(f"{source}: tokenizer.ggml.tokens has {len(toks)} tokens but "
                                     f"{ARCH}.vocab_size is {vocab}")
            vocab = vocab or len(toks)
        vocab = vocab or vocab_from_tensor
        if not vocab:
            raise ModelFileError(f"{source}: cannot tell the vocabulary size")
        special = _special_token_ids(md, source, vocab, toks)
        block_count = m.int("block_count", lo=1)
        nextn = m.int("nextn_predict_layers", 0, lo=0)
        if nextn >= block_count:
            raise ModelFileError(f"{source}: {ARCH}.nextn_predict_layers {nextn} leaves no layers of "
                                 f"{ARCH}.block_count {block_count}")
        gating = m.int("expert_gating_func", 0, lo=0)
        if not gating:
            # no key (or 0, "none"): DeepSeek V2 / V2.5 files from before the key existed are softmax
            # (llama.cpp's reading), but GLM-4.7-Flash files from early converters lack it too and
            # are sigmoid: ik tells them apart by layer count (47 or 48); the file's content says it
            # without guessing: selection biases (exp_probs_b) exist only beside sigmoid scores
            gating = GATING_SIGMOID if any(n.endswith(".exp_probs_b.bias") for n in table) else GATING_SOFTMAX
        groups = _known_groups(md, n_expert, gating)
        n_dense_lead = m.int("leading_dense_block_count", _REQUIRED if n_expert else 1 << 30, lo=0)
        has_dense = n_dense_lead > 0 or not n_expert
        cfg = cls(
            n_layer=block_count - nextn,
            d_model=m.int("embedding_length", lo=1),
            n_head=n_head,
            # absent: 0 (direct q), unless the file has the low-rank q (attn_q_a): its rows then say it
            q_lora_rank=m.int("attention.q_lora_rank", _rows(table, "blk.0.attn_q_a.weight") or 0, lo=0),
            kv_lora_rank=r,
            rope_dim=rope_dim,
            nope_dim=qk_dim - rope_dim,
            v_dim=v_dim,
            vocab_size=vocab,
            ffn_dim=m.int("feed_forward_length", lo=1 if has_dense else 0),
            expert_ffn_dim=m.int("expert_feed_forward_length", _REQUIRED if n_expert else 0, lo=1 if n_expert else 0),
            n_expert=n_expert,
            n_expert_used=m.int("expert_used_count", _REQUIRED if n_expert else 0, lo=0),
            n_expert_shared=m.int("expert_shared_count", _REQUIRED if n_expert else 0, lo=0),
            n_expert_group=m.int("expert_group_count", groups[0], lo=0) or 1,
            n_expert_group_used=m.int("expert_group_used_count", groups[1], lo=0) or 1,
            n_dense_lead=n_dense_lead,
            expert_weights_scale=m.float("expert_weights_scale", _REQUIRED if n_expert else 1.0, positive=True),
            expert_weights_norm=m.bool("expert_weights_norm", False),
            gating=gating,
            rms_eps=m.float("attention.layer_norm_rms_epsilon", positive=True),
            rope_base=rope_base,
            yarn=yarn,
            context_length=m.int("context_length", 4096, lo=1),
            bos_token_id=special.get("bos"),
            eos_token_id=special.get("eos"),
            n_nextn=nextn,
        )
        cfg.validate(source)
        if tensors is not None:
            cfg.check_tensors(tensors, source)
        return cfg

    def validate(self, source: str) -> None:
        if self.nope_dim <= 0 or self.v_dim <= 0 or self.rope_dim % 2:
            raise ModelFileError(f"{source}: impossible head sizes nope={self.nope_dim} rope={self.rope_dim} v={self.v_dim}")
        if self.gating not in (GATING_SOFTMAX, GATING_SIGMOID):
            raise ModelFileError(f"{source}: unknown expert_gating_func {self.gating}")
        if self.n_expert:
            if not 0 < self.n_expert_used <= self.n_expert:
                raise ModelFileError(f"{source}: expert_used_count {self.n_expert_used} of {self.n_expert} experts")
            if self.n_expert % self.n_expert_group:
                raise ModelFileError(f"{source}: {self.n_expert} experts do not split into {self.n_expert_group} "
                                     f"groups (expert_count, expert_group_count)")
            if self.n_expert_group_used > self.n_expert_group:
                raise ModelFileError(f"{source}: expert_group_used_count {self.n_expert_group_used} exceeds "
                                     f"expert_group_count {self.n_expert_group}")
            per_group = self.n_expert // self.n_expert_group
            if self.n_expert_group > 1 and self.n_expert_group_used * per_group < self.n_expert_used:
                raise ModelFileError(f"{source}: {self.n_expert_group_used} of {self.n_expert_group} expert groups "
                                     f"hold fewer than expert_used_count {self.n_expert_used} experts")
        elif self.n_expert_used:
            raise ModelFileError(f"{source}: expert_used_count {self.n_expert_used} with no experts (expert_count 0)")

    def check_tensors(self, tensors: Mapping[str, Any], source: str) -> None:
        """The tensor table holds exactly this model: `blk.N` for N in 0..block_count-1 (the trailing
        `nextn_predict_layers` MTP layers may be present or not: ikjax does not run them), every tensor
        the graph reads present with its shape, and no tensor it would silently ignore (a renamed
        `output`, shared experts the metadata does not declare, a layer past block_count)."""
        block_count = self.n_layer + self.n_nextn
        layers: dict[int, str] = {}
        for name in tensors:
            mt = _BLK_RE.match(name)
            if mt:
                layers.setdefault(int(mt.group(1)), name)
        beyond = [i for i in layers if i >= block_count]
        if beyond:
            i = min(beyond)
            raise ModelFileError(f"{source}: {ARCH}.block_count is {block_count} but the file has tensors of layer "
                                 f"{i} ({layers[i]})")
        # (counted, not listed: a damaged block_count of 2^40 built a list of every missing layer)
        n_absent = self.n_layer - sum(1 for i in layers if i < self.n_layer)
        if n_absent:
            first = next(i for i in range(self.n_layer) if i not in layers)  # within len(layers) + 1 steps
            raise ModelFileError(f"{source}: {ARCH}.block_count is {block_count} but the file has no tensors of "
                                 f"layer {first}" + (f" ({n_absent} layers missing)" if n_absent > 1 else ""))
        specs = all_specs(self)
        check_shapes(specs, tensors, source)
        known = {s.gguf_name for s in specs}
        for i in range(self.n_layer, block_count):  # MTP layers: a MoE layer plus the nextn.* tensors
            known.update(s.gguf_name for s in layer_specs(self, i))
            known.update(f"blk.{i}.nextn.{n}.weight" for n in _NEXTN_TENSORS)
        for name in tensors:
            if _INDEXER_RE.match(name) and int(_INDEXER_RE.match(name).group(1)) < block_count:
                continue  # V3.2's sparse-attention indexer: loaded past, named by load_notes
            if name not in known:
                raise ModelFileError(f"{source}: unexpected tensor {name}: a {ARCH} model with this metadata "
                                     f"does not read it")


_BLK_RE = re.compile(r"^blk\.(\d+)\.")
_NEXTN_TENSORS = ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")
# DeepSeek V3.2's lightning indexer (sparse attention): tensors gguf-py names blk.N.indexer.*
_INDEXER_RE = re.compile(r"^blk\.(\d+)\.indexer\.(k_norm\.weight|k_norm\.bias|proj\.weight|attn_k\.weight|"
                         r"attn_q_b\.weight)$")


# Expert groups of the models that route by groups, for files that do not say (ik's converter and
# mainline's before 2025 wrote no expert_group_count; ik then skips the group step, which moves a
# grouped model's logits 34-52 % from the reference, SPEC §1): (routed experts, gating) -> (groups,
# groups used). Every model of those two shapes has them: DeepSeek V3 / V3.1 / V3.2 / R1 (256
# sigmoid-scored experts, 8 groups, top 4); DeepSeek V2 / V2.5 / Coder-V2 (160 softmax-scored
# experts, group_limited_greedy over 8 groups, top 3). Other shapes keep one group.
KNOWN_GROUPS = {(256, GATING_SIGMOID): (8, 4), (160, GATING_SOFTMAX): (8, 3)}


def _known_groups(md: Mapping[str, Any], n_expert: int, gating: int) -> tuple[int, int]:
    """(groups, groups used) defaults: KNOWN_GROUPS where the file has neither group key."""
    if f"{ARCH}.expert_group_count" in md or f"{ARCH}.expert_group_used_count" in md:
        return 1, 1
    return KNOWN_GROUPS.get((n_expert, gating), (1, 1))


def _kimi_without_betas(md: Mapping[str, Any]) -> bool:
    """A Kimi-tokenizer file (Kimi K2 / K2.5, whose YaRN betas are 1 and 1) that does not say its
    YaRN betas."""
    return (md.get("tokenizer.ggml.pre") == "kimi-k2" and f"{ARCH}.rope.scaling.yarn_beta_fast" not in md
            and f"{ARCH}.rope.scaling.yarn_beta_slow" not in md)


def _experts_in(table: Mapping[str, Any]) -> int | None:
    """The routed experts of the first MoE layer's ffn_gate_exps (its first dim), or None."""
    for name, info in table.items():
        if name.endswith(".ffn_gate_exps.weight"):
            shape = getattr(info, "shape", None)
            return int(shape[0]) if shape is not None and len(shape) == 3 else None
    return None


def _rows(table: Mapping[str, Any], name: str) -> int | None:
    """The rows (NumPy's first dim) of a 2-D tensor of the table, or None."""
    shape = getattr(table.get(name), "shape", None)
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def _qk_dim_from_tensors(table: Mapping[str, Any], n_head: int) -> int | None:
    """The per-head query/key size (nope + rope) from layer 0's query projection's rows (attn_q_b,
    or attn_q without q_lora): what a file says when its key_length does not. ik's converter writes
    `key_length = head_dim` when the config has one, and transformers 5 saves DeepSeek configs with
    `head_dim` = the rope size (16 in a tiny model, 64 in a real one): key_length then leaves no
    nope part at all."""
    for name in ("blk.0.attn_q_b.weight", "blk.0.attn_q.weight"):
        info = table.get(name)
        shape = getattr(info, "shape", None)
        if shape is not None and len(shape) == 2 and shape[0] % n_head == 0:
            return int(shape[0]) // n_head
    return None


def load_notes(cfg: ModelConfig, tensors: Mapping[str, Any], metadata: Mapping[str, Any]) -> list[str]:
    """One line per thing the loader should say about a file rather than pass over silently: a
    per-head key size taken from the tensors because key_length could not be it (see
    _qk_dim_from_tensors), and each part ikjax loads past without running it: the MTP layers (`nextn_predict_layers`, GLM-4.7-Flash's layer 47, a V3
    checkpoint converted with its MTP layer), whose extra next-token head serves only speculative
    decoding, and DeepSeek V3.2's sparse-attention indexer, which ik_llama.cpp skips as well,
    running V3.2 with dense attention over every cached key (the same output while a sequence is
    no longer than the indexer's top-k, 2048; past it, dense attention sees keys V3.2 would drop)."""
    notes = []
    key_length = metadata.get(f"{ARCH}.attention.key_length")
    if f"{ARCH}.attention.key_length_mla" not in metadata and key_length is not None and key_length != cfg.qk_dim:
        notes.append(f"{ARCH}.attention.key_length {int(key_length)} leaves no room for the non-rope part "
                     f"(rope.dimension_count {cfg.rope_dim}): per-head key size {cfg.qk_dim} taken from the "
                     f"query projection's rows (a converter wrote transformers' head_dim, the rope size)")
    if cfg.n_expert_group > 1 and _known_groups(metadata, cfg.n_expert, cfg.gating) != (1, 1):
        notes.append(f"expert groups not in the file: {cfg.n_expert_group} groups, top {cfg.n_expert_group_used} "
                     f"(every model of {cfg.n_expert} {'sigmoid' if cfg.gating == GATING_SIGMOID else 'softmax'}"
                     f"-scored experts routes so: DeepSeek {'V3 / R1' if cfg.gating == GATING_SIGMOID else 'V2 / V2.5'}"
                     f"; ik_llama.cpp skips the group step)")
    if cfg.n_expert and cfg.gating == GATING_SIGMOID and f"{ARCH}.expert_weights_norm" not in metadata:
        notes.append(f"{ARCH}.expert_weights_norm not in the file: taken as false, as llama.cpp reads it; DeepSeek "
                     f"V3 / R1's sigmoid routing normalizes the picked experts' weights (a converter that left the "
                     f"key out changed the model)")
    if cfg.yarn is not None and _kimi_without_betas(metadata):
        notes.append("YaRN betas not in the file: Kimi K2's (beta_fast 1, beta_slow 1, as its config.json; "
                     "YaRN's default 32 / 1 would rotate other dimensions) for this kimi-k2 model")
    if cfg.n_nextn:
        first, last = cfg.n_layer, cfg.n_layer + cfg.n_nextn - 1
        present = any(_BLK_RE.match(n) and first <= int(_BLK_RE.match(n).group(1)) <= last for n in tensors)
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        notes.append(f"MTP {which} ({ARCH}.nextn_predict_layers = {cfg.n_nextn}"
                     f"{', tensors present' if present else ', tensors absent'}) ignored: ikjax runs the "
                     f"{cfg.n_layer} main layers and no speculative decoding")
    layers = {int(m.group(1)) for n in tensors if (m := _INDEXER_RE.match(n))}
    keys = sorted(k for k in metadata if k.startswith(f"{ARCH}.attention.indexer."))
    if layers or keys:
        top_k = metadata.get(f"{ARCH}.attention.indexer.top_k")
        notes.append(f"sparse-attention indexer (DeepSeek V3.2: blk.N.indexer.* tensors in {len(layers)} layers"
                     f"{f', top_k {int(top_k)}' if top_k is not None else ''}) ignored: dense attention over "
                     f"every cached key, as ik_llama.cpp runs it")
    return notes


# Keys ikjax reads. A key missing from a file falls back to a default (or is an error), so a key
# whose name was damaged must not pass as merely "absent": see _check_key_names.
READ_KEYS = frozenset(
    [f"{ARCH}.{k}" for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
        "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
        "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length", "attention.value_length",
        "attention.key_length_mla", "attention.value_length_mla", "leading_dense_block_count",
        "expert_feed_forward_length", "expert_count", "expert_used_count", "expert_shared_count",
        "expert_weights_scale", "expert_weights_norm", "expert_gating_func", "expert_group_count",
        "expert_group_used_count", "nextn_predict_layers", "rope.dimension_count", "rope.freq_base",
        "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
        "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")]
    + [f"tokenizer.ggml.{k}" for k in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id",
                                       "eos_token_id", "padding_token_id", "add_bos_token")]
    + ["general.architecture", "general.alignment", "split.count", "split.no", "split.tensors.count"])


def _standard_keys() -> frozenset[str]:
    """Every key name the gguf package defines (with this architecture): legitimate, read or not."""
    import inspect

    import gguf
    out = set()
    for group in vars(gguf.Keys).values():
        if inspect.isclass(group):
            for v in vars(group).values():
                if isinstance(v, str) and "{" not in v.replace("{arch}", ""):
                    out.add(v.replace("{arch}", ARCH))
    return frozenset(out | OTHER_WRITERS_KEYS)


# keys other writers use that this gguf package no longer defines: ik_llama.cpp's converter writes a
# CLS id where the tokenizer has one, 2 characters from bos_token_id (a file without a BOS id, as
# GLM's tokenizers are, was refused as damaged: an outside review, stop 68)
OTHER_WRITERS_KEYS = frozenset({"tokenizer.ggml.cls_token_id"})


_STANDARD_KEYS: frozenset[str] | None = None


def _check_key_names(md: Mapping[str, Any], source: str) -> None:
    """A key no GGUF writer uses, one or two bytes away from a key ikjax reads that the file lacks, is
    a damaged name (`expert_gating_fuoc`): refused, since reading the default instead would run a
    different model (softmax for a sigmoid-gated V3, no YaRN, BOS dropped, ...)."""
    global _STANDARD_KEYS
    if _STANDARD_KEYS is None:
        _STANDARD_KEYS = _standard_keys()
    absent = [k for k in READ_KEYS if k not in md]
    for key in md:
        if key in READ_KEYS or key in _STANDARD_KEYS:
            continue
        for want in absent:
            if len(want) == len(key):
                d = sum(a != b for a, b in zip(key, want))
                if d <= 2:
                    raise ModelFileError(f"{source}: metadata key {key!r} is unknown and {d} character(s) away from "
                                         f"{want}, which the file lacks: the key name looks damaged")


def _kind(v: Any) -> str:
    """The GGUF kind of a metadata value as the reader returns it, for error messages."""
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "integer"
    if isinstance(v, (float, np.floating)):
        return "float"
    if isinstance(v, str):
        return "string"
    return "array"


_F32_MAX = float(np.finfo(np.float32).max)


class _Meta:
    """Typed, range-checked reads of `deepseek2.*` keys: a key of the wrong GGUF type or an impossible
    value fails naming the key, instead of `int("abc")` or a model built from a NaN."""

    def __init__(self, md: Mapping[str, Any], source: str):
        self.md, self.source = md, source

    def has(self, key: str) -> bool:
        return f"{ARCH}.{key}" in self.md

    def _get(self, key: str, default: Any, want: str) -> tuple[bool, str, Any]:
        full = f"{ARCH}.{key}"
        if full not in self.md:
            if default is _REQUIRED:
                raise ModelFileError(f"{self.source}: missing metadata key {full}")
            return False, full, default
        v = self.md[full]
        if _kind(v) != want:
            raise ModelFileError(f"{self.source}: {full}: expected {'an' if want == 'integer' else 'a'} {want}, "
                                 f"got {_kind(v)}")
        return True, full, v

    def int(self, key: str, default: Any = _REQUIRED, *, lo: int | None = None) -> Any:
        found, full, v = self._get(key, default, "integer")
        if found:
            v = int(v)
            if lo is not None and v < lo:
                raise ModelFileError(f"{self.source}: {full} is {v}, must be at least {lo}")
        return v

    def float(self, key: str, default: Any = _REQUIRED, *, positive: bool = False) -> Any:
        found, full, v = self._get(key, default, "float")
        if found:
            v = float(v)
            # float32's range: the model computes in it (a float64 1e300 passed as finite, then was inf)
            if not math.isfinite(v) or abs(v) > _F32_MAX or (positive and v <= 0):
                raise ModelFileError(f"{self.source}: {full} is {v}, must be a finite"
                                     f"{' positive' if positive else ''} number (in float32's range)")
        return v

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        return bool(self._get(key, default, "bool")[2])

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._get(key, default, "string")[2]


def _special_token_ids(md: Mapping[str, Any], source: str, vocab: int, tokens: Any) -> dict[str, int]:
    """`tokenizer.ggml.<name>_token_id` keys (bos, eos, padding, ...): integers inside the vocabulary,
    checked at load so a bad id is named by its key, not met as "token id out of range" mid-generation."""
    n = len(tokens) if tokens is not None else vocab
    out = {}
    for key, v in md.items():
        if not (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            continue
        if _kind(v) != "integer":
            raise ModelFileError(f"{source}: {key}: expected an integer, got {_kind(v)}")
        if not 0 <= int(v) < n:
            raise ModelFileError(f"{source}: {key} {int(v)} is outside the vocabulary of {n} tokens")
        out[key[len("tokenizer.ggml."):-len("_token_id")]] = int(v)
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and tokens is not None and (_kind(types) != "array" or len(types) != len(tokens)):
        got = f"{len(types)} entries" if _kind(types) == "array" else f"a {_kind(types)}"
        raise ModelFileError(f"{source}: tokenizer.ggml.token_type has {got} for {len(tokens)} tokens")
    if types is not None and not np.issubdtype(np.asarray(types).dtype, np.integer):
        # (an array of strings was int("x")'s ValueError when the tokenizer was built)
        raise ModelFileError(f"{source}: tokenizer.ggml.token_type: expected an array of integers")
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"):
        if key in md and _kind(md[key]) != "bool":  # (a string "no" was read as true: a BOS added)
            raise ModelFileError(f"{source}: {key}: expected a bool, got {_kind(md[key])}")
    return out
