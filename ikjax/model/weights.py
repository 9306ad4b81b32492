"""Model weights: the GGUF tensors a deepseek2 graph needs, checked and wrapped as QuantArrays.

Each tensor keeps its GGUF blocks; nothing is dequantized here. The three MLA layouts load as they
are: whichever of `attn_kv_b` / `attn_k_b` / `attn_v_b` a file lacks is derived inside the graph
from the ones it has (see `attention_weights`), exactly, with no re-quantization.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ikjax import env, ops, programs
from ikjax.errors import OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile, TensorInfo
from ikjax.model.groups import LayerGroup, layer_spans
from ikjax.gguf_io.tensors import FUSED_ROWS, KERNEL_MATRICES, TensorSpec, is_routed_expert, layer_specs, model_specs, validate
from ikjax.placement import devices
from ikjax.placement.host import (HostQuantArray, HostStack, cached_fraction, host_form, min_offload_batch, pin_tree, populate_pages,
                                  release_pages, to_pinned)
from ikjax.placement.rules import Placement
from ikjax.quant.array import QuantArray

# pytree: {"token_embd", "output_norm", "output", "groups": [LayerGroup, ...]} (ikjax.model.groups)
Weights = dict[str, Any]


Placer = Callable[[str, np.ndarray], Any]


@jax.jit
def _concat_rows(parts: tuple):
    """One program for the fused matrix (eager `jnp.concatenate` also ran a dtype-conversion program
    per part: each its own compile-cache read at load)."""
    return jax.lax.concatenate(list(parts), 0)


def fuse_rows(layer: dict) -> dict:
    """Stack the matrices that read the same input (`FUSED_ROWS`, from the tensor kinds) into one,
    where their types and columns agree: one product instead of two in every step."""
    for fused, keys in FUSED_ROWS:
        parts = [layer.get(k) for k in keys]
        if any(p is None for p in parts):
            continue
        qt, cols = parts[0].qtype, parts[0].shape[-1]
        if any(p.qtype != qt or p.ndim != 2 or p.shape[-1] != cols or p.shape[0] % qt.interleave for p in parts):
            continue
        rows = sum(p.shape[0] for p in parts)
        layer[fused] = QuantArray(programs.run("concat_rows", _concat_rows, (tuple(p.data for p in parts),)), qt,
                                  (rows, cols))
        for k in keys:
            del layer[k]
    return layer


def default_placer(name: str, host: np.ndarray) -> jax.Array:
    """One device: on a CPU, blocks at a 64-byte aligned file offset are aliased, not copied (XLA's
    CPU buffers need that alignment; GGUF guarantees only its `general.alignment`, 32 by default),
    so the weights are the file's pages; the rest are copied once and the mapped pages under them are
    handed back (MADV_DONTNEED), so a tensor is never held twice. Measured on the 4-layer V2-Lite
    Q8_0 file: peak RSS 5.05 GiB with every tensor copied and its pages kept, see bench/RESULTS.md."""
    try:
        out = jax.device_put(host, may_alias=env.choice("IKJAX_WEIGHTS") != "copy")
    except TypeError:  # a JAX without may_alias
        out = jax.device_put(host)
    if isinstance(host, np.ndarray) and out.unsafe_buffer_pointer() != host.ctypes.data:
        out.block_until_ready()
        release_pages(host)
    elif isinstance(host, np.ndarray) and not name.startswith("token_embd"):  # a step reads a few rows of it
        populate_pages(host)
    return out


def placer_for(placement: Placement) -> Placer:
    """Put each tensor where the Placement says. On a CPU-only machine (`placement.unified`) every
    place is the one CPU device and `device_put` of the mmapped blocks is zero-copy, so host- and
    device-placed tensors both stay in the file's pages. On an accelerator, device-placed tensors go
    to their device; host-placed routed experts (`ffn_*_exps`) are copied into the pinned host
    memory of the accelerator whose step reads them, one tensor at a time, and the memory map's pages of that
    tensor are released right after (one copy in RAM; both the host-experts custom call and the
    streaming of big batches read it: ikjax.placement.host). With IKJAX_HOST_EXPERTS=mmap they stay
    the memory map's bytes (no copy at all; every batch then runs on the host).
    Any other host-placed tensor next to an accelerator (`-ot "blk\\.1\\.=CPU"`, `-ngl N`) is
    loaded on the host CPU device (stacked and repacked there) and held in its stage device's pinned
    host memory (`TensorLoader`, `host_weights.HostTensor`); steps move it to the device where they
    read it. Several devices (-sm graph, or a split over several CPU devices): ikjax.placement.devices.placer."""
    if placement.split_mode == "graph" or (placement.unified and len(placement.devices) > 1):
        return devices.placer(placement)
    if placement.unified:
        return default_placer
    host = [t for t in placement.tensors if t.on_host and is_routed_expert(t.name)]
    if host:
        why = ops.host_experts_unavailable()
        if why:
            raise OptionError(f"ot: {host[0].name} is placed in host memory ({host[0].rule}), but {why}")
    accel = [d for d in jax.devices() if d.platform != "cpu"]
    by_label = dict(zip(placement.devices, accel))
    pinned = bool(host) and host_form() == "pinned"
    cpu = jax.devices("cpu")[0]

    def place(name: str, data: np.ndarray):
        t = placement[name]
        if t.on_host and not is_routed_expert(name):  # built on the host CPU, pinned by TensorLoader
            return jax.device_put(data, cpu)
        if t.on_host:
            if not pinned:
                return data
            # in the pinned memory of the device whose step reads it (-sm layer: its layer's
            # stage; -mg: the main device): a step takes only its own device's arrays
            return to_pinned(data, accel[placement.stage_device(name)])
        return jax.device_put(data, by_label[t.device])

    place.host_device = lambda name: accel[placement.stage_device(name)]  # whose pinned memory holds it
    return place


def load_weights(gf: GGUFModelFile, cfg: ModelConfig, place: Placer | None = None,
                 placement: Placement | None = None, spans: tuple | None = None,
                 on_shapes: Callable[[Weights], None] | None = None, cancel: Any = None,
                 shapes_only: bool = False) -> Weights:
    """Copy each tensor's bytes from the memory map to where `place` puts it, one tensor at a time.

    `placement` (from `ikjax.placement.rules.plan_placement`) decides where each tensor goes when no
    `place` is given; it stays next to the returned tree (static metadata, never a traced leaf).
    `spans`: the layer groups (ikjax.model.groups.layer_spans; computed here when not given).

    `on_shapes(tree)` is called once the tree's shapes are known, long before its bytes are all
    in: the top-level tensors and the first layer of every group are loaded first (a group's
    stacks take their shapes from its first layer), then `tree` — the weights as
    ShapeDtypeStructs with their shardings, what a step is lowered against — is handed over, and
    the other layers load after. A caller compiles its steps from it while the bytes stream in
    (ikjax.runtime.engine: the load in a thread of its own, issue 22's load/compile overlap).
    `cancel` (a threading.Event): once set, the load stops at the next layer (LoadCancelled).

    `shapes_only`: no bytes and no programs, only the tree `on_shapes` would get, returned: each tensor
    a ShapeDtypeStruct on the device `place` puts it (asked with a zero-size array), each repack or
    stack traced for its shapes (ikjax.programs.abstract). Why: `on_shapes` comes after the top
    tensors' and each group's first layer's programs ran, which on a cold start means compiled
    (2.1 s of a V2-Lite cold start on an H200, RESULTS §22p), and the steps waited for it. Only
    where every tensor is on a device (a host-resident tensor raises AbstractUnavailable)."""
    if place is None:
        place = placer_for(placement) if placement is not None else default_placer
    validate(gf.tensors, cfg, gf.path)
    if spans is None:
        spans = layer_spans(cfg, gf.tensors, placement)
    # -sm graph runs the XLA path on GSPMD-split matrices: no kernel layouts
    graph = placement is not None and placement.split_mode == "graph"
    load = TensorLoader(gf, cfg, place, placement, repack=ops.needs_repack() and not graph)
    load.cancel = cancel
    if shapes_only:
        load.abstract = True
        with programs.abstract():
            weights = load.top()
            groups = [load.group_start(first, count) for first, count in spans]
            return abstract({**weights, "groups": [g.shapes() for g in groups]})
    weights: Weights = load.top()
    groups = [load.group_start(first, count) for first, count in spans]
    if on_shapes is not None:
        on_shapes(abstract({**weights, "groups": [g.shapes() for g in groups]}))
    weights["groups"] = [g.finish() for g in groups]
    return weights


def _abstract_leaf(a):
    if isinstance(a, jax.Array):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
    return a


class AbstractUnavailable(Exception):
    """A load on shapes alone met what it cannot describe without its bytes (a host-resident
    tensor): the caller waits for the real load's shapes instead."""


def same_shapes(a, b) -> bool:
    """Whether two weight trees have the same structure and, leaf by leaf, the same shape, dtype
    and sharding (what a step compiled for one needs of the other)."""
    la, ta = jax.tree.flatten(abstract(a))
    lb, tb = jax.tree.flatten(abstract(b))
    return ta == tb and all((tuple(x.shape), x.dtype, x.sharding) == (tuple(y.shape), y.dtype, y.sharding)
                            for x, y in zip(la, lb))


def abstract(tree):
    """`tree` with every array a ShapeDtypeStruct of its shape, dtype and sharding (what
    `jit.lower` needs of an argument; ShapeDtypeStructs already in it stay)."""
    return jax.tree.map(_abstract_leaf, tree)


class _Stacks:
    """The leaves of a layer group, each stacked on a new leading axis as its layers load (so a
    device holds the stacks and one layer's tensors, never every layer twice). Leaves on the host or
    a CPU device are copied into 64-byte aligned NumPy buffers, which the CPU device then aliases
    (no XLA program, no second copy); leaves on an accelerator are written into zeroed device
    arrays in place, all of a layer's in one donated program (one compile per group, not one per
    tensor: those small compiles were 7 of the 10 s a cold V2-Lite load took on an H100)."""

    def __init__(self, leaves: list, count: int):
        self.count = count
        self.shardings = [getattr(a, "sharding", None) for a in leaves]
        # a load on shapes alone (load_weights(shapes_only=True)): the stacks' ShapeDtypeStructs only,
        # each where `done` puts it (a leaf's sharding, or as device_put picks it)
        self.abstract = [jax.ShapeDtypeStruct((count,) + tuple(a.shape), a.dtype,
                                              sharding=getattr(a, "sharding", None) or _default_sharding(a.dtype))
                         for a in leaves] if programs.is_abstract() else None
        self.on_host = [s is None or all(d.platform == "cpu" for d in s.device_set) for s in self.shardings]
        if self.abstract is not None:
            # on shapes alone: the zeroed stacks' program traced, so that a recording load
            # (programs.recording) has it compiled ahead with the rest; the real load compiled it
            # itself, under the steps' lowering lock (1.4 s of a deep V2-Lite cold start, §22ai)
            specs = tuple(((count,) + tuple(a.shape), np.dtype(a.dtype), self.shardings[k])
                          for k, a in enumerate(leaves) if not self.on_host[k])
            self.dev = list(_zeros(specs)) if specs else []
            return
        self.host: list = [None] * len(leaves)
        dev_specs = []
        for k, a in enumerate(leaves):
            shape, dtype = (count,) + tuple(a.shape), np.dtype(a.dtype)
            if self.on_host[k]:
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                raw = np.empty(nbytes + 64, np.uint8)
                off = -raw.ctypes.data % 64
                self.host[k] = raw[off:off + nbytes].view(dtype).reshape(shape)
            else:
                dev_specs.append((shape, dtype, self.shardings[k]))
        self.dev = list(_zeros(tuple(dev_specs))) if dev_specs else []

    def put(self, j: int, leaves: list) -> None:
        if self.abstract is not None:
            # on shapes alone, one layer's put traced for the recording (the same program puts
            # every layer: the index is an argument)
            dev_leaves = [a for k, a in enumerate(leaves) if not self.on_host[k]]
            if j == 0 and dev_leaves:
                self.dev = list(programs.run("put_layer", _put_layer, (tuple(self.dev), tuple(dev_leaves), np.int32(j))))
            return
        dev_leaves = []
        for k, a in enumerate(leaves):
            if self.on_host[k]:
                src = np.asarray(a)
                self.host[k][j] = src
                release_pages(src)  # the file's pages of a memory-mapped source: one copy kept
            else:
                dev_leaves.append(a)
        if dev_leaves:
            self.dev = list(programs.run("put_layer", _put_layer, (tuple(self.dev), tuple(dev_leaves), np.int32(j))))

    def shapes(self) -> list:
        """The stacks as ShapeDtypeStructs (shape, dtype, sharding), as `done` will give them."""
        if self.abstract is not None:
            return list(self.abstract)
        out, dev = [], iter(self.dev)
        for k in range(len(self.on_host)):
            if not self.on_host[k]:
                a = next(dev)
                out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding))
            else:  # where `done` puts it: its sharding, or (None) the default device, as device_put picks it
                h, sh = self.host[k], self.shardings[k]
                out.append(jax.ShapeDtypeStruct(h.shape, h.dtype, sharding=sh or _default_sharding(h.dtype)))
        return out

    def done(self) -> list:
        out, dev = [], iter(self.dev)
        for k in range(len(self.on_host)):
            if not self.on_host[k]:
                out.append(next(dev))
                continue
            try:
                out.append(jax.device_put(self.host[k], self.shardings[k], may_alias=True))
            except TypeError:  # a JAX without may_alias
                out.append(jax.device_put(self.host[k], self.shardings[k]))
        return out


def _default_sharding(dtype):
    """Where `jax.device_put` of a host array of this type lands (the default device)."""
    return jax.device_put(np.zeros((), dtype)).sharding


def _zeros(specs: tuple):
    """Zeroed arrays of (shape, dtype, sharding) each, in one program (`specs` its static argument,
    which names it in ikjax.programs' store)."""
    zeros = jax.jit(lambda _specs: tuple(jnp.zeros(sh, dt) for sh, dt, _ in _specs), static_argnums=0,
                    out_shardings=tuple(s for _, _, s in specs))
    return programs.run("zeros", zeros, (), (specs,))


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stacks: tuple, leaves: tuple, j):
    return tuple(jax.lax.dynamic_update_index_in_dim(s, a.astype(s.dtype), j, 0) for s, a in zip(stacks, leaves))


# float norms and biases in NumPy: no jitted dequantize per shape at load (each one an XLA
# compile or cache entry, and the JIT state it leaves in the process)
_NP_FLOATS = {"F32": np.float32, "F16": np.float16}


def _dense_float(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A norm, bias (or F32 router) as float32: the file's f32 bytes as they are (a view of the memory map,
    which `place` aliases or copies), f16 converted in NumPy; other types through the dequantizer."""
    np_type = _NP_FLOATS.get(info.qtype.name)
    if np_type is not None:
        return raw.view(np_type).reshape(info.shape).astype(np.float32, copy=False)
    return np.asarray(QuantArray.from_bytes(raw, info.qtype, info.shape).dequantize(jnp.float32))


class TensorLoader:
    """Reads tensors from the file through `place`, the top-level ones (`top`) or one layer's
    (`layer`), stacked (`fuse_rows`) and repacked for the kernels (`repack`) as a step reads them.

    `place(name, bytes)` may return only a part of the bytes (the tensor-parallel loader gives each
    device its slice): the QuantArray then gets the part's shape, the rows and columns it holds."""

    def __init__(self, gf: GGUFModelFile, cfg: ModelConfig, place: Placer, placement: Placement | None,
                 repack: bool, host_arrays: dict | None = None):
        self.gf, self.cfg, self.place, self.placement, self.repack = gf, cfg, place, placement, repack
        # host-resident tensors by name: loaders of several devices share one (ikjax.runtime.mesh),
        # which steps then reach by address only (HostQuantArray.by_address)
        self.host_arrays = {} if host_arrays is None else host_arrays
        self.by_address = host_arrays is not None
        self.hybrid = placement is not None and not placement.unified
        self.min_batch = min_offload_batch(placement.min_offload_batch) if self.hybrid else 0
        # stacking a group on the one CPU device: the file's bytes as they are, copied once into
        # the stack (whose pages the device then aliases), the file's pages released after
        self._raw = False
        self.abstract = False  # load_weights(shapes_only=True): ShapeDtypeStructs, no bytes
        # an F32 router under the C++ kernels: its bytes as an F32 QuantArray, which the decode
        # step's router product reads in place (ops.router_logits); elsewhere a float32 array
        self._f32_bytes = ops.resolve_backend() == "cpu"
        self.cancel = None  # load_weights's `cancel`
        self._prefetcher = None  # `prefetch`'s thread

    def tensor(self, spec: TensorSpec):
        info = self.gf.tensors.get(spec.gguf_name)
        if info is None:
            return None
        raw = self.gf.tensor_bytes(spec.gguf_name)
        if self.abstract:
            return self._abstract_tensor(spec, info, raw)
        place = (lambda name, host: host) if self._raw else self.place
        if self._as_float(spec, info):
            return place(spec.gguf_name, _dense_float(raw, info))
        qa = QuantArray.from_bytes(raw, info.qtype, spec.shape)
        data = place(spec.gguf_name, qa.data)
        if self.hybrid and self.placement[spec.gguf_name].on_host and is_routed_expert(spec.gguf_name):
            # routed experts: the memory map's bytes (or their pinned copy), read by the host kernels
            if spec.gguf_name not in self.host_arrays:
                self.host_arrays[spec.gguf_name] = HostQuantArray(data, qa.qtype, qa.shape, min_batch=self.min_batch,
                                                                  tensor=self.placement[spec.gguf_name],
                                                                  by_address=self.by_address)
            return self.host_arrays[spec.gguf_name]
        shape = qa.shape
        if tuple(data.shape) != tuple(qa.data.shape):  # a part: its rows, and its share of each row
            shape = tuple(data.shape[:-1]) + (qa.shape[-1] * data.shape[-1] // qa.data.shape[-1],)
        return QuantArray(data, qa.qtype, shape)

    def _as_float(self, spec: TensorSpec, info: TensorInfo) -> bool:
        """Whether the tensor loads as a plain float32 array (norms, biases; the F32 router off the
        C++ kernels) rather than a QuantArray of the file's blocks."""
        return spec.dense_float or (spec.f32_as_float and info.qtype.name == "F32" and not self._f32_bytes)

    def _abstract_tensor(self, spec: TensorSpec, info: TensorInfo, raw: np.ndarray):
        """`tensor`'s result as ShapeDtypeStructs: its device asked of `place` with a zero-size array
        of its type (no bytes read)."""
        if self._as_float(spec, info):
            shape, dtype, qa = tuple(info.shape), np.dtype(np.float32), None
        else:
            qa = QuantArray.from_bytes(raw, info.qtype, spec.shape)
            shape, dtype = tuple(qa.data.shape), np.dtype(qa.data.dtype)
        if self.hybrid and self.placement[spec.gguf_name].on_host:
            raise AbstractUnavailable(f"{spec.gguf_name} is placed in host memory")
        probe = self.place(spec.gguf_name, np.zeros((0,), dtype))
        sharding = getattr(probe, "sharding", None)
        if sharding is None:
            raise AbstractUnavailable(f"{spec.gguf_name} stays a host array")
        sds = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return sds if qa is None else QuantArray(sds, qa.qtype, qa.shape)

    def for_kernels(self, tensors: dict) -> dict:
        if not self.repack:
            return tensors
        return ops.prepare_weights(tensors, [k for k in tensors if k in KERNEL_MATRICES])

    def _host_keys(self, specs) -> dict[str, str]:
        """key -> tensor name of the non-expert tensors placed in host memory next to an accelerator."""
        if not self.hybrid or getattr(self.place, "host_device", None) is None:
            return {}
        return {s.key: s.gguf_name for s in specs if s.gguf_name in self.gf.tensors
                and self.placement[s.gguf_name].on_host and not is_routed_expert(s.gguf_name)}

    def _pin(self, tensors: dict, host_keys: dict[str, str]) -> dict:
        """Host-placed non-expert tensors, loaded on the host CPU, into pinned host memory."""
        for k, name in host_keys.items():
            if tensors.get(k) is not None:
                tensors[k] = pin_tree(tensors[k], self.place.host_device(name))
        return tensors

    def top(self) -> dict:
        specs = model_specs(self.cfg)
        weights = self.for_kernels({s.key: self.tensor(s) for s in specs})
        return self._pin(weights, self._host_keys(specs))

    def group(self, first: int, count: int) -> LayerGroup:
        """Layers first .. first + count - 1 as one LayerGroup: a group of one as `layer` loads it,
        a longer one with each leaf stacked as its layers load (`_Stacks`)."""
        return self.group_start(first, count).finish()

    def group_start(self, first: int, count: int) -> "_GroupLoad":
        """A group whose first layer is in (and so its shapes known): `finish()` loads the rest."""
        return _GroupLoad(self, first, count)

    @contextlib.contextmanager
    def raw(self, on: bool):
        """Stacking a group on the one CPU device: `tensor` gives the file's bytes as they are."""
        self._raw = on and self.place is default_placer
        try:
            yield
        finally:
            self._raw = False


    def prefetch(self, i: int) -> None:
        """Fault in layer i's file pages on a thread of its own while this one copies the layer
        before: a copy out of the memory map otherwise takes a page fault every 4 KiB on the
        loading thread (1.5 GiB/s single-threaded on an H100 host, RESULTS §22b)."""
        if env.choice("IKJAX_PREFETCH") == "0":
            return
        names = [s.gguf_name for s in layer_specs(self.cfg, i) if s.gguf_name in self.gf.tensors]
        if self._prefetcher is None:
            from concurrent.futures import ThreadPoolExecutor
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="ikjax-prefetch")
        self._prefetcher.submit(self._populate_cached, names)

    def _populate_cached(self, names: list[str]) -> None:
        """Map the tensors' pages that the page cache holds; leave a file still on disk to the
        loading thread's own sequential reads (a second reader slowed a cold load: v2l-8 from a
        virtual disk, 7.1 s median one reader against 8.9 s two)."""
        for n in names:
            data = self.gf.tensor_bytes(n)
            if cached_fraction(data) > 0.9:
                populate_pages(data)

    def layer(self, i: int) -> dict:
        specs = layer_specs(self.cfg, i)
        tensors = {s.key: v for s in specs if (v := self.tensor(s)) is not None}
        host_keys = self._host_keys(specs)
        # stacking saves a launch per product on accelerators; on the CPU the C++ kernels read the
        # file's own pages, and a stacked copy would only add its bytes to the process (RESULTS §9);
        # a layer with host-placed tensors is not stacked (its parts live on two devices)
        if ops.resolve_backend() != "cpu" and not host_keys:
            tensors = fuse_rows(tensors)
        hot = self.placement.hot(i) if self.placement is not None else ()
        if hot:
            tensors["hot_experts"] = self._hot_experts(i, hot)
        return self._pin(self.for_kernels(tensors), host_keys)

    def _hot_experts(self, i: int, ids: tuple[int, ...]) -> dict:
        """--gpu-experts: copies of layer i's experts `ids` on the GPU beside the host-resident
        tensors, laid out as device-resident experts are (gate/up/down [H, ...], the kernels'
        repack), and `slot` [E] int32: each expert's row in them, -1 where the host computes it
        (ikjax.model.moe.moe_ffn splits the routed picks between the two)."""
        out = {}
        host_device = getattr(self.place, "host_device", None)  # next to an accelerator: its GPU
        device = host_device(f"blk.{i}.ffn_gate_exps.weight") if host_device else jax.devices()[0]
        for key, suffix in (("gate", "ffn_gate_exps.weight"), ("up", "ffn_up_exps.weight"),
                            ("down", "ffn_down_exps.weight")):
            name = f"blk.{i}.{suffix}"
            info = self.gf.tensors[name]
            qa = QuantArray.from_bytes(self.gf.tensor_bytes(name), info.qtype, info.shape)
            rows = np.ascontiguousarray(np.asarray(qa.data)[list(ids)])  # [H, rows, row_bytes]
            out[key] = QuantArray(jax.device_put(rows, device), qa.qtype, (len(ids),) + tuple(info.shape[1:]))
        out = {k: ops.prepare_weight(v) for k, v in out.items()} if self.repack else out
        slot = np.full(self.cfg.n_expert, -1, np.int32)
        slot[list(ids)] = np.arange(len(ids), dtype=np.int32)
        out["slot"] = jax.device_put(slot, device)
        return out


class LoadCancelled(Exception):
    """A load stopped by its caller (load_weights's `cancel`): nobody waits for its weights."""


class _GroupLoad:
    """One layer group as it loads: its first layer at once (a group of one is then whole, a
    longer one has its stacks, `_Stacks`, made from that layer's leaves), the rest in `finish`.
    `shapes()` is the group's tree of ShapeDtypeStructs from the start."""

    def __init__(self, load: TensorLoader, first: int, count: int):
        self.load, self.first, self.count = load, first, count
        self.whole: LayerGroup | None = None
        if count == 1:
            self.whole = LayerGroup(first, 1, load.layer(first))
            return
        with load.raw(True):
            rest, host = _host_parts(load.layer(first))
            leaves, self.tree = jax.tree.flatten(rest)
            self.host = {k: [v] for k, v in host.items()}  # each layer's host-resident experts (HostStack)
            self.stacks = _Stacks(leaves, count)
            self.stacks.put(0, leaves)

    def shapes(self) -> LayerGroup:
        if self.whole is not None:
            return abstract(self.whole)
        if self.host:
            raise AbstractUnavailable(f"layers {self.first}.. hold routed experts in host memory")
        return LayerGroup(self.first, self.count, jax.tree.unflatten(self.tree, self.stacks.shapes()))

    def finish(self) -> LayerGroup:
        if self.whole is not None:
            return self.whole
        first, count = self.first, self.count
        with self.load.raw(True):
            for j in range(1, count):
                if self.load.cancel is not None and self.load.cancel.is_set():
                    raise LoadCancelled(f"load stopped before layer {first + j}")
                if j + 1 < count:
                    self.load.prefetch(first + j + 1)
                rest, host = _host_parts(self.load.layer(first + j))
                leaves, t = jax.tree.flatten(rest)
                if t != self.tree or host.keys() != self.host.keys():
                    raise OptionError(f"layer {first + j} is laid out unlike layer {first} of its group "
                                      f"({t} vs {self.tree}): a bug, please report (IKJAX_LAYERS=unroll runs it)")
                self.stacks.put(j, leaves)
                for k, v in host.items():
                    self.host[k].append(v)
                del leaves
        tensors = jax.tree.unflatten(self.tree, self.stacks.done())
        tensors.update({k: HostStack(v) for k, v in self.host.items()})
        self.whole = LayerGroup(first, count, tensors)
        self.stacks = None
        return self.whole


def _host_parts(tensors: dict) -> tuple[dict, dict]:
    """(a layer's tensors less its routed experts in host memory, those by key): the experts stay
    each layer's own bytes in a scanned group (a HostStack), never stacked into one copy."""
    host = {k: v for k, v in tensors.items() if isinstance(v, HostQuantArray)}
    return {k: v for k, v in tensors.items() if k not in host}, host
