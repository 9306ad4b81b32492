"""Compiled steps and their cache: one executable per (batch bucket, token bucket, step plan
[, decode loop]), compiled once per engine (or loaded whole from an earlier run's store,
ikjax.runtime.compile_cache), counted, and charged to the engine's memory plan.

The jitted functions are module-level: one jit for all engines, so engines whose config, plan and
weight types agree share executables. The cache argument is donated, so XLA updates it in place.
Which function a step lowers and with which shardings is the executor's business
(ikjax.runtime.executors); `compile_step` here is the one-device form it uses.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ikjax import env
from ikjax.gguf_io.config import ModelConfig
from ikjax.model import cache as kvcache
from ikjax.model.deepseek2 import StepPlan, forward
from ikjax.options import RunOptions
from ikjax.runtime import compile_cache
from ikjax.runtime.generation import decode_steps
from ikjax.runtime.memory_plan import MemoryPlan, charge_compile, check_fits, process_memory, release_freed_memory

log = logging.getLogger("ikjax")

# One jit for all engines: engines whose config, plan and weight types agree share executables.
_jitted_forward = jax.jit(forward, static_argnames=("cfg", "plan"), donate_argnums=(1,))
_jitted_decode = jax.jit(decode_steps, static_argnames=("cfg", "plan", "chunk", "sampling"), donate_argnums=(1,))
# XLA's command buffers for the decode loop only: with WHILE the loop and its body become one CUDA
# graph (RESULTS §13b: one command buffer for the whole loop). ikjax turns command buffers off
# for everything else (ikjax/__init__.py), where they measured slower.
_DECODE_GPU_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,CUDNN,"
                                                        "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE",
                       "xla_gpu_graph_min_graph_size": 1}


def compile_step(weights, cache, B: int, T: int, *, cfg: ModelConfig, plan: StepPlan, sharding=None,
                 decode: tuple | None = None, gpu: bool = False):
    """Trace, lower and compile one step on one device: `cache` the cache's ShapeDtypeStructs,
    `sharding` that of the int32 inputs (None: the default device). `decode` = (chunk, sampling):
    the decode loop (`decode_steps`, compiled with `_DECODE_GPU_OPTIONS` on a GPU) instead of one
    step of T tokens."""
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=sharding)
    if decode is not None:
        chunk, sampling = decode
        lowered = _jitted_decode.lower(weights, cache, i32((B,)), i32((B,)), i32(()),
                                       jax.eval_shape(lambda: jax.random.key(0)), cfg=cfg,
                                       plan=plan, chunk=chunk, sampling=sampling)
        return lowered.compile(_DECODE_GPU_OPTIONS if gpu else None)
    return _jitted_forward.lower(weights, cache, i32((B, T)), i32((B,)), i32((B,)), cfg=cfg, plan=plan).compile()


# JAX settings that change what a traced step's arguments are (x64: Python ints and int64 inputs)
# or what it computes; part of a stored step's key.
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                 "jax_default_prng_impl", "jax_threefry_partitionable")


def step_arguments(weights, layout, B: int, T: int, decode: tuple | None) -> tuple:
    """The arguments a compiled step is called with, as ShapeDtypeStructs (the weights as given):
    (weights, cache, tokens, start, last) or, for the decode loop, (weights, cache, tokens, start,
    n, key) — what `compile_step` lowers and `Engine.step` / `Engine.decode` pass."""
    cache = jax.eval_shape(lambda: kvcache.init_cache(layout))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if decode is not None:
        return (weights, cache, i32((B,)), i32((B,)), i32(()), jax.eval_shape(lambda: jax.random.key(0)))
    return (weights, cache, i32((B, T)), i32((B,)), i32((B,)))


def _describe(a) -> tuple:
    """A leaf as a stored step's key sees it: shape, dtype, and for an array its placement."""
    sharding = getattr(a, "sharding", None)
    return (tuple(a.shape), str(a.dtype), str(sharding) if sharding is not None else None,
            getattr(sharding, "memory_kind", None))


class Executables:
    """The compiled steps of one engine, by key (B, T, plan, decode): `table` (key -> executable),
    `compiled` (keys counted), `count` (steps compiled or loaded by this engine, each once),
    `cache_hits` (of those, the ones JAX loaded from its persistent cache) and `memory`, the
    engine's memory plan, charged with each new step's compiler memory and XLA buffers.

    `executor` compiles a step for its devices (ikjax.runtime.executors); `layout(B)` is the KV
    cache layout of batch B; `source` names the model in a refusal."""

    def __init__(self, executor, *, config: ModelConfig, options: RunOptions,
                 layout: Callable[[int], Any], source: str, memory: MemoryPlan):
        self.executor = executor
        self.config, self.options, self.layout, self.source = config, options, layout, source
        self.memory = memory
        self.table: dict[tuple, Any] = {}
        self.compiled: set[tuple] = set()
        self.count = 0
        self.cache_hits = 0
        self._lock = threading.Lock()

    def get(self, weights, B: int, T: int, plan: StepPlan, decode: tuple | None = None):
        """The compiled step for this shape: compiled once, its XLA buffers (temp + outputs) put
        into the memory plan, and on CPU refused (DoesNotFitError) before it ever runs if the
        plan's peak exceeds what the machine has. `decode` = (chunk, sampling): the decode loop
        (`decode_steps`) instead of one step of T tokens."""
        key = (B, T, plan, decode)
        exe = self.table.get(key)
        if exe is not None:
            return exe
        with self._lock:
            self._note_compile(B, T, plan, decode)
        compile_cache.setup()
        hits0, writes0 = compile_cache.hits(), compile_cache.writes()
        before = process_memory()
        stored = self._stored_step(weights, key)
        # compiled by an earlier run: no tracing, no lowering; one made for other arguments is a miss
        exe = compile_cache.load_step(*stored) if stored else None
        loaded = exe is not None
        if not loaded:
            exe = self.executor.compile(weights, self.layout(B), B, T, plan, decode)
        if stored and not loaded and compile_cache.hits() == hits0:
            # only an executable compiled here: one JAX itself loaded from its cache does not
            # serialize again whole on XLA:CPU (a run of such an entry failed: "Function
            # wrapped_iota not found"), and in threads a hit elsewhere makes this one skip too
            compile_cache.store_step(stored[0], exe)
        with self._lock:  # steps compiling side by side (compile_in_parallel) share this bookkeeping
            exe = self._account(key, exe, hits0, writes0, before)
        if self.executor.on_cpu_only:
            # the compiler's freed memory back before the steps run beside the weights; after the
            # plan charged the compile what it grew by, which is the peak the compile reached
            release_freed_memory()
        return exe

    def precompile(self, weights, B: int, T: int, plan: StepPlan, decode: tuple | None = None) -> float:
        """Compile (no execution, no cache allocated) unless there already; seconds taken."""
        if (B, T, plan, decode) in self.table:
            return 0.0
        t0 = time.perf_counter()
        self.get(weights, B, T, plan, decode)
        return time.perf_counter() - t0

    def _note_compile(self, B: int, T: int, plan: StepPlan, decode: tuple | None = None) -> bool:
        key = (B, T, plan, decode)
        if key in self.compiled:
            return False
        self.compiled.add(key)
        self.count += 1
        what = f"decode loop of {decode[0]} steps" if decode else f"tokens {T}"
        log.info("compiling step: batch %d, %s, kv_len %d, mla %d, fa %d", B, what, plan.kv_len, plan.mla, plan.fa)
        return True

    def _stored_step(self, weights, key: tuple) -> tuple[tuple, Any] | None:
        """(parts, signature) of a step compiled for `key`, for compile_cache.load_step/store_step;
        None where steps are not stored whole: several devices, weights outside device memory, and
        by default a CPU (its steps trace and compile in about a second; IKJAX_STORE_STEPS=1
        stores them too, =0 never stores).

        `parts` is everything the executable's arguments and code are made of that tracing would
        see: the whole argument tree (weights, KV cache, inputs) with every leaf's shape, dtype,
        sharding and memory kind (the cache's type and length come from -ctk, -c, -mla and the
        batch: two runs differing only there once shared a key, and the second run's call failed
        with "pytree does not match" / "Argument types differ"), the run options, the model config,
        the step's key and the JAX settings that change traced types (x64) or numerics; the
        sources, versions, XLA_FLAGS and devices are added by compile_cache. `signature` (the
        argument tree and avals) is checked against a loaded executable before it is used."""
        store = env.choice("IKJAX_STORE_STEPS")
        if store == "0" or store == "auto" and self.executor.on_cpu_only:
            return None
        if not self.executor.stores_steps:
            return None
        for a in jax.tree.leaves(weights):
            if not isinstance(a, jax.Array) or getattr(a.sharding, "memory_kind", None) not in (None, "device"):
                return None
        B, T, _, decode = key
        args = step_arguments(weights, self.layout(B), B, T, decode)
        leaves, tree = jax.tree.flatten((args, {}))
        described = tuple(_describe(a) for a in leaves)
        settings = tuple((name, str(getattr(jax.config, name, None))) for name in _JAX_SETTINGS)
        parts = ("step", str(tree), described, repr(self.layout(B)), repr(self.options), self.config, key, settings)
        return parts, (tree, tuple((tuple(a.shape), str(a.dtype)) for a in leaves))

    def _account(self, key: tuple, exe, hits0: int, writes0: int, before: tuple[int, int]):
        """Count a new executable (cache hit or not) and put its buffers into the memory plan."""
        B, T, plan, decode = key
        if compile_cache.hits() > hits0 and compile_cache.writes() == writes0:
            self.cache_hits += 1
        what = f"the step of batch {B} x {T} tokens, kv_len {plan.kv_len}"
        mem = charge_compile(self.memory, before, process_memory(), exe, what)
        if jax.default_backend() == "cpu":
            check_fits(mem, self.options, self.source, what=what)
        self.memory = mem
        self.table[key] = exe
        return exe
