"""Pallas GPU kernels (Triton lowering) for ikjax, one folder per operation.

Each folder: `reference.py` (plain jnp, the CPU path and the oracle), `kernel.py` (Pallas),
`bench.py` (micro-benchmark). Tests live in `tests/test_kernels_*.py`; `ikjax/ops/` picks
the backend.
"""
