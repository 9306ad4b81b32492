"""`serve`'s decode form: batch-invariant unless told otherwise (the flag, else the variable)."""
from __future__ import annotations

import os

import pytest

from ikjax.cli.serve import _batch_invariance


@pytest.mark.parametrize("flag,env_value,want", [
    (None, None, True), (None, "0", False), (None, "1", True), (False, None, False), (True, "0", True),
    (False, "1", False)])
def test_serve_batch_invariance(monkeypatch, flag, env_value, want):
    if env_value is None:
        monkeypatch.delenv("IKJAX_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("IKJAX_BATCH_INVARIANT", env_value)
    assert _batch_invariance(flag) is want
    # what the traces read (and the stored steps are keyed on)
    assert os.environ["IKJAX_BATCH_INVARIANT"] == ("1" if want else "0")
