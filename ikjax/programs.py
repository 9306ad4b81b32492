"""One hook for the small programs a model load runs (the kernels' repacks, a layer group's stacks
and fused rows), so that the runtime can keep them compiled whole between runs.

Why: JAX's persistent cache keys an executable by its lowered module, so every process traces and
lowers each of these programs again before the cache can answer, about 0.1-0.2 s each on an H200's
host; a warm V2-Lite load spent ~0.8 s of its 1.7 s there (RESULTS §22n's timeline: the repacks
0.55 s, the stacks' zeros 0.25 s), and a warm run's first row waits for the load. The runtime
already keeps steps whole, keyed without tracing (ikjax.runtime.compile_cache); the load sits below
the runtime in the package's layers (model, ops, and pallas_kernels' packing), so the runtime
installs its runner here (`install`), and without one a program is the jitted call it always was.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

# runner(name, jitted, args, static) -> jitted(*args, *static)'s outputs
Runner = Callable[[str, Any, tuple, tuple], Any]
_runner: Runner | None = None
# set (in this thread) by `abstract()`: programs give their outputs' ShapeDtypeStructs only
_abstract = contextvars.ContextVar("ikjax_programs_abstract", default=False)
# set (in this thread) by `recording()`: the calls `abstract()` traced, in order
_recorded = contextvars.ContextVar("ikjax_programs_recorded", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Within (in this thread only), each program traced under `abstract()` is appended to the
    list given as (name, jitted, args as ShapeDtypeStructs, static): the programs a real load will
    run, known before it runs them, so that the runtime can compile them side by side ahead of it
    (ikjax.runtime.compile_cache.precompile_programs)."""
    calls: list = []
    token = _recorded.set(calls)
    try:
        yield calls
    finally:
        _recorded.reset(token)


@contextlib.contextmanager
def abstract() -> Iterator[None]:
    """Within (in this thread only), `run` computes nothing: each program gives its outputs as
    ShapeDtypeStructs (traced, never compiled), on the device of its inputs where it names none.
    For a load run on shapes alone (ikjax.model.weights.load_weights(shapes_only=True)): a cold
    start's steps compile from the weights' shapes, which a real load knows only after its first
    programs compiled (2.1 s of an H200 cold start, RESULTS §22p)."""
    token = _abstract.set(True)
    try:
        yield
    finally:
        _abstract.reset(token)


def is_abstract() -> bool:
    """Whether this thread is inside `abstract()`."""
    return _abstract.get()


def _shapes_of(jitted: Any, args: tuple, static: tuple) -> Any:
    import jax
    out = jitted.trace(*args, *static).out_info
    shardings = {s for a in jax.tree.leaves(args) if (s := getattr(a, "sharding", None)) is not None}
    common = next(iter(shardings)) if len(shardings) == 1 else None

    def placed(o):
        return o if getattr(o, "sharding", None) is not None else jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=common)
    return jax.tree.map(placed, out)


def run(name: str, jitted: Any, args: tuple, static: tuple = ()) -> Any:
    """`jitted(*args, *static)`, through the installed runner if there is one. `name` tells the
    program apart in the runner's store; `static` are the jit's static arguments, which come after
    the array arguments `args` in `jitted`'s parameters. Inside `abstract()`: the outputs'
    ShapeDtypeStructs."""
    if _abstract.get():
        calls = _recorded.get()
        if calls is not None:
            calls.append((name, jitted, args, static))
        return _shapes_of(jitted, args, static)
    r = _runner
    if r is None:
        return jitted(*args, *static)
    return r(name, jitted, args, static)


def runner(name: str) -> Callable[[Any, tuple, tuple], Any]:
    """`run` with the name bound: what a caller below ikjax (pallas_kernels' packing) is handed."""
    return lambda jitted, args, static=(): run(name, jitted, args, static)


def install(new: Runner | None) -> Runner | None:
    """Make `new` the runner (None: none); the one it replaces."""
    global _runner
    old, _runner = _runner, new
    return old
