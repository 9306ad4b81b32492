"""The memory plan: weights per place (device / host, as ikjax.placement decides), KV cache and the attention buffer,
computed from the file header and the options alone, before any weight moves; on a running
engine also what the process really holds at its peak (`MemoryPlan.peak_bytes`).

Where the memory goes on CPU (measured on the 4-layer V2-Lite shape, Q8_0, -c 1024 -ub 512;
see tests/test_memory_plan.py): the weights stay memory-mapped (jax.device_put of the mmapped
blocks is zero-copy on CPU; the pages become resident as a step reads them: the file size);
load adds copies only for the stacked same-input matrices and the f32 norms; each compiled step
keeps ~50-120 MB of compiler state; and the step itself needs XLA's buffers — for a prompt step
on the plain XLA path that is by far the largest part (8.8 GiB for that 2.2 GiB model: the
grouped MoE dequantizes every expert to f32 and XLA's CPU ragged_dot expands to dense products
of [tokens*k, experts*ffn]). Nothing but the compiler knows that last number, so it is taken
from the compiled step itself (`Compiled.memory_analysis()`: temp + outputs) before the step
runs; the runtime baseline, the load copies and the compiler state are measured on the process
(/proc/self/status). A plan that exceeds what the device (GPU) or the machine (CPU:
MemAvailable, this process's cgroup limits, RLIMIT_AS: the lowest, `available_memory`) has is
refused with one line: at load, and again
on CPU for each new step shape before it runs."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import resource
from dataclasses import dataclass
from typing import Iterable

import jax
import numpy as np

from ikjax.model.cache import CacheLayout
from ikjax import ops
from ikjax.errors import DoesNotFitError
from ikjax.gguf_io.config import ModelConfig
from ikjax.options import RunOptions
from ikjax.gguf_io.tensors import is_routed_expert
from ikjax.placement.rules import Placement, plan_placement

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    attention_buffer_bytes: int
    host_weights_bytes: int = 0
    # weights in each device's own memory (from the Placement), e.g. (("GPU0", n),) or (("CPU", n),)
    device_weights: tuple[tuple[str, int], ...] = ()
    unified: bool = True  # host and device memory are one RAM (CPU-only machine)
    # KV cache bytes on each device (-sm layer: its layers' share; -sm graph: a whole copy on each)
    device_kv: tuple[tuple[str, int], ...] = ()
    split_mode: str = "none"
    # the context asked for (-c) and the rows the cache holds for it (rounded up to --kv-block; per sequence)
    ctx: int | None = None
    kv_rows: int | None = None
    # Measured on the running process (None where there is none: `ikjax info`):
    runtime_bytes: int | None = None  # RSS before the model: Python, JAX and XLA's runtime
    load_copy_bytes: int | None = None  # anonymous memory the load added besides the weights (f32 norms, repacks)
    compile_bytes: int | None = None  # what the XLA compilations of the steps kept
    # the most a compilation grew the process by beyond what it kept (its freed memory handed back
    # after it, `settle_compile`): compiles run one at a time, so only the largest counts
    compile_transient_bytes: int = 0
    # From the compiler: XLA buffers (temp + outputs) of the largest step compiled so far
    compute_bytes: int | None = None
    compute_step: str = ""
    # Host-resident experts streamed to the device by prompt steps past ik's threshold: the blocks
    # a step holds on the device at once (a round's raw blocks and their kernel layout), 0 if none
    stream_buffer_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return (self.weights_bytes - self.host_weights_bytes + self.kv_bytes + self.attention_buffer_bytes
                + self.stream_buffer_bytes)

    @property
    def per_device(self) -> dict[str, int]:
        """Weight bytes in each device's own memory, by device name ("GPU0", ...; "CPU0", ... for a
        split over several CPU devices; "CPU" for the one device of a CPU-only process)."""
        return dict(self.device_weights)

    @property
    def per_device_total(self) -> dict[str, int]:
        """Weights + KV cache on each device: what the load checks against each device's memory."""
        kv = dict(self.device_kv)
        return {d: n + kv.get(d, 0) for d, n in self.device_weights}

    @property
    def step_bytes(self) -> int:
        """Buffers of a step: XLA's own number once a step is compiled, else the attention buffer."""
        return self.attention_buffer_bytes if self.compute_bytes is None else self.compute_bytes

    @property
    def measured_bytes(self) -> int:
        """Runtime + load copies + compiled steps: what the process measured (0 where nothing)."""
        return ((self.runtime_bytes or 0) + (self.load_copy_bytes or 0) + (self.compile_bytes or 0)
                + self.compile_transient_bytes)

    @property
    def peak_bytes(self) -> int:
        """What the process holds at its peak on CPU (host memory = device memory there)."""
        return self.measured_bytes + self.weights_bytes + self.kv_bytes + self.step_bytes

    def lines(self) -> list[str]:
        """The plan from the file and the options (what `ikjax info` prints too)."""
        out = [f"weights          {self.weights_bytes / MIB:10.2f} MiB"]
        if len(self.device_weights) > 1:
            kv = dict(self.device_kv)
            for dev, nbytes in self.device_weights:
                out.append(f"  on {dev:<12}{nbytes / MIB:10.2f} MiB weights, {kv.get(dev, 0) / MIB:.2f} MiB KV cache"
                           f" (-sm {self.split_mode})")
            if self.host_weights_bytes:
                out.append(f"  on host        {self.host_weights_bytes / MIB:10.2f} MiB"
                           + (" (no accelerator here: host and device are one RAM)" if self.unified else ""))
        elif self.host_weights_bytes:
            for dev, nbytes in self.device_weights:
                out.append(f"  on device {dev:<5}{nbytes / MIB:10.2f} MiB")
            out.append(f"  on host        {self.host_weights_bytes / MIB:10.2f} MiB"
                       + (" (no accelerator here: host and device are one RAM)" if self.unified else ""))
        rounded = (f", {self.kv_rows} tokens: -c {self.ctx} rounded up to --kv-block"
                   if self.ctx is not None and self.kv_rows is not None and self.kv_rows != self.ctx else "")
        out += [f"KV cache         {self.kv_bytes / MIB:10.2f} MiB ({self.kv_bytes_per_token} B/token{rounded})",
                f"attention buffer {self.attention_buffer_bytes / MIB:10.2f} MiB"]
        if self.stream_buffer_bytes:
            out.append(f"stream buffer    {self.stream_buffer_bytes / MIB:10.2f} MiB (host experts on the device "
                       f"during big prompt steps)")
        return out

    def peak_lines(self) -> list[str]:
        """The measured parts and the peak of a running engine (empty where nothing was measured)."""
        if self.runtime_bytes is None:
            return []
        out = [f"runtime          {self.runtime_bytes / MIB:10.2f} MiB (Python, JAX/XLA, measured)",
               f"load copies      {(self.load_copy_bytes or 0) / MIB:10.2f} MiB (f32 norms, repacks; stacked layers count as weights)",
               f"compiled steps   {(self.compile_bytes or 0) / MIB:10.2f} MiB (compiler state kept)"]
        if self.compile_transient_bytes:
            out.append(f"compiling        {self.compile_transient_bytes / MIB:10.2f} MiB (the largest compile's "
                       f"working memory, freed after it)")
        if self.compute_bytes is not None:
            out.append(f"compute buffers  {self.compute_bytes / MIB:10.2f} MiB (XLA, {self.compute_step})")
        out.append(f"peak (process)   {self.peak_bytes / MIB:10.2f} MiB")
        return out

    def with_compute(self, nbytes: int, step: str) -> "MemoryPlan":
        if self.compute_bytes is not None and nbytes <= self.compute_bytes:
            return self
        return dataclasses.replace(self, compute_bytes=int(nbytes), compute_step=step)


# -- what this process holds and what the machine has ------------------------------------------------

def process_memory() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process (Linux /proc/self/status; (0, 0)
    where there is no /proc)."""
    anon = file = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith(("RssFile:", "RssShmem:")):
                    file += int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


def release_freed_memory() -> None:
    """Hand the heap memory malloc keeps after frees back to the system (glibc's malloc_trim; a
    no-op elsewhere). XLA compiles in threads of its own: what the compiler frees stays in their
    malloc arenas, where the steps' own allocations do not reuse it, so a first run that compiled
    cold peaked ~40 MiB above one that loaded its steps (RESULTS §9h)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mapped_rss(paths: Iterable[str]) -> int:
    """Resident bytes of this process's mappings of these files (/proc/self/smaps): the part of a
    memory-mapped model that already counts in the process's RSS. 0 where there is no /proc."""
    want = {os.path.realpath(p) for p in paths}
    total = 0
    current = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    current = len(head) == 6 and head[5].strip() in want
                elif current and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


@functools.cache
def runtime_ready() -> None:
    """Run one trivial computation, once per process, before the memory plan measures the runtime:
    XLA sets up its execution machinery (thread pools, ~50 MiB on CPU) at the first run, which
    belongs to the runtime part of the plan, not to whichever step happens to run first."""
    jax.jit(lambda x: x + 1)(np.int32(0)).block_until_ready()


def charge_load(plan: MemoryPlan, before: tuple[int, int], after: tuple[int, int], mapped: int,
                held: int = 0) -> MemoryPlan:
    """The plan with what a load added besides the weights, which weights_bytes counts in full:
    the mapped file's pages (`mapped`) and the weights the load copied whole into memory of its
    own (`held`: a scanned layer group's stacked matrices on a CPU-only machine) are the weights;
    the rest is f32 norms, repacked layouts, the modules and helpers it brought in. `before` /
    `after`: `process_memory()` around the load. Why `held`: counted as load copies too, a CPU
    model's stacked layers counted twice (the 61-layer R1 shape of 18.4 GiB was refused on a
    23 GiB machine as needing 36.7 GiB; the 8-layer one planned 5.0 GiB for 2.6 GiB held)."""
    return dataclasses.replace(plan, load_copy_bytes=max(0, sum(after) - mapped - sum(before) - held))


def charge_compile(plan: MemoryPlan, before: tuple[int, int], after: tuple[int, int], exe, what: str) -> MemoryPlan:
    """The plan charged with a new compiled step: what the process grew by while compiling
    (`process_memory()` around it; compiling reads no weight pages, so all of it is compiler
    state), and XLA's buffers of the step (temp + outputs - aliased, from
    `exe.memory_analysis()`) as the compute part where it is the largest so far. A backend
    without the analysis leaves the attention-buffer formula standing."""
    plan = dataclasses.replace(plan, compile_bytes=plan.compile_bytes + max(0, sum(after) - sum(before)))
    try:
        ma = exe.memory_analysis()
    except Exception:  # a backend without the analysis: the attention-buffer formula stands
        ma = None
    if ma is not None:
        plan = plan.with_compute(ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes, what)
    return plan


def settle_compile(plan: MemoryPlan, peak: tuple[int, int], released: tuple[int, int]) -> MemoryPlan:
    """The plan once a compile's freed memory went back to the system (`release_freed_memory`):
    `charge_compile` charged all the compile grew by (`peak`, measured before the release); what
    the release handed back (down to `released`) was working memory, not state the step keeps.
    Compiles run one at a time where this is called (a CPU-only process), so the working memory
    of the largest one, not of all, is the peak's: counting every compile's in full put the plan
    of a 2-layer model 16 % above its peak RSS once a prompt step compiled a second layer form."""
    freed = max(0, sum(peak) - sum(released))
    freed = min(freed, plan.compile_bytes or 0)
    return dataclasses.replace(plan, compile_bytes=(plan.compile_bytes or 0) - freed,
                               compile_transient_bytes=max(plan.compile_transient_bytes, freed))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().strip()
    except OSError:
        return None
    return int(v) if v.isdigit() else None


def _vm_size() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _own_cgroups() -> list[tuple[str, str]]:
    """(limit file, usage file) of this process's memory cgroup and of each cgroup above it (a
    parent's limit binds its children too), cgroup v2 and v1, from /proc/self/cgroup; the mount's
    root files as well (inside a container the cgroup path is often the mount's root)."""
    out: list[tuple[str, str]] = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            root, limit, usage = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit, usage = "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        d = rel.strip("/")
        while True:
            base = os.path.join(root, d) if d else root
            out.append((os.path.join(base, limit), os.path.join(base, usage)))
            if not d:
                break
            d = os.path.dirname(d)
    for pair in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        if pair not in out:
            out.append(pair)
    return out


def available_memory() -> tuple[int | None, str]:
    """Bytes this process can still take, and where the number comes from: the least of
    MemAvailable (/proc/meminfo), each memory cgroup limit over this process (its own cgroup and
    those above it, v2 memory.max or v1 memory.limit_in_bytes, less their usage), and the address
    space limit RLIMIT_AS (`ulimit -v`, `prlimit --as`) less the address space in use (VmSize).

    Why all three: with MemAvailable alone a run under `prlimit --as=2G` passed the plan, compiled,
    echoed the prompt and died in the first step with RESOURCE_EXHAUSTED (or std::bad_alloc); the
    kernel enforces whichever limit is lowest, so the plan must too, and say which one it was.
    (None, why) if nothing is known."""
    cands: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    cands.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    for limit_file, usage_file in _own_cgroups():
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            cands.append((max(0, limit - usage), f"cgroup memory limit {limit >> 20} MiB ({limit_file})"))
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError):
        soft = resource.RLIM_INFINITY
    if soft != resource.RLIM_INFINITY:
        vm = _vm_size()
        if vm is not None:
            cands.append((max(0, soft - vm), f"RLIMIT_AS {soft >> 20} MiB (ulimit -v), {vm >> 20} MiB of "
                                             f"address space in use"))
    if not cands:
        return None, "no /proc/meminfo"
    return min(cands, key=lambda c: c[0])


def cache_capacity(options: RunOptions) -> int:
    """Cache rows per sequence: the context `-c` in whole KV blocks, nothing more.

    ik_llama.cpp pads n_ctx the same way (GGML_PAD to llama_kv_cache_get_padding: 256 with flash
    attention) and adds no micro-batch. The cache once held one padded micro-batch past the context
    (`-c 4096 -ub 2048`: 6144 rows, 54 MiB where ik allocates 36) so that a prompt step padded to
    its token bucket could never write past the end, where dynamic_update_slice would clamp it onto
    earlier rows; a step whose bucket would now run past the end computes only the rows left
    instead (`Engine.prompt_tokens`), and the KV buckets stop at this many rows."""
    o = options
    return -(-o.ctx // o.kv_block) * o.kv_block


def plan_memory(cfg: ModelConfig, options: RunOptions, tensor_bytes: Iterable[tuple[str, int]] | None = None,
                batch: int = 1, *, placement: Placement | None = None, stream_whole: bool = True) -> MemoryPlan:
    """The plan from the header and the options. Weights per place come from the `Placement`
    (given by a loaded engine; else made here from (name, nbytes) pairs, as `ikjax info` does).
    `stream_whole=False`: host experts of big batches cross by runs of experts even where
    IKJAX_STREAM=layer would move whole layers (the engine's choice when two do not fit the device)."""
    o = options
    capacity = cache_capacity(o)
    layout = CacheLayout.for_model(cfg, o.mla, o.ctk, batch, capacity)
    kv_cols = o.kv_block if o.fa else capacity
    buf = batch * o.ubatch * cfg.n_head * kv_cols * 4
    if not o.fa and o.amb:
        buf = min(buf, max(o.amb * MIB, batch * o.ubatch * kv_cols * 4))
    if placement is None:
        if tensor_bytes is None:
            raise ValueError("plan_memory: give tensor_bytes or a placement")
        placement = plan_placement(cfg, ((name, None, nbytes) for name, nbytes in tensor_bytes), o)
    return MemoryPlan(placement.total_bytes, layout.total_bytes(), layout.bytes_per_token(), buf,
                      placement.host_bytes, device_weights=tuple(placement.device_bytes().items()),
                      unified=placement.unified, device_kv=kv_per_device(placement, layout),
                      split_mode=placement.split_mode, ctx=o.ctx, kv_rows=capacity,
                      stream_buffer_bytes=stream_buffer(placement, o.ubatch, hot=bool(o.gpu_experts)
                                                        or placement.split_mode == "graph", whole=stream_whole))


def stream_buffer(placement: Placement, ubatch: int, hot: bool = False, whole: bool = True) -> int:
    """Device bytes of host-resident tensors in flight: any non-expert one while its op runs, and
    routed experts during a prompt step that streams them (ik's rule: ubatch x n_expert_used >= min_offload_batch x n_expert; ikjax.kernels
    `_moe_stream`): IKJAX_STREAM=active holds one round (IKJAX_STREAM_MIB of raw blocks, at most a
    layer) as stored plus in the kernels' layout; =chunks IKJAX_STREAM_AHEAD runs of experts, both
    forms; =layer two layers' tensors, both forms; =auto
    whichever `ops.stream_mode` picks for a batch of `ubatch` (`hot`: --gpu-experts is given, or
    -sm graph, whose devices stream by round from one copy; `whole=False`: two whole layers do not
    fit, so =layer streams chunks)."""
    if placement.unified:
        return 0
    # any other host-placed tensor is moved to the device by every step that reads it
    # (host_weights.HostTensor): the largest layer's worth, or the top-level ones', at a time
    others: dict[int | None, int] = {}
    for t in placement.tensors:
        if t.on_host and not is_routed_expert(t.name):
            others[t.layer] = others.get(t.layer, 0) + t.nbytes
    transient = max(others.values(), default=0)
    if not placement.n_expert or ubatch * placement.n_expert_used < placement.min_offload_batch * placement.n_expert:
        return transient
    per_layer: dict[int, int] = {}
    for t in placement.tensors:
        if t.on_host and is_routed_expert(t.name) and t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.nbytes
    if not per_layer:
        return transient
    layer = max(per_layer.values())
    mode = ops.stream_mode(ubatch, placement.n_expert, placement.n_expert_used, hot=hot)
    if mode == "layer" and whole:
        return transient + 2 * 2 * layer
    per_expert = layer // placement.n_expert
    if mode in ("chunks", "layer"):  # (layer without room for two: chunks, ops._moe_stream)
        return transient + 2 * ops.stream_ahead() * ops.chunk_experts(per_expert, placement.n_expert) * per_expert
    return transient + 2 * ops.stream_slots_for(per_expert, placement.n_expert) * per_expert


def kv_per_device(placement: Placement, layout: CacheLayout) -> tuple[tuple[str, int], ...]:
    """KV cache bytes on each device: -sm layer splits it with the layers, -sm graph keeps a whole
    copy on every device of the mesh (ikjax.runtime.mesh), otherwise the main device holds it."""
    per_layer = layout.total_bytes() // max(layout.n_layer, 1)
    out = {d: 0 for d in placement.devices}
    if placement.split_mode == "layer":
        for i in range(layout.n_layer):
            out[placement.devices[placement.layer_device[i]]] += per_layer
    elif placement.split_mode == "graph":
        for d in placement.tensors[0].spread:
            out[d] += layout.total_bytes()
    else:
        out[placement.devices[placement.main_device]] += layout.total_bytes()
    return tuple(out.items())


def device_limit(device) -> int | None:
    """Bytes a device can hold (its allocator's limit), or None where the backend does not say
    (CPU devices: they share the machine's RAM, checked as a whole; another process's device: that
    process checks its own)."""
    if getattr(device, "process_index", 0) != jax.process_index():
        return None
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def check_devices(plan: MemoryPlan, devices: dict, source: str) -> None:
    """Refuse a split that leaves one device over its memory: weights + KV cache of each device
    (`plan.per_device_total`) against `device_limit` of the JAX device of that name."""
    for name, need in plan.per_device_total.items():
        dev = devices.get(name)
        limit = None if dev is None else device_limit(dev)
        if limit and need > limit:
            raise DoesNotFitError(f"{source}: -sm {plan.split_mode} puts {need / MIB:.0f} MiB (weights and KV cache) "
                                  f"on {name}, which has {limit / MIB:.0f} MiB (change -ts, lower -c, use -ctk q8_0 "
                                  f"or -ot exps=CPU)")


def check_fits(plan: MemoryPlan, options: RunOptions, source: str, what: str = "") -> None:
    """Refuse, before loading or before a step runs, what cannot run here: a plan larger than the
    accelerator's memory, and on CPU a peak larger than what this process holds plus what the
    machine still has free."""
    backend = jax.default_backend()
    if backend == "cpu":
        avail, src = available_memory()
        if avail is None:
            return
        anon, file = process_memory()
        held = anon + file
        more = plan.peak_bytes - held
        if more > avail:
            step = f" for {what}" if what else ""
            raise DoesNotFitError(
                f"{source}: needs {plan.peak_bytes / MIB:.0f} MiB of host memory{step} (weights "
                f"{plan.weights_bytes / MIB:.0f}, KV cache {plan.kv_bytes / MIB:.0f}, step buffers "
                f"{plan.step_bytes / MIB:.0f}, runtime {plan.measured_bytes / MIB:.0f}); "
                f"this process holds {held / MIB:.0f} MiB and {avail / MIB:.0f} MiB more are available ({src}) "
                f"(lower -ub{' or -c, use -ctk q8_0' if options.ctk != 'q8_0' else ' or -c'}, or a smaller model)")
        return
    # host-placed tensors next to an accelerator: routed experts run from host memory, anything
    # else is refused by the loader (weights.placer_for) before a tensor is read
    if len(plan.device_weights) > 1:  # several devices: each one against its own memory (check_devices)
        return
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit and plan.device_bytes > limit:
        raise DoesNotFitError(f"{source}: needs {plan.device_bytes / MIB:.0f} MiB on {backend}, "
                              f"the device has {limit / MIB:.0f} MiB (lower -c, use -ctk q8_0 or -ot)")
