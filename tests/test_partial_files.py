"""No partial output: make-model, the GGUF writer and plot check their target before writing a
byte, and a failure or Ctrl-C in the middle leaves neither the target nor a temporary file."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from ikjax.tools import synthetic
from ikjax.errors import IkjaxError, OptionError
from ikjax.gguf_io import writer as gw
from ikjax.tools.plot import plot_files, read_jsonl


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# -- make-model ---------------------------------------------------------------------------------

def test_make_model_refuses_a_directory_before_writing(tmp_path):
    target = tmp_path / "out.gguf"
    target.mkdir()
    with pytest.raises(OptionError, match="is a directory"):
        synthetic.make_model(target, "tiny", "Q8_0", layers=1)
    assert _listing(tmp_path) == ["out.gguf"] and _listing(target) == []


def test_make_model_refuses_a_parent_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OptionError, match="is not a directory"):
        synthetic.make_model(tmp_path / "f" / "m.gguf", "tiny", "Q8_0", layers=1)
    assert _listing(tmp_path) == ["f"]


def test_make_model_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe.gguf")
    with pytest.raises(OptionError, match="not a regular file"):
        synthetic.make_model(tmp_path / "pipe.gguf", "tiny", "Q8_0", layers=1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_make_model_refuses_unwritable_parent(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        with pytest.raises(OptionError, match="not writable"):
            synthetic.make_model(ro / "m.gguf", "tiny", "Q8_0", layers=1)
    finally:
        ro.chmod(0o700)


def test_make_model_refuses_when_the_disk_is_too_small(tmp_path, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail, self.f_flag = st.f_frsize, 10, st.f_flag  # 10 blocks free

    monkeypatch.setattr(os, "statvfs", lambda p: Small(real(p)))
    with pytest.raises(OptionError, match=r"output: .*needs .* free"):
        synthetic.make_model(tmp_path / "m.gguf", "v2-lite", "Q4_0", layers=2)
    assert _listing(tmp_path) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")])
def test_make_model_failure_midway_leaves_nothing(tmp_path, monkeypatch, exc):
    real_chunks = synthetic.tensor_chunks
    calls = {"n": 0}

    def failing(t, rng, pools):
        calls["n"] += 1
        if calls["n"] == 5:  # some tensors are already on disk
            raise exc
        return real_chunks(t, rng, pools)

    monkeypatch.setattr(synthetic, "tensor_chunks", failing)
    target = tmp_path / "m.gguf"
    expected = KeyboardInterrupt if isinstance(exc, KeyboardInterrupt) else OptionError
    with pytest.raises(expected) as info:
        synthetic.make_model(target, "tiny", "Q8_0", layers=1)
    if expected is OptionError:
        assert "No space left" in str(info.value) and "\n" not in str(info.value)
    assert calls["n"] == 5 and _listing(tmp_path) == []


def test_make_model_failure_keeps_the_previous_file(tmp_path, monkeypatch):
    target = synthetic.make_model(tmp_path / "m.gguf", "tiny", "Q8_0", layers=1)
    before = target.read_bytes()
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)  # published with the usual mode

    def boom(t, rng, pools):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "tensor_chunks", boom)
    with pytest.raises(KeyboardInterrupt):
        synthetic.make_model(target, "tiny", "Q8_0", layers=1, seed=5)
    assert target.read_bytes() == before and _listing(tmp_path) == ["m.gguf"]


# -- the GGUF writer -------------------------------------------------------------------------------

def _small_write(path, monkeypatch, split=0):
    cfg = synthetic.preset_config("tiny", layers=1)
    rng = np.random.default_rng(0)
    fake = [(f"blk.0.t{i}.weight", rng.standard_normal((4, 32)).astype(np.float32)) for i in range(3)]
    monkeypatch.setattr(gw, "deepseek2_tensors", lambda cfg, sd, layout="all", **kw: iter(fake))
    return gw.write_deepseek2_gguf(path, cfg, {}, qtype="F32", split_max_tensors=split)


@pytest.mark.parametrize("split", [0, 1])
def test_writer_publishes_all_files_or_none(tmp_path, monkeypatch, split):
    paths = _small_write(tmp_path / "w.gguf", monkeypatch, split)
    assert len(paths) == (3 if split else 1)
    assert _listing(tmp_path) == sorted(p.name for p in paths)
    for p in paths:
        gguf.GGUFReader(str(p))

    out = tmp_path / "fail"
    out.mkdir()

    def boom(self, *a, **k):
        self.fout[0].write(b"\0" * 64)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(KeyboardInterrupt):
        _small_write(out / "w.gguf", monkeypatch, split)
    assert _listing(out) == []


def test_writer_refuses_directory_and_unwritable_type(tmp_path, monkeypatch):
    (tmp_path / "d.gguf").mkdir()
    with pytest.raises(OptionError, match="is a directory"):
        _small_write(tmp_path / "d.gguf", monkeypatch)
    with pytest.raises(OptionError, match="Q4_K"):
        gw.write_deepseek2_gguf(tmp_path / "k.gguf", synthetic.preset_config("tiny"), {}, qtype="Q4_K")
    assert _listing(tmp_path) == ["d.gguf"]


# -- plot ----------------------------------------------------------------------------------------

ROW = {"n_kv_max": 1024, "pp": 512, "tg": 128, "n_kv": 0, "t_pp": 1.0, "speed_pp": 500.0, "t_tg": 1.0,
       "speed_tg": 50.0}


def _jsonl(tmp_path, *extra: str) -> Path:
    p = tmp_path / "run.jsonl"
    lines = [json.dumps(ROW), json.dumps(dict(ROW, n_kv=512))] + list(extra)
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("line,problem", [
    ("not json at all", "not a JSON object"),
    ('{"n_kv": 0, "speed_pp": 1.0', "not a JSON object"),
    ('[1, 2]', "not a JSON object"),
    ('{"n_kv": 1024, "speed_pp": 3.0}', "missing speed_tg"),
    ('{"n_kv": 1024, "speed_pp": "fast", "speed_tg": 3.0}', "speed_pp"),
    ('{"n_kv": 1024, "speed_pp": NaN, "speed_tg": 3.0}', "speed_pp"),
    ('{"n_kv": 1024, "speed_pp": 1.0, "speed_tg": Infinity}', "speed_tg"),
    ('{"n_kv": -5, "speed_pp": 1.0, "speed_tg": 2.0}', "n_kv"),
    ('{"n_kv": true, "speed_pp": 1.0, "speed_tg": 2.0}', "n_kv"),
    ('{"n_kv": 1024, "speed_pp": -1.0, "speed_tg": 2.0}', "speed_pp"),
])
def test_plot_names_the_bad_line(tmp_path, line, problem):
    p = _jsonl(tmp_path, line)
    with pytest.raises(OptionError, match=rf"^{p}:3: .*{problem}"):
        read_jsonl(p)
    with pytest.raises(OptionError):
        plot_files([p], tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_plot_reads_good_rows_and_writes_atomically(tmp_path, monkeypatch):
    p = _jsonl(tmp_path, "")  # blank lines are allowed
    rows = read_jsonl(p)
    assert [r["n_kv"] for r in rows] == [0, 512]
    (tmp_path / "sub").mkdir()
    out = plot_files([p], tmp_path / "sub" / "out.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _listing(tmp_path / "sub") == ["out.png"]

    import matplotlib.figure

    def boom(self, *a, **k):
        Path(a[0]).write_bytes(b"partial") if isinstance(a[0], (str, Path)) else a[0].write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", boom)
    with pytest.raises(KeyboardInterrupt):
        plot_files([p], tmp_path / "sub" / "out2.png")
    assert _listing(tmp_path / "sub") == ["out.png"]


def test_plot_refuses_bad_targets_and_files(tmp_path):
    p = _jsonl(tmp_path)
    (tmp_path / "d.png").mkdir()
    with pytest.raises(OptionError, match="is a directory"):
        plot_files([p], tmp_path / "d.png")
    with pytest.raises(OptionError, match="format"):
        plot_files([p], tmp_path / "out.xyz")
    # a directory that does not exist is refused (as sweep-bench --plot, make-model -o), not made
    with pytest.raises(OptionError, match="does not exist"):
        plot_files([p], tmp_path / "no" / "such" / "out.png")
    assert not (tmp_path / "no").exists()
    with pytest.raises(IkjaxError, match="cannot read"):
        read_jsonl(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(OptionError, match="no sweep-bench"):
        read_jsonl(empty)
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(OptionError, match="not a regular file"):
        read_jsonl(tmp_path / "fifo.jsonl")
