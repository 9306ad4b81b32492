"""The op registry: which implementation runs each op, and the trace-time settings they share.

The model calls only the ops of this package (`ikjax.ops.*`), never a backend directly.

Each op (`quant_linear`, `moe_experts`, `mla_attention`) has implementations

- `xla`: the plain-jnp reference (pallas_kernels/<op>/reference.py), which covers every type and
  shape on every platform;
- `pallas`: the Pallas GPU kernels (`interpret` runs them in interpret mode anywhere, for tests);
- `cpu`: the C++ kernels reached through XLA FFI custom calls (pallas_kernels/<op>/cpu.py),

each with a `supported(...)` check. Choice per call: the `backend=` argument, else the trace-time
context (`kernel_context(...)`, set by the model from the run options), else `IKJAX_KERNELS`
(`auto | xla | pallas | cpu | interpret`; `jnp` is an old name of `xla`), else `auto`: `pallas` on
a GPU, `cpu` on a CPU. An implementation that does not support a call's type or shape hands
that call to `xla` (the reference covers everything); `selected()` says which one ran, and the
CPU path's coverage of every type the issue names is tested, so this is a documented rule, not
a silent fallback. Rules that pick between forms of one op (gather vs grouped MoE; Pallas only for
decode-sized products under `auto`) are written once, in the op's module.

The layout follows openxla/tokamax: this module is the shared `api` (backend resolution, the
`Impl` table each op dispatches through, which one ran); each op family is one module beside it
(`embed`, `quant_matmul`, `moe`, `attention`, `ffn`) holding its XLA reference or naming it in
pallas_kernels/<op>/reference.py, and the kernels themselves live in pallas_kernels/<op>/.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from ikjax import env
from ikjax.errors import OptionError
from pallas_kernels import cpu as _cpu

BACKENDS = ("auto", "xla", "pallas", "cpu", "interpret")
_ALIASES = {"jnp": "xla"}


# -- which implementation ------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelContext:
    """Trace-time settings of the kernels: backend override and the CPU kernels' thread count
    (the user's -t for generation steps, -tb for prompt steps; 0 = every core)."""
    backend: str | None = None
    threads: int = 0


_CONTEXT: contextvars.ContextVar[KernelContext] = contextvars.ContextVar("ikjax_kernels", default=KernelContext())
# Per-trace state an op may keep between its calls in one step (the expert streaming keeps the
# previous streamed layer's input: ikjax.ops.moe).
_STREAM: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ikjax_stream", default=None)


@contextlib.contextmanager
def kernel_context(backend: str | None = None, threads: int = 0):
    """Kernel settings for everything traced inside the block (the model sets it per step)."""
    token = _CONTEXT.set(KernelContext(backend, threads))
    stream = _STREAM.set({})
    try:
        yield
    finally:
        _STREAM.reset(stream)
        _CONTEXT.reset(token)


_warned_no_cpu = False


def resolve_backend(backend: str | None = None) -> str:
    """-> 'xla' | 'pallas' | 'interpret' | 'cpu' for this call."""
    b = (backend or _CONTEXT.get().backend or env.choice("IKJAX_KERNELS"))
    b = _ALIASES.get(b, b)
    if b not in BACKENDS:
        raise OptionError(f"IKJAX_KERNELS/backend must be one of {', '.join(BACKENDS)}, got {b!r}")
    if b == "auto":
        platform = jax.default_backend()
        if platform == "gpu":
            return "pallas"
        if platform == "cpu" and _cpu.available():
            return "cpu"
        if platform == "cpu":
            global _warned_no_cpu
            if not _warned_no_cpu:
                _warned_no_cpu = True
                print(f"ikjax: {_cpu.unavailable_reason()}; running the XLA path", file=sys.stderr)
        return "xla"
    if b == "cpu" and not _cpu.available():
        raise OptionError(f"IKJAX_KERNELS=cpu: {_cpu.unavailable_reason()}")
    return b


def threads() -> int:
    """The CPU kernels' thread count of the step being traced (0 = every core)."""
    return _CONTEXT.get().threads


# Which implementation served the last trace of each op (tests and `bench` read it).
_SELECTED: dict[str, str] = {}


def selected(op: str) -> str | None:
    return _SELECTED.get(op)


def ran(op: str, impl: str) -> None:
    _SELECTED[op] = impl


@dataclass(frozen=True)
class Impl:
    supported: Callable[..., bool]
    run: Callable


def dispatch(op: str, impls: dict[str, Impl], backend: str, *args):
    impl = impls.get(backend)
    name = backend if impl is not None and impl.supported(*args) else "xla"
    ran(op, name)
    return impls[name].run(*args)



def trace_state() -> dict | None:
    """The dict an op may keep state in for the rest of the step being traced (None outside
    `kernel_context`)."""
    return _STREAM.get()


def auto_backend() -> bool:
    """Whether nothing overrides `auto` for the call being traced (no per-step backend, IKJAX_KERNELS
    auto): `auto` picks forms by size (e.g. the Pallas matmul only for decode-sized products)."""
    return _CONTEXT.get().backend is None and env.choice("IKJAX_KERNELS") == "auto"


def auto_dtype() -> str:
    """What `dtype="auto"` means: `IKJAX_DTYPE` if set, else bf16 products where kernels run them
    (Pallas on a GPU; the C++ kernels on a CPU: prompt-sized products in bf16 with f32 sums, and
    decode-sized products on 8-bit activation blocks with int8 dot products, as ik runs its CPU
    matmuls; K-quant types decode in f32 there),
    and f32 on the XLA reference path, whose bf16 dots on a CPU are slower than its f32 ones."""
    return env.choice("IKJAX_DTYPE") or ("f32" if resolve_backend() == "xla" else "bf16")


# -- numerics every implementation shares --------------------------------------------------------

HIGHEST = jax.lax.Precision.HIGHEST


def precision_for(dtype):
    """f32 compute means true f32 matmuls (no TF32 on GPU); lower dtypes use the default."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def compute(dtype) -> str:
    """The C++ kernels' compute mode for a step dtype."""
    return "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f32"


def rows(x) -> int:
    """Rows of x: the product of every dim but the last."""
    n = 1
    for s_ in x.shape[:-1]:
        n *= s_
    return n
