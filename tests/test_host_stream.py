"""Streaming host-resident experts to the accelerator for big batches (issue 10, deliverable 4),
checked on any machine: a CPU device has a `pinned_host` memory too, so the pinned form of a
`HostQuantArray`, ik's rule deciding host vs stream, the in-step move to device memory and the
ordering barrier all run here; only the transfer itself (and the host custom call) need a GPU
(tests/test_hybrid_gpu.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from jax.sharding import SingleDeviceSharding

from ikjax import kernels
from ikjax.errors import OptionError
from ikjax.host_weights import HostQuantArray, min_offload_batch, release_pages
from ikjax.quant.array import QuantArray
from ikjax.quant.types import by_name

Q = by_name("Q8_0")
E, F, D, K = 8, 64, 128, 2


def _quant(rng, shape) -> QuantArray:
    raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), GGMLQuantizationType.Q8_0)
    return QuantArray.from_bytes(raw, Q, shape)


def _pinned(qa: QuantArray, min_batch: int) -> HostQuantArray:
    data = jax.device_put(np.asarray(qa.data), SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    return HostQuantArray(data, Q, qa.shape, min_batch=min_batch)


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    return [_quant(rng, s) for s in ((E, F, D), (E, F, D), (E, D, F))]


def _inputs(n, seed=1):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((n, D)), jnp.float32), jnp.asarray(rng.random((n, K)), jnp.float32),
            jnp.asarray(rng.integers(0, E, (n, K)), jnp.int32))


def _two_layers():
    @jax.jit
    def f(x, w, ids, g, u, d):
        with kernels.kernel_context("xla"):
            a = kernels.moe_experts(x, w, ids, g, u, d, jnp.float32)
            return kernels.moe_experts(a, w, ids, g, u, d, jnp.float32)
    return f


def test_rule_is_iks(experts):
    h = _pinned(experts[0], 32)
    # batch x n_expert_used >= 32 x n_expert: 128 tokens for 8 experts, 2 used
    assert h.runs_on(127, E, K) == "host" and h.runs_on(128, E, K) == "device"
    assert _pinned(experts[0], 4).runs_on(16, E, K) == "device"


@pytest.mark.parametrize("order", ["prev", "self", "free"])
def test_streamed_equals_device_resident(experts, monkeypatch, order):
    """Past the threshold the pinned experts move into the step and the device implementation
    computes them: the same result as device-resident experts, bit for bit."""
    monkeypatch.setenv("IKJAX_STREAM_ORDER", order)
    x, w, ids = _inputs(200)
    host = [_pinned(t, 32) for t in experts]
    f = _two_layers()
    got = f(x, w, ids, *host)
    assert kernels.selected("moe_experts") == "stream:xla"
    ref = f(x, w, ids, *experts)
    assert kernels.selected("moe_experts") == "xla"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    hlo = f.lower(x, w, ids, *host).as_text()
    assert hlo.count('memory_kind = "pinned_host"') >= 3  # the experts enter as host parameters
    # the second layer's copy waits for the first layer's input ("prev") / its own ("self")
    assert ("optimization_barrier" in hlo) == (order != "free")


def test_small_batch_takes_host_path(experts):
    """Below the threshold the pinned experts never reach device code: the host path is chosen
    (on a machine without CUDA it refuses, naming why)."""
    x, w, ids = _inputs(16)
    host = [_pinned(t, 32) for t in experts]
    if jax.default_backend() == "gpu":
        pytest.skip("the host path runs in tests/test_hybrid_gpu.py")
    with pytest.raises(OptionError, match="need a CUDA GPU"):
        _two_layers()(x, w, ids, *host)


def test_mapped_form_never_streams(experts):
    """Memory-mapped (NumPy) experts are leafless: a step cannot move them, so they stay on the host
    path for every batch size, and `to_device` says so."""
    h = HostQuantArray(np.asarray(experts[0].data), Q, experts[0].shape)
    assert not h.streamable and jax.tree_util.tree_leaves(h) == []
    with pytest.raises(OptionError, match="IKJAX_HOST_EXPERTS=mmap"):
        h.to_device()
    p = _pinned(experts[0], 32)
    assert len(jax.tree_util.tree_leaves(p)) == 1 and p.host_address() == p.data.unsafe_buffer_pointer()


def test_min_offload_batch_env(monkeypatch):
    assert min_offload_batch(32) == 32
    monkeypatch.setenv("IKJAX_MIN_OFFLOAD_BATCH", "8")
    assert min_offload_batch(32) == 8
    monkeypatch.setenv("IKJAX_MIN_OFFLOAD_BATCH", "zero")
    with pytest.raises(OptionError, match="IKJAX_MIN_OFFLOAD_BATCH"):
        min_offload_batch(32)


def test_release_pages_only_touches_mapped_bytes(tmp_path):
    """The load drops a tensor's memory-mapped pages once it is pinned; the bytes still read back
    from the file, and anonymous memory is never advised (MADV_DONTNEED would zero it)."""
    import mmap
    p = tmp_path / "blob"
    payload = np.random.default_rng(0).integers(0, 255, 3 * mmap.PAGESIZE + 100, dtype=np.uint8)
    p.write_bytes(payload.tobytes())
    with open(p, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(m, dtype=np.uint8, count=payload.size - 50, offset=50)
        released = release_pages(view)
        if hasattr(__import__("os"), "sched_getaffinity"):
            assert released == 2 * mmap.PAGESIZE  # whole pages strictly inside the range
        np.testing.assert_array_equal(view, payload[50:])
        del view
        m.close()
    anon = payload.copy()
    assert release_pages(anon) == 0
    np.testing.assert_array_equal(anon, payload)
