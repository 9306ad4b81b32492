"""The commands' decode form: the flag, else the variable, else the command's default (on for
`serve`, off for `generate`)."""
from __future__ import annotations

import os

import pytest

from ikjax.cli.common import batch_invariance


@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("flag,env_value,want", [
    (None, None, None), (None, "0", False), (None, "1", True), (False, None, False), (True, "0", True),
    (False, "1", False)])
def test_batch_invariance_choice(monkeypatch, flag, env_value, want, default):
    want = default if want is None else want
    if env_value is None:
        monkeypatch.delenv("IKJAX_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("IKJAX_BATCH_INVARIANT", env_value)
    assert batch_invariance(flag, default=default) is want
    # what the traces read (and the stored steps are keyed on)
    assert os.environ["IKJAX_BATCH_INVARIANT"] == ("1" if want else "0")
