"""`-sm graph`: every layer split over the devices of a mesh, each device running the same kernels
as one device does (Pallas on GPUs, the C++ custom calls on CPUs) on its part, inside `jax.shard_map`.

Why not let XLA partition the step (GSPMD)? The kernels are custom calls XLA cannot partition: it
would gather every weight to every device around them (or the step would have to run the XLA
path, 60x slower on GPUs, RESULTS §10). Here the split is explicit, as in jax-llm-examples'
deepseek_r1_jax: attention by heads (q/q_b/kv_b/k_b/v_b rows, attn_output columns), dense and
shared FFNs by their hidden rows (gate/up rows, down columns), routed experts by expert, the
embedding and output head by vocabulary rows (`ikjax.placement.splits.consistent_splits` decides per layer
and group; a group that cannot split runs whole on every device). Each device computes a partial
sum; one `psum` per split group completes it (two per layer at most), the output head's logits
are gathered. The router is whole everywhere, so every device picks the same experts and computes
those it holds. The latent KV cache (mla 1-3) is one stream read by every head: each device keeps
a whole copy and writes the same rows; with -mla 0 the per-head K/V cache is split with the heads.

Weights: each device's part is cut from the file's bytes (only this process's devices' parts are
read, so under jax.distributed each host reads its share), then stacked and repacked for the
kernels on that device exactly as one device would (`ikjax.model.weights.TensorLoader`), and every leaf
becomes one array `[n_devices, *part]` split on its first axis (whole copies for what is not
split): inside the step each device sees its own part, whatever its layout.

Routed experts in host RAM (`-ot exps=CPU`) stay one copy, in the first device's pinned host
memory (the memory map's pages with IKJAX_HOST_EXPERTS=mmap), which steps reach by address only
(`HostQuantArray.by_address`). Small batches: the first device's step calls the host-experts
kernel (pallas_kernels/moe_matmul/host.py) with every pick, the others' with none (their weights
zeroed, which the kernel skips), so the host computes each selected expert once per step with the
whole -t pool; the psum joins the parts. (A range per device made the host run two half-size calls
one after the other: the kernel runs one call at a time, RESULTS §25e.) Big batches (ik's rule): each device copies
the experts of its range that the batch uses from that copy (the `stream_experts` custom call, by
round) and computes them on the GPU, so the link of every device carries its share (before, the
host computed them: 241 vs ik's 1008 t/s, RESULTS §25b).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ikjax import ops
from ikjax.errors import OptionError
from ikjax.gguf_io.tensors import is_routed_expert, layer_of, split_group, validate
from ikjax.model.deepseek2 import embed, forward, output_head, run_layers
from ikjax.model.weights import TensorLoader
from ikjax.placement.devices import BYTES_READ
from ikjax.placement.host import host_form, to_pinned
from ikjax.placement.splits import MESH_AXIS
from ikjax.runtime.generation import decode_steps
from ikjax.runtime.sampling import NON_FINITE


@dataclass(frozen=True)
class TensorSplit:
    """What a -sm graph step splits (static: part of the compile key): the mesh, and the keys of
    the split groups — "embd", "out", and "{layer}.attn" / ".ffn" / ".shexp" / ".exps"."""
    mesh: Any
    split: frozenset
    axis: str = MESH_AXIS

    @property
    def n(self) -> int:
        return int(self.mesh.devices.size)

    def has(self, key: str) -> bool:
        return key in self.split


def tensor_split(placement, mesh) -> TensorSplit:
    """The split groups of a -sm graph placement."""
    keys = set()
    for t in placement.tensors:
        if t.split_dim is None:
            continue
        if t.name.startswith("token_embd."):
            keys.add("embd")
        elif t.name.startswith("output."):
            keys.add("out")
        else:
            group = split_group(t.name)
            if group not in (None, "router"):
                keys.add(f"{layer_of(t.name)}.{group}")
    for t in placement.tensors:  # host-resident experts: whole, each device's host call takes a range
        if t.on_host and not placement.unified and is_routed_expert(t.name):
            keys.add(f"{layer_of(t.name)}.exps")
    return TensorSplit(mesh, frozenset(keys))


# -- loading -----------------------------------------------------------------------------------------

def _part_placer(placement, k: int, n: int, device, pinned: dict | None = None):
    """The placer of mesh position k: the k-th of n equal parts of each split tensor (its
    `split_dim`), the whole of the others, copied to `device`. Host-resident routed experts next to
    accelerators are one copy for all devices: in the first device's pinned host memory (`pinned`,
    shared by the placers of all positions; the memory map's pages released after), or the memory
    map's bytes themselves with IKJAX_HOST_EXPERTS=mmap."""
    def place(name: str, data):
        t = placement[name]
        if t.on_host and not placement.unified:
            if pinned is None:
                return data
            if name not in pinned:
                pinned[name] = to_pinned(data, pinned["__device__"])
            return pinned[name]
        if t.split_dim is not None:
            d = t.split_dim % data.ndim
            size = data.shape[d] // n
            index = [slice(None)] * data.ndim
            index[d] = slice(k * size, (k + 1) * size)
            data = data[tuple(index)]
        BYTES_READ[0] += data.nbytes
        return jax.device_put(np.ascontiguousarray(data), device)
    return place


_expand = None


def _stack(trees: list, positions: list[int], mesh) -> Any:
    """Per-device trees of the same structure (parts of this process's devices, in mesh positions
    `positions`) -> one tree whose leaves are `[n, *part]` arrays split on their first axis."""
    global _expand
    if _expand is None:  # donated: the part's buffer becomes the stacked array's (no second copy)
        _expand = jax.jit(lambda a: a[None], donate_argnums=0)
    flat = [jax.tree.flatten(t) for t in trees]
    treedef = flat[0][1]
    if any(f[1] != treedef for f in flat[1:]):
        raise OptionError("sm: -sm graph cut a tensor into parts of different layouts (a bug: please report)")
    n = int(mesh.devices.size)
    sh = NamedSharding(mesh, P(MESH_AXIS))
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        for j in range(len(flat[0][0])):
            parts = [_expand(f[0][j]) for f in flat]
            out.append(jax.make_array_from_single_device_arrays((n,) + tuple(parts[0].shape[1:]), sh, parts))
    return jax.tree.unflatten(treedef, out)


def load(gf, cfg, placement, mesh, spans) -> dict:
    """The weight tree of a -sm graph step (module docstring), one layer at a time so a device
    holds at most one layer twice while it is stacked."""
    host = [t for t in placement.tensors if t.on_host]
    if host and not placement.unified:
        for t in host:
            if not is_routed_expert(t.name):
                raise OptionError(f"ot: {t.name} is placed in host memory ({t.rule}); next to accelerators only "
                                  f"routed experts (ffn_*_exps) can stay in host memory")
        why = ops.host_experts_unavailable()
        if why:
            raise OptionError(f"ot: {host[0].name} is placed in host memory ({host[0].rule}), but {why}")
    validate(gf.tensors, cfg, gf.path)
    devices = list(mesh.devices.flat)
    n = len(devices)
    me = jax.process_index()
    mine = [k for k, d in enumerate(devices) if d.process_index == me]
    repack = ops.needs_repack()
    shared: dict = {}  # host-resident experts: one HostQuantArray for every device, reached by address
    # their bytes: one pinned copy (big batches stream the experts each device computes from it)
    pinned = {"__device__": devices[mine[0]]} if host and not placement.unified and host_form() == "pinned" else None
    loaders = [TensorLoader(gf, cfg, _part_placer(placement, k, n, devices[k], pinned), placement, repack, shared)
               for k in mine]
    weights = _stack([ld.top() for ld in loaders], mine, mesh)
    weights["groups"] = [_stack([ld.group(first, count) for ld in loaders], mine, mesh) for first, count in spans]
    return weights


# -- the step ----------------------------------------------------------------------------------------

def cache_specs(layout, tp: TensorSplit) -> dict:
    """PartitionSpecs of the KV cache: the latent whole on every device; -mla 0's per-head K/V
    split with the heads of layers whose attention is split."""
    def spec(i: int, width: int):  # entries [count, B, S, ...] of the group whose first layer is i
        split = layout.kind == "kv" and tp.has(f"{i}.attn")
        if layout.ctk == "q8_0":
            return {"q": P(None, None, None, tp.axis, None), "d": P(None, None, None, tp.axis)} if split else \
                {"q": P(), "d": P()}
        return P(None, None, None, tp.axis) if split else P()
    firsts = np.cumsum((0,) + layout.group_counts[:-1])
    return {name: [spec(int(i), w) for i in firsts] for name, w in layout.widths}


def check_cache(layout, tp: TensorSplit) -> None:
    """-mla 0 with a q8_0 cache splits K/V rows at 32-value blocks: each device's heads must fill
    whole blocks."""
    if layout.kind != "kv" or layout.ctk != "q8_0":
        return
    for name, width in layout.widths:
        if (width // tp.n) % 32:
            raise OptionError(f"ctk: -mla 0 with -sm graph over {tp.n} devices splits the {name} cache by heads "
                              f"into {width // tp.n}-value rows, not whole q8_0 blocks of 32 (use -ctk f16 or -mla 3)")


def cache_shardings(layout, tp: TensorSplit) -> dict:
    return jax.tree.map(lambda s: NamedSharding(tp.mesh, s), cache_specs(layout, tp),
                        is_leaf=lambda x: isinstance(x, P))


def _step(weights, cache, tokens, start, last, *, cfg, plan, layout):
    tp = plan.tp
    specs = cache_specs(layout, tp)

    def local(w, c, t, s, l_):
        w = jax.tree.map(lambda a: a[0], w)  # this device's part
        return forward(w, c, t, s, l_, cfg=cfg, plan=plan)
    f = jax.shard_map(local, mesh=tp.mesh, in_specs=(P(tp.axis), specs, P(), P(), P()), out_specs=(P(), specs),
                      check_vma=False)
    return f(weights, cache, tokens, start, last)


_jitted = None


def step():
    """The jitted -sm graph step: (weights, cache, tokens, start, last; cfg, plan, layout) ->
    (logits replicated, cache); the cache is donated."""
    global _jitted
    if _jitted is None:
        _jitted = jax.jit(_step, static_argnames=("cfg", "plan", "layout"), donate_argnums=(1,))
    return _jitted


# -- the decode loop ---------------------------------------------------------------------------------

def fused_pick(plan, sampling: tuple) -> bool:
    """Whether the decode loop picks each token without gathering the logits (`_greedy_steps`):
    greedy, with the output head and the embedding split by the same vocabulary rows."""
    tp, s = plan.tp, dict(sampling)
    # a draw with a key per row names its top_k bucket, not its temperature (generation.sampling_key)
    greedy = s.get("temperature", 0.0) <= 0.0 and "bucket" not in s
    return greedy and tp.has("out") and tp.has("embd")


def _pick_and_embed(logits, table, axis: str, ban: tuple):
    """Greedy over a vocabulary split by rows: logits [B, V/n] of this device's rows -> (token
    ids [B] int32, their embedding rows [B, d]), the same on every device, in ONE small all-gather.

    Each device takes its own rows' best (value, id) and embeds that candidate from its own part
    of the table; the gather of [B, 3 + d] per device lets every device pick the winner (the
    largest value, ties to the lowest device = the lowest id, as jnp.argmax over the whole row) and
    take the winner's row as the next step's input. Gathering the logits (B x V floats) and then
    assembling the next token's embedding with a psum (a second collective) is what the plain
    step does; the result is the same token and the same row. A row of non-finite logits on any
    device gives NON_FINITE, as `sample_device` does (its row fed to the next step is then
    whatever won: the host refuses those tokens)."""
    B, Vn = logits.shape
    k = jax.lax.axis_index(axis)
    logits = logits.astype(jnp.float32)
    finite = jnp.isfinite(logits).all(axis=-1)
    if ban:  # this device's columns among the banned ids
        cols = k * Vn + jnp.arange(Vn, dtype=jnp.int32)
        logits = jnp.where(jnp.isin(cols, jnp.asarray(ban, jnp.int32))[None], -jnp.inf, logits)
    li = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lv = jnp.take_along_axis(logits, li[:, None], axis=-1)
    row = embed(table, li[:, None])[:, 0]  # [B, d]: this device's candidate, from its own rows
    # ids < 2^24 are exact in f32 (vocabularies are ~10^5)
    payload = jnp.concatenate([lv, li[:, None].astype(jnp.float32), finite[:, None].astype(jnp.float32), row], -1)
    every = jax.lax.all_gather(payload, axis)  # [n, B, 3 + d]
    win = jnp.argmax(every[:, :, 0], axis=0)  # [B]
    sel = jnp.take_along_axis(every, win[None, :, None], axis=0)[0]
    tok = win.astype(jnp.int32) * Vn + sel[:, 1].astype(jnp.int32)
    tok = jnp.where(every[:, :, 2].min(axis=0) > 0, tok, NON_FINITE)
    return tok, sel[:, 3:]


def _greedy_steps(weights, cache, tok, start, n, *, cfg, plan, chunk: int, ban: tuple):
    """`decode_steps` for greedy decoding on one device's part (inside shard_map): the loop
    carries the next token's embedding row, not its id, so a step's collectives are the layers'
    psums and one all-gather of [B, 3 + d] (`_pick_and_embed`) instead of the logits' gather
    plus the embedding's psum. Returns (tokens [B, chunk], the first n produced; cache)."""
    axis = plan.tp.axis
    B = tok.shape[0]
    zeros = jnp.zeros((B,), jnp.int32)
    table = weights["token_embd"]
    with ops.kernel_context(plan.backend, plan.threads, seq_tokens=1):
        x0 = embed(table, tok[:, None], axis=axis)

        def body(i, carry):
            cache, x, out = carry
            h, cache = run_layers(weights["groups"], cache, x, start + i, cfg=cfg, plan=plan, last=zeros)
            logits = output_head(weights, h, zeros, cfg=cfg, plan=plan, gather=False)
            nxt, row = _pick_and_embed(logits, table, axis, ban)
            return cache, row[:, None, :], jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))

        out = jnp.zeros((B, chunk), jnp.int32)
        cache, _, out = jax.lax.fori_loop(0, n, body, (cache, x0, out))
    return out, cache


def _decode(weights, cache, tok, start, n, key_data, *, cfg, plan, layout, chunk: int, sampling: tuple):
    """The decode loop (`ikjax.runtime.generation.decode_steps`) inside one shard_map: n <= chunk
    steps, each the layers on every device's part, the token picked on the device and the same on
    every device (tokens replicated), so the whole loop is one executable whose while loop XLA
    keeps on the devices. `key_data`: the PRNG key's raw data (a global input from the host;
    typed keys do not cross `distributed.global_input`)."""
    tp = plan.tp
    specs = cache_specs(layout, tp)
    fused = fused_pick(plan, sampling)

    def local(w, c, t, s, n_, kd):
        w = jax.tree.map(lambda a: a[0], w)  # this device's part
        if fused and w["token_embd"].shape[0] == w["output"].shape[0]:
            return _greedy_steps(w, c, t, s, n_, cfg=cfg, plan=plan, chunk=chunk, ban=dict(sampling).get("ban", ()))
        # a key per row (sampling "rows"): their raw data [B, ...], beside each row's setting where it draws
        key = (jax.random.wrap_key_data(kd[0]), kd[1]) if isinstance(kd, tuple) else jax.random.wrap_key_data(kd)
        return decode_steps(w, c, t, s, n_, key, cfg=cfg, plan=plan, chunk=chunk, sampling=sampling)
    f = jax.shard_map(local, mesh=tp.mesh, in_specs=(P(tp.axis), specs, P(), P(), P(), P()),
                      out_specs=(P(), specs), check_vma=False)
    return f(weights, cache, tok, start, n, key_data)


_jitted_decode = None


def decode():
    """The jitted -sm graph decode loop: (weights, cache, tokens [B], start [B], n, key data;
    cfg, plan, layout, chunk, sampling) -> (tokens [B, chunk] replicated, cache); the cache is
    donated."""
    global _jitted_decode
    if _jitted_decode is None:
        _jitted_decode = jax.jit(_decode, static_argnames=("cfg", "plan", "layout", "chunk", "sampling"),
                                 donate_argnums=(1,))
    return _jitted_decode


# -- collectives of a compiled step ------------------------------------------------------------------

_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                   "collective-permute", "collective-broadcast")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][a-z\-]*)\(")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w*)\[([0-9,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64}
_CALLED = re.compile(r"\b(body|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclass
class Collectives:
    """The collectives a compiled -sm graph executable runs (`collectives`): `per_step` those of
    one step (of one decode-loop iteration in a decode executable: every layer's psums and the
    token's gather), `per_step_bytes` their result bytes on one device, `kinds` per_step by op
    (all-reduce, all-gather, ...), and `outside` those a decode executable runs once per dispatch
    (the first token's embedding)."""
    per_step: int = 0
    per_step_bytes: int = 0
    outside: int = 0
    kinds: dict = field(default_factory=dict)

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return (f"{self.per_step} collectives a step ({kinds or 'none'}; {self.per_step_bytes} bytes a device)"
                + (f", {self.outside} once a dispatch" if self.outside else ""))


def _array_bytes(shape_text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        out.append(size * _BITS.get(dtype, 8) // 8)
    return out


def _collective_bytes(op: str, shape_text: str) -> int:
    """Result bytes of one collective: an async all-gather's tuple is (operands, results), other
    async starts lead with their operand; combined all-reduces return a tuple of results."""
    sizes = _array_bytes(shape_text)
    if not sizes:
        return 0
    if op == "all-gather-start":
        return sum(sizes[len(sizes) // 2:])
    if op.endswith("-start") and op != "all-reduce-start":
        return sizes[0]
    return sum(sizes)


def collectives(hlo_text: str) -> Collectives:
    """Count the collectives in XLA's optimized HLO of a compiled step (`exe.as_text()`), each as
    many times as it runs: a layer scan's body times its known trip count. In a decode executable
    (a while loop of unknown trip count at the top: `decode`) `per_step` is one iteration's.

    Why count them: at batch 1 a -sm graph step is latency-bound and each collective is a
    synchronisation of every device (~10-20 us over NVLink, more over PCIe): their number per
    token is what the mesh pays over one device, and the benches print it next to t/s."""
    comps: dict[str, list] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        shape, op = m.group(1), m.group(2)
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base in _COLLECTIVE_OPS:
            comps[current].append(("op", base, _collective_bytes(op, shape)))
            continue
        if op == "while":
            body = re.search(r"\bbody=%([\w.\-]+)", line)
            trip = _TRIP.search(line)
            comps[current].append(("loop", body.group(1), int(trip.group(1)) if trip else None))
            continue
        branches = _BRANCHES.search(line)
        if branches:
            comps[current].append(("branches", [b.strip().lstrip("%") for b in branches.group(1).split(",")], 1))
        for kind, name in _CALLED.findall(line):
            comps[current].append(("call", name, 1))
    if entry is None:
        raise OptionError("collectives: no ENTRY computation in the HLO text (pass exe.as_text() of a compiled step)")

    def total(name: str, seen=()) -> tuple[int, int, dict]:
        count, nbytes, kinds = 0, 0, {}
        for kind, what, k in comps.get(name, ()):
            if kind == "op":
                count, nbytes = count + 1, nbytes + k
                kinds[what] = kinds.get(what, 0) + 1
                continue
            names = what if kind == "branches" else [what]
            parts = [total(n, seen + (name,)) for n in names if n not in seen]
            if not parts:
                continue
            c, b, ks = max(parts, key=lambda p: p[0])  # branches: the costliest one
            times = k if k is not None else 1
            count, nbytes = count + c * times, nbytes + b * times
            for op, n in ks.items():
                kinds[op] = kinds.get(op, 0) + n * times
        return count, nbytes, kinds

    loops = [what for kind, what, k in comps[entry] if kind == "loop" and k is None]
    everything = total(entry)
    if len(loops) != 1:  # one step: every collective of the executable
        return Collectives(everything[0], everything[1], 0, everything[2])
    c, b, kinds = total(loops[0], (entry,))
    return Collectives(c, b, everything[0] - c, kinds)
