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
from ikjax.errors import OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.model import cache as kvcache
from ikjax.model.deepseek2 import StepPlan, forward
from ikjax.options import RunOptions
from ikjax.placement.host import is_host_resident
from ikjax.runtime import compile_cache
from ikjax.runtime.generation import decode_steps
from ikjax.runtime.sampling import row_params
from ikjax.runtime.memory_plan import (MemoryPlan, charge_compile, check_fits, process_memory, release_freed_memory,
                                       settle_compile)

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


@functools.cache
def _check_option(name: str, value, asked_by: str) -> None:
    """An XLA compile option an IKJAX_* setting asks for, tried once on a trivial program: XLA's
    options differ between jaxlib versions, and a step's compile would otherwise fail with XLA's
    own message ("No such compile option") instead of one naming the setting."""
    try:
        jax.jit(lambda: jnp.int32(0)).lower().compile({name: value})
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" in str(e):
            raise OptionError(f"{asked_by}: this jaxlib ({jax.__version__}) has no XLA option {name}") from None
        raise


def gpu_options(plan: StepPlan, decode: bool, gpu: bool = True) -> dict | None:
    """XLA's compile options for one step (None off a GPU): the decode loop's command buffers (their
    layer loops unrolled in the graph with IKJAX_DECODE_GRAPH_UNROLL=1), and autotuning off
    (compile_cache.NO_GPU_AUTOTUNE) unless IKJAX_GPU_AUTOTUNE asks for it or the XLA path runs.
    Why off: with the Pallas kernels doing the products, a step's autotuning measures ~240 small
    fusions (native against block-level emitter, nearly always native) and the router's GEMM: 3-4 s
    of a cold start's ~10 s compile on an H200, for 1.2-2.5 % of S_PP and nothing of S_TG (RESULTS
    §22q). The XLA path's dequantized GEMMs are what autotuning is for (§22b: 8-40 % of S_PP)."""
    if not gpu:
        return None
    options = dict(_DECODE_GPU_OPTIONS) if decode else {}
    if decode and env.choice("IKJAX_DECODE_GRAPH_UNROLL") == "1":
        _check_option("xla_gpu_command_buffer_unroll_loops", True, "IKJAX_DECODE_GRAPH_UNROLL=1")
        options["xla_gpu_command_buffer_unroll_loops"] = True
    tune = env.choice("IKJAX_GPU_AUTOTUNE")
    if tune == "0" or (tune == "auto" and plan.backend == "pallas"):
        options.update(compile_cache.NO_GPU_AUTOTUNE)
    return options or None


def compile_side_by_side(work: list[tuple[Any, Callable[[], Any]]], max_threads: int = 8) -> list:
    """Run compile jobs `(family, fn)` on threads (XLA compiles with the GIL released), each
    family's first job before the rest of that family: the first of each family start together,
    and a family's others once its first is done. Steps of one family (the prompt steps of one
    token count at several KV buckets) hold the same GEMM fusions, and XLA keeps what its GPU
    autotuner measured for a fusion in the process (RESULTS §22b: compiled all at once, every step
    autotuned the same GEMMs again, the autotuning's kernel runs queueing on the one GPU); the
    followers then find those results instead of measuring them again. Results in `work`'s order.

    The families' firsts lower one at a time in `work`'s order (`compile_cache.LoweringTurns`):
    put the job whose XLA compile is longest first, its compile then runs while the others lower.
    A follower lowers when its first is done, as the lock lets it."""
    if len(work) <= 1:
        return [fn() for _, fn in work]
    from concurrent.futures import ThreadPoolExecutor

    firsts: dict[Any, int] = {}
    for i, (family, _) in enumerate(work):
        firsts.setdefault(family, i)
    turns = compile_cache.LoweringTurns()
    # every first is submitted before any follower, and enough threads run them all at once, so a
    # follower waiting for its first never holds a thread its first needs (nor a first its turn)
    with ThreadPoolExecutor(max(len(firsts), min(len(work), max_threads))) as pool:
        futures: dict[int, Any] = {i: pool.submit(compile_cache.in_turn, turns, turn, work[i][1])
                                   for turn, i in enumerate(firsts.values())}
        for i, (family, fn) in enumerate(work):
            if i not in futures:
                lead = futures[firsts[family]]
                futures[i] = pool.submit(lambda fn=fn, lead=lead: (lead.result(), fn())[1])
        return [futures[i].result() for i in range(len(work))]


def compile_step(weights, cache, B: int, T: int, *, cfg: ModelConfig, plan: StepPlan, sharding=None,
                 decode: tuple | None = None, gpu: bool = False):
    """Trace, lower and compile one step on one device: `cache` the cache's ShapeDtypeStructs,
    `sharding` that of the int32 inputs (None: the default device). `decode` = (chunk, sampling):
    the decode loop (`decode_steps`) instead of one step of T tokens. On a GPU each compiles with
    `gpu_options`."""
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=sharding)
    # the options before the lowering: their first check compiles a trivial program (`_check_option`),
    # which then runs while this job waits for its lowering turn, not between its lowering and its
    # compile (0.35-0.6 s of the deep first row's decode loop, its critical path, RESULTS §22am)
    options = gpu_options(plan, decode is not None, gpu)
    if decode is not None:
        chunk, sampling = decode
        lowered = compile_cache.lower(_jitted_decode, weights, cache, i32((B,)), i32((B,)), i32(()),
                                      _decode_key(B, sampling), cfg=cfg, plan=plan, chunk=chunk, sampling=sampling)
        return lowered.compile(options)
    return compile_cache.lower(_jitted_forward, weights, cache, i32((B, T)), i32((B,)), i32((B,)), cfg=cfg,
                               plan=plan).compile(options)


# JAX settings that change what a traced step's arguments are (x64: Python ints and int64 inputs)
# or what it computes; part of a stored step's key.
_JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                 "jax_default_prng_impl", "jax_threefry_partitionable")


def has_host_tensors(weights) -> bool:
    """The tree holds host-resident experts (-ot), pinned or mapped. Their custom calls name the bytes
    by slots that tracing sets in this process (pallas_kernels/moe_matmul/host.py `host_slot`), so a
    step loaded whole without tracing would find them unset; and a mapped tensor
    (IKJAX_HOST_EXPERTS=mmap) is a node without leaves, invisible to a walk over the leaves."""
    return any(is_host_resident(a) for a in jax.tree.leaves(weights, is_leaf=is_host_resident))


def step_arguments(weights, layout, B: int, T: int, decode: tuple | None) -> tuple:
    """The arguments a compiled step is called with, as ShapeDtypeStructs (the weights as given):
    (weights, cache, tokens, start, last) or, for the decode loop, (weights, cache, tokens, start,
    n, key) — what `compile_step` lowers and `Engine.step` / `Engine.decode` pass."""
    cache = jax.eval_shape(lambda: kvcache.init_cache(layout))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    if decode is not None:
        return (weights, cache, i32((B,)), i32((B,)), i32(()), _decode_key(B, decode[1]))
    return (weights, cache, i32((B, T)), i32((B,)), i32((B,)))


def _decode_key(B: int, sampling: tuple):
    """The decode loop's key argument: one PRNG key, or one a row where `sampling` says ("rows",
    True) (generation.decode_steps, sampling.sample_rows), with the rows' sampling values beside
    them where it draws (a "bucket": sampling.row_params' [B] arrays, step arguments)."""
    s = dict(sampling)
    if s.get("rows"):
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), B))
        if "bucket" not in s:
            return keys
        params = jax.eval_shape(lambda: row_params([{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}] * B))
        return keys, params
    return jax.eval_shape(lambda: jax.random.key(0))


# IKJAX_* variables that change nothing a compiled step is made of: where files live, what the CLI
# prints, whether steps are stored or the decode loop is used (which steps are asked for, not what
# one is), what the C++ runtime reads on every call. Every other one (IKJAX_TOPK, IKJAX_STREAM, a
# new knob: by default) may change what a step traces, and its value is part of a stored step's key.
_NOT_IN_STEPS = frozenset({"IKJAX_COMPILE_CACHE", "IKJAX_CACHE", "IKJAX_DEBUG", "IKJAX_FIXTURES", "IKJAX_STORE_STEPS",
                           "IKJAX_DECODE_LOOP", "IKJAX_CPU_ISA", "IKJAX_SPIN", "IKJAX_SPIN_LONG", "IKJAX_SERVE_TRACE", "IKJAX_SERVE_BURST_MS", "IKJAX_SERVE_SOLO",
                           "IKJAX_LOAD_OVERLAP", "IKJAX_EARLY_BACKEND", "IKJAX_AMX", "IKJAX_AMX_MIN_ROWS", "IKJAX_AVXVNNI",
                           "IKJAX_PREFETCH_STEPS", "IKJAX_STORE_PROGRAMS", "IKJAX_PROGRAMS_AHEAD", "IKJAX_DRY_SHAPES", "IKJAX_JOIN_TIMEOUT"})


_IN_STEPS = tuple(sorted(name for name in env.VARIABLES if name not in _NOT_IN_STEPS))


def trace_variables() -> tuple:
    """(name, value) of every IKJAX_* variable that may change what a step traces, as set now:
    in the StepPlan (the in-process jit cache's key) and in a stored step's key."""
    return env.values(_IN_STEPS)


class StoredStep:
    """A step loaded whole from the store (compile_cache.load_step), until its first call: called
    like the executable it holds (`exe`; other attributes are the executable's).

    Why: the store's key describes the arguments `step_arguments` says a step takes; should a call
    ever pass others (a key that misses something, a caller that changed), JAX refuses the call
    before anything runs or is donated (TypeError: "Argument types differ ...", "pytree does not
    match"; ValueError: a sharding or layout that does not match). That is a miss found late, not
    an error: the step is compiled (`Executables.recompile`, which replaces the entry) and the call
    made with it, so no run fails, no bench row is skipped. A first call that fits leaves the
    executable itself in the table."""

    __slots__ = ("owner", "key", "weights", "exe", "parts")

    def __init__(self, owner: "Executables", key: tuple, weights, exe, parts: tuple):
        self.owner, self.key, self.weights, self.exe, self.parts = owner, key, weights, exe, parts

    def __call__(self, *args):
        try:
            out = self.exe(*args)
        except (TypeError, ValueError) as e:
            if any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(args)):
                raise  # it ran far enough to consume its arguments: not a refusal at the door
            return self.owner.recompile(self.key, self.weights, self.parts, e)(*args)
        self.owner.fitted(self.key, self)
        return out

    def __getattr__(self, name: str):
        return getattr(self.exe, name)


class Executables:
    """The compiled steps of one engine, by key (B, T, plan, decode): `table` (key -> executable),
    `compiled` (keys counted), `count` (steps compiled or loaded by this engine, each once),
    `cache_hits` (of those, the ones JAX loaded from its persistent cache) and `memory`, the
    engine's memory plan, charged with each new step's compiler memory and XLA buffers.

    `executor` compiles a step for its devices (ikjax.runtime.executors); `layout(B)` is the KV
    cache layout of batch B; `source` names the model in a refusal."""

    def __init__(self, executor, *, config: ModelConfig, options: RunOptions,
                 layout: Callable[[int], Any], source: str, memory: MemoryPlan, recent: str | None = None):
        self.executor = executor
        self.recent = recent  # compile_cache.recent_label of this run: the steps it uses are noted there
        self.config, self.options, self.layout, self.source = config, options, layout, source
        self.memory = memory
        self.table: dict[tuple, Any] = {}
        self.compiled: set[tuple] = set()
        self.count = 0
        self.cache_hits = 0
        self._lock = threading.Lock()
        self._compiling: dict[tuple, threading.Event] = {}  # keys a thread is compiling now

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
            exe = self.table.get(key)
            if exe is not None:
                return exe
            busy = self._compiling.get(key)
            if busy is None:
                self._compiling[key] = threading.Event()
                self._note_compile(B, T, plan, decode)
        if busy is not None:
            # another thread compiles this very step (the server's warm-up beside a request, two
            # callers of precompile): wait for it, not compile it a second time; if it failed
            # there, compile here, where its error then reaches the caller
            busy.wait()
            exe = self.table.get(key)
            return exe if exe is not None else self.get(weights, B, T, plan, decode)
        try:
            return self._compile(key, weights)
        finally:
            with self._lock:
                self._compiling.pop(key).set()

    def _compile(self, key: tuple, weights):
        """`get`'s work for a step no thread has: load it stored or compile it, then account for it."""
        B, T, plan, decode = key
        compile_cache.setup()
        counts0 = compile_cache.thread_counts()  # this thread's: steps may compile side by side
        before = process_memory()
        stored = self._stored_step(weights, key)
        # compiled by an earlier run: no tracing, no lowering; one made for other arguments is a miss
        exe = compile_cache.load_step(*stored, label=self.recent) if stored else None
        loaded = exe is not None
        if not loaded:
            exe = self.executor.compile(weights, self.layout(B), B, T, plan, decode)
        if stored and not loaded and compile_cache.thread_counts()[0] == counts0[0]:
            # only an executable compiled here: one JAX itself loaded from its cache does not
            # serialize again whole on XLA:CPU (a run of such an entry failed: "Function
            # wrapped_iota not found")
            compile_cache.store_step(stored[0], exe, label=self.recent)
        with self._lock:  # steps compiling side by side (compile_in_parallel) share this bookkeeping
            exe = self._account(key, exe, counts0, before)
            if loaded:  # checked against its first call's arguments (StoredStep)
                exe = self.table[key] = StoredStep(self, key, weights, exe, stored[0])
        if self.executor.on_cpu_only:
            # the compiler's freed memory back before the steps run beside the weights; after the
            # plan charged the compile what it grew by, which is the peak the compile reached (what
            # the release hands back is then its working memory: settle_compile)
            peak = process_memory()
            release_freed_memory()
            with self._lock:
                self.memory = settle_compile(self.memory, peak, process_memory())
        return exe

    def forget_all(self) -> None:
        """Drop every executable (each compiles again at its next `get`): for steps compiled
        against weight shapes the loaded weights turned out not to have."""
        with self._lock:
            self.table.clear()

    def update_memory(self, change: Callable[[MemoryPlan], MemoryPlan]) -> None:
        """The memory plan replaced by `change(plan)`, with no step's charge in between."""
        with self._lock:
            self.memory = change(self.memory)

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
        None where steps are not stored whole: several devices, weights outside device memory (host
        experts, pinned or mapped: `has_host_tensors`), and by default a CPU (its steps trace and
        compile in about a second; IKJAX_STORE_STEPS=1 stores them too, =0 never stores).

        `parts` is everything the executable's arguments and code are made of that tracing would
        see: the whole argument tree (weights, KV cache, inputs) with every leaf's shape, dtype,
        sharding and memory kind (the cache's type and length come from -ctk, -c, -mla and the
        batch: two runs differing only there once shared a key, and the second run's call failed
        with "pytree does not match" / "Argument types differ"), the run options, the model config,
        the step's key, the JAX settings that change traced types (x64) or numerics and the IKJAX_*
        variables that may change what a step traces (all but `_NOT_IN_STEPS`); the sources,
        versions, XLA_FLAGS and devices are added by compile_cache. The weights are described by
        flattening whatever tree the executor loaded (a list of layers, stacked layer groups: a
        custom node's static data is part of `str(tree)`). `signature` (the argument tree and
        avals) is checked against a loaded executable before it is used, and its first call
        against the arguments it is called with (StoredStep)."""
        if not compile_cache.stores_whole(self.executor.on_cpu_only):
            return None
        if key[2].expert_stats is not None:  # its host callback counts into this engine's object
            return None
        if not self.executor.stores_steps:
            return None
        if has_host_tensors(weights):
            return None
        for a in jax.tree.leaves(weights):  # arrays, or their ShapeDtypeStructs while they load
            if not isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) or \
                    getattr(a.sharding, "memory_kind", None) not in (None, "device"):
                return None
        B, T, _, decode = key
        args = step_arguments(weights, self.layout(B), B, T, decode)
        leaves, tree = jax.tree.flatten((args, {}))
        described = tuple(compile_cache.describe_leaf(a) for a in leaves)
        settings = tuple((name, str(getattr(jax.config, name, None))) for name in _JAX_SETTINGS)
        variables = trace_variables()
        parts = ("step", str(tree), described, repr(self.layout(B)), repr(self.options), self.config, key, settings,
                 variables)
        return parts, compile_cache.signature_of(tree, leaves)

    def recompile(self, key: tuple, weights, parts: tuple, error: Exception):
        """A stored step that loaded but did not fit its call's arguments (StoredStep): compiled
        here, its entry replaced, the table's too; the fresh executable."""
        B, T, plan, decode = key
        why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        log.warning("compilation cache: a stored step (batch %d, %d tokens, kv_len %d) did not fit its call (%s); "
                    "compiling it", B, T, plan.kv_len, why)
        compile_cache.drop_step(parts, "did not fit its call")
        before = process_memory()
        exe = self.executor.compile(weights, self.layout(B), B, T, plan, decode)
        compile_cache.store_step(parts, exe, label=self.recent)
        with self._lock:
            self.memory = charge_compile(self.memory, before, process_memory(), exe,
                                         f"the step of batch {B} x {T} tokens, kv_len {plan.kv_len}")
            self.table[key] = exe
            self.cache_hits = max(0, self.cache_hits - 1)  # counted as loaded: compiled after all
        return exe

    def fitted(self, key: tuple, stored: "StoredStep") -> None:
        """A stored step's first call fitted: the table holds the executable itself from now on
        (every later call of this key passes arguments of the same types)."""
        with self._lock:
            if self.table.get(key) is stored:
                self.table[key] = stored.exe

    def _account(self, key: tuple, exe, counts0: tuple[int, int], before: tuple[int, int]):
        """Count a new executable (cache hit or not) and put its buffers into the memory plan."""
        B, T, plan, decode = key
        hits, writes = compile_cache.thread_counts()
        if hits > counts0[0] and writes == counts0[1]:
            self.cache_hits += 1
        what = f"the step of batch {B} x {T} tokens, kv_len {plan.kv_len}"
        mem = charge_compile(self.memory, before, process_memory(), exe, what)
        if jax.default_backend() == "cpu":
            check_fits(mem, self.options, self.source, what=what)
        self.memory = mem
        self.table[key] = exe
        return exe
