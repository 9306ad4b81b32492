"""Take a GGUF file apart and put it back together byte for byte, for tests that damage files.

Deliberately independent of `ikjax.gguf_io.reader` (the code under test): a plain walk of the
GGUF v3 layout that keeps every field's raw bytes, so a test can change one field (a count, an
offset, a key) and rebuild, and the fuzz test can tell which kind of field a byte belongs to.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
              12: "<d"}
STRING, ARRAY = 8, 9
U32, I32, F32, BOOL, U64 = 4, 5, 6, 7, 10


@dataclass
class KV:
    key: str
    vtype: int
    payload: bytes  # the value's bytes as stored after the type field


@dataclass
class TensorEntry:
    name: str
    ne: list[int]  # GGUF order (ne[0] = elements per row)
    type_id: int
    rel: int  # offset relative to the data section


@dataclass
class Gguf:
    version: int
    kvs: list[KV]
    tensors: list[TensorEntry]
    data: bytes  # everything from the (aligned) start of the data section
    alignment: int = 32
    # (start, end, kind) for every byte range of the header: kind "struct" (counts, lengths, keys,
    # types, names, dims, offsets), "value" (metadata values), "pad" (alignment padding)
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    data_start: int = 0

    def kv(self, key: str) -> KV:
        return next(k for k in self.kvs if k.key == key)

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)


def _value_size(raw: bytes, pos: int, vtype: int, spans: list | None) -> int:
    """Bytes taken by one value at `pos`; records its spans."""
    def add(a, b, kind):
        if spans is not None and b > a:
            spans.append((a, b, kind))
    if vtype in SCALAR_FMT:
        n = struct.calcsize(SCALAR_FMT[vtype])
        add(pos, pos + n, "value")
        return n
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", raw, pos)
        add(pos, pos + 8, "struct")
        add(pos + 8, pos + 8 + n, "value")
        return 8 + n
    if vtype == ARRAY:
        itype, count = struct.unpack_from("<IQ", raw, pos)
        add(pos, pos + 12, "struct")
        p = pos + 12
        if itype in SCALAR_FMT:
            n = count * struct.calcsize(SCALAR_FMT[itype])
            add(p, p + n, "value")
            return 12 + n
        for _ in range(count):
            p += _value_size(raw, p, itype, spans)
        return p - pos
    raise ValueError(f"unknown value type {vtype}")


def parse(raw: bytes) -> Gguf:
    assert raw[:4] == b"GGUF"
    spans: list[tuple[int, int, str]] = [(0, 24, "struct")]
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, 4)
    pos, kvs = 24, []
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", raw, pos)
        key = raw[pos + 8:pos + 8 + n].decode()
        (vtype,) = struct.unpack_from("<I", raw, pos + 8 + n)
        spans.append((pos, pos + 8 + n + 4, "struct"))
        vpos = pos + 8 + n + 4
        size = _value_size(raw, vpos, vtype, spans)
        kvs.append(KV(key, vtype, raw[vpos:vpos + size]))
        pos = vpos + size
    alignment = 32
    for kv in kvs:
        if kv.key == "general.alignment":
            alignment = struct.unpack("<I", kv.payload)[0]
    tensors = []
    for _ in range(n_tensors):
        start = pos
        (n,) = struct.unpack_from("<Q", raw, pos)
        name = raw[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", raw, pos)
        ne = list(struct.unpack_from(f"<{n_dims}Q", raw, pos + 4))
        pos += 4 + 8 * n_dims
        type_id, rel = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        spans.append((start, pos, "struct"))
        tensors.append(TensorEntry(name, ne, type_id, rel))
    data_start = -(-pos // alignment) * alignment
    spans.append((pos, data_start, "pad"))
    return Gguf(version, kvs, tensors, raw[data_start:], alignment, spans, data_start)


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def build(g: Gguf, *, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    """The file for `g`, fields written exactly as given (counts overridable to lie)."""
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", g.version, len(g.tensors) if n_tensors is None else n_tensors,
                       len(g.kvs) if n_kv is None else n_kv)
    for kv in g.kvs:
        out += _string(kv.key) + struct.pack("<I", kv.vtype) + kv.payload
    for t in g.tensors:
        out += _string(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
        out += struct.pack("<IQ", t.type_id, t.rel)
    out += bytes(-len(out) % g.alignment)
    return bytes(out + g.data)


# value payload encoders
def u32(v: int) -> tuple[int, bytes]:
    return U32, struct.pack("<I", v)


def i32(v: int) -> tuple[int, bytes]:
    return I32, struct.pack("<i", v)


def f32(v: float) -> tuple[int, bytes]:
    return F32, struct.pack("<f", v)


def string(s: str) -> tuple[int, bytes]:
    return STRING, _string(s)


def set_kv(g: Gguf, key: str, value: tuple[int, bytes]) -> None:
    """Replace (or append) `key` with a value from the encoders above."""
    vtype, payload = value
    for kv in g.kvs:
        if kv.key == key:
            kv.vtype, kv.payload = vtype, payload
            return
    g.kvs.append(KV(key, vtype, payload))
