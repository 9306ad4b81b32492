"""The persistent compilation cache (ikjax.runtime.compile_cache): a second process compiles nothing and
computes the same logits; IKJAX_COMPILE_CACHE=0 writes nothing; a changed kernel library gets its
own subdirectory; a bad directory is one OptionError naming the setting.

The runs are subprocesses: JAX decides about its cache once per process, and the test process
itself keeps the cache off (conftest)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from ikjax.runtime import compile_cache
from ikjax.errors import OptionError

RUN = """
import json, sys
import numpy as np
import ikjax
from ikjax.runtime import compile_cache
eng = ikjax.load(sys.argv[1], ctx=256, ubatch=32)
out = eng.logits(list(range(1, 41)))  # two prompt chunks: two step shapes
np.save(sys.argv[2], out)
print(json.dumps(dict(compiled=eng.compile_count, from_cache=eng.compile_cache_hits, hits=compile_cache.hits(),
                      writes=compile_cache.writes(), dir=str(compile_cache.directory()),
                      step_loads=compile_cache.step_loads(), replaced=compile_cache.replaced(),
                      read_ahead=compile_cache.steps_read_ahead())))
"""


def _run(model: str, out: Path, env: dict, stderr: list | None = None) -> dict:
    res = subprocess.run([sys.executable, "-c", RUN, model, str(out)], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    if stderr is not None:
        stderr.append(res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


def test_second_process_compiles_nothing_and_matches(tiny_model, tmp_path):
    cache = tmp_path / "xla"
    env = {"IKJAX_COMPILE_CACHE": str(cache), "IKJAX_STORE_STEPS": "1"}  # stored whole: GPU's default
    cold = _run(tiny_model, tmp_path / "a.npy", env)
    assert cold["compiled"] == 2 and cold["from_cache"] == 0 and cold["writes"] >= 2
    assert Path(cold["dir"]).parent == cache and Path(cold["dir"]).name == compile_cache.build_tag()
    assert any(p.name.startswith("jit_forward") for p in _files(cache))
    warm = _run(tiny_model, tmp_path / "b.npy", env)
    assert warm["compiled"] == 2 and warm["from_cache"] == 2  # both steps loaded
    assert warm["writes"] == 0 and warm["hits"] >= 2  # nothing compiled anywhere in the process
    # loaded whole from steps/, the first one included: the C++ FFI targets are registered before
    # a stored step is deserialized (it once failed with "No FFI handler registered for
    # ikjax_cpu_embed_rows" and came from JAX's cache, traced)
    assert warm["step_loads"] == 2
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    # the steps are also kept whole (loaded without tracing); a damaged entry is a miss, the
    # step then comes from JAX's own cache, and the entry is removed (not read again)
    steps = [p for p in _files(cache) if p.parent.name == "steps"]
    assert len(steps) == 2
    for p in steps:
        p.write_bytes(b"not a pickle")
    again = _run(tiny_model, tmp_path / "c.npy", env)
    assert again["from_cache"] == 2 and again["writes"] == 0 and again["step_loads"] == 0
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "c.npy"))
    # a JAX cache hit is not stored again (it would not serialize whole on XLA:CPU)
    assert not any(p.exists() for p in steps)
    # by default a CPU stores no steps
    default = _run(tiny_model, tmp_path / "d.npy", {"IKJAX_COMPILE_CACHE": str(tmp_path / "xla2")})
    assert default["writes"] >= 2 and not [p for p in _files(tmp_path / "xla2") if p.parent.name == "steps"]


def test_warm_run_reads_its_steps_ahead(tiny_model, tmp_path):
    """A run notes the stored steps it used under its model and options; the next such run reads
    them on a thread while its weights load (issue 22's warm start) and takes them from there,
    checked as any stored step: an entry holding another step's executable is not used (the step
    comes from JAX's cache, the entry is removed), and IKJAX_PREFETCH_STEPS=0 reads nothing ahead."""
    cache = tmp_path / "xla"
    env = {"IKJAX_COMPILE_CACHE": str(cache), "IKJAX_STORE_STEPS": "1"}
    cold = _run(tiny_model, tmp_path / "a.npy", env)
    assert cold["compiled"] == 2 and cold["read_ahead"] == 0
    lists = list(cache.rglob("recent/*.txt"))
    assert len(lists) == 1
    names = lists[0].read_text().split()
    steps = {p.name: p for p in _files(cache) if p.parent.name == "steps"}
    assert sorted(names) == sorted(steps)  # both steps, each once
    warm = _run(tiny_model, tmp_path / "b.npy", env)
    assert warm["step_loads"] == 2 and warm["read_ahead"] == 2 and warm["writes"] == 0
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    off = _run(tiny_model, tmp_path / "c.npy", {**env, "IKJAX_PREFETCH_STEPS": "0"})
    assert off["step_loads"] == 2 and off["read_ahead"] == 0
    # another step's executable under this step's name: read ahead, refused by its key, compiled
    first, second = (steps[n] for n in names)
    second.write_bytes(first.read_bytes())
    mixed = _run(tiny_model, tmp_path / "d.npy", env)
    assert mixed["step_loads"] == 1 and mixed["read_ahead"] == 1 and mixed["from_cache"] == 2
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "d.npy"))
    assert not second.exists()  # removed, not read again
    # a list that is not text (a damaged cache: an outside probe's run then failed with a
    # UnicodeDecodeError every time, and bench skipped its rows): nothing read ahead, the run goes
    # on, and the list is written anew
    lists[0].write_bytes(b"\xff\xfe")
    damaged = _run(tiny_model, tmp_path / "e.npy", env)
    assert damaged["read_ahead"] == 0
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "e.npy"))
    assert lists[0].read_text().split()  # readable again


def test_off_writes_nothing(tiny_model, tmp_path):
    home = tmp_path / "home"
    env = {"IKJAX_COMPILE_CACHE": "0", "HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = _run(tiny_model, tmp_path / "a.npy", env)
    assert r["dir"] == "None" and r["writes"] == 0 and r["hits"] == 0 and r["from_cache"] == 0
    assert _files(home) == [] and _files(tmp_path / "xdg") == []


def test_sweep_bench_says_it_compiled_nothing(tiny_model, tmp_path):
    """The second `ikjax sweep-bench` of the same model and options: "compiled 0 steps, N from the cache"."""
    args = [sys.executable, "-c", "from ikjax.cli import app; app()", "sweep-bench", "-m", tiny_model, "-c", "128",
            "-ub", "64", "-n", "2", "--compile-cache", str(tmp_path / "c")]
    lines = []
    for _ in range(2):
        res = subprocess.run(args, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "IKJAX_COMPILE_CACHE": "0"})  # the option wins over the variable
        assert res.returncode == 0, res.stderr
        lines.append(next(l for l in res.stderr.splitlines() if l.startswith("compiled ")))
    n = int(lines[0].split()[1])
    assert n >= 2 and lines[0].startswith(f"compiled {n} steps, 0 from the cache"), lines[0]
    assert lines[1].startswith(f"compiled 0 steps, {n} from the cache"), lines[1]
    assert str(tmp_path / "c") in lines[1]


def test_resolve_locations(monkeypatch, tmp_path):
    monkeypatch.delenv("IKJAX_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve() == tmp_path / "xdg" / "ikjax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.resolve() == Path.home() / ".cache" / "ikjax" / "xla"
    monkeypatch.setenv("IKJAX_COMPILE_CACHE", str(tmp_path / "env"))
    assert compile_cache.resolve() == tmp_path / "env"
    assert compile_cache.resolve(str(tmp_path / "opt")) == tmp_path / "opt"  # the CLI option wins
    for off in ("0", "off", "OFF", "false"):
        monkeypatch.setenv("IKJAX_COMPILE_CACHE", off)
        assert compile_cache.resolve() is None
    assert compile_cache.resolve("0") is None
    with pytest.raises(OptionError, match="--compile-cache: empty"):
        compile_cache.resolve("  ")


def test_unusable_directory_is_an_option_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OptionError, match=r"^--compile-cache: cannot use .*file/ikjax-.*IKJAX_COMPILE_CACHE=0"):
        compile_cache.setup(str(blocker))
    assert compile_cache.directory() is None  # nothing configured in this process


def test_build_tag_follows_the_kernel_library(monkeypatch, tmp_path):
    """A rebuilt native library (other bytes) must not reuse executables compiled against the old one."""
    lib = tmp_path / "_cpu.cpython-311-x86_64-linux-gnu.so"
    lib.write_bytes(b"one build")
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(compile_cache.importlib.util, "find_spec", lambda name: spec)
    a = compile_cache.build_tag()
    assert compile_cache.build_tag() == a
    lib.write_bytes(b"another build")
    b = compile_cache.build_tag()
    assert a != b and a.startswith("ikjax-") and b.startswith("ikjax-")
    monkeypatch.setattr(compile_cache, "_cpu_signature", lambda: "another CPU")
    assert compile_cache.build_tag() != b


def test_jax_cache_set_by_the_user_is_kept(tiny_model, tmp_path):
    """JAX_COMPILATION_CACHE_DIR set and no IKJAX_COMPILE_CACHE: ikjax uses JAX's directory as is."""
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "theirs"), "IKJAX_COMPILE_CACHE": "",
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = _run(tiny_model, tmp_path / "a.npy", env)
    assert r["dir"] == str(tmp_path / "theirs") and _files(tmp_path / "xdg") == []


def test_damaged_jax_entries_are_replaced(tiny_model, tmp_path):
    """Entries of JAX's own cache that cannot be read (random bytes, a truncated file, 0 bytes as a
    full disk leaves them): the run is correct, says so in one line (no UserWarnings), compiles
    them again and writes them afresh, so the next run loads everything and says nothing."""
    cache = tmp_path / "xla"
    env = {"IKJAX_COMPILE_CACHE": str(cache)}
    _run(tiny_model, tmp_path / "a.npy", env)
    entries = [p for p in _files(cache) if p.name.endswith("-cache")]
    assert len(entries) >= 3
    rng = np.random.default_rng(0)
    for i, p in enumerate(sorted(entries)):  # each kind of damage on some entries
        data = p.read_bytes()
        p.write_bytes([rng.bytes(len(data)), data[:len(data) // 2], b""][i % 3])
    damaged = {p: p.read_bytes() for p in entries}
    err: list[str] = []
    r = _run(tiny_model, tmp_path / "b.npy", env, err)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    assert r["replaced"] >= 2 and r["writes"] >= r["replaced"]
    notes = [line for line in err[0].splitlines() if line.strip()]
    assert "UserWarning" not in err[0] and "Error reading persistent compilation cache" not in err[0], err[0]
    assert len(notes) == 1 and "compilation cache: replacing an unreadable entry" in notes[0], notes
    for p, bad in damaged.items():
        assert p.exists() and p.read_bytes() != bad  # written afresh
    err.clear()
    again = _run(tiny_model, tmp_path / "c.npy", env, err)
    assert again["replaced"] == 0 and again["writes"] == 0 and again["from_cache"] == 2
    assert err[0].strip() == "", err[0]
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "c.npy"))


def test_damaged_stored_steps_are_compiled_again(tiny_model, tmp_path):
    """A stored step (IKJAX_STORE_STEPS=1) whose bytes changed on disk after it was written whole
    (one flipped bit inside the serialized executable) is a miss said in one line, removed, and the
    step compiled again with the same logits (it was deserialized and run as machine code: a segfault
    or an illegal instruction on every later run, once a wrong perplexity: an outside probe)."""
    cache = tmp_path / "xla"
    env = {"IKJAX_COMPILE_CACHE": str(cache), "IKJAX_STORE_STEPS": "1"}
    _run(tiny_model, tmp_path / "a.npy", env)
    steps = sorted(p for p in _files(cache) if p.parent.name == "steps")
    assert len(steps) >= 2
    for p in steps:
        data = bytearray(p.read_bytes())
        data[int(len(data) * 0.63)] ^= 1
        p.write_bytes(bytes(data))
    err: list[str] = []
    r = _run(tiny_model, tmp_path / "b.npy", env, err)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    assert r["step_loads"] == 0 and r["compiled"] == 2, r
    notes = [line for line in err[0].splitlines() if "damaged" in line]
    assert len(notes) == len(steps) and all("checksum does not match" in n for n in notes), err[0]
    err.clear()
    # the damaged entries are gone: served by JAX's cache now (a step JAX loaded is not stored whole
    # again on XLA:CPU, see Executables._compile), nothing said
    again = _run(tiny_model, tmp_path / "c.npy", env, err)
    assert again["from_cache"] == 2 and "damaged" not in err[0], (again, err[0])
    assert not [p for p in steps if p.exists() and p.read_bytes() == b""]
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "c.npy"))


WRITE_FAILS = """
import sys
import jax, jax.numpy as jnp
from jax._src import compilation_cache as jcc
from ikjax.runtime import compile_cache
compile_cache.setup()

class Full:
    def put(self, *a, **k):
        raise OSError(28, "No space left on device")
    def get(self, *a, **k):
        return None
jcc._get_cache = lambda backend: Full()
for k in range(3):
    jax.jit(lambda x, k=k: x * k + 1)(jnp.arange(4.0)).block_until_ready()
print("ok")
"""


def test_entries_not_written_are_one_line(tmp_path):
    """JAX's cache write failing (a full disk, the directory removed under the run): the run goes
    on, and says so once in one ikjax line, not a two-line UserWarning naming site-packages each
    time."""
    res = subprocess.run([sys.executable, "-c", WRITE_FAILS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "IKJAX_COMPILE_CACHE": str(tmp_path / "xla")})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert "UserWarning" not in res.stderr and "site-packages" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if "not written" in line]
    assert len(lines) == 1 and "No space left on device" in lines[0], res.stderr


PROGRAMS = """
import functools, json, sys
import jax, jax.numpy as jnp, numpy as np
from ikjax import programs
from ikjax.runtime import compile_cache
compile_cache.setup()

@functools.partial(jax.jit, static_argnums=1)
def scale(x, k):
    return x * k + 1

@functools.partial(jax.jit, donate_argnums=0)
def put(stack, row, j):
    return jax.lax.dynamic_update_index_in_dim(stack, row, j, 0)

x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
a = programs.run("scale", scale, (x,), (3.0,))
b = programs.run("scale", scale, (x + 1,), (3.0,))
st = jnp.zeros((4, 3), jnp.float32)
for j in range(4):
    st = programs.run("put", put, (st, x[0] + j, np.int32(j)))
print(json.dumps(dict(a=np.asarray(a).tolist(), b=np.asarray(b).tolist(), st=np.asarray(st).tolist(),
                      loads=compile_cache.program_loads())))
"""


def _programs(env: dict) -> dict:
    res = subprocess.run([sys.executable, "-c", PROGRAMS], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_load_programs_kept_whole(tmp_path):
    """The load's small programs (ikjax.programs: repacks, stacks) are kept whole beside the
    stored steps and read back by the next process without tracing, with the same answers; a
    damaged entry, or one holding another program, is a miss (compiled, or from JAX's own cache)
    and is removed; by default a CPU keeps none (its loads run none of them); with the cache off
    they are plain calls."""
    want = dict(a=[[1.0, 4.0, 7.0], [10.0, 13.0, 16.0]], b=[[4.0, 7.0, 10.0], [13.0, 16.0, 19.0]],
                st=[[0.0, 1.0, 2.0], [1.0, 2.0, 3.0], [2.0, 3.0, 4.0], [3.0, 4.0, 5.0]])
    cache = tmp_path / "xla"
    env = {"IKJAX_COMPILE_CACHE": str(cache), "IKJAX_STORE_STEPS": "1"}
    cold = _programs(env)
    assert {k: cold[k] for k in want} == want and cold["loads"] == 0
    stored = sorted(p for p in _files(cache) if p.parent.name == "programs")
    assert len(stored) == 2  # one a program, whatever the calls of it in a process
    warm = _programs(env)
    assert {k: warm[k] for k in want} == want and warm["loads"] == 2
    stored[1].write_bytes(stored[0].read_bytes())  # another program's executable under this one's name
    swapped = _programs(env)
    assert {k: swapped[k] for k in want} == want and swapped["loads"] == 1
    assert stored[0].exists() and not stored[1].exists()  # refused and removed, the good one kept
    stored[0].write_bytes(b"not a pickle")
    damaged = _programs(env)
    assert {k: damaged[k] for k in want} == want and damaged["loads"] == 0
    assert not stored[0].exists()  # removed, not read again (JAX's own cache answered the compile)
    default = _programs({"IKJAX_COMPILE_CACHE": str(tmp_path / "xla2"), "IKJAX_STORE_STEPS": "auto"})
    assert {k: default[k] for k in want} == want and default["loads"] == 0
    assert not [p for p in _files(tmp_path / "xla2") if p.parent.name == "programs"]
    off = _programs({"IKJAX_COMPILE_CACHE": "0", "IKJAX_STORE_STEPS": "1"})
    assert {k: off[k] for k in want} == want and off["loads"] == 0


def test_repacks_of_a_load_kept_whole(tiny_model, tmp_path):
    """A load that repacks for the Pallas kernels (interpret mode here: the GPU's load) reads its
    repack programs whole in the next process, with the same logits."""
    env = {"IKJAX_COMPILE_CACHE": str(tmp_path / "xla"), "IKJAX_STORE_STEPS": "1", "IKJAX_KERNELS": "interpret"}
    code = RUN.replace("step_loads=compile_cache.step_loads()",
                       "step_loads=compile_cache.step_loads(), program_loads=compile_cache.program_loads()")
    outs = []
    for name in ("a", "b"):
        res = subprocess.run([sys.executable, "-c", code, tiny_model, str(tmp_path / f"{name}.npy")],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    stored = [p for p in _files(tmp_path / "xla") if p.parent.name == "programs"]
    assert stored and outs[0]["program_loads"] == 0
    assert outs[1]["program_loads"] == len(stored)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))


def test_load_programs_compiled_ahead_of_the_load(tiny_model, tmp_path):
    """With the weights' shapes computed before the load (IKJAX_DRY_SHAPES) the load's programs
    (interpret-mode repacks here: a GPU's load) compile side by side ahead of it, and the load runs
    those executables rather than compiling its own: every program the load ran came from there,
    the same logits as a load that compiles each itself (IKJAX_PROGRAMS_AHEAD=0)."""
    base = {"IKJAX_STORE_STEPS": "1", "IKJAX_KERNELS": "interpret", "IKJAX_LOAD_OVERLAP": "1", "IKJAX_DRY_SHAPES": "1"}
    code = RUN.replace("step_loads=compile_cache.step_loads()",
                       "step_loads=compile_cache.step_loads(), ahead=compile_cache.programs_ahead(), "
                       "program_loads=compile_cache.program_loads()")
    outs = {}
    for run, ahead in (("cold", "1"), ("off", "0"), ("warm", "1")):
        cache = tmp_path / ("xla0" if ahead == "0" else "xla1")
        env = {**base, "IKJAX_PROGRAMS_AHEAD": ahead, "IKJAX_COMPILE_CACHE": str(cache)}
        res = subprocess.run([sys.executable, "-c", code, tiny_model, str(tmp_path / f"{run}.npy")],
                             env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        outs[run] = json.loads(res.stdout.strip().splitlines()[-1])
        stored = [p for p in _files(cache) if p.parent.name == "programs"]
        assert stored, run
        # each distinct program the load ran: served from ahead (1), compiled by the load (0); warm,
        # read whole on the ahead threads and served from there
        assert outs[run]["ahead"] == (0 if ahead == "0" else len(stored)), (run, outs[run], len(stored))
        assert outs[run]["program_loads"] == (len(stored) if run == "warm" else 0), (run, outs[run])
    for run in ("off", "warm"):
        np.testing.assert_array_equal(np.load(tmp_path / "cold.npy"), np.load(tmp_path / f"{run}.npy"))


def test_load_programs_on_another_device_come_back_there(tmp_path):
    """A program whose arrays live on the second of two devices (a -sm layer stage's load), and one
    on the first device of a process that sees two (the first stage's; it came back bound to both
    devices and refused its arguments, "expected 2 shards", on a 2-GPU lease), are kept whole and
    read back by the next process on the devices they were compiled for, with the same answers."""
    want = dict(a=[[1.0, 4.0, 7.0], [10.0, 13.0, 16.0]], st3=[3.0, 4.0, 5.0])
    env = {"IKJAX_COMPILE_CACHE": str(tmp_path / "xla"), "IKJAX_STORE_STEPS": "1",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()}
    for dev in (1, 0):
        code = PROGRAMS.replace(
            "x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)",
            f"x = jax.device_put(jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3), jax.devices()[{dev}])"
        ).replace("st = jnp.zeros((4, 3), jnp.float32)",
                  f"st = jax.device_put(jnp.zeros((4, 3), jnp.float32), jax.devices()[{dev}])"
                  ).replace("loads=compile_cache.program_loads()",
                            "loads=compile_cache.program_loads(), on=[d.id for d in a.devices() | st.devices()]")
        outs = []
        for _ in range(2):
            res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                                 text=True, timeout=120)
            assert res.returncode == 0, res.stderr
            outs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        for out, loads in zip(outs, (0, 2)):
            assert out["a"] == want["a"] and out["st"][3] == want["st3"], out
            assert out["loads"] == loads and out["on"] == [dev], out


@pytest.mark.parametrize("setting, backend, level", [
    ("auto", "pallas", 0), ("auto", "xla", None), ("1", "pallas", None), ("0", "xla", 0), ("0", "pallas", 0)])
def test_gpu_options_autotune(monkeypatch, setting, backend, level):
    """IKJAX_GPU_AUTOTUNE: XLA's autotuning off for the Pallas path by default (RESULTS §22q), on for
    the XLA path; the decode loop keeps its command buffers either way; the options are ones JAX's
    compile accepts (compiled here on the CPU, where XLA ignores the GPU ones)."""
    import jax
    import jax.numpy as jnp

    from ikjax.runtime import executables

    monkeypatch.setenv("IKJAX_GPU_AUTOTUNE", setting)
    plan = SimpleNamespace(backend=backend)
    for decode in (False, True):
        opts = executables.gpu_options(plan, decode) or {}
        assert opts.get("xla_gpu_autotune_level") == level
        assert ("xla_gpu_enable_command_buffer" in opts) == decode
        if decode:
            assert "WHILE" in opts["xla_gpu_enable_command_buffer"]
        exe = jax.jit(lambda x: x * 2 + 1).lower(jnp.float32(1)).compile(opts or None)
        assert float(exe(jnp.float32(3))) == 7.0
    assert executables.gpu_options(plan, True) is not executables._DECODE_GPU_OPTIONS  # a copy: callers add to it
    assert executables.gpu_options(plan, True, gpu=False) is None and executables.gpu_options(plan, False, False) is None


def test_gpu_options_decode_graph_unroll(monkeypatch):
    """IKJAX_DECODE_GRAPH_UNROLL=1 (the default) asks XLA to unroll the decode graph's layer loops
    (decode loop only), an option this jaxlib's compile accepts; 0 leaves them loops."""
    import jax
    import jax.numpy as jnp

    from ikjax.runtime import executables

    plan = SimpleNamespace(backend="pallas")
    monkeypatch.setenv("IKJAX_DECODE_GRAPH_UNROLL", "0")
    assert "xla_gpu_command_buffer_unroll_loops" not in executables.gpu_options(plan, True)
    monkeypatch.delenv("IKJAX_DECODE_GRAPH_UNROLL")
    opts = executables.gpu_options(plan, True)
    assert opts["xla_gpu_command_buffer_unroll_loops"] is True
    assert "xla_gpu_command_buffer_unroll_loops" not in (executables.gpu_options(plan, False) or {})
    exe = jax.jit(lambda x: x - 1).lower(jnp.float32(1)).compile(opts)
    assert float(exe(jnp.float32(3))) == 2.0


def test_unknown_xla_option_is_one_option_error():
    """An XLA option a setting asks for that this jaxlib lacks: one OptionError naming the setting,
    not XLA's message at a step's compile."""
    from ikjax.runtime import executables

    with pytest.raises(OptionError, match=r"IKJAX_SOMETHING=1: this jaxlib .* has no XLA option xla_gpu_no_such_option"):
        executables._check_option("xla_gpu_no_such_option", True, "IKJAX_SOMETHING=1")
    executables._check_option("xla_gpu_command_buffer_unroll_loops", True, "IKJAX_DECODE_GRAPH_UNROLL=1")  # known here


@pytest.mark.parametrize("decode", [None, (4, ())])
def test_step_options_are_made_before_the_lowering(monkeypatch, decode):
    """compile_step makes a step's XLA options (whose first check compiles a trivial program,
    `_check_option`) before it lowers: a job side by side then checks while it waits for its
    lowering turn, not between its lowering and its compile (0.35-0.6 s of the deep first row's
    decode loop, RESULTS §22am)."""
    from ikjax.runtime import compile_cache, executables

    order = []
    monkeypatch.setattr(executables, "gpu_options", lambda plan, dec, gpu=True: order.append(("options", dec)) or {})

    class Lowered:
        def compile(self, options):
            order.append(("compile", options))
            return "exe"

    def lower(jitted, *args, **kwargs):
        order.append(("lower", jitted is executables._jitted_decode))
        return Lowered()
    monkeypatch.setattr(compile_cache, "lower", lower)
    plan = SimpleNamespace(backend="pallas")
    assert executables.compile_step({}, {}, 1, 1, cfg=None, plan=plan, decode=decode, gpu=True) == "exe"
    assert order == [("options", decode is not None), ("lower", decode is not None), ("compile", {})]


def test_steps_lower_one_at_a_time_from_shapes():
    """compile_cache.lower: no two lowerings at once (threads racing in JAX's trace cache made a
    nested jit two jaxprs, and a step's module, and so JAX's cache key, differ between runs of one
    command: RESULTS §25j), and arrays reach the lowering as ShapeDtypeStructs of their shape,
    dtype and sharding (avals that printed alike differed on a GPU); other arguments unchanged."""
    import threading
    import time

    import jax.numpy as jnp

    from ikjax.runtime import compile_cache

    inside, overlapped, got = [], [], []

    class Jitted:
        def lower(self, *args, **kwargs):
            inside.append(1)
            if len(inside) > 1:
                overlapped.append(len(inside))
            time.sleep(0.02)
            inside.pop()
            got.append((args, kwargs))
            return args

    threads = [threading.Thread(target=compile_cache.lower, args=(Jitted(), i)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 6 and not overlapped, overlapped
    x = jnp.ones((2, 3), jnp.bfloat16)
    args = compile_cache.lower(Jitted(), x, 5, {"w": x}, n=x)
    assert isinstance(args[0], jax.ShapeDtypeStruct) and args[0].shape == (2, 3) and args[0].dtype == jnp.bfloat16
    assert args[0].sharding == x.sharding and args[1] == 5 and isinstance(args[2]["w"], jax.ShapeDtypeStruct)
    assert isinstance(got[-1][1]["n"], jax.ShapeDtypeStruct)


def test_setup_makes_locations_independent_of_the_call_path(tmp_path, monkeypatch):
    """With the cache on, lowered modules carry the innermost frame only, its path cut at the
    package: a Pallas GPU kernel's Triton module keeps its locations inside JAX's cache key, and
    full tracebacks (engine, CLI, thread frames) made every run's key another (RESULTS §25j)."""
    import re

    from ikjax.runtime import compile_cache

    monkeypatch.setattr(compile_cache, "_configured", None)
    assert compile_cache.setup(str(tmp_path / "cc")) is not None
    assert jax.config.jax_include_full_tracebacks_in_locations is False
    pattern = jax.config.jax_hlo_source_file_canonicalization_regex
    assert re.sub(pattern, "", "/tmp/src/ikjax/model/deepseek2.py") == "ikjax/model/deepseek2.py"
    assert re.sub(pattern, "", "/opt/x/pallas_kernels/quant_matmul/kernel.py") == "pallas_kernels/quant_matmul/kernel.py"


def test_triton_modules_carry_no_locations(monkeypatch):
    """A Pallas GPU kernel's Triton module is stripped of its source locations: an inlined jitted
    helper's ops name the frame of whichever trace first filled JAX's trace cache, so even the
    innermost frame followed the order a process traced its steps in, and the 8-layer R1's -ot
    steps compiled on every warm run (RESULTS §25k). Lowering Triton needs a GPU jaxlib, so the
    Pallas lowering is stood in for by a module with a file location, as Pallas builds one."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering

    from ikjax.runtime import compile_cache

    def lowered(*args, **kwargs):
        ctx = ir.Context()
        ctx.allow_unregistered_dialects = True
        with ctx:
            module = ir.Module.parse('"tt.func_like"() : () -> () loc("pallas_kernels/flash.py":12:3)')
        return lowering.LoweringResult(module, (1, 1, 1))

    def asm(result):
        return result.module.operation.get_asm(enable_debug_info=True)

    assert "flash.py" in asm(lowered())  # the stand-in does carry a location
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lowered)
    compile_cache._strip_triton_locations()
    compile_cache._strip_triton_locations()  # once only: not wrapped twice
    wrapped = lowering.lower_jaxpr_to_triton_module
    assert wrapped is not lowered and wrapped.__wrapped__ is lowered
    text = asm(wrapped())
    assert "tt.func_like" in text and "flash.py" not in text, text


@pytest.mark.parametrize("split", ["layer", "graph"])
def test_several_device_steps_served_by_jax_s_cache(tiny4_model, tmp_path, split):
    """Several devices (two fake CPU devices): steps are not stored whole, JAX's own cache serves
    them, so the second of two identical sweep-bench runs compiles none. On a GPU no such step was
    ever served until the lowering became one at a time, from shapes, with stable locations
    (compile_cache.lower, RESULTS §25j); this keeps the several-device path keyed the same way."""
    import re
    env = {**os.environ, "IKJAX_COMPILE_CACHE": str(tmp_path / "xla"),
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()}
    cmd = [sys.executable, "-m", "ikjax.cli", "sweep-bench", "-m", tiny4_model, "-c", "256", "-ub", "64", "-n", "4",
           "-sm", split]
    runs = [subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    last = [re.findall(r"compiled (\d+) steps, (\d+) from the cache", r.stderr)[-1] for r in runs]
    assert int(last[0][0]) >= 2 and last[1] == ("0", last[0][0]), last
