"""What `dtype="auto"` means on each path, and that IKJAX_DTYPE overrides it (the suite pins it to f32)."""
from __future__ import annotations

import pytest

from ikjax.errors import OptionError
from ikjax.ops import auto_dtype
from ikjax.options import RunOptions


def test_auto_follows_the_kernels(monkeypatch):
    monkeypatch.delenv("IKJAX_DTYPE", raising=False)
    monkeypatch.setenv("IKJAX_KERNELS", "xla")
    assert auto_dtype() == "f32"          # XLA's CPU bf16 dots are slower than its f32 ones
    monkeypatch.setenv("IKJAX_KERNELS", "cpu")
    assert auto_dtype() == "bf16"         # C++ kernels: bf16 prompt products, 8-bit-activation decode products
    assert RunOptions().with_model(6, True, auto_dtype()).dtype == "bf16"
    assert RunOptions(dtype="f32").with_model(6, True, auto_dtype()).dtype == "f32"


def test_env_override(monkeypatch):
    monkeypatch.setenv("IKJAX_DTYPE", "f32")
    monkeypatch.setenv("IKJAX_KERNELS", "cpu")
    assert RunOptions().with_model(6, True, auto_dtype()).dtype == "f32"
    monkeypatch.setenv("IKJAX_DTYPE", "f64")
    with pytest.raises(OptionError, match="IKJAX_DTYPE"):
        auto_dtype()
