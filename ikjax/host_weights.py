"""Tensors that stay in host RAM next to an accelerator (`-ot exps=CPU`, `--cpu-moe`, `--n-cpu-moe`).

A `HostQuantArray` holds a tensor's GGUF bytes exactly as the file's memory map has them (a NumPy
view: no copy in RAM, nothing on the device). It sits in the weight tree like a QuantArray but is a
pytree node with no leaves: jit never sees its bytes, so they are never transferred to the device
or baked into a compiled step as a constant. Only ops written for host-resident weights read it —
today the routed experts (`ikjax.kernels.moe_experts` → the CUDA host-experts custom call, which
gets the bytes' host address). Identity is its static key: two engines' tensors never share a
compiled step, and the object (hence the memory map) lives as long as the weight tree holding it.
"""
from __future__ import annotations

import jax
import numpy as np

from ikjax.errors import OptionError


class HostQuantArray:
    """GGUF bytes in host memory: `data` uint8 `[..., rows, row_bytes]` (NumPy / memmap), static
    `qtype` and logical `shape`, as QuantArray; not a QuantArray, so nothing repacks or dequantizes
    it by accident (the Pallas repack and the XLA reference would copy it to the device)."""
    __slots__ = ("data", "qtype", "shape")

    def __init__(self, data: np.ndarray, qtype, shape: tuple):
        if not isinstance(data, np.ndarray):
            raise TypeError(f"HostQuantArray: data must be a host NumPy array, got {type(data).__name__}")
        self.data, self.qtype, self.shape = data, qtype, tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def n_per_row(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    def dequantize(self, dtype=None):
        raise OptionError(f"a host-resident {self.qtype.name} tensor {self.shape} was read by an op that has no "
                          f"host path (only routed experts run from host memory next to an accelerator)")

    def __repr__(self) -> str:
        return f"HostQuantArray({self.qtype.name}, shape={self.shape}, nbytes={self.nbytes})"


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


jax.tree_util.register_pytree_node(HostQuantArray, lambda h: ((), _Key(h)), lambda key, _: key.obj)


def is_host_resident(t) -> bool:
    return isinstance(t, HostQuantArray)
