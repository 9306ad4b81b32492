"""Lossless repacking of GGUF blocks into planar arrays a GPU kernel can load with aligned tiles.

GGUF blocks mix f16 scales and packed quants at odd byte strides (Q4_0: 18 bytes per 32 weights).
`prepare(qa)` splits them, once at load time, into separate arrays (quants, scales, mins), keeping
every bit: 6-bit K-quant scales are only unpacked into bytes. `dequantize_packed` decodes the planar
form in jnp with the same float32 operations as `ikjax.quant.dequant` (bit-exact with
`QuantArray.dequantize`, tested).

Every layout views a row of K weights as `K/G` groups of `P` parts of `L` consecutive-in-memory
values (`P*L = G`); part `p` of group `g` holds weights `g*G + PERM`, described by `x_view`:
the activation x [M, K] reshaped to [M, K/G, P, L] lines up element for element with the parts.

| type   | G   | P | L  | arrays (rows N, lead dims ... in front)                                  |
|--------|-----|---|----|--------------------------------------------------------------------------|
| F32/F16/BF16 | 32 | 1 | 32 | w [N, K/32, 32] float                                            |
| Q8_0   | 32  | 1 | 32 | q int8 [N, K/32, 32], d f16 [N, K/32]                                    |
| Q4_0   | 32  | 2 | 16 | qs u8 [N, K/32, 16] (lo nibble: part 0, hi: part 1), d f16 [N, K/32]     |
| Q4_K   | 64  | 2 | 32 | qs u8 [N, K/64, 32], s u8 [N, K/64, 2], m u8 [N, K/64, 2], d/dmin f16 [N, K/256] |
| Q6_K   | 128 | 4 | 32 | ql u8 [N, K/128, 2, 32], qh u8 [N, K/128, 32], sc i8 [N, K/128, 4, 2], d f16 [N, K/256] |
| IQ4_XS | 32  | 2 | 16 | qs u8 [N, K/32, 16], ls u8 [N, K/32] (6-bit scale), d f16 [N, K/256]     |
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ikjax.quant.array import QuantArray
from ikjax.quant.dequant import IQ4NL_VALUES, k_scale_min

F32 = jnp.float32

# name -> (G, P, L, groups per super-block R: a per-super-block scale covers R groups)
GEOMETRY = {
    "F32": (32, 1, 32, 1), "F16": (32, 1, 32, 1), "BF16": (32, 1, 32, 1),
    "Q8_0": (32, 1, 32, 1), "Q4_0": (32, 2, 16, 1),
    "Q4_K": (64, 2, 32, 4), "Q6_K": (128, 4, 32, 2), "IQ4_XS": (32, 2, 16, 8),
}
KERNEL_TYPES = tuple(GEOMETRY)


def supported(qtype_name: str) -> bool:
    return qtype_name in GEOMETRY


@dataclass(frozen=True)
class PackedWeight:
    """Planar, kernel-ready form of a quantized [..., N, K] weight (see module doc)."""
    arrays: dict
    qtype: str = field(metadata=dict(static=True))
    shape: tuple = field(metadata=dict(static=True))

    @property
    def geometry(self):
        return GEOMETRY[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in self.arrays.values()))

    def dequantize(self, dtype=jnp.float32):
        return dequantize_packed(self, dtype)

    def take(self, idx) -> "PackedWeight":
        """Select along the first (expert) axis."""
        arrays = {k: v[idx] for k, v in self.arrays.items()}
        idx_shape = tuple(np.shape(idx))
        return PackedWeight(arrays, self.qtype, idx_shape + self.shape[1:])

    def __repr__(self) -> str:
        return f"PackedWeight({self.qtype}, shape={self.shape}, nbytes={self.nbytes})"


jax.tree_util.register_dataclass(PackedWeight)


def _f16(b):
    """[..., 2] bytes -> f16 [...] (same bits)."""
    return lax.bitcast_convert_type(b, jnp.float16)


def _prepare(data, qtype: str, shape: tuple):
    lead = tuple(shape[:-1])
    K = shape[-1]
    data = jnp.asarray(data).reshape(*lead, -1)
    if qtype in ("F32", "F16", "BF16"):
        dt = {"F32": jnp.float32, "F16": jnp.float16, "BF16": jnp.bfloat16}[qtype]
        w = lax.bitcast_convert_type(data.reshape(*lead, K, jnp.dtype(dt).itemsize), dt)
        return {"w": w.reshape(*lead, K // 32, 32)}
    if qtype == "Q8_0":
        b = data.reshape(*lead, K // 32, 34)
        return {"q": lax.bitcast_convert_type(b[..., 2:34], jnp.int8), "d": _f16(b[..., 0:2])}
    if qtype == "Q4_0":
        b = data.reshape(*lead, K // 32, 18)
        return {"qs": b[..., 2:18], "d": _f16(b[..., 0:2])}
    ns = K // 256
    if qtype == "Q4_K":
        b = data.reshape(*lead, ns, 144)
        s, m = k_scale_min(b[..., 4:16])                     # [..., ns, 8] each, sub-block order
        return {"qs": b[..., 16:144].reshape(*lead, ns * 4, 32),
                "s": s.reshape(*lead, ns * 4, 2), "m": m.reshape(*lead, ns * 4, 2),
                "d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4])}
    if qtype == "Q6_K":
        b = data.reshape(*lead, ns, 210)
        return {"ql": b[..., 0:128].reshape(*lead, ns * 2, 2, 32),
                "qh": b[..., 128:192].reshape(*lead, ns * 2, 32),
                "sc": lax.bitcast_convert_type(b[..., 192:208], jnp.int8).reshape(*lead, ns * 2, 4, 2),
                "d": _f16(b[..., 208:210])}
    if qtype == "IQ4_XS":
        b = data.reshape(*lead, ns, 136)
        sh = lax.bitcast_convert_type(b[..., 2:4], jnp.uint16)
        sl = jnp.stack([b[..., 4:8] & 0xF, b[..., 4:8] >> 4], axis=-1).reshape(*lead, ns, 8)
        shv = ((sh[..., None] >> (2 * jnp.arange(8, dtype=jnp.uint16))) & 3).astype(jnp.uint8)
        ls = sl | (shv << 4)
        return {"qs": b[..., 8:136].reshape(*lead, ns * 8, 16), "ls": ls.reshape(*lead, ns * 8),
                "d": _f16(b[..., 0:2])}
    raise ValueError(f"no planar layout for {qtype}")


@functools.partial(jax.jit, static_argnums=1)
def _prepare_many(datas, metas):
    return tuple(_prepare(d, qt, sh) for d, (qt, sh) in zip(datas, metas))


def packed_shape(qa: QuantArray) -> tuple:
    """The [..., N, K] shape `prepare` gives `qa` (a vector is one row)."""
    return tuple(qa.shape) if len(qa.shape) > 1 else (1,) + tuple(qa.shape)


def _meta(qa: QuantArray) -> tuple:
    """(type name, packed shape) of a weight the planar layouts take; ValueError otherwise."""
    name = qa.qtype.name
    if name not in GEOMETRY:
        raise ValueError(f"{name}: no Pallas kernel layout (supported: {', '.join(KERNEL_TYPES)})")
    G = GEOMETRY[name][0] * GEOMETRY[name][3]
    if qa.shape[-1] % G:
        raise ValueError(f"{name}: row of {qa.shape[-1]} is not a multiple of {G}")
    return name, packed_shape(qa)


def prepare_many(qas: list, run=None) -> list:
    """`prepare` of each QuantArray, all in one compiled program: at load a program per weight cost a
    compile-cache read (and, on a GPU, its kernels' module load) per distinct shape, ~half of the
    V2-Lite load's 1.2 s on an H200 (RESULTS §22k); a layer's weights then cost one. The arrays must
    share their devices (one call per device set). `run(jitted, args, static)`: how the program is
    called (ikjax.programs.runner, which may keep it compiled whole between runs); default a call."""
    metas = tuple(_meta(qa) for qa in qas)
    datas = tuple(qa.data for qa in qas)
    outs = run(_prepare_many, (datas,), (metas,)) if run is not None else _prepare_many(datas, metas)
    return [PackedWeight(o, qt, sh) for o, (qt, sh) in zip(outs, metas)]


def prepare(qa: QuantArray) -> PackedWeight:
    """QuantArray [..., N, K] -> PackedWeight (lossless; runs on the array's device, once at load)."""
    return prepare_many([qa])[0]


# ----------------------------------------------------------------------------------------------
# decoding: one part of a tile, shared by the jnp reference and the Pallas kernel

def iq4nl_value(q):
    """IQ4_NL table lookup as arithmetic selects (no gather): q uint8 0..15 -> f32 value."""
    v = IQ4NL_VALUES
    b0, b1, b2, b3 = [((q >> i) & 1) == 1 for i in range(4)]
    def pick(lo, hi, c):
        return jnp.where(c, hi, lo)
    l1 = [pick(F32(v[2 * i]), F32(v[2 * i + 1]), b0) for i in range(8)]
    l2 = [pick(l1[2 * i], l1[2 * i + 1], b1) for i in range(4)]
    l3 = [pick(l2[2 * i], l2[2 * i + 1], b2) for i in range(2)]
    return pick(l3[0], l3[1], b3)


def expand_super(d, R: int):
    """Per-super-block scale [..., n/R] -> per-group [..., n] (each repeated R times)."""
    if R == 1:
        return d
    sh = d.shape
    return jnp.broadcast_to(d[..., None], (*sh, R)).reshape(*sh[:-1], sh[-1] * R)


# arrays whose first axis after the groups selects the part: name -> part p -> index on that axis
PART_AXIS = {"Q4_K": {"s": lambda p: p, "m": lambda p: p},
             "Q6_K": {"ql": lambda p: p & 1, "sc": lambda p: p}}


def part_arrays(qtype: str, arrays: dict, p: int, n_lead: int = 0) -> dict:
    """Cut the part axis of the arrays that have one (jnp arrays; the kernel does it in its loads)."""
    sel = PART_AXIS.get(qtype, {})
    out = {}
    for name, a in arrays.items():
        if name in sel:
            # array [..., N, groups, part, ...]: the part axis sits after rows and groups
            ax = a.ndim - (2 if qtype == "Q6_K" and name in ("ql", "sc") else 1)
            out[name] = jnp.take(a, sel[name](p), axis=ax)
        else:
            out[name] = a
    return out


def decode_part(qtype: str, t: dict, p: int):
    """Tiles `t` (arrays cut to [bn, ng, ...] groups, the part axis already selected; per-super-block
    arrays to [bn, ng/R]) -> float32 weights [bn, ng, L] of part p, with the reference's operations."""
    G, P, L, R = GEOMETRY[qtype]
    if qtype in ("F32", "F16", "BF16"):
        return t["w"].astype(F32)
    if qtype == "Q8_0":
        return t["q"].astype(F32) * t["d"].astype(F32)[..., None]
    if qtype == "Q4_0":
        b = t["qs"]
        nib = (b & 0xF) if p == 0 else (b >> 4)
        return t["d"].astype(F32)[..., None] * (nib.astype(jnp.int32) - 8).astype(F32)
    if qtype == "Q4_K":
        b = t["qs"]
        nib = (b & 0xF) if p == 0 else (b >> 4)
        d = expand_super(t["d"].astype(F32), R)
        dmin = expand_super(t["dmin"].astype(F32), R)
        dl = d * t["s"].astype(F32)
        ml = dmin * t["m"].astype(F32)
        return dl[..., None] * nib.astype(F32) - ml[..., None]
    if qtype == "Q6_K":
        ql = t["ql"]
        nib = (ql & 0xF) if p < 2 else (ql >> 4)
        crumb = (t["qh"] >> (2 * p)) & 3
        q = ((nib | (crumb << 4)).astype(jnp.int32) - 32).astype(F32)      # [bn, ng, 32]
        d = expand_super(t["d"].astype(F32), R)
        dl = d[..., None] * t["sc"].astype(F32)                  # [bn, ng, 2]
        sh = q.shape
        return (dl[..., None] * q.reshape(*sh[:-1], 2, 16)).reshape(sh)
    if qtype == "IQ4_XS":
        b = t["qs"]
        nib = (b & 0xF) if p == 0 else (b >> 4)
        d = expand_super(t["d"].astype(F32), R)
        dl = d * (t["ls"].astype(jnp.int32) - 32).astype(F32)
        return dl[..., None] * iq4nl_value(nib)
    raise ValueError(qtype)


MAGIC = 0x4B000000          # bits of 2**23: (MAGIC | v) as f32 is 2**23 + v for 0 <= v < 2**23


def small_uint_to_f32(v):
    """Exact float32 of a small unsigned integer array without an int->float conversion instruction
    (a quarter-rate op on NVIDIA GPUs): OR it into the mantissa of 2**23, subtract 2**23."""
    return lax.bitcast_convert_type(v.astype(jnp.uint32) | jnp.uint32(MAGIC), jnp.float32) - F32(8388608.0)


def int8_to_f32(q):
    """Exact float32 of int8 values, the same way (bias by 128 first)."""
    u = (q.astype(jnp.int32) + 128).astype(jnp.uint32)
    return lax.bitcast_convert_type(u | jnp.uint32(MAGIC), jnp.float32) - F32(8388608.0 + 128.0)


def decode_part_factored(qtype: str, t: dict, p: int):
    """Part p of a tile as (q [bn, ng, L] float32 integer levels or values, scale, bias, sub):
    weight = scale * q + bias, with scale/bias [bn, ng] per group, or [bn, ng, 2] per half-group
    when `sub` (Q6_K's 16-wide scales); None means 1 / 0. Lets a GEMV factor the scales out of the
    inner sum: sum_i w_i x_i = scale * sum_i q_i x_i + bias * sum_i x_i."""
    G, P, L, R = GEOMETRY[qtype]
    if qtype in ("F32", "F16", "BF16"):
        return t["w"].astype(F32), None, None, False
    if qtype == "Q8_0":
        return int8_to_f32(t["q"]), t["d"].astype(F32), None, False
    if qtype == "Q4_0":
        b = t["qs"]
        nib = (b & 0xF) if p == 0 else (b >> 4)
        d = t["d"].astype(F32)
        return small_uint_to_f32(nib), d, d * -8.0, False
    if qtype == "Q4_K":
        b = t["qs"]
        nib = (b & 0xF) if p == 0 else (b >> 4)
        dl = expand_super(t["d"].astype(F32), R) * t["s"].astype(F32)
        ml = expand_super(t["dmin"].astype(F32), R) * t["m"].astype(F32)
        return small_uint_to_f32(nib), dl, -ml, False
    if qtype == "Q6_K":
        ql = t["ql"]
        nib = (ql & 0xF) if p < 2 else (ql >> 4)
        crumb = (t["qh"] >> (2 * p)) & 3
        q = small_uint_to_f32(nib | (crumb << 4))
        dl = expand_super(t["d"].astype(F32), R)[..., None] * t["sc"].astype(F32)
        return q, dl, dl * -32.0, True
    if qtype == "IQ4_XS":
        b = t["qs"]
        nib = (b & 0xF) if p == 0 else (b >> 4)
        dl = expand_super(t["d"].astype(F32), R) * (t["ls"].astype(jnp.int32) - 32).astype(F32)
        return iq4nl_value(nib), dl, None, False
    raise ValueError(qtype)


def dequantize_packed(pw: PackedWeight, dtype=jnp.float32):
    """PackedWeight -> [..., N, K] values, bit-exact with QuantArray.dequantize."""
    G, P, L, R = GEOMETRY[pw.qtype]
    parts = [decode_part(pw.qtype, part_arrays(pw.qtype, pw.arrays, p), p) for p in range(P)]   # each [..., N, K/G, L]
    w = jnp.stack(parts, axis=-2)                                       # [..., N, K/G, P, L]
    return w.reshape(pw.shape).astype(dtype)


def x_view(x, qtype: str):
    """x [M, K] -> [M, K/G, P, L], aligned with the parts of `qtype`'s layout (a free reshape)."""
    G, P, L, R = GEOMETRY[qtype]
    return x.reshape(*x.shape[:-1], x.shape[-1] // G, P, L)
