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
import dataclasses
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
    """Trace-time settings of the kernels: backend override, the CPU kernels' thread count
    (the user's -t for generation steps, -tb for prompt steps; 0 = every core) and the tokens
    per sequence of the step being traced (0: not a model step), which picks the CPU kernels'
    decode or prompt form for every row alike (`decode_groups`)."""
    backend: str | None = None
    threads: int = 0
    seq_tokens: int = 0


_CONTEXT: contextvars.ContextVar[KernelContext] = contextvars.ContextVar("ikjax_kernels", default=KernelContext())
# Per-trace state an op may keep between its calls in one step (the expert streaming keeps the
# previous streamed layer's input: ikjax.ops.moe).
_STREAM: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ikjax_stream", default=None)


@contextlib.contextmanager
def kernel_context(backend: str | None = None, threads: int = 0, seq_tokens: int = 0):
    """Kernel settings for everything traced inside the block (the model sets it per step, with
    `seq_tokens` the T of its [B, T] tokens)."""
    token = _CONTEXT.set(KernelContext(backend, threads, seq_tokens))
    stream = _STREAM.set({})
    try:
        yield
    finally:
        _STREAM.reset(stream)
        _CONTEXT.reset(token)


def forget_model_file(dev: int, inode: int) -> None:
    """The kernels' hold on a model file let go of (`Engine.close`): the C++ row gather keeps one
    descriptor a file it reads rows from (pallas_kernels/embed_rows/cpu_ffi.cc)."""
    _cpu.forget_file(dev, inode)


def cpu_kernel_report() -> str:
    """Which instruction-set level the C++ kernels run at here and why (`ikjax info`): the
    surfaces ask the registry, which owns the kernels, never the kernels themselves."""
    return _cpu.isa_report()


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


def register_native_targets() -> None:
    """Register the XLA FFI targets of the native kernels this build has (the C++ CPU kernels;
    the CUDA host-experts handler where built). Tracing a step registers each on first use; an
    executable loaded whole (ikjax.runtime.compile_cache.load_step) is never traced, and XLA
    refuses to deserialize one whose custom calls have no handler ("No FFI handler registered")."""
    if _cpu.available():
        _cpu.register()
    if jax.default_backend() == "gpu":
        from pallas_kernels.moe_matmul import host as _host
        if _host.available():
            _host.register()


def cpu_isa() -> str:
    """The instruction-set level the C++ kernels run at here (`IKJAX_CPU_ISA` caps it), or "not built"."""
    return _cpu.isa() if _cpu.available() else "not built"


def default_threads() -> int:
    """What `-t 0` means for the C++ kernels: every core this process may run on (its affinity)."""
    return _cpu.available_cores()


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


def softmax_rows(x):
    """Softmax over the last axis; in a batch-invariant decode step (`batch_invariant`) with the
    denominator summed in 32-bit fixed point. Why: on a GPU an XLA reduction's order of additions
    follows the whole shape, batch included (a router's softmax over 64 experts gave a token other
    bits in a batch of 8 than alone, RESULTS §23b); integer sums do not depend on the order. The
    terms are exp(x - max) in (0, 1], so a scale of 2^(31 - ceil(log2 n)) keeps n of them inside
    uint32 and the sum (>= 1: the max's term is 1) within ~n * 2^-32 of the exact one."""
    if not batch_invariant():
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(axis=-1, keepdims=True)))
    n = x.shape[-1]
    scale = float(2 ** (31 - max(0, (n - 1).bit_length())))
    total = jnp.round(e * scale).astype(jnp.uint32).sum(axis=-1, dtype=jnp.uint32).astype(jnp.float32) / scale
    return e / total[..., None]


def sum_rows_small(x):
    """Sum over a short last axis (an MoE token's k weights); in a batch-invariant decode step
    added in order, term by term (elementwise, so the same bits whatever the batch)."""
    if not batch_invariant():
        return x.sum(axis=-1)
    y = x[..., 0]
    for i in range(1, x.shape[-1]):
        y = y + x[..., i]
    return y


def compute(dtype) -> str:
    """The C++ kernels' compute mode for a step dtype."""
    return "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f32"


# The C++ CPU kernels compute products of fewer than 4 activation rows in their decode form (8-bit
# activation blocks with int8 dots at compute=bf16, dequantize-and-dot in f32) and 4 or more in
# their prompt form (packed bf16 / int8 panels): each form gives every row the same bits whatever
# the row count, but the two forms differ (pallas_kernels/quant_matmul/cpu_kernel.cc
# kGemmMinRows; tests/test_batch_consistency.py checks both halves of that).
CPU_DECODE_MAX_ROWS = 3


# The decode step's rows that hold a sequence (an int32 [rows] traced mask), while its layers are traced
_LIVE_ROWS: contextvars.ContextVar = contextvars.ContextVar("ikjax_live_rows", default=None)


@contextlib.contextmanager
def live_rows(mask):
    """Inside a decode step: which of its rows hold a sequence (mask [B], nonzero = live); the
    others are the idle slots of a server's decode batch. Why: in the batch-invariant form each
    row is its own program in every product (`batch_invariant`), so an 8-slot step serving one
    stream ran every product 8 times: one V2-Lite stream decoded at 150 t/s under `serve` against
    368 t/s alone (H200, RESULTS §23i). The row-by-row kernels skip the idle rows (zeros out), and
    the decode attention gives an idle row one key, not its slot's whole cached history."""
    token = _LIVE_ROWS.set(mask)
    try:
        yield
    finally:
        _LIVE_ROWS.reset(token)


def live_rows_mask(n_rows: int):
    """The live-rows mask of the decode step being traced if it covers `n_rows` rows, else None."""
    mask = _LIVE_ROWS.get()
    return mask if mask is not None and mask.shape[0] == n_rows else None


@contextlib.contextmanager
def seq_tokens(t: int):
    """Inside a step, a part traced for `t` tokens per sequence instead of the step's (the last
    layer's FFN of a step that keeps the last token's logits only runs on that token: t = 1, so
    its rows take the decode form, in groups, as that token alone would: `decode_groups`)."""
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), seq_tokens=t))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def decode_groups(n_rows: int) -> list[tuple[int, int]] | None:
    """Row ranges [a, b) to give the CPU kernels separately in a decode step, or None for one call.

    Why: a batched decode must compute each sequence's token as the same sequence alone does
    (generate_batch and a server's continuous batching against generate). Alone, a decode step
    has 1 row per product and the kernels take their decode form; a batch of 4 or more would
    switch the whole product to the prompt form, and an MoE expert picked by 4 or more of the
    batch's tokens likewise. So in a step of fewer than 4 tokens per sequence (`seq_tokens` of
    the kernel context) a product of more rows is cut into groups of at most 3, each in the
    decode form: bit for bit what each row gets alone. Prompt steps (and calls outside a model
    step) are one call."""
    t = _CONTEXT.get().seq_tokens
    if not 0 < t <= CPU_DECODE_MAX_ROWS or n_rows <= CPU_DECODE_MAX_ROWS:
        return None
    return [(a, min(n_rows, a + CPU_DECODE_MAX_ROWS)) for a in range(0, n_rows, CPU_DECODE_MAX_ROWS)]


def decode_step() -> bool:
    """Whether the step being traced has fewer than 4 tokens per sequence (see `decode_groups`)."""
    return 0 < _CONTEXT.get().seq_tokens <= CPU_DECODE_MAX_ROWS


# The largest decode batch (rows of a product) the GPU kernels compute row by row in a decode step
# (`batch_invariant`); a bigger one takes the batch-sized path.
INVARIANT_MAX_ROWS = 64


def batch_invariant() -> bool:
    """Whether the step being traced is a decode step whose GPU kernels compute every row as it is
    computed alone: one-row tiles and splits sized for one sequence (pallas_kernels' pick_config
    `split_rows` / `split_batch`), sums over a few terms as products and reductions rather than
    batched dots (whose algorithm XLA picks by the shape), the router as one reduction per
    (token, expert). Why: a server's greedy answer must equal `generate`'s for the same prompt
    alone, and a batch's rounding differing in the last bit is enough to flip a near-tie. The CPU
    kernels get the same property from `decode_groups`, always. On a GPU it is IKJAX_BATCH_INVARIANT=1,
    which `serve` sets by default: with the RMSNorm one row per program (ikjax.ops.norm) and the
    prompt's MoE sums in a fixed order, a whole [8, 1] step's row equals the row alone bit for bit,
    and greedy answers equal `generate`'s (H200, RESULTS §23c); the form costs ~8 % of S_TG at
    batch 1, so the one-sequence commands keep the faster kernels."""
    # the GPU kernels' form (and theirs in interpret mode, for tests): the CPU path is invariant already
    return decode_step() and env.choice("IKJAX_BATCH_INVARIANT") == "1" and resolve_backend() in ("pallas", "interpret")


def invariant_matrix_unit() -> bool:
    """Whether the batch-invariant decode's dense and per-head products take the matrix-unit
    schedule (IKJAX_INVARIANT_FORM=dot; pallas_kernels' invariant_config) rather than a program
    per row: eight rows for about the price of one, one row ~1.5x the row kernel's (RESULTS §23l)."""
    return env.choice("IKJAX_INVARIANT_FORM") == "dot"


def rows(x) -> int:
    """Rows of x: the product of every dim but the last."""
    n = 1
    for s_ in x.shape[:-1]:
        n *= s_
    return n
