"""`table[tokens]` for a u8 [V, R] table of GGUF blocks, as the C++ op ikjax_cpu_embed_rows (cpu_ffi.cc).

Same bytes as jnp's `table[tokens]` (negative ids from the end, then clamped to [0, V)), but each row is read with
pread() from the file the table is memory-mapped from, so a step's few rows do not map the 64 KiB
of page-cache pages around each of them into the process (kernel fault-around): a 512-token
prompt of random ids otherwise adds 30-100 MiB of embedding pages to the RSS (bench/RESULTS.md §9e).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu as _cpu

TARGET = "ikjax_cpu_embed_rows"


def supported(table, tokens) -> bool:
    """Whether the C++ op takes this call: the extension built, table u8 [V, R] with V > 0 (no row
    to clamp an id to otherwise), integer tokens."""
    return (_cpu.available() and table.ndim == 2 and table.dtype == jnp.uint8 and table.shape[0] > 0
            and jnp.issubdtype(tokens.dtype, jnp.integer))


def embed_rows(table, tokens):
    """table u8 [V, R], tokens int [...] -> u8 [..., R]: the rows of the ids, as `table[tokens]`."""
    if not supported(table, tokens):
        raise ValueError(f"embed_rows (cpu): unsupported call table {table.shape} {table.dtype}, tokens "
                         f"{tokens.dtype}" + (f"; {_cpu.unavailable_reason()}" if not _cpu.available() else ""))
    _cpu.register()
    out = jax.ShapeDtypeStruct(tuple(tokens.shape) + (table.shape[1],), jnp.uint8)
    return jax.ffi.ffi_call(TARGET, out)(table, tokens.astype(jnp.int32))
