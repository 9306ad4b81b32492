"""Engine: a loaded model with its options, compiled steps and KV cache — the user-facing facade.

One jitted step per (batch bucket, token bucket, KV-length bucket, mode); the cache is donated so
XLA updates it in place. Prompts run in `ubatch` chunks. Generation runs several decode steps per
dispatch (`Engine.decode`: a loop in one executable, the next token chosen on the device), which
on a GPU XLA captures whole as one CUDA graph; with -sm layer / -sm graph one token per step.

The parts it composes: `executors` (how a step runs on the placement's devices: one device, the
-sm layer pipeline, the -sm graph mesh), `executables` (the compiled steps, their cache and their
charge to the memory plan), `generation` (the decode loop, `generate` / `generate_batch`'s
scheduling and stopping rules), `memory_plan`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from ikjax import env, ops
from ikjax.errors import OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.model import cache as kvcache
from ikjax.model.deepseek2 import StepPlan
from ikjax.options import RunOptions
from ikjax.placement import devices
from ikjax.placement.rules import plan_placement
from ikjax.runtime import buckets as kv_buckets
from ikjax.runtime import compile_cache, distributed, generation
from ikjax.runtime.executables import Executables
from ikjax.runtime.executors import Executor, executor_for
from ikjax.runtime.generation import BatchGeneration, Generation
from ikjax.runtime.memory_plan import (MemoryPlan, cache_capacity, charge_load, check_devices, check_fits, mapped_rss,
                                       plan_memory, process_memory, runtime_ready)

log = logging.getLogger("ikjax")


class Engine:
    """Load with `ikjax.load(path, **options)`."""

    def __init__(self, path: str, options: RunOptions):
        runtime_ready()
        before = process_memory()  # the process before this model: the plan's runtime part
        self.file = GGUFModelFile(path)
        first_tensor = self.file.tensors.get("token_embd.weight")
        self.config = ModelConfig.from_metadata(self.file.metadata, source=path,
                                                vocab_from_tensor=first_tensor.shape[0] if first_tensor else None)
        self.options = options.with_model(self.config.n_expert_used, self.config.n_expert > 0, ops.auto_dtype())
        self.capacity = cache_capacity(self.options)
        o, cfg = self.options, self.config
        # where every tensor lives, decided once (refuses an -ot device this machine lacks)
        self.placement = plan_placement(cfg, self.file.tensors.values(), self.options)
        for note in self.placement.notes:
            log.warning("%s", note)
        self.split_mode = self.placement.split_mode
        distributed.check_split(self.split_mode)
        self.backend = ops.resolve_backend()
        self.decode_kernel = (o.fa and o.mla in (1, 3) and self.backend != "jnp"
                              and ops.mla_decode_supported(cfg.n_head, self.capacity, cfg.latent_dim,
                                                               cfg.kv_lora_rank, backend=self.backend))
        memory = dataclasses.replace(self._static_plan(1), runtime_bytes=sum(before), load_copy_bytes=0,
                                     compile_bytes=0)
        check_fits(memory, self.options, path)
        if len(self.placement.devices) > 1:
            check_devices(memory, dict(zip(self.placement.devices, devices.jax_devices(self.placement))), path)
        t0 = time.perf_counter()
        # how a step runs on these devices: one device, the -sm layer pipeline or the -sm graph mesh
        self.executor: Executor = executor_for(self.placement, cfg, self.cache_layout(1))
        self.weights = self.executor.load(self.file)
        after = process_memory()
        memory = charge_load(memory, before, after, mapped_rss(shard.path for shard in self.file.shards))
        log.info("loaded %s in %.2fs", path, time.perf_counter() - t0)
        self.executor.bind(self.weights)
        stages = self.executor.describe()
        if stages:
            log.info("-sm %s: %s", self.split_mode, stages)
        self._steps = Executables(self.executor, config=cfg, options=self.options, layout=self.cache_layout,
                                  source=self.file.path, memory=memory)

    # -- compiled steps (ikjax.runtime.executables) ----------------------------------------------
    @property
    def compile_count(self) -> int:
        """Steps this engine compiled (or loaded whole from an earlier run), each counted once."""
        return self._steps.count

    @property
    def compile_cache_hits(self) -> int:
        """Steps of compile_count loaded from the persistent cache (ikjax.runtime.compile_cache)."""
        return self._steps.cache_hits

    @property
    def _executables(self) -> dict:
        """The compiled steps by (B, T, plan, decode) (tests clear it to compile again)."""
        return self._steps.table

    @property
    def _compiled(self) -> set:
        return self._steps.compiled

    def _plan(self, kv_len: int, all_logits: bool, n_tokens: int = 1) -> StepPlan:
        o = self.options
        # ik's split: -t threads for generation steps, -tb (default: -t) for prompt steps
        threads = o.threads if n_tokens == 1 else (o.threads_batch or o.threads)
        return StepPlan(mla=o.mla, fa=o.fa, amb_bytes=o.amb << 20, kv_block=o.kv_block, kv_len=kv_len,
                        dtype=o.dtype, fmoe=o.fmoe, ser=o.ser, all_logits=all_logits,
                        backend=self.backend, threads=threads, tp=self.executor.tp)

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

    def compile_in_parallel(self) -> bool:
        """Whether several steps may compile at once (sweep_bench.precompile): on one accelerator.
        On CPU they compile one by one, so the memory plan can charge each its compiler memory
        and refuse a step that would not fit before it runs; the -sm layer / graph steps keep
        their own compile order."""
        return self.executor.compiles_in_parallel

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
        exe = self._steps.get(self.weights, B, T, plan)
        return self.executor.run(exe, self.weights, cache, tokens, start, last)

    def precompile(self, batch: int, n_tokens: int, kv_needed: int, all_logits: bool = False) -> float:
        """Compile the step for this shape ahead of time (no execution, no cache allocated); seconds taken."""
        return self._steps.precompile(self.weights, batch, n_tokens,
                                      self._plan(self.kv_bucket(kv_needed, n_tokens), all_logits, n_tokens))

    def decode_loop(self) -> bool:
        """Whether generation runs several steps per dispatch (`decode`): on one device (the
        -sm layer pipeline and the -sm graph mesh step one token at a time), with every weight
        in that device's memory: weights kept in host RAM next to an accelerator (-ot ...=CPU,
        --n-cpu-moe) are read by host custom calls that no CUDA graph can hold, so the loop
        gains nothing there and that path keeps its GPU-tested one token per dispatch.
        IKJAX_DECODE_LOOP=0 turns it off everywhere (for comparison)."""
        hybrid = not self.placement.unified and self.placement.host_bytes > 0
        return self.executor.loops and not hybrid and env.choice("IKJAX_DECODE_LOOP") == "1"

    _sampling_key = staticmethod(generation.sampling_key)

    def _decode_plan(self, start_max: int, chunk: int) -> StepPlan:
        return self._plan(self.kv_bucket(start_max + chunk, 1), False, 1)

    def decode(self, cache, tokens, start, n: int, *, chunk: int | None = None, sampling: dict | None = None,
               key=None):
        """n decode steps in one dispatch (see `generation.decode_steps`): tokens [B] at positions
        start [B]; returns (new tokens [B, chunk] on the device, the first n valid; cache). The
        cache is donated. `chunk` (default n) is the compiled length, so calls with n <= chunk
        share one executable; `sampling`: `check_sampling`'s keys (default greedy); `key`: a JAX
        PRNG key."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        start = np.asarray(start, np.int32).reshape(-1)
        chunk = n if chunk is None else chunk
        if not 0 < n <= chunk:
            raise OptionError(f"decode: need 0 < n <= chunk, got n={n}, chunk={chunk}")
        plan = self._decode_plan(int(start.max()), chunk)
        exe = self._steps.get(self.weights, len(tokens), 1, plan, (chunk, self._sampling_key(sampling)))
        return self.executor.run(exe, self.weights, cache, tokens, start, np.int32(n),
                                 jax.random.key(0) if key is None else key)

    def precompile_decode(self, batch: int, chunk: int, kv_needed: int, sampling: dict | None = None) -> float:
        """Compile the decode loop of `chunk` steps whose last step reads `kv_needed` entries."""
        return self._steps.precompile(self.weights, batch, 1, self._decode_plan(kv_needed - chunk, chunk),
                                      (chunk, self._sampling_key(sampling)))

    def new_cache(self, batch: int = 1):
        """A zeroed KV cache: per device with -sm layer, replicated over the mesh with -sm graph."""
        return self.executor.new_cache(self.cache_layout(batch))

    def cache_layout(self, batch: int = 1) -> kvcache.CacheLayout:
        return kvcache.CacheLayout.for_model(self.config, self.options.mla, self.options.ctk, batch, self.capacity)

    # -- public API ----------------------------------------------------------------------------
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
        ids = generation.check_ids(token_ids, self.config.vocab_size)
        out, _ = self.prefill(self.new_cache(1), ids, 0, all_logits=True)
        return out

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: Iterable[int] = ()) -> Generation:
        """New token ids as they are produced (an iterator); stop on EOS, a stop id, `max_tokens`,
        or a full context.

        Every argument is checked here, before anything runs (OptionError naming it). The context
        end is treated as llama.cpp does without context shift: a sequence never holds more than
        `ctx` tokens (prompt + generated); generation stops there with a warning. A prompt longer
        than `ctx` is refused. The iterator's `stop_reason` ("eos", "max_tokens", "context") is
        set when the last token is yielded; `generate_batch` follows the same rules. Up to
        DECODE_CHUNK tokens per dispatch where `decode_loop()`, else one step per token.
        """
        return generation.generate(self, prompt_ids, max_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, min_p=min_p, seed=seed, stop=stop)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                       stop: Iterable[int] = ()) -> BatchGeneration:
        """Generate for several sequences at once, each at its own length; one list of new ids each.

        Same checks and stopping rules as `generate` (each sequence stops on its own at EOS / a
        stop id, `max_tokens`, or `ctx` tokens in all); the returned list's `stop_reasons` says
        which, per sequence. Prompts are fed together in ubatch chunks (a shorter prompt's padding
        lands past its end, where the causal mask hides it until its own generated tokens
        overwrite it); then every step decodes one token per unfinished sequence. The batch is
        padded to a power of two.
        """
        return generation.generate_batch(self, prompts, max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, min_p=min_p, seed=seed, stop=stop)

    def _static_plan(self, batch: int) -> MemoryPlan:
        return plan_memory(self.config, self.options, batch=batch, placement=self.placement)

    def memory_plan(self, batch: int = 1) -> MemoryPlan:
        """Weights (as stored, per place), KV cache and attention-buffer bytes for these options;
        for batch 1 also what this engine measured: runtime, load copies, compiled steps, and
        XLA's buffers of the largest step compiled so far (`peak_bytes`, `peak_lines()`)."""
        return self._steps.memory if batch == 1 else self._static_plan(batch)


def load(path: str, **options) -> Engine:
    """Open a deepseek2 GGUF (any shard of a split model) with ik_llama.cpp-named options."""
    compile_cache.setup()  # before anything compiles: JAX looks for its cache once
    return Engine(str(path), RunOptions.from_kwargs(**options))
