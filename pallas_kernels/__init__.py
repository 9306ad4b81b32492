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
