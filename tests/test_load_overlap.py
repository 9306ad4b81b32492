"""The weights load in a thread while the first steps compile from their shapes (issue 22, item 4;
IKJAX_LOAD_OVERLAP, ikjax.runtime.executors.BackgroundLoad).

Why: a cold start loaded every weight, then compiled (V2-Lite on an H100: 4.6 s load, then 16.7 s
of compiles, RESULTS §22). A step needs only the weights' shapes and shardings, known once the top
tensors and each layer group's first layer are in. What must hold: the steps compiled from the
shapes compute what steps compiled from the arrays compute, bit for bit; they compile before the
bytes are in (the test holds the load at its second layer until the compile is done); a stored
step made one way is found by a run made the other way (the key sees the same arguments); and a
load that fails in its thread raises its own error in the caller's thread, not a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import ikjax
from ikjax.errors import IkjaxError
from ikjax.model import weights as weights_mod

PROMPT = list(range(1, 12))


def _engine(path, overlap: str, monkeypatch, **opts):
    monkeypatch.setenv("IKJAX_LOAD_OVERLAP", overlap)
    return ikjax.load(path, ctx=256, ubatch=64, **opts)


def test_overlap_computes_what_a_plain_load_does(tiny4_model, monkeypatch):
    plain = _engine(tiny4_model, "0", monkeypatch)
    assert not plain.load_overlapped
    ref_logits = plain.logits(PROMPT)
    ref_tokens = list(plain.generate(PROMPT, 6))
    eng = _engine(tiny4_model, "1", monkeypatch)
    assert eng.load_overlapped  # one CPU device, every weight on it: the overlap applies
    eng.precompile(1, 16, 32)  # from the shapes, possibly before the load is done
    np.testing.assert_array_equal(eng.logits(PROMPT), ref_logits)
    assert list(eng.generate(PROMPT, 6)) == ref_tokens
    # the plan charged the load once it was waited for, and the tree is the arrays themselves; the
    # file's resident mapped bytes were measured on the load's thread (not the caller's, between
    # the compile and the first row), as the plain load measures them after its load
    assert eng.memory_plan().load_copy_bytes is not None
    from ikjax.runtime.memory_plan import mapped_rss
    assert eng._mapped_at_load is not None and plain._mapped_at_load is None
    assert abs(eng._mapped_at_load - mapped_rss([tiny4_model])) <= 1 << 20
    assert all(hasattr(a, "block_until_ready") for a in __import__("jax").tree.leaves(eng.weights))


def test_steps_compile_before_the_bytes_are_in(tiny4_model, monkeypatch):
    """The load is held after its shapes are known (each group's first layer in) until the
    compile is done: a compile that needed the weights would wait forever (timeout)."""
    gate = threading.Event()
    finish = weights_mod._GroupLoad.finish

    def held(self):
        assert gate.wait(120), "the compile did not finish while the load was held"
        return finish(self)
    monkeypatch.setattr(weights_mod._GroupLoad, "finish", held)
    eng = _engine(tiny4_model, "1", monkeypatch)
    seconds = eng.precompile(1, 16, 32) + eng.precompile_decode(1, 4, 32)
    assert seconds > 0 and eng.compile_count == 2
    assert eng.loading  # still held: the two steps compiled from the shapes alone
    gate.set()
    plain = _engine(tiny4_model, "0", monkeypatch)
    monkeypatch.setattr(weights_mod._GroupLoad, "finish", finish)
    np.testing.assert_array_equal(eng.logits(PROMPT[:16]), plain.logits(PROMPT[:16]))
    assert eng.compile_count >= 2 and not eng.loading


@pytest.mark.parametrize("dry", ["0", "1"])  # 1: the shapes computed before the load (IKJAX_DRY_SHAPES)
def test_a_failed_load_raises_its_error_in_the_caller(tiny4_model, dry, monkeypatch):
    monkeypatch.setenv("IKJAX_DRY_SHAPES", dry)

    def broken(self):
        raise IkjaxError(f"layer {self.first + 1}: bytes missing (test)")
    monkeypatch.setattr(weights_mod._GroupLoad, "finish", broken)
    eng = _engine(tiny4_model, "1", monkeypatch)  # the shapes were known: the engine is made
    with pytest.raises(IkjaxError, match="bytes missing"):
        eng.logits(PROMPT)
    with pytest.raises(IkjaxError, match="bytes missing"):  # and again: not a hang, not a None
        eng.wait_loaded()


@pytest.mark.parametrize("dry", ["0", "1"])  # 1: computing the shapes fails too, then the load's own error
def test_a_load_that_fails_before_its_shapes_raises_at_load(tiny4_model, dry, monkeypatch):
    monkeypatch.setenv("IKJAX_DRY_SHAPES", dry)

    def broken(self, first, count):
        raise IkjaxError("first layer unreadable (test)")
    monkeypatch.setattr(weights_mod.TensorLoader, "group_start", broken)
    with pytest.raises(IkjaxError, match="first layer unreadable"):
        _engine(tiny4_model, "1", monkeypatch)


RUN = """
import json, sys
import ikjax
eng = ikjax.load(sys.argv[1], ctx=256, ubatch=64)
eng.precompile(1, 64, 64)
logits = eng.logits(list(range(1, 9)))
print(json.dumps(dict(overlapped=eng.load_overlapped, compiled=eng.compile_count, from_cache=eng.compile_cache_hits,
                      logits=[float(x) for x in logits.reshape(-1)[:64]])))
"""


def _run(model, overlap: str, cache) -> dict:
    env = {**os.environ, "IKJAX_COMPILE_CACHE": str(cache), "IKJAX_STORE_STEPS": "1", "IKJAX_LOAD_OVERLAP": overlap}
    res = subprocess.run([sys.executable, "-c", RUN, model], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_step_stored_one_way_is_found_the_other(tiny4_model, tmp_path):
    """Steps stored by an overlapped run (compiled from ShapeDtypeStructs) are found whole by a
    plain run (arrays), and the other way round: the key describes the same arguments."""
    a = _run(tiny4_model, "1", tmp_path / "a")
    assert a["overlapped"] and a["from_cache"] == 0 and a["compiled"] >= 2
    b = _run(tiny4_model, "0", tmp_path / "a")
    assert not b["overlapped"] and b["from_cache"] == b["compiled"] == a["compiled"], (a, b)
    assert b["logits"] == a["logits"]
    c = _run(tiny4_model, "0", tmp_path / "c")
    d = _run(tiny4_model, "1", tmp_path / "c")
    assert d["from_cache"] == d["compiled"] == c["compiled"] and d["logits"] == c["logits"], (c, d)


# -- the commands, as a user runs them: the same output with the load beside the compile ---------

def _invoke(args, monkeypatch, overlap: str, code: int = 0):
    from typer.testing import CliRunner
    from ikjax.cli import app
    monkeypatch.setenv("IKJAX_LOAD_OVERLAP", overlap)
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, f"exit {res.exit_code}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def test_sweep_bench_and_generate_beside_the_load(tiny4_model, monkeypatch):
    sweep = ["sweep-bench", "-m", tiny4_model, "-c", 512, "-ub", 128, "-n", 8]
    rows = {}
    for ov in ("0", "1"):
        res = _invoke(sweep, monkeypatch, ov)
        assert ("in a thread beside the compile" in res.stderr) == (ov == "1"), res.stderr
        assert res.stderr.index("compiled") < res.stderr.index("memory plan"), res.stderr
        rows[ov] = [line.split("|")[1:4] for line in res.stdout.splitlines() if line.startswith("|  ")]
    assert rows["0"] == rows["1"] and len(rows["1"]) == 5, rows  # the header and 4 rows
    gen = ["generate", "-m", tiny4_model, "-p", "Hello world", "-n", 8, "--temp", 0, "-c", 256, "-ub", 64]
    a, b = _invoke(gen, monkeypatch, "0"), _invoke(gen, monkeypatch, "1")
    assert a.stdout == b.stdout and "Hello world" in b.stdout


def test_a_command_error_while_loading_stops_the_load(tiny4_model, monkeypatch):
    """generate's prompt check runs beside the load: its one-line error, and the load's thread
    stopped (cancel_load), not left copying as the process ends."""
    from ikjax.runtime import engine as engine_mod
    made = []
    init = engine_mod.Engine.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(engine_mod.Engine, "__init__", keep)
    finish = weights_mod._GroupLoad.finish

    def held(self):  # the load is still under way when the command fails, until it is told to stop
        assert self.load.cancel.wait(120), "the load was never cancelled"
        return finish(self)
    monkeypatch.setattr(weights_mod._GroupLoad, "finish", held)
    res = _invoke(["generate", "-m", tiny4_model, "-p", "word " * 300, "-n", 8, "-c", 256, "-ub", 64],
                  monkeypatch, "1", code=1)
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "leave no room" in err[0], res.stderr
    assert made and made[0].load_overlapped and not made[0].loading
    with pytest.raises(weights_mod.LoadCancelled):
        made[0].wait_loaded()  # stopped at its next layer


def test_interrupted_wait_stops_the_load(tiny4_model, monkeypatch):
    """Ctrl-C while the engine waits for its load: the load's thread is stopped (at its next
    layer) before the interrupt goes on, not left running as the interpreter exits."""
    from ikjax.runtime import executors
    gate = threading.Event()
    finish = weights_mod._GroupLoad.finish

    def held(self):  # the load sits between layers until it is cancelled
        assert self.load.cancel.wait(120), "the load was never cancelled"
        gate.set()
        return finish(self)
    monkeypatch.setattr(weights_mod._GroupLoad, "finish", held)
    eng = _engine(tiny4_model, "1", monkeypatch)
    loading = eng._loading

    calls = []
    real_join = loading._thread.join

    def join(*a):  # the first wait is interrupted (Ctrl-C); cancel's own join then waits for real
        calls.append(a)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_join(*a)
    monkeypatch.setattr(loading._thread, "join", join)
    with pytest.raises(KeyboardInterrupt):
        eng.wait_loaded()
    assert len(calls) == 2 and gate.is_set()  # cancel reached the load and waited for its thread
    assert not loading._thread.is_alive() and isinstance(loading._error, weights_mod.LoadCancelled)
    assert isinstance(loading, executors.BackgroundLoad)



def test_overlap_decision_on_an_accelerator(monkeypatch):
    """Engine._overlaps_load on a GPU placement (host and device memories apart): auto overlaps
    when every weight is on the device, not with host-resident tensors (-ot exps=CPU: flags set
    after the load) nor --gpu-experts. Until ccd6438's GPU run the test read `unified`, true only
    on a CPU-only machine, and no GPU load ever ran beside the compile."""
    from types import SimpleNamespace
    from ikjax.placement.rules import Placement, TensorPlacement
    from ikjax.runtime.engine import Engine

    def decide(memories, gpu_experts=None, overlap="auto", expert_stats=None, store="auto"):
        monkeypatch.setenv("IKJAX_LOAD_OVERLAP", overlap)
        monkeypatch.setenv("IKJAX_STORE_STEPS", store)
        tensors = tuple(TensorPlacement(f"blk.0.t{i}", m, "GPU0" if m == "device" else "CPU", 0, None, 100, "default")
                        for i, m in enumerate(memories))
        eng = SimpleNamespace(
            executor=SimpleNamespace(overlaps_load=True, compiles_in_parallel=True, stores_steps=True,
                                     on_cpu_only=False),
            placement=Placement(tensors, ("GPU0",), unified=False),
            options=SimpleNamespace(gpu_experts=gpu_experts, expert_stats=expert_stats))
        return Engine._overlaps_load(eng)

    assert decide(["device", "device"])
    assert not decide(["device", "host"])
    assert not decide(["device", "device"], gpu_experts="auto")
    assert not decide(["device", "device"], overlap="0")
    # steps JAX's own cache serves (not stored whole) lower beside no load (RESULTS §25j)
    assert not decide(["device", "device"], expert_stats="stats.json")
    assert not decide(["device", "device"], store="0")
    assert decide(["device", "device"], store="0", overlap="1")


# --- JAX's backend started on a thread as the command line starts (ikjax.early_backend) ---

def test_early_backend_only_for_model_commands_without_a_coordinator(monkeypatch):
    from ikjax import early_backend as eb
    monkeypatch.delenv("IKJAX_EARLY_BACKEND", raising=False)
    assert eb.wanted(["sweep-bench", "-m", "x.gguf"])
    assert eb.wanted(["serve", "-m", "x.gguf", "--port", "8080"])
    for args in ([], ["info", "x.gguf"], ["make-model", "-o", "x"], ["run", "--config", "c.json"],
                 ["generate", "-m", "x", "--coordinator", "h:1"], ["bench", "--coordinator=h:1"],
                 ["generate", "--help"]):
        assert not eb.wanted(args), args  # a coordinator must join before any backend exists
    monkeypatch.setenv("IKJAX_EARLY_BACKEND", "0")
    assert not eb.wanted(["sweep-bench", "-m", "x.gguf"])
    # only the command line's own process: the console script, or `python -m ikjax.cli` (argv[0]
    # is "-m" while Python imports the module's packages); never a script or pytest importing ikjax
    assert eb.is_cli(["/usr/local/bin/ikjax", "serve"]) and eb.is_cli(["-m", "sweep-bench"])
    for argv in ([], ["-c", "serve"], ["/x/pytest", "serve"], ["myscript.py", "sweep-bench"], ["ikjax.py"]):
        assert not eb.is_cli(argv), argv


def test_early_backend_starts_before_the_package_imports_gguf(tiny4_model, tmp_path):
    """As the command line: the backend's thread starts from ikjax/__init__, before the package
    imports gguf (and its own modules), so it runs beside those imports."""
    probe = ("import sys\n"
             "sys.argv = ['/usr/bin/ikjax'] + sys.argv[1:]\n"
             "import ikjax, ikjax.early_backend as eb\n"
             "print('thread', eb._thread is not None, 'gguf first', eb.began_after_gguf)\n")
    env = dict(os.environ, IKJAX_COMPILE_CACHE=str(tmp_path / "cc"))
    out = subprocess.run([sys.executable, "-c", probe, "generate", "-m", tiny4_model], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["thread", "True", "gguf", "first", "False"]


EARLY = """
import sys, threading
sys.argv = ["ikjax"] + sys.argv[1:]
import ikjax.cli
names = [t.name for t in threading.enumerate()]
print("started", "ikjax-backend-start" in names or __import__("ikjax.early_backend").early_backend._thread is not None)
ikjax.cli.main()
"""


@pytest.mark.parametrize("early", ["1", "0"])
def test_early_backend_command_runs_and_errors_as_before(tiny4_model, early, tmp_path):
    """With the thread or without: the same table, and a bad file still one line and exit 1 (the
    thread joined at exit, no traceback from a backend left half-started)."""
    env = dict(os.environ, IKJAX_EARLY_BACKEND=early, IKJAX_COMPILE_CACHE=str(tmp_path / "cc"))
    ok = subprocess.run([sys.executable, "-c", EARLY, "generate", "-m", tiny4_model, "-p", "1,2,3", "-n", "4",
                         "--temp", "0"], env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.splitlines()[0] == f"started {early == '1'}"
    bad = subprocess.run([sys.executable, "-c", EARLY, "generate", "-m", str(tmp_path / "missing.gguf"), "-p", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr and "missing.gguf" in bad.stderr.strip().splitlines()[-1]


# -- the weights' shapes computed before the load (load_weights(shapes_only=True), IKJAX_DRY_SHAPES) ---

def _shapes_both_ways(path: str):
    eng = ikjax.load(path, ctx=256, ubatch=32)
    seen = {}
    real = weights_mod.load_weights(eng.file, eng.config, placement=eng.placement, spans=eng.spans,
                                    on_shapes=lambda t: seen.setdefault("tree", t))
    dry = weights_mod.load_weights(eng.file, eng.config, placement=eng.placement, spans=eng.spans, shapes_only=True)
    return seen["tree"], real, dry


@pytest.mark.parametrize("kernels", ["cpu", "interpret"])
def test_dry_shapes_are_the_loads(tiny4_model, kernels, monkeypatch):
    """The tree computed without the bytes (each tensor's device asked with a zero-size array, each
    repack, fused row and stack traced) equals, leaf for leaf (shape, dtype, sharding) and in
    structure, the one the load hands `on_shapes` and the loaded arrays', with the C++ kernels'
    layout and the Pallas kernels' repacks (interpret: the GPU's load); and no bytes are read."""
    monkeypatch.setenv("IKJAX_KERNELS", kernels)
    seen, real, dry = _shapes_both_ways(tiny4_model)
    assert weights_mod.same_shapes(seen, dry) and weights_mod.same_shapes(weights_mod.abstract(real), dry)
    leaves = __import__("jax").tree.leaves(dry)
    assert leaves and all(isinstance(a, __import__("jax").ShapeDtypeStruct) and a.sharding is not None for a in leaves)
    assert any(len(a.shape) >= 3 for a in leaves)  # the stacked groups are there


def test_dry_shapes_of_the_real_converters_files(monkeypatch):
    """The same on the fixtures (ik_llama.cpp's converter: MLA layouts, K-quants, kv_b split)."""
    from conftest import fixtures_dir
    d = fixtures_dir()
    files = sorted(d.glob("*.gguf"))[:4]
    assert files
    for kernels in ("cpu", "interpret"):
        monkeypatch.setenv("IKJAX_KERNELS", kernels)
        for f in files:
            seen, real, dry = _shapes_both_ways(str(f))
            assert weights_mod.same_shapes(seen, dry), (f.name, kernels)


def test_steps_compiled_from_dry_shapes(tiny4_model, monkeypatch):
    """IKJAX_DRY_SHAPES=1 (a CPU's default is off: its load runs no programs): the steps compile from
    the computed tree, compute what a plain load's compute; a (never expected) difference between
    the computed and the loaded shapes drops the compiled steps, which compile again, with the
    same results and a warning."""
    plain = _engine(tiny4_model, "0", monkeypatch)
    ref = plain.logits(PROMPT)
    monkeypatch.setenv("IKJAX_DRY_SHAPES", "1")
    eng = _engine(tiny4_model, "1", monkeypatch)
    assert eng._dry is not None and eng._shapes is eng._dry
    eng.precompile(1, 16, 32)
    np.testing.assert_array_equal(eng.logits(PROMPT), ref)
    from ikjax.runtime import engine as engine_mod
    monkeypatch.setattr(engine_mod, "same_shapes", lambda a, b: False)
    odd = _engine(tiny4_model, "1", monkeypatch)
    odd.precompile(1, 16, 32)
    np.testing.assert_array_equal(odd.logits(PROMPT), ref)
    assert odd._dry is None  # the loaded tree's shapes from then on
    monkeypatch.setenv("IKJAX_DRY_SHAPES", "auto")
    assert _engine(tiny4_model, "1", monkeypatch)._dry is None  # a CPU: off by default


def test_interpreter_exit_stops_a_load_first(tmp_path):
    """A script that fails while its weights still load: at exit the load is told to stop and its
    thread joined before the interpreter tears down (a daemon thread left inside the runtime's
    copies ended a GPU process in an abort instead of the script's traceback), and the script's
    own error and exit status come out."""
    marker = tmp_path / "stopped"
    script = f"""
import threading, time
from ikjax.runtime.executors import BackgroundLoad
started = threading.Event()
def slow_load(file, on_shapes=None, cancel=None):
    started.set()
    while not cancel.is_set():  # a layer at a time, as load_weights checks `cancel`
        time.sleep(0.01)
    open({str(marker)!r}, "w").write("stopped")
    raise RuntimeError("cancelled")
load = BackgroundLoad(slow_load, "model.gguf")
started.wait()
raise SystemExit("the script's own error")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "the script's own error" in r.stderr
    assert marker.read_text() == "stopped"
