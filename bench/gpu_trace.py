"""The GPU's kernels in a JAX profiler trace (bench scripts' shared reader).

    with jax.profiler.trace(tmp, create_perfetto_trace=True): ...
    for e in gpu_kernels(tmp): e["name"], e["dur"] (us), e["args"].get("hlo_module")
    for e in host_events(tmp): the same off the GPUs (thunks, CUDA API calls)
"""
from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path


def gpu_kernels(trace_dir) -> Iterator[dict]:
    """Every complete event ("X") on a GPU's timeline in the perfetto traces under `trace_dir`."""
    for path in Path(trace_dir).rglob("perfetto_trace.json.gz"):
        ev = json.load(gzip.open(path))["traceEvents"]
        gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
               and "GPU" in e["args"]["name"]}
        yield from (e for e in ev if e.get("ph") == "X" and e["pid"] in gpu)


def host_events(trace_dir) -> Iterator[dict]:
    """Every complete event ("X") off the GPUs' timelines (XLA's thunks, the CUDA API calls, Python)."""
    for path in Path(trace_dir).rglob("perfetto_trace.json.gz"):
        ev = json.load(gzip.open(path))["traceEvents"]
        gpu = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
               and "GPU" in e["args"]["name"]}
        yield from (e for e in ev if e.get("ph") == "X" and e["pid"] not in gpu)
