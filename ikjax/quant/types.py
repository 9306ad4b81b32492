"""The table of GGML tensor types: id, name, block geometry, bytes per row.

Standard ids come from the `gguf` package; ik_llama.cpp's own ids (IQ4_K, IQ4_KS, the `_R4`
row-interleaved types, ...) are added here because `gguf` rejects them.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ikjax.errors import ModelFileError


class UnsupportedQuantType(ModelFileError):
    """A tensor type this build cannot dequantize (message names tensor and type). A ModelFileError
    (so an IkjaxError and a ValueError): a file of such a type is refused with its one line."""


@dataclass(frozen=True)
class QuantType:
    """Geometry of one GGML type.

    block_elems: weights per block; block_bytes: bytes per block;
    row_meta_bytes: bytes stored once per row before the blocks (ik's *_KS types keep a row scale);
    interleave: rows interleaved together (ik's _R4/_R8 types), 1 for plain types.
    """
    name: str
    type_id: int
    block_elems: int
    block_bytes: int
    row_meta_bytes: int = 0
    interleave: int = 1

    @property
    def layout_known(self) -> bool:
        """False for ik's ids whose block struct ikjax does not record (ik_types registers them with
        block_bytes 0 so the name still reports): their size cannot be computed at all."""
        return self.block_bytes > 0

    def row_bytes(self, n_per_row: int) -> int:
        if not self.layout_known:
            # the placeholder block of 2**30 weights would say "row of 512 is not a multiple of
            # 1073741824", as if the shape were wrong: the type is what ikjax does not know
            raise UnsupportedQuantType(f"type id {self.type_id} ({self.name}): ikjax does not know this "
                                       f"type's block layout, so it cannot size or read the tensor")
        if n_per_row % self.block_elems:
            raise ValueError(f"{self.name}: row of {n_per_row} is not a multiple of {self.block_elems}")
        return self.row_meta_bytes + n_per_row // self.block_elems * self.block_bytes


def _standard_types() -> dict[int, QuantType]:
    table = {}
    for t in GGMLQuantizationType:
        be, bb = GGML_QUANT_SIZES[t]
        table[int(t)] = QuantType(t.name, int(t), be, bb)
    return table


# ik_llama.cpp-only ids (ggml/include/ggml.h of ik_llama.cpp); filled in by ikjax.quant.ik_types.
QUANT_TYPES: dict[int, QuantType] = _standard_types()
QUANT_TYPES_BY_NAME: dict[str, QuantType] = {q.name: q for q in QUANT_TYPES.values()}


def register(qt: QuantType) -> None:
    QUANT_TYPES[qt.type_id] = qt
    QUANT_TYPES_BY_NAME[qt.name] = qt


def lookup(type_id: int) -> QuantType | None:
    """The type for a raw id, or None if unknown (the caller names the tensor in its error)."""
    return QUANT_TYPES.get(int(type_id))


def by_name(name: str) -> QuantType:
    try:
        return QUANT_TYPES_BY_NAME[name.upper()]
    except KeyError:
        raise UnsupportedQuantType(f"unknown tensor type {name!r}") from None
