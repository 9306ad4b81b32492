"""Streaming host-resident experts to the accelerator for big batches (issue 10, deliverable 4),
checked on any machine: a CPU device has a `pinned_host` memory too, so the pinned form of a
`HostQuantArray`, ik's rule deciding host vs stream, the in-step move to device memory and the
ordering barrier all run here; only the transfer itself (and the host custom call) need a GPU
(tests/test_hybrid_gpu.py)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from jax.sharding import SingleDeviceSharding

from ikjax import ops
from ikjax.errors import OptionError
from ikjax.placement.host import HostQuantArray, min_offload_batch, release_pages
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
        with ops.kernel_context("xla"):
            a = ops.moe_experts(x, w, ids, g, u, d, jnp.float32)
            return ops.moe_experts(a, w, ids, g, u, d, jnp.float32)
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
    monkeypatch.setenv("IKJAX_STREAM", "layer")
    monkeypatch.setenv("IKJAX_STREAM_ORDER", order)
    x, w, ids = _inputs(200)
    host = [_pinned(t, 32) for t in experts]
    f = _two_layers()
    got = f(x, w, ids, *host)
    assert ops.selected("moe_experts") == "stream:xla"
    ref = f(x, w, ids, *experts)
    assert ops.selected("moe_experts") == "xla"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    hlo = f.lower(x, w, ids, *host).as_text()
    assert hlo.count('memory_kind = "pinned_host"') >= 3  # the experts enter as host parameters
    # the second layer's copy waits for the first layer's input ("prev") / its own ("self")
    assert ("optimization_barrier" in hlo) == (order != "free")


@pytest.mark.parametrize("fit,ahead", [(3, 2), (5, 1), (8, 3)])
def test_chunks_equal_device_resident(experts, monkeypatch, fit, ahead):
    """IKJAX_STREAM=chunks: every expert crosses as runs of `chunk_experts` experts (slices of the
    pinned tensors moved inside the step), each run's picks computed apart and summed: the result
    of device-resident experts; each run's copy is ordered after the run `ahead` before it has been
    computed, and each run's compute after the next copy was issued (two barriers a run)."""
    monkeypatch.setenv("IKJAX_STREAM", "chunks")
    monkeypatch.setenv("IKJAX_STREAM_AHEAD", str(ahead))
    per_expert = sum(t.nbytes for t in experts) // E
    monkeypatch.setenv("IKJAX_STREAM_MIB", str(fit * per_expert / 2**20))
    S = ops.chunk_experts(per_expert, E)
    assert S == {3: 2, 5: 4, 8: 8}[fit]  # the largest divisor of 8 within the room
    x, w, ids = _routed(200)
    host = [_pinned(t, 32) for t in experts]
    f = _two_layers()
    got = f(x, w, ids, *host)
    assert ops.selected("moe_experts") == "stream:xla"
    ref = f(x, w, ids, *experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    jaxpr = str(jax.make_jaxpr(f)(x, w, ids, *host))
    runs = 2 * (E // S)  # both layers
    assert jaxpr.count("optimization_barrier") == 2 * runs  # each copy ordered, each run's compute ordered
    assert jaxpr.count("device_put") >= 3 * runs


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_chunks_by_the_copy_engine(experts, monkeypatch, ahead):
    """Where the CUDA handler is built, runs cross by the copy engine: start(lo, n) for the next
    runs is issued before a run computes, done() waits for a run's copy just before its MoE, and at
    most `ahead` runs are held (started, not yet computed). Here over jnp stand-ins for the two
    calls (the real ones: tests/test_hybrid_gpu.py), which log the order the step runs them in."""
    from pallas_kernels.moe_matmul import host as moe_host
    log = []

    def fake_start(after, gate, up, down, *, lo, n):
        log.append(("start", lo))
        return [jax.device_put(t.data[lo:lo + n], jax.memory.Space.Device) for t in (gate, up, down)]

    def fake_done(after, blocks):
        log.append(("done", None))
        return blocks

    monkeypatch.setattr(moe_host, "stream_supported", lambda *a: True)
    monkeypatch.setattr(moe_host, "chunk_copy_start", fake_start)
    monkeypatch.setattr(moe_host, "chunk_copy_done", fake_done)
    monkeypatch.setenv("IKJAX_STREAM", "chunks")
    monkeypatch.setenv("IKJAX_STREAM_COPY", "engine")
    monkeypatch.setenv("IKJAX_STREAM_AHEAD", str(ahead))
    per_expert = sum(t.nbytes for t in experts) // E
    monkeypatch.setenv("IKJAX_STREAM_MIB", str(2 * per_expert / 2**20))  # runs of 2: 4 a layer
    x, w, ids = _routed(200)
    host = [_pinned(t, 32) for t in experts]
    jaxpr = jax.make_jaxpr(_two_layers())(x, w, ids, *host)
    assert str(jaxpr).count("optimization_barrier") == 8  # each run's compute after the next copy's start
    starts = [e[1] for e in log if e[0] == "start"]
    assert starts == [0, 2, 4, 6] * 2  # every run of both layers, once, in order
    held, most = 0, 0
    for kind, _ in log:  # runs started and not yet waited for, in the order the step issues them
        held += 1 if kind == "start" else -1
        assert held >= 0
        most = max(most, held)
    assert most == ahead
    got = _two_layers()(x, w, ids, *host)
    ref = _two_layers()(x, w, ids, *experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    monkeypatch.setattr(moe_host, "stream_supported", lambda *a: False)
    monkeypatch.setenv("IKJAX_STREAM_COPY", "engine")
    with pytest.raises(OptionError, match="IKJAX_STREAM_COPY=engine"):
        _two_layers()(x, w, ids, *host)


def test_chunk_experts_sizes(monkeypatch):
    """Runs of the largest divisor of the expert count within IKJAX_STREAM_MIB when that is at
    least half of what fits; else runs as equal as can be; bad IKJAX_STREAM_AHEAD is named."""
    monkeypatch.setenv("IKJAX_STREAM_MIB", "512")
    per = 3 * 2048 * 4032  # R1's gate + up + down at Q4_0, about 24.8 MB an expert: 21 fit
    assert ops.chunk_experts(per, 256) == 16 and ops.chunk_experts(per, 160) == 20 and ops.chunk_experts(per, 384) == 16
    assert ops.chunk_experts(per, 7 * 3) == 21  # all fit: one run
    monkeypatch.setenv("IKJAX_STREAM_MIB", str(5 * per / 2**20))
    assert ops.chunk_experts(per, 7) == 4  # no divisor of 7 in 3..5: runs of 4 and 3
    assert ops.stream_ahead() == 2
    monkeypatch.setenv("IKJAX_STREAM_AHEAD", "0")
    with pytest.raises(OptionError, match="IKJAX_STREAM_AHEAD"):
        ops.stream_ahead()


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


# -- IKJAX_STREAM=active: only the experts a batch routes to, in rounds ----------------------------

def _routed(n, seed=2, experts_used=None):
    """Routing over a subset of the experts (a batch rarely uses all of them) with some zero
    weights (smart expert reduction's dropped experts, which need no copy)."""
    x, w, _ = _inputs(n, seed)
    rng = np.random.default_rng(seed)
    pool = np.asarray(experts_used if experts_used is not None else range(E))
    ids = jnp.asarray(rng.choice(pool, (n, K)), jnp.int32)
    w = jnp.where(jnp.asarray(rng.random((n, K)) < 0.2), 0.0, w)
    return x, w, ids


# The round loop (ops.moe_rounds) is the same whatever kernel computes a round: every slots x
# routing pair on the XLA path; the Pallas kernel (interpret mode) on each slot count and each
# routing once (rounds short of a full slot set, one expert with empty rounds after it, all of them)
_ROUNDS = ([("xla", s, u) for s in (1, 3, E) for u in (None, (1, 4, 5, 6), (7,))]
           + [("interpret", 3, (1, 4, 5, 6)), ("interpret", 1, (7,)), ("interpret", E, None)])


@pytest.mark.parametrize("backend,slots,used", _ROUNDS)
def test_rounds_equal_all_experts(experts, backend, slots, used):
    """The round loop over the jnp reference of the streaming call gives the plain MoE: every
    active expert in exactly one round, inactive slots never weighed, empty rounds adding 0."""
    from pallas_kernels.moe_matmul import host as moe_host
    x, w, ids = _routed(37, experts_used=used)
    fetch = lambda w_, i_, r: moe_host.stream_experts_ref(w_, i_, *experts, slots=slots, round=r)
    dtype = jnp.float32 if backend == "xla" else jnp.bfloat16
    got = jax.jit(lambda x, w, ids: ops.moe_rounds(x, w, ids, *experts, dtype, fetch=fetch, slots=slots,
                                                       backend=backend))(x, w, ids)
    ref = ops.moe_experts(x, w, ids, *experts, dtype, backend="xla")
    tol = 1e-5 if backend == "xla" else 2e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol * float(jnp.abs(ref).max()))


def test_stream_ref_contract(experts):
    """slot_of names each active expert's slot in its round (ascending ids), -1 elsewhere; the
    slots hold those experts' blocks as stored; an empty round leaves zeros."""
    from pallas_kernels.moe_matmul import host as moe_host
    w = jnp.asarray([[0.5, 0.0], [0.25, 1.0]], jnp.float32)
    ids = jnp.asarray([[6, 2], [3, 6]], jnp.int32)  # active: 3, 6 (2 has weight 0)
    g, u, d, slot_of = moe_host.stream_experts_ref(w, ids, *experts, slots=1, round=1)
    assert np.asarray(slot_of).tolist() == [-1, -1, -1, -1, -1, -1, 0, -1]
    np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(experts[0].data)[6])
    np.testing.assert_array_equal(np.asarray(d[0]), np.asarray(experts[2].data)[6])
    *_, empty = moe_host.stream_experts_ref(w, ids, *experts, slots=1, round=2)
    assert (np.asarray(empty) == -1).all()


def test_active_stream_in_step(experts, monkeypatch):
    """The default mode end to end through a jitted two-layer step with pinned experts: past ik's
    threshold the step runs the rounds (here over a jnp stand-in for the CUDA call, which needs a
    GPU: tests/test_hybrid_gpu.py) and equals device-resident experts; the rounds follow
    IKJAX_STREAM_MIB."""
    from pallas_kernels.moe_matmul import host as moe_host
    calls = []

    def fake_fetch(w_, i_, r, *, gate, up, down, slots):
        calls.append((r, slots))
        dev = [QuantArray(jax.device_put(t.data, jax.memory.Space.Device), t.qtype, t.shape) for t in (gate, up, down)]
        return moe_host.stream_experts_ref(w_, i_, *dev, slots=slots, round=r)

    monkeypatch.setattr(ops.moe, "_fetch_active", fake_fetch)
    monkeypatch.setattr(moe_host, "stream_supported", lambda *a: True)
    monkeypatch.setenv("IKJAX_STREAM", "active")  # auto would take the whole layer: 200 x 2 picks >= 4 x 8
    per_expert = sum(t.nbytes for t in experts) // E
    monkeypatch.setenv("IKJAX_STREAM_MIB", str(3 * per_expert / 2**20))
    x, w, ids = _routed(200)
    host = [_pinned(t, 32) for t in experts]
    got = _two_layers()(x, w, ids, *host)
    assert ops.selected("moe_experts") == "stream:xla"
    assert sorted(set(calls)) == [(0, 3), (1, 3), (2, 3)]  # 8 experts in rounds of 3, both layers
    ref = _two_layers()(x, w, ids, *experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_active_stream_refuses_without_handler(experts, monkeypatch):
    """Without the CUDA handler the default mode says what to build (never a quiet whole-layer
    copy); bad IKJAX_STREAM / IKJAX_STREAM_MIB values are named."""
    from pallas_kernels.moe_matmul import host as moe_host
    x, w, ids = _inputs(200)
    host = [_pinned(t, 32) for t in experts]
    monkeypatch.setenv("IKJAX_STREAM", "active")
    if not moe_host.available():
        with pytest.raises(OptionError, match="streaming host experts"):
            _two_layers()(x, w, ids, *host)
    monkeypatch.setenv("IKJAX_STREAM", "all")
    with pytest.raises(OptionError, match="IKJAX_STREAM must be"):
        _two_layers()(x, w, ids, *host)
    monkeypatch.setenv("IKJAX_STREAM", "active")
    monkeypatch.setenv("IKJAX_STREAM_MIB", "-1")
    with pytest.raises(OptionError, match="IKJAX_STREAM_MIB"):
        ops.stream_slots(*host)
    monkeypatch.setenv("IKJAX_STREAM_MIB", "1e9")
    assert ops.stream_slots(*host) == E


@pytest.mark.parametrize("used,rounds", [((7,), [0]), ((1, 4, 5), [0, 1]), (None, [0, 1, 2, 3])])
def test_rounds_run_only_while_experts_remain(experts, used, rounds):
    """Round r > 0 runs only when the batch routes to more than r * slots experts: a batch using
    1 expert pays one round, 3 experts at 2 a round two, all 8 four."""
    from pallas_kernels.moe_matmul import host as moe_host
    ran = []

    def fetch(w_, i_, r):
        jax.debug.callback(lambda: ran.append(r))
        return moe_host.stream_experts_ref(w_, i_, *experts, slots=2, round=r)

    x, w, ids = _routed(64, experts_used=used)
    w = jnp.where(w == 0, 0.5, w)  # every routed expert active
    out = jax.jit(lambda x, w, ids: ops.moe_rounds(x, w, ids, *experts, jnp.float32, fetch=fetch, slots=2,
                                                       backend="xla"))(x, w, ids)
    out.block_until_ready()
    jax.effects_barrier()
    assert sorted(ran) == rounds
    ref = ops.moe_experts(x, w, ids, *experts, jnp.float32, backend="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_stream_auto_picks_by_coverage(monkeypatch):
    """IKJAX_STREAM=auto (default): every expert, a run at a time, once the batch's picks reach 4
    per expert (a trained router then leaves ~2 % of them untouched), the routed experts alone below
    that or when --gpu-experts holds the hot ones; an explicit mode is kept whatever the batch."""
    monkeypatch.delenv("IKJAX_STREAM", raising=False)
    assert ops.stream_mode(128, 256, 8) == "chunks"     # 1024 picks = 4 x 256
    assert ops.stream_mode(127, 256, 8) == "active"
    assert ops.stream_mode(2048, 256, 8, hot=True) == "active"
    assert ops.stream_mode() == "active"
    for m in ("active", "chunks", "layer"):
        monkeypatch.setenv("IKJAX_STREAM", m)
        assert ops.stream_mode(1, 256, 8) == ops.stream_mode(8192, 256, 8, hot=True) == m


def test_by_address_experts_stream_by_round(experts, monkeypatch):
    """-sm graph's host experts (one pinned copy for the mesh, reached by address): no step
    argument (no pytree leaf), so a big batch streams them by round through the custom call even
    where auto would move whole layers, and gives the device-resident result; asking for whole
    layers is refused by name."""
    from pallas_kernels.moe_matmul import host as moe_host
    calls = []

    def fake_fetch(w_, i_, r, *, gate, up, down, slots):
        calls.append(r)
        dev = [QuantArray(jax.device_put(t.data, jax.memory.Space.Device), t.qtype, t.shape) for t in (gate, up, down)]
        return moe_host.stream_experts_ref(w_, i_, *dev, slots=slots, round=r)

    monkeypatch.setattr(ops.moe, "_fetch_active", fake_fetch)
    monkeypatch.setattr(moe_host, "stream_supported", lambda *a: True)
    host = [_pinned(t, 32) for t in experts]
    by_addr = [HostQuantArray(h.data, Q, h.shape, min_batch=32, by_address=True) for h in host]
    assert jax.tree.leaves(by_addr) == [] and not by_addr[0].streamable and by_addr[0].pinned
    assert "by address" in repr(by_addr[0])
    x, w, ids = _routed(200)
    got = _two_layers()(x, w, ids, *by_addr)
    assert ops.selected("moe_experts") == "stream:xla" and calls  # auto alone would copy whole layers
    ref = _two_layers()(x, w, ids, *experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    # =layer over pinned step arguments the engine's plan had no room to move whole (whole_ok
    # False): runs of experts instead, never the custom call's rounds nor a whole layer
    calls.clear()
    monkeypatch.setenv("IKJAX_STREAM", "layer")
    tight = [_pinned(t, 32) for t in experts]
    for t in tight:
        t.whole_ok = False
    jaxpr = str(jax.make_jaxpr(_two_layers())(x, w, ids, *tight))
    np.testing.assert_allclose(np.asarray(_two_layers()(x, w, ids, *tight)), np.asarray(ref), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(ref).max()))
    assert not calls and ops.selected("moe_experts") == "stream:xla" and "optimization_barrier" in jaxpr
    with pytest.raises(OptionError, match="IKJAX_STREAM=layer: under -sm graph"):
        _two_layers()(x, w, ids, *by_addr)


def test_mesh_placer_pins_host_experts_once(experts):
    """ikjax.runtime.mesh: every mesh position's placer returns the same pinned copy of a host
    expert tensor (one copy for the mesh, in the first device's pinned memory)."""
    from types import SimpleNamespace
    from ikjax.runtime.mesh import _part_placer

    class Placement:  # only what the placer reads: every tensor host-resident, next to accelerators
        unified = False

        def __getitem__(self, name):
            return SimpleNamespace(on_host=True)

    data = np.asarray(experts[0].data).copy()
    placement = Placement()
    pinned = {"__device__": jax.devices()[0]}
    a = _part_placer(placement, 0, 2, jax.devices()[0], pinned)("blk.3.ffn_up_exps.weight", data)
    b = _part_placer(placement, 1, 2, jax.devices()[0], pinned)("blk.3.ffn_up_exps.weight", data)
    assert a is b and a.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(a), np.asarray(experts[0].data))
    mapped = _part_placer(placement, 0, 2, jax.devices()[0], None)("blk.3.ffn_up_exps.weight", data)
    assert mapped is data  # IKJAX_HOST_EXPERTS=mmap: the memory map's bytes


def test_sweep_reports_streamed_bytes_against_the_link(experts, monkeypatch):
    """sweep-bench's line for issue 24: a prompt step past ik's rule moves every host expert of
    every such layer (whole layers, the default) or the routed ones by round (-sm graph's
    by-address copy, counted by the custom call); the rate at the rows' mean prompt time is put
    against a measured pinned host -> device copy."""
    from types import SimpleNamespace
    from ikjax.model import groups
    from ikjax.tools import sweep_bench as sb
    monkeypatch.delenv("IKJAX_STREAM", raising=False)
    host = [_pinned(t, 32) for t in experts]
    layers = [{"gate_exps": host[0], "up_exps": host[1], "down_exps": host[2]}, {"attn_q": None}] * 2
    monkeypatch.setattr(groups, "host_layers", lambda weights: layers)
    eng = SimpleNamespace(weights=None, config=SimpleNamespace(n_expert_used=K), options=SimpleNamespace(ubatch=256))
    per_layer = sum(t.nbytes for t in host)
    assert sb.streamed_bytes(eng, 256) == (2 * per_layer, "chunks")
    assert sb.streamed_bytes(eng, 64) is None  # 64 x 2 picks < 32 x 8: computed on the host
    rows = [SimpleNamespace(t_pp=0.5), SimpleNamespace(t_pp=0.7)]
    line = sb.stream_report(eng, 512, rows)  # -ub 512 in steps of 256: 0.3 s a step
    assert f"{2 * per_layer / 1e9:.2f} GB cross" in line and "0.300 s a step" in line and "GB/s (" in line
    by_addr = [HostQuantArray(h.data, Q, h.shape, min_batch=32, by_address=True) for h in host]
    layers[0] = layers[2] = {"gate_exps": by_addr[0], "up_exps": by_addr[1], "down_exps": by_addr[2]}
    assert sb.streamed_bytes(eng, 256)[1] == "active"
    assert "3.00 GB over" in sb.stream_report(eng, 512, rows, active_bytes=3 * 10**9)
    assert sb.h2d_bandwidth(jax.devices()[0], nbytes=1 << 20, reps=1) > 0


def test_host_decode_report_splits_a_token(monkeypatch):
    """sweep-bench's line on the host kernel's share of a TG token (-ot exps=CPU next to a GPU):
    the mean decode-sized call, its expert bytes a second, times the host layers, against the TG
    rows' mean time a token; nothing without decode-sized calls (a CPU-only run, all on the GPU)."""
    from types import SimpleNamespace
    from ikjax.model import groups
    from ikjax.quant.types import by_name
    from ikjax.tools import sweep_bench as sb
    host = HostQuantArray(np.zeros((4, 2, 18), np.uint8), by_name("Q4_0"), (4, 2, 32))
    layers = [{"gate_exps": host}] * 4 + [{"attn_q": np.zeros(3)}]  # 4 host layers of 5 listed
    monkeypatch.setattr(groups, "host_layers", lambda weights: layers)
    eng = SimpleNamespace(weights={})
    rows = [sb.SweepRow(2048, 32, 0, 0.5, 0.4), sb.SweepRow(2048, 32, 2048, 0.5, 0.4)]  # 12.5 ms a token
    stats = {"small_calls": 8, "small_ns": 8_000_000, "small_bytes": 8 * 200_000_000, "host_call": "flag"}
    line = sb.host_decode_report(eng, rows, stats)
    assert line == ("host experts in decode steps: 1.000 ms a call in the host kernel (200.0 GB/s of experts "
                    "read, 8 calls, handed over by flag); x 4 layers = 4.00 ms of the TG rows' mean 12.50 ms a token (32 %)"), line
    assert sb.host_decode_report(eng, rows, {}) is None
    assert sb.host_decode_report(eng, [sb.SweepRow(2048, 0, 0, 0.5, 0.0)], stats) is None


def test_pinned_host_cap_follows_ram():
    """XLA caps a GPU's pinned host memory at 64 GB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says
    otherwise (R1-16's 78 GB of host experts failed to load on one H200, RESULTS §25g): importing
    ikjax raises the cap to the machine's RAM, leaves a user's value alone, and sets nothing where
    RAM is at most XLA's default. Checked in a fresh interpreter, as a user's process imports it."""
    import subprocess
    import sys

    import ikjax
    assert ikjax._pinned_host_limit({}, 251) == "251"
    assert ikjax._pinned_host_limit({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "7"}, 251) is None
    assert ikjax._pinned_host_limit({}, 64) is None and ikjax._pinned_host_limit({}, 0) is None
    probe = "import os, ikjax; print(os.environ.get('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'), ikjax._host_ram_gib())"
    env = {k: v for k, v in os.environ.items() if k != "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"}
    value, ram = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                check=True).stdout.split()
    assert int(ram) >= 1
    assert value == (ram if int(ram) > 64 else "None")
    env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = "5"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True).stdout.split()[0] == "5"


# ---- The host tensors' slots: a step names host bytes by a number stable across processes ---------

_SLOT_PROBE = r"""
import hashlib, json, sys
import numpy as np
import jax, jax.numpy as jnp
from ikjax.placement.host import HostQuantArray
from ikjax.placement.rules import TensorPlacement
from ikjax.quant.types import by_name
from pallas_kernels.moe_matmul import host as mh

Q = by_name("Q8_0")
E, F, D = 4, 64, 64
def tensor(name, shape):
    rows = shape[0] * shape[1]
    # a fresh allocation each process (and a different one a second time here): addresses differ
    data = np.zeros((rows + int(sys.argv[1]), shape[2] // 32 * 34), np.uint8)[: rows]
    place = TensorPlacement(name, "host", "CPU", 1, None, data.nbytes, "-ot exps=CPU")
    return HostQuantArray(data, Q, shape, tensor=place)
g, u, d = (tensor(f"blk.1.ffn_{k}_exps.weight", s) for k, s in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F))))
out = {"addresses": [t.host_address() for t in (g, u, d)],
       "slots": [mh.host_slot(t, t.host_address(), t.nbytes) for t in (g, u, d)]}
if mh.available():  # the step's HLO for a CUDA device, lowered here without one
    f = jax.jit(lambda x, w, i: mh.moe_experts(x, w, i, g, u, d))
    sds = jax.ShapeDtypeStruct
    hlo = f.trace(sds((2, D), jnp.float32), sds((2, 2), jnp.float32), sds((2, 2), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    out["hlo"] = hashlib.sha1(hlo.encode()).hexdigest()
    out["addresses_in_hlo"] = [a for a in out["addresses"] if str(a) in hlo]
    out["slots_in_hlo"] = all(f"{k}_slots = dense<{s}> " in hlo for k, s in zip(("gate", "up", "down"), out["slots"]))
    from pallas_kernels import _cuda_host
    out["resolved"] = [list(_cuda_host.host_slot(s)) for s in out["slots"]]
print(json.dumps(out))
"""


def _slot_probe(pad: int) -> dict:
    import json
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SLOT_PROBE, str(pad)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_host_slots_same_in_every_process():
    """Two processes with the experts' bytes at other addresses name them by the same slots (and,
    where the CUDA handler is built, lower the host-experts call to the same HLO, with no address
    in it, and map each slot to that process's own bytes): what lets JAX's persistent cache serve an
    -ot step (RESULTS §25h: every -ot run compiled again, 65-73 s on R1-16 -sm graph)."""
    a, b = _slot_probe(0), _slot_probe(4096)
    assert a["addresses"] != b["addresses"]
    assert a["slots"] == b["slots"] and len(set(a["slots"])) == 3
    if "hlo" in a:
        assert a["hlo"] == b["hlo"]
        assert a["addresses_in_hlo"] == [] and a["slots_in_hlo"]
        for probe in (a, b):
            assert [r[0] for r in probe["resolved"]] == probe["addresses"]


def test_host_slots_distinct_for_live_tensors(experts):
    """In one process: the same tensor (or a view of it) keeps its slot; a second engine's copy of
    the same tensor (same name, other bytes) and another tensor each get their own."""
    from ikjax.placement.rules import TensorPlacement
    from pallas_kernels.moe_matmul import host as mh

    def host(qa, name):
        data = np.array(qa.data)
        place = TensorPlacement(name, "host", "CPU", 1, None, data.nbytes, "-ot exps=CPU")
        return HostQuantArray(data, Q, qa.shape, tensor=place)

    g1 = host(experts[0], "blk.9.ffn_gate_exps.weight")
    g2 = host(experts[0], "blk.9.ffn_gate_exps.weight")  # a second engine of the same model
    u1 = host(experts[1], "blk.9.ffn_up_exps.weight")
    s = lambda t: mh.host_slot(t, t.host_address(), t.nbytes)
    first = s(g1)
    assert s(g1) == first == s(HostQuantArray._view(g1, g1.data))
    assert len({first, s(g2), s(u1)}) == 3
    assert all(0 <= x < 2 ** 63 for x in (first, s(g2), s(u1)))


def test_steps_with_host_tensors_are_never_stored_whole(experts):
    """A step over host experts is not kept whole (loaded later without tracing, its slots would be
    unset), in both forms: pinned (a leaf) and mapped (a node with no leaf)."""
    from ikjax.runtime.executables import has_host_tensors
    pinned = _pinned(experts[0], 32)
    mapped = HostQuantArray(np.asarray(experts[0].data), Q, experts[0].shape)
    assert jax.tree.leaves({"m": mapped}) == []
    assert has_host_tensors([{"gate_exps": mapped, "norm": jnp.ones(3)}])
    assert has_host_tensors({"layers": (pinned,)})
    assert not has_host_tensors({"gate_exps": experts[0], "norm": jnp.ones(3)})
