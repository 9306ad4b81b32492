"""QuantArray: GGUF quantized bytes as a JAX pytree, dequantized on demand (inside jit)."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .dequant import dequantize as _dequantize
from .types import QuantType


class LogicalShape:
    """What a quantized tensor's logical `shape` [..., rows, n_per_row] says, for every form of one
    (QuantArray, a LayerSlice of a stack, ikjax.placement.host.HostQuantArray)."""
    __slots__ = ()
    shape: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def n_per_row(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True)
class QuantArray(LogicalShape):
    """One leaf `data` (uint8 `[..., rows, row_bytes]` as laid in the file; numpy, memmap or jax);
    static `qtype` and logical `shape` `[..., rows, n_per_row]`."""
    data: object
    qtype: QuantType = field(metadata=dict(static=True))
    shape: tuple = field(metadata=dict(static=True))

    @classmethod
    def from_bytes(cls, raw, qtype: QuantType, shape) -> "QuantArray":
        """Wrap raw bytes (any shape holding exactly the tensor's bytes) as `[..., rows, row_bytes]`."""
        shape = tuple(int(s) for s in shape)
        if len(shape) < 1:
            raise ValueError(f"{qtype.name}: a quantized tensor needs at least one dimension, got {shape}")
        n_per_row = shape[-1]
        rb = qtype.row_bytes(n_per_row)
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        if getattr(raw, "dtype", None) != np.uint8:
            raise ValueError(f"{qtype.name}: expected uint8 bytes, got dtype {getattr(raw, 'dtype', type(raw))}")
        size = int(np.prod(raw.shape, dtype=np.int64))
        if size != rows * rb:
            raise ValueError(f"{qtype.name} tensor of shape {shape}: expected {rows * rb} bytes "
                             f"({rows} rows x {rb}), got {size}")
        if qtype.interleave > 1 and len(shape) > 1 and shape[-2] % qtype.interleave:
            raise ValueError(f"{qtype.name}: {shape[-2]} rows is not a multiple of the interleave {qtype.interleave}")
        byte_shape = shape[:-1] + (rb,) if len(shape) > 1 else (1, rb)
        if tuple(raw.shape) != byte_shape:
            raw = raw.reshape(byte_shape)
        return cls(raw, qtype, shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape, dtype=np.int64))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        out = _dequantize(self.data, self.qtype, self.n_per_row, dtype)
        return out.reshape(self.shape)

    def __repr__(self) -> str:
        return f"QuantArray({self.qtype.name}, shape={self.shape}, nbytes={self.nbytes})"


jax.tree_util.register_dataclass(QuantArray)


@dataclass(frozen=True)
class LayerSlice(LogicalShape):
    """Layer `index` of a stacked weight: `stack` a QuantArray (or the Pallas repack, or any
    pytree of arrays) whose every array has a leading axis of layers, `index` an int32 scalar —
    inside a scanned layer group (ikjax.model.groups) the scan's traced index.

    Why not slice it: a dynamic slice that feeds a custom call is a copy, so every kernel (C++
    on CPUs, Pallas on GPUs) would copy every weight of every layer on every step (a scanned 61-
    layer tiny model decoded at half the unrolled speed that way). The kernels take the stack and
    the index and read the layer in place; the XLA forms slice it (`get`), which XLA fuses into
    the dequantize that reads it. `shape` and `qtype` are the layer's (a stacked QuantArray keeps
    its per-layer logical shape)."""
    stack: object
    index: object

    @property
    def shape(self) -> tuple:
        s = self.stack.shape
        return s[1:] if isinstance(self.stack, jax.Array) else s  # a plain array's leading axis is the layers'

    @property
    def qtype(self):
        return self.stack.qtype

    def get(self):
        """The layer as its own weight (a slice of each array: XLA fuses it into its reader)."""
        return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, keepdims=False),
                                      self.stack)

    @property
    def data(self):
        return self.get().data

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.get().dequantize(dtype)

    def __repr__(self) -> str:
        return f"LayerSlice({self.stack!r})"


jax.tree_util.register_dataclass(LayerSlice, data_fields=["stack", "index"], meta_fields=[])


def stacked_operands(w):
    """(bytes [L, ..., rows, row_bytes], layer index int32 scalar) for a kernel that reads one layer
    of a stack in place: a LayerSlice's stack and index, or a single weight as a stack of one
    (a reshape, no copy) at index 0."""
    if isinstance(w, LayerSlice):
        return jnp.asarray(w.stack.data), jnp.asarray(w.index, jnp.int32)
    data = jnp.asarray(w.data)
    return data.reshape((1,) + tuple(data.shape)), jnp.zeros((), jnp.int32)
