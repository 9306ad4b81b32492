"""Pallas GPU kernels (Triton lowering) for ikjax, one folder per operation.

Each folder: `reference.py` (plain jnp, the CPU path and the oracle), `kernel.py` (Pallas),
`bench.py` (micro-benchmark). Tests live in `tests/test_kernels_*.py`; `ikjax/ops/` picks
the backend.
"""


def _triton_dialect_found_once() -> None:
    """Let MLIR's Python bindings find the Triton dialect's module under a name they search.

    Why: each Triton op a kernel's lowering builds (and each value type it downcasts) asks MLIR
    for the `tt` dialect's Python module; MLIR looks for it as `jaxlib.mlir.dialects.tt`,
    `jaxlib.mosaic.python.tt` and `jax.jaxlib.mosaic.python.tt`, none of which exists (jaxlib
    ships it as `jaxlib.triton.dialect`), and a failed lookup is not remembered: ~230 failed
    imports, each a walk over sys.path, a kernel. That was a third of Pallas's Triton lowering
    (65 -> 45 ms for a Q4_0 decode product, the lowered module byte for byte the same), and the
    lowering is Python on a cold start's critical path (RESULTS §22af). Registering the module
    under the first searched name lets MLIR find and keep it."""
    import sys
    if "jaxlib.mlir.dialects.tt" in sys.modules:
        return
    try:
        from jax._src.lib.triton import dialect
    except ImportError:  # a jaxlib without Triton: no Pallas GPU lowering to speed up
        return
    sys.modules["jaxlib.mlir.dialects.tt"] = dialect


_triton_dialect_found_once()


WIDE_OFFSETS = False  # whether `_wide_offsets_where_needed` took (ikjax.ops.pallas_stack_limit reads it)


def _wide_offsets_where_needed() -> None:
    """Give Pallas's Triton lowering 64-bit offsets for every array of more than 2^31 elements.

    Why: the lowering indexes an operand with 32-bit offsets (in elements) unless the operand's
    size passes 2^32 bytes; Triton's pointer arithmetic takes them signed, so a byte array of 2^31
    to 2^32 bytes (V2-Lite's 26 MoE layers stack 2.7 GB of each expert tensor) wraps to a negative
    offset: an illegal address on the GPU. The layer groups used to stop a stack below 2^31 bytes
    instead (V2-Lite: 1 dense + 20 + 6 MoE layers; an R1 expert tensor of 2.1 GB a layer: a group
    per layer), and each group is traced, lowered and compiled again: a third of a cold step's
    lowering and kernel compiles on the deep V2-Lite shape (RESULTS §22ai). The lowering's own
    rule is kept (its offsets are 64-bit from 2^32 bytes); this makes the operand look that big to
    it where its elements pass 2^31, so its offsets are 64-bit there too. Offsets are all the dtype
    is read for there. Where the lowering is not the one this was written against, nothing is
    patched and the groups keep their limit."""
    global WIDE_OFFSETS
    import dataclasses
    import inspect
    import math
    try:
        import jax
        import numpy as np
        from jax._src.pallas.triton import lowering as tl
    except ImportError:  # no Pallas Triton lowering: nothing to widen
        return
    orig = getattr(tl, "_compute_offsets_from_indices", None)
    if orig is None or getattr(orig, "ikjax_wide", False):
        WIDE_OFFSETS = orig is not None
        return
    try:  # (the 2^32 threshold read from the function's constants: its source would cost ~6 ms a process)
        fits = (list(inspect.signature(orig).parameters) == ["block_info", "nd_indexer"]
                and "full_shape_dtype" in {f.name for f in dataclasses.fields(tl.BlockInfo)}
                and 2**32 in getattr(getattr(orig, "__code__", None), "co_consts", ()))
    except (TypeError, ValueError):
        fits = False
    if not fits:
        return

    def offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if math.prod(full.shape) > 2**31:
            block_info = dataclasses.replace(block_info, full_shape_dtype=jax.ShapeDtypeStruct(full.shape, np.uint64))
        return orig(block_info, nd_indexer)

    offsets.ikjax_wide = True
    offsets.__wrapped__ = orig
    tl._compute_offsets_from_indices = offsets
    WIDE_OFFSETS = True


_wide_offsets_where_needed()
