"""Routed experts: the sum over each token's chosen experts of down(silu(gate x) * up x).

Implementations: `xla` = pallas_kernels/moe_matmul/reference.py (gather form for few tokens,
grouped form for many: `gather_form`, the one place that rule lives); `pallas`/`interpret` =
pallas_kernels/moe_matmul/kernel.py; `cpu` = the C++ fused MoE; `host` = experts kept in host RAM
next to a GPU, computed by the host CPU from the GPU step; `stream:<impl>` = host experts of a big
batch copied to the GPU inside the step and run by `<impl>`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ikjax import env
from ikjax.errors import OptionError
from ikjax.ops import registry
from ikjax.ops.quant_matmul import one_layer, pallas_ok, pallas_weight, prepare_weight
from ikjax.placement.host import is_host_resident
from ikjax.quant.array import QuantArray
from pallas_kernels.moe_matmul import cpu as _moe_cpu_mod
from pallas_kernels.moe_matmul import kernel as _moe
from pallas_kernels.moe_matmul.reference import moe_experts_grouped_ref, moe_experts_ref

# -- routed experts -------------------------------------------------------------------------------

def host_experts_unavailable() -> str:
    """Why routed experts cannot stay in host memory next to a GPU in this build ("" when they can):
    the CUDA host-experts handler is built only with a CUDA toolkit (pallas_kernels/moe_matmul/host.py)."""
    from pallas_kernels.moe_matmul import host as moe_host
    return "" if moe_host.available() else moe_host.unavailable_reason()


def gather_form(n_tokens: int, n_used: int, n_expert: int) -> bool:
    """Few tokens: gather the selected experts' blocks (bytes grow with tokens x experts used);
    many tokens: group assignments by expert and read every expert once. The one place this rule lives."""
    return n_tokens * n_used <= 2 * n_expert


def _moe_xla(x, weights, ids, gate, up, down, dtype, fused=True):
    gate, up, down = one_layer(gate), one_layer(up), one_layer(down)
    fn = moe_experts_ref if gather_form(ids.shape[0], ids.shape[1], gate.shape[0]) else moe_experts_grouped_ref
    return fn(x, weights, ids, gate, up, down, dtype, fused=fused)


def _moe_pallas_supported(x, weights, ids, gate, up, down, dtype, fused=True) -> bool:
    # f32 compute is the exact reference mode: prompt-sized f32 work stays on XLA's HIGHEST path
    # (the grouped kernel's f32 tiles, IEEE since pallas_kernels.flash.tile_dot, overflow shared memory)
    if not gather_form(ids.shape[0], ids.shape[1], gate.shape[0]) and jnp.dtype(dtype) == jnp.float32:
        return False
    return all(pallas_ok(t) for t in (gate, up, down))


def _moe_pallas(interpret: bool):
    def run(x, weights, ids, gate, up, down, dtype, fused=True):
        (g, layer), (u, _), (d, _) = pallas_weight(gate), pallas_weight(up), pallas_weight(down)
        return _moe.moe_experts(x, weights, ids, g, u, d, dtype, interpret=interpret, layer=layer,
                                row_invariant=registry.batch_invariant())
    return run


def _moe_cpu_supported(x, weights, ids, gate, up, down, dtype, fused=True) -> bool:
    return jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16) and _moe_cpu_mod.supported(gate, up, down)


def _moe_cpu(x, weights, ids, gate, up, down, dtype, fused=True):
    def run(x, weights, ids):
        return _moe_cpu_mod.moe_experts(x, weights, ids, gate, up, down, n_threads=registry.threads(),
                                        compute=registry.compute(dtype))
    # a batch's decode step in groups of at most 3 tokens: no expert sees 4 rows and switches to
    # the prompt form, so each token's experts compute what they do for it alone (registry.decode_groups)
    groups = registry.decode_groups(x.shape[0])
    if groups is None:
        return run(x, weights, ids)
    return jnp.concatenate([run(x[a:b], weights[a:b], ids[a:b]) for a, b in groups], axis=0)


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
    registry.ran("moe_experts", "host")
    return moe_host.moe_experts(x, weights, ids, gate, up, down, n_threads=registry.threads(), compute=registry.compute(dtype))


# IKJAX_STREAM_ORDER: when a streamed layer's host-to-device copy may start. "prev" (default): once
# the previous streamed layer's MoE input exists, so layer i's experts cross PCIe while layer i-1's
# experts and layer i's attention compute, and the device holds at most two layers' experts;
# "self": once its own MoE input exists (no overlap, one layer held); "free": whenever XLA's
# scheduler likes (it may start every layer's copy at once: a full copy on the device).
STREAM_ORDERS = ("prev", "self", "free")


def _stream_order() -> str:
    return env.choice("IKJAX_STREAM_ORDER")


# IKJAX_STREAM: how a big batch moves host-resident experts to the GPU. "active" (ik's -ooae):
# only the experts the batch routes to, in rounds of IKJAX_STREAM_MIB (512) MiB of blocks; "chunks":
# every expert of the layer, a fixed run of experts (about IKJAX_STREAM_MIB of blocks) at a time,
# each run's MoE computed as soon as it is on the device while the next ones cross, at most
# IKJAX_STREAM_AHEAD runs held; "layer": every expert of the layer, the whole tensors in one
# host-to-device transfer (two layers held); "auto" (default): "chunks" where the batch's picks would
# touch nearly every expert anyway, else "active".
STREAM_MODES = ("auto", "active", "chunks", "layer")

# auto: every expert from n_tokens * n_expert_used >= LAYER_PICKS * n_expert. Picks spread as a
# trained router's leave about exp(-LAYER_PICKS) of the experts untouched (1.8 % at 4), so "active"
# would copy nearly the same bytes, but in rounds that each wait for the routing on the host
# (a stream sync) and copy on the compute stream; a fixed run of experts needs no ids, so its copy
# is ordered only by the buffer's room. Measured on an H200 with the realistically routed 8-layer
# R1 at -ub 2048: whole layers 2858 vs active 2191 t/s (bench/RESULTS.md §24b); chunks run at 0.97x
# whole layers' rate with a sixteenth of their stream buffer, within ik's device memory (§24k).
LAYER_PICKS = 4


def stream_mode(n_tokens: int | None = None, n_expert: int = 0, n_expert_used: int = 0, *,
                hot: bool = False) -> str:
    """The streaming form for a batch of `n_tokens` ("active", "chunks" or "layer"; IKJAX_STREAM
    unless it says auto). `hot`: some of the layer's experts have GPU copies (--gpu-experts) and the
    batch streams only the rest: "active" then, as every run of experts would bring the hot ones too."""
    m = env.choice("IKJAX_STREAM")
    if m != "auto":
        return m
    if hot or n_tokens is None or not n_expert:
        return "active"
    return "chunks" if n_tokens * n_expert_used >= LAYER_PICKS * n_expert else "active"


def chunk_experts(per_expert_bytes: int, n_expert: int) -> int:
    """Experts per run of the "chunks" form: the largest divisor of `n_expert` within
    IKJAX_STREAM_MIB of blocks, if it is at least half of what fits (one kernel shape for every
    run); else runs of equal size as near as can be (at most two shapes)."""
    fit = stream_slots_for(per_expert_bytes, n_expert)
    div = max(d for d in range(1, fit + 1) if n_expert % d == 0)
    if 2 * div >= fit:
        return div
    n = -(-n_expert // fit)
    return -(-n_expert // n)


def stream_ahead() -> int:
    """Runs of experts the "chunks" form holds on the device at once (IKJAX_STREAM_AHEAD, >= 1):
    a run's copy may start once the run `ahead` before it has been computed."""
    return env.positive_int("IKJAX_STREAM_AHEAD")


def stream_slots(gate, up, down) -> int:
    """Experts per streaming round: as many as fit IKJAX_STREAM_MIB MiB of raw blocks (at least
    one, at most all): the device holds one round's blocks (and their kernel layout) at a time."""
    return stream_slots_for(sum(t.nbytes for t in (gate, up, down)) // gate.shape[0], gate.shape[0])


def stream_slots_for(per_expert_bytes: int, n_expert: int) -> int:
    """`stream_slots` from one expert's bytes (gate + up + down) and the expert count (the memory
    plan's use, before anything is loaded)."""
    mib = env.positive_float("IKJAX_STREAM_MIB")
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
    b = registry.resolve_backend(backend)
    n_active = jnp.zeros((E,), bool).at[ids.reshape(-1)].max(weights.reshape(-1) != 0).sum()

    def one_round(r, weights, ids):
        *blocks, slot_of = fetch(weights, ids, r)
        s = slot_of[ids]
        keep = s >= 0
        xla_reads = b not in ("pallas", "interpret") or (
            jnp.dtype(dtype) == jnp.float32 and not gather_form(ids.shape[0], ids.shape[1], slots))
        if xla_reads:
            # the XLA forms may multiply every slot's weights (by zero); unfilled slots hold
            # arbitrary bytes (NaN, once dequantized), so they are zeroed there (the kernels never
            # read them). Not only off the GPU: f32 prompt-sized work takes XLA's grouped form there
            # too (_moe_pallas_supported), which read NaN from the slots a round left unfilled
            # once --gpu-experts took some experts out of the stream
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


def stream_form(gate, up, down, n_tokens: int, n_used: int, hot: bool = False) -> str:
    """How a batch of `n_tokens` moves these host experts to the GPU ("active", "chunks" or
    "layer"): `stream_mode`'s rule, except that experts reached by address only (-sm graph: one
    pinned copy for the whole mesh, no step argument) go by round through the custom call, and
    whole layers the engine's plan had no room for (`whole_ok` False) go as runs of experts.
    The one place this rule lives (the step and sweep-bench's report of the bytes moved)."""
    if any(t.by_address for t in (gate, up, down)):
        return "active"
    mode = stream_mode(n_tokens, gate.shape[0], n_used, hot=hot)
    if mode == "layer" and not all(t.whole_ok for t in (gate, up, down)):
        return "chunks"
    return mode


def _moe_stream(x, weights, ids, gate, up, down, dtype, fused, backend, hot=False):
    """Host-resident (pinned) experts, big batches (ik's rule, `HostQuantArray.runs_on`): the GPU
    implementation the all-GPU run would pick computes them after they cross PCIe inside the step,
    in the form `stream_form` says: =chunks (auto's form for a batch that uses nearly every expert)
    every expert a run at a time (`_moe_chunks`); =active only the experts this batch routes to, a
    round at a time (`moe_rounds` + the `ikjax_stream_experts` custom call, which waits for the
    ids); =layer the whole layer's tensors (`_moe_whole_layer`)."""
    if any(t.by_address for t in (gate, up, down)) and env.choice("IKJAX_STREAM") == "layer":
        raise OptionError("IKJAX_STREAM=layer: under -sm graph the host experts are one pinned copy for every "
                          "device, streamed by round (IKJAX_STREAM=active or auto), never whole layers")
    mode = stream_form(gate, up, down, ids.shape[0], ids.shape[1], hot)
    if mode == "chunks":
        out = _moe_chunks(x, weights, ids, gate, up, down, dtype, fused, backend)
    elif mode == "active":
        from pallas_kernels.moe_matmul import host as moe_host
        if not moe_host.stream_supported(gate, up, down):
            raise OptionError(f"ot: streaming host experts to the GPU: "
                              f"{moe_host.unavailable_reason() or 'the experts have no host address'}")
        slots = stream_slots(gate, up, down)
        fetch = functools.partial(_fetch_active, gate=gate, up=up, down=down, slots=slots)
        out = moe_rounds(x, weights, ids, gate, up, down, dtype, fetch=fetch, slots=slots, fused=fused,
                         backend=backend)
    else:
        out = _moe_whole_layer(x, weights, ids, gate, up, down, dtype, fused, backend)
    registry.ran("moe_experts", "stream:" + registry.selected("moe_experts"))
    return out


def _moe_whole_layer(x, weights, ids, gate, up, down, dtype, fused, backend):
    """The whole layer's tensors moved in one copy each, which may start when `IKJAX_STREAM_ORDER`
    says (an optimization barrier ties the host parameter to an earlier activation, so the
    transfer cannot be hoisted to the start of the step); XLA frees them after the layer."""
    order, state = _stream_order(), registry.trace_state()
    dep = x if order == "self" else (state or {}).get("prev") if order == "prev" else None
    data = tuple(t.data for t in (gate, up, down))
    if dep is not None:
        *data, _ = jax.lax.optimization_barrier((*data, dep))
    if state is not None:
        state["prev"] = x
    b = registry.resolve_backend(backend)
    dev = [_streamed(jax.device_put(d, jax.memory.Space.Device), t, t.shape, b) for t, d in zip((gate, up, down), data)]
    return moe_experts(x, weights, ids, *dev, dtype, fused=fused, backend=backend)


def _moe_chunks(x, weights, ids, gate, up, down, dtype, fused, backend):
    """Every expert of the layer crosses to the GPU as runs of `chunk_experts` experts, and each
    run's MoE is computed as it arrives, its picks only (the others' weights zeroed: no work in the
    kernels); the runs' outputs add up. The device holds `stream_ahead()` runs: the copies of the
    next ones are issued before a run computes and overlap it (`_chunk_copier`: the copy engine on
    a side stream where the CUDA handler is built, else slices of the host tensors that XLA moves)."""
    E = gate.shape[0]
    per_expert = sum(t.nbytes for t in (gate, up, down)) // E
    S, ahead = chunk_experts(per_expert, E), stream_ahead()
    runs = [(lo, min(S, E - lo)) for lo in range(0, E, S)]
    b = registry.resolve_backend(backend)
    start, done = _chunk_copier(gate, up, down)

    def dep(a):  # one element of `a`: a data dependence that orders a copy call after a's producer
        return jax.lax.slice_in_dim(a.reshape(-1), 0, 1)

    pending, out = {}, None
    for j in range(min(ahead - 1, len(runs))):
        pending[j] = start(dep(x), *runs[j])
    for j, (lo, n) in enumerate(runs):
        last = x if out is None else out  # run j-1's sum: its buffers are free from here
        nxt = j + ahead - 1
        if nxt < len(runs):
            pending[nxt] = start(dep(last), *runs[nxt])
        blocks = done(dep(last), pending.pop(j))
        # run j computes after the next run's copy was issued (else XLA may issue it late, serially)
        xj, *blocks, _ = jax.lax.optimization_barrier((x, *blocks, pending.get(nxt, ())))
        s = ids - lo
        keep = (s >= 0) & (s < n) & (weights != 0)

        def run(xj, weights, s, keep, *blocks, lo=lo, n=n):
            dev = [_streamed(blk, t, (n, *t.shape[1:]), b) for t, blk in zip((gate, up, down), blocks)]
            return moe_experts(xj, jnp.where(keep, weights, 0.0), jnp.where(keep, s, 0), *dev, dtype, fused=fused,
                               backend=backend)

        # a branch of its own: XLA cannot schedule one run's layout and kernels beside another's, so
        # the step's temporaries hold one run's (unrolled, the prompt step of R1-8 asked for 23 GiB
        # at runs of 512 MiB: §24k); a run no pick of the batch routes to computes nothing
        args = (xj, weights, s, keep, *blocks)
        shape = jax.eval_shape(run, *args)
        part = jax.lax.cond(keep.any(), run, lambda *a: jnp.zeros(shape.shape, shape.dtype), *args)
        out = part if out is None else out + part
    return out


def _chunk_copier(gate, up, down):
    """(start(after, lo, n) -> handle, done(after, handle) -> [gate, up, down blocks]) for runs of
    experts [lo, lo + n) of pinned host tensors. IKJAX_STREAM_COPY=engine (auto where the CUDA
    handler is built): the copy engine on a side stream (`chunk_copy_start` / `_done`), so the copy
    runs beside the kernels; =xla: slices of the host tensors moved by XLA (on a GPU it reads them
    with a kernel on the compute stream: 62 % of the link's rate in the step, §24k)."""
    from pallas_kernels.moe_matmul import host as moe_host
    form = env.choice("IKJAX_STREAM_COPY")
    if form == "auto":
        form = "engine" if jax.default_backend() == "gpu" and moe_host.stream_supported(gate, up, down) else "xla"
    if form == "engine":
        if not moe_host.stream_supported(gate, up, down):
            raise OptionError(f"IKJAX_STREAM_COPY=engine: {moe_host.unavailable_reason() or 'the experts have no host address'}")
        return (lambda after, lo, n: moe_host.chunk_copy_start(after, gate, up, down, lo=lo, n=n),
                moe_host.chunk_copy_done)
    data = tuple(t.data for t in (gate, up, down))

    def start(after, lo, n):
        *held, _ = jax.lax.optimization_barrier((*data, after))
        return [jax.device_put(d[lo:lo + n], jax.memory.Space.Device) for d in held]
    return start, lambda after, blocks: blocks


def streamed_bytes_counted(reset: bool = False) -> int:
    """Bytes of routed experts the by-round stream (the `ikjax_stream_experts` custom call) has
    copied to devices since the process started or the last reset; 0 without the CUDA handler."""
    from pallas_kernels.moe_matmul import host as moe_host
    return int(moe_host.stream_stats(reset).get("bytes", 0))


def host_kernel_stats(reset: bool = False) -> dict:
    """Totals of the host CPU's expert calls from GPU steps since the process started or the last
    reset (calls, ns, bytes; small_*: decode-sized calls); {} without the CUDA handler."""
    from pallas_kernels.moe_matmul import host as moe_host
    return moe_host.host_stats(reset)


def _fetch_active(weights, ids, r, *, gate, up, down, slots):
    from pallas_kernels.moe_matmul import host as moe_host
    return moe_host.stream_experts(weights, ids, gate, up, down, slots=slots, round=r)


def host_computes(gate, up, down, n_tokens: int, n_used: int) -> bool:
    """Whether `moe_experts` over a batch of `n_tokens` tokens (`n_used` picks each) computes these
    experts on the host CPU: some are host-resident, and the batch is too small for streaming them
    (`ikjax.placement.rules.runs_on`) or they are not pinned (memory-mapped: host only)."""
    ts = (gate, up, down)
    if not any(is_host_resident(t) for t in ts):
        return False
    return not all(is_host_resident(t) and t.pinned and t.runs_on(n_tokens, gate.shape[0], n_used) == "device"
                   for t in ts)


def moe_experts(x, weights, ids, gate, up, down, dtype, *, fused: bool = True, backend: str | None = None,
                hot: bool = False):
    """Routed experts of N tokens: sum_j weights[n,j] * down_e(silu(gate_e x) * up_e x), e = ids[n,j].
    The kernels always fuse gate and up; `fused` only changes the XLA form (ik's -fmoe).
    Host-resident experts (`-ot exps=CPU` next to a GPU) take the `host` implementation, or, for a
    batch where `ikjax.placement.rules.runs_on` says "device" and the experts are pinned, `stream:<impl>`
    (`hot`: the layer's most used experts have GPU copies and these picks are the rest: see `stream_mode`)."""
    if any(is_host_resident(t) for t in (gate, up, down)):
        if not host_computes(gate, up, down, *ids.shape):
            return _moe_stream(x, weights, ids, gate, up, down, dtype, fused, backend, hot)
        return _moe_host(x, weights, ids, gate, up, down, dtype)
    impls = {
        "xla": registry.Impl(lambda *a: True, _moe_xla),
        "pallas": registry.Impl(_moe_pallas_supported, _moe_pallas(False)),
        "interpret": registry.Impl(_moe_pallas_supported, _moe_pallas(True)),
        "cpu": registry.Impl(_moe_cpu_supported, _moe_cpu),
    }
    return registry.dispatch("moe_experts", impls, registry.resolve_backend(backend), x, weights, ids, gate, up, down, dtype, fused)
