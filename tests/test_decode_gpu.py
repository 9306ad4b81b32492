"""The decode loop on a real GPU (issue 11): several decode steps in one dispatch, compiled with
XLA's WHILE command buffers so the loop is one CUDA graph, must give the tokens of one step per
dispatch (the Pallas kernels inside the graph, the cache donated across iterations), with
sampling on the device reproducible from the seed. Run with `pytest -m gpu`; the same code runs
on CPU in test_engine.py."""
from __future__ import annotations

import pytest

import jax

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (the CUDA-graph compile options of the decode loop)", allow_module_level=True)

import ikjax  # noqa: E402
from conftest import fixtures_dir  # noqa: E402


@pytest.mark.parametrize("mla,ctk", [(3, "q8_0"), (2, "f16")])
def test_decode_loop_equals_steps_on_gpu(monkeypatch, mla, ctk):
    path = fixtures_dir() / "v3tiny-all-Q4_0.gguf"
    if not path.exists():
        pytest.skip(f"fixture {path} absent")
    eng = ikjax.load(path, mla=mla, fa=True, ctk=ctk, ubatch=32, ctx=96, dtype="f32")
    p = list(range(2, 30))
    loop = list(eng.generate(p, 60, stop=()))
    a = list(eng.generate(p, 20, temperature=0.8, top_k=20, seed=5, stop=()))
    assert a == list(eng.generate(p, 20, temperature=0.8, top_k=20, seed=5, stop=()))
    monkeypatch.setenv("IKJAX_DECODE_LOOP", "0")
    step = list(eng.generate(p, 60, stop=()))
    assert loop == step and len(loop) == 60
