"""One description per tensor of a deepseek2 file: every fact about a weight, in one row.

A weight's facts used to sit in four tables (the loader's specs, placement's logical axes, -sm
graph's split groups, the kernels' repack and row-fusion sets) that had to be edited together.
Here each kind of tensor is one `TensorKind` (in the spirit of jax-llm-examples deepseek_r1_jax's
`ArrayInfo`): its key in the weight tree, its GGUF name, the logical axes of its NumPy shape (which
placement maps onto devices, `ShardingRules`-style), the -sm graph group it splits with, whether the
Pallas kernels read it repacked, and which stacked matrix it joins. `layer_specs(cfg, i)` and
`model_specs(cfg)` give the concrete `TensorSpec`s (kind + shape) a file must hold; everything else
(`logical_axes`, `split_group`, `KERNEL_MATRICES`, `FUSED_ROWS`) is derived from the kinds.

Shapes are NumPy's (GGUF dims reversed): rows first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from typing import Any, Mapping

from ikjax.errors import ModelFileError
from ikjax.quant.dequant import supports
from ikjax.quant.types import UnsupportedQuantType


@dataclass(frozen=True)
class TensorKind:
    """What every tensor of one kind shares, whatever the model's dims."""
    key: str                    # its key in the weight tree (a layer's dict, or the top level)
    suffix: str                 # its GGUF name after `blk.N.` (the whole name for top-level tensors)
    axes: tuple[str | None, ...]  # logical axes of the NumPy shape; "heads" = rows of whole heads
    group: str | None = None    # -sm graph: the tensors that split together (None: alone, never with others)
    kernel: bool = False        # the Pallas kernels read it repacked (`PackedWeight`, lossless)
    fuse: tuple[str, int] | None = None  # (stacked matrix, position): rows stacked with the same input's
    optional: bool = False
    dense_float: bool = False   # 1-D norms and biases: plain float32 arrays
    f32_as_float: bool = False  # a plain float32 array where the file stores F32 (same bytes), else blocks
    flat_axes: tuple[str | None, ...] | None = None  # the 2-D per-head form ik's converter writes


def _k(key, suffix, axes, **kw) -> TensorKind:
    return TensorKind(key, suffix, axes, **kw)


# Groups (-sm graph): a layer's attention, FFN, shared and routed experts run split over the devices
# only where every matrix of the group splits (whole heads, FFN rows, experts), so one all-reduce
# completes each; the router is never split (every device picks the same experts from all of them).
# Kernel matrices: attn_kv_b too (prompts expand the latent cache with it, one product); the
# embedding (row gather), the router and the per-head attn_k_b/v_b keep their GGUF blocks.
# Fusion: matrices that read the same input are stored as one (rows stacked, blocks untouched) when
# their types agree, so a step runs one product for both: fewer kernels per layer, which is what a
# batch-1 decode step is bound by on a GPU (bench/RESULTS.md §5).
KINDS: tuple[TensorKind, ...] = (
    _k("token_embd", "token_embd.weight", ("vocab", "embed")),
    _k("output_norm", "output_norm.weight", ("embed",), dense_float=True),
    _k("output", "output.weight", ("vocab", "embed"), kernel=True),  # required, as ik (DeepSeek never ties it)
    _k("attn_norm", "attn_norm.weight", ("embed",), dense_float=True),
    _k("q_a", "attn_q_a.weight", ("q_lora", "embed"), kernel=True, fuse=("attn_in", 0)),
    _k("q", "attn_q.weight", ("heads", "embed"), group="attn", kernel=True, fuse=("attn_in", 0)),
    _k("kv_a_mqa", "attn_kv_a_mqa.weight", ("kv_lora", "embed"), kernel=True, fuse=("attn_in", 1)),  # + rope key
    _k("kv_a_norm", "attn_kv_a_norm.weight", ("kv_lora",), dense_float=True),
    _k("kv_b", "attn_kv_b.weight", ("heads", "kv_lora"), group="attn", kernel=True, optional=True),
    _k("k_b", "attn_k_b.weight", ("heads", "kv_lora", "head_dim"), group="attn", optional=True,
       flat_axes=("heads", "head_dim")),
    _k("v_b", "attn_v_b.weight", ("heads", "head_dim", "kv_lora"), group="attn", optional=True,
       flat_axes=("heads", "kv_lora")),
    _k("attn_output", "attn_output.weight", ("embed", "heads"), group="attn", kernel=True),
    _k("ffn_norm", "ffn_norm.weight", ("embed",), dense_float=True),
    _k("q_a_norm", "attn_q_a_norm.weight", ("q_lora",), dense_float=True),
    _k("q_b", "attn_q_b.weight", ("heads", "q_lora"), group="attn", kernel=True),
    # an F32 router as a float32 array (its very bytes): a QuantArray of F32 bytes was converted to
    # f32 in every step (0.24-0.30 ms of a CPU decode step, RESULTS §9e); a quantized one stays blocks
    _k("gate_inp", "ffn_gate_inp.weight", ("expert", "embed"), group="router", f32_as_float=True),
    _k("exp_probs_b", "exp_probs_b.bias", ("expert",), group="router", optional=True, dense_float=True),
    _k("gate_exps", "ffn_gate_exps.weight", ("expert", "ffn", "embed"), group="exps", kernel=True),
    _k("up_exps", "ffn_up_exps.weight", ("expert", "ffn", "embed"), group="exps", kernel=True),
    _k("down_exps", "ffn_down_exps.weight", ("expert", "embed", "ffn"), group="exps", kernel=True),
    _k("gate_shexp", "ffn_gate_shexp.weight", ("ffn", "embed"), group="shexp", kernel=True,
       fuse=("shexp_gate_up", 0)),
    _k("up_shexp", "ffn_up_shexp.weight", ("ffn", "embed"), group="shexp", kernel=True, fuse=("shexp_gate_up", 1)),
    _k("down_shexp", "ffn_down_shexp.weight", ("embed", "ffn"), group="shexp", kernel=True),
    _k("ffn_gate", "ffn_gate.weight", ("ffn", "embed"), group="ffn", kernel=True, fuse=("ffn_gate_up", 0)),
    _k("ffn_up", "ffn_up.weight", ("ffn", "embed"), group="ffn", kernel=True, fuse=("ffn_gate_up", 1)),
    _k("ffn_down", "ffn_down.weight", ("embed", "ffn"), group="ffn", kernel=True),
)
KIND: dict[str, TensorKind] = {k.key: k for k in KINDS}
_BY_SUFFIX: dict[str, TensorKind] = {k.suffix: k for k in KINDS}
TOP_LEVEL = ("token_embd", "output_norm", "output")

# derived views, for the loader: the stacked matrices (each with the kinds it stacks, in row order)
# and every matrix the Pallas kernels read repacked (stacked ones included)
FUSED_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (name, combo)
    for name in dict.fromkeys(k.fuse[0] for k in KINDS if k.fuse)
    for combo in product(*[[k.key for k in KINDS if k.fuse == (name, pos)]
                           for pos in sorted({k.fuse[1] for k in KINDS if k.fuse and k.fuse[0] == name})]))
KERNEL_MATRICES: frozenset[str] = frozenset({k.key for k in KINDS if k.kernel} | {name for name, _ in FUSED_ROWS})

ROUTED_EXPERT_SUFFIXES = tuple(k.suffix for k in KINDS if k.group == "exps")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def kind_of(name: str) -> TensorKind | None:
    """The kind of a GGUF tensor name (`blk.3.attn_q_b.weight` -> q_b), None for one the graph does
    not read (an MTP block's `nextn.*`, an unknown name)."""
    m = _LAYER.match(name)
    kind = _BY_SUFFIX.get(name[m.end():] if m else name)
    if kind is not None and (m is None) != (kind.key in TOP_LEVEL):
        return None
    return kind


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def is_routed_expert(name: str) -> bool:
    return name.endswith(ROUTED_EXPERT_SUFFIXES)


def logical_axes(name: str, rank: int | None) -> tuple[str | None, ...] | None:
    """The logical axes of a tensor's NumPy shape; a tuple of None (nothing to split) for a tensor
    the graph does not read (e.g. the MTP block); None where the rank is not known (a plan made
    from names and sizes only, as `ikjax info` does)."""
    m = _LAYER.match(name)
    kind = _BY_SUFFIX.get(name[m.end():] if m else name)
    axes = None if kind is None else kind.axes
    if kind is not None and kind.flat_axes is not None:  # attn_k_b / attn_v_b: 3-D, or 2-D per-head rows
        axes = {len(kind.axes): kind.axes, len(kind.flat_axes): kind.flat_axes}.get(rank)
    if rank is None:
        return axes
    if axes is None or len(axes) != rank:
        return (None,) * rank
    return axes


def split_group(name: str) -> str | None:
    """The group of tensors -sm graph splits together ("attn", "ffn", "shexp", "exps"), "router"
    (never split), or None (alone)."""
    kind = _BY_SUFFIX.get(name[m.end():] if (m := _LAYER.match(name)) else name)
    return None if kind is None or not m else kind.group


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the graph reads: its kind, its GGUF name and the NumPy shape this model expects."""
    kind: TensorKind
    gguf_name: str
    shape: tuple[int, ...]

    @property
    def key(self) -> str:
        return self.kind.key

    @property
    def optional(self) -> bool:
        return self.kind.optional

    @property
    def dense_float(self) -> bool:
        return self.kind.dense_float

    @property
    def f32_as_float(self) -> bool:
        return self.kind.f32_as_float

    def matches(self, shape: tuple[int, ...]) -> bool:
        """Whether a file's shape is this one (the 2-D per-head attn_k_b / attn_v_b of ik's
        converter hold the same rows as the 3-D form)."""
        shape = tuple(shape)
        if shape == self.shape:
            return True
        return (self.kind.flat_axes is not None and len(shape) == 2
                and shape == (self.shape[0] * self.shape[1], self.shape[2]))


def _spec(key: str, layer: int | None, shape: tuple[int, ...]) -> TensorSpec:
    kind = KIND[key]
    return TensorSpec(kind, kind.suffix if layer is None else f"blk.{layer}.{kind.suffix}", shape)


def layer_specs(cfg: Any, i: int) -> list[TensorSpec]:
    """The tensors layer i of this model (a `ModelConfig`) reads, with their shapes."""
    H, d, r, rope = cfg.n_head, cfg.d_model, cfg.kv_lora_rank, cfg.rope_dim
    nope, v = cfg.nope_dim, cfg.v_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,), "kv_a_mqa": (r + rope, d), "kv_a_norm": (r,), "kv_b": (H * (nope + v), r),
        "k_b": (H, r, nope), "v_b": (H, v, r), "attn_output": (d, H * v), "ffn_norm": (d,),
    }
    if cfg.q_lora_rank:
        shapes.update(q_a=(cfg.q_lora_rank, d), q_a_norm=(cfg.q_lora_rank,), q_b=(H * cfg.qk_dim, cfg.q_lora_rank))
    else:
        shapes["q"] = (H * cfg.qk_dim, d)
    if cfg.is_moe_layer(i):
        E, f = cfg.n_expert, cfg.expert_ffn_dim
        shapes.update(gate_inp=(E, d), exp_probs_b=(E,), gate_exps=(E, f, d), up_exps=(E, f, d), down_exps=(E, d, f))
        if cfg.n_expert_shared:
            fs = f * cfg.n_expert_shared
            shapes.update(gate_shexp=(fs, d), up_shexp=(fs, d), down_shexp=(d, fs))
    else:
        shapes.update(ffn_gate=(cfg.ffn_dim, d), ffn_up=(cfg.ffn_dim, d), ffn_down=(d, cfg.ffn_dim))
    order = ("attn_norm", "kv_a_mqa", "kv_a_norm", "kv_b", "k_b", "v_b", "attn_output", "ffn_norm", "q_a", "q_a_norm",
             "q_b", "q", "gate_inp", "exp_probs_b", "gate_exps", "up_exps", "down_exps", "gate_shexp", "up_shexp",
             "down_shexp", "ffn_gate", "ffn_up", "ffn_down")
    return [_spec(k, i, shapes[k]) for k in order if k in shapes]


def model_specs(cfg: Any) -> list[TensorSpec]:
    """The top-level tensors (embedding, final norm, output head)."""
    d, V = cfg.d_model, cfg.vocab_size
    return [_spec("token_embd", None, (V, d)), _spec("output_norm", None, (d,)), _spec("output", None, (V, d))]


def all_specs(cfg: Any) -> list[TensorSpec]:
    return model_specs(cfg) + [s for i in range(cfg.n_layer) for s in layer_specs(cfg, i)]


def check_shapes(specs: list[TensorSpec], tensors: Mapping[str, Any], source: str) -> None:
    """Every non-optional tensor present, each present one of the expected shape."""
    for spec in specs:
        info = tensors.get(spec.gguf_name)
        if info is None:
            if not spec.optional:
                raise ModelFileError(f"{source}: missing tensor {spec.gguf_name}")
        elif not spec.matches(info.shape):
            raise ModelFileError(f"{source}: tensor {spec.gguf_name} has shape {list(info.shape)}, "
                                 f"expected {list(spec.shape)}")


def validate(tensors: Mapping[str, Any], cfg: Any, source: str) -> None:
    """Every tensor present, of the right shape and a type we can read — before loading any data."""
    specs = all_specs(cfg)
    check_shapes(specs, tensors, source)
    for spec in specs:
        info = tensors.get(spec.gguf_name)
        if info is not None and (info.qtype is None or not supports(info.qtype)):
            raise UnsupportedQuantType(f"{source}: tensor {spec.gguf_name} has type {info.type_name}, "
                                       f"which ikjax cannot dequantize")
    for i in range(cfg.n_layer):
        present = {s.key for s in layer_specs(cfg, i) if s.gguf_name in tensors}
        if "kv_b" not in present and not {"k_b", "v_b"} <= present:
            raise ModelFileError(f"{source}: layer {i} has neither attn_kv_b nor both attn_k_b and attn_v_b")
