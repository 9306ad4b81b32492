"""Layer groups (ikjax.model.groups): runs of identical layers scanned with `lax.scan`.

- every kernel reads layer j of a stacked weight in place (ikjax.quant.array.LayerSlice) and
  gives what it gives for that layer's own weight, at a traced index, for each implementation;
- the groups are what the file and the placement make identical (dense lead, MoE run, a host
  layer alone);
- a scanned model computes what the unrolled one does, in every attention mode, and its compile
  time does not grow with depth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ikjax
from ikjax import ops
from ikjax.errors import OptionError
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.model.groups import all_layers, layer_spans, layer_tensors
from ikjax.quant.array import LayerSlice
from pallas_kernels.moe_matmul import cpu as moe_cpu
from pallas_kernels.quant_matmul import cpu as qm_cpu
from pallas_kernels.quant_matmul import prepare
from pallas_kernels.testing import random_quant_array


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def stack(ws):
    return jax.tree.map(lambda *a: jnp.stack(a), *ws)


def backends(name: str) -> list[str]:
    out = ["xla", "interpret"]
    if qm_cpu.supported(name):
        out.append("cpu")
    return out


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_K"])
def test_quant_linear_reads_the_layer_of_a_stack(name):
    rng = np.random.default_rng(3)
    L, N, K = 3, 64, 256
    ws = [random_quant_array(name, (N, K), rng) for _ in range(L)]
    for rows in (1, 5):  # the decode form and the prompt form
        x = jnp.asarray(rng.standard_normal((rows, K)), jnp.float32)
        for b in backends(name):
            per = [prepare(w) for w in ws] if b == "interpret" else ws
            st = stack(per)
            f = jax.jit(lambda x, s, i, b=b: ops.quant_linear(x, LayerSlice(s, i), jnp.float32, backend=b))
            for i in range(L):
                want = ops.quant_linear(x, per[i], jnp.float32, backend=b)
                got = f(x, st, jnp.int32(i))
                assert rel(got, want) < 1e-6, (name, b, rows, i)
                # and it is that layer's product, not another's
                other = ops.quant_linear(x, per[(i + 1) % L], jnp.float32, backend=b)
                assert rel(got, other) > 1e-2


def test_head_linear_and_ffn_read_the_layer_of_a_stack():
    rng = np.random.default_rng(4)
    L, H, N, K, F, d = 2, 4, 32, 64, 64, 128
    heads = [random_quant_array("Q8_0", (H, N, K), rng) for _ in range(L)]
    x = jnp.asarray(rng.standard_normal((3, H, K)), jnp.float32)
    impls = ["xla"] + (["cpu"] if qm_cpu.supported("Q8_0") else [])
    for b in impls:
        f = jax.jit(lambda x, s, i, b=b: ops.head_linear(x, LayerSlice(s, i), jnp.float32, backend=b))
        for i in range(L):
            assert rel(f(x, stack(heads), jnp.int32(i)), ops.head_linear(x, heads[i], jnp.float32, backend=b)) < 1e-6
    ffns = [[random_quant_array("Q8_0", s, rng) for s in ((F, d), (F, d), (d, F))] for _ in range(L)]
    st = [stack([f[k] for f in ffns]) for k in range(3)]
    xs = jnp.asarray(rng.standard_normal((8, d)), jnp.float32)  # prompt-sized: the fused C++ FFN
    for b in impls:
        f = jax.jit(lambda x, g, u, dn, i, b=b: ops.swiglu_ffn(
            x, LayerSlice(g, i), LayerSlice(u, i), LayerSlice(dn, i), jnp.float32, backend=b))
        for i in range(L):
            want = ops.swiglu_ffn(xs, *ffns[i], jnp.float32, backend=b)
            assert rel(f(xs, *st, jnp.int32(i)), want) < 1e-5, (b, i)


@pytest.mark.parametrize("N", [2, 40])  # gather form, grouped form
def test_moe_experts_read_the_layer_of_a_stack(N):
    rng = np.random.default_rng(5)
    L, E, F, d, k = 3, 6, 128, 256, 2
    layers = [[random_quant_array("Q8_0", s, rng) for s in ((E, F, d), (E, F, d), (E, d, F))] for _ in range(L)]
    x = jnp.asarray(rng.standard_normal((N, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (N, k)), jnp.float32)
    impls = ["xla", "interpret"] + (["cpu"] if moe_cpu.supported(*layers[0]) else [])
    for b in impls:
        per = [[prepare(t) for t in lay] for lay in layers] if b == "interpret" else layers
        st = [stack([lay[j] for lay in per]) for j in range(3)]
        f = jax.jit(lambda x, w, ids, g, u, dn, i, b=b: ops.moe_experts(
            x, w, ids, LayerSlice(g, i), LayerSlice(u, i), LayerSlice(dn, i), jnp.float32, backend=b))
        for i in range(L):
            want = ops.moe_experts(x, w, ids, *per[i], jnp.float32, backend=b)
            assert rel(f(x, w, ids, *st, jnp.int32(i)), want) < 1e-5, (b, N, i)


def test_groups_follow_the_file_and_the_placement(tiny4_model):
    eng = ikjax.load(tiny4_model, ctx=64)
    cfg = eng.config
    spans = eng.spans
    assert sum(c for _, c in spans) == cfg.n_layer and [f for f, _ in spans] == list(np.cumsum([0] + [c for _, c in spans[:-1]]))
    # the dense lead and the MoE layers never share a group; identical neighbours always do
    for first, count in spans:
        assert len({cfg.is_moe_layer(i) for i in range(first, first + count)}) == 1
    assert len(spans) == (1 if cfg.n_dense_lead in (0, cfg.n_layer) else 2)
    groups = eng.weights["groups"]
    assert [(g.first, g.count) for g in groups] == list(spans)
    # a stacked group holds every layer's tensors: layer_tensors gives back each one
    gf = GGUFModelFile(tiny4_model)
    big = next(g for g in groups if g.count > 1)
    for i in big.layers:
        t = layer_tensors(eng.weights, i)
        raw = np.asarray(gf.tensor_bytes(f"blk.{i}.attn_kv_a_mqa.weight")).reshape(-1)
        assert np.array_equal(np.asarray(t["kv_a_mqa"].data).reshape(-1), raw)
    assert len(all_layers(eng.weights)) == cfg.n_layer
    # unrolled: a group per layer
    assert layer_spans(cfg, gf.tensors, None, mode="unroll") == tuple((i, 1) for i in range(cfg.n_layer))
    # a layer whose tensors differ (here: one layer's type) splits the run around it
    tensors = dict(gf.tensors)
    name = f"blk.{big.first + 1}.attn_output.weight"
    tensors[name] = type("Info", (), {"qtype": type("Q", (), {"name": "ODD"})(), "shape": gf.tensors[name].shape})()
    split = layer_spans(cfg, tensors, None, mode="scan")
    assert (big.first + 1, 1) in split and len(split) == len(spans) + 2


@pytest.mark.parametrize("mla,ctk", [(3, "f16"), (2, "q8_0"), (1, "f32"), (0, "f16")])
def test_scanned_model_equals_unrolled(tiny4_model, monkeypatch, mla, ctk):
    """Same logits from the scanned and the unrolled layers (prompt chunks, then decode steps),
    on the default backend of this machine."""
    rng = np.random.default_rng(mla)
    ids = rng.integers(2, 200, 37)
    out = {}
    for mode in ("scan", "unroll"):
        monkeypatch.setenv("IKJAX_LAYERS", mode)
        eng = ikjax.load(tiny4_model, ctx=128, ubatch=16, mla=mla, ctk=ctk, dtype="f32")
        assert (len(eng.weights["groups"]) < eng.config.n_layer) == (mode == "scan")
        logits = eng.logits(ids)
        toks = list(eng.generate(ids[:20], 6))
        out[mode] = (logits, toks)
    np.testing.assert_allclose(out["scan"][0], out["unroll"][0], rtol=2e-5, atol=2e-5 * np.abs(out["unroll"][0]).max())
    assert out["scan"][1] == out["unroll"][1]


def _first_prompt_step(path) -> tuple[float, int, int]:
    """(backend compile seconds, optimized HLO instructions, steps compiled) of a fresh engine's
    first prompt step, in this process (JAX's own compile event; the in-memory caches dropped so
    nothing is reused from an earlier compile)."""
    seconds: list[float] = []

    def on_event(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seconds.append(duration)

    jax.clear_caches()
    eng = ikjax.load(path, ctx=256, ubatch=64)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        eng.logits(np.arange(2, 40))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    (exe,) = eng._executables.values()
    hlo = exe.as_text()
    return max(seconds), sum(1 for line in hlo.splitlines() if " = " in line), eng.compile_count


def test_compile_time_does_not_grow_with_depth(tmp_path, monkeypatch):
    """The first prompt step of a 24-layer model is the program of a 4-layer one (the MoE run one
    scanned loop: the same optimized HLO but for its shapes; unrolled it is ~5x the instructions) and
    compiles in about its time (unrolled ~3x as long). Both measured in this process, one after
    the other, so a loaded machine slows both alike; the time bound is loose, the HLO one exact."""
    from ikjax.tools.synthetic import make_model
    monkeypatch.setenv("IKJAX_COMPILE_CACHE", "0")
    got = {}
    for layers in (4, 24):
        path = tmp_path / f"tiny{layers}.gguf"
        make_model(path, "tiny", "Q8_0", layers=layers)
        got[layers] = _first_prompt_step(path)
    (t4, n4, c4), (t24, n24, c24) = got[4], got[24]
    assert c4 == c24 == 1, got
    assert n24 == n4, got  # one layer's program, whatever the depth
    assert t24 < 2.0 * t4 + 1.0, got


def test_gpu_decode_unroll_bounded_and_equal(tmp_path, monkeypatch):
    """GPU decode steps scan at most IKJAX_DECODE_UNROLL layers an iteration (a remainder traced apart):
    the layers traced stay under 2 x IKJAX_DECODE_UNROLL whatever the group's size, and the form gives
    the scanned model's tokens and logits (the GPU path's kernels in interpret mode: an 8-layer
    model, 7 MoE layers = one iteration of 4 and a remainder of 3)."""
    from ikjax.model import groups
    from ikjax.tools.synthetic import make_model

    from ikjax import env

    monkeypatch.setenv("IKJAX_LAYERS", "auto")
    # auto: one layer an iteration where XLA unrolls the decode graph's loops (the default), else 4
    assert groups.decode_unroll() == 1 and groups.unroll_scan(1, "pallas", 26) == 1
    monkeypatch.setenv("IKJAX_DECODE_GRAPH_UNROLL", "0")
    assert groups.decode_unroll() == 4
    monkeypatch.setenv("IKJAX_DECODE_UNROLL", "x")
    with pytest.raises(OptionError, match="IKJAX_DECODE_UNROLL must be a positive integer"):
        groups.decode_unroll()
    monkeypatch.setenv("IKJAX_DECODE_UNROLL", "4")
    most = env.positive_int("IKJAX_DECODE_UNROLL")
    for count in range(1, 130):
        k = groups.unroll_scan(1, "pallas", count)
        assert 1 <= k <= most and k + count % k < 2 * most, count
        assert groups.unroll_scan(7, "pallas", count) == groups.unroll_scan(1, "cpu", count) == 1
    assert [groups.unroll_scan(1, "pallas", n) for n in (26, 58, 7, 5, 3)] == [4, 4, 4, 3, 3]
    monkeypatch.setenv("IKJAX_LAYERS", "halves")
    assert groups.unroll_scan(1, "pallas", 26) == 13

    path = tmp_path / "m8.gguf"
    make_model(path, "tiny", "Q8_0", layers=8)
    monkeypatch.setenv("IKJAX_KERNELS", "interpret")
    ids = np.random.default_rng(3).integers(2, 200, 9)
    out = {}
    for mode in ("scan", "auto"):
        monkeypatch.setenv("IKJAX_LAYERS", mode)
        eng = ikjax.load(path, ctx=64, ubatch=16, dtype="f32")
        logits, cache = eng.prefill(eng.new_cache(1), ids, 0)
        steps = []
        for t in range(3):
            tok = int(np.argmax(np.asarray(logits)))
            o, cache = eng.step(cache, np.array([[tok]], np.int32), np.array([len(ids) + t]), np.array([0]))
            logits = np.asarray(o, np.float32)[0]
            steps.append((tok, logits))
        out[mode] = steps
    for (ta, la), (tb, lb) in zip(out["scan"], out["auto"]):
        assert ta == tb
        np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5 * np.abs(lb).max())


def test_host_layers_slices_no_device_group(tiny4_model):
    """`host_layers` (sweep-bench's streamed-bytes line, the load's host-expert flags) returns the
    layers holding host-memory tensors without slicing the groups that are all on the device: an
    eager slice of a stacked device array is a compile and a copy (81 of them in a cold V2-Lite
    start on a GPU, RESULTS §22g). Here no tensor is on the host: nothing to return, nothing run."""
    from jax._src import array as jarray

    import ikjax
    from ikjax.model.groups import all_layers, host_layers
    eng = ikjax.load(tiny4_model, ctx=128)
    sliced = []
    assert host_layers(eng.weights) == []
    stacked = [g for g in eng.weights["groups"] if g.stacked]
    assert stacked  # the file has a group the old all_layers sliced
    orig = jarray.ArrayImpl.__getitem__

    def spy(self, idx):
        sliced.append(idx)
        return orig(self, idx)
    jarray.ArrayImpl.__getitem__ = spy
    try:
        host_layers(eng.weights)
        assert sliced == []
        all_layers(eng.weights)
        assert sliced  # the contrast: all_layers does slice every stacked leaf
    finally:
        jarray.ArrayImpl.__getitem__ = orig


class _HybridPlacement:
    """A placement next to an accelerator (not unified) with the tensors `host` names in host
    memory, the rest on GPU0: what layer_spans reads of one (by name, `hot`, `unified`)."""
    unified = False

    def __init__(self, names, host):
        from ikjax.placement.rules import TensorPlacement
        self.by_name = {n: TensorPlacement(n, "host" if host(n) else "device", "CPU" if host(n) else "GPU0",
                                           None, None, 0, "-ot" if host(n) else "default") for n in names}

    def __getitem__(self, name):
        return self.by_name[name]

    def hot(self, i):
        return ()


@pytest.mark.parametrize("env,scanned", [({}, True), ({"IKJAX_HOST_LAYERS": "unroll"}, False),
                                         ({"IKJAX_STREAM": "layer"}, False), ({"IKJAX_STREAM_COPY": "xla"}, False)])
def test_host_expert_layers_scan_as_a_group(tiny4_model, monkeypatch, env, scanned):
    """-ot exps=CPU: the MoE layers whose routed experts stay in host memory are one scanned group
    (their host calls pick each layer's bytes at run time), unless IKJAX_HOST_LAYERS=unroll or a
    streaming form that takes a layer's bytes as a step argument; their host bytes never count
    toward the Pallas stack limit; any other tensor in host memory keeps its layer alone."""
    from ikjax.gguf_io.tensors import is_routed_expert
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gf = GGUFModelFile(tiny4_model)
    cfg = ikjax.load(tiny4_model, ctx=64).config
    moe = [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)]
    assert len(moe) >= 3
    exps = _HybridPlacement(gf.tensors, is_routed_expert)
    biggest = max(gf.tensors[f"blk.{moe[0]}.ffn_{p}_exps.weight"].nbytes for p in ("gate", "up", "down"))
    spans = layer_spans(cfg, gf.tensors, exps, mode="scan", max_stack_bytes=biggest)
    want = (moe[0], len(moe)) in spans if scanned else all((i, 1) in spans for i in moe)
    assert want, spans
    # one layer's attention output on the host: that layer alone, its neighbours still one group
    mid = moe[1]
    odd = _HybridPlacement(gf.tensors, lambda n: is_routed_expert(n) or n == f"blk.{mid}.attn_output.weight")
    spans = layer_spans(cfg, gf.tensors, odd, mode="scan")
    assert (mid, 1) in spans, spans


def test_host_stack_views_and_the_host_call(monkeypatch):
    """A scanned group's host tensor (HostStack): no leaves, equal where it holds the same arrays
    (every -sm graph device loads the group), each layer's own array back from LayerGroup.layer,
    and inside the scan a view (`layer_view`) whose host call names every layer's bytes in slot
    tables and the traced index after the ids, lowered for CUDA: one call for the whole group."""
    from ikjax.model.groups import LayerGroup
    from ikjax.ops.quant_matmul import layer_view
    from ikjax.placement.host import HostLayer, HostQuantArray, HostStack, is_host_resident
    from ikjax.quant import by_name
    from pallas_kernels.moe_matmul import host as moe_host
    E, F, d, L = 4, 64, 32, 3
    qt = by_name("Q8_0")
    rng = np.random.default_rng(0)

    def arr(rows, cols):
        return HostQuantArray(rng.integers(0, 255, size=(E, rows, cols // 32 * 34), dtype=np.uint8), qt,
                              (E, rows, cols))
    per = [(arr(F, d), arr(F, d), arr(d, F)) for _ in range(L)]
    stacks = [HostStack([per[l][t] for l in range(L)]) for t in range(3)]
    assert jax.tree.leaves(stacks) == [] and all(is_host_resident(s) for s in stacks)
    again = HostStack(list(stacks[0].arrays))
    assert again == stacks[0] and hash(again) == hash(stacks[0]) and again != stacks[1]
    assert jax.tree.structure(again) == jax.tree.structure(stacks[0])
    with pytest.raises(ValueError, match="differ"):
        HostStack([per[0][0], per[0][2]])
    norm = jnp.ones((L, d))
    group = LayerGroup(5, L, {"gate_exps": stacks[0], "ffn_norm": norm})
    assert group.layer(6)["gate_exps"] is per[1][0] and group.layer(7)["ffn_norm"].shape == (d,)
    view = layer_view(group.tensors, jnp.int32(2))
    assert isinstance(view["gate_exps"], HostLayer) and view["gate_exps"].host_layers == stacks[0].arrays
    assert view["gate_exps"].shape == (E, F, d) and not view["gate_exps"].streamable
    assert not view["gate_exps"].whole_ok  # a group never moves a layer whole

    monkeypatch.setattr(moe_host, "register", lambda: None)  # lowered only: no CUDA device here
    monkeypatch.setattr(moe_host, "supported", lambda *a: True)

    def body(x, w, ids, j):
        g, u, dn = (layer_view({"t": s}, j)["t"] for s in stacks)
        return moe_host.moe_experts(x, w, ids, g, u, dn)
    x, w, ids = jnp.zeros((2, d)), jnp.ones((2, 2)), jnp.zeros((2, 2), jnp.int32)
    txt = jax.jit(body).trace(x, w, ids, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in txt.splitlines() if "custom_call @ikjax_host_moe_experts" in line]
    assert len(calls) == 1
    for t, key in enumerate(("gate_slots", "up_slots", "down_slots")):
        slots = [moe_host.host_slot(a, a.host_address(), a.nbytes) for a in stacks[t].arrays]
        assert f"{key} = dense<[{', '.join(map(str, slots))}]> : tensor<{L}xi64>" in calls[0]
        assert len(set(slots)) == L
    assert "tensor<5xi32>" in calls[0]  # 2 x 2 ids and the layer index
    # one layer of its own: a table of one slot, index 0
    one = moe_host.moe_experts
    txt1 = jax.jit(lambda x, w, ids: one(x, w, ids, *per[0])).trace(x, w, ids).lower(
        lowering_platforms=("cuda",)).as_text()
    slot = moe_host.host_slot(per[0][0], per[0][0].host_address(), per[0][0].nbytes)
    assert f"gate_slots = dense<{slot}> : tensor<1xi64>" in txt1
