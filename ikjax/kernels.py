"""One registry per kernel op: the model calls only these, never a backend directly.

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
decode-sized products under `auto`) are written here, once.

Weights: the Pallas kernels read a planar repacking of the GGUF blocks (`PackedWeight`) made once
at load with `prepare_weight(qa)`; the C++ kernels read the GGUF blocks as stored.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from ikjax.errors import OptionError
from ikjax.host_weights import is_host_resident
from ikjax.options import env_choice
from ikjax.quant.array import QuantArray
from pallas_kernels import cpu as _cpu
from pallas_kernels.quant_matmul import packing as _qm_packing
from pallas_kernels.quant_matmul.packing import PackedWeight, prepare as _prepare
from pallas_kernels.quant_matmul.reference import quant_matmul_ref
from pallas_kernels.quant_matmul import kernel as _qm
from pallas_kernels.quant_matmul import cpu as _qm_cpu
from pallas_kernels.moe_matmul import cpu as _moe_cpu_mod
from pallas_kernels.embed_rows import cpu as _embed_cpu_mod
from pallas_kernels.mla_decode import cpu as _mla_cpu_mod
from pallas_kernels.moe_matmul.reference import moe_experts_ref, moe_experts_grouped_ref
from pallas_kernels.moe_matmul import kernel as _moe
from pallas_kernels.mla_decode.reference import mla_decode_ref
from pallas_kernels.mla_decode import kernel as _mla

BACKENDS = ("auto", "xla", "pallas", "cpu", "interpret")
_ALIASES = {"jnp": "xla"}
__all__ = ["BACKENDS", "resolve_backend", "kernel_context", "prepare_weight", "quant_linear", "head_linear",
           "moe_experts",
           "mla_decode_supported", "mla_decode_attention", "PackedWeight", "selected"]


# -- which implementation ------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelContext:
    """Trace-time settings of the kernels: backend override and the CPU kernels' thread count
    (the user's -t for generation steps, -tb for prompt steps; 0 = every core)."""
    backend: str | None = None
    threads: int = 0


_CONTEXT: contextvars.ContextVar[KernelContext] = contextvars.ContextVar("ikjax_kernels", default=KernelContext())
# Per-trace state of the expert streaming (`_moe_stream`): the previous streamed layer's input.
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
    b = (backend or _CONTEXT.get().backend or os.environ.get("IKJAX_KERNELS", "auto")).lower()
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


def _threads() -> int:
    return _CONTEXT.get().threads


# Which implementation served the last trace of each op (tests and `bench` read it).
_SELECTED: dict[str, str] = {}


def selected(op: str) -> str | None:
    return _SELECTED.get(op)


def _ran(op: str, impl: str) -> None:
    _SELECTED[op] = impl


@dataclass(frozen=True)
class Impl:
    supported: Callable[..., bool]
    run: Callable


def _dispatch(op: str, impls: dict[str, Impl], backend: str, *args):
    impl = impls.get(backend)
    name = backend if impl is not None and impl.supported(*args) else "xla"
    _ran(op, name)
    return impls[name].run(*args)


# -- embedding rows -------------------------------------------------------------------------------

def _embed_rows_cpu_supported(table, tokens) -> bool:
    return _embed_cpu_mod.supported(table, tokens)


def embed_rows(table, tokens, backend: str | None = None):
    """The GGUF blocks of the token ids' rows, u8 [V, R] -> [..., R] (`table[tokens]`). On CPU the
    C++ op reads them from the file (pread) instead of through the mapping, which would map the
    ~64 KiB of page cache around each row into the process (RESULTS §9e: 73-108 MiB of a sweep's
    peak RSS)."""
    impls = {
        "xla": Impl(lambda *a: True, lambda t, i: t[i]),
        "cpu": Impl(_embed_rows_cpu_supported, _embed_cpu_mod.embed_rows),
    }
    return _dispatch("embed_rows", impls, resolve_backend(backend), table, tokens)


# -- weights --------------------------------------------------------------------------------------

def prepare_weight(qa):
    """Load-time repack for the Pallas kernels; returns `qa` unchanged when its type has no kernel layout."""
    if isinstance(qa, PackedWeight) or not isinstance(qa, QuantArray):
        return qa
    if not _qm_packing.supported(qa.qtype.name):
        return qa
    G, P, L, R = _qm_packing.GEOMETRY[qa.qtype.name]
    if qa.shape[-1] % (G * R):
        return qa
    return _prepare(qa)


def needs_repack(backend: str | None = None) -> bool:
    """Whether weights should be repacked at load (only the Pallas kernels read a repacked layout)."""
    return resolve_backend(backend) in ("pallas", "interpret")


def _packed(w):
    if isinstance(w, PackedWeight):
        return w
    warnings.warn(f"ikjax.kernels: repacking {w!r} inside the step; call prepare_weight() at load",
                  stacklevel=3)
    return _prepare(w)


def _pallas_ok(w) -> bool:
    name = w.qtype if isinstance(w, PackedWeight) else w.qtype.name
    return _qm.kernel_supports(name, w.shape[-2], w.shape[-1])


def _cpu_ok(w) -> bool:
    return isinstance(w, QuantArray) and _qm_cpu.supported(w.qtype.name)


def _compute(dtype) -> str:
    return "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f32"


def _rows(x) -> int:
    rows = 1
    for s_ in x.shape[:-1]:
        rows *= s_
    return rows


# -- quantized matmul -----------------------------------------------------------------------------

# Under `auto`, the Pallas matmul serves decode (up to this many rows of x); larger batches
# (prompt processing) take XLA's dequantize-then-cuBLAS path, measured faster there (bench/RESULTS.md).
AUTO_MAX_ROWS = 4


def _qm_pallas_supported(auto: bool):
    def supported(x, w, dtype) -> bool:
        rows = _rows(x)
        if auto and rows > AUTO_MAX_ROWS:
            return False
        if rows > AUTO_MAX_ROWS and jnp.dtype(dtype) == jnp.float32:  # no TF32 in f32 mode
            return False
        return _pallas_ok(w)
    return supported


def _qm_cpu_supported(x, w, dtype) -> bool:
    return _cpu_ok(w) and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def _qm_cpu_run(x, w, dtype):
    return _qm_cpu.quant_matmul(x, w, n_threads=_threads(), compute=_compute(dtype))


def quant_linear(x, w, dtype, *, backend: str | None = None):
    """x [..., K] @ W[N, K]^T (W QuantArray or PackedWeight), computed in `dtype`, f32 result."""
    b = resolve_backend(backend)
    auto = backend is None and _CONTEXT.get().backend is None and os.environ.get("IKJAX_KERNELS", "auto") == "auto"
    impls = {
        "xla": Impl(lambda *a: True, quant_matmul_ref),
        "pallas": Impl(_qm_pallas_supported(auto), lambda x, w, d: _qm.quant_matmul(x, _packed(w), d)),
        "interpret": Impl(_qm_pallas_supported(False),
                          lambda x, w, d: _qm.quant_matmul(x, _packed(w), d, interpret=True)),
        "cpu": Impl(_qm_cpu_supported, _qm_cpu_run),
    }
    return _dispatch("quant_linear", impls, b, x, w, dtype)


# -- per-head products (MLA's absorbed W_kb / W_vb) ----------------------------------------------------

def _heads_xla(x, w, dtype):
    prec = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
    return jnp.einsum("...hk,hnk->...hn", x.astype(dtype), w.dequantize(dtype), precision=prec,
                      preferred_element_type=jnp.float32)


def _heads_cpu_supported(x, w, dtype) -> bool:
    return _cpu_ok(w) and len(w.shape) == 3 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def head_linear(x, w, dtype, *, backend: str | None = None):
    """Per-head products y[..., h, :] = x[..., h, :] @ W[h]^T: x [..., H, K], W [H, N, K] -> [..., H, N]
    float32 (MLA's absorbed form: q_lat = W_kb q_nope and o = W_vb o_lat, head by head)."""
    impls = {
        "xla": Impl(lambda *a: True, _heads_xla),
        "cpu": Impl(_heads_cpu_supported,
                    lambda x, w, d: _qm_cpu.quant_matmul_heads(x, w, n_threads=_threads(), compute=_compute(d))),
    }
    return _dispatch("head_linear", impls, resolve_backend(backend), x, w, dtype)


# -- routed experts -------------------------------------------------------------------------------

def gather_form(n_tokens: int, n_used: int, n_expert: int) -> bool:
    """Few tokens: gather the selected experts' blocks (bytes grow with tokens x experts used);
    many tokens: group assignments by expert and read every expert once. The one place this rule lives."""
    return n_tokens * n_used <= 2 * n_expert


def _moe_xla(x, weights, ids, gate, up, down, dtype, fused=True):
    fn = moe_experts_ref if gather_form(ids.shape[0], ids.shape[1], gate.shape[0]) else moe_experts_grouped_ref
    return fn(x, weights, ids, gate, up, down, dtype, fused=fused)


def _moe_pallas_supported(x, weights, ids, gate, up, down, dtype, fused=True) -> bool:
    # f32 compute is the exact reference mode: the grouped kernel's tile products (tl.dot) would
    # round through TF32, so prompt-sized f32 work stays on XLA's HIGHEST-precision path
    if not gather_form(ids.shape[0], ids.shape[1], gate.shape[0]) and jnp.dtype(dtype) == jnp.float32:
        return False
    return all(_pallas_ok(t) for t in (gate, up, down))


def _moe_pallas(interpret: bool):
    def run(x, weights, ids, gate, up, down, dtype, fused=True):
        return _moe.moe_experts(x, weights, ids, _packed(gate), _packed(up), _packed(down), dtype,
                                interpret=interpret)
    return run


def _moe_cpu_supported(x, weights, ids, gate, up, down, dtype, fused=True) -> bool:
    return jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16) and _moe_cpu_mod.supported(gate, up, down)


def _moe_cpu(x, weights, ids, gate, up, down, dtype, fused=True):
    return _moe_cpu_mod.moe_experts(x, weights, ids, gate, up, down, n_threads=_threads(), compute=_compute(dtype))


def _moe_host(x, weights, ids, gate, up, down, dtype):
    """Experts kept in host RAM next to a GPU (HostQuantArray), small batches: the host CPU computes
    them from the GPU step (pallas_kernels/moe_matmul/host.py), whatever the backend override says —
    no other implementation may read them in place (each would copy the whole tensors to the
    device). Big batches stream them instead (`_moe_stream`)."""
    from pallas_kernels.moe_matmul import host as moe_host
    if jax.default_backend() != "gpu":
        raise OptionError(f"ot: routed experts in host memory next to an accelerator need a CUDA GPU, "
                          f"the backend is {jax.default_backend()}")
    if not moe_host.supported(gate, up, down):
        why = moe_host.unavailable_reason() or (f"no host path for {gate.qtype.name}/{up.qtype.name}/"
                                                f"{down.qtype.name} experts of shape {tuple(gate.shape)}")
        raise OptionError(f"ot: routed experts in host memory: {why}")
    _ran("moe_experts", "host")
    return moe_host.moe_experts(x, weights, ids, gate, up, down, n_threads=_threads(), compute=_compute(dtype))


# IKJAX_STREAM_ORDER: when a streamed layer's host-to-device copy may start. "prev" (default): once
# the previous streamed layer's MoE input exists, so layer i's experts cross PCIe while layer i-1's
# experts and layer i's attention compute, and the device holds at most two layers' experts;
# "self": once its own MoE input exists (no overlap, one layer held); "free": whenever XLA's
# scheduler likes (it may start every layer's copy at once: a full copy on the device).
STREAM_ORDERS = ("prev", "self", "free")


def _stream_order() -> str:
    return env_choice("IKJAX_STREAM_ORDER", STREAM_ORDERS, "prev")


# IKJAX_STREAM: how a big batch moves host-resident experts to the GPU. "active" (default, ik's
# -ooae): only the experts the batch routes to, in rounds of IKJAX_STREAM_MIB (512) MiB of blocks;
# "layer": every expert of the layer, the whole tensors in one host-to-device transfer.
STREAM_MODES = ("active", "layer")


def _stream_mode() -> str:
    return env_choice("IKJAX_STREAM", STREAM_MODES, "active")


def stream_slots(gate, up, down) -> int:
    """Experts per streaming round: as many as fit IKJAX_STREAM_MIB MiB of raw blocks (at least
    one, at most all): the device holds one round's blocks (and their kernel layout) at a time."""
    return stream_slots_for(sum(t.nbytes for t in (gate, up, down)) // gate.shape[0], gate.shape[0])


def stream_slots_for(per_expert_bytes: int, n_expert: int) -> int:
    """`stream_slots` from one expert's bytes (gate + up + down) and the expert count (the memory
    plan's use, before anything is loaded)."""
    raw = os.environ.get("IKJAX_STREAM_MIB", "512")
    try:
        mib = float(raw)
    except ValueError:
        mib = 0.0
    if not mib > 0:
        raise OptionError(f"IKJAX_STREAM_MIB must be a positive number of MiB, got {raw!r}")
    return max(1, min(n_expert, int(mib * 2**20 // max(per_expert_bytes, 1))))


def _streamed(blocks, t, shape, backend: str):
    """Expert blocks that reached the device inside a step, laid out as the load would lay out
    device-resident ones for `backend` (the Pallas repack), as a QuantArray of `t`'s type."""
    qa = QuantArray(blocks, t.qtype, shape)
    return prepare_weight(qa) if backend in ("pallas", "interpret") else qa


def moe_rounds(x, weights, ids, gate, up, down, dtype, *, fetch, slots: int, fused: bool = True,
               backend: str | None = None):
    """Routed experts computed in rounds of at most `slots` experts on the device: `fetch(weights,
    ids, round)` -> (gate, up, down blocks [slots, rows, row_bytes], slot_of [E]) brings a round's
    experts (host_experts.stream_experts, or its jnp reference); each round's MoE sees only its
    experts (the others' weights zeroed: no work in the kernels), and the rounds' outputs add up.

    Round 0 always runs; round r > 0 only if the batch routes to more than r * slots experts
    (`lax.cond`: a batch that uses few experts pays for one round's copy, layout and kernel, not
    for every expert's). Each round waits for the previous round's output, so XLA cannot start
    every round's copy at once (the device would hold all of them)."""
    E = gate.shape[0]
    b = resolve_backend(backend)
    n_active = jnp.zeros((E,), bool).at[ids.reshape(-1)].max(weights.reshape(-1) != 0).sum()

    def one_round(r, weights, ids):
        *blocks, slot_of = fetch(weights, ids, r)
        s = slot_of[ids]
        keep = s >= 0
        if b not in ("pallas", "interpret"):
            # the XLA forms may multiply every slot's weights (by zero); unfilled slots hold
            # arbitrary bytes, so they are zeroed there (the kernels never read them)
            filled = jnp.zeros((slots,), bool).at[jnp.where(slot_of >= 0, slot_of, slots)].set(True, mode="drop")
            blocks = [jnp.where(filled[:, None, None], blk, jnp.zeros((), blk.dtype)) for blk in blocks]
        dev = [_streamed(blk, t, (slots, *t.shape[1:]), b) for t, blk in zip((gate, up, down), blocks)]
        return moe_experts(x, jnp.where(keep, weights, 0.0), jnp.where(keep, s, 0), *dev, dtype, fused=fused,
                           backend=backend)

    out = one_round(0, weights, ids)
    for r in range(1, -(-E // slots)):
        weights, ids, _ = jax.lax.optimization_barrier((weights, ids, out))
        part = jax.lax.cond(n_active > r * slots, functools.partial(one_round, r),
                            lambda w, i: jnp.zeros_like(out), weights, ids)
        out = out + part
    return out


def _moe_stream(x, weights, ids, gate, up, down, dtype, fused, backend):
    """Host-resident (pinned) experts, big batches (ik's rule, `HostQuantArray.runs_on`): the GPU
    implementation the all-GPU run would pick computes them after they cross PCIe inside the step.
    IKJAX_STREAM=active (default): only the experts this batch routes to, a round at a time
    (`moe_rounds` + the `ikjax_stream_experts` custom call, which waits for the ids); =layer: the
    whole layer's tensors, whose copy may start when `IKJAX_STREAM_ORDER` says (an optimization
    barrier ties the host parameter to an earlier activation, so the transfer cannot be hoisted to
    the start of the step); XLA frees them after the layer."""
    if _stream_mode() == "active":
        from pallas_kernels.moe_matmul import host as moe_host
        if not moe_host.stream_supported(gate, up, down):
            raise OptionError(f"ot: streaming host experts to the GPU: "
                              f"{moe_host.unavailable_reason() or 'the experts have no host address'}")
        slots = stream_slots(gate, up, down)
        fetch = functools.partial(_fetch_active, gate=gate, up=up, down=down, slots=slots)
        out = moe_rounds(x, weights, ids, gate, up, down, dtype, fetch=fetch, slots=slots, fused=fused,
                         backend=backend)
        _ran("moe_experts", "stream:" + selected("moe_experts"))
        return out
    order, state = _stream_order(), _STREAM.get()
    dep = x if order == "self" else (state or {}).get("prev") if order == "prev" else None
    data = tuple(t.data for t in (gate, up, down))
    if dep is not None:
        *data, _ = jax.lax.optimization_barrier((*data, dep))
    if state is not None:
        state["prev"] = x
    b = resolve_backend(backend)
    dev = [_streamed(jax.device_put(d, jax.memory.Space.Device), t, t.shape, b) for t, d in zip((gate, up, down), data)]
    out = moe_experts(x, weights, ids, *dev, dtype, fused=fused, backend=backend)
    _ran("moe_experts", "stream:" + selected("moe_experts"))
    return out


def _fetch_active(weights, ids, r, *, gate, up, down, slots):
    from pallas_kernels.moe_matmul import host as moe_host
    return moe_host.stream_experts(weights, ids, gate, up, down, slots=slots, round=r)


def moe_experts(x, weights, ids, gate, up, down, dtype, *, fused: bool = True, backend: str | None = None):
    """Routed experts of N tokens: sum_j weights[n,j] * down_e(silu(gate_e x) * up_e x), e = ids[n,j].
    The kernels always fuse gate and up; `fused` only changes the XLA form (ik's -fmoe).
    Host-resident experts (`-ot exps=CPU` next to a GPU) take the `host` implementation, or, for a
    batch where `ikjax.placement.runs_on` says "device" and the experts are pinned, `stream:<impl>`."""
    if any(is_host_resident(t) for t in (gate, up, down)):
        N, k = ids.shape
        if all(is_host_resident(t) and t.streamable and t.runs_on(N, gate.shape[0], k) == "device"
               for t in (gate, up, down)):
            return _moe_stream(x, weights, ids, gate, up, down, dtype, fused, backend)
        return _moe_host(x, weights, ids, gate, up, down, dtype)
    impls = {
        "xla": Impl(lambda *a: True, _moe_xla),
        "pallas": Impl(_moe_pallas_supported, _moe_pallas(False)),
        "interpret": Impl(_moe_pallas_supported, _moe_pallas(True)),
        "cpu": Impl(_moe_cpu_supported, _moe_cpu),
    }
    return _dispatch("moe_experts", impls, resolve_backend(backend), x, weights, ids, gate, up, down, dtype, fused)


# -- MLA attention on the latent cache --------------------------------------------------------------

def mla_decode_supported(n_head: int, n_kv: int, width: int, v_dim: int, backend: str | None = None) -> bool:
    """Whether the decode kernel of the resolved backend takes this geometry and reads each sequence
    only up to its own length (so decode steps can share one KV bucket)."""
    b = resolve_backend(backend)
    if b == "cpu":  # the C++ kernel takes any geometry with v_dim <= width (it reads the cache as stored)
        return _cpu.available() and 1 <= v_dim <= width
    if b in ("pallas", "interpret"):
        return _mla.supports(_heads_padded(n_head), n_kv, width, v_dim)
    return False


def _heads_padded(n_head: int) -> int:
    """The Pallas decode kernel works on blocks of 16 heads (its dot tiles): fewer heads (a device's
    share under -sm graph, e.g. 16 / 4) are padded with zero queries, which cost no cache reads
    (the cache rows are read once per head block) and whose outputs are dropped."""
    return -(-n_head // 16) * 16


def _mla_xla(q, cache, lengths, scale, v_dim, dtype):
    return mla_decode_ref(q, cache, lengths, scale, v_dim=v_dim, dtype=dtype)


def _mla_pallas_supported(q, cache, lengths, scale, v_dim, dtype) -> bool:
    B, H, D = q.shape
    S = (cache["q"] if isinstance(cache, dict) else cache).shape[1]
    return _mla.supports(_heads_padded(H), S, D, v_dim)


def _mla_pallas(interpret: bool):
    def run(q, cache, lengths, scale, v_dim, dtype):
        H = q.shape[1]
        pad = _heads_padded(H) - H
        if pad:
            q = jnp.pad(q, ((0, 0), (0, pad), (0, 0)))
        out = _mla.mla_decode(q, cache, lengths, scale, v_dim=v_dim, dtype=dtype, interpret=interpret)
        return out[:, :H] if pad else out
    return run


def _mla_cpu_supported(q, cache, lengths, scale, v_dim, dtype) -> bool:
    return _mla_cpu_mod.supported(q.shape, cache, v_dim)


def _mla_cpu(q, cache, lengths, scale, v_dim, dtype):
    return _mla_cpu_mod.mla_decode(q, cache, lengths, scale, v_dim=v_dim, n_threads=_threads())


def mla_decode_attention(q, cache, lengths, scale, *, v_dim: int = 512, dtype=jnp.bfloat16,
                         backend: str | None = None):
    """Absorbed-MLA decode: one query per sequence over latent cache entries 0..lengths[b]-1."""
    impls = {
        "xla": Impl(lambda *a: True, _mla_xla),
        "pallas": Impl(_mla_pallas_supported, _mla_pallas(False)),
        "interpret": Impl(_mla_pallas_supported, _mla_pallas(True)),
        "cpu": Impl(_mla_cpu_supported, _mla_cpu),
    }
    return _dispatch("mla_decode", impls, resolve_backend(backend), q, cache, lengths, scale, v_dim, dtype)


def mla_prompt_supported(q_shape, cache, v_dim: int, backend: str | None = None) -> bool:
    """Whether absorbed attention for prompt steps (T > 1) has a kernel on this backend (CPU only)."""
    if resolve_backend(backend) != "cpu":
        return False
    return _mla_cpu_mod.supported(q_shape, cache, v_dim)


def mla_prompt_attention(q, cache, q_pos, scale, *, v_dim: int, backend: str | None = None):
    """Absorbed MLA over the latent cache for T queries at positions q_pos [B, T] (causal by position);
    only keys up to each query's position are read. q [B, T, H, D] -> [B, T, H, v_dim] float32."""
    _ran("mla_prompt", "cpu")
    return _mla_cpu_mod.mla_attention(q, cache, q_pos, scale, v_dim=v_dim, n_threads=_threads())


# -- attention over decompressed keys and values ------------------------------------------------

def _attend_xla(q, k, v, q_pos, scale, flash, amb_bytes, kv_block):
    from ikjax.model.attention import attend  # the model's jnp form (it imports this module)
    return attend(q, k, v, q_pos, scale, flash=flash, amb_bytes=amb_bytes, kv_block=kv_block)


def _attend_cpu_supported(q, k, v, q_pos, scale, flash, amb_bytes, kv_block) -> bool:
    # flash only: without -fa the user asked for materialized scores in -amb chunks (ik's
    # non-FA path), which the XLA form is
    return flash and _mla_cpu_mod.attention_supported(q.shape, k, v)


def _attend_cpu(q, k, v, q_pos, scale, flash, amb_bytes, kv_block):
    return _mla_cpu_mod.attention(q, k, v, q_pos, scale, n_threads=_threads())


def attention(q, k, v, q_pos, scale, *, flash: bool, amb_bytes: int = 0, kv_block: int = 256,
              backend: str | None = None):
    """Causal attention over keys and values of their own: q [B, T, H, D], k [B, S, Hk, D], v [B, S,
    Hk, Dv] (Hk = 1 or H), the query at position p seeing keys 0..p -> [B, T, H, Dv] float32. The
    `-mla 0/2/3` prompt steps (decompressed K/V) and `-mla 0` decode. `xla`: attention.attend
    (flash: the blocked online softmax; else scores in `-amb` chunks). `cpu` (flash only): the C++
    flash kernel, which reads only the keys a query sees (XLA's scan reads every block of the
    bucket and materializes each block's scores: 59-79 GFLOP/s at V2-Lite's prompt shape against
    168-215 for the kernel, RESULTS §9h)."""
    impls = {
        "xla": Impl(lambda *a: True, _attend_xla),
        "cpu": Impl(_attend_cpu_supported, _attend_cpu),
    }
    return _dispatch("attention", impls, resolve_backend(backend), q, k, v, q_pos, scale, flash, amb_bytes,
                     kv_block)


# -- dense SwiGLU FFN (the dense layers' FFN and the shared experts) -------------------------------

# The C++ fused MoE serves prompt-sized dense FFNs from this many rows of x (decode keeps the three
# tuned GEMVs of quant_linear)
FUSED_FFN_MIN_ROWS = 4


def _ffn_xla(x, gate, up, down, dtype, backend=None):
    # the three products take the caller's backend: `backend="xla"` is XLA throughout
    g, u = quant_linear(x, gate, dtype, backend=backend), quant_linear(x, up, dtype, backend=backend)
    return quant_linear(jax.nn.silu(g) * u, down, dtype, backend=backend)


def _expert_view(w):
    """[F, d] as one expert [1, F, d]: the same bytes, a leading axis."""
    return QuantArray(w.data.reshape((1,) + tuple(w.data.shape)), w.qtype, (1,) + tuple(w.shape))


def _ffn_cpu_supported(x, gate, up, down, dtype) -> bool:
    return (_rows(x) >= FUSED_FFN_MIN_ROWS and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)
            and all(_cpu_ok(w) and len(w.shape) == 2 for w in (gate, up, down))
            and _moe_cpu_mod.supported(*(_expert_view(w) for w in (gate, up, down))))


def _ffn_cpu(x, gate, up, down, dtype):
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    y = _moe_cpu_mod.moe_experts(rows, jnp.ones((n, 1), jnp.float32), jnp.zeros((n, 1), jnp.int32),
                                 *(_expert_view(w) for w in (gate, up, down)), n_threads=_threads(),
                                 compute=_compute(dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def swiglu_ffn(x, gate, up, down, dtype, *, backend: str | None = None):
    """down(silu(gate x) * up x): x [..., d], gate/up [F, d], down [d, F] -> [..., d] float32.
    `xla`: three quant_linear products and XLA's SiLU·mul. `cpu` (prompt-sized x): the fused MoE
    kernel with one expert every row picks at weight 1 — gate and up in one pass, SiLU·mul and
    down per column block, so the two [rows, F] f32 products never exist whole (42.75 MiB of a
    512-token V2-Lite step's XLA buffers, RESULTS §9e)."""
    impls = {
        "xla": Impl(lambda *a: True, functools.partial(_ffn_xla, backend=backend)),
        "cpu": Impl(_ffn_cpu_supported, _ffn_cpu),
    }
    return _dispatch("swiglu_ffn", impls, resolve_backend(backend), x, gate, up, down, dtype)


def _attend_kv_xla(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block):
    from ikjax.model.attention import split_heads_kv
    k, v = split_heads_kv(kv, k_rope[..., :q.shape[-1] - nope], nope)
    return _attend_xla(q, k.astype(q.dtype), v.astype(q.dtype), q_pos, scale, flash, amb_bytes, kv_block)


def _attend_kv_cpu_supported(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block) -> bool:
    return flash and _mla_cpu_mod.attention_kv_supported(q.shape, kv, k_rope, nope)


def _attend_kv_cpu(q, kv, k_rope, q_pos, scale, nope, flash, amb_bytes, kv_block):
    return _mla_cpu_mod.attention_kv(q, kv, k_rope, q_pos, scale, nope=nope, n_threads=_threads())


def attention_kv(q, kv, k_rope, q_pos, scale, *, nope: int, flash: bool, amb_bytes: int = 0, kv_block: int = 256,
                 backend: str | None = None):
    """`attention` over the keys and values as the -mla 2/3 prompt's kv_b product gives them: kv [B,
    S, H, nope + Dv] (each head's k_nope | v) and the rope part k_rope [B, S, >= R] shared by the
    heads; K = kv[..., :nope] ++ k_rope[..., :R], V = kv[..., nope:], both taken at q's dtype.
    `xla` builds K and V (concatenate, broadcast, converts) and runs `attend`; `cpu` (flash) reads
    them in place (RESULTS §9h: those copies were ~40 ms of a 512-token V2-Lite step)."""
    impls = {
        "xla": Impl(lambda *a: True, _attend_kv_xla),
        "cpu": Impl(_attend_kv_cpu_supported, _attend_kv_cpu),
    }
    return _dispatch("attention", impls, resolve_backend(backend), q, kv, k_rope, q_pos, scale, nope, flash,
                     amb_bytes, kv_block)
