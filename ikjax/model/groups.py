"""Layer groups: runs of consecutive identical layers that a step computes with one `lax.scan`.

Why: unrolled, every layer is traced, lowered and compiled again, so compile time grows with depth
(tiny preset on a CPU: 4 layers 5.8 s, 61 layers 30.6 s; a 61-layer R1 compiled for minutes on
every new batch or KV bucket). Scanned, a run of identical layers is one loop whose body is one
layer: XLA compiles it once, whatever the depth (MaxText's `scan_layers`).

Identical means: the same tensors (keys, GGUF types, shapes), dense or MoE alike, and placed alike
(same memory and device, same -sm graph split). Routed experts in host memory next to an
accelerator (`-ot exps=CPU`) scan too: the group holds each layer's host tensor as loaded
(`ikjax.placement.host.HostStack`) and its host calls pick the layer's bytes by the scan's index
at run time (`stacks_host_layers`; R1-16 with them unrolled compiled its first row in 44-54 s against
R1-7's 16.5 s, RESULTS §25l; scanned, a 16-layer R1 shape with 32 experts compiles its two steps in
4.1-5.7 s against 9.9-11.5 s unrolled, 0.94x the 4-layer file's, at the same S_PP / S_TG, §22x). A layer with any other tensor in host memory (fetched into the step)
is a group of its own, run as it is (unrolled). So is every layer with `IKJAX_LAYERS=unroll`, the
old form, kept for comparison.

GPU decode steps (`IKJAX_LAYERS=auto`, the default) run each group's scan with up to
IKJAX_DECODE_UNROLL layers an iteration (auto: 1 where XLA unrolls the decode graph's loops,
IKJAX_DECODE_GRAPH_UNROLL=1, the default since RESULTS §22s; else 4). Why more than one, with the
graph's loops kept: every iteration of a loop over layers inside the decode loop costs ~6-10 us a
token (H100, V2-Lite 27 layers, -c 4096, cold compile / S_TG at N_KV 0: scanned 16.3 s / 350, two
iterations 16.7 s / 378, four 22.4 s / 372, unrolled 24.3 s / 385, RESULTS §22; H200: scanned 355
against two iterations' 375, the decode loop's compile 5.7 s against 10.6 s, §22e). Up to 4 layers
an iteration keeps most of that (V2-Lite: 7 iterations, not 26) while the step traces at most 2 x 4
- 1 layers a group (a scan's remainder is traced apart), whatever the depth: two iterations of half
a group (`IKJAX_LAYERS=halves`, the form before) traced half the group, so a 61-layer R1's decode
compiled ~6x the layers of an 8-layer one.

A group's weights are one `LayerGroup` pytree: each leaf stacked on a new leading axis of
`count` (a QuantArray keeps its per-layer logical shape, its blocks gain the axis), except a group
of one, whose tensors stay as loaded. A group's KV cache is always stacked, `[count, B, S, W]`
(ikjax.model.cache).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from ikjax import env, ops
from ikjax.gguf_io.tensors import is_routed_expert, layer_specs
from ikjax.placement.host import HostStack, is_host_resident

LAYER_MODES = ("auto", "scan", "halves", "unroll")


def layer_mode() -> str:
    """IKJAX_LAYERS: "auto" (default), "scan", "halves" or "unroll"."""
    return env.choice("IKJAX_LAYERS")


def stacks_host_layers() -> bool:
    """Whether layers with routed experts in host memory scan as a group (HostStack): unless
    IKJAX_HOST_LAYERS=unroll, or a streaming form that takes a layer's host bytes as a step argument
    (IKJAX_STREAM=layer, IKJAX_STREAM_COPY=xla) rather than through the host calls' slot tables."""
    return (env.choice("IKJAX_HOST_LAYERS") == "scan" and env.choice("IKJAX_STREAM") != "layer"
            and env.choice("IKJAX_STREAM_COPY") != "xla")


def unroll_scan(n_tokens: int, backend: str, count: int) -> int:
    """How many layers of a group of `count` one iteration of its scan runs, in a step of
    `n_tokens` tokens on `backend` (module doc): for GPU decode under "auto", the count split into
    the fewest iterations of at most IKJAX_DECODE_UNROLL layers, as even as they go (26 -> 7 iterations
    of 4; a remainder of 2 traced apart), under "halves" two iterations of half; else 1."""
    mode = layer_mode()
    # "interpret": the GPU path's kernels run on a CPU (the tests' check of the GPU form)
    if n_tokens != 1 or backend not in ("pallas", "interpret") or mode not in ("auto", "halves"):
        return 1
    if mode == "halves":
        return -(-count // 2)
    iterations = -(-count // decode_unroll())
    return -(-count // iterations)


def decode_unroll() -> int:
    """IKJAX_DECODE_UNROLL: a positive integer, or "auto" (the default): 1 where XLA lays the decode
    graph's loops out flat (IKJAX_DECODE_GRAPH_UNROLL=1, the graph then has no loop iterations to
    save and one layer's kernels compile instead of four's), else 4."""
    if (env.raw("IKJAX_DECODE_UNROLL") or "auto").lower() == "auto":
        return 1 if env.choice("IKJAX_DECODE_GRAPH_UNROLL") == "1" else 4
    return env.positive_int("IKJAX_DECODE_UNROLL")


class LayerGroup:
    """Layers first .. first + count - 1 of the model: `tensors` their weights, stacked on a
    leading axis when count > 1 (else layer `first`'s dict as loaded). `first` and `count` are
    static (pytree aux data): they decide the step's structure."""
    __slots__ = ("first", "count", "tensors")

    def __init__(self, first: int, count: int, tensors: dict):
        self.first, self.count, self.tensors = int(first), int(count), tensors

    @property
    def stacked(self) -> bool:
        return self.count > 1

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.count)

    def layer(self, i: int) -> dict:
        """Layer i's tensors (i in `layers`): the dict itself for a group of one, else a slice of
        each stacked leaf (for tests and tools; a step never slices this way)."""
        if i not in self.layers:
            raise IndexError(f"layer {i} is not in group {self.first}..{self.first + self.count - 1}")
        if not self.stacked:
            return self.tensors
        j = i - self.first
        return {k: v.arrays[j] if isinstance(v, HostStack) else jax.tree.map(lambda a: a[j], v)
                for k, v in self.tensors.items()}

    def __repr__(self) -> str:
        return f"LayerGroup(layers {self.first}..{self.first + self.count - 1}, {sorted(self.tensors)})"


jax.tree_util.register_pytree_node(
    LayerGroup, lambda g: ((g.tensors,), (g.first, g.count)), lambda aux, c: LayerGroup(aux[0], aux[1], c[0]))


def _signature(cfg, i: int, tensors: Mapping[str, Any], placement) -> tuple | None:
    """What must agree for layer i to share a scan with its neighbour; None: never shares."""
    sig = [cfg.is_moe_layer(i)]
    for spec in layer_specs(cfg, i):
        info = tensors.get(spec.gguf_name)
        if info is None:
            sig.append((spec.key, None))
            continue
        where = None
        if placement is not None:
            t = placement[spec.gguf_name]
            if t.on_host and not placement.unified and not (is_routed_expert(spec.gguf_name) and stacks_host_layers()):
                return None  # read at its own host address, or fetched: run as it is
            where = (t.memory, t.device, t.spread, t.split_dim)
        sig.append((spec.key, getattr(info.qtype, "name", None), tuple(info.shape), where))
    return tuple(sig)


def layer_spans(cfg, tensors: Mapping[str, Any], placement=None, mode: str | None = None,
                max_stack_bytes: int | None = None) -> tuple[tuple[int, int], ...]:
    """(first, count) of each group, in layer order, covering layers 0 .. n_layer - 1: maximal runs
    of consecutive layers with the same `_signature` (all ones with mode "unroll"), each of whose
    stacked tensors stays under `max_stack_bytes` (default: `ops.pallas_stack_limit()` where the
    Pallas kernels read the weights: none where their offsets are 64-bit as needed, else below
    2^31 bytes; no limit elsewhere)."""
    mode = mode or layer_mode()
    if max_stack_bytes is None and ops.needs_repack():
        max_stack_bytes = ops.pallas_stack_limit()
    spans: list[list[int]] = []
    prev = None
    for i in range(cfg.n_layer):
        sig = _signature(cfg, i, tensors, placement) if mode != "unroll" else None
        if sig is not None and placement is not None and placement.hot(i):
            sig = ("gpu experts", i)  # its own set of GPU copies (--gpu-experts): a group of one
        biggest = max((getattr(tensors.get(s.gguf_name), "nbytes", 0) or 0 for s in layer_specs(cfg, i)
                       if not _apart(s.gguf_name, placement)), default=0)
        fits = max_stack_bytes is None or (spans and (spans[-1][1] + 1) * biggest <= max_stack_bytes)
        if spans and sig is not None and sig == prev and fits:
            spans[-1][1] += 1
        else:
            spans.append([i, 1])
        prev = sig
    return tuple((a, b) for a, b in spans)


def _apart(name: str, placement) -> bool:
    """A tensor that stays in host memory next to an accelerator: never part of a stack's bytes."""
    t = placement.by_name.get(name) if placement is not None and not placement.unified else None
    return t is not None and t.on_host


def layer_tensors(weights: dict, i: int) -> dict:
    """Layer i's tensors of a loaded weight tree (see `LayerGroup.layer`; i < 0 counts from the end)."""
    if i < 0:
        i += sum(g.count for g in weights["groups"])
    for g in weights["groups"]:
        if i in g.layers:
            return g.layer(i)
    raise IndexError(f"layer {i}: the model has {sum(g.count for g in weights['groups'])} layers")


def all_layers(weights: dict) -> list[dict]:
    """Every layer's tensors, in order (`layer_tensors` of each)."""
    return [g.layer(i) for g in weights["groups"] for i in g.layers]


def host_layers(weights: dict) -> list[dict]:
    """The tensors of every layer that holds a tensor in host memory (-ot ...=CPU), in order.
    Groups all in device memory are not sliced: a layer's slice of a stacked device array is an
    eager program (compiled once per shape) and a copy of that layer's weights; `all_layers` on a
    27-layer V2-Lite at sweep-bench's start compiled 81 of them, 4.7-9.7 s of a cold start, and
    copied 8 GB on the device (RESULTS §22g)."""
    return [g.layer(i) for g in weights["groups"]
            if any(is_host_resident(t) for t in jax.tree.leaves(g.tensors, is_leaf=is_host_resident))
            for i in g.layers]
