"""Embedding rows: the GGUF blocks of the token ids' rows. Reference: `table[tokens]` (XLA); `cpu`: a
C++ op that preads the rows from the file.
"""
from __future__ import annotations

from ikjax.ops import registry
from pallas_kernels.embed_rows import cpu as _embed_cpu_mod

# -- embedding rows -------------------------------------------------------------------------------

def _embed_rows_cpu_supported(table, tokens) -> bool:
    return _embed_cpu_mod.supported(table, tokens)


def embed_rows(table, tokens, backend: str | None = None):
    """The GGUF blocks of the token ids' rows, u8 [V, R] -> [..., R] (`table[tokens]`). On CPU the
    C++ op reads them from the file (pread) instead of through the mapping, which would map the
    ~64 KiB of page cache around each row into the process (RESULTS §9e: 73-108 MiB of a sweep's
    peak RSS)."""
    impls = {
        "xla": registry.Impl(lambda *a: True, lambda t, i: t[i]),
        "cpu": registry.Impl(_embed_rows_cpu_supported, _embed_cpu_mod.embed_rows),
    }
    return registry.dispatch("embed_rows", impls, registry.resolve_backend(backend), table, tokens)
