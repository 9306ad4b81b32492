"""Stored steps (ikjax.runtime.compile_cache.load_step / store_step) are keyed on everything that
shapes the executable's arguments: runs that differ only in the KV cache (-ctk, -c, -mla) or in
the tool that made the step never get another run's executable (issue 21: "Function compiled
with input pytree does not match", "Argument types differ ..." until steps/ was deleted), and an
entry that does not fit the call is a miss that gets replaced, never an error.

The runs are subprocesses with their own compile cache (the test process keeps it off, conftest)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ikjax.runtime import compile_cache

# engines of one model that differ only in their KV cache, one after another in one process (each
# engine's steps are looked up in steps/ before anything is traced), then the first again
RUN = """
import json, sys
import numpy as np
import ikjax
from ikjax.runtime import compile_cache
runs = json.loads(sys.argv[2])
out = []
for i, opts in enumerate(runs):
    eng = ikjax.load(sys.argv[1], **opts)
    logits = eng.logits(list(range(1, 9)))  # the same step as the prompt of generate below
    toks = list(eng.generate(list(range(1, 9)), 4))
    np.save(f"{sys.argv[3]}/{i}.npy", logits)
    out.append(dict(compiled=eng.compile_count, from_cache=eng.compile_cache_hits, toks=toks))
print(json.dumps(dict(runs=out, step_loads=compile_cache.step_loads())))
"""

VARIANTS = [dict(ctx=256, ubatch=64, ctk="f16"), dict(ctx=256, ubatch=64, ctk="q8_0"),
            dict(ctx=256, ubatch=64, ctk="bf16"), dict(ctx=512, mla=2), dict(ctx=1024, mla=2)]


def _run(model: str, runs: list[dict], out: Path, env: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-c", RUN, model, json.dumps(runs), str(out)],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_cache_layouts_get_their_own_steps(tiny_model, tmp_path):
    env = {"IKJAX_COMPILE_CACHE": str(tmp_path / "xla"), "IKJAX_STORE_STEPS": "1"}
    cold = _run(tiny_model, VARIANTS + VARIANTS[:1], tmp_path / "cold", env)
    for r in cold["runs"][:len(VARIANTS)]:  # each layout compiled its own steps: no other's loaded
        assert r["from_cache"] == 0, cold
    assert cold["runs"][-1]["from_cache"] == cold["runs"][-1]["compiled"]  # f16 again: its own, stored
    # a second process loads every variant's steps whole and computes the same
    warm = _run(tiny_model, VARIANTS, tmp_path / "warm", env)
    assert warm["step_loads"] == sum(r["compiled"] for r in warm["runs"])
    for i, (c, w) in enumerate(zip(cold["runs"], warm["runs"])):
        assert w["from_cache"] == w["compiled"] and w["toks"] == c["toks"]
        np.testing.assert_array_equal(np.load(tmp_path / "cold" / f"{i}.npy"), np.load(tmp_path / "warm" / f"{i}.npy"))


def test_stored_step_for_other_arguments_is_a_miss(tiny_model, tmp_path):
    """An entry under a step's key whose executable takes other arguments (a stale entry, or one
    written before the key named the cache layout): recompiled, the entry replaced, no error."""
    env = {"IKJAX_COMPILE_CACHE": str(tmp_path / "xla"), "IKJAX_STORE_STEPS": "1"}
    _run(tiny_model, VARIANTS[:2], tmp_path / "a", env)
    steps = sorted((tmp_path / "xla").rglob("steps/*.pkl"))
    assert len(steps) >= 4
    # give every entry another entry's bytes: the keys stay, the executables are for other arguments
    blobs = [p.read_bytes() for p in steps]
    for p, b in zip(steps, blobs[1:] + blobs[:1]):
        p.write_bytes(b)
    r = _run(tiny_model, VARIANTS[:2], tmp_path / "b", env)
    assert r["step_loads"] == 0
    for i in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / "a" / f"{i}.npy"), np.load(tmp_path / "b" / f"{i}.npy"))


def test_load_step_checks_the_signature(monkeypatch, tmp_path):
    """In process: an entry whose executable's argument tree or types differ from the call's is a
    miss and is removed; the matching one loads."""
    import jax
    import jax.numpy as jnp
    monkeypatch.setattr(compile_cache, "_configured", (None, tmp_path, True))
    f = jax.jit(lambda c, t: (c + t.sum(), c))
    args = (jax.ShapeDtypeStruct((4,), jnp.float16), jax.ShapeDtypeStruct((2,), jnp.int32))
    exe = f.lower(*args).compile()
    leaves, tree = jax.tree.flatten((args, {}))
    sig = (tree, tuple((tuple(a.shape), str(a.dtype)) for a in leaves))
    compile_cache.store_step(("t",), exe)
    path = next(tmp_path.rglob("steps/*.pkl"))
    other = ((jax.ShapeDtypeStruct((4,), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32)), {})
    other_sig = (jax.tree.structure(other), tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(other)))
    assert compile_cache.load_step(("t",), other_sig) is None and not path.exists()
    compile_cache.store_step(("t",), exe)
    loaded = compile_cache.load_step(("t",), sig)
    assert loaded is not None
    out, _ = loaded(jnp.ones(4, jnp.float16), jnp.arange(2, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.full(4, 2, np.float16))
    assert compile_cache.load_step(("u",), sig) is None  # another key: absent


@pytest.mark.slow
def test_tools_share_one_cache(tiny_model, tmp_path):
    """The issue's sequence on the CLI, one compile cache with stored steps: sweep-bench, bench
    (f16 and q8_0 caches: no row skipped), generate; -ctk f16 then q8_0; -mla 2 -c 512 then 1024;
    then all of it again, every run clean."""
    env = {**os.environ, "IKJAX_COMPILE_CACHE": str(tmp_path / "xla"), "IKJAX_STORE_STEPS": "1"}
    m = ["-m", tiny_model]
    gen = ["generate", *m, "-p", "hello world", "-n", "4"]
    cmds = [["sweep-bench", *m, "-c", "256", "-ub", "64", "-n", "4"],
            ["bench", *m, "-p", "64", "-n", "16", "-ub", "64", "-r", "1", "-ctk", "f16,q8_0"],
            [*gen, "-c", "256", "-ub", "64"],
            [*gen, "-c", "256", "-ub", "64", "-ctk", "f16"], [*gen, "-c", "256", "-ub", "64", "-ctk", "q8_0"],
            [*gen, "-mla", "2", "-c", "512"], [*gen, "-mla", "2", "-c", "1024"]]
    for _ in range(2):
        for cmd in cmds:
            res = subprocess.run([sys.executable, "-c", "from ikjax.cli import app; app()", *cmd], env=env,
                                 capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, (cmd, res.stderr)
            assert "error" not in res.stderr.lower() and "skipp" not in (res.stdout + res.stderr).lower(), \
                (cmd, res.stdout, res.stderr)


# A key that misses what the call passes (here: an engine of another cache length looks its steps
# up under the first engine's descriptions, as a key blind to the cache length once did): the
# stored step loads, passes load_step's check (it fits the arguments the key describes) and JAX
# refuses its first call. That call must still run, on a step compiled then, with the numbers a
# step compiled for it gives.
LATE = """
import json, sys
import numpy as np
import ikjax
from ikjax.runtime import compile_cache, executables
ids = list(range(1, 9))
a = ikjax.load(sys.argv[1], ctx=256, ubatch=64)
a_logits, a_toks = a.logits(ids), list(a.generate(ids, 4))  # compiled and stored
b = ikjax.load(sys.argv[1], ctx=512, ubatch=64)
b._steps._stored_step = lambda weights, key: a._steps._stored_step(a.weights, key)
loads0 = compile_cache.step_loads()
b_logits, b_toks = b.logits(ids), list(b.generate(ids, 4))
loads = compile_cache.step_loads() - loads0
late = sum(isinstance(e, executables.StoredStep) for e in b._executables.values())
ref = ikjax.load(sys.argv[1], ctx=512, ubatch=64)
ref._steps._stored_step = lambda weights, key: None  # compiled here, nothing loaded
r_logits, r_toks = ref.logits(ids), list(ref.generate(ids, 4))
np.testing.assert_array_equal(b_logits, r_logits)
print(json.dumps(dict(loads=loads, late=late, toks=[a_toks, b_toks, r_toks],
                      close=bool(np.allclose(a_logits, b_logits, atol=1e-4)))))
"""


def test_stored_step_refused_at_its_call_is_recompiled(tiny_model, tmp_path):
    env = {**os.environ, "IKJAX_COMPILE_CACHE": str(tmp_path / "xla"), "IKJAX_STORE_STEPS": "1"}
    res = subprocess.run([sys.executable, "-c", LATE, tiny_model], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["loads"] >= 2  # a's two prompt steps (all logits; the last one's), loaded for b's calls
    assert r["late"] == 0  # each refused at its first call and replaced by a fresh executable
    assert res.stderr.count("did not fit its call") == r["loads"], res.stderr[-3000:]
    assert r["toks"][1] == r["toks"][2] == r["toks"][0] and r["close"]


def test_counts_are_per_thread():
    """Steps compile side by side in threads on an accelerator: a hit (or write) of JAX's cache in
    one thread is not the step another thread compiles (it decided whether that step is stored
    whole and whether it counts as "from the cache")."""
    import threading
    h0, w0 = compile_cache.thread_counts()
    g0 = compile_cache.hits()
    t = threading.Thread(target=compile_cache._count, args=(compile_cache.HIT_EVENT,))
    t.start()
    t.join()
    assert compile_cache.hits() == g0 + 1 and compile_cache.thread_counts() == (h0, w0)
    compile_cache._count(compile_cache.WRITE_EVENT)
    assert compile_cache.thread_counts() == (h0, w0 + 1)


def test_unset_and_default_variables_key_a_step_alike(monkeypatch):
    """A variable left unset, set to its default, or to it in capitals traces the same step: the
    StepPlan's settings and a stored step's key must not tell them apart (RESULTS §22k: a warm run
    without IKJAX_LAYERS recompiled the steps a cold run with IKJAX_LAYERS=auto had stored); a
    value that changes the trace still does."""
    from ikjax.runtime.executables import trace_variables
    monkeypatch.delenv("IKJAX_LAYERS", raising=False)
    monkeypatch.delenv("IKJAX_STREAM_MIB", raising=False)
    unset = trace_variables()
    assert ("IKJAX_LAYERS", "auto") in unset
    for value in ("auto", "AUTO", ""):
        monkeypatch.setenv("IKJAX_LAYERS", value)
        assert trace_variables() == unset, value
    monkeypatch.setenv("IKJAX_STREAM_MIB", "512")  # a number at its default
    assert trace_variables() == unset
    monkeypatch.setenv("IKJAX_LAYERS", "unroll")
    assert trace_variables() != unset


def test_a_step_key_names_the_kernel_build_and_the_cpu(monkeypatch):
    """A stored step's key holds `build_tag` (the kernel libraries' bytes, the CPU's model and
    flags): where the user pointed JAX's own cache (jax_compilation_cache_dir, no ikjax
    subdirectory per build) another CPU or a rebuilt library sharing it gets its own steps (an
    outside probe found the key without it)."""
    parts = ("prompt", 1, 8)
    before = compile_cache._step_key(parts)
    assert compile_cache._step_key(parts) == before
    monkeypatch.setattr(compile_cache, "_cpu_signature", lambda: "another cpu: avx2 only")
    compile_cache._build_tag_once.cache_clear()
    try:
        assert compile_cache._step_key(parts) != before
    finally:
        monkeypatch.undo()
        compile_cache._build_tag_once.cache_clear()
    assert compile_cache._step_key(parts) == before
