"""Several devices: `-sm layer` (a pipeline of whole layers) and `-sm graph` (every layer split over
a `jax.sharding.Mesh`), with `-ts` shares and `-mg`.

`ikjax.placement` decides, per tensor, which device(s) hold it using the rules here; this module
also holds what runs them:

- `-sm layer`: llama.cpp's rule (`llm_load_tensors`): shares are made cumulative and normalized,
  and layer i goes to the first device whose cumulative share exceeds `(i - i_gpu_start) /
  act_gpu_layers` (`act_gpu_layers = min(ngl, n_layer + 1)`, so the output head counts as one more
  layer and, with the default -ngl, goes to the device of fraction `n_layer / (n_layer + 1)`: the
  last device holding layers). The embedding goes to the device of layer 0. Each device's KV cache
  holds only its layers. A step runs one jitted stage per device in turn (`Pipeline`), the
  activation moved from one device to the next (`jax.device_put`), as llama.cpp's pipeline does:
  one jit over weights committed to different devices is refused by JAX ("incompatible devices"),
  and a per-device stage keeps every kernel (C++ CPU custom calls, Pallas) usable unchanged.
- `-sm graph`: one mesh axis ("x") over the devices; each tensor's logical axes (placement's
  `logical_axes`, the jax-llm-examples ShardingRules pattern) map through `GRAPH_RULES`: heads for
  attention q/q_b/kv_b/k_b/v_b rows and attn_output columns, expert for routed experts, ffn for
  dense and shared FFN rows/columns, vocab for the embedding and the output head. A tensor is split
  on its first mapped dimension that divides into whole parts (whole heads, whole quant blocks of a
  row, whole interleaved row groups), and only where every matrix of its group splits
  (`consistent_splits`); the router never. ikjax.tensor_parallel loads the parts and runs the step
  on them with the same kernels as one device, inside shard_map. Uneven -ts shares are refused: -sm
  graph takes the devices with a non-zero share, and refuses unequal non-zero shares (every part of
  a split dimension has one size).
"""
from __future__ import annotations

import bisect
import re
from typing import Any, Sequence

from ikjax.errors import OptionError

MESH_AXIS = "x"
# logical axis -> mesh axis (None: never split) for -sm graph
GRAPH_RULES: dict[str, str] = {"heads": MESH_AXIS, "expert": MESH_AXIS, "ffn": MESH_AXIS, "vocab": MESH_AXIS}


def shares_for(tensor_split: Sequence[float], n_devices: int, flag: str = "ts") -> list[float]:
    """-ts shares padded to one per device with zeros (llama.cpp's fixed-size array); equal shares
    when -ts is not given. More shares than devices is refused."""
    if not tensor_split:
        return [1.0] * n_devices
    if len(tensor_split) > n_devices:
        raise OptionError(f"{flag}: {len(tensor_split)} shares ({','.join(f'{x:g}' for x in tensor_split)}) "
                          f"for {n_devices} devices")
    return list(tensor_split) + [0.0] * (n_devices - len(tensor_split))


def layer_split(n_layer: int, shares: Sequence[float], ngl: int) -> tuple[tuple[int, ...], int]:
    """(device index of every layer, device index of the output head): llama.cpp's rule (module
    docstring). Layers below `n_layer - ngl` (host memory) run on the device of the first
    device-resident layer's share, i.e. the step of the device at fraction 0."""
    total = float(sum(shares))
    cum, acc = [], 0.0
    for x in shares:
        acc += x
        cum.append(acc / total)
    n = len(shares)
    start = max(n_layer - ngl, 0)
    act = min(ngl, n_layer + 1)

    def device_at(frac: float) -> int:
        return min(bisect.bisect_right(cum, frac), n - 1)

    if act <= 0:
        return tuple(device_at(0.0) for _ in range(n_layer)), device_at(0.0)
    layers = tuple(device_at(max(i - start, 0) / act) for i in range(n_layer))
    return layers, device_at((act - 1) / act)


def graph_devices(tensor_split: Sequence[float], n_devices: int) -> tuple[int, ...]:
    """The devices of the -sm graph mesh: those with a non-zero share; their shares must be equal."""
    shares = shares_for(tensor_split, n_devices)
    used = tuple(i for i, x in enumerate(shares) if x > 0)
    if len({shares[i] for i in used}) > 1:
        raise OptionError(f"ts: -sm graph cuts every split tensor into equal parts (XLA's sharding has one part "
                          f"size per dimension); {','.join(f'{x:g}' for x in tensor_split)} is uneven: give equal "
                          f"shares (0 leaves a device out) or use -sm layer")
    return used


def graph_split_dim(axes: Sequence[str | None] | None, shape: Sequence[int] | None, qtype: Any, n: int,
                    n_head: int) -> int | None:
    """The NumPy dim of a tensor that -sm graph splits over `n` devices (-1 = the last, the
    columns), or None for a whole copy on each: the first dim whose logical axis `GRAPH_RULES` maps
    to the mesh and that divides into `n` whole parts — whole heads, whole quant blocks of a row
    (the bytes of a row split at block boundaries), whole interleaved row groups."""
    if n <= 1 or axes is None or shape is None or len(axes) != len(shape):
        return None
    last = len(shape) - 1
    for d, ax in enumerate(axes):
        if ax is None or GRAPH_RULES.get(ax) is None:
            continue
        size = shape[d]
        if size % n or (ax == "heads" and n_head % n):
            continue
        if qtype is not None:
            if d == last:
                if qtype.row_meta_bytes or (size // qtype.block_elems) % n or size % qtype.block_elems:
                    continue
            elif d == last - 1 and qtype.interleave > 1 and (size // n) % qtype.interleave:
                continue
        return -1 if d == last else d
    return None


_GROUPS = (("attn", re.compile(r"attn_(q|q_b|kv_b|k_b|v_b|output)\.weight$")),
           ("ffn", re.compile(r"ffn_(gate|up|down)\.weight$")),
           ("shexp", re.compile(r"ffn_(gate|up|down)_shexp\.weight$")),
           ("exps", re.compile(r"ffn_(gate|up|down)_exps\.weight$")),
           ("router", re.compile(r"(ffn_gate_inp\.weight|exp_probs_b\.bias)$")))


def split_group(name: str) -> str | None:
    """The group of tensors -sm graph splits together ("attn", "ffn", "shexp", "exps"), "router"
    (never split: every device picks the same experts from all of them), or None (alone)."""
    for group, pat in _GROUPS:
        if pat.search(name):
            return group
    return None


def consistent_splits(tensors: Sequence[Any]) -> list[Any]:
    """-sm graph runs each layer's attention, FFN, shared and routed experts split over the
    devices only where every matrix of the group splits (whole heads: q/q_b/kv_b/k_b/v_b rows and
    attn_output columns; whole FFN rows: gate/up rows and down columns; whole experts), so each
    device computes a partial sum that one all-reduce completes. A group with one matrix that
    cannot split (a dimension not divisible into whole quant blocks) runs whole on every device.
    The router is never split. Returns the TensorPlacements with `split_dim` made so."""
    import dataclasses
    from ikjax.placement import layer_of
    whole: set[tuple] = set()
    for t in tensors:
        g = split_group(t.name)
        if g is not None and t.split_dim is None:
            whole.add((layer_of(t.name), g))
    out = []
    for t in tensors:
        g = split_group(t.name)
        if t.split_dim is not None and (g == "router" or (layer_of(t.name), g) in whole):
            t = dataclasses.replace(t, split_dim=None)
        out.append(t)
    return out


# -- at load and at run time ------------------------------------------------------------------------

def jax_devices(placement) -> list:
    """The JAX devices the Placement's labels name, in label order (accelerators, or the CPU
    devices of a CPU-only machine; every process's under jax.distributed)."""
    import jax
    devs = jax.devices()
    accel = [d for d in devs if d.platform != "cpu"]
    return (accel or devs)[:len(placement.devices)]


def mesh_for(placement):
    """The 1-D mesh of -sm graph over the devices that hold parts (the first tensor's `spread`)."""
    import numpy as np
    from jax.sharding import Mesh
    by_label = dict(zip(placement.devices, jax_devices(placement)))
    spread = placement.tensors[0].spread
    return Mesh(np.array([by_label[d] for d in spread]), (MESH_AXIS,))


def partition_spec(split_dim: int | None, ndim: int):
    """The PartitionSpec of an array of `ndim` dims split on `split_dim` (None: replicated)."""
    from jax.sharding import PartitionSpec as P
    if split_dim is None or ndim == 0:
        return P()
    d = split_dim % ndim
    return P(*[MESH_AXIS if i == d else None for i in range(ndim)])


def replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(mesh, P())


# bytes of tensor data this process copied out of the file for its devices (-sm graph,
# ikjax.tensor_parallel): under jax.distributed each process reads only its devices' parts
BYTES_READ = [0]


def placer(placement):
    """The loader's placer for -sm layer / -mg over several devices of a CPU-only process: each
    tensor on the device whose step reads it (host-resident ones too: on a CPU, host and device
    memory are one RAM). Next to accelerators, -sm layer goes through the single-device loader
    (each tensor to its label's device) instead; -sm graph loads through ikjax.tensor_parallel."""
    import jax
    devs = jax_devices(placement)

    def place(name: str, data):
        return jax.device_put(data, devs[placement.stage_device(name)])
    return place


# -- -sm layer: one jitted stage per device ---------------------------------------------------------

def _stage(weights, cache, x, start, last, *, cfg, plan, first: int, embed_in: bool, head_out: bool):
    """One device's part of a step: [embedding] + its layers + [output head]."""
    from ikjax import kernels
    from ikjax.model.deepseek2 import embed, output_head, run_layers
    with kernels.kernel_context(plan.backend, plan.threads):
        if embed_in:
            x = embed(weights["token_embd"], x)
        x, cache = run_layers(weights["layers"], cache, x, start, first, cfg=cfg, plan=plan)
        if head_out:
            x = output_head(weights, x, last, cfg=cfg, plan=plan)
    return x, cache


_jitted_stage = None


def _stage_jit():
    global _jitted_stage
    if _jitted_stage is None:
        import jax
        _jitted_stage = jax.jit(_stage, static_argnames=("cfg", "plan", "first", "embed_in", "head_out"),
                                donate_argnums=(1,))
    return _jitted_stage


class Pipeline:
    """-sm layer: the step as stages, one per run of consecutive layers on one device, in order
    (stage = (device index, first layer, layer count, embeds?, computes the head?)). The embedding
    and the output head join the first / last stage where they share its device, else they are a
    stage of their own. Each stage's weights and cache live on its device; the activation [B,T,d]
    moves to the next device between stages."""

    def __init__(self, placement, weights, cfg):
        import jax
        self.cfg = cfg
        self.devices = jax_devices(placement)
        n_layer = cfg.n_layer
        groups: list[list[int]] = []  # [device, first, count]
        for i, d in enumerate(placement.layer_device[:n_layer]):
            if groups and groups[-1][0] == d:
                groups[-1][2] += 1
            else:
                groups.append([d, i, 1])
        if not groups or groups[0][0] != placement.embed_device:
            groups.insert(0, [placement.embed_device, 0, 0])
        if groups[-1][0] != placement.output_device:
            groups.append([placement.output_device, n_layer, 0])
        self.stages = tuple((d, first, count, k == 0, k == len(groups) - 1)
                            for k, (d, first, count) in enumerate(groups))
        self.stage_weights = []
        for d, first, count, embed_in, head_out in self.stages:
            w: dict[str, Any] = {"layers": weights["layers"][first:first + count]}
            if embed_in:
                w["token_embd"] = weights["token_embd"]
            if head_out:  # tied embeddings: the output is the embedding, maybe on another device
                w["output_norm"] = jax.device_put(weights["output_norm"], self.devices[d])
                w["output"] = jax.device_put(weights["output"], self.devices[d])
            self.stage_weights.append(w)

    def describe(self) -> str:
        parts = []
        for d, first, count, embed_in, head_out in self.stages:
            what = (["embedding"] if embed_in else []) + ([f"layers {first}-{first + count - 1}"] if count else []) \
                + (["output"] if head_out else [])
            parts.append(f"device {d}: {', '.join(what)}")
        return "; ".join(parts)

    def new_cache(self, layout) -> dict:
        """The KV cache: each layer's entries on the device of its stage."""
        import dataclasses
        import jax
        from ikjax import cache as kvcache
        out: dict[str, list] = {name: [] for name, _ in layout.widths}
        for d, first, count, _, _ in self.stages:
            if not count:
                continue
            with jax.default_device(self.devices[d]):
                part = kvcache.init_cache(dataclasses.replace(layout, n_layer=count))
            for name in out:
                out[name] += part[name]
        return out

    def _split_cache(self, cache) -> list[dict]:
        return [{name: entries[first:first + count] for name, entries in cache.items()}
                for _, first, count, _, _ in self.stages]

    def compile(self, cache_shapes, B: int, T: int, plan) -> "CompiledPipeline":
        """Compile every stage for this shape (`cache_shapes`: the whole cache's ShapeDtypeStructs)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import SingleDeviceSharding
        exes = []
        for (d, first, count, embed_in, head_out), w, c in zip(self.stages, self.stage_weights,
                                                              self._split_cache(cache_shapes)):
            sh = SingleDeviceSharding(self.devices[d])
            c = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), c)
            x = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh) if embed_in else \
                jax.ShapeDtypeStruct((B, T, self.cfg.d_model), jnp.float32, sharding=sh)
            i32 = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh)
            exes.append(_stage_jit().lower(w, c, x, i32, i32, cfg=self.cfg, plan=plan, first=first,
                                           embed_in=embed_in, head_out=head_out).compile())
        return CompiledPipeline(self, exes)


class CompiledPipeline:
    """A compiled -sm layer step: called like the one-device executable, (weights, cache, tokens,
    start, last) -> (logits, cache); `weights` is ignored (each stage holds its own part)."""

    def __init__(self, pipeline: Pipeline, exes: list):
        self.pipeline, self.exes = pipeline, exes

    def __call__(self, weights, cache, tokens, start, last):
        import jax
        p = self.pipeline
        x = tokens
        out_cache: dict[str, list] = {name: [] for name in cache}
        for (d, _, _, _, _), w, c, exe in zip(p.stages, p.stage_weights, p._split_cache(cache), self.exes):
            dev = p.devices[d]
            x, c = exe(w, c, jax.device_put(x, dev), jax.device_put(start, dev), jax.device_put(last, dev))
            for name in out_cache:
                out_cache[name] += c[name]
        return x, out_cache

    def memory_analysis(self):
        """XLA's buffers of all stages together (each stage's on its own device)."""
        from types import SimpleNamespace
        total = SimpleNamespace(temp_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0)
        for exe in self.exes:
            ma = exe.memory_analysis()
            for k in vars(total):
                setattr(total, k, getattr(total, k) + getattr(ma, k))
        return total
