"""The memory plan printed at load: weights per place (device / host via -ot), KV cache, and the
attention buffer, computed from the file header and the options alone, before any weight moves.
A plan that exceeds the device's memory is refused here with one line."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import jax

from ikjax.cache import CacheLayout
from ikjax.errors import DoesNotFitError, OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.options import RunOptions

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    attention_buffer_bytes: int
    host_weights_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return self.weights_bytes - self.host_weights_bytes + self.kv_bytes + self.attention_buffer_bytes

    def lines(self) -> list[str]:
        out = [f"weights          {self.weights_bytes / MIB:10.2f} MiB"]
        if self.host_weights_bytes:
            out.append(f"  on host (-ot)  {self.host_weights_bytes / MIB:10.2f} MiB")
        out += [f"KV cache         {self.kv_bytes / MIB:10.2f} MiB ({self.kv_bytes_per_token} B/token)",
                f"attention buffer {self.attention_buffer_bytes / MIB:10.2f} MiB"]
        return out


def cache_capacity(options: RunOptions) -> int:
    """Cache rows per sequence: the context plus one padded micro-batch, in whole KV blocks."""
    o = options
    return -(-(o.ctx + o.ubatch) // o.kv_block) * o.kv_block


def placement(name: str, options: RunOptions) -> str:
    """'host' or 'device' for a tensor: the first -ot rule matching its name wins."""
    for rule in options.ot:
        if rule.matches(name):
            return "host" if rule.device == "CPU" else "device"
    return "device"


def plan_memory(cfg: ModelConfig, options: RunOptions, tensor_bytes: Iterable[tuple[str, int]],
                batch: int = 1) -> MemoryPlan:
    o = options
    capacity = cache_capacity(o)
    layout = CacheLayout.for_model(cfg, o.mla, o.ctk, batch, capacity)
    kv_cols = o.kv_block if o.fa else capacity
    buf = batch * o.ubatch * cfg.n_head * kv_cols * 4
    if not o.fa and o.amb:
        buf = min(buf, max(o.amb * MIB, batch * o.ubatch * kv_cols * 4))
    total = host = 0
    for name, nbytes in tensor_bytes:
        total += nbytes
        if placement(name, o) == "host":
            host += nbytes
    return MemoryPlan(total, layout.total_bytes(), layout.bytes_per_token(), buf, host)


def check_fits(plan: MemoryPlan, options: RunOptions, source: str) -> None:
    """Refuse, before loading, what cannot run here: -ot host placement on an accelerator (not
    implemented yet) and a plan larger than the accelerator's memory."""
    backend = jax.default_backend()
    if backend == "cpu":
        return  # host and device are the same memory
    if plan.host_weights_bytes:
        raise OptionError(f"ot: keeping tensors in host memory on {backend} is not implemented yet "
                          f"({plan.host_weights_bytes / MIB:.0f} MiB matched)")
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit and plan.device_bytes > limit:
        raise DoesNotFitError(f"{source}: needs {plan.device_bytes / MIB:.0f} MiB on {backend}, "
                              f"the device has {limit / MIB:.0f} MiB (lower -c, use -ctk q8_0 or -ot)")
