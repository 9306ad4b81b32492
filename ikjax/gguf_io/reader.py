"""Open GGUF files without reading tensor data: header, metadata and tensor table only.

Why our own parser: `gguf.GGUFReader` rejects ik_llama.cpp's type ids and builds a NumPy view per
metadata string (7 s to open a file carrying DeepSeek's 129k-token vocabulary). Here string arrays
are indexed lazily, tensor data stays in a read-only memory map, and split files
(`name-00001-of-00005.gguf`) open as one model.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ikjax.errors import ModelFileError
from ikjax.quant.types import QuantType, lookup

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class StringArray:
    """A metadata array of strings, decoded only when read (tokenizer vocabularies are large)."""

    def __init__(self, buf: memoryview, offsets: np.ndarray, lengths: np.ndarray):
        self._buf, self._offsets, self._lengths = buf, offsets, lengths

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> str:
        o = int(self._offsets[i])
        return bytes(self._buf[o:o + int(self._lengths[i])]).decode("utf-8", errors="replace")

    def tolist(self) -> list[str]:
        return [self[i] for i in range(len(self))]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies. `shape` is NumPy order (GGUF's ne reversed): [..., rows, n_per_row]."""
    name: str
    type_id: int
    qtype: QuantType | None
    shape: tuple[int, ...]
    path: str
    offset: int  # absolute byte offset in `path`
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.qtype.name if self.qtype else f"type id {self.type_id}"


class _Cursor:
    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelFileError(f"{self.path}: truncated GGUF header (ends at byte {len(self.buf)})")
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"{self.path}: truncated GGUF header (string runs past end of file)")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[itype]).newbyteorder("<")
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise ModelFileError(f"{self.path}: truncated GGUF header (array runs past end of file)")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos = end
                return arr
            if itype == _STRING:
                return self._string_array(count)
            return [self.value(itype) for _ in range(count)]
        raise ModelFileError(f"{self.path}: unknown GGUF metadata value type {vtype}")

    def _string_array(self, count: int) -> StringArray:
        offsets = np.empty(count, np.int64)
        lengths = np.empty(count, np.int64)
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > end:
                raise ModelFileError(f"{self.path}: truncated GGUF header (string array)")
            n = unpack(buf, pos)[0]
            offsets[i], lengths[i] = pos + 8, n
            pos += 8 + n
        if pos > end:
            raise ModelFileError(f"{self.path}: truncated GGUF header (string array)")
        self.pos = pos
        return StringArray(buf, offsets, lengths)


class GGUFShard:
    """One GGUF file: metadata and tensor table parsed, data left in the memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            fd = open(self.path, "rb")
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open: {e.strerror}") from None
        with fd:
            size = os.fstat(fd.fileno()).st_size
            if size < 24:
                raise ModelFileError(f"{self.path}: not a GGUF file ({size} bytes)")
            self._mmap = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._mmap)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf, self.path)
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            ne = [cur.unpack("<Q") for _ in range(n_dims)]
            type_id, rel = cur.unpack("<I"), cur.unpack("<Q")
            raw_infos.append((name, ne, type_id, rel))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel in raw_infos:
            qt = lookup(type_id)
            shape = tuple(int(n) for n in reversed(ne)) or (1,)
            nbytes = _tensor_nbytes(qt, shape, self.path, name) if qt else 0
            info = TensorInfo(name, type_id, qt, shape, self.path, data_start + rel, nbytes)
            if info.offset + nbytes > size:
                raise ModelFileError(
                    f"{self.path}: truncated: tensor {name} needs bytes up to {info.offset + nbytes}, "
                    f"file has {size}")
            self.tensors[name] = info

    def bytes_of(self, info: TensorInfo) -> np.ndarray:
        """A read-only uint8 view of the tensor's bytes, shaped [..., rows, row_bytes]."""
        rows_shape = info.shape[:-1]
        row_bytes = info.nbytes // max(1, int(np.prod(rows_shape)))
        arr = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return arr.reshape(*rows_shape, row_bytes)


def _tensor_nbytes(qt: QuantType, shape: tuple[int, ...], path: str, name: str) -> int:
    n_per_row = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    try:
        return rows * qt.row_bytes(n_per_row)
    except ValueError as e:
        raise ModelFileError(f"{path}: tensor {name}: {e}") from None


_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: str | os.PathLike) -> list[str]:
    """All shards of a split model given any one of them (llama.cpp's gguf-split naming)."""
    p = Path(path)
    m = _SPLIT_RE.match(p.name)
    if not m:
        return [str(p)]
    count = int(m.group("count"))
    return [str(p.with_name(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf")) for i in range(1, count + 1)]


class GGUFModelFile:
    """A model's GGUF file or its split shards, seen as one: metadata of the first shard, all tensors."""

    def __init__(self, path: str | os.PathLike):
        paths = split_paths(path)
        missing = [p for p in paths if not os.path.exists(p)]
        if missing and len(paths) == 1:
            raise ModelFileError(f"{path}: cannot open: no such file")
        if missing:
            raise ModelFileError(f"{path}: split model is missing shard {missing[0]}")
        self.shards = [GGUFShard(p) for p in paths]
        self.path = str(path)
        self.metadata = dict(self.shards[0].metadata)
        declared = int(self.metadata.get("split.count", 1))
        if declared != len(self.shards):
            raise ModelFileError(f"{path}: split.count is {declared} but {len(self.shards)} shard file(s) found")
        self.tensors: dict[str, TensorInfo] = {}
        self._shard_of: dict[str, GGUFShard] = {}
        for shard in self.shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise ModelFileError(f"{path}: tensor {name} appears twice")
                self.tensors[name] = info
                self._shard_of[name] = shard

    def tensor_bytes(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.qtype is None:
            raise ModelFileError(f"{self.path}: tensor {name} has unknown type id {info.type_id}")
        return self._shard_of[name].bytes_of(info)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")
