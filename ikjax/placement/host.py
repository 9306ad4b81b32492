"""Tensors that stay in host RAM next to an accelerator (`-ot exps=CPU`, `--cpu-moe`, `--n-cpu-moe`).

A `HostQuantArray` holds a routed-expert tensor's GGUF blocks in host memory, in one of two forms:

- pinned (the default next to a GPU): a `jax.Array` in the GPU's `pinned_host` memory, copied once
  from the memory map at load, tensor by tensor, after which the map's pages of that tensor are
  unmapped (`to_pinned`; the page cache keeps them while memory allows: the next load reads them
  at memory speed), so the process holds one copy. It is a pytree node with one leaf, so a
  jitted step receives it as a parameter in host memory: a big prompt batch streams it to the GPU
  inside the step (`to_device`, the host-offloading transfer XLA overlaps with compute) and runs
  the GPU kernels on it; decode steps never touch the leaf (jit prunes it) — the host-experts
  custom call reads the same bytes through their host address (`host_address`).
- mapped (`IKJAX_HOST_EXPERTS=mmap`, and hand-made arrays): the memory map's NumPy bytes, a pytree
  node with no leaves — jit never sees them, only the host path reads them, for every batch size.

Identity is the static key: two engines' tensors never share a compiled step, and the object
(hence its memory) lives as long as the weight tree holding it. Where an op on it runs is
`ikjax.placement.rules.runs_on` (ik's rule), with the threshold `min_batch` (`min_offload_batch`).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os

import jax
import numpy as np

from ikjax import env
from ikjax.errors import OptionError
from ikjax.placement.rules import MIN_OFFLOAD_BATCH, TensorPlacement, runs_on
from ikjax.quant.array import LogicalShape

# IKJAX_HOST_EXPERTS: "pinned" (default: streamable, one copy shared by both paths) or "mmap"
# (the file's pages, host path for every batch). IKJAX_MIN_OFFLOAD_BATCH: ik's 32 (see runs_on).
HOST_FORMS = ("pinned", "mmap")


def host_form() -> str:
    return env.choice("IKJAX_HOST_EXPERTS")


def min_offload_batch(default: int = MIN_OFFLOAD_BATCH) -> int:
    return env.positive_int("IKJAX_MIN_OFFLOAD_BATCH") if env.raw("IKJAX_MIN_OFFLOAD_BATCH") is not None else default


class HostQuantArray(LogicalShape):
    """GGUF bytes in host memory: `data` uint8 `[..., rows, row_bytes]` (a pinned-host jax.Array,
    or NumPy / memmap), static `qtype`, logical `shape`, its `tensor` placement and the offload
    threshold `min_batch`. Not a QuantArray, so nothing repacks or dequantizes it by accident (the
    Pallas repack and the XLA reference would copy it whole to the device)."""
    __slots__ = ("data", "qtype", "shape", "tensor", "min_batch", "by_address", "whole_ok", "_origin", "_addr")

    def __init__(self, data, qtype, shape: tuple, *, tensor: TensorPlacement | None = None,
                 min_batch: int = MIN_OFFLOAD_BATCH, by_address: bool = False):
        if not isinstance(data, np.ndarray) and not _is_pinned(data):
            raise TypeError(f"HostQuantArray: data must be host NumPy bytes or a pinned_host jax.Array, got "
                            f"{type(data).__name__} {getattr(getattr(data, 'sharding', None), 'memory_kind', '')}")
        self.data, self.qtype, self.shape = data, qtype, tuple(shape)
        self.tensor, self.min_batch = tensor, int(min_batch)
        # by_address: steps reach the bytes only through their host address (the custom calls),
        # never as a step argument: -sm graph, where every device of the mesh reads the one copy
        # (a step argument would have to be one device's array)
        self.by_address = bool(by_address)
        # whole_ok: big batches may move this tensor whole (IKJAX_STREAM=auto's layer form); False
        # where the engine's memory plan has no room for two whole layers on the device
        self.whole_ok = True
        self._origin = None
        self._addr = int(data.ctypes.data) if isinstance(data, np.ndarray) else int(data.unsafe_buffer_pointer())

    @classmethod
    def _view(cls, origin: "HostQuantArray", data) -> "HostQuantArray":
        """The node rebuilt around a traced (or replaced) leaf; host facts come from `origin`."""
        v = object.__new__(cls)
        v.data, v.qtype, v.shape, v.tensor, v.min_batch = data, origin.qtype, origin.shape, origin.tensor, origin.min_batch
        v.by_address, v.whole_ok, v._origin, v._addr = origin.by_address, origin.whole_ok, origin, origin._addr
        return v

    @property
    def streamable(self) -> bool:
        """Held as a pinned-host jax.Array that steps take as an argument: a step can move the
        whole tensor to the device (IKJAX_STREAM=layer) or copy the experts a batch uses."""
        return self.pinned and not self.by_address

    @property
    def pinned(self) -> bool:
        """Held in pinned host memory (not the memory map's pages): the stream_experts custom call
        copies a batch's experts from its address to any GPU at the link's speed, also by address."""
        return not isinstance(self.data, np.ndarray)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape))

    def host_address(self) -> int:
        """Address of the first byte in host memory (C-contiguous), for the host-experts kernel."""
        return self._addr

    def runs_on(self, n_tokens: int, n_expert: int, n_expert_used: int) -> str:
        """"device" or "host" for an expert op over `n_tokens` tokens (`ikjax.placement.rules.runs_on`)."""
        t = self.tensor or TensorPlacement("ffn_gate_exps.weight", "host", "CPU", None, None, self.nbytes, "")
        return runs_on([t], n_tokens, n_expert=n_expert, n_expert_used=n_expert_used, min_batch=self.min_batch)

    def to_device(self):
        """Inside a jitted step: the blocks moved to the device (host-to-device transfer in the
        step, scheduled by XLA), as a QuantArray the GPU kernels read."""
        from ikjax.quant.array import QuantArray
        if not self.streamable:
            raise OptionError(f"{self!r}: memory-mapped host tensors are computed on the host only "
                              f"(IKJAX_HOST_EXPERTS=mmap); pinned ones stream to the device")
        return QuantArray(jax.device_put(self.data, jax.memory.Space.Device), self.qtype, self.shape)

    def dequantize(self, dtype=None):
        raise OptionError(f"a host-resident {self.qtype.name} tensor {self.shape} was read by an op that has no "
                          f"host path (only routed experts run from host memory next to an accelerator)")

    def __repr__(self) -> str:
        form = ("pinned" if self.pinned else "mapped") + (", by address" if self.by_address else "")
        return f"HostQuantArray({self.qtype.name}, shape={self.shape}, nbytes={self.nbytes}, {form})"


def _is_pinned(a) -> bool:
    return getattr(getattr(a, "sharding", None), "memory_kind", None) == "pinned_host"


class _Key:
    """Static pytree aux data: equal only to itself (the bytes are never compared)."""
    __slots__ = ("obj",)

    def __init__(self, obj: HostQuantArray):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return repr(self.obj)


def _flatten(h: HostQuantArray):
    origin = h._origin or h
    return ((h.data,), _Key(origin)) if origin.streamable else ((), _Key(origin))  # by_address: no leaf


def _unflatten(key: _Key, leaves):
    return HostQuantArray._view(key.obj, leaves[0]) if leaves else key.obj


jax.tree_util.register_pytree_node(HostQuantArray, _flatten, _unflatten)


class HostStack:
    """One routed-expert tensor of a scanned group of host layers (ikjax.model.groups): each
    layer's HostQuantArray, as loaded (never copied into one stack: R1's are 2 GB a tensor a layer).
    A pytree node with no leaves, static, equal where it holds the same arrays (the devices of a
    -sm graph mesh each load the group, sharing the arrays). Inside the group's scan the step
    reads layer j through `at(j)`: the host calls then carry every layer's slot and j (a traced
    index), so one loop body serves every layer. Only forms the calls reach by address stack so:
    never the whole-layer or XLA-copy streaming forms, which take a layer's bytes as a step
    argument (`groups.stacks_host_layers`)."""
    __slots__ = ("arrays",)

    def __init__(self, arrays):
        self.arrays = tuple(arrays)
        first = self.arrays[0]
        if any((a.qtype, a.shape, a.nbytes) != (first.qtype, first.shape, first.nbytes) for a in self.arrays):
            raise ValueError(f"HostStack: the layers' tensors differ in type or shape: {self.arrays}")

    def __len__(self) -> int:
        return len(self.arrays)

    def __eq__(self, other) -> bool:
        return isinstance(other, HostStack) and _stack_key(other) == _stack_key(self)

    def __hash__(self) -> int:
        return hash(_stack_key(self))

    def at(self, j) -> "HostLayer":
        """Layer j (an int or a traced int32) of the stack, as the ops read it."""
        return HostLayer(self, j)

    def __repr__(self) -> str:
        return f"HostStack({len(self.arrays)} x {self.arrays[0]!r})"


def _stack_key(h: HostStack):
    return tuple(_Key(a) for a in h.arrays)


jax.tree_util.register_pytree_node(HostStack, lambda h: ((), _stack_key(h)),
                                   lambda key, _: HostStack([k.obj for k in key]))


class HostLayer(HostQuantArray):
    """Layer `layer_index` (traced) of a HostStack inside a scanned step: a HostQuantArray to every
    op (type, logical shape, placement, offload threshold of the stack's layers), whose host calls
    name all the stack's layers (`host_layers`) and pick one by the index at run time. Never
    streamable as a step argument (no bytes of its own), never moved whole (`whole_ok` False)."""
    __slots__ = ("stack", "layer_index")

    def __init__(self, stack: HostStack, j):
        first = stack.arrays[0]
        self.stack, self.layer_index = stack, j
        self.data, self.qtype, self.shape = None, first.qtype, first.shape
        self.tensor, self.min_batch, self.by_address = first.tensor, first.min_batch, first.by_address
        self.whole_ok, self._origin, self._addr = False, None, 0

    @property
    def host_layers(self) -> tuple:
        return self.stack.arrays

    @property
    def streamable(self) -> bool:
        return False

    @property
    def pinned(self) -> bool:
        return self.stack.arrays[0].pinned

    @property
    def nbytes(self) -> int:
        return self.stack.arrays[0].nbytes

    def host_address(self) -> int:
        raise TypeError("a scanned group's host tensor has one address a layer (host_layers), picked at run time")

    def __repr__(self) -> str:
        return f"HostLayer({self.stack!r})"


jax.tree_util.register_pytree_node(HostLayer, lambda h: ((h.layer_index,), h.stack),
                                   lambda stack, c: HostLayer(stack, c[0]))


def is_host_resident(t) -> bool:
    """A routed-expert tensor held in host memory: one layer's (HostQuantArray, HostLayer) or a
    scanned group's (HostStack)."""
    return isinstance(t, (HostQuantArray, HostStack))


def to_pinned(data: np.ndarray, device) -> jax.Array:
    """One tensor's bytes copied into `device`'s pinned host memory, waited for, then the source's
    memory-mapped pages unmapped (`release_pages`): the process holds one copy, and the page cache
    keeps the file's pages while memory allows, as ik leaves its map, so the next load reads them at
    memory speed (a second R1-16 -ot load whose pages had been evicted read 78.6 GB from the disk at
    0.65 GB/s: RESULTS §25g)."""
    from jax.sharding import SingleDeviceSharding
    out = jax.device_put(data, SingleDeviceSharding(device, memory_kind="pinned_host"))
    out.block_until_ready()
    release_pages(data)
    return out


_MADV_DONTNEED, _MADV_POPULATE_READ = 4, 22


@functools.cache
def _libc():
    """The C library with madvise and mincore typed (Linux: the callers check `_file_pages` first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return libc


def _file_pages(data: np.ndarray, inner: bool = False) -> tuple[int, int] | None:
    """(start, length) of the pages under `data` where they are a file's mapped pages on Linux
    (never madvise anonymous memory: that would zero it), else None: every page it touches, or
    (`inner`) the whole pages inside it only."""
    if not hasattr(os, "sched_getaffinity") or not _is_mapped(data) or data.nbytes == 0:  # not Linux / a file
        return None
    page = mmap.PAGESIZE
    a0 = int(data.ctypes.data)
    a1 = a0 + int(data.nbytes)
    lo, hi = (-(-a0 // page) * page, a1 // page * page) if inner else (a0 // page * page, a1)
    return (lo, hi - lo) if hi > lo else None


def populate_pages(data: np.ndarray) -> bool:
    """Fault in the file pages under `data` now (MADV_POPULATE_READ, Linux >= 5.14; best effort):
    a step that reads weights aliased from the memory map then takes no page fault per 4 KiB, which
    otherwise lands in the first generated tokens."""
    span = _file_pages(data)
    return span is not None and _libc().madvise(*span, _MADV_POPULATE_READ) == 0


def cached_fraction(data: np.ndarray) -> float:
    """The share of the file pages under `data` in the page cache now (mincore; 0.0 where that
    cannot be asked): mapping cached pages ahead of a reader pays, reading uncached ones from a
    second thread competes with the reader's own sequential reads (`TensorLoader.prefetch`)."""
    span = _file_pages(data)
    if span is None:
        return 0.0
    n = -(-span[1] // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    if _libc().mincore(*span, vec) != 0:
        return 0.0
    return float((np.frombuffer(vec, np.uint8) & 1).sum()) / n


def _is_mapped(data: np.ndarray) -> bool:
    """Whether `data` is a view of a memory-mapped file (never madvise anonymous memory: that
    would zero it)."""
    b = data
    while b is not None:
        if isinstance(b, mmap.mmap):
            return True
        b = b.base if isinstance(b, np.ndarray) else getattr(b, "obj", None) if isinstance(b, memoryview) else None
    return False


def release_pages(data: np.ndarray) -> int:
    """Give back the memory-mapped pages under `data` once its bytes live elsewhere: MADV_DONTNEED
    unmaps them from this process; they stay in the page cache for the next load (clean pages the
    kernel reclaims when memory is short). Only whole pages inside the range; reading `data` again
    faults them back in from the file. Returns the bytes released (0 where not Linux)."""
    span = _file_pages(data, inner=True)
    if span is None:
        return 0
    libc = _libc()
    if libc.madvise(*span, _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) on {span[1]} mapped bytes: {os.strerror(err)}")
    return span[1]


class HostTensor:
    """Any other tensor placed in host memory next to an accelerator (`-ot "blk\\.[0-9]\\.=CPU"`,
    `-ngl N`): its loaded form (QuantArray, kernel layout, or float array; built on the host CPU)
    held in the accelerator's pinned host memory, one copy. Only routed experts have host kernels,
    so a step moves the tensor to the device where it reads it (`fetch`: a host-to-device transfer
    inside the step, as the expert streaming does), every step — correct at whatever speed the
    link gives; the device holds it only while the op runs."""
    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self) -> str:
        return f"HostTensor({self.inner!r})"


jax.tree_util.register_pytree_node(HostTensor, lambda h: ((h.inner,), None), lambda _, c: HostTensor(c[0]))


def fetch(x):
    """Inside a step: a HostTensor's content moved to the device (anything else as it is)."""
    if isinstance(x, HostTensor):
        return jax.tree_util.tree_map(lambda a: jax.device_put(a, jax.memory.Space.Device), x.inner)
    return x


def fetch_all(tree: dict) -> dict:
    """`fetch` of each entry of a layer's (or the top-level) weight dict."""
    return {k: fetch(v) for k, v in tree.items()} if any(isinstance(v, HostTensor) for v in tree.values()) else tree


def pin_tree(tree, device):
    """A loaded tensor (any pytree of host or device arrays) copied into `device`'s pinned host
    memory, as a HostTensor."""
    from jax.sharding import SingleDeviceSharding
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    out = jax.tree_util.tree_map(lambda a: jax.device_put(a, pinned), tree)
    jax.block_until_ready(out)
    return HostTensor(out)
