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

from typing import Any, Callable

# runner(name, jitted, args, static) -> jitted(*args, *static)'s outputs
Runner = Callable[[str, Any, tuple, tuple], Any]
_runner: Runner | None = None


def run(name: str, jitted: Any, args: tuple, static: tuple = ()) -> Any:
    """`jitted(*args, *static)`, through the installed runner if there is one. `name` tells the
    program apart in the runner's store; `static` are the jit's static arguments, which come after
    the array arguments `args` in `jitted`'s parameters."""
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
