"""Routed experts: DeepSeek's router (softmax or sigmoid, bias for selection, group limit, norm,
scale), ik's smart expert reduction, and the expert FFN in two forms.

The expert FFN itself is the `moe_experts` op (ikjax.ops): on the XLA path a gather form for
few tokens and a grouped (`ragged_dot`) form for many; the Pallas and C++ kernels always fuse gate
and up; `fmoe` selects the fused XLA form, as ik's `-fmoe`.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import ops
from ikjax.gguf_io.config import GATING_SIGMOID, ModelConfig
from ikjax import env
from ikjax.errors import OptionError
from ikjax.options import SmartExpertReduction
from ikjax.model.layers import SHARED_EXPERTS, dense_ffn
from ikjax.ops import registry



def top_k(x, k: int):
    """(values, indices) of the k largest along the last axis, ties to the lower index (as
    lax.top_k). Few rows (a decode step's router): by rank, each entry counting the entries
    above it, which XLA fuses into plain loop kernels that a CUDA graph captures like the rest;
    lax.top_k is a sort custom call of its own on GPU (one run with command buffers measured
    5.64 ms a V2-Lite decode step with it, 4.95 by rank, RESULTS §13b). Many rows: lax.top_k.
    IKJAX_TOPK=lax forces lax.top_k (for comparison).

    NaN ranks last (as -inf): a NaN compares false with everything, so by rank every NaN entry
    counted nothing above it, several shared rank 0 and their summed ids named an expert past
    the last (the kernels refused `expert id 120 outside [0, 16)`, the XLA gather silently
    clamped). Mapped so, the ids stay in range whatever the scores hold; the NaN itself still
    reaches the logits through the weights taken from the scores, where the engine names it."""
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    n, e = math.prod(x.shape[:-1]), x.shape[-1]
    if env.choice("IKJAX_TOPK") == "lax" or n * e * e > _RANK_TOPK_MAX:
        return jax.lax.top_k(x, k)
    a, b = x[..., :, None], x[..., None, :]  # [.., e, f]: does f outrank e?
    idx = jnp.arange(e)
    above = (b > a) | ((b == a) & (idx[None, :] < idx[:, None]))
    rank = above.sum(axis=-1)  # [.., e]: 0 for the largest
    hit = rank[..., :, None] == jnp.arange(k)  # [.., e, k]
    ids = jnp.where(hit, idx[:, None], 0).sum(axis=-2).astype(jnp.int32)
    vals = jnp.where(hit, x[..., :, None], 0).sum(axis=-2)
    return vals, ids


_RANK_TOPK_MAX = 1 << 22  # compares per call (decode: 1 x 256^2 for R1)


def route(x, layer: dict, cfg: ModelConfig, ser: SmartExpertReduction | None):
    """x [N, d] -> (weights [N, k] float32, expert ids [N, k] int32), as transformers' routers."""
    # float32 [E, d] as loaded (ikjax.model.weights), a LayerSlice in a scanned group, a QuantArray
    # if built by hand: the op takes each as it is
    logits = ops.router_logits(x, layer["gate_inp"])  # in a decode step, each token's bits as alone
    scores = jax.nn.sigmoid(logits) if cfg.gating == GATING_SIGMOID else registry.softmax_rows(logits)
    choice = scores + layer["exp_probs_b"] if "exp_probs_b" in layer else scores
    G, g_used = cfg.n_expert_group, cfg.n_expert_group_used
    if G > 1 and g_used < G:
        grouped = choice.reshape(-1, G, cfg.n_expert // G)
        if cfg.gating == GATING_SIGMOID:
            group_score = top_k(grouped, 2)[0].sum(axis=-1)
        else:
            group_score = grouped.max(axis=-1)
        _, top_groups = top_k(group_score, g_used)
        keep = jnp.zeros_like(group_score, dtype=bool).at[jnp.arange(group_score.shape[0])[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, cfg.n_expert // G, axis=-1), choice, -jnp.inf)
    _, ids = top_k(choice, cfg.n_expert_used)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.expert_weights_norm:
        w = w / (registry.sum_rows_small(w)[..., None] + 1e-20)
    w = w * cfg.expert_weights_scale
    if ser is not None:
        w = smart_expert_reduction(w, ser)
    return w, ids


def smart_expert_reduction(w, ser: SmartExpertReduction):
    """Keep the top Kmin weights; a lower one only where w_i > t * w_max. Dropped weights become 0."""
    order = jnp.argsort(-w, axis=-1)
    rank = jnp.argsort(order, axis=-1)
    w_max = w.max(axis=-1, keepdims=True)
    keep = (rank < ser.min_experts) | (w > ser.threshold * w_max)
    return jnp.where(keep, w, 0.0)


class ExpertCounts:
    """Tokens each MoE layer routed to each expert, summed over the steps that ran with
    `StepPlan.expert_stats` (`record_counts`, called back from the step): what `Engine.expert_stats`
    returns and `--expert-stats FILE.json` writes. `tokens`: the real tokens those steps fed
    (padding rows of a prompt chunk are not counted, nor routed picks of weight 0 (-ser))."""

    def __init__(self, n_expert: int, moe_layers):
        self.n_expert = n_expert
        self.moe_layers = sorted(int(i) for i in moe_layers)
        self.first_moe_layer = self.moe_layers[0] if self.moe_layers else -1
        # (tokens, per-layer counts [n MoE layers, n_expert]) replaced whole by each step's record: a
        # Ctrl-C (KeyboardInterrupt) that lands in a callback run on the main thread, mid-record,
        # leaves the last whole step's figures, never a step counted in some layers and not others
        self._state: tuple[int, np.ndarray] = (0, np.zeros((len(self.moe_layers), n_expert), np.int64))
        self._row = {layer: r for r, layer in enumerate(self.moe_layers)}
        self.paused = False  # `Engine.uncounted`: warm-up runs, not the user's tokens
        self._lock = threading.Lock()  # counts land from the steps' callback threads

    def record_counts(self, layers, counts, n_valid) -> None:
        """Per-expert counts [n, E] of the MoE layers `layers` [n] of one step (or of one pipeline
        stage), which fed `n_valid` real tokens."""
        if self.paused:
            return
        layers = np.asarray(layers).reshape(-1).tolist()
        counts = np.asarray(counts).reshape(len(layers), -1)
        rows = [self._row[layer] for layer in layers]
        with self._lock:
            tokens, table = self._state
            table = table.copy()
            np.add.at(table, rows, counts)
            if self.first_moe_layer in layers:  # once a step: the tokens it fed
                tokens += int(n_valid)
            self._state = (tokens, table)  # one store: the step counts everywhere or nowhere

    @property
    def tokens(self) -> int:
        return self._state[0]

    def as_json(self) -> dict:
        tokens, table = self._state
        return {"tokens": tokens, "layers": {str(i): table[r].tolist() for i, r in self._row.items()}}


def add_stats(into: dict, other: dict) -> dict:
    """`other`'s counts added to `into` (both in `ExpertCounts.as_json`'s form), layer by layer;
    refused where a layer's expert counts differ (statistics of another model)."""
    into["tokens"] += int(other.get("tokens", 0))
    for k, v in other.get("layers", {}).items():
        mine = into["layers"].setdefault(k, [0] * len(v))
        if len(mine) != len(v):
            raise OptionError(f"expert-stats: layer {k} has {len(mine)} experts in one count and {len(v)} in "
                              f"another; count one model a file")
        into["layers"][k] = [a + b for a, b in zip(mine, v)]
    return into


def is_stats_file(path: str) -> bool:
    """Whether `path` holds an expert-stats file ({"tokens": int, "layers": {...}}): what a run may
    replace (an earlier run's statistics); any other file is never overwritten."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and type(data.get("tokens")) is int and isinstance(data.get("layers"), dict)


def refuse_overwrite(path: str) -> None:
    """Refuse, in one line, to write expert statistics over an existing file that is not an
    expert-stats file (the model, the -f text, a config: a probe saw the loaded GGUF replaced)."""
    from ikjax.atomic_file import keep_foreign
    keep_foreign(path, "expert-stats", is_stats_file, 'an expert-stats file (JSON {"tokens": N, "layers": {...}})')


# The counts of the MoE layers traced so far in this step (`counting`), awaiting the step's one call
# to the host (`flush_counts`): (layer index, counts [E] int32) pairs
_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("ikjax_expert_counts", default=None)


@contextlib.contextmanager
def counting():
    """While the layers of a step are traced: each MoE layer's counts are kept (made on the device)
    for one host call (`flush_counts`), not one call per layer. Why: a host callback stalls the
    device's stream; one per MoE layer cost 25 % of the 8-layer R1's decode with the experts in
    host RAM (58.9 -> 43.8 t/s on an H200, RESULTS §24e). Yields (pending list, owner): inside an
    enclosing `counting` (the decode loop's, one host call a dispatch) the enclosing list, and
    owner False: the enclosing collector calls the host, not this one."""
    outer = _PENDING.get()
    if outer is not None:
        yield outer, False
        return
    pending: list = []
    token = _PENDING.set(pending)
    try:
        yield pending, True
    finally:
        _PENDING.reset(token)


def stacked_counts(pending: list, n_expert: int):
    """(layers [n], counts [n, E]) of pending (layer, counts) pairs, a scanned group's stacked ones
    included."""
    return (jnp.concatenate([jnp.reshape(l, (-1,)) for l, _ in pending]),
            jnp.concatenate([jnp.reshape(c, (-1, n_expert)) for _, c in pending]))


def count_experts(sink: ExpertCounts, layer_index, ids, w, valid, axis: str | None = None) -> None:
    """Inside a step: layer `layer_index`'s routing (ids [N, k], weights w [N, k], valid [N] the real
    tokens) counted per expert on the device, kept for the step's one host call (`counting`);
    outside `counting`, handed to `sink` at once. Under -sm graph every device routes alike: the
    first one counts (`flush_counts`)."""
    picked = (w != 0) & jnp.asarray(valid, bool).reshape(-1, 1)
    counts = jnp.zeros(sink.n_expert, jnp.int32).at[ids.reshape(-1)].add(picked.reshape(-1).astype(jnp.int32))
    layer = jnp.asarray(layer_index, jnp.int32)
    pending = _PENDING.get()
    if pending is not None:
        pending.append((layer, counts))
        return
    flush_counts(sink, [(layer, counts)], jnp.sum(jnp.asarray(valid, jnp.int32)), axis)


def flush_counts(sink: ExpertCounts, pending: list, n_valid, axis: str | None = None) -> None:
    """The pending (layer, counts) pairs of a step to `sink`, in one host call."""
    if not pending:
        return
    layers, counts = stacked_counts(pending, sink.n_expert)
    part = jax.lax.axis_index(axis) if axis is not None else jnp.int32(0)

    def record(layers, counts, n_valid, part):
        if int(part) == 0:
            sink.record_counts(layers, counts, n_valid)
    jax.debug.callback(record, layers, counts, n_valid, part)


def moe_ffn(x, layer: dict, cfg: ModelConfig, *, dtype, fused: bool, ser: SmartExpertReduction | None,
            experts_axis: str | None = None, shared_axis: str | None = None, n_parts: int = 1, on_route=None,
            valid=None):
    """x [N, d] float32 -> routed experts + shared experts, [N, d] float32.

    -sm graph (ikjax.runtime.mesh): with `experts_axis` this device holds a contiguous slice of
    the experts: every device routes over all of them alike, computes the selected ones it holds
    (the others' weights zeroed) and a psum adds the devices' parts; with `shared_axis` the shared
    experts' hidden rows are split and their partial sums join the same psum. Experts every device
    holds whole (host-resident: one copy for all `n_parts` devices) are divided the same way, by
    range, their ids left as they are, where the devices compute them (big batches stream them);
    where the host computes them, the first device's call takes them all.

    `valid` [N] bool: the rows whose output is used; the others (padding, idle slots) route to no
    expert (their weights zeroed, so no kernel computes or reads their picks)."""
    w, ids = route(x, layer, cfg, ser)
    if valid is not None:
        w = jnp.where(valid[:, None], w, 0.0)
    if on_route is not None:
        on_route(ids, w)
    if experts_axis is not None:
        n_local = layer["gate_exps"].shape[0]
        whole = n_local == cfg.n_expert
        if whole and ops.host_computes(layer["gate_exps"], layer["up_exps"], layer["down_exps"], *ids.shape):
            # the host computes them (a decode-sized batch): the first device's call takes every
            # pick, with the whole -t pool. The host kernel runs one call at a time (one scratch,
            # one pool), so a range a device made two half-size calls in a row, each waiting for
            # the other's host function (R1-7 on 2 x H200: 45.8 t/s against 69.6 on one GPU at
            # the same host threads, RESULTS §25e)
            w = jnp.where(jax.lax.axis_index(experts_axis) == 0, w, 0.0)
        else:
            part = -(-cfg.n_expert // n_parts) if whole else n_local
            local = ids - jax.lax.axis_index(experts_axis) * part
            mine = (local >= 0) & (local < part)
            w = jnp.where(mine, w, 0.0)
            if not whole:
                ids = jnp.where(mine, local, 0)
    hot = layer.get("hot_experts")
    if hot is not None:
        # --gpu-experts: the picks of experts with a GPU copy run there, the rest on the host
        # (each side skips the picks whose weight is zeroed: the host kernel reads no bytes of
        # them, a big batch streams only the experts it still needs)
        s = hot["slot"][ids]
        on = s >= 0
        out = ops.moe_experts(x, jnp.where(on, w, 0.0), jnp.where(on, s, 0), hot["gate"], hot["up"], hot["down"],
                              dtype, fused=fused)
        out = out + ops.moe_experts(x, jnp.where(on, 0.0, w), ids, layer["gate_exps"], layer["up_exps"],
                                    layer["down_exps"], dtype, fused=fused, hot=True)
    else:
        out = ops.moe_experts(x, w, ids, layer["gate_exps"], layer["up_exps"], layer["down_exps"], dtype,
                              fused=fused)
    if "down_shexp" not in layer:
        return jax.lax.psum(out, experts_axis) if experts_axis else out
    shared = dense_ffn(x, layer, SHARED_EXPERTS, dtype)
    if experts_axis and shared_axis:
        return jax.lax.psum(out + shared, experts_axis)
    if experts_axis:
        return jax.lax.psum(out, experts_axis) + shared
    if shared_axis:
        return out + jax.lax.psum(shared, shared_axis)
    return out + shared
