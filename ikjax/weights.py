"""Model weights: the GGUF tensors a deepseek2 graph needs, checked and wrapped as QuantArrays.

Each tensor keeps its GGUF blocks; nothing is dequantized here. The three MLA layouts load as they
are: whichever of `attn_kv_b` / `attn_k_b` / `attn_v_b` a file lacks is derived inside the graph
from the ones it has (see `attention_weights`), exactly, with no re-quantization.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import kernels
from ikjax.errors import ModelFileError, OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile, TensorInfo
from ikjax.host_weights import pin_tree, HostQuantArray, host_form, min_offload_batch, populate_pages, release_pages, to_pinned
from ikjax.placement import Placement, is_routed_expert
from ikjax.quant.array import QuantArray
from ikjax.quant.dequant import supports
from ikjax.quant.types import UnsupportedQuantType

Weights = dict[str, Any]  # pytree: {"token_embd", "output_norm", "output", "layers": [dict, ...]}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the graph reads: GGUF name, expected NumPy shape, whether it may be absent."""
    key: str
    gguf_name: str
    shape: tuple[int, ...]
    optional: bool = False
    dense_float: bool = False  # 1-D norms and biases: plain float32 arrays
    f32_as_float: bool = False  # a plain float32 array where the file stores F32 (same bytes), else blocks


def layer_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    H, d, r, rope = cfg.n_head, cfg.d_model, cfg.kv_lora_rank, cfg.rope_dim
    nope, v = cfg.nope_dim, cfg.v_dim
    p = f"blk.{i}."
    s = [
        TensorSpec("attn_norm", p + "attn_norm.weight", (d,), dense_float=True),
        TensorSpec("kv_a_mqa", p + "attn_kv_a_mqa.weight", (r + rope, d)),
        TensorSpec("kv_a_norm", p + "attn_kv_a_norm.weight", (r,), dense_float=True),
        TensorSpec("kv_b", p + "attn_kv_b.weight", (H * (nope + v), r), optional=True),
        TensorSpec("k_b", p + "attn_k_b.weight", (H, r, nope), optional=True),
        TensorSpec("v_b", p + "attn_v_b.weight", (H, v, r), optional=True),
        TensorSpec("attn_output", p + "attn_output.weight", (d, H * v)),
        TensorSpec("ffn_norm", p + "ffn_norm.weight", (d,), dense_float=True),
    ]
    if cfg.q_lora_rank:
        s += [TensorSpec("q_a", p + "attn_q_a.weight", (cfg.q_lora_rank, d)),
              TensorSpec("q_a_norm", p + "attn_q_a_norm.weight", (cfg.q_lora_rank,), dense_float=True),
              TensorSpec("q_b", p + "attn_q_b.weight", (H * cfg.qk_dim, cfg.q_lora_rank))]
    else:
        s.append(TensorSpec("q", p + "attn_q.weight", (H * cfg.qk_dim, d)))
    if cfg.is_moe_layer(i):
        E, f = cfg.n_expert, cfg.expert_ffn_dim
        # an F32 router as a float32 array (its very bytes): a QuantArray of F32 bytes was
        # converted to f32 in every step (0.24-0.30 ms of a CPU decode step, RESULTS §9e); a
        # quantized one stays blocks (dequantized where the step reads it, no f32 copy held)
        s += [TensorSpec("gate_inp", p + "ffn_gate_inp.weight", (E, d), f32_as_float=True),
              TensorSpec("exp_probs_b", p + "exp_probs_b.bias", (E,), optional=True, dense_float=True),
              TensorSpec("gate_exps", p + "ffn_gate_exps.weight", (E, f, d)),
              TensorSpec("up_exps", p + "ffn_up_exps.weight", (E, f, d)),
              TensorSpec("down_exps", p + "ffn_down_exps.weight", (E, d, f))]
        if cfg.n_expert_shared:
            fs = f * cfg.n_expert_shared
            s += [TensorSpec("gate_shexp", p + "ffn_gate_shexp.weight", (fs, d)),
                  TensorSpec("up_shexp", p + "ffn_up_shexp.weight", (fs, d)),
                  TensorSpec("down_shexp", p + "ffn_down_shexp.weight", (d, fs))]
    else:
        s += [TensorSpec("ffn_gate", p + "ffn_gate.weight", (cfg.ffn_dim, d)),
              TensorSpec("ffn_up", p + "ffn_up.weight", (cfg.ffn_dim, d)),
              TensorSpec("ffn_down", p + "ffn_down.weight", (d, cfg.ffn_dim))]
    return s


def model_specs(cfg: ModelConfig) -> list[TensorSpec]:
    d, V = cfg.d_model, cfg.vocab_size
    return [TensorSpec("token_embd", "token_embd.weight", (V, d)),
            TensorSpec("output_norm", "output_norm.weight", (d,), dense_float=True),
            TensorSpec("output", "output.weight", (V, d), optional=True)]


def _shape_matches(info: TensorInfo, spec: TensorSpec) -> bool:
    if info.shape == spec.shape:
        return True
    # 2-D per-head attn_k_b / attn_v_b (ik's converter) hold the same rows as the 3-D form
    return spec.key in ("k_b", "v_b") and len(info.shape) == 2 and \
        info.shape == (spec.shape[0] * spec.shape[1], spec.shape[2])


def _check_layer_has_mla_source(present: set[str], i: int, source: str) -> None:
    if "kv_b" not in present and not {"k_b", "v_b"} <= present:
        raise ModelFileError(f"{source}: layer {i} has neither attn_kv_b nor both attn_k_b and attn_v_b")


def validate(gf: GGUFModelFile, cfg: ModelConfig) -> None:
    """Every tensor present, of the right shape and a type we can read — before loading any data."""
    specs = model_specs(cfg) + [s for i in range(cfg.n_layer) for s in layer_specs(cfg, i)]
    for spec in specs:
        info = gf.tensors.get(spec.gguf_name)
        if info is None:
            if not spec.optional:
                raise ModelFileError(f"{gf.path}: missing tensor {spec.gguf_name}")
            continue
        if not _shape_matches(info, spec):
            raise ModelFileError(f"{gf.path}: tensor {spec.gguf_name} has shape {list(info.shape)}, "
                                 f"expected {list(spec.shape)}")
        if info.qtype is None or not supports(info.qtype):
            raise UnsupportedQuantType(f"{gf.path}: tensor {spec.gguf_name} has type {info.type_name}, "
                                       f"which ikjax cannot dequantize")
    for i in range(cfg.n_layer):
        present = {s.key for s in layer_specs(cfg, i) if s.gguf_name in gf.tensors}
        _check_layer_has_mla_source(present, i, gf.path)


Placer = Callable[[str, np.ndarray], Any]

# Matrices the Pallas kernels read, repacked once at load into their planar layout (lossless).
# attn_kv_b too: prompts expand the latent cache with it (one product); where the graph wants it
# per head it dequantizes the packed form. The embedding (row gather), the router and the
# attn_k_b/v_b head matrices (the per-head op reads GGUF blocks) keep their GGUF blocks.
KERNEL_MATRICES = frozenset({"q", "q_a", "q_b", "kv_a_mqa", "kv_b", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                             "gate_exps", "up_exps", "down_exps", "gate_shexp", "up_shexp", "down_shexp", "output",
                             "attn_in", "ffn_gate_up", "shexp_gate_up"})

# Matrices that read the same input, stored as one (rows stacked, blocks untouched) when their
# types agree, so a step runs one product for both: fewer kernels per layer, which is what a
# batch-1 decode step is bound by on a GPU (bench/RESULTS.md §5).
FUSED_ROWS = (("attn_in", ("q_a", "kv_a_mqa")), ("attn_in", ("q", "kv_a_mqa")),
              ("ffn_gate_up", ("ffn_gate", "ffn_up")), ("shexp_gate_up", ("gate_shexp", "up_shexp")))


def fuse_rows(layer: dict) -> dict:
    for fused, keys in FUSED_ROWS:
        parts = [layer.get(k) for k in keys]
        if any(p is None for p in parts):
            continue
        qt, cols = parts[0].qtype, parts[0].shape[-1]
        if any(p.qtype != qt or p.ndim != 2 or p.shape[-1] != cols or p.shape[0] % qt.interleave for p in parts):
            continue
        rows = sum(p.shape[0] for p in parts)
        layer[fused] = QuantArray(jnp.concatenate([p.data for p in parts], axis=0), qt, (rows, cols))
        for k in keys:
            del layer[k]
    return layer


def default_placer(name: str, host: np.ndarray) -> jax.Array:
    """One device: on a CPU, blocks at a 64-byte aligned file offset are aliased, not copied (XLA's
    CPU buffers need that alignment; GGUF guarantees only its `general.alignment`, 32 by default),
    so the weights are the file's pages; the rest are copied once and the mapped pages under them are
    handed back (MADV_DONTNEED), so a tensor is never held twice. Measured on the 4-layer V2-Lite
    Q8_0 file: peak RSS 5.05 GiB with every tensor copied and its pages kept, see bench/RESULTS.md."""
    try:
        out = jax.device_put(host, may_alias=os.environ.get("IKJAX_WEIGHTS", "") != "copy")
    except TypeError:  # a JAX without may_alias
        out = jax.device_put(host)
    if isinstance(host, np.ndarray) and out.unsafe_buffer_pointer() != host.ctypes.data:
        out.block_until_ready()
        release_pages(host, evict=False)
    elif isinstance(host, np.ndarray) and not name.startswith("token_embd"):  # a step reads a few rows of it
        populate_pages(host)
    return out


def placer_for(placement: Placement) -> Placer:
    """Put each tensor where the Placement says. On a CPU-only machine (`placement.unified`) every
    place is the one CPU device and `device_put` of the mmapped blocks is zero-copy, so host- and
    device-placed tensors both stay in the file's pages. On an accelerator, device-placed tensors go
    to their device; host-placed routed experts (`ffn_*_exps`) are copied into the first
    accelerator's pinned host memory, one tensor at a time, and the memory map's pages of that
    tensor are released right after (one copy in RAM; both the host-experts custom call and the
    streaming of big batches read it: ikjax.host_weights). With IKJAX_HOST_EXPERTS=mmap they stay
    the memory map's bytes (no copy at all; every batch then runs on the host).
    Any other host-placed tensor next to an accelerator (`-ot "blk\\.1\\.=CPU"`, `-ngl N`) is
    loaded on the host CPU device (stacked and repacked there) and held in its stage device's pinned
    host memory (`TensorLoader`, `host_weights.HostTensor`); steps move it to the device where they
    read it. Several devices (-sm graph, or a split over several CPU devices): ikjax.sharding.placer."""
    if placement.split_mode == "graph" or (placement.unified and len(placement.devices) > 1):
        from ikjax.sharding import placer
        return placer(placement)
    if placement.unified:
        return default_placer
    host = [t for t in placement.tensors if t.on_host and is_routed_expert(t.name)]
    if host:
        from pallas_kernels.moe_matmul import host as _host_moe
        if not _host_moe.available():
            raise OptionError(f"ot: {host[0].name} is placed in host memory ({host[0].rule}), but "
                              f"{_host_moe.unavailable_reason()}")
    accel = [d for d in jax.devices() if d.platform != "cpu"]
    by_label = dict(zip(placement.devices, accel))
    pinned = bool(host) and host_form() == "pinned"
    cpu = jax.devices("cpu")[0]

    def place(name: str, data: np.ndarray):
        t = placement[name]
        if t.on_host and not is_routed_expert(name):  # built on the host CPU, pinned by TensorLoader
            return jax.device_put(data, cpu)
        if t.on_host:
            if not pinned:
                return data
            out = to_pinned(data, accel[0])
            release_pages(data)
            return out
        return jax.device_put(data, by_label[t.device])

    place.host_device = lambda name: accel[placement.stage_device(name)]  # whose pinned memory holds it
    return place


def load_weights(gf: GGUFModelFile, cfg: ModelConfig, place: Placer | None = None,
                 placement: Placement | None = None) -> Weights:
    """Copy each tensor's bytes from the memory map to where `place` puts it, one tensor at a time.

    `placement` (from `ikjax.placement.plan_placement`) decides where each tensor goes when no
    `place` is given; it stays next to the returned tree (static metadata, never a traced leaf)."""
    if place is None:
        place = placer_for(placement) if placement is not None else default_placer
    validate(gf, cfg)
    # -sm graph runs the XLA path on GSPMD-split matrices: no kernel layouts
    graph = placement is not None and placement.split_mode == "graph"
    load = TensorLoader(gf, cfg, place, placement, repack=kernels.needs_repack() and not graph)
    weights: Weights = load.top()
    weights["layers"] = [load.layer(i) for i in range(cfg.n_layer)]
    return weights


# float norms and biases in NumPy: no jitted dequantize per shape at load (each one an XLA
# compile or cache entry, and the JIT state it leaves in the process)
_NP_FLOATS = {"F32": np.float32, "F16": np.float16}


def _dense_float(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A norm, bias (or F32 router) as float32: the file's f32 bytes as they are (a view of the memory map,
    which `place` aliases or copies), f16 converted in NumPy; other types through the dequantizer."""
    np_type = _NP_FLOATS.get(info.qtype.name)
    if np_type is not None:
        return raw.view(np_type).reshape(info.shape).astype(np.float32, copy=False)
    return np.asarray(QuantArray.from_bytes(raw, info.qtype, info.shape).dequantize(jnp.float32))


class TensorLoader:
    """Reads tensors from the file through `place`, the top-level ones (`top`) or one layer's
    (`layer`), stacked (`fuse_rows`) and repacked for the kernels (`repack`) as a step reads them.

    `place(name, bytes)` may return only a part of the bytes (the tensor-parallel loader gives each
    device its slice): the QuantArray then gets the part's shape, the rows and columns it holds."""

    def __init__(self, gf: GGUFModelFile, cfg: ModelConfig, place: Placer, placement: Placement | None,
                 repack: bool, host_arrays: dict | None = None):
        self.gf, self.cfg, self.place, self.placement, self.repack = gf, cfg, place, placement, repack
        # host-resident tensors by name: loaders of several devices share one (ikjax.tensor_parallel)
        self.host_arrays = {} if host_arrays is None else host_arrays
        self.hybrid = placement is not None and not placement.unified
        self.min_batch = min_offload_batch(placement.min_offload_batch) if self.hybrid else 0

    def tensor(self, spec: TensorSpec):
        info = self.gf.tensors.get(spec.gguf_name)
        if info is None:
            return None
        raw = self.gf.tensor_bytes(spec.gguf_name)
        if spec.dense_float or (spec.f32_as_float and info.qtype.name == "F32"):
            return self.place(spec.gguf_name, _dense_float(raw, info))
        qa = QuantArray.from_bytes(raw, info.qtype, spec.shape)
        data = self.place(spec.gguf_name, qa.data)
        if self.hybrid and self.placement[spec.gguf_name].on_host and is_routed_expert(spec.gguf_name):
            # routed experts: the memory map's bytes (or their pinned copy), read by the host kernels
            if spec.gguf_name not in self.host_arrays:
                self.host_arrays[spec.gguf_name] = HostQuantArray(data, qa.qtype, qa.shape, min_batch=self.min_batch,
                                                                  tensor=self.placement[spec.gguf_name])
            return self.host_arrays[spec.gguf_name]
        shape = qa.shape
        if tuple(data.shape) != tuple(qa.data.shape):  # a part: its rows, and its share of each row
            shape = tuple(data.shape[:-1]) + (qa.shape[-1] * data.shape[-1] // qa.data.shape[-1],)
        return QuantArray(data, qa.qtype, shape)

    def for_kernels(self, tensors: dict) -> dict:
        if not self.repack:
            return tensors
        return {k: kernels.prepare_weight(v) if k in KERNEL_MATRICES else v for k, v in tensors.items()}

    def _host_keys(self, specs) -> dict[str, str]:
        """key -> tensor name of the non-expert tensors placed in host memory next to an accelerator."""
        if not self.hybrid or getattr(self.place, "host_device", None) is None:
            return {}
        return {s.key: s.gguf_name for s in specs if s.gguf_name in self.gf.tensors
                and self.placement[s.gguf_name].on_host and not is_routed_expert(s.gguf_name)}

    def _pin(self, tensors: dict, host_keys: dict[str, str]) -> dict:
        """Host-placed non-expert tensors, loaded on the host CPU, into pinned host memory."""
        for k, name in host_keys.items():
            if tensors.get(k) is not None:
                tensors[k] = pin_tree(tensors[k], self.place.host_device(name))
        return tensors

    def top(self) -> dict:
        specs = model_specs(self.cfg)
        weights = self.for_kernels({s.key: self.tensor(s) for s in specs})
        if weights["output"] is None:  # tied embeddings
            weights["output"] = weights["token_embd"]
        return self._pin(weights, self._host_keys(specs))

    def layer(self, i: int) -> dict:
        specs = layer_specs(self.cfg, i)
        tensors = {s.key: v for s in specs if (v := self.tensor(s)) is not None}
        host_keys = self._host_keys(specs)
        # stacking saves a launch per product on accelerators; on the CPU the C++ kernels read the
        # file's own pages, and a stacked copy would only add its bytes to the process (RESULTS §9);
        # a layer with host-placed tensors is not stacked (its parts live on two devices)
        if kernels.resolve_backend() != "cpu" and not host_keys:
            tensors = fuse_rows(tensors)
        return self._pin(self.for_kernels(tensors), host_keys)
