"""QuantArray: GGUF quantized bytes as a JAX pytree, dequantized on demand (inside jit)."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .dequant import dequantize as _dequantize
from .types import QuantType


@dataclass(frozen=True)
class QuantArray:
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
    def n_per_row(self) -> int:
        return self.shape[-1]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape, dtype=np.int64))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        out = _dequantize(self.data, self.qtype, self.n_per_row, dtype)
        return out.reshape(self.shape)

    def __repr__(self) -> str:
        return f"QuantArray({self.qtype.name}, shape={self.shape}, nbytes={self.nbytes})"


jax.tree_util.register_dataclass(QuantArray)
