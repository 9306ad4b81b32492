"""Placement: where every GGUF tensor lives and where every op runs, decided once at load.

One function, `plan_placement`, reads the `-ot` rules (first match wins; `--cpu-moe` /
`--n-cpu-moe N` arrive already expanded into `-ot` rules by `RunOptions`), `-ngl` and the devices
present, and returns a `Placement`: for every tensor of the file its memory ("device" or "host"),
the device that holds it, its layer and its logical axes. The memory plan sums bytes per place
from it, the loader puts each tensor where it says, and the multi-device work maps the logical
axes onto a `jax.splits.Mesh` (the jax-llm-examples `ShardingRules` pattern: the model names
what each dimension *is*; a separate table says which mesh axis, if any, splits it).

The Placement is kept next to the weight tree (`Engine.placement`), not inside it: it is static
metadata (a frozen, hashable dataclass of strings and ints), so it can never become a traced leaf
and the model's pure functions read the same dicts as before.

Rules, as ik_llama.cpp applies them:
- `-ot REGEX=DEV`: the first rule whose regex matches the tensor name decides; `CPU` = host
  memory; `GPU`, `GPUn`, `CUDAn`, `DEVICEn` = device memory of accelerator n (0 without a
  number). A device index this machine does not have is refused (OptionError) — ik refuses a
  buffer type it does not know the same way. On a CPU-only machine the CPU is the one device:
  `GPU`/`CUDA0` name it (accepted, with a note that there is no accelerator and the tensor is in
  the one memory the CPU has), `CUDA1` is refused.
- `-ngl N` (llama.cpp's `i_gpu_start = n_layer - N`): layers `i < n_layer - N` stay in host
  memory, the last N layers go to the device; the output head (`output`, `output_norm`) goes to the
  device only when N > n_layer. So `-ngl 0` keeps everything on the host, and the default 99
  (> any layer count here) puts everything on the device. Tensors of layers past n_layer (the MTP
  `nextn` block) count as layers for this rule. One difference from ik: ik always keeps the input
  embedding (`token_embd`) in host memory and gathers its rows on the CPU; ikjax keeps it with the
  device layers (device unless `-ngl 0`) until the host-side gather exists (the plan counts it in the
  device's weights; no line singles it out).
- `-ot` rules take precedence over `-ngl`, as in ik (an override names the buffer outright).
- On a CPU-only machine device memory and host memory are the same RAM. The requested placement
  is recorded anyway (so the memory plan and `ikjax info` show what a GPU run would hold), and
  `Placement.unified` says both places are one memory.

Where an op runs follows from where its weights live (`runs_on`): an op whose weights are all on
the device runs there; one reading host-resident weights runs on the host for small batches and on
the device (weights streamed over) for big ones, with ik's thresholds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Sequence

from ikjax.errors import OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.tensors import is_routed_expert, layer_of, logical_axes
from ikjax.options import RunOptions
from ikjax.placement import splits

DEVICE, HOST = "device", "host"
HOST_DEVICE = "CPU"  # the label of host memory's processor

# ik_llama.cpp (ggml-cuda offload_op): a matmul on host-resident weights is worth moving to the GPU
# from 32 tokens; routed experts only when each expert sees that many tokens on average.
MIN_OFFLOAD_BATCH = 32


@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor lives: memory "device" or "host", the device label that holds it ("CPU" for
    host memory; "GPU0", ... on an accelerator; "CPU" for both on a CPU-only machine), its layer
    (None for token_embd / output / output_norm), its logical axes and its size in the file."""
    name: str
    memory: str
    device: str
    layer: int | None
    axes: tuple[str | None, ...] | None
    nbytes: int
    rule: str  # what decided it: "-ot PATTERN=DEV", "-ngl N" or "default"
    # -sm graph: the devices of the mesh that hold parts of it, and the NumPy dim split over them
    # (from the front; -1 = the last, the matrix's columns); None with `spread` = a whole copy on
    # each. Empty `spread`: the tensor is on `device` alone.
    spread: tuple[str, ...] = ()
    split_dim: int | None = None

    @property
    def on_host(self) -> bool:
        return self.memory == HOST


@dataclass(frozen=True)
class Placement:
    """Every tensor's place (`tensors`, in file order) and what was decided about the machine.

    `unified`: host and device memory are one (a CPU-only machine): the placement is recorded as
    requested, but both places are the same RAM. `min_offload_batch`: ik's 32 (see `runs_on`).
    """
    tensors: tuple[TensorPlacement, ...]
    devices: tuple[str, ...]  # device labels present, e.g. ("GPU0",) or ("CPU",)
    unified: bool
    n_expert: int = 0
    n_expert_used: int = 0
    min_offload_batch: int = MIN_OFFLOAD_BATCH
    notes: tuple[str, ...] = field(default=(), compare=False)
    # -sm: "none" (everything on devices[main_device]), "layer" (layer i on devices[layer_device[i]],
    # the embedding on devices[embed_device], the output head on devices[output_device]) or
    # "graph" (every device of the mesh holds its part of each tensor: TensorPlacement.spread).
    split_mode: str = "none"
    layer_device: tuple[int, ...] = ()
    embed_device: int = 0
    output_device: int = 0
    main_device: int = 0
    # --gpu-experts: (layer, expert ids) whose copies a GPU keeps beside the host-resident
    # routed experts of that layer (ikjax.placement.hot)
    hot_experts: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def hot(self, layer: int) -> tuple[int, ...]:
        """The experts of `layer` kept on the GPU (--gpu-experts), () for none."""
        return dict(self.hot_experts).get(layer, ())

    def stage_device(self, name: str) -> int:
        """The index (in `devices`, i.e. in this process's JAX device list) of the device whose
        step reads this tensor: its layer's device with -sm layer, the main device otherwise.
        Host-resident tensors are read by that device's step too (from host memory)."""
        if self.split_mode != "layer":
            return self.main_device
        layer = layer_of(name)
        if layer is not None and layer < len(self.layer_device):
            return self.layer_device[layer]
        return self.embed_device if name.startswith("token_embd.") else self.output_device

    @cached_property
    def by_name(self) -> dict[str, TensorPlacement]:
        return {t.name: t for t in self.tensors}

    def __getitem__(self, name: str) -> TensorPlacement:
        return self.by_name[name]

    def memory(self, name: str) -> str:
        return self.by_name[name].memory

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.on_host)

    def device_bytes(self) -> dict[str, int]:
        """Bytes of weights in each device's own memory (every device present, 0 where none)."""
        out = {d: 0 for d in self.devices}
        for t in self.tensors:
            if t.on_host:
                continue
            if t.spread:
                part = t.nbytes if t.split_dim is None else -(-t.nbytes // len(t.spread))
                for d in t.spread:
                    out[d] += part
            else:
                out[t.device] += t.nbytes
        return out

    def runs_on(self, op_tensors: Sequence[str], n_tokens: int) -> str:
        """Where an op reading these tensors runs for a batch of `n_tokens` (see `runs_on`)."""
        return runs_on([self.by_name[n] for n in op_tensors], n_tokens, n_expert=self.n_expert,
                       n_expert_used=self.n_expert_used, min_batch=self.min_offload_batch)


def runs_on(op_tensors: Sequence[TensorPlacement], n_tokens: int, *, n_expert: int = 0, n_expert_used: int = 0,
            min_batch: int = MIN_OFFLOAD_BATCH) -> str:
    """"device" or "host": where an op whose weights are `op_tensors` runs on a batch of `n_tokens`.

    ik_llama.cpp's rule (ggml-cuda's offload_op), written once here:
    - every weight in device memory: the device;
    - a host-resident embedding (a row gather): always the host — it reads a few rows;
    - host-resident routed experts: the device only when `n_tokens * n_expert_used >= min_batch *
      n_expert` (each expert then sees `min_batch` tokens on average, which pays for streaming the
      whole expert tensor over PCIe), else the host computes them where they live;
    - any other host-resident matrix: the device from `min_batch` tokens, else the host.
    """
    if n_tokens < 1:
        raise ValueError(f"runs_on: n_tokens must be >= 1, got {n_tokens}")
    host = [t for t in op_tensors if t.on_host]
    if not host:
        return DEVICE
    for t in host:
        if t.name.startswith("token_embd."):
            return HOST
        if is_routed_expert(t.name):
            if not n_expert or n_tokens * n_expert_used < min_batch * n_expert:
                return HOST
        elif n_tokens < min_batch:
            return HOST
    return DEVICE


_DEV = re.compile(r"(?i)(cpu)|(?:gpu|cuda|device)(\d*)")


def _device_labels(devices: Sequence[Any], several: bool = False) -> tuple[tuple[str, ...], bool]:
    """Labels of the accelerators present ("GPU0", ...), or ("CPU",) and unified=True where there
    are none (CPU devices of a CPU-only machine share one memory). `several`: a split over several
    CPU devices (-sm/-mg with e.g. --xla_force_host_platform_device_count) labels each one
    ("CPU0", "CPU1", ...); they still share one RAM (unified)."""
    accel = [d for d in devices if getattr(d, "platform", "cpu") != "cpu"]
    if not accel:
        if several and len(devices) > 1:
            return tuple(f"{HOST_DEVICE}{i}" for i in range(len(devices))), True
        return (HOST_DEVICE,), True
    return tuple(f"GPU{i}" for i in range(len(accel))), False


def check_ot_devices(options, devices: Sequence[Any] | None = None) -> None:
    """Refuse (OptionError) an `-ot` rule naming a device this machine does not have: `place`'s
    check (it makes it again with the split mode), made where a command checks its options, before
    it reads or tokenizes anything (perplexity printed its tokenization first)."""
    if not options.ot:
        return
    if devices is None:
        import jax
        devices = jax.devices()
    # (several=True: CPU devices labelled one by one, so nothing `place` would take is refused here)
    labels, unified = _device_labels(devices, several=True)
    for r in options.ot:
        _target(r.device, labels, unified, f"{r.pattern}={r.device}")


def _target(dev: str, labels: tuple[str, ...], unified: bool, rule: str) -> tuple[str, str]:
    """(memory, device label) an `-ot` device name stands for on this machine; OptionError if it
    names a device that does not exist here."""
    m = _DEV.fullmatch(dev)
    if m is None:
        raise OptionError(f"ot: unknown device {dev!r} in {rule!r} (use CPU, GPU, CUDA0, ...)")
    if m.group(1):
        return HOST, HOST_DEVICE
    idx = int(m.group(2) or 0)
    if unified and len(labels) > 1:  # several CPU devices: GPUn names the n-th of them
        if idx >= len(labels):
            raise OptionError(f"ot: {rule!r} names device {idx}, but this process has {len(labels)} CPU devices "
                              f"(use CUDA0..CUDA{len(labels) - 1} or CPU)")
        return DEVICE, labels[idx]
    if unified:
        if idx > 0:
            raise OptionError(f"ot: {rule!r} names accelerator {idx}, but this machine has no accelerator "
                              f"(only the CPU: use CPU, or GPU/CUDA0 for the one device)")
        return DEVICE, HOST_DEVICE
    if idx >= len(labels):
        valid = "CUDA0" if len(labels) == 1 else f"CUDA0..CUDA{len(labels) - 1}"
        raise OptionError(f"ot: {rule!r} names accelerator {idx}, but this machine has {len(labels)} "
                          f"({', '.join(labels)}; use {valid} or CPU)")
    return DEVICE, labels[idx]


def plan_placement(cfg: ModelConfig, tensors: Iterable[Any], options: RunOptions,
                   devices: Sequence[Any] | None = None) -> Placement:
    """Decide memory and device for every tensor of the file.

    `tensors`: the file's tensors, each a `TensorInfo`-like object (`.name`, `.shape`, `.nbytes`)
    or a tuple (name, shape, nbytes) — shape may be None where only names and sizes are known.
    `devices`: the JAX devices (default `jax.devices()`: every process's under jax.distributed, in
    process order, so every process labels them alike). Refuses (OptionError) an
    `-ot` device this machine does not have, before anything is loaded.
    """
    if devices is None:
        import jax
        devices = jax.devices()
    mode = options.split_mode
    labels, unified = _device_labels(devices, several=mode != "none" or options.main_gpu != 0)
    n_dev = len(labels)
    notes: list[str] = []
    if options.main_gpu >= n_dev:
        raise OptionError(f"mg: device {options.main_gpu} does not exist: this process has {n_dev} "
                          f"({', '.join(labels)}; use 0{f'..{n_dev - 1}' if n_dev > 1 else ''})")
    split: dict[str, Any] = {"main_device": options.main_gpu}
    if mode != "none" and n_dev == 1:
        notes.append(f"-sm {mode} has no effect with one device: everything runs on {labels[0]}")
        mode = "none"
    mesh: tuple[int, ...] = ()
    if mode == "layer":
        # split over the file's blocks as ik does (MTP layers counted, -ngl's count), the layers run kept
        layer_dev, out_dev = splits.layer_split(cfg.n_layer + cfg.n_nextn,
                                                  splits.shares_for(options.tensor_split, n_dev), options.ngl)
        layer_dev = layer_dev[:cfg.n_layer]
        split.update(layer_device=layer_dev, embed_device=layer_dev[0] if layer_dev else out_dev,
                     output_device=out_dev, main_device=layer_dev[0] if layer_dev else out_dev)
        used = set(layer_dev) | {out_dev}
        if options.tensor_split and len(used) < n_dev:  # as -sm graph's note: a 0 share leaves a device idle
            left = [labels[i] for i in range(n_dev) if i not in used]
            notes.append(f"-sm layer over {len(used)} of {n_dev} devices: -ts leaves out {', '.join(left)}")
    if mode == "graph":
        mesh = splits.graph_devices(options.tensor_split, n_dev)
        split.update(main_device=mesh[0])
        if options.main_gpu != 0:
            notes.append(f"-mg {options.main_gpu} has no effect with -sm graph: every layer runs on all of the mesh's "
                         f"devices ({', '.join(labels[i] for i in mesh)})")
        if len(mesh) < n_dev:
            left = [labels[i] for i in range(n_dev) if i not in mesh]
            notes.append(f"-sm graph over {len(mesh)} of {n_dev} devices: -ts leaves out {', '.join(left)}")
    if mode == "layer" and options.main_gpu != 0:
        notes.append(f"-mg {options.main_gpu} has no effect with -sm layer: the split (-ts) decides each layer's "
                     f"device, the first layers' on {labels[split['main_device']]}")
    if mode not in ("layer", "graph") and options.tensor_split and len(devices) > 1:
        notes.append("-ts has no effect with -sm none: the model runs on one device (-mg); ikjax's default split "
                     "mode is none, give -sm layer or -sm graph to split")
    main = labels[split["main_device"]]
    targets = []
    for r in options.ot:
        rule = f"{r.pattern}={r.device}"
        mem, dev = _target(r.device, labels, unified, rule)
        if mode != "none" and mem == DEVICE:
            raise OptionError(f"ot: {rule!r} names a device, but with -sm {mode} the split decides which device "
                              f"holds each tensor (-ts); only =CPU (host memory) combines with -sm")
        if mode == "none" and mem == DEVICE and dev != main:
            raise OptionError(f"ot: {rule!r} names {dev}, but with -sm none the model runs on one device, {main} "
                              f"(-mg {options.main_gpu}): an -ot rule moves tensors to CPU (host memory) or to "
                              f"that device; give -sm layer or -sm graph to use several")
        if unified and mem == DEVICE:
            notes.append(f"-ot {rule}: no accelerator here, the tensors it matches run on the CPU "
                         f"(device and host memory are one RAM)")
        targets.append((r, f"-ot {rule}", mem, dev))
    # -ngl counts the file's blocks as ik does (its n_layer is block_count, trailing MTP / nextn layers
    # included): the last ngl blocks on the device, the output head there only past all of them. Counted
    # over the layers ikjax runs, -ngl N put N + 1 blocks on the device and -ngl block_count the head too
    # (an outside review, stop 68: GLM-4.7-Flash's and V3's MTP layer)
    n_layer, ngl = cfg.n_layer + cfg.n_nextn, options.ngl
    # (99, the default, and any count of every layer: nothing to say; under -sm layer over several CPU
    # devices -ngl still picks the layers the split spreads)
    if unified and mode == "none" and ngl < n_layer:
        notes.append(f"-ngl {ngl} has no effect: no accelerator here, every layer runs on the CPU "
                     f"(device and host memory are one RAM)")
    first_device_layer = max(n_layer - ngl, 0)
    out = []
    matched: set[int] = set()
    for t in tensors:
        if isinstance(t, tuple):
            name, shape, nbytes = t
        else:
            name, shape, nbytes = t.name, t.shape, t.nbytes
        layer = layer_of(name)
        for i, (r, why, mem, dev) in enumerate(targets):
            if r.matches(name):
                matched.add(i)
                break
        else:
            if layer is not None:
                on_dev = layer >= first_device_layer
            elif name.startswith("token_embd."):
                on_dev = ngl > 0
            else:  # output head: llama.cpp's dev_output, on the device only when ngl > n_layer
                on_dev = ngl > n_layer
            why = "default" if ngl > n_layer else f"-ngl {ngl}"
            mem, dev = (DEVICE, main) if on_dev else (HOST, HOST_DEVICE)
        axes = logical_axes(name, None if shape is None else len(shape))
        spread, split_dim = (), None
        if mode == "layer" and mem == DEVICE:
            if layer is not None and layer < cfg.n_layer:
                dev = labels[split["layer_device"][layer]]
            else:
                dev = labels[split["embed_device"] if name.startswith("token_embd.") else split["output_device"]]
        elif mode == "graph":
            spread = tuple(labels[i] for i in mesh)
            split_dim = splits.graph_split_dim(axes, shape, getattr(t, "qtype", None), len(mesh), cfg.n_head)
            if mem == DEVICE:
                dev = spread[0]
            elif not unified:  # one copy in host RAM, read by every device's host call
                split_dim = None
        out.append(TensorPlacement(name, mem, dev, layer, axes, int(nbytes), why, spread, split_dim))
    for i, (r, why, _, _) in enumerate(targets):
        if i not in matched:
            shadow = any(r.matches(t.name) for t in out)  # matched, but an earlier rule took those tensors
            notes.append(f"{why}: " + ("every tensor it matches is taken by an earlier rule" if shadow
                                       else "matches no tensor of this file"))
    if mode == "graph":
        out = splits.consistent_splits(out)
        whole = splits.whole_groups(out, len(mesh))
        if whole and len(mesh) > 1:
            notes.append(f"-sm graph over {len(mesh)} devices: {whole} do not divide into {len(mesh)} whole parts; "
                         f"they run whole on every device (their memory on each, no speed-up from the split)")
    return Placement(tuple(out), labels, unified, cfg.n_expert, cfg.n_expert_used, notes=tuple(notes),
                     split_mode=mode, **split)
