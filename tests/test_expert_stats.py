"""Expert statistics (issue 24): tokens each MoE layer routes to each expert, over every step."""
from __future__ import annotations

import json

import numpy as np
import pytest

import ikjax
from ikjax.errors import OptionError


def _stats(path, monkeypatch, mode, **kw):
    monkeypatch.setenv("IKJAX_LAYERS", mode)
    eng = ikjax.load(path, ctx=256, ubatch=32, expert_stats=True, **kw)
    toks = list(eng.generate(np.arange(2, 22), 5))
    return eng, toks, eng.expert_stats()


def test_counts_every_fed_token_once_per_pick(tiny4_model, monkeypatch, tmp_path):
    eng, _, st = _stats(tiny4_model, monkeypatch, "auto")
    cfg = eng.config
    # the 20 prompt tokens (not the 12 rows padding their 32-token step) and the 4 tokens fed back
    assert st["tokens"] == 20 + 4
    moe_layers = [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)]
    assert sorted(int(k) for k in st["layers"]) == moe_layers
    for counts in st["layers"].values():
        assert len(counts) == cfg.n_expert and sum(counts) == st["tokens"] * cfg.n_expert_used
        assert max(counts) < st["tokens"]  # an expert is picked once per token at most
    # scanned or unrolled layers: the same counts
    _, _, st2 = _stats(tiny4_model, monkeypatch, "unroll")
    assert st2 == st
    eng.save_expert_stats(tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == st
    # a second run adds to the counts
    list(eng.generate(np.arange(2, 22), 5))
    st3 = eng.expert_stats()
    assert st3["tokens"] == 2 * st["tokens"]
    assert all(np.array_equal(np.array(st3["layers"][k]), 2 * np.array(v)) for k, v in st["layers"].items())


def test_dropped_picks_are_not_counted(tiny4_model, monkeypatch):
    """-ser drops picks (weight 0): they route no token to their expert."""
    eng, _, st = _stats(tiny4_model, monkeypatch, "auto", ser="1,1.0")
    total = sum(sum(v) for v in st["layers"].values())
    n_layers = len(st["layers"])
    assert n_layers * st["tokens"] <= total < n_layers * st["tokens"] * eng.config.n_expert_used


def test_asked_without_counting_is_one_line(tiny4_model):
    eng = ikjax.load(tiny4_model, ctx=128)
    with pytest.raises(OptionError, match="expert_stats=True"):
        eng.expert_stats()


def test_cli_writes_the_file_at_the_end(tiny4_model, tmp_path):
    import subprocess
    import sys
    out = tmp_path / "stats" / "e.json"
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hello there", "-n", "4",
                        "--temp", "0", "-c", "128", "--expert-stats", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(out.read_text())
    assert st["tokens"] > 4 and all(sum(v) == st["tokens"] * 4 for v in st["layers"].values())
    assert f"-> {out}" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "bench", "-m", tiny4_model, "--expert-stats", str(out)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: expert-stats:")


def test_split_modes_count_alike(tiny4_model):
    """-sm graph (every device routes alike: counted once) and -sm layer give the one-device counts
    (two fake CPU devices, in a process of their own)."""
    import subprocess
    import sys
    code = ("import os\nos.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
            "import json, numpy as np, ikjax\nres = {}\n"
            "for sm in ('none', 'graph', 'layer'):\n"
            f"    eng = ikjax.load({tiny4_model!r}, ctx=128, ubatch=32, expert_stats=True, split_mode=sm)\n"
            "    list(eng.generate(np.arange(2, 22), 4))\n    res[sm] = eng.expert_stats()\n"
            "print(json.dumps(res))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["none"]["tokens"] == 20 + 3
    assert res["graph"] == res["none"] and res["layer"] == res["none"]
