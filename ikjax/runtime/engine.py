"""Engine: a loaded model with its options, compiled steps and KV cache — the user-facing facade.

One jitted step per (batch bucket, token bucket, KV-length bucket, mode); the cache is donated so
XLA updates it in place. Prompts run in `ubatch` chunks. Generation runs several decode steps per
dispatch (`Engine.decode`: a loop in one executable, the next token chosen on the device), which
on a GPU XLA captures whole as one CUDA graph; -sm graph runs the same loop inside its shard_map,
-sm layer dispatches its stages token after token without the host reading anything in between.

The parts it composes: `executors` (how a step runs on the placement's devices: one device, the
-sm layer pipeline, the -sm graph mesh), `executables` (the compiled steps, their cache and their
charge to the memory plan), `generation` (the decode loop, `generate` / `generate_batch`'s
scheduling and stopping rules), `memory_plan`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from ikjax import env, ops, programs
from ikjax.errors import DoesNotFitError, OptionError
from ikjax.gguf_io.config import ModelConfig, load_notes
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.model import cache as kvcache
from ikjax.model import moe
from ikjax.model.groups import host_layers, layer_spans
from ikjax.model.weights import same_shapes
from ikjax.model.deepseek2 import StepPlan
from ikjax.options import RunOptions
from ikjax.placement import devices
from ikjax.placement import hot as hot_experts
from ikjax.placement.host import is_host_resident
from ikjax.placement.rules import plan_placement
from ikjax.runtime import buckets as kv_buckets
from ikjax.runtime import compile_cache, distributed, generation, host_malloc, text
from ikjax.runtime.executables import Executables, trace_variables
from ikjax.runtime.executors import BackgroundLoad, Executor, executor_for
from ikjax.runtime.generation import BatchGeneration, Generation, KVSession
from ikjax.runtime.sampling import (NON_FINITE, ROW_PARAMS, NonFiniteLogitsError, check_finite_logits,
                                    top_k_bucket)
from ikjax.runtime.memory_plan import (MemoryPlan, cache_capacity, charge_load, check_devices, check_fits, mapped_rss,
                                       plan_memory, process_memory, release_freed_memory, runtime_ready)

log = logging.getLogger("ikjax")

# the short prompt step's tokens on a GPU (Engine.token_bucket): chat turns and prompt tails; the
# sizes between it and ubatch grow by CHUNK_GROWTH (64, 256, 1024, ...)
SHORT_CHUNK = 64
CHUNK_GROWTH = 4


class Engine:
    """Load with `ikjax.load(path, **options)`."""

    def __init__(self, path: str, options: RunOptions):
        runtime_ready()
        before = process_memory()  # the process before this model: the plan's runtime part
        self.file = GGUFModelFile(path)
        first_tensor = self.file.tensors.get("token_embd.weight")
        self.config = ModelConfig.from_metadata(self.file.metadata, source=path,
                                                vocab_from_tensor=first_tensor.shape[0] if first_tensor else None,
                                                file_tensors=self.file.tensors)
        if options.ctx == 0:  # ik's -c 0: the model's training context
            options = dataclasses.replace(options, ctx=self.config.context_length)
        self.options = options.with_model(self.config.n_expert_used, self.config.n_expert > 0, ops.auto_dtype())
        self.capacity = cache_capacity(self.options)
        o, cfg = self.options, self.config
        # where every tensor lives, decided once (refuses an -ot device this machine lacks)
        self.placement = plan_placement(cfg, self.file.tensors.values(), self.options)
        # runs of identical layers, each one lax.scan (ikjax.model.groups)
        self.spans = layer_spans(cfg, self.file.tensors, self.placement)
        for note in self.placement.notes:
            log.warning("note: %s", note)
        asked, cores = max(o.threads, o.threads_batch), ops.registry.default_threads()
        if asked > cores:  # the C++ pool runs at most one thread a core
            log.warning("note: -t %d: this process may run on %d cores; the CPU kernels run %d threads",
                        asked, cores, cores)
        for note in load_notes(cfg, self.file.tensors, self.file.metadata):  # MTP layers, V3.2's indexer
            log.warning("%s: %s", path, note)
        if o.ctx > cfg.context_length:  # ik warns too: positions past training are untested ground
            log.warning("-c %d exceeds the model's training context (context_length %d in %s): output past "
                        "position %d may degrade", o.ctx, cfg.context_length, path, cfg.context_length)
        self.split_mode = self.placement.split_mode
        distributed.check_split(self.split_mode)
        self.backend = ops.resolve_backend()
        if self.backend == "pallas" and jax.default_backend() != "gpu":  # (Pallas refused later, mid-compile)
            raise OptionError(f"IKJAX_KERNELS=pallas: the Pallas kernels run on a GPU, and JAX's backend here is "
                              f"{jax.default_backend()}; use auto, cpu or xla (interpret: the Pallas kernels "
                              f"interpreted, for tests)")
        self.decode_kernel = (o.fa and o.mla in (1, 3) and self.backend != "jnp"
                              and ops.mla_decode_supported(cfg.n_head, self.capacity, cfg.latent_dim,
                                                               cfg.kv_lora_rank, backend=self.backend))
        # one prompt step for every depth (issue 22): where the prompt attention reads keys only up
        # to each query's position (the Pallas kernel) and the kv_b expansion computes only the rows
        # in use (ops.quant_linear_live), a step over the whole cache costs what a step over its
        # bucket did, and compiles once instead of once per KV bucket
        self.prompt_whole_cache = (o.fa and o.mla in (2, 3) and self.split_mode == "none"
                                   and env.choice("IKJAX_PROMPT_BUCKETS") == "one"
                                   and ops.prompt_kernel_bounded(self.backend, cfg.nope_dim, cfg.rope_dim, cfg.v_dim))
        # host experts of big batches cross whole layers (IKJAX_STREAM=layer) only where two of them
        # fit beside the rest; else by runs of experts (=chunks, the default's form)
        self.stream_whole = True
        memory = dataclasses.replace(self._static_plan(1), runtime_bytes=sum(before), load_copy_bytes=0,
                                     compile_bytes=0)
        try:
            check_fits(memory, self.options, path)
        except DoesNotFitError:
            if not memory.stream_buffer_bytes or env.choice("IKJAX_STREAM") != "layer":
                raise
            self.stream_whole = False
            memory = dataclasses.replace(self._static_plan(1), runtime_bytes=sum(before), load_copy_bytes=0,
                                         compile_bytes=0)
            check_fits(memory, self.options, path)
            log.info("host experts: two whole layers do not fit the device beside the rest; big batches stream "
                     "the routed experts by runs (IKJAX_STREAM=chunks' form)")
        moe_layers = [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)] if cfg.n_expert else []
        if o.expert_stats and not moe_layers:  # refused before the load, not after it
            raise OptionError(f"expert-stats: {path} has no MoE layer (no routed experts to count)")
        self.gpu_experts_note = ""
        if o.gpu_experts:  # copies of the most used host-resident experts in the VRAM left
            free = None
            if o.gpu_experts == "auto":
                limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit") or 0
                # headroom past the plan: a prompt step's temporaries (4.6 GiB at R1's width and
                # -ub 2048 on an H200, beyond what the plan counts) and the streaming rounds
                free = limit - memory.device_bytes - max(6 << 30, limit // 5)
            self.placement, line, _ = hot_experts.plan(self.placement, cfg.n_expert, self.file.tensors,
                                                       o.gpu_experts, o.expert_counts, free)
            self.gpu_experts_note = line  # the CLI prints it beside the memory plan
            log.info("%s", line)
            self.spans = layer_spans(cfg, self.file.tensors, self.placement)
        if len(self.placement.devices) > 1:
            check_devices(memory, dict(zip(self.placement.devices, devices.jax_devices(self.placement))), path)
        # how a step runs on these devices: one device, the -sm layer pipeline or the -sm graph mesh
        self.executor: Executor = executor_for(self.placement, cfg, self.spans, self.cache_layout(1))
        if self.executor.on_cpu_only:  # a CPU step's temporaries kept between steps (host_malloc)
            host_malloc.tune()
        self._weights = None
        self._closed = False  # `close()` let go of the weights: using the engine raises
        self._dry = None  # the weights' shapes computed before the load (`_dry_shapes`), if used
        self._loading: BackgroundLoad | None = None
        self._mapped_at_load: int | None = None  # the file's resident mapped bytes, measured by the load's thread
        self._load_lock = threading.Lock()
        # the stored steps this model and these options used last time, read while the weights
        # load (compile_cache.prefetch_steps: issue 22's warm start)
        self._recent = self._prefetch_steps()
        self._load_start = (time.perf_counter(), before)
        if self._overlaps_load():
            # the shapes computed without the bytes (issue 22's cold start), and with them the load's
            # programs started compiling ahead (IKJAX_PROGRAMS_AHEAD), before the load asks for any
            self._dry = self._dry_shapes()
            # the bytes stream in on a thread of their own; steps compile meanwhile from `_shapes`
            self._loading = BackgroundLoad(self._load_and_measure, self.file)
            self._shapes = self._dry if self._dry is not None else self._loading.shapes()
        else:
            self._weights = self._shapes = self.executor.load(self.file)
            memory = self._loaded(memory, compiled_bytes=0)
        self.load_overlapped = self._loading is not None
        self._cache_specs: dict[int, tuple] = {}
        self._collectives: dict[tuple, object] = {}  # Engine.collectives, by step key
        # --expert-stats: the steps count each MoE layer's routing here (ikjax.model.moe)
        self._expert_counts = None
        if o.expert_stats:
            self._expert_counts = moe.ExpertCounts(cfg.n_expert, moe_layers)
        self._steps = Executables(self.executor, config=cfg, options=self.options, layout=self.cache_layout,
                                  source=self.file.path, memory=memory, recent=self._recent)

    def _dry_shapes(self):
        """The weights' ShapeDtypeStructs from the file and placement alone (load_weights with
        shapes_only=True: no bytes, each program traced, not compiled), checked against the real
        load's once it is in (`wait_loaded`); None with IKJAX_DRY_SHAPES=0, on a CPU-only machine
        unless it is 1 (its load runs no programs: nothing to gain), or where they cannot be had so
        (a tensor in host memory: AbstractUnavailable; anything else, a bad file say, is the load's
        to raise in its own thread)."""
        choice = env.choice("IKJAX_DRY_SHAPES")
        if choice == "0" or choice == "auto" and self.executor.on_cpu_only:
            return None
        try:
            with programs.recording() as calls:
                shapes = self.executor.load(self.file, shapes_only=True)
        except Exception as e:  # noqa: BLE001 - the shapes then come from the load
            log.info("the weights' shapes come from the load (%s: %s)", type(e).__name__, e)
            return None
        # the load's programs compiled side by side ahead of the load that runs them (cold start)
        if env.choice("IKJAX_PROGRAMS_AHEAD") == "1":
            compile_cache.precompile_programs(calls)
        return shapes

    def _prefetch_steps(self) -> str | None:
        """This run's label for its stored steps (compile_cache.recent_label), with the ones its
        last run used started reading; None where steps are not stored whole (as
        Executables._stored_step decides: several devices, a CPU unless IKJAX_STORE_STEPS=1)."""
        if not self.executor.stores_steps or not compile_cache.stores_whole(self.executor.on_cpu_only):
            return None
        if compile_cache.setup() is None:
            return None
        label = compile_cache.recent_label(self.file.path, self.options)
        n = compile_cache.prefetch_steps(label)
        if n:
            log.info("compilation cache: reading %d stored step(s) of the last run ahead", n)
        return label

    # -- the weights (loaded here, or in a thread while steps compile: IKJAX_LOAD_OVERLAP) -------

    @property
    def weights(self):
        """The weight tree on its devices; waits for a load still under way (`_overlaps_load`)."""
        self._check_open()
        if self._weights is None:
            self.wait_loaded()
        return self._weights

    def _check_open(self) -> None:
        if self._closed:
            raise OptionError(f"{self.file.path}: this engine was closed (Engine.close); load the model again")

    def close(self) -> None:
        """Let go of this engine's memory now, not whenever Python collects it: the weights, the
        compiled steps and the model file's map, then the heap's freed pages handed back to the
        system. Using the engine afterwards raises an OptionError naming the file; `with
        ikjax.load(...) as eng:` closes at the block's end; closing twice is a no-op. Why: a notebook
        loading one model after another kept each one's memory after `del` (an outside probe, stop 65:
        a 628 MiB model's process at 937 MiB loaded, 772 MiB after `del eng`, 304 MiB only after a
        malloc_trim by hand). A KV cache or session the caller still holds keeps its own arrays."""
        if self._closed:
            return
        try:
            self.cancel_load()
            self.wait_loaded()
        except Exception:  # noqa: BLE001 - a load that failed or was stopped: nothing of it to keep
            pass
        self._closed = True
        self._weights = self._shapes = self._dry = None
        self.executor.unbind()  # (-sm layer's stages hold every weight)
        self._steps.forget_all()
        gc.collect()  # the arrays that viewed the file's map go before the map
        self.file.close()
        for shard in self.file.shards:  # the row gather's descriptor: a deleted file's space is freed
            ops.registry.forget_model_file(*shard.identity[:2])
        release_freed_memory()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @weights.setter
    def weights(self, tree) -> None:
        """Another weight tree for this engine's steps (tests load one by hand); no load under way."""
        self.wait_loaded()
        self._weights = self._shapes = tree

    def wait_loaded(self) -> None:
        """Wait for the weights (a no-op once in); a load that failed raises its error here."""
        if self._loading is None:
            return
        with self._load_lock:
            if self._loading is None:
                return
            weights = self._loading.result()  # its own error, if it failed
            end = self._loading.finished_at
            real = self._loading.shapes_seen()
            if self._dry is not None and real is not None and not same_shapes(real, self._dry):
                # never expected (tests/test_engine.py compares the two): steps compiled for the
                # computed shapes would not take these weights, so none of them is kept
                log.warning("the loaded weights' shapes differ from the ones computed before the load; compiling "
                            "the steps again (a bug, please report; IKJAX_DRY_SHAPES=0 avoids it)")
                self._steps.forget_all()
                self._shapes = real
                self._dry = None
            self._weights, self._loading = weights, None
            self._steps.update_memory(lambda m: self._loaded(m, compiled_bytes=m.compile_bytes or 0, end=end))

    def cancel_load(self) -> None:
        """Stop a load still under way (its thread ends at its next layer); the engine then has no
        weights, and using it raises. For a command whose own work failed while it loaded."""
        if self._loading is not None:
            self._loading.cancel()

    @property
    def loading(self) -> bool:
        """Whether the weights are still streaming in (steps may compile meanwhile)."""
        return self._loading is not None and not self._loading.done()

    def _overlaps_load(self) -> bool:
        """Whether the load runs in a thread while steps compile from the weights' shapes: on one
        accelerator whose steps compile side by side, every weight on it (a pipeline or mesh
        derives its stages from the loaded arrays; host-resident experts get flags set after the
        load); IKJAX_LOAD_OVERLAP=1 anywhere those hold (the CPU too), =0 never."""
        choice = env.choice("IKJAX_LOAD_OVERLAP")
        if choice == "0" or not self.executor.overlaps_load:
            return False
        # every weight on the accelerator (on a CPU-only machine host and device are one memory):
        # `unified` alone, as here until ccd6438's GPU run showed, kept every GPU load serial
        if self.options.gpu_experts or (not self.placement.unified and self.placement.host_bytes):
            return False
        if choice == "1":
            return True
        # steps that JAX's own cache serves (not stored whole: --expert-stats, IKJAX_STORE_STEPS=0)
        # must lower to the same module in every run, and a load tracing its programs beside them
        # races them in JAX's trace cache (a nested jit traced twice: RESULTS §25j)
        if self.options.expert_stats or not (self.executor.stores_steps
                                             and compile_cache.stores_whole(self.executor.on_cpu_only)):
            return False
        return self.executor.compiles_in_parallel

    def _loaded(self, memory: MemoryPlan, compiled_bytes: int, end: float | None = None) -> MemoryPlan:
        """After the load: the host-expert flags, the plan charged with what the load added
        (less what steps compiling beside it grew the process by, `compiled_bytes`, charged to
        them already), the log line, the executor's view of the weights."""
        t0, before = self._load_start
        if not self.stream_whole:
            for lay in host_layers(self._weights):
                for t in lay.values():
                    if is_host_resident(t):
                        t.whole_ok = False
        after = process_memory()
        mapped = self._mapped_at_load
        if mapped is None:
            mapped = mapped_rss(shard.path for shard in self.file.shards)
        memory = charge_load(memory, before, (after[0] - compiled_bytes, after[1]), mapped, self._stacked_host_bytes())
        self.loaded_at = end or time.perf_counter()  # perf_counter when the load ended (its thread's end)
        log.info("loaded %s in %.2fs", self.file.path, self.loaded_at - t0)
        self.executor.bind(self._weights)
        stages = self.executor.describe()
        if stages:
            log.info("-sm %s: %s", self.split_mode, stages)
        return memory

    def _load_and_measure(self, file, **kwargs):
        """The load, on its thread (BackgroundLoad), then the file's resident mapped bytes for the
        memory plan (`_loaded`): reading /proc/self/smaps of a GPU process (thousands of
        mappings) took 60-90 ms, which the command's thread paid between the steps' compile and
        the first row (RESULTS §22al); the load's thread ends sooner and has the time."""
        tree = self.executor.load(file, **kwargs)
        self._mapped_at_load = mapped_rss(shard.path for shard in file.shards)
        return tree

    def _stacked_host_bytes(self) -> int:
        """File bytes of the weights a CPU-only load holds as stacked copies (the layers of scanned
        groups: a stack is one array, built from the file's per-layer tensors), which the plan
        counts in its weights already (memory_plan.charge_load)."""
        if not self.placement.unified:
            return 0
        stacked = {i for first, count in self.spans if count > 1 for i in range(first, first + count)}
        return sum(t.nbytes for t in self.placement.tensors if t.layer in stacked)

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
                        backend=self.backend, threads=threads, tp=self.executor.tp,
                        expert_stats=self._expert_counts, settings=trace_variables(),
                        kv_live=n_tokens > 1 and self.prompt_whole_cache)

    def kv_bucket(self, needed: int, n_tokens: int = 0) -> int:
        """Cache rows a step reads: the bucket covering `needed` (ikjax.kv_buckets: multiples of
        ubatch placed by length, as many as powers of two would be). Decode steps that run the
        split-KV MLA kernel read each sequence only up to its own length, so they share one bucket."""
        if n_tokens == 1 and self.decode_kernel or n_tokens > 1 and self.prompt_whole_cache:
            return self.capacity
        o = self.options
        return kv_buckets.kv_bucket(needed, o.ctx, o.ubatch, o.kv_block, self.capacity)

    def token_bucket(self, n: int) -> int:
        """Tokens a prompt step of `n` real tokens computes (the rest padding, masked). On the CPU
        the next power of two up to ubatch: padding costs compute there, a compile a second or two.
        With the GPU kernels a few fixed sizes, SHORT_CHUNK times powers of CHUNK_GROWTH below
        ubatch, and ubatch (64 / 256 / 512 at -ub 512): each step is a compile there, so a server
        whose prompts end at any length never stalls its streams on one (Scheduler.warmup compiles
        every size at every KV bucket) and `generate` pads exactly as the server does (same steps,
        same bits). Why a size between: a 128-token prompt padded to 512 rows took 37 ms of the
        27-layer V2-Lite shape on an H200, its time to first token, and eight of them arriving
        together held the eighth's first token 340 ms (RESULTS §23ao)."""
        ub = self.options.ubatch
        if self.backend == "pallas" and n <= ub:
            return next(t for t in self.prompt_step_sizes() if t >= n)
        return min(kv_buckets.pow2_at_least(n), max(n, ub))

    def prompt_step_sizes(self) -> tuple[int, ...]:
        """The token counts of full prompt chunks and of the padded short ones that `token_bucket`
        can give (what a server compiles ahead): every power of two up to ubatch on the CPU."""
        ub = self.options.ubatch
        if self.backend == "pallas":
            sizes, t = {ub}, SHORT_CHUNK
            while t < ub:
                sizes.add(t)
                t *= CHUNK_GROWTH
            return tuple(sorted(sizes))
        return tuple(sorted({self.token_bucket(n) for n in range(1, ub + 1)}))

    def prompt_tokens(self, n: int, pos: int) -> int:
        """Tokens the step computes for a prompt chunk of `n` real tokens at position `pos`: its
        token bucket (the padding rows land past the chunk, hidden by the causal mask until later
        tokens overwrite them), or, where the bucket would run past the cache's `capacity` rows,
        exactly the rows left (a write past the end would be clamped onto earlier rows).

        Why the rows left and not `n`: prompts from position 0 meet the end only in the chunk
        that starts at the last multiple of ubatch, so every such prompt shares that one extra
        step (the rows left, the whole cache as its KV bucket), whatever its length; `n` would
        be a new step for each length. `pos + n` must fit (the callers check it against ctx)."""
        t = self.token_bucket(n)
        room = self.capacity - pos
        return t if t <= room else max(n, room)

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
        `last` [B]: the token whose logits sequence b returns (default T-1); the tokens after it
        are padding, and -1 marks an idle sequence (the server's free slots in a decode batch):
        its rows still write their KV, but route to no expert (with experts in host RAM, each
        row's experts are bytes read from RAM) and its logits are meaningless.
        """
        tokens = self._ids("tokens", tokens, 2)
        B, T = tokens.shape
        start = self._positions("start", start, B, T)
        last = np.full(B, T - 1, np.int32) if last is None else self._int_array("last", last, 1, B)
        if (last < -1).any() or (last >= T).any():
            raise OptionError(f"last: indices must lie in [0, {T}) for {T} tokens a sequence (or be -1: an idle "
                              f"sequence), got {last.tolist()}")
        last = last.astype(np.int32)
        self._check_cache(cache, B)
        self.file.check_unchanged()
        plan = self._plan(self.kv_bucket(int(start.max()) + T, T), all_logits, T)
        weights = self.weights
        exe = self._steps.get(self._shapes, B, T, plan)
        return self.executor.run(exe, weights, cache, tokens, start, last)

    def precompile(self, batch: int, n_tokens: int, kv_needed: int, all_logits: bool = False) -> float:
        """Compile the step for this shape ahead of time (no execution, no cache allocated); seconds taken."""
        self._check_open()
        return self._steps.precompile(self._shapes, batch, n_tokens,
                                      self._plan(self.kv_bucket(kv_needed, n_tokens), all_logits, n_tokens))

    def decode_loop(self) -> bool:
        """Whether generation runs several steps per dispatch (`decode`): under every split
        mode (one device, the -sm layer pipeline, the -sm graph mesh), with weights in host RAM
        next to an accelerator (-ot ...=CPU, --n-cpu-moe) too: their host custom calls keep the
        loop out of one CUDA graph, but the loop still saves each token's Python dispatch and,
        with expert statistics, each token's host callback (8-layer R1 on an H200,
        --gpu-experts auto: sweep-bench's TG rows ran one dispatch a token at ~110 t/s, 78-85
        counting, against the loop's 115-125, RESULTS §24j). IKJAX_DECODE_LOOP=0 turns it off
        everywhere (for comparison)."""
        return self.executor.loops and env.choice("IKJAX_DECODE_LOOP") == "1"

    def row_sampling(self) -> bool:
        """Whether `decode` can draw each row with its own key (sampling "rows": the server's
        sampled streams in the decode loop, and `generate`'s draws, whose values then compile
        nothing): the loop on one device and under -sm layer."""
        return self.decode_loop() and self.executor.row_keys

    _sampling_key = staticmethod(generation.sampling_key)

    def _decode_plan(self, start_max: int, chunk: int) -> StepPlan:
        return self._plan(self.kv_bucket(start_max + chunk, 1), False, 1)

    def decode(self, cache, tokens, start, n: int, *, chunk: int | None = None, sampling: dict | None = None,
               key=None, check_finite: bool = True, idle=None):
        """n decode steps in one dispatch (see `generation.decode_steps`): tokens [B] at positions
        start [B]; returns (new tokens [B, chunk] on the device, the first n valid; cache). The
        cache is donated. `chunk` (default n) is the compiled length, so calls with n <= chunk
        share one executable; `sampling`: `check_sampling`'s keys (default greedy); `key`: a JAX
        PRNG key. A token made from non-finite logits (NON_FINITE) is refused here unless
        `check_finite=False` (the server ends only that row's request). `idle` [B] bool: rows whose
        tokens nobody reads (the server's free slots): on one device they route to no expert, as
        `step`'s last = -1 (elsewhere they compute as any row; their tokens are meaningless).
        `sampling` with "rows": True takes `key` as a key per row (`sampling.sample_rows`; on one
        device, `row_sampling()`) and, where it draws (temperature > 0), the rows' own settings
        beside them: `key` = (keys [B], `sampling.row_params(...)`); then only `sampling`'s top_k
        bucket is compiled in, and the rows' values may differ and change freely."""
        tokens = self._ids("tokens", tokens, 1)
        if (sampling or {}).get("rows"):
            if not self.row_sampling():
                raise OptionError("decode: a key per row needs the decode loop on one device or under -sm layer")
            draws = "bucket" in sampling or sampling.get("temperature", 0.0) > 0.0
            keys, params = key if draws and isinstance(key, tuple) and len(key) == 2 else (key, None)
            if keys is None or getattr(keys, "shape", ()) != (len(tokens),):
                raise OptionError(f"decode: sampling by rows needs a key per row ({len(tokens)}), got "
                                  f"{getattr(keys, 'shape', None)}")
            if draws:
                if not isinstance(params, dict) or any(np.shape(params.get(k)) != (len(tokens),) for k in ROW_PARAMS):
                    raise OptionError(f"decode: sampling by rows needs key = (keys, sampling.row_params(settings)), "
                                      f"{len(tokens)} values each")
                bucket = sampling["bucket"] if "bucket" in sampling else top_k_bucket(int(sampling.get("top_k", 0)))
                if {top_k_bucket(int(k)) for k in np.asarray(params["top_k"])} != {bucket}:
                    raise OptionError("decode: every row's top_k must fall in the bucket of sampling's top_k "
                                      "(sampling.top_k_bucket)")
        if idle is not None and np.asarray(idle, bool).any():
            tokens = np.where(np.asarray(idle, bool), -1 if self.executor.plain_loop else 0, tokens).astype(np.int32)
        chunk = n if chunk is None else chunk
        if not _is_int(n) or not _is_int(chunk) or not 0 < n <= chunk:
            raise OptionError(f"decode: need integers 0 < n <= chunk, got n={n!r}, chunk={chunk!r}")
        start = self._positions("start", start, len(tokens), n)
        self._check_cache(cache, len(tokens))
        self.file.check_unchanged()
        plan = self._decode_plan(int(start.max()), chunk)
        weights = self.weights
        exe = self._steps.get(self._shapes, len(tokens), 1, plan, (chunk, self._sampling_key(sampling)))
        out, cache = self.executor.run(exe, weights, cache, tokens, start, np.int32(n),
                                       jax.random.key(0) if key is None else key)
        # the tokens are tiny and every caller reads them next (generate) or waits for them
        # (the benches): checked here, the host copy stays cached on the array
        bad = np.asarray(out)[:, :n] == NON_FINITE
        if idle is not None:
            bad &= ~np.asarray(idle, bool)[:, None]
        if check_finite and bad.any():
            b, i = (int(v[0]) for v in np.nonzero(bad))
            raise self._non_finite(f" at decode step {i} of sequence {b} (position {int(start[b]) + i})")
        return out, cache

    def collectives(self) -> list[tuple[str, object]]:
        """-sm graph: (what, `ikjax.runtime.mesh.Collectives`) of every step compiled so far, e.g.
        ("decode loop, batch 1", 55 collectives a step); [] under the other split modes. The
        count a token pays over one device, printed by sweep-bench and the multi-GPU bench."""
        out = []
        for (B, T, plan, decode), exe in sorted(self._steps.table.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                         kv[0][3] is None)):
            c = self._collectives.get((B, T, plan, decode))
            if c is None:
                c = self.executor.collectives(getattr(exe, "exe", exe))  # a StoredStep holds the executable
                if c is None:  # not a mesh step, or its HLO text is not to be had
                    continue
                self._collectives[(B, T, plan, decode)] = c
            what = f"decode loop, batch {B}" if decode else f"step of batch {B} x {T} tokens"
            out.append((f"{what}, kv_len {plan.kv_len}", c))
        return out

    def precompile_decode(self, batch: int, chunk: int, kv_needed: int, sampling: dict | None = None) -> float:
        """Compile the decode loop of `chunk` steps whose last step reads `kv_needed` entries."""
        self._check_open()
        return self._steps.precompile(self._shapes, batch, 1, self._decode_plan(kv_needed - chunk, chunk),
                                      (chunk, self._sampling_key(sampling)))

    def expert_stats(self) -> dict:
        """Tokens routed to each expert of each MoE layer over every step this engine ran (loaded with
        `expert_stats=True`, the CLI's --expert-stats): {"tokens": N, "layers": {"3": [tokens routed to
        expert 0, 1, ...], ...}}, N the real tokens fed (prompt and generation). Every token a step
        computed counts: a decode loop that draws several tokens a dispatch computes the rest of its
        dispatch after a stop string or an abandoned stream too (up to its chunk, 16 tokens), and
        those are counted, as the work they were (statistics of a whole prompt file or sweep are
        what placement reads; a stream's last few tokens move them by a few tokens in thousands)."""
        if self._expert_counts is None:
            raise OptionError("expert-stats: load the model with expert_stats=True (--expert-stats FILE.json) "
                              "to count the experts' tokens")
        jax.effects_barrier()  # every callback of the steps run so far has landed
        return self._expert_counts.as_json()

    @contextlib.contextmanager
    def uncounted(self):
        """Steps run inside are not counted in `expert_stats()` (sweep-bench's and bench's warm-up
        runs: the statistics are the user's tokens, not how often a tool warms a step, which
        differs between a CPU and a GPU). Their callbacks are waited for before counting resumes."""
        if self._expert_counts is None:
            yield
            return
        jax.effects_barrier()
        self._expert_counts.paused = True
        try:
            yield
        finally:
            jax.effects_barrier()
            self._expert_counts.paused = False

    def save_expert_stats(self, path, stats: dict | None = None) -> None:
        """`expert_stats()` (or `stats` in its form) as JSON in `path`, written whole or not at all
        (its directory must exist: a mistyped path is refused, not made, as on the CLI); an existing
        file is replaced only if it is an expert-stats file (`moe.refuse_overwrite`)."""
        write_expert_stats(path, self.expert_stats() if stats is None else stats)

    def new_cache(self, batch: int = 1):
        """A zeroed KV cache: per device with -sm layer, replicated over the mesh with -sm graph.
        A batch the memory plan says cannot fit is refused by it (a batch of 10^12 was XLA's
        RESOURCE_EXHAUSTED); one sequence fits, or the load would have been refused."""
        self._check_open()
        batch = _batch_size(batch)
        if batch > 1:
            check_fits(self._static_plan(batch), self.options, self.file.path, f"a KV cache of {batch} sequences")
        return self.executor.new_cache(self.cache_layout(batch))

    def prepare_cache(self, batch: int = 1) -> None:
        """Compile what `new_cache(batch)` runs, ahead: beside the first steps' compile, so the
        first cache costs its allocation only (ikjax.runtime.executors._zeroed_cache)."""
        self.executor.prepare_cache(self.cache_layout(_batch_size(batch)))

    def cache_layout(self, batch: int = 1) -> kvcache.CacheLayout:
        return kvcache.CacheLayout.for_model(self.config, self.options.mla, self.options.ctk, batch, self.capacity,
                                             tuple(count for _, count in self.spans))

    # -- argument checks (host side, on small arrays: microseconds a step) ------------------------
    @staticmethod
    def _int_array(name: str, x, ndim: int, length: int | None = None) -> np.ndarray:
        """An integer array of `ndim` dims (and `length` rows); one line naming `name`."""
        try:
            arr = np.asarray(x)
        except (ValueError, TypeError) as e:
            raise OptionError(f"{name}: not an integer array ({e})") from None
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise OptionError(f"{name}: expected integers, got {arr.dtype} values")
        if ndim == 1 and arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != ndim or arr.size == 0:
            raise OptionError(f"{name}: expected a non-empty {ndim}-D integer array, got shape {arr.shape}")
        if length is not None and arr.shape[0] != length:
            raise OptionError(f"{name}: expected {length} entries (one per sequence), got {arr.shape[0]}")
        return arr  # as given: the callers' range checks come before the cast to int32

    def _ids(self, name: str, x, ndim: int) -> np.ndarray:
        arr = self._int_array(name, x, ndim)
        V = self.config.vocab_size
        if arr.min() >= 0 and arr.max() < V:
            return arr.astype(np.int32)
        bad = (arr < 0) | (arr >= V)
        if bad.any():
            i = tuple(int(v[0]) for v in np.nonzero(bad))
            raise OptionError(f"{name}: token id {int(arr[i])} at index {i if ndim > 1 else i[0]} is outside the "
                              f"vocabulary [0, {V})")
        return arr.astype(np.int32)

    def _positions(self, name: str, x, B: int, T: int) -> np.ndarray:
        """Positions start[b] of B sequences writing T rows each: >= 0 and inside the cache (its
        `capacity` rows: ctx in whole KV blocks; a write past it would land, clamped, on earlier
        rows)."""
        start = self._int_array(name, x, 1, B)
        if start.min() < 0:
            raise OptionError(f"{name}: positions must be >= 0, got {start.tolist()}")
        if int(start.max()) + T > self.capacity:
            raise OptionError(f"{name}: {int(start.max())} + {T} tokens run past the cache ({self.capacity} rows for "
                              f"ctx={self.options.ctx})")
        return start.astype(np.int32)

    def _cache_spec(self, batch: int):
        spec = self._cache_specs.get(batch)
        if spec is None:
            shapes = jax.eval_shape(lambda: kvcache.init_cache(self.cache_layout(batch)))
            leaves, tree = jax.tree.flatten(shapes)
            spec = self._cache_specs[batch] = (tree, [(a.shape, a.dtype) for a in leaves])
        return spec

    def _check_cache(self, cache, batch: int) -> None:
        """The cache is this engine's (model, -mla, -ctk, -c) for `batch` sequences and still
        alive (a step consumes the cache it is given): else one line, not a JAX TypeError."""
        tree, want = self._cache_spec(batch)
        leaves, got_tree = jax.tree.flatten(cache)
        layout = self.cache_layout(batch)
        what = (f"{layout.kind} cache of {layout.n_layer} layers, batch {batch}, {layout.capacity} rows, "
                f"-ctk {layout.ctk}")
        if got_tree != tree:
            raise OptionError(f"cache: not a cache of this engine (expected a {what}); make one with new_cache({batch})")
        for a, (shape, dtype) in zip(leaves, want):
            if getattr(a, "shape", None) != shape or getattr(a, "dtype", None) != dtype:
                raise OptionError(f"cache: holds {getattr(a, 'dtype', type(a).__name__)}"
                                  f"{list(getattr(a, 'shape', ()))} where this engine's {what} has "
                                  f"{dtype}{list(shape)}; make one with new_cache({batch})")
            if isinstance(a, jax.Array) and a.is_deleted():
                raise OptionError("cache: already consumed by an earlier step (steps donate their cache): pass "
                                  "the cache that step returned")

    # -- non-finite values -----------------------------------------------------------------------
    def _check_finite(self, logits: np.ndarray, position: int) -> None:
        try:
            check_finite_logits(logits)
        except NonFiniteLogitsError:
            raise self._non_finite(f" (up to position {position})") from None

    def _non_finite(self, where: str) -> NonFiniteLogitsError:
        """The error for non-finite logits: which tensor of the file holds NaN/Inf, looked for
        only now (on the failure path), in the order the step reads them."""
        source = _non_finite_tensor(self.file)
        return NonFiniteLogitsError(f"{self.file.path}: non-finite logits{where}: {source}")

    # -- public API ----------------------------------------------------------------------------
    def prefill(self, cache, ids: np.ndarray, start: int = 0, all_logits: bool = False):
        """Feed one sequence's ids from position `start` in ubatch chunks (batch 1), each step
        `prompt_tokens` long (never past the cache; start + len(ids) must fit in ctx).

        Returns (logits, cache): [n, V] for every token if all_logits, else [V] of the last one.
        """
        ids = generation.check_ids(ids, self.config.vocab_size, "ids")
        if not _is_int(start) or start < 0:
            raise OptionError(f"start: expected an integer position >= 0, got {start!r}")
        n = len(ids)
        if start + n > self.options.ctx:
            raise OptionError(f"{start + n} tokens exceed the context size ctx={self.options.ctx}")
        outs = []
        logits = None
        for c0 in range(0, n, self.options.ubatch):
            chunk = ids[c0:c0 + self.options.ubatch]
            T = self.prompt_tokens(len(chunk), start + c0)
            toks = np.zeros((1, T), np.int32)
            toks[0, :len(chunk)] = chunk
            logits, cache = self.step(cache, toks, np.array([start + c0]), np.array([len(chunk) - 1]),
                                      all_logits)
            if all_logits:
                outs.append(np.asarray(logits, np.float32)[0, :len(chunk)])
                self._check_finite(outs[-1], start + c0)
        if all_logits:
            return np.concatenate(outs, 0), cache
        out = np.asarray(logits, np.float32)[0]
        self._check_finite(out, start + n - 1)
        return out, cache

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [n_tokens, n_vocab] (float32) at every position of a fresh sequence."""
        ids = generation.check_ids(token_ids, self.config.vocab_size)
        out, _ = self.prefill(self.new_cache(1), ids, 0, all_logits=True)
        return out

    def perplexity(self, ids: Sequence[int], ctx: int | None = None, *, n_chunks: int | None = None,
                   save_base=None, on_chunk=None):
        """llama-perplexity over a whole text's token ids (BOS first where the model adds one):
        chunks of `ctx` tokens (default -c), each scoring its second half; returns a
        `PerplexityResult` (ppl, ppl_err, per-chunk running PPL, every token's NLL). `save_base`:
        also write ik's --kl-divergence-base file. The rules are ik's: ikjax.runtime.perplexity."""
        from ikjax.runtime import perplexity
        return perplexity.perplexity(self, ids, ctx, n_chunks=n_chunks, save_base=save_base, on_chunk=on_chunk)

    def kld(self, base, *, n_chunks: int | None = None, on_chunk=None):
        """llama-perplexity --kl-divergence against a base log-probability file (a path, or
        `perplexity.BaseLogits`) written by `perplexity(save_base=...)` or by ik; returns a
        `KLDResult` (`.lines()`: ik's statistics block)."""
        from ikjax.runtime import perplexity
        return perplexity.kld(self, base, n_chunks=n_chunks, on_chunk=on_chunk)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                 stop: Iterable[int] = (), stream: bool = False, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 penalize_nl: bool = False, ignore_eos: bool = False, session: KVSession | None = None,
                 **unknown) -> Generation:
        """New token ids as they are produced (an iterator); stop on EOS, a stop id, `max_tokens`,
        or a full context.

        Every argument is checked here, before anything runs (OptionError naming it). The context
        end is treated as llama.cpp does without context shift: a sequence never holds more than
        `ctx` tokens (prompt + generated); generation stops there with a warning. A prompt longer
        than `ctx` is refused. The iterator's `stop_reason` ("eos", "max_tokens", "context") is
        set when the last token is yielded; `generate_batch` follows the same rules. Up to
        DECODE_CHUNK tokens per dispatch where `decode_loop()`, else one step per token.

        `stream=True`: one token per dispatch, each yielded as soon as it is made (the same tokens
        for the same seed: a draw depends on its position, not on the dispatch). `repeat_penalty`
        (llama.cpp's, over the last `repeat_last_n` tokens of prompt and answer; 1 = off), and
        `frequency_penalty` / `presence_penalty` (OpenAI's, as llama.cpp applies them over the same
        window; 0 = off), pick every token on the host, one step per token; they leave the newline
        token alone unless `penalize_nl` (ik_llama.cpp's default). `ignore_eos`: EOS is never drawn and does not
        stop. `session` (`session()`): a KV cache kept across calls; a prompt extending what it
        holds feeds only the new tokens (`Generation.cached_tokens` says how many were reused).
        """
        _refuse_unknown("generate", unknown)
        return generation.generate(self, prompt_ids, max_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, min_p=min_p, seed=seed, stop=stop, stream=stream,
                                   repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                   frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                   penalize_nl=penalize_nl, ignore_eos=ignore_eos, session=session)

    # -- text: tokenizer, chat template, completions (ikjax.runtime.text) -------------------------
    @property
    def tokenizer(self):
        """The model file's tokenizer (ikjax.tokenizer.GGUFTokenizer), built on first use."""
        tok = self.__dict__.get("_tokenizer")
        if tok is None:
            from ikjax.tokenizer import GGUFTokenizer
            tok = self._tokenizer = GGUFTokenizer(self.file.metadata, source=str(self.file.path))
        return tok

    @property
    def newline_token(self) -> int | None:
        """The token "\n" encodes to first (ik_llama.cpp's linefeed token: the penalties leave it
        alone by default); None where the vocabulary has none."""
        if "_newline" not in self.__dict__:
            try:
                ids = self.tokenizer.encode("\n", add_bos=False, parse_special=False)
            except Exception:  # noqa: BLE001 (a file without a usable vocabulary: no newline token)
                ids = []
            self._newline = int(ids[0]) if ids and 0 <= ids[0] < self.config.vocab_size else None
        return self._newline

    def chat_template(self, choice: str | None = None):
        """The chat template (ikjax.chat_template.ChatTemplate): None -> the file's own, else the
        builtin for its pre-tokenizer; a builtin name (deepseek3, deepseek-r1, deepseek2, chatml, kimi-k2, chatglm4), a FILE, or
        Jinja text. bos_token / eos_token are this model's."""
        from ikjax.chat_template import template_for
        if choice is None and self.__dict__.get("_default_template") is not None:
            return self._default_template  # compiled once (and the fallback noted once)
        tok = self.tokenizer
        t = template_for(self.file.metadata, choice, bos_token=tok.token_text(tok.bos_id),
                         eos_token=tok.token_text(tok.eos_id))
        if choice is None:
            self._default_template = t
        return t

    def session(self) -> KVSession:
        """A KV cache kept between calls (multi-turn chat): pass it as `session=` to generate,
        complete or chat; each call feeds only what its prompt adds to what the cache holds."""
        self._check_open()
        return KVSession(self)

    def complete(self, prompt, max_tokens: int | None = None, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop=None, stream: bool = False,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, penalize_nl: bool = False, ignore_eos: bool = False,
                 session: KVSession | None = None, **unknown):
        """Text in, text out. `prompt`: text (BOS added as the model asks) or token ids;
        `max_tokens` None: until EOS or the context's end; `stop`: a string or a list of strings
        that end the answer (not included). Returns a `text.Completion` (`.text`, `.tokens`,
        `.finish_reason` "stop" | "length", `.usage`), or with `stream=True` a `text.TextStream`:
        an iterator of text deltas, token by token, never half a UTF-8 character or any part of
        a stop string. The other arguments are `generate`'s."""
        _refuse_unknown("complete", unknown)
        return text.complete(self, prompt, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p, seed=seed, stop=stop, stream=stream, repeat_penalty=repeat_penalty,
                             repeat_last_n=repeat_last_n, frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty, penalize_nl=penalize_nl, ignore_eos=ignore_eos,
                             session=session)

    def chat(self, messages, max_tokens: int | None = None, *, chat_template=None, reasoning_format: str = "deepseek",
             template_kwargs=None, stream: bool = False, tools=None, tool_choice=None, **kw):
        """A conversation (`[{"role": "user", "content": "..."}, ...]`) rendered by the chat template
        (`chat_template`: as `chat_template()` takes it, or a ChatTemplate), then `complete`. The
        result's `.content` / `.reasoning_content` split R1's `<think>` block off
        (`reasoning_format="deepseek"`, llama-server's; "none" keeps it in the content). `tools`:
        OpenAI's function tools, offered to the model; the calls it answers with are in
        `.tool_calls` (`ikjax.tool_calls.ToolCall`: name, arguments as JSON text), taken out of
        `.content`; `tool_choice` as OpenAI's ("auto", "none", "required" or one function: the
        answer then starts with that call, `ikjax.tool_calls.forced_call`). With `stream=True` the
        deltas are the raw text (a forced call's opening is the prompt's end, not a delta);
        `TextStream.reasoning_opened`
        tells `ikjax.chat_template.ReasoningSplitter` how to split them, and
        `ikjax.tool_calls.ToolCallSplitter` takes the calls out."""
        return text.chat(self, messages, max_tokens, chat_template=chat_template, reasoning_format=reasoning_format,
                         template_kwargs=template_kwargs, stream=stream, tools=tools, tool_choice=tool_choice, **kw)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                       stop: Iterable[int] = (), **unknown) -> BatchGeneration:
        """Generate for several sequences at once, each at its own length; one list of new ids each.

        Same checks and stopping rules as `generate` (each sequence stops on its own at EOS / a
        stop id, `max_tokens`, or `ctx` tokens in all); the returned list's `stop_reasons` says
        which, per sequence. Each prompt is fed alone in ubatch chunks into its row of the batch's
        cache; then the decode loop runs every row up to DECODE_CHUNK tokens per dispatch where
        `decode_loop()` (else one step per token for every unfinished sequence). The batch is
        padded to a power of two; greedy, each sequence gets the tokens `generate` gives it.
        """
        _refuse_unknown("generate_batch", unknown)
        return generation.generate_batch(self, prompts, max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, min_p=min_p, seed=seed, stop=stop)

    def _static_plan(self, batch: int) -> MemoryPlan:
        return plan_memory(self.config, self.options, batch=batch, placement=self.placement,
                           stream_whole=self.stream_whole)

    def memory_plan(self, batch: int = 1) -> MemoryPlan:
        """Weights (as stored, per place), KV cache and attention-buffer bytes for these options;
        for batch 1 also what this engine measured: runtime, load copies, compiled steps, and
        XLA's buffers of the largest step compiled so far (`peak_bytes`, `peak_lines()`)."""
        self._check_open()
        if _batch_size(batch) != 1:
            return self._static_plan(batch)
        self.wait_loaded()  # the load's own charge
        return self._steps.memory


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


_SCAN_BYTES = 4 << 30  # how much of the file the failure path reads looking for the bad tensor


def _read_order(name: str) -> tuple:
    """Tensors in the order a step reads them: the embedding, the layers, the output head."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def _non_finite_tensor(file: GGUFModelFile) -> str:
    """Where the weights hold NaN/Inf: the first tensor (in read order) with a non-finite value,
    with the layer it belongs to; the routed experts (most of a big file) after the rest, within
    _SCAN_BYTES. The text says what was checked when nothing turns up (then the arithmetic
    overflowed: a narrower -dtype, or activations past f16's range)."""
    from ikjax.quant.dequant import dequantize, supports

    names = sorted(file.tensors, key=lambda n: ("_exps" in n, _read_order(n)))
    scanned = 0
    for name in names:
        info = file.tensors[name]
        if info.qtype is None or not supports(info.qtype) or scanned + info.nbytes > _SCAN_BYTES:
            continue
        scanned += info.nbytes
        raw = file.tensor_bytes(name)
        n_per_row = info.shape[-1]
        rb = info.qtype.row_bytes(n_per_row)
        rows = raw.reshape(-1, rb)
        bad = 0
        R = info.qtype.interleave
        step = max(R, (64 << 20) // rb // R * R)
        for r0 in range(0, len(rows), step):
            vals = np.asarray(dequantize(rows[r0:r0 + step], info.qtype, n_per_row))
            bad += int((~np.isfinite(vals)).sum())
        if bad:
            layer = f" (layer {name.split('.')[1]})" if name.startswith("blk.") else ""
            return f"tensor {name}{layer} holds {bad} NaN/Inf value(s) in the file"
    return (f"no NaN/Inf in the {scanned >> 20} MiB of weights checked: the arithmetic overflowed "
            f"(try --dtype f32)")


def _refuse_unknown(method: str, unknown: dict) -> None:
    """A keyword the method does not take: OptionError naming it (Python's TypeError before)."""
    if unknown:
        names = ", ".join(sorted(unknown))
        raise OptionError(f"{method}: unknown option{'s' if len(unknown) > 1 else ''} {names}")


def write_expert_stats(path, stats: dict) -> None:
    """Expert statistics ({"tokens", "layers"}) as JSON in `path`: whole or not at all, its directory
    existing, an existing file replaced only if it is an expert-stats file (`moe.refuse_overwrite`)."""
    import json
    from ikjax.atomic_file import atomic_write, check_target
    def count(c) -> bool:
        return isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0

    layers = stats.get("layers") if isinstance(stats, dict) else None
    if not (isinstance(stats, dict) and count(stats.get("tokens")) and isinstance(layers, dict)
            and all(isinstance(v, (list, tuple)) and all(count(c) for c in v) for v in layers.values())):
        raise OptionError('expert-stats: expected {"tokens": N, "layers": {"3": [counts >= 0, ...], ...}} '
                          "(Engine.expert_stats()'s form)")
    data = json.dumps(stats, default=int)
    check_target(path, len(data), "expert-stats", parent_exists=True)
    moe.refuse_overwrite(path)
    with atomic_write(path, len(data), what="expert-stats") as tmp:
        tmp.write_text(data)


def _batch_size(batch) -> int:
    """A batch size the API takes: an integer >= 1 (a TypeError or a negative shape from JAX's
    depths before, an empty cache for 0)."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise OptionError(f"batch: expected an integer >= 1, got {batch!r}")
    return int(batch)


def load(path: str, **options) -> Engine:
    """Open a deepseek2 GGUF (any shard of a split model) with ik_llama.cpp-named options."""
    compile_cache.setup()  # before anything compiles: JAX looks for its cache once
    env.check_all()  # every IKJAX_* set: a bad value is an error here, not at its first use or a default later
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():  # ("" read as ".", b"..." as "b'...'")
        raise OptionError(f"path: expected the model file's path (a non-empty str or os.PathLike), got {path!r}"[:300])
    return Engine(os.path.expanduser(os.fspath(path)), RunOptions.from_kwargs(**options))  # "~/" as the CLI reads it
