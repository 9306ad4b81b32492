"""Engine: a loaded model with its options, compiled steps and KV cache.

One jitted step per (batch bucket, token bucket, KV-length bucket, mode); the cache is donated so
XLA updates it in place. Prompts run in `ubatch` chunks. Generation runs several decode steps per
dispatch (`Engine.decode`: a loop in one executable, the next token chosen on the device), which
on a GPU XLA captures whole as one CUDA graph; with -sm layer / -sm graph one token per step.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import cache as kvcache
from ikjax import compile_cache, kv_buckets
from ikjax import distributed, kernels, sharding, tensor_parallel
from ikjax.errors import OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.memory_plan import (MemoryPlan, cache_capacity, check_devices, check_fits, mapped_rss, plan_memory,
                               process_memory, release_freed_memory)
from ikjax.model.deepseek2 import StepPlan, forward
from ikjax.options import RunOptions, env_choice
from ikjax.placement import plan_placement
from ikjax.sampling import check_count, check_sampling, sample_device, sample_next
from ikjax.weights import load_weights

log = logging.getLogger("ikjax")

# One jit for all engines: engines whose config, plan and weight types agree share executables.
_jitted_forward = jax.jit(forward, static_argnames=("cfg", "plan"), donate_argnums=(1,))


def decode_steps(weights, cache, tok, start, n, key, *, cfg: ModelConfig, plan: StepPlan, chunk: int,
                 sampling: tuple):
    """n <= chunk decode steps in one dispatch: tok [B] sits at positions start [B]; each step
    feeds the current token, appends its latent to the cache and picks the next one on the device
    (`sample_device` with `sampling`, a static tuple of its keyword items). Returns (tokens
    [B, chunk] int32, the first n of them produced, cache).

    Why: a batch-1 decode step is ~700 small kernels; dispatched one step at a time the host's
    launches (~5 us each) set the pace, and a per-step CUDA graph is re-recorded whenever a
    buffer moves. A loop with a trip count read on the device is one executable whose body XLA
    captures as one CUDA graph (a WHILE command, see _DECODE_GPU_OPTIONS)."""
    B = tok.shape[0]
    zeros = jnp.zeros((B,), jnp.int32)

    def body(i, carry):
        cache, tok, out, key = carry
        logits, cache = forward(weights, cache, tok[:, None], start + i, zeros, cfg=cfg, plan=plan)
        key, sub = jax.random.split(key)
        nxt = sample_device(logits, sub, **dict(sampling))
        return cache, nxt, jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i)), key

    out = jnp.zeros((B, chunk), jnp.int32)
    cache, _, out, _ = jax.lax.fori_loop(0, n, body, (cache, tok, out, key))
    return out, cache


_jitted_decode = jax.jit(decode_steps, static_argnames=("cfg", "plan", "chunk", "sampling"), donate_argnums=(1,))
# XLA's command buffers for the decode loop only: with WHILE the loop and its body become one CUDA
# graph (RESULTS §13b: one command buffer for the whole loop). ikjax turns command buffers off
# for everything else (ikjax/__init__.py), where they measured slower.
_DECODE_GPU_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,CUDNN,"
                                                        "DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE",
                       "xla_gpu_graph_min_graph_size": 1}
DECODE_CHUNK = 16  # tokens per dispatch in generate (a stop mid-chunk wastes the rest of it)


STOP_EOS, STOP_MAX_TOKENS, STOP_CONTEXT = "eos", "max_tokens", "context"


@functools.cache
def _runtime_ready() -> None:
    """Run one trivial computation, once per process, before the memory plan measures the runtime:
    XLA sets up its execution machinery (thread pools, ~50 MiB on CPU) at the first run, which
    belongs to the runtime part of the plan, not to whichever step happens to run first."""
    jax.jit(lambda x: x + 1)(np.int32(0)).block_until_ready()


class Generation:
    """What `Engine.generate` returns: an iterator of new token ids. `stop_reason` is None while
    more may come and, from the moment the last token is yielded, "eos" (EOS or a stop id),
    "max_tokens", or "context" (the sequence reached `ctx` tokens)."""

    def __init__(self):
        self.stop_reason: str | None = None
        self._it: Iterator[int] = iter(())

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> int:
        return next(self._it)


class BatchGeneration(list):
    """What `Engine.generate_batch` returns: one list of new ids per prompt, and `stop_reasons`,
    one of "eos", "max_tokens", "context" per prompt (as `Generation.stop_reason`)."""
    stop_reasons: list[str | None]


class Engine:
    """Load with `ikjax.load(path, **options)`."""

    compile_cache_hits = 0  # steps of compile_count loaded from the persistent cache (ikjax.compile_cache)

    def __init__(self, path: str, options: RunOptions):
        _runtime_ready()
        anon0, file0 = process_memory()  # the process before this model: the plan's runtime part
        self.file = GGUFModelFile(path)
        first_tensor = self.file.tensors.get("token_embd.weight")
        self.config = ModelConfig.from_metadata(self.file.metadata, source=path,
                                                vocab_from_tensor=first_tensor.shape[0] if first_tensor else None)
        self.options = options.with_model(self.config.n_expert_used, self.config.n_expert > 0)
        self.capacity = cache_capacity(self.options)
        o, cfg = self.options, self.config
        # where every tensor lives, decided once (refuses an -ot device this machine lacks)
        self.placement = plan_placement(cfg, self.file.tensors.values(), self.options)
        for note in self.placement.notes:
            log.warning("%s", note)
        self.split_mode = self.placement.split_mode
        distributed.check_split(self.split_mode)
        self.backend = kernels.resolve_backend()
        self.decode_kernel = (o.fa and o.mla in (1, 3) and self.backend != "jnp"
                              and kernels.mla_decode_supported(cfg.n_head, self.capacity, cfg.latent_dim,
                                                               cfg.kv_lora_rank, backend=self.backend))
        self._memory = dataclasses.replace(self._static_plan(1), runtime_bytes=anon0 + file0, load_copy_bytes=0,
                                           compile_bytes=0)
        check_fits(self._memory, self.options, path)
        if len(self.placement.devices) > 1:
            check_devices(self._memory, dict(zip(self.placement.devices, sharding.jax_devices(self.placement))), path)
        t0 = time.perf_counter()
        self._pipeline = self._mesh = self._tp = None
        if self.split_mode == "graph":  # each device's part, read and laid out for its kernels
            self._mesh = sharding.mesh_for(self.placement)
            self._tp = tensor_parallel.tensor_split(self.placement, self._mesh)
            tensor_parallel.check_cache(self.cache_layout(1), self._tp)
            self.weights = tensor_parallel.load(self.file, self.config, self.placement, self._mesh)
        else:
            self.weights = load_weights(self.file, self.config, placement=self.placement)
        # what the load added besides the mapped file's pages (counted in full as weights_bytes):
        # stacked matrices, f32 norms, repacked layouts, the modules and helpers it brought in
        anon1, file1 = process_memory()
        mapped = mapped_rss(shard.path for shard in self.file.shards)
        self._memory = dataclasses.replace(self._memory, load_copy_bytes=max(0, anon1 + file1 - mapped
                                                                             - anon0 - file0))
        log.info("loaded %s in %.2fs", path, time.perf_counter() - t0)
        self._step = _jitted_forward
        if self.split_mode == "layer":
            self._pipeline = sharding.Pipeline(self.placement, self.weights, cfg)
            log.info("-sm layer: %s", self._pipeline.describe())
        elif self.split_mode == "graph":
            self._step = tensor_parallel.step()
        elif len(self.placement.devices) > 1:  # -sm none on device -mg
            self._device = sharding.jax_devices(self.placement)[self.placement.main_device]
        self._compiled: set[tuple] = set()
        self._executables: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.compile_count = 0

    # -- compiled step -------------------------------------------------------------------------
    def _executable(self, B: int, T: int, plan: StepPlan, decode: tuple | None = None):
        """The compiled step for this shape: compiled once, its XLA buffers (temp + outputs) put
        into the memory plan, and on CPU refused (DoesNotFitError) before it ever runs if the
        plan's peak exceeds what the machine has. `decode` = (chunk, sampling): the decode loop
        (`decode_steps`) instead of one step of T tokens."""
        key = (B, T, plan, decode)
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        with self._lock:
            self._note_compile(B, T, plan, decode)
        compile_cache.setup()
        hits0, writes0 = compile_cache.hits(), compile_cache.writes()
        anon0, file0 = process_memory()
        stored = self._stored_step_key(key)
        exe = compile_cache.load_step(stored) if stored else None  # compiled by an earlier run:
        loaded = exe is not None                                   # no tracing, no lowering
        if not loaded:
            exe = self._compile(B, T, plan, decode)
        if stored and not loaded and compile_cache.hits() == hits0:
            # only an executable compiled here: one JAX itself loaded from its cache does not
            # serialize again whole on XLA:CPU (a run of such an entry failed: "Function
            # wrapped_iota not found"), and in threads a hit elsewhere makes this one skip too
            compile_cache.store_step(stored, exe)
        with self._lock:  # steps compiling side by side (compile_in_parallel) share this bookkeeping
            exe = self._account(key, exe, hits0, writes0, anon0, file0)
        if self._on_cpu_only():
            # the compiler's freed memory back before the steps run beside the weights; after the
            # plan charged the compile what it grew by, which is the peak the compile reached
            release_freed_memory()
        return exe

    def _compile(self, B: int, T: int, plan: StepPlan, decode: tuple | None):
        """Trace, lower and compile one step (`_executable` says which; the decode loop runs on
        one device only, `decode_loop`)."""
        cache = jax.eval_shape(lambda: kvcache.init_cache(self.cache_layout(B)))
        if self._pipeline is not None:
            return self._pipeline.compile(cache, B, T, plan)
        static = {}
        if self._mesh is not None:  # -sm graph: the cache split as tensor_parallel says
            sh = sharding.replicated(self._mesh)
            layout = self.cache_layout(B)
            cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache,
                                 tensor_parallel.cache_shardings(layout, self._tp))
            static = {"layout": layout}
        else:
            sh, cache = self._on_main_device(cache)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=sh)
        if decode is not None:
            chunk, sampling = decode
            lowered = _jitted_decode.lower(self.weights, cache, i32((B,)), i32((B,)), i32(()),
                                           jax.eval_shape(lambda: jax.random.key(0)), cfg=self.config,
                                           plan=plan, chunk=chunk, sampling=sampling)
            return lowered.compile(_DECODE_GPU_OPTIONS if self._on_gpu() else None)
        return self._step.lower(self.weights, cache, i32((B, T)), i32((B,)), i32((B,)), cfg=self.config,
                                plan=plan, **static).compile()

    def _on_main_device(self, cache):
        """(sharding, cache shapes) of a single-device step: with -sm none on device -mg of several
        devices its inputs are placed there; on one device (None, as given)."""
        if len(self.placement.devices) == 1:
            return None, cache
        sh = jax.sharding.SingleDeviceSharding(self._device)
        return sh, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), cache)

    def _stored_step_key(self, key: tuple) -> tuple | None:
        """What a step compiled for `key` is made of, for compile_cache.load_step/store_step; None
        where steps are not stored whole: several devices, weights outside device memory, and by
        default a CPU (its steps trace and compile in about a second; IKJAX_STORE_STEPS=1 stores
        them too, =0 never stores)."""
        store = env_choice("IKJAX_STORE_STEPS", ("auto", "1", "0"), "auto")
        if store == "0" or store == "auto" and self._on_cpu_only():
            return None
        if self._pipeline is not None or self._mesh is not None or len(self.placement.devices) > 1:
            return None
        leaves, tree = jax.tree.flatten(self.weights)
        shapes = []
        for a in leaves:
            if not isinstance(a, jax.Array) or getattr(a.sharding, "memory_kind", None) not in (None, "device"):
                return None
            shapes.append((a.shape, str(a.dtype)))
        return ("step", str(tree), tuple(shapes), self.config, key, self.options.mla, self.options.fa)

    def _account(self, key: tuple, exe, hits0: int, writes0: int, anon0: int, file0: int):
        """Count a new executable (cache hit or not) and put its buffers into the memory plan."""
        B, T, plan, decode = key
        if compile_cache.hits() > hits0 and compile_cache.writes() == writes0:
            self.compile_cache_hits += 1
        anon1, file1 = process_memory()  # compiling reads no weight pages: all of it is compiler state
        mem = dataclasses.replace(self._memory, compile_bytes=self._memory.compile_bytes
                                  + max(0, anon1 + file1 - anon0 - file0))
        what = f"the step of batch {B} x {T} tokens, kv_len {plan.kv_len}"
        try:
            ma = exe.memory_analysis()
        except Exception:  # a backend without the analysis: the attention-buffer formula stands
            ma = None
        if ma is not None:
            step_bytes = ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            mem = mem.with_compute(step_bytes, what)
        if jax.default_backend() == "cpu":
            check_fits(mem, self.options, self.file.path, what=what)
        self._memory = mem
        self._executables[key] = exe
        return exe

    def _plan(self, kv_len: int, all_logits: bool, n_tokens: int = 1) -> StepPlan:
        o = self.options
        # ik's split: -t threads for generation steps, -tb (default: -t) for prompt steps
        threads = o.threads if n_tokens == 1 else (o.threads_batch or o.threads)
        return StepPlan(mla=o.mla, fa=o.fa, amb_bytes=o.amb << 20, kv_block=o.kv_block, kv_len=kv_len,
                        dtype=o.dtype, fmoe=o.fmoe, ser=o.ser, all_logits=all_logits,
                        backend=self.backend, threads=threads, tp=self._tp)

    def kv_bucket(self, needed: int, n_tokens: int = 0) -> int:
        """Cache rows a step reads: the bucket covering `needed` (ikjax.kv_buckets: multiples of
        ubatch placed by length, as many as powers of two would be). Decode steps that run the
        split-KV MLA kernel read each sequence only up to its own length, so they share one bucket."""
        if n_tokens == 1 and self.decode_kernel:
            return self.capacity
        o = self.options
        return kv_buckets.kv_bucket(needed, o.ctx, o.ubatch, o.kv_block, self.capacity)

    def token_bucket(self, n: int) -> int:
        return min(kv_buckets.pow2_at_least(n), max(n, self.options.ubatch))

    def _note_compile(self, B: int, T: int, plan: StepPlan, decode: tuple | None = None) -> bool:
        key = (B, T, plan, decode)
        if key in self._compiled:
            return False
        self._compiled.add(key)
        self.compile_count += 1
        what = f"decode loop of {decode[0]} steps" if decode else f"tokens {T}"
        log.info("compiling step: batch %d, %s, kv_len %d, mla %d, fa %d", B, what, plan.kv_len, plan.mla, plan.fa)
        return True

    def compile_in_parallel(self) -> bool:
        """Whether several steps may compile at once (sweep_bench.precompile): on one accelerator.
        On CPU they compile one by one, so the memory plan can charge each its compiler memory
        and refuse a step that would not fit before it runs; the -sm layer / graph steps keep
        their own compile order."""
        return not self._on_cpu_only() and self._pipeline is None and self._mesh is None

    def _on_cpu_only(self) -> bool:
        return all(d.platform == "cpu" for d in sharding.jax_devices(self.placement))

    def _on_gpu(self) -> bool:
        return any(d.platform == "gpu" for d in sharding.jax_devices(self.placement))

    def step(self, cache, tokens: np.ndarray, start: np.ndarray, last: np.ndarray | None = None,
             all_logits: bool = False):
        """One compiled step: tokens [B,T] of sequence b at positions start[b]..; returns (logits, cache).

        The cache passed in is donated (consumed); use the one returned. Rows past a sequence's
        position are ignored by the causal mask, so "removing" tokens is moving `start` back.
        """
        tokens = np.asarray(tokens, np.int32)
        start = np.asarray(start, np.int32)
        B, T = tokens.shape
        last = np.full(B, T - 1, np.int32) if last is None else np.asarray(last, np.int32)
        plan = self._plan(self.kv_bucket(int(start.max()) + T, T), all_logits, T)
        exe = self._executable(B, T, plan)
        if self._mesh is None:
            return exe(self.weights, cache, tokens, start, last)
        # the mesh may span other processes' devices: inputs as global arrays (the same values on
        # every process), the replicated logits read from this process's own copy
        rep = sharding.replicated(self._mesh)
        logits, cache = exe(self.weights, cache, *(distributed.global_input(a, rep) for a in (tokens, start, last)))
        return distributed.local_value(logits), cache

    def precompile(self, batch: int, n_tokens: int, kv_needed: int, all_logits: bool = False) -> float:
        """Compile the step for this shape ahead of time (no execution, no cache allocated); seconds taken."""
        return self._precompile(batch, n_tokens, self._plan(self.kv_bucket(kv_needed, n_tokens), all_logits, n_tokens))

    def _precompile(self, B: int, T: int, plan: StepPlan, decode: tuple | None = None) -> float:
        if (B, T, plan, decode) in self._executables:
            return 0.0
        t0 = time.perf_counter()
        self._executable(B, T, plan, decode)
        return time.perf_counter() - t0

    def decode_loop(self) -> bool:
        """Whether generation runs several steps per dispatch (`decode`): on one device (the
        -sm layer pipeline and the -sm graph mesh step one token at a time), with every weight
        in that device's memory: weights kept in host RAM next to an accelerator (-ot ...=CPU,
        --n-cpu-moe) are read by host custom calls that no CUDA graph can hold, so the loop
        gains nothing there and that path keeps its GPU-tested one token per dispatch.
        IKJAX_DECODE_LOOP=0 turns it off everywhere (for comparison)."""
        hybrid = not self.placement.unified and self.placement.host_bytes > 0
        return (self._pipeline is None and self._mesh is None and not hybrid
                and env_choice("IKJAX_DECODE_LOOP", ("1", "0"), "1") == "1")

    @staticmethod
    def _sampling_key(sampling: dict | None) -> tuple:
        """The static sampling setting of a decode executable; every greedy setting is one."""
        p = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
        if sampling and sampling.get("temperature", 0.0) > 0.0:
            p.update({k: sampling[k] for k in p if k in sampling})
        return tuple(sorted(p.items()))

    def _decode_plan(self, start_max: int, chunk: int) -> StepPlan:
        return self._plan(self.kv_bucket(start_max + chunk, 1), False, 1)

    def decode(self, cache, tokens, start, n: int, *, chunk: int | None = None, sampling: dict | None = None,
               key=None):
        """n decode steps in one dispatch (see `decode_steps`): tokens [B] at positions start [B];
        returns (new tokens [B, chunk] on the device, the first n valid; cache). The cache is
        donated. `chunk` (default n) is the compiled length, so calls with n <= chunk share one
        executable; `sampling`: `check_sampling`'s keys (default greedy); `key`: a JAX PRNG key."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        start = np.asarray(start, np.int32).reshape(-1)
        chunk = n if chunk is None else chunk
        if not 0 < n <= chunk:
            raise OptionError(f"decode: need 0 < n <= chunk, got n={n}, chunk={chunk}")
        plan = self._decode_plan(int(start.max()), chunk)
        exe = self._executable(len(tokens), 1, plan, (chunk, self._sampling_key(sampling)))
        return exe(self.weights, cache, tokens, start, np.int32(n), jax.random.key(0) if key is None else key)

    def precompile_decode(self, batch: int, chunk: int, kv_needed: int, sampling: dict | None = None) -> float:
        """Compile the decode loop of `chunk` steps whose last step reads `kv_needed` entries."""
        return self._precompile(batch, 1, self._decode_plan(kv_needed - chunk, chunk),
                                (chunk, self._sampling_key(sampling)))

    def new_cache(self, batch: int = 1):
        """A zeroed KV cache: per device with -sm layer, replicated over the mesh with -sm graph."""
        layout = self.cache_layout(batch)
        if self._pipeline is not None:
            return self._pipeline.new_cache(layout)
        if self._mesh is not None:
            return jax.jit(kvcache.init_cache, static_argnums=0,
                           out_shardings=tensor_parallel.cache_shardings(layout, self._tp))(layout)
        if len(self.placement.devices) > 1:
            with jax.default_device(self._device):
                return kvcache.init_cache(layout)
        return kvcache.init_cache(layout)

    def cache_layout(self, batch: int = 1) -> kvcache.CacheLayout:
        return kvcache.CacheLayout.for_model(self.config, self.options.mla, self.options.ctk, batch, self.capacity)

    # -- public API ----------------------------------------------------------------------------
    def _check_ids(self, ids, what: str = "token ids") -> np.ndarray:
        """A non-empty 1-D integer sequence inside the vocabulary; the error names the bad id."""
        try:
            arr = np.asarray(ids)
        except (ValueError, TypeError, OverflowError) as e:
            raise OptionError(f"{what}: not a sequence of integers ({e})") from None
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise OptionError(f"{what}: must be a non-empty 1-D integer sequence, got shape {arr.shape} "
                              f"of {arr.dtype}")
        V = self.config.vocab_size
        bad = (arr < 0) | (arr >= V)
        if bad.any():
            i = int(np.argmax(bad))
            raise OptionError(f"{what}: token id {int(arr[i])} at index {i} is outside the vocabulary [0, {V})")
        return arr.astype(np.int32)

    def _stop_ids(self, stop: Iterable[int]) -> set[int]:
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
            raise OptionError(f"stop: expected a collection of token ids, got {stop!r}")
        out = set()
        for s in stop:
            if not isinstance(s, numbers.Integral) or isinstance(s, (bool, np.bool_)):
                raise OptionError(f"stop: token ids must be integers, got {s!r}")
            out.add(int(s))
        if self.config.eos_token_id is not None:
            out.add(self.config.eos_token_id)
        return out

    def _check_prompt_fits(self, n: int, what: str) -> None:
        if n > self.options.ctx:
            raise OptionError(f"{what}: {n} tokens exceed the context size ctx={self.options.ctx}")

    def prefill(self, cache, ids: np.ndarray, start: int = 0, all_logits: bool = False):
        """Feed one sequence's ids from position `start` in ubatch chunks (batch 1).

        Returns (logits, cache): [n, V] for every token if all_logits, else [V] of the last one.
        """
        n = len(ids)
        if start + n > self.options.ctx:
            raise OptionError(f"{start + n} tokens exceed the context size ctx={self.options.ctx}")
        outs = []
        logits = None
        for c0 in range(0, n, self.options.ubatch):
            chunk = ids[c0:c0 + self.options.ubatch]
            T = self.token_bucket(len(chunk))
            toks = np.zeros((1, T), np.int32)
            toks[0, :len(chunk)] = chunk
            logits, cache = self.step(cache, toks, np.array([start + c0]), np.array([len(chunk) - 1]),
                                          all_logits)
            if all_logits:
                outs.append(np.asarray(logits, np.float32)[0, :len(chunk)])
        if all_logits:
            return np.concatenate(outs, 0), cache
        return np.asarray(logits, np.float32)[0], cache

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [n_tokens, n_vocab] (float32) at every position of a fresh sequence."""
        ids = self._check_ids(token_ids)
        out, _ = self.prefill(self.new_cache(1), ids, 0, all_logits=True)
        return out

    def _stop_reason(self, tok: int, n_new: int, length: int, max_tokens: int, stop_ids: set[int]) -> str | None:
        """Why a sequence ends after `tok` (its `n_new`-th new token, `length` tokens in all), or None."""
        if tok in stop_ids:
            return STOP_EOS
        if n_new >= max_tokens:
            return STOP_MAX_TOKENS
        if length >= self.options.ctx:
            log.warning("context full (ctx=%d): generation stopped after %d new tokens", self.options.ctx, n_new)
            return STOP_CONTEXT
        return None

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: Iterable[int] = ()) -> "Generation":
        """New token ids as they are produced (an iterator); stop on EOS, a stop id, `max_tokens`,
        or a full context.

        Every argument is checked here, before anything runs (OptionError naming it). The context
        end is treated as llama.cpp does without context shift: a sequence never holds more than
        `ctx` tokens (prompt + generated); generation stops there with a warning. A prompt longer
        than `ctx` is refused. The iterator's `stop_reason` ("eos", "max_tokens", "context") is
        set when the last token is yielded; `generate_batch` follows the same rules.
        """
        max_tokens = check_count("max_tokens", max_tokens)
        p = check_sampling(temperature, top_k, top_p, min_p, seed)
        ids = self._check_ids(prompt_ids, "prompt_ids")
        self._check_prompt_fits(len(ids), "prompt_ids")
        stop_ids = self._stop_ids(stop)
        gen = Generation()
        gen._it = self._generate(gen, ids, max_tokens, p, stop_ids)
        return gen

    def _generate(self, gen: "Generation", ids: np.ndarray, max_tokens: int, p: dict, stop_ids: set[int]):
        if max_tokens == 0:
            gen.stop_reason = STOP_MAX_TOKENS
            return
        if len(ids) >= self.options.ctx:
            log.warning("context full (ctx=%d): the prompt fills it, no token generated", self.options.ctx)
            gen.stop_reason = STOP_CONTEXT
            return
        rng = np.random.default_rng(p["seed"])
        sp = {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p")}
        logits, cache = self.prefill(self.new_cache(1), ids, 0, all_logits=False)
        length = len(ids)
        pending = [sample_next(logits, rng=rng, **sp)]  # produced, not yet yielded
        n_new = 0
        key = jax.random.key(int(rng.integers(0, 2**31 - 1)))  # the device's draws follow the seed
        while True:
            for tok in pending:  # a stop id inside a decode chunk drops the tokens after it
                n_new, length = n_new + 1, length + 1
                reason = self._stop_reason(tok, n_new, length, max_tokens, stop_ids)
                gen.stop_reason = reason
                yield tok
                if reason is not None:
                    return
            # the last token is not in the cache yet: it goes at position length - 1
            if not self.decode_loop():
                out, cache = self.step(cache, np.array([[tok]], np.int32), np.array([length - 1]), np.array([0]),
                                       False)
                pending = [sample_next(np.asarray(out, np.float32)[0], rng=rng, **sp)]
                continue
            # up to DECODE_CHUNK tokens in one dispatch, no further than the stopping rules allow
            n = min(DECODE_CHUNK, max_tokens - n_new, self.options.ctx - length)
            key, sub = jax.random.split(key)
            out, cache = self.decode(cache, [tok], [length - 1], n, chunk=DECODE_CHUNK, sampling=sp, key=sub)
            pending = [int(t) for t in np.asarray(out)[0, :n]]

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                       stop: Iterable[int] = ()) -> "BatchGeneration":
        """Generate for several sequences at once, each at its own length; one list of new ids each.

        Same checks and stopping rules as `generate` (each sequence stops on its own at EOS / a
        stop id, `max_tokens`, or `ctx` tokens in all); the returned list's `stop_reasons` says
        which, per sequence. Prompts are fed together in ubatch chunks (a shorter prompt's padding
        lands past its end, where the causal mask hides it until its own generated tokens
        overwrite it); then every step decodes one token per unfinished sequence. The batch is
        padded to a power of two.
        """
        max_tokens = check_count("max_tokens", max_tokens)
        p = check_sampling(temperature, top_k, top_p, min_p, seed)
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
            raise OptionError("prompts: expected a non-empty list of token id sequences")
        seqs = [self._check_ids(s, f"prompts[{i}]") for i, s in enumerate(prompts)]
        for i, s in enumerate(seqs):
            self._check_prompt_fits(len(s), f"prompts[{i}]")
        stop_ids = self._stop_ids(stop)
        n = len(seqs)
        out = BatchGeneration([] for _ in range(n))
        if max_tokens == 0:
            out.stop_reasons = [STOP_MAX_TOKENS] * n
            return out
        B = kv_buckets.pow2_at_least(n)
        lengths = np.array([len(s) for s in seqs] + [1] * (B - n))
        rng = np.random.default_rng(p["seed"])
        sp = {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p")}
        cache = self.new_cache(B)
        width = int(lengths.max())
        padded = np.zeros((B, width), np.int32)
        for b, s in enumerate(seqs):
            padded[b, :len(s)] = s
        last_logits = np.zeros((B, self.config.vocab_size), np.float32)
        for c0 in range(0, width, self.options.ubatch):
            c1 = min(width, c0 + self.options.ubatch)
            T = self.token_bucket(c1 - c0)
            toks = np.zeros((B, T), np.int32)
            toks[:, :c1 - c0] = padded[:, c0:c1]
            last = np.clip(lengths - 1 - c0, 0, T - 1)
            logits, cache = self.step(cache, toks, np.full(B, c0), last)
            logits = np.asarray(logits, np.float32)
            ends_here = (lengths - 1 >= c0) & (lengths - 1 < c1)
            last_logits[ends_here] = logits[ends_here]
        reasons: list[str | None] = [None] * n
        for b in range(n):
            if lengths[b] >= self.options.ctx:
                log.warning("context full (ctx=%d): prompts[%d] fills it, no token generated", self.options.ctx, b)
                reasons[b] = STOP_CONTEXT
        done = np.array([r is not None for r in reasons] + [True] * (B - n))
        pos = lengths.copy()  # where each sequence's next token goes; frozen once it is done
        while not done.all():
            toks = np.zeros((B, 1), np.int32)
            for b in range(n):
                if done[b]:
                    continue
                tok = sample_next(last_logits[b], rng=rng, **sp)
                out[b].append(tok)
                toks[b, 0] = tok
                reasons[b] = self._stop_reason(tok, len(out[b]), int(lengths[b]) + len(out[b]), max_tokens, stop_ids)
            fed = ~done
            done = done | np.array([r is not None for r in reasons] + [True] * (B - n))
            if done.all():  # no step needed after the last token
                break
            logits, cache = self.step(cache, toks, pos)
            last_logits = np.asarray(logits, np.float32)
            pos = np.where(fed & ~done, pos + 1, pos)
        out.stop_reasons = reasons
        return out

    def _static_plan(self, batch: int) -> MemoryPlan:
        return plan_memory(self.config, self.options, batch=batch, placement=self.placement)

    def memory_plan(self, batch: int = 1) -> MemoryPlan:
        """Weights (as stored, per place), KV cache and attention-buffer bytes for these options;
        for batch 1 also what this engine measured: runtime, load copies, compiled steps, and
        XLA's buffers of the largest step compiled so far (`peak_bytes`, `peak_lines()`)."""
        return self._memory if batch == 1 else self._static_plan(batch)


def load(path: str, **options) -> Engine:
    """Open a deepseek2 GGUF (any shard of a split model) with ik_llama.cpp-named options."""
    compile_cache.setup()  # before anything compiles: JAX looks for its cache once
    return Engine(str(path), RunOptions.from_kwargs(**options))
