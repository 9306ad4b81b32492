"""Open GGUF files without reading tensor data: header, metadata and tensor table only.

Why our own parser: `gguf.GGUFReader` rejects ik_llama.cpp's type ids and builds a NumPy view per
metadata string (7 s to open a file carrying DeepSeek's 129k-token vocabulary). Here string arrays
are indexed lazily, tensor data stays in a read-only memory map, and split files
(`name-00001-of-00005.gguf`) open as one model.

The format is enforced, so a damaged file is refused with one line instead of loading as some
other model: regular files only; every count and length checked against the bytes left before it
allocates anything; no duplicate key or tensor name; a power-of-two integer alignment; tensors of
1-4 positive dims, aligned, inside the file and packed without overlap or gap; split keys that agree
with the shards; and (deepseek2) metadata and tensor table checked against each other by ModelConfig.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import stat
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


_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# Fewest bytes one value of each type takes: what a count is checked against before it is trusted.
_MIN_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
GGML_MAX_DIMS = 4
MAX_ARRAY_ITEMS = 1 << 24  # a metadata array's items: 60x the largest vocabularies (Kimi K2: 163,840 tokens)
GGML_MAX_NAME = 64  # ggml's limit, terminating NUL included: llama.cpp refuses longer tensor names
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one ne, type, offset
_INT64_MAX = (1 << 63) - 1


def type_name(vtype: int) -> str:
    return _TYPE_NAMES.get(vtype, f"type {vtype}")


class _Cursor:
    """Reads the header front to back. Every count or length read from the file is checked against
    the bytes left before it is used to allocate or loop, so a damaged count fails at once."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {what}")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, count: int, each: int, what: str) -> None:
        """`count` items of at least `each` bytes must fit in what is left of the file."""
        if count * each > self.left():
            raise self.fail(f"truncated or damaged GGUF header: {what} {count} at byte {self.pos} needs at least "
                            f"{count * each} bytes, {self.left()} left in the file")

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.fail(f"truncated GGUF header (ends at byte {len(self.buf)})")
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def raw_string(self, what: str) -> bytes:
        n = self.unpack("<Q")
        if n > self.left():
            raise self.fail(f"truncated or damaged GGUF header: {what} of {n} bytes at byte {self.pos - 8} runs past "
                            f"the end of the file ({self.left()} bytes left)")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def name(self, what: str) -> str:
        """A metadata key or tensor name: non-empty, valid UTF-8 (a damaged name must not match another)."""
        at = self.pos
        raw = self.raw_string(what)
        if not raw:
            raise self.fail(f"empty {what} at byte {at}")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {at} is not valid UTF-8: {raw[:64]!r}") from None

    def value(self, vtype: int, key: str) -> Any:
        if vtype == 7:  # bool: GGUF stores 0 or 1
            b = self.unpack("<B")
            if b > 1:
                raise self.fail(f"metadata {key}: bool byte {b} at byte {self.pos - 1} is neither 0 nor 1")
            return bool(b)
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.raw_string(f"metadata {key} string").decode("utf-8", errors="replace")
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype not in _MIN_BYTES:
                raise self.fail(f"metadata {key}: unknown GGUF array item type {itype}")
            self.need(count, _MIN_BYTES[itype], f"metadata {key}: array of {type_name(itype)} count")
            if itype == _ARRAY:  # (ggml's reader refuses them too; 3000 levels were a RecursionError)
                raise self.fail(f"metadata {key}: an array of arrays (not supported)")
            if count > MAX_ARRAY_ITEMS:  # (a damaged count in a big file allocated gigabytes before failing)
                raise self.fail(f"metadata {key}: an array of {count} items (at most {MAX_ARRAY_ITEMS} are read: a "
                                f"damaged count?)")
            if itype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[itype]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr
            if itype == _STRING:
                return self._string_array(count, key)
            return [self.value(itype, key) for _ in range(count)]
        raise self.fail(f"metadata {key}: unknown GGUF metadata value type {vtype}")

    def _string_array(self, count: int, key: str) -> StringArray:
        offsets = np.empty(count, np.int64)  # count * 8 bytes: already checked against the file
        lengths = np.empty(count, np.uint64)  # holds any stored length; one past the end fails below
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > end:
                raise self.fail(f"truncated or damaged GGUF header: metadata {key}: string {i} of {count} starts "
                                f"past the end of the file")
            n = unpack(buf, pos)[0]
            offsets[i], lengths[i] = pos + 8, n  # pos + 8 <= end here, so the offset fits
            pos += 8 + n
        if pos > end:
            raise self.fail(f"truncated or damaged GGUF header: metadata {key}: the last of its {count} strings "
                            f"runs past the end of the file")
        start = self.pos
        self.pos = pos
        # the strings' bytes copied out of the file's map (a vocabulary's few MiB, once): an array kept by the
        # tokenizer would otherwise hold the map, and with it the file, open after `Engine.close`
        return StringArray(memoryview(bytes(buf[start:pos])), offsets - start, lengths)


def _file_size(path: str) -> int:
    """Size of a regular file; anything else (FIFO, directory, device) is refused before it is opened,
    since opening or reading a FIFO blocks forever and a device has no fixed contents."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot open: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ModelFileError(f"{path}: not a regular file ({kind}); a GGUF model must be a file")
    return st.st_size


class GGUFShard:
    """One GGUF file: metadata and tensor table parsed and checked, data left in the memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        size = _file_size(self.path)
        if size < 24:
            raise ModelFileError(f"{self.path}: not a GGUF file ({size} bytes)")
        try:
            fd = open(self.path, "rb")
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open: {e.strerror}") from None
        with fd:
            if not stat.S_ISREG(os.fstat(fd.fileno()).st_mode):  # replaced between stat and open
                raise ModelFileError(f"{self.path}: not a regular file")
            st = os.fstat(fd.fileno())
            size = self.size = st.st_size
            # what the file was when mapped: `GGUFModelFile.check_unchanged` compares against it
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            try:
                self._mmap = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise ModelFileError(f"{self.path}: cannot map the file: {e}") from None
        buf = memoryview(self._mmap)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf, self.path)
        cur.pos = 4
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        cur.need(n_kv, _MIN_KV_BYTES, "metadata count")
        cur.need(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor count")
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for _ in range(n_kv):
            key = cur.name("metadata key")
            if key in self.metadata:
                raise ModelFileError(f"{self.path}: metadata key {key} appears twice")
            vtype = cur.unpack("<I")
            self.metadata[key] = cur.value(vtype, key)
            self.metadata_types[key] = vtype
        cur.need(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor count")
        align = self._alignment()
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.name("tensor name")
            if len(name.encode()) >= GGML_MAX_NAME:
                raise ModelFileError(f"{self.path}: tensor name {name[:80]!r} is longer than ggml's "
                                     f"{GGML_MAX_NAME - 1} bytes")
            n_dims = cur.unpack("<I")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise ModelFileError(f"{self.path}: tensor {name} has {n_dims} dimensions (GGUF allows 1 to "
                                     f"{GGML_MAX_DIMS})")
            cur.need(n_dims, 8, f"tensor {name} dimension count")
            ne = list(struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos))
            cur.pos += 8 * n_dims
            if min(ne) < 1 or math.prod(ne) > _INT64_MAX:
                raise ModelFileError(f"{self.path}: tensor {name} has impossible dimensions {ne}")
            type_id, rel = cur.unpack("<I"), cur.unpack("<Q")
            raw_infos.append((name, ne, type_id, rel))
        data_start = (cur.pos + align - 1) // align * align
        self.data_start = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel in raw_infos:
            if name in self.tensors:
                raise ModelFileError(f"{self.path}: tensor {name} appears twice")
            qt = lookup(type_id)
            shape = tuple(int(n) for n in reversed(ne))
            nbytes = _tensor_nbytes(qt, shape, self.path, name) if qt else 0
            if rel % align:
                raise ModelFileError(f"{self.path}: tensor {name} data offset {rel} is not a multiple of the "
                                     f"alignment {align}")
            info = TensorInfo(name, type_id, qt, shape, self.path, data_start + rel, nbytes)
            if info.offset + nbytes > size:
                raise ModelFileError(
                    f"{self.path}: truncated: tensor {name} needs bytes up to {info.offset + nbytes}, "
                    f"file has {size}")
            self.tensors[name] = info
        self.layout_error = self._check_layout(align)

    def _alignment(self) -> int:
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        vtype = self.metadata_types.get("general.alignment", 4)
        if vtype not in _INT_TYPES:
            raise ModelFileError(f"{self.path}: general.alignment: expected an integer, got {type_name(vtype)}")
        if align <= 0 or align & (align - 1):
            raise ModelFileError(f"{self.path}: general.alignment {align} is not a positive power of two")
        return int(align)

    def _check_layout(self, align: int) -> str | None:
        """Tensor data packed as GGUF writers lay it out: in offset order, each tensor starting at the
        aligned end of the one before, none overlapping. A damaged offset, shape or type shows up here
        as an overlap or a gap, instead of loading some other bytes as weights. Returns the problem,
        raised by the model file after its shape checks (which name a damaged shape more clearly).

        Sizes are trusted only for types ikjax reads: a tensor of an unknown or unreadable type is
        refused by name (UnsupportedQuantType) when the model reads it, so it is not measured here."""
        from ikjax.quant.dequant import supports

        infos = sorted(self.tensors.values(), key=lambda t: t.offset)
        expect, prev = self.data_start, None
        for t in infos:
            if prev is not None and t.offset < prev.offset + prev.nbytes:  # prev: last tensor of known size
                return (f"{self.path}: tensors {prev.name} (bytes {prev.offset}..{prev.offset + prev.nbytes}) and "
                        f"{t.name} (from byte {t.offset}) overlap")
            if expect is not None and t.offset != expect:
                where = f"after tensor {prev.name}" if prev else "at the start of the data section"
                return (f"{self.path}: tensor {t.name} starts at byte {t.offset}, but the data {where} ends at "
                        f"byte {expect}: the tensor table is damaged")
            # after a tensor of unknown type its size is unknown: the next offset cannot be predicted
            known = t.qtype is not None and supports(t.qtype)
            expect = (t.offset + t.nbytes + align - 1) // align * align if known else None
            prev = t if known else None
        # the data ends where the last tensor does (writers pad to the alignment): bytes past that mean
        # the data section starts later than general.alignment puts it (a damaged alignment read every
        # tensor 16 bytes early, silently) or the table is short of a tensor
        if prev is not None and self.size - (prev.offset + prev.nbytes) >= align:
            return (f"{self.path}: the tensor data ends at byte {prev.offset + prev.nbytes} (tensor {prev.name}) but "
                    f"the file has {self.size} bytes: general.alignment ({align}) or the tensor table is damaged")
        return None

    def close(self) -> None:
        """Unmap the file now. Arrays still viewing the map keep it: it then goes with the last of
        them (Python's mmap refuses to close under them), never under one."""
        try:
            self._mmap.close()
        except BufferError:
            pass

    def bytes_of(self, info: TensorInfo) -> np.ndarray:
        """A read-only uint8 view of the tensor's bytes, shaped [..., rows, row_bytes]."""
        rows_shape = info.shape[:-1]
        row_bytes = info.nbytes // max(1, int(np.prod(rows_shape)))
        arr = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return arr.reshape(*rows_shape, row_bytes)


def _tensor_nbytes(qt: QuantType, shape: tuple[int, ...], path: str, name: str) -> int:
    n_per_row = shape[-1]
    rows = math.prod(shape[:-1])
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
    """A model's GGUF file or its split shards, seen as one: metadata of the first shard, all tensors.

    Opening checks the file as a whole: split keys agree with the shards found, no tensor twice, and
    for a deepseek2 file that the tensor table is exactly the model its metadata describes
    (`ModelConfig.check_tensors`), so a damaged file fails here rather than loading as another model.
    `check_model=False` skips that last step (tools that inspect partial or foreign files).
    """

    def __init__(self, path: str | os.PathLike, *, check_model: bool = True):
        paths = split_paths(path)
        if not paths:
            raise ModelFileError(f"{path}: split file name says the model has 0 shards")
        m = _SPLIT_RE.match(Path(path).name)
        if m and not 1 <= int(m.group("no")) <= len(paths):  # (-00007-of-00002 opened shards 1 and 2)
            raise ModelFileError(f"{path}: split file name says shard {int(m.group('no'))} of {len(paths)}")
        missing = [p for p in paths if not os.path.lexists(p)]
        if missing and len(paths) == 1:
            raise ModelFileError(f"{path}: cannot open: no such file")
        if missing:
            raise ModelFileError(f"{path}: split model is missing shard {missing[0]}")
        self.shards = [GGUFShard(p) for p in paths]
        self.path = str(path)
        self.metadata = dict(self.shards[0].metadata)
        self._check_split()
        self.tensors: dict[str, TensorInfo] = {}
        self._shard_of: dict[str, GGUFShard] = {}
        for shard in self.shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise ModelFileError(f"{path}: tensor {name} appears twice (in {self._shard_of[name].path} "
                                         f"and {shard.path})")
                self.tensors[name] = info
                self._shard_of[name] = shard
        total = self.metadata.get("split.tensors.count")
        if total is not None and len(self.shards) > 1 and total != len(self.tensors):
            raise ModelFileError(f"{path}: split.tensors.count is {total} but the shards hold {len(self.tensors)} "
                                 f"tensors")
        if check_model and self.architecture == "deepseek2":
            from ikjax.gguf_io.config import ModelConfig
            emb = self.tensors.get("token_embd.weight")
            ModelConfig.from_metadata(self.metadata, source=self.path,
                                      vocab_from_tensor=emb.shape[0] if emb else None, tensors=self.tensors)
        for shard in self.shards:
            if shard.layout_error:
                raise ModelFileError(shard.layout_error)

    def _check_split(self) -> None:
        """gguf-split keys: every shard says the same count, and its own 0-based index."""
        for i, shard in enumerate(self.shards):
            md, types = shard.metadata, shard.metadata_types
            for key in ("split.count", "split.no", "split.tensors.count"):
                if key in md and types[key] not in _INT_TYPES:
                    raise ModelFileError(f"{shard.path}: {key}: expected an integer, got {type_name(types[key])}")
            declared = md.get("split.count", 1)
            if declared != len(self.shards):
                raise ModelFileError(f"{self.path}: split.count is {declared} but {len(self.shards)} shard file(s) "
                                     f"found" + (f" ({shard.path} says so)" if i else ""))
            if len(self.shards) > 1 and md.get("split.no", i) != i:
                raise ModelFileError(f"{shard.path}: split.no is {md['split.no']}, expected {i} for shard "
                                     f"{i + 1} of {len(self.shards)}")

    def close(self) -> None:
        """Unmap every shard (`GGUFShard.close`)."""
        for shard in self.shards:
            shard.close()

    def check_unchanged(self) -> None:
        """Refuse (one line) to go on with a model whose file changed on disk since it was opened.

        The tensor data stay in a memory map of the file (zero-copy weights on CPU, the embedding
        rows read from the file): a file rewritten in place changes the weights under a loaded
        engine without a word, and one truncated makes the next read of a page past its new end
        kill the process with SIGBUS. One os.stat per shard (~1 us), so the engine calls it before
        every step it dispatches; a file replaced by another (new inode) is refused too, since the
        path now names a model other than the one loaded."""
        for shard in self.shards:
            dev, ino, size, mtime = shard.identity
            try:
                st = os.stat(shard.path)
            except OSError as e:
                raise ModelFileError(f"{shard.path}: the model file is gone since it was loaded "
                                     f"({e.strerror or e}); load it again") from None
            if st.st_size < size and (st.st_dev, st.st_ino) == (dev, ino):
                raise ModelFileError(f"{shard.path}: truncated from {size} to {st.st_size} bytes since it was "
                                     f"loaded; refusing to read its mapping (load it again)")
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise ModelFileError(f"{shard.path}: replaced by another file since it was loaded; load it again")
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                raise ModelFileError(f"{shard.path}: modified since it was loaded (size {size} -> {st.st_size}, "
                                     f"mtime changed); the loaded weights may no longer match it: load it again")

    def tensor_bytes(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.qtype is None:
            raise ModelFileError(f"{self.path}: tensor {name} has unknown type id {info.type_id}")
        return self._shard_of[name].bytes_of(info)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")
