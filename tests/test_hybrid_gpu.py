"""Routed experts in host RAM next to a GPU (issue 10, deliverable 3), on a real GPU.

`-ot exps=CPU` keeps every `ffn_*_exps` tensor as the GGUF memory map's bytes and computes the
experts on the host CPU from inside the GPU step (pallas_kernels/moe_matmul/cuda_host.cc); the
logits must equal the all-GPU run's (f32 compute: the same function, only the summation order of
the expert products differs) and, on the real-converter fixtures, the reference logits.

Needs a CUDA GPU and the handler built with `-DIKJAX_BUILD_CUDA=ON`; run with `pytest -m gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax

from pallas_kernels.moe_matmul import host as host_moe

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (the host-experts custom call is registered for platform CUDA)",
                allow_module_level=True)
if not host_moe.available():
    pytest.skip(host_moe.unavailable_reason(), allow_module_level=True)

import ikjax  # noqa: E402
from ikjax import kernels  # noqa: E402
from ikjax.host_weights import HostQuantArray  # noqa: E402

from conftest import fixture_entry, fixtures_dir, load_ref, rel_err  # noqa: E402

TOL = 1e-5  # f32 compute, host vs GPU experts
FIXTURES = ("v3tiny-all-Q4_K_M.gguf", "v2lite_tiny-kvb-Q5_1.gguf")


def _logits(path, tokens, **opts):
    eng = ikjax.load(path, ctx=256, ubatch=64, dtype="f32", **opts)
    out = eng.logits(tokens)
    return eng, out


def _check_host_resident(eng, n_host_layers: int | None = None):
    layers = [i for i, lay in enumerate(eng.weights["layers"]) if "gate_exps" in lay]
    host = [i for i in layers if isinstance(eng.weights["layers"][i]["gate_exps"], HostQuantArray)]
    want = layers if n_host_layers is None else [i for i in layers if i < n_host_layers]
    assert host == want and host, (host, want)
    for i in host:
        for k in ("gate_exps", "up_exps", "down_exps"):
            t = eng.weights["layers"][i][k]
            assert isinstance(t, HostQuantArray) and isinstance(t.data, np.ndarray)
    # the memory plan puts exactly those bytes on the host, none of them on the GPU
    plan = eng.memory_plan()
    assert plan.host_weights_bytes == sum(eng.weights["layers"][i][k].nbytes for i in host
                                          for k in ("gate_exps", "up_exps", "down_exps"))


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """The tiny synthetic preset, 4 layers (1 dense + 3 MoE), Q4_K: made by our writer."""
    from ikjax.synthetic import make_model
    p = tmp_path_factory.mktemp("hybrid") / "tiny4-Q4_K.gguf"
    make_model(p, "tiny", "Q4_K", layers=4)
    return str(p)


def test_tiny4_host_experts_equal_gpu(tiny4):
    tokens = np.arange(1, 40) % 200
    _, ref = _logits(tiny4, tokens)
    eng, got = _logits(tiny4, tokens, ot="exps=CPU", t=4)
    assert kernels.selected("moe_experts") == "host"
    _check_host_resident(eng)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_tiny4_n_cpu_moe_and_decode(tiny4):
    """--n-cpu-moe 2: the first MoE layer's (layer 1) experts on the host, layers 2-3's on the GPU;
    greedy decode (batch-1 steps) gives the all-GPU run's tokens."""
    prompt = list(range(3, 20))
    ref = ikjax.load(tiny4, ctx=256, ubatch=64, dtype="f32").generate(prompt, max_tokens=12)
    eng = ikjax.load(tiny4, ctx=256, ubatch=64, dtype="f32", n_cpu_moe=2)
    _check_host_resident(eng, 2)
    assert list(eng.generate(prompt, max_tokens=12)) == list(ref)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_host_experts(name):
    entry = fixture_entry(name)
    tokens, ref = load_ref(entry)
    path = fixtures_dir() / name
    _, gpu = _logits(path, tokens)
    eng, got = _logits(path, tokens, ot="exps=CPU")
    _check_host_resident(eng)
    assert rel_err(got, gpu) <= TOL, rel_err(got, gpu)
    assert rel_err(got, ref) <= entry["tol"], rel_err(got, ref)
