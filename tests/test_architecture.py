"""The code's shape, checked so it cannot grow back: layered packages whose imports point one way,
no import cycle at any level (function-level imports included), the kernels below ikjax, one
place that reads the environment, one description per tensor."""
from __future__ import annotations

import re
from pathlib import Path

import grimp
import pytest

from ikjax import env
from ikjax.gguf_io import tensors

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ikjax", "pallas_kernels")


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            succ = edges.get(v, [])
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_no_import_cycle_at_any_level(graph):
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    """The check above could fail: a two-module loop is reported."""
    class G:
        modules = {"a", "b", "c"}

        @staticmethod
        def find_modules_directly_imported_by(m):
            return {"a": {"b"}, "b": {"a"}, "c": {"a"}}[m]
    assert _cycles(G) == [["a", "b"]]


def test_import_contracts_kept():
    """pyproject.toml's import-linter contracts: the layers, the kernels below ikjax, only the ops
    reaching the kernels, no cycle between the modules of any package."""
    from importlinter.cli import lint_imports
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_nothing_imports_the_package_facade(graph):
    """`ikjax/__init__.py` is the public facade (load, Engine, RunOptions); a module inside the
    package that imported it would reach the runtime from below."""
    importers = sorted(m for m in graph.find_modules_that_directly_import("ikjax") if m.startswith(PACKAGES))
    assert importers == []


def test_pallas_kernels_reach_only_quant_and_errors(graph):
    for m in graph.modules:
        if m.startswith("pallas_kernels"):
            for i in graph.find_modules_directly_imported_by(m):
                if i.startswith("ikjax"):
                    assert i.startswith(("ikjax.quant", "ikjax.errors")), f"{m} imports {i}"


def test_environment_read_in_one_place():
    """Only ikjax/env.py reads IKJAX_* variables, and every one the code names is declared there."""
    named: set[str] = set()
    for path in sorted((REPO / "ikjax").rglob("*.py")) + sorted((REPO / "pallas_kernels").rglob("*.py")):
        text = path.read_text()
        named.update(re.findall(r"\bIKJAX_[A-Z0-9_]+", text))
        if path.name == "env.py" and path.parent.name == "ikjax":
            continue
        reads = re.findall(r"(?:os\.environ(?:\.get)?\s*[\[(]|os\.getenv\s*\()\s*[\"'](IKJAX_\w+)", text)
        assert reads == [], f"{path.relative_to(REPO)} reads {reads} itself; use ikjax.env"
    for path in sorted((REPO / "pallas_kernels").rglob("*.cc")):
        named.update(re.findall(r"(?:getenv|env_on)\(\"(IKJAX_\w+)\"\)", path.read_text()))
    build_only = {"IKJAX_BUILD_CUDA"}  # a CMake option (-Ccmake.define.IKJAX_BUILD_CUDA=ON), not an environment variable
    assert named - build_only - set(env.VARIABLES) == set()


def test_env_choice_refuses_a_bad_value(monkeypatch):
    from ikjax.errors import OptionError
    monkeypatch.setenv("IKJAX_STREAM", "sideways")
    with pytest.raises(OptionError, match="IKJAX_STREAM must be one of auto, active, chunks, layer"):
        env.choice("IKJAX_STREAM")
    monkeypatch.setenv("IKJAX_STREAM", "LAYER")
    assert env.choice("IKJAX_STREAM") == "layer"
    monkeypatch.delenv("IKJAX_STREAM")
    assert env.choice("IKJAX_STREAM") == "auto"


def test_native_knobs_refused_when_an_engine_loads(monkeypatch):
    """The C++ kernels read their knobs themselves and run their default on a value they cannot use
    (IKJAX_AMX_MIN_ROWS=8 ran the default, silently): env.check_native refuses it first, when an
    engine loads, naming the variable."""
    import ikjax
    from ikjax.errors import OptionError
    for name, bad, msg in (("IKJAX_AMX_MIN_ROWS", "8", "integer >= 16"), ("IKJAX_AMX_MIN_ROWS", "64 rows", "integer"),
                           ("IKJAX_SPIN", "-1", "integer >= 0"), ("IKJAX_AVXVNNI", "2", "one of 1, 0"),
                           ("IKJAX_CPU_PART_ROWS", "10", "integer >= 64"), ("IKJAX_CPU_PART_ROWS", "abc", "integer"),
                           ("IKJAX_MOE_ONE_JOB", "yes", "one of 0, 1"), ("IKJAX_CPU_ISA", "sse4", "one of generic"),
                           # what the C++ side reads differently: exact case, plain digits, no overflow
                           ("IKJAX_CPU_ISA", "Generic", "lower case"), ("IKJAX_AMX_MIN_ROWS", "3_2", "integer >= 16"),
                           ("IKJAX_AMX_MIN_ROWS", "32 ", "integer >= 16"), ("IKJAX_SPIN", "9" * 20, "at most")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(OptionError, match=f"{name} must be .*{msg}"):
            env.check_native()
        with pytest.raises(OptionError, match=name):  # before the file is even opened
            ikjax.load("/nonexistent/model.gguf")
        monkeypatch.delenv(name)
    monkeypatch.setenv("IKJAX_AMX_MIN_ROWS", "32")
    monkeypatch.setenv("IKJAX_SPIN", "0")
    monkeypatch.setenv("IKJAX_CPU_PART_ROWS", "64")
    env.check_native()  # values the kernels take pass


def test_every_variable_checked_when_an_engine_loads(monkeypatch, capsys):
    """Each IKJAX_* set is checked before the file is opened, not at its first use after a load
    (IKJAX_STREAM_MIB=-5 at the first host-expert step, IKJAX_DECODE_LOOP=yes after the load);
    an unknown name is named on stderr with the closest known one, and left alone."""
    import ikjax
    from ikjax.errors import IkjaxError, OptionError
    for name, bad, msg in (("IKJAX_STREAM_MIB", "-5", "positive number of MiB"), ("IKJAX_JOIN_TIMEOUT", "abc", "positive integer"),
                           ("IKJAX_DECODE_LOOP", "yes", "one of 1, 0"), ("IKJAX_DECODE_UNROLL", "0", "positive integer"),
                           ("IKJAX_FOLD_NORM", "on", "one of 1, 0"), ("IKJAX_SERVE_BURST_MS", "fast", "positive number"),
                           ("IKJAX_STREAM_MIB", "inf", "positive number of MiB"), ("IKJAX_SERVE_BURST_MS", "nan", "positive"),
                           ("IKJAX_JOIN_TIMEOUT", "9" * 25, "positive integer")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(OptionError, match=f"{name} must be a? ?{msg}"):
            ikjax.load("/nonexistent/model.gguf")
        monkeypatch.delenv(name)
    for name, good in (("IKJAX_DECODE_UNROLL", "auto"), ("IKJAX_DECODE_UNROLL", "4"), ("IKJAX_STREAM_MIB", "64.5")):
        monkeypatch.setenv(name, good)
        env.check_all()
        monkeypatch.delenv(name)
    monkeypatch.setenv("IKJAX_KERNEL", "xla")
    with pytest.raises(IkjaxError) as e:  # the file's own error: the unknown name is not refused
        ikjax.load("/nonexistent/model.gguf")
    assert "IKJAX_KERNEL" not in str(e.value)
    assert "IKJAX_KERNEL is not a variable ikjax reads (ignored); did you mean IKJAX_KERNELS?" in capsys.readouterr().err


def test_readme_lists_every_variable():
    assert env.markdown_table() in (REPO / "README.md").read_text()


def test_one_description_per_tensor():
    """Every tensor kind is described once; the loader's fused and repacked sets, -sm graph's split
    groups and placement's logical axes are all read off those descriptions."""
    keys = [k.key for k in tensors.KINDS]
    suffixes = [k.suffix for k in tensors.KINDS]
    assert len(set(keys)) == len(keys) and len(set(suffixes)) == len(suffixes)
    # the fused matrices stack kinds that read the same input, in row order
    assert ("attn_in", ("q_a", "kv_a_mqa")) in tensors.FUSED_ROWS
    assert ("attn_in", ("q", "kv_a_mqa")) in tensors.FUSED_ROWS
    assert ("ffn_gate_up", ("ffn_gate", "ffn_up")) in tensors.FUSED_ROWS
    for name, parts in tensors.FUSED_ROWS:
        assert name in tensors.KERNEL_MATRICES and all(tensors.KIND[p].kernel for p in parts)
    # what the Pallas kernels cannot read stays in GGUF blocks: the row-gathered embedding, the router,
    # the per-head absorbed matrices
    assert not {"token_embd", "gate_inp", "k_b", "v_b"} & tensors.KERNEL_MATRICES
    assert tensors.split_group("blk.3.attn_q_b.weight") == "attn"
    assert tensors.split_group("blk.3.ffn_gate_inp.weight") == "router"
    assert tensors.split_group("blk.3.attn_q_a.weight") is None
    assert tensors.split_group("output.weight") is None
    assert tensors.logical_axes("blk.0.attn_k_b.weight", 2) == ("heads", "head_dim")
    assert tensors.logical_axes("blk.0.attn_k_b.weight", 3) == ("heads", "kv_lora", "head_dim")
    assert tensors.logical_axes("blk.61.nextn.eh_proj.weight", 2) == (None, None)


def test_every_written_tensor_has_a_description(tmp_path):
    """A synthetic model's tensors (the writer's names) are all described, but for the MTP block."""
    from ikjax.gguf_io.reader import GGUFModelFile
    from ikjax.tools.synthetic import make_model
    path = make_model(tmp_path / "m.gguf", "tiny", "Q8_0", layers=2)
    names = GGUFModelFile(str(path)).tensors
    assert names and all(tensors.kind_of(n) is not None for n in names if ".nextn." not in n)
