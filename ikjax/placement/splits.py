"""Splits over several devices: which device(s) hold each tensor under `-sm layer` (a pipeline of
whole layers) and `-sm graph` (every layer split over a `jax.sharding.Mesh`), with `-ts` shares and
`-mg`. Pure rules on names, shapes and shares: `ikjax.placement.rules` applies them per tensor,
`ikjax.placement.devices` maps the result onto JAX devices, and the runtime runs it
(`ikjax.runtime.pipeline` for -sm layer, `ikjax.runtime.mesh` for -sm graph).

- `-sm layer`: llama.cpp's rule (`llm_load_tensors`): shares are made cumulative and normalized,
  and layer i goes to the first device whose cumulative share exceeds `(i - i_gpu_start) /
  act_gpu_layers` (`act_gpu_layers = min(ngl, n_layer + 1)`, so the output head counts as one more
  layer and, with the default -ngl, goes to the device of fraction `n_layer / (n_layer + 1)`: the
  last device holding layers). The embedding goes to the device of layer 0. Each device's KV cache
  holds only its layers. A step runs one jitted stage per device in turn (runtime's `Pipeline`), the
  activation moved from one device to the next (`jax.device_put`), as llama.cpp's pipeline does:
  one jit over weights committed to different devices is refused by JAX ("incompatible devices"),
  and a per-device stage keeps every kernel (C++ CPU custom calls, Pallas) usable unchanged.
- `-sm graph`: one mesh axis ("x") over the devices; each tensor's logical axes (placement's
  `logical_axes`, the jax-llm-examples ShardingRules pattern) map through `GRAPH_RULES`: heads for
  attention q/q_b/kv_b/k_b/v_b rows and attn_output columns, expert for routed experts, ffn for
  dense and shared FFN rows/columns, vocab for the embedding and the output head. A tensor is split
  on its first mapped dimension that divides into whole parts (whole heads, whole quant blocks of a
  row, whole interleaved row groups), and only where every matrix of its group splits
  (`consistent_splits`); the router never. ikjax.runtime.mesh loads the parts and runs the step
  on them with the same kernels as one device, inside shard_map. Uneven -ts shares are refused: -sm
  graph takes the devices with a non-zero share, and refuses unequal non-zero shares (every part of
  a split dimension has one size).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Sequence

from ikjax.errors import OptionError
from ikjax.gguf_io.tensors import layer_of, split_group

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
    if not math.isfinite(float(sum(tensor_split))):  # 1e308,1e308: the sum overflows, every fraction NaN
        raise OptionError(f"{flag}: shares {','.join(f'{x:g}' for x in tensor_split)} do not add up to a finite "
                          f"number; give proportions such as 3,1")
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


_GROUP_WORDS = {"attn": "the attention heads", "ffn": "the dense FFN rows", "shexp": "the shared experts' rows",
                "exps": "the routed experts", "embd": "the vocabulary", "out": "the vocabulary"}


def whole_groups(tensors: Sequence[Any], n: int) -> str:
    """What of a -sm graph placement over `n` devices runs whole on every device for want of
    dividing (`consistent_splits`), in words ("the attention heads, the routed experts"), or "" when
    every group that could split does. The router is never split, and host-resident experts are one
    copy by design: neither counts."""
    words: list[str] = []
    for t in tensors:
        if t.memory != "device":
            continue
        g = split_group(t.name)
        if t.name.startswith(("token_embd.", "output.")):
            g = "embd"
        if g in (None, "router") or t.split_dim is not None or not t.axes or not any(t.axes):
            continue
        w = _GROUP_WORDS.get(g, g)
        if w not in words:
            words.append(w)
    return ", ".join(words)


def consistent_splits(tensors: Sequence[Any]) -> list[Any]:
    """-sm graph runs each layer's attention, FFN, shared and routed experts split over the
    devices only where every matrix of the group splits (whole heads: q/q_b/kv_b/k_b/v_b rows and
    attn_output columns; whole FFN rows: gate/up rows and down columns; whole experts), so each
    device computes a partial sum that one all-reduce completes. A group with one matrix that
    cannot split (a dimension not divisible into whole quant blocks) runs whole on every device.
    The router is never split. Returns the TensorPlacements with `split_dim` made so."""
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
