"""Random valid inputs for kernel tests and benchmarks (fresh per call; never zeros)."""
from __future__ import annotations

import numpy as np

from ikjax.quant import QuantArray, by_name

# byte offsets of the f16 scale fields inside one block, for types quantized from random bytes
# (Q4_1 / Q5_1: d and the minimum m; random bytes there can be an f16 NaN or infinity)
_F16_FIELDS = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ4_NL": [0], "IQ4_XS": [0], "Q4_1": [0, 2], "Q5_1": [0, 2]}
_GGUF_QUANTIZE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def random_bytes(name: str, lead: tuple, n: int, rng, fast: bool = False) -> np.ndarray:
    """Quantized bytes [*lead, row_bytes] of random valid blocks of type `name`.

    Simple types go through gguf's quantizer (fast=False) or are built directly (fast=True: random
    quants, random f16 scales of a realistic size; gguf's NumPy quantizer is slow at real sizes)."""
    qt = by_name(name)
    be, bb = qt.block_elems, qt.block_bytes
    if name in ("F32", "F16", "BF16"):
        x = rng.standard_normal((*lead, n)).astype(np.float32) * 0.05
        if name == "F32":
            return x.view(np.uint8).reshape(*lead, -1)
        if name == "F16":
            return x.astype(np.float16).view(np.uint8).reshape(*lead, -1)
        u = (x.view(np.uint32) >> 16).astype(np.uint16)        # truncation: any bf16 bits are valid
        return u.view(np.uint8).reshape(*lead, -1)
    if name in _GGUF_QUANTIZE and not fast:
        import gguf
        x = rng.standard_normal((*lead, n)).astype(np.float32)
        t = gguf.GGMLQuantizationType[name]
        return np.ascontiguousarray(gguf.quants.quantize(x, t)).view(np.uint8).reshape(*lead, -1)
    raw = rng.integers(0, 256, (*lead, n // be, bb), dtype=np.uint8)
    fields = _F16_FIELDS.get(name, [0])
    for off in fields:
        scale = rng.uniform(-0.05, 0.05, raw.shape[:-1]).astype(np.float16)
        raw[..., off:off + 2] = scale[..., None].view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*lead, -1)


def random_quant_array(name: str, shape: tuple, rng, fast: bool = False) -> QuantArray:
    shape = tuple(shape)
    raw = random_bytes(name, shape[:-1], shape[-1], rng, fast=fast)
    return QuantArray.from_bytes(raw, by_name(name), shape)


def cuda_lowering(f, *args):
    """Lower f for CUDA on this (CPU) machine: runs the Pallas -> Triton IR lowering, so a kernel
    the GPU would refuse fails a test without a GPU."""
    import jax
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    chk = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=chk)(*specs)
