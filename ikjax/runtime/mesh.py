"""`-sm graph`: every layer split over the devices of a mesh, each device running the same kernels
as one device does (Pallas on GPUs, the C++ custom calls on CPUs) on its part, inside `jax.shard_map`.

Why not let XLA partition the step (GSPMD)? The kernels are custom calls XLA cannot partition: it
would gather every weight to every device around them (or the step would have to run the XLA
path, 60x slower on GPUs, RESULTS §10). Here the split is explicit, as in jax-llm-examples'
deepseek_r1_jax: attention by heads (q/q_b/kv_b/k_b/v_b rows, attn_output columns), dense and
shared FFNs by their hidden rows (gate/up rows, down columns), routed experts by expert, the
embedding and output head by vocabulary rows (`ikjax.placement.splits.consistent_splits` decides per layer
and group; a group that cannot split runs whole on every device). Each device computes a partial
sum; one `psum` per split group completes it (two per layer at most), the output head's logits
are gathered. The router is whole everywhere, so every device picks the same experts and computes
those it holds. The latent KV cache (mla 1-3) is one stream read by every head: each device keeps
a whole copy and writes the same rows; with -mla 0 the per-head K/V cache is split with the heads.

Weights: each device's part is cut from the file's bytes (only this process's devices' parts are
read, so under jax.distributed each host reads its share), then stacked and repacked for the
kernels on that device exactly as one device would (`ikjax.model.weights.TensorLoader`), and every leaf
becomes one array `[n_devices, *part]` split on its first axis (whole copies for what is not
split): inside the step each device sees its own part, whatever its layout.

Routed experts in host RAM (`-ot exps=CPU`) stay one copy, the file's memory map: every device's
step calls the host-experts kernel (pallas_kernels/moe_matmul/host.py) with the slots of its own
range of experts (the others' weights zeroed, which the kernel skips), so the host computes each
selected expert once per step, whichever device asked; the psum joins the ranges. Big batches
are computed there too (no streaming under -sm graph yet).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ikjax import ops
from ikjax.errors import OptionError
from ikjax.gguf_io.tensors import is_routed_expert, layer_of, split_group, validate
from ikjax.model.deepseek2 import forward
from ikjax.model.weights import TensorLoader
from ikjax.placement.devices import BYTES_READ
from ikjax.placement.splits import MESH_AXIS


@dataclass(frozen=True)
class TensorSplit:
    """What a -sm graph step splits (static: part of the compile key): the mesh, and the keys of
    the split groups — "embd", "out", and "{layer}.attn" / ".ffn" / ".shexp" / ".exps"."""
    mesh: Any
    split: frozenset
    axis: str = MESH_AXIS

    @property
    def n(self) -> int:
        return int(self.mesh.devices.size)

    def has(self, key: str) -> bool:
        return key in self.split


def tensor_split(placement, mesh) -> TensorSplit:
    """The split groups of a -sm graph placement."""
    keys = set()
    names = {t.name for t in placement.tensors}
    for t in placement.tensors:
        if t.split_dim is None:
            continue
        if t.name.startswith("token_embd."):
            keys.add("embd")
            if "output.weight" not in names:  # tied: the head reads the same split rows
                keys.add("out")
        elif t.name.startswith("output."):
            keys.add("out")
        else:
            group = split_group(t.name)
            if group not in (None, "router"):
                keys.add(f"{layer_of(t.name)}.{group}")
    for t in placement.tensors:  # host-resident experts: whole, each device's host call takes a range
        if t.on_host and not placement.unified and is_routed_expert(t.name):
            keys.add(f"{layer_of(t.name)}.exps")
    return TensorSplit(mesh, frozenset(keys))


# -- loading -----------------------------------------------------------------------------------------

def _part_placer(placement, k: int, n: int, device):
    """The placer of mesh position k: the k-th of n equal parts of each split tensor (its
    `split_dim`), the whole of the others, copied to `device`. Host-resident routed experts next to
    accelerators stay the memory map's bytes, one copy for all devices."""
    def place(name: str, data):
        t = placement[name]
        if t.on_host and not placement.unified:
            return data
        if t.split_dim is not None:
            d = t.split_dim % data.ndim
            size = data.shape[d] // n
            index = [slice(None)] * data.ndim
            index[d] = slice(k * size, (k + 1) * size)
            data = data[tuple(index)]
        BYTES_READ[0] += data.nbytes
        return jax.device_put(np.ascontiguousarray(data), device)
    return place


_expand = None


def _stack(trees: list, positions: list[int], mesh) -> Any:
    """Per-device trees of the same structure (parts of this process's devices, in mesh positions
    `positions`) -> one tree whose leaves are `[n, *part]` arrays split on their first axis."""
    global _expand
    if _expand is None:  # donated: the part's buffer becomes the stacked array's (no second copy)
        _expand = jax.jit(lambda a: a[None], donate_argnums=0)
    flat = [jax.tree.flatten(t) for t in trees]
    treedef = flat[0][1]
    if any(f[1] != treedef for f in flat[1:]):
        raise OptionError("sm: -sm graph cut a tensor into parts of different layouts (a bug: please report)")
    n = int(mesh.devices.size)
    sh = NamedSharding(mesh, P(MESH_AXIS))
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for j in range(len(flat[0][0])):
            parts = [_expand(f[0][j]) for f in flat]
            out.append(jax.make_array_from_single_device_arrays((n,) + tuple(parts[0].shape[1:]), sh, parts))
    return jax.tree.unflatten(treedef, out)


def load(gf, cfg, placement, mesh, spans) -> dict:
    """The weight tree of a -sm graph step (module docstring), one layer at a time so a device
    holds at most one layer twice while it is stacked."""
    host = [t for t in placement.tensors if t.on_host]
    if host and not placement.unified:
        for t in host:
            if not is_routed_expert(t.name):
                raise OptionError(f"ot: {t.name} is placed in host memory ({t.rule}); next to accelerators only "
                                  f"routed experts (ffn_*_exps) can stay in host memory")
        why = ops.host_experts_unavailable()
        if why:
            raise OptionError(f"ot: {host[0].name} is placed in host memory ({host[0].rule}), but {why}")
    validate(gf.tensors, cfg, gf.path)
    devices = list(mesh.devices.flat)
    n = len(devices)
    me = jax.process_index()
    mine = [k for k, d in enumerate(devices) if d.process_index == me]
    repack = ops.needs_repack()
    shared: dict = {}  # host-resident experts: one HostQuantArray (memory-map bytes) for every device
    loaders = [TensorLoader(gf, cfg, _part_placer(placement, k, n, devices[k]), placement, repack, shared)
               for k in mine]
    tops = [ld.top() for ld in loaders]
    tied = tops[0]["output"] is tops[0]["token_embd"]
    if tied:
        for t in tops:
            del t["output"]
    weights = _stack(tops, mine, mesh)
    if tied:
        weights["output"] = weights["token_embd"]
    weights["groups"] = [_stack([ld.group(first, count) for ld in loaders], mine, mesh) for first, count in spans]
    return weights


# -- the step ----------------------------------------------------------------------------------------

def cache_specs(layout, tp: TensorSplit) -> dict:
    """PartitionSpecs of the KV cache: the latent whole on every device; -mla 0's per-head K/V
    split with the heads of layers whose attention is split."""
    def spec(i: int, width: int):  # entries [count, B, S, ...] of the group whose first layer is i
        split = layout.kind == "kv" and tp.has(f"{i}.attn")
        if layout.ctk == "q8_0":
            return {"q": P(None, None, None, tp.axis, None), "d": P(None, None, None, tp.axis)} if split else \
                {"q": P(), "d": P()}
        return P(None, None, None, tp.axis) if split else P()
    firsts = np.cumsum((0,) + layout.group_counts[:-1])
    return {name: [spec(int(i), w) for i in firsts] for name, w in layout.widths}


def check_cache(layout, tp: TensorSplit) -> None:
    """-mla 0 with a q8_0 cache splits K/V rows at 32-value blocks: each device's heads must fill
    whole blocks."""
    if layout.kind != "kv" or layout.ctk != "q8_0":
        return
    for name, width in layout.widths:
        if (width // tp.n) % 32:
            raise OptionError(f"ctk: -mla 0 with -sm graph over {tp.n} devices splits the {name} cache by heads "
                              f"into {width // tp.n}-value rows, not whole q8_0 blocks of 32 (use -ctk f16 or -mla 3)")


def cache_shardings(layout, tp: TensorSplit) -> dict:
    return jax.tree.map(lambda s: NamedSharding(tp.mesh, s), cache_specs(layout, tp),
                        is_leaf=lambda x: isinstance(x, P))


def _step(weights, cache, tokens, start, last, *, cfg, plan, layout):
    tp = plan.tp
    specs = cache_specs(layout, tp)

    def local(w, c, t, s, l_):
        w = jax.tree.map(lambda a: a[0], w)  # this device's part
        return forward(w, c, t, s, l_, cfg=cfg, plan=plan)
    f = jax.shard_map(local, mesh=tp.mesh, in_specs=(P(tp.axis), specs, P(), P(), P()), out_specs=(P(), specs),
                      check_vma=False)
    return f(weights, cache, tokens, start, last)


_jitted = None


def step():
    """The jitted -sm graph step: (weights, cache, tokens, start, last; cfg, plan, layout) ->
    (logits replicated, cache); the cache is donated."""
    global _jitted
    if _jitted is None:
        _jitted = jax.jit(_step, static_argnames=("cfg", "plan", "layout"), donate_argnums=(1,))
    return _jitted
