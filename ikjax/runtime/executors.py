"""Executors: how a step runs on the placement's devices, named in one place.

Three, chosen by `executor_for` from the placement's split mode:

- `SingleDevice` (-sm none): the whole step as one executable on one device (the main device -mg
  where there are several); the only one whose steps are stored whole (ikjax.runtime.compile_cache).
- `LayerPipeline` (-sm layer): stages of consecutive layers, one per device, run in turn
  (ikjax.runtime.pipeline); its decode loop dispatches every stage of every token without the
  host waiting in between (pipeline.DecodePipeline).
- `GraphMesh` (-sm graph): every layer split over a mesh inside `jax.shard_map`
  (ikjax.runtime.mesh), inputs given as global arrays so the mesh may span processes; its decode
  loop is one executable, the loop inside the shard_map (mesh.decode).

All three run the decode loop (`loops`: several tokens per dispatch, the token picked on the
device).

The interface (`Executor`): `load(file)` the weight tree; `bind(weights)` once the load was
measured (the pipeline cuts its stages then); `new_cache(layout)`; `compile(weights, layout, B, T,
plan, decode)` an executable; `run(exe, weights, cache, *inputs)` -> (logits or tokens, cache);
and what the engine asks of it: `tp` (StepPlan.tp), `loops` (runs `decode_steps`),
`stores_steps`, `compiles_in_parallel`, `on_cpu_only`, `on_gpu`, `describe()`.
"""
from __future__ import annotations

import abc
import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ikjax import env
from ikjax.gguf_io.config import ModelConfig
from ikjax.model import cache as kvcache
from ikjax.model.deepseek2 import StepPlan
from ikjax.model.weights import load_weights
from ikjax.placement import devices
from ikjax.runtime import compile_cache, distributed
from ikjax.runtime import mesh as tensor_parallel
from ikjax.runtime.executables import compile_step, gpu_options
from ikjax.runtime.sampling import row_params_shapes
from ikjax.runtime.pipeline import Pipeline

log = logging.getLogger("ikjax")


def _cache_shapes(layout: kvcache.CacheLayout):
    return jax.eval_shape(lambda: kvcache.init_cache(layout))


_KEY_DATA = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))  # a PRNG key's raw data


def _is_key(a) -> bool:
    return isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


class Executor(abc.ABC):
    """What every executor answers (module docstring); the defaults are those of several devices.
    `new_cache` and `compile` are each executor's own (abstract: a fourth executor must say them)."""

    split_mode = "none"
    tp = None                    # StepPlan.tp: -sm graph's TensorSplit, else None
    loops = False                # runs the decode loop (several steps per dispatch)
    plain_loop = False           # its decode loop is generation.decode_steps itself: token -1 an idle
                                 # row, a PRNG key per row with sampling ("rows", True)
    row_keys = False             # its decode loop draws with a PRNG key per row (sampling ("rows", True))
    stores_steps = False         # its steps may be stored whole (compile_cache.store_step)
    compiles_in_parallel = False  # several steps may compile at once (on an accelerator)

    def __init__(self, placement, config: ModelConfig, spans: tuple):
        self.placement, self.config, self.spans = placement, config, spans  # spans: the layer groups
        self.devices = devices.jax_devices(placement)
        self.on_cpu_only = all(d.platform == "cpu" for d in self.devices)
        self.on_gpu = any(d.platform == "gpu" for d in self.devices)

    # whether `load` may run in a thread while steps compile from the weights' shapes (`on_shapes`):
    # an executor that derives state from the loaded arrays (`bind`) before it compiles may not
    overlaps_load = False

    def load(self, file, on_shapes=None, cancel=None, shapes_only: bool = False) -> dict:
        """The weight tree, each tensor where the placement puts it; `on_shapes(tree)` as soon as
        its ShapeDtypeStructs are known, `cancel` stops it; `shapes_only`: only those
        ShapeDtypeStructs, computed without the bytes (ikjax.model.weights.load_weights)."""
        return load_weights(file, self.config, placement=self.placement, spans=self.spans, on_shapes=on_shapes,
                            cancel=cancel, shapes_only=shapes_only)

    def bind(self, weights) -> None:
        """After the load was measured: whatever the executor derives from the weights."""

    def unbind(self) -> None:
        """Let go of what `bind` derived from the weights (`Engine.close`)."""

    def describe(self) -> str:
        """Where the parts of a step run, for the log ("" where that says nothing new)."""
        return ""

    @abc.abstractmethod
    def new_cache(self, layout: kvcache.CacheLayout):
        """A zeroed KV cache on the executor's devices."""

    def prepare_cache(self, layout: kvcache.CacheLayout) -> None:
        """Compile what `new_cache(layout)` will run, ahead (beside the steps' compile); nothing
        where an executor has nothing to compile ahead."""

    @abc.abstractmethod
    def compile(self, weights, layout: kvcache.CacheLayout, B: int, T: int, plan: StepPlan,
                decode: tuple | None = None):
        """The executable of one step shape (or of the decode loop, where `loops`)."""

    def run(self, exe, weights, cache, *inputs):
        """Run a compiled step (tokens, start, last) or decode loop (tokens, start, n, key)."""
        return exe(weights, cache, *inputs)

    def collectives(self, exe) -> "tensor_parallel.Collectives | None":
        """The collectives a compiled step runs between devices (-sm graph), else None."""
        return None


@functools.lru_cache(maxsize=16)
def _zeroed_cache(layout: kvcache.CacheLayout):
    """The compiled program that makes a zeroed cache of this layout on the default device. Why
    one program, compiled ahead: the cache's zeros made eagerly compiled one small program per
    shape at the first `new_cache`, 0.2 s of the deep V2-Lite shape's cold first row on an H200
    after its steps had compiled (RESULTS §22z); `SingleDevice.prepare_cache` compiles it beside them."""
    return jax.jit(kvcache.init_cache, static_argnums=0).lower(layout).compile()


class SingleDevice(Executor):
    """-sm none: one executable on one device; with several devices, on the main device -mg (its
    inputs and cache placed there)."""

    loops = True
    plain_loop = True
    row_keys = True
    overlaps_load = True

    def __init__(self, placement, config: ModelConfig, spans: tuple):
        super().__init__(placement, config, spans)
        self.stores_steps = len(placement.devices) == 1
        self.compiles_in_parallel = not self.on_cpu_only
        self._device = self.devices[placement.main_device] if len(placement.devices) > 1 else None

    def new_cache(self, layout: kvcache.CacheLayout):
        if self._device is not None:
            with jax.default_device(self._device):
                return kvcache.init_cache(layout)
        return _zeroed_cache(layout)()

    def prepare_cache(self, layout: kvcache.CacheLayout) -> None:
        if self._device is None:
            _zeroed_cache(layout)

    def _on_main_device(self, cache):
        """(sharding, cache shapes) of a single-device step: with -sm none on device -mg of several
        devices its inputs are placed there; on one device (None, as given)."""
        if self._device is None:
            return None, cache
        sh = jax.sharding.SingleDeviceSharding(self._device)
        return sh, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), cache)

    def compile(self, weights, layout, B, T, plan, decode=None):
        sh, cache = self._on_main_device(_cache_shapes(layout))
        return compile_step(weights, cache, B, T, cfg=self.config, plan=plan, sharding=sh, decode=decode,
                            gpu=self.on_gpu)


class LayerPipeline(Executor):
    """-sm layer: `pipeline.Pipeline`'s stages, built from the loaded weights (`bind`); a compiled
    step is a `CompiledPipeline`, called like the one-device executable (it ignores `weights`)."""

    split_mode = "layer"
    loops = True
    row_keys = True  # the last stage draws as decode_steps does (pipeline._decode_stage)

    def __init__(self, placement, config: ModelConfig, spans: tuple):
        super().__init__(placement, config, spans)
        self.pipeline: Pipeline | None = None

    def bind(self, weights) -> None:
        self.pipeline = Pipeline(self.placement, weights, self.config)

    def unbind(self) -> None:
        self.pipeline = None  # its stages hold every weight (and the head's copies)

    def describe(self) -> str:
        return self.pipeline.describe()

    def new_cache(self, layout):
        """Per device: each layer's entries on the device of its stage."""
        return self.pipeline.new_cache(layout)

    def compile(self, weights, layout, B, T, plan, decode=None):
        if decode is not None:  # the stages' decode steps, sampling on the last (pipeline.DecodePipeline)
            chunk, sampling = decode
            return self.pipeline.compile_decode(_cache_shapes(layout), B, plan, chunk, sampling,
                                                gpu_options(plan, True, self.on_gpu))
        return self.pipeline.compile(_cache_shapes(layout), B, T, plan, gpu_options(plan, False, self.on_gpu))


class GraphMesh(Executor):
    """-sm graph: the mesh of the placement's spread, the split groups (`tp`, part of the step
    plan), each device's part of the weights (`mesh.load`), the cache replicated or split as
    `mesh.cache_shardings` says; -mla 0 with a q8_0 cache is checked against the split at once."""

    split_mode = "graph"
    loops = True
    row_keys = True  # decode_steps inside the shard_map (mesh._decode), the keys' raw data as inputs

    def __init__(self, placement, config: ModelConfig, spans: tuple, layout: kvcache.CacheLayout):
        super().__init__(placement, config, spans)
        self.mesh = devices.mesh_for(placement)
        self.tp = tensor_parallel.tensor_split(placement, self.mesh)
        tensor_parallel.check_cache(layout, self.tp)

    def load(self, file) -> dict:
        """Each device's part, read and laid out for its kernels."""
        return tensor_parallel.load(file, self.config, self.placement, self.mesh, self.spans)

    def new_cache(self, layout):
        return jax.jit(kvcache.init_cache, static_argnums=0,
                       out_shardings=tensor_parallel.cache_shardings(layout, self.tp))(layout)

    def compile(self, weights, layout, B, T, plan, decode=None):
        sh = devices.replicated(self.mesh)
        cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), _cache_shapes(layout),
                             tensor_parallel.cache_shardings(layout, self.tp))
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=sh)
        if decode is not None:  # the decode loop inside the shard_map (mesh.decode)
            chunk, sampling = decode
            options = self._decode_options(plan)  # before the lowering, as compile_step's
            rows = dict(sampling).get("rows", False)
            key = jax.ShapeDtypeStruct(((B,) if rows else ()) + _KEY_DATA.shape, _KEY_DATA.dtype, sharding=sh)
            if rows and "bucket" in dict(sampling):  # (keys, each row's setting: sampling.row_params)
                key = (key, row_params_shapes(B, sh))
            lowered = compile_cache.lower(tensor_parallel.decode(), weights, cache, i32((B,)), i32((B,)), i32(()),
                                          key, cfg=self.config, plan=plan, layout=layout, chunk=chunk,
                                          sampling=sampling)
            return lowered.compile(options)
        options = gpu_options(plan, False, self.on_gpu)
        return compile_cache.lower(tensor_parallel.step(), weights, cache, i32((B, T)), i32((B,)), i32((B,)),
                                   cfg=self.config, plan=plan, layout=layout).compile(options)

    def _decode_options(self, plan) -> dict | None:
        """XLA options of the decode loop: on GPUs the one-device loop's command buffers, whose
        WHILE capture cannot hold a loop with collectives in it (the segments between them become
        graphs); IKJAX_MESH_GRAPH=1 adds the collectives (NCCL kernels captured in the graph), so
        the loop may become one graph as on one device."""
        options = gpu_options(plan, True, self.on_gpu)
        if options is not None and env.choice("IKJAX_MESH_GRAPH") == "1":
            key = "xla_gpu_enable_command_buffer"
            options[key] += ",COLLECTIVES"
        return options

    def run(self, exe, weights, cache, *inputs):
        # the mesh may span other processes' devices: inputs as global arrays (the same values on
        # every process), the replicated logits (or tokens) read from this process's own copy;
        # the decode loop's PRNG key travels as its raw data
        rep = devices.replicated(self.mesh)
        inputs = jax.tree.map(lambda a: jax.random.key_data(a) if _is_key(a) else a, inputs)  # (keys, row settings) too
        out, cache = exe(weights, cache, *jax.tree.map(lambda a: distributed.global_input(a, rep), inputs))
        return distributed.local_value(out), cache


    def collectives(self, exe):
        # from XLA's optimized HLO (mesh.collectives); the text of a big step takes a moment. A
        # count is a report, not part of the run: an executable that cannot print its HLO (a
        # backend without it) reports none
        try:
            text = exe.as_text()
        except Exception as e:  # noqa: BLE001 - any backend's refusal; logged, never fatal
            log.info("-sm graph: no HLO text of a compiled step (%s: %s)", type(e).__name__, e)
            return None
        return tensor_parallel.collectives(text)


def executor_for(placement, config: ModelConfig, spans: tuple, layout: kvcache.CacheLayout) -> Executor:
    """The executor of the placement's split mode (`spans`: the layer groups, ikjax.model.groups;
    `layout`: the batch-1 KV cache, which -sm graph checks against its split before anything loads)."""
    if placement.split_mode == "layer":
        return LayerPipeline(placement, config, spans)
    if placement.split_mode == "graph":
        return GraphMesh(placement, config, spans, layout)
    return SingleDevice(placement, config, spans)


class BackgroundLoad:
    """`load(file, on_shapes=...)` on a thread of its own: `shapes()` waits only for the weight
    tree's ShapeDtypeStructs (the top tensors and each group's first layer in), `result()` for
    the whole tree. Why: a cold start compiled its steps after the load (V2-Lite on an H100: 4.6 s
    of load, then 16.7 s compiling, RESULTS §22); a step needs only the weights' shapes and
    shardings, so it compiles while the bytes stream in. An error of the load is raised by
    whichever of the two is waiting, in the caller's thread, as it was raised."""

    def __init__(self, load: Callable, file):
        self._shapes = self._weights = self._error = None
        self._have_shapes = threading.Event()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(load, file), name="ikjax-load", daemon=True)
        _LOADS.add(self)
        self._thread.start()

    def _run(self, load, file) -> None:
        try:
            self._weights = load(file, on_shapes=self._on_shapes, cancel=self._cancel)
        except BaseException as e:  # handed to the waiting caller, in its thread
            self._error = e
        finally:
            self.finished_at = time.perf_counter()
            self._have_shapes.set()

    def _on_shapes(self, tree) -> None:
        self._shapes = tree
        self._have_shapes.set()

    def shapes_seen(self):
        """The tree `on_shapes` got (None before, or if the load failed first): no waiting."""
        return self._shapes

    def shapes(self):
        self._wait(self._have_shapes.wait)
        if self._shapes is None:
            self.result()  # the load failed before its shapes were known: its error
        return self._shapes

    def _wait(self, wait) -> None:
        """Wait; interrupted (Ctrl-C), stop the load at its next layer first, so no thread is left
        copying into device memory as the interpreter exits."""
        try:
            wait()
        except BaseException:
            self.cancel()
            raise

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop the load at its next layer and wait for its thread (a command that fails while
        the weights load: its error, not a thread still copying as the interpreter exits)."""
        self._cancel.set()
        self._thread.join()

    def result(self):
        self._wait(self._thread.join)
        if self._error is not None:
            raise self._error
        return self._weights


# Loads still streaming when the interpreter exits (a script's error while the weights load): each
# stopped at its next layer and its thread joined first. A daemon thread left inside the runtime's
# copies as the interpreter tears down can end the process in an abort instead of the script's own
# traceback and exit status (seen on a GPU: "terminate called ... FATAL: exception not rethrown").
_LOADS: "weakref.WeakSet[BackgroundLoad]" = weakref.WeakSet()


@atexit.register
def _stop_loads() -> None:
    for load in list(_LOADS):
        if not load.done():
            load.cancel()
