"""Routed experts in host RAM next to a GPU (issue 10, deliverable 3), on a real GPU.

`-ot exps=CPU` keeps every `ffn_*_exps` tensor in pinned host memory (one copy, made from the
memory map at load) and computes the experts on the host CPU from inside the GPU step
(pallas_kernels/moe_matmul/cuda_host.cc) for small batches, and streams them to the GPU inside the
step for batches past ik's rule (deliverable 4); the logits must equal the all-GPU run's (f32
compute: the same function, only the summation order of the expert products differs) and, on the
real-converter fixtures, the reference logits.

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
from ikjax import ops  # noqa: E402
from ikjax.placement.host import HostQuantArray  # noqa: E402

from conftest import fixture_entry, fixtures_dir, load_ref, rel_err  # noqa: E402
from ikjax.model.groups import all_layers, layer_tensors

TOL = 1e-5  # f32 compute, host vs GPU experts
FIXTURES = ("v3tiny-all-Q4_K_M.gguf", "v2lite_tiny-kvb-Q5_1.gguf")


def _logits(path, tokens, **opts):
    eng = ikjax.load(path, ctx=256, ubatch=64, dtype="f32", **opts)
    out = eng.logits(tokens)
    return eng, out


def _check_host_resident(eng, n_host_layers: int | None = None):
    layers = [i for i, lay in enumerate(all_layers(eng.weights)) if "gate_exps" in lay]
    host = [i for i in layers if isinstance(layer_tensors(eng.weights, i)["gate_exps"], HostQuantArray)]
    want = layers if n_host_layers is None else [i for i in layers if i < n_host_layers]
    assert host == want and host, (host, want)
    for i in host:
        for k in ("gate_exps", "up_exps", "down_exps"):
            t = layer_tensors(eng.weights, i)[k]
            assert isinstance(t, HostQuantArray) and t.streamable
            assert t.data.sharding.memory_kind == "pinned_host"
            assert t.host_address() == t.data.unsafe_buffer_pointer() != 0
    # the memory plan puts exactly those bytes on the host, none of them on the GPU
    plan = eng.memory_plan()
    assert plan.host_weights_bytes == sum(layer_tensors(eng.weights, i)[k].nbytes for i in host
                                          for k in ("gate_exps", "up_exps", "down_exps"))


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """The tiny synthetic preset, 4 layers (1 dense + 3 MoE), Q4_K: made by our writer."""
    from ikjax.tools.synthetic import make_model
    p = tmp_path_factory.mktemp("hybrid") / "tiny4-Q4_K.gguf"
    make_model(p, "tiny", "Q4_K", layers=4)
    return str(p)


def test_tiny4_host_experts_equal_gpu(tiny4):
    tokens = np.arange(1, 40) % 200
    _, ref = _logits(tiny4, tokens)
    eng, got = _logits(tiny4, tokens, ot="exps=CPU", t=4)
    assert ops.selected("moe_experts") == "host"
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


@pytest.mark.parametrize("form", ["flag", "hostfunc"])
def test_hybrid_decode_loop_equals_steps(tiny4, monkeypatch, tmp_path, form):
    """With the experts in host RAM, generation runs the decode loop (several tokens a dispatch,
    a host call a MoE layer a token inside it): its greedy tokens and its expert statistics (one
    host callback a dispatch, the loop's carry summed) equal one step a dispatch's
    (IKJAX_DECODE_LOOP=0), under both hand-over forms."""
    monkeypatch.setenv("IKJAX_HOST_CALL", form)
    prompt = list(range(3, 20))
    got = {}
    for loop in ("1", "0"):
        monkeypatch.setenv("IKJAX_DECODE_LOOP", loop)
        eng = ikjax.load(tiny4, ctx=256, ubatch=64, dtype="f32", ot="exps=CPU", t=4, expert_stats=True)
        assert eng.decode_loop() == (loop == "1")
        toks = [int(t) for t in eng.generate(prompt, max_tokens=40)]
        got[loop] = (toks, eng.expert_stats())
    assert len(got["1"][0]) == 40 and got["1"][0] == got["0"][0]
    assert got["1"][1] == got["0"][1] and got["1"][1]["tokens"] == len(prompt) + 39


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


# ik's rule on the fixtures and the tiny preset (16 experts, 4 used): the experts stream to the GPU
# from 32 * 16 / 4 = 128 tokens in one step
STREAM_TOKENS = 200


def test_tiny4_prompt_streams_experts(tiny4):
    """A 200-token prompt in one step (ubatch 256) streams the pinned experts to the GPU and runs
    the GPU MoE on them (f32: the XLA grouped form, as the all-GPU run); the decode steps after it
    read the same pinned bytes on the host. Both equal the all-GPU run."""
    tokens = (np.arange(STREAM_TOKENS) * 7 + 3) % 1000
    ref_eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32")
    ref = ref_eng.logits(tokens)
    ref_gen = list(ref_eng.generate(list(tokens), max_tokens=6))
    eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32", ot="exps=CPU", t=4)
    _check_host_resident(eng)
    got = eng.logits(tokens)
    assert ops.selected("moe_experts") == "stream:xla", ops.selected("moe_experts")
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    assert list(eng.generate(list(tokens), max_tokens=6)) == ref_gen
    assert ops.selected("moe_experts") == "host"


def test_tiny4_prompt_streams_bf16_pallas(tiny4):
    """bf16 (dtype auto's prompt products): the streamed experts run the Pallas grouped kernel, as
    the all-GPU run does on the same packed blocks."""
    tokens = (np.arange(STREAM_TOKENS) * 5 + 1) % 1000
    ref = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="bf16").logits(tokens)
    got = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="bf16", ot="exps=CPU").logits(tokens)
    assert ops.selected("moe_experts") == "stream:pallas", ops.selected("moe_experts")
    assert rel_err(got, ref) <= 1e-2, rel_err(got, ref)


def test_fixture_prompt_streams_experts(monkeypatch):
    """v3tiny-all-Q4_K_M: a prompt past the threshold streams; a lower IKJAX_MIN_OFFLOAD_BATCH
    moves the threshold (8 * 16 / 4 = 32 tokens), so 64-token chunks stream too."""
    name = FIXTURES[0]
    path = fixtures_dir() / name
    fixture_entry(name)
    tokens = (np.arange(STREAM_TOKENS) * 11 + 5) % 1000
    ref = ikjax.load(path, ctx=512, ubatch=256, dtype="f32").logits(tokens)
    got = ikjax.load(path, ctx=512, ubatch=256, dtype="f32", ot="exps=CPU").logits(tokens)
    assert ops.selected("moe_experts") == "stream:xla"
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    monkeypatch.setenv("IKJAX_MIN_OFFLOAD_BATCH", "8")
    eng = ikjax.load(path, ctx=512, ubatch=64, dtype="f32", ot="exps=CPU")
    assert layer_tensors(eng.weights, -1)["gate_exps"].min_batch == 8
    tokens = tokens[:192]  # three 64-token steps, each past the lowered threshold
    ref = ikjax.load(path, ctx=512, ubatch=64, dtype="f32").logits(tokens)
    got = eng.logits(tokens)
    assert ops.selected("moe_experts") == "stream:xla"
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


@pytest.mark.parametrize("mib,dtype", [("1024", "f32"), ("0.01", "f32"), ("0.01", "bf16")])
def test_active_stream_rounds(tiny4, monkeypatch, mib, dtype):
    """IKJAX_STREAM=active: only the experts the prompt routes to cross PCIe, in one
    round (1024 MiB) or one expert a round (0.01 MiB): the same logits as the all-GPU run, every
    copied byte accounted (copied experts x their blocks), never more experts than the batch uses;
    IKJAX_STREAM=layer (the whole layer) and =chunks (runs of experts) agree too."""
    monkeypatch.setenv("IKJAX_STREAM_MIB", mib)
    monkeypatch.setenv("IKJAX_STREAM", "active")
    tokens = (np.arange(STREAM_TOKENS) * 3 + 2) % 1000
    ref = ikjax.load(tiny4, ctx=512, ubatch=256, dtype=dtype).logits(tokens)
    eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype=dtype, ot="exps=CPU")
    host_moe.stream_stats(reset=True)
    got = eng.logits(tokens)
    st = host_moe.stream_stats(reset=True)
    tol = TOL if dtype == "f32" else 1e-2
    assert ops.selected("moe_experts").startswith("stream:")
    assert rel_err(got, ref) <= tol, rel_err(got, ref)
    lay = [l for l in all_layers(eng.weights) if "gate_exps" in l]
    E = lay[0]["gate_exps"].shape[0]
    per_expert = sum(lay[0][k].nbytes for k in ("gate_exps", "up_exps", "down_exps")) // E
    slots = ops.stream_slots(*(lay[0][k] for k in ("gate_exps", "up_exps", "down_exps")))
    assert (slots == E) == (mib == "1024")
    # round 0 of every layer, later rounds only while the layer has more active experts
    assert len(lay) <= st["calls"] <= len(lay) * -(-E // slots), st
    if slots == 1:
        assert st["calls"] == st["active"], st
    assert 0 < st["copied"] == st["active"] <= len(lay) * E and st["bytes"] == st["copied"] * per_expert, st
    for mode in ("layer", "chunks"):  # every expert: whole layers, or runs of experts (at 0.01 MiB: one each)
        monkeypatch.setenv("IKJAX_STREAM", mode)
        whole = ikjax.load(tiny4, ctx=512, ubatch=256, dtype=dtype, ot="exps=CPU").logits(tokens)
        st = host_moe.stream_stats(reset=True)
        assert rel_err(whole, ref) <= tol, (mode, rel_err(whole, ref))
        if mode == "layer":
            assert st["calls"] == 0, st
        else:  # by the copy engine: every expert of every layer once, in runs of `slots` (or all)
            steps = st["copied"] // (len(lay) * E)  # prompt steps run (one, unless the load warms one up)
            assert steps >= 1 and st["copied"] == steps * len(lay) * E, st
            assert st["bytes"] == st["copied"] * per_expert, st
            assert st["calls"] == steps * len(lay) * -(-E // ops.chunk_experts(per_expert, E)), st


@pytest.mark.parametrize("ot", [r"blk\.1\.=CPU,token_embd=CPU,output=CPU", r"blk\.[0-9]\.=CPU"])
def test_any_tensor_on_the_host(tiny4, ot):
    """Any tensor may stay in host memory next to the GPU (not only experts): non-expert ones are
    held pinned and moved to the GPU by the step that reads them, experts run on the host (decode)
    or stream (prompt): prompt logits and greedy tokens equal the all-GPU run's."""
    tokens = list((np.arange(40) * 13 + 7) % 1000)
    ref_eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32")
    ref = ref_eng.logits(tokens)
    eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32", ot=ot)
    from ikjax.placement.host import HostTensor
    assert isinstance(layer_tensors(eng.weights, 1)["attn_norm"], HostTensor)
    got = eng.logits(tokens)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    assert list(eng.generate(tokens, max_tokens=5)) == list(ref_eng.generate(tokens, max_tokens=5))


def test_any_tensor_on_the_host_fixture():
    """v2lite_tiny-kvb-Q5_1 (real converter file) with its first two layers and the output head in
    host memory: equal to the all-GPU run and within the fixture's tolerance of its reference."""
    name = FIXTURES[1]
    entry = fixture_entry(name)
    tokens, ref = load_ref(entry)
    path = fixtures_dir() / name
    _, gpu = _logits(path, tokens)
    eng, got = _logits(path, tokens, ot=r"blk\.[01]\.=CPU,output=CPU")
    assert rel_err(got, gpu) <= TOL, rel_err(got, gpu)
    assert rel_err(got, ref) <= entry["tol"], rel_err(got, ref)


@pytest.mark.parametrize("n_tokens, dtype", [(39, "f32"), (STREAM_TOKENS, "f32"), (39, "bf16")])
def test_tiny4_gpu_experts(tiny4, tmp_path, n_tokens, dtype):
    """--gpu-experts 3: copies of each host layer's 3 most used experts on the GPU (the Pallas or
    XLA MoE there), the other picks on the host (small batches) or streamed (big ones: only the
    experts left); logits as the plain -ot exps=CPU run's, and the device holds the copies."""
    tokens = (np.arange(n_tokens) * 7 + 3) % 1000
    stats = tmp_path / "s.json"
    base = ikjax.load(tiny4, ctx=512, ubatch=256, dtype=dtype, ot="exps=CPU", expert_stats=True)
    ref = base.logits(tokens)
    base.save_expert_stats(stats)
    eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype=dtype, ot="exps=CPU", gpu_experts="3",
                     expert_counts=str(stats))
    _check_host_resident(eng)
    hot = dict(eng.placement.hot_experts)
    assert hot and all(len(e) == 3 for e in hot.values())
    for i in hot:
        copies = layer_tensors(eng.weights, i)["hot_experts"]
        assert all(d.platform == "gpu" for d in copies["slot"].devices())
    got = eng.logits(tokens)
    assert rel_err(got, ref) <= (TOL if dtype == "f32" else 1e-2), rel_err(got, ref)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="-sm graph needs 2 or more GPUs")
def test_graph_split_streams_host_experts(tiny4):
    """-sm graph with -ot exps=CPU: one pinned copy for the mesh, reached by address; a 200-token
    prompt streams each device's range of the used experts by round (stream_experts), the decode
    after it computes them on the host, every pick in the first device's call. Both equal the
    one-GPU all-device run (logits; greedy tokens)."""
    tokens = (np.arange(STREAM_TOKENS) * 7 + 3) % 1000
    ref_eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32")
    ref = ref_eng.logits(tokens)
    ref_gen = list(ref_eng.generate(list(tokens), max_tokens=6))
    eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32", ot="exps=CPU", sm="graph")
    lay = [l for l in all_layers(eng.weights) if "gate_exps" in l]
    assert all(isinstance(l["gate_exps"], HostQuantArray) and l["gate_exps"].by_address and l["gate_exps"].pinned
               for l in lay)
    host_moe.stream_stats(reset=True)
    got = eng.logits(tokens)
    st = host_moe.stream_stats(reset=True)
    assert ops.selected("moe_experts").startswith("stream:")
    assert st["copied"] > 0, st
    # the mesh's all-reduces add the devices' partial products in another order than one GPU's
    # sums: 1.25e-5 measured on 2 x H200 (RESULTS §25f), f32 rounding, not a wrong pick
    assert rel_err(got, ref) <= 3 * TOL, rel_err(got, ref)
    assert list(eng.generate(list(tokens), max_tokens=6)) == ref_gen


@pytest.mark.skipif(len(jax.devices()) < 2, reason="-sm layer over GPUs needs 2 or more")
def test_layer_split_host_experts_in_their_stage_memory(tiny4):
    """-sm layer with -ot exps=CPU: each layer's host experts sit in the pinned memory of the GPU
    whose stage reads them (a step takes only its own device's arrays), and a streamed prompt and
    the host-computed decode after it equal the one-GPU all-device run."""
    tokens = (np.arange(STREAM_TOKENS) * 7 + 3) % 1000
    ref = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32").logits(tokens)
    eng = ikjax.load(tiny4, ctx=512, ubatch=256, dtype="f32", ot="exps=CPU", sm="layer")
    devs = {d for i, lay in enumerate(all_layers(eng.weights)) if "gate_exps" in lay
            for d in lay["gate_exps"].data.sharding.device_set}
    assert len(devs) == 2, devs  # the 3 MoE layers of 4 span both stages
    got = eng.logits(tokens)
    assert ops.selected("moe_experts").startswith("stream:")
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="the split modes need 2 or more GPUs")
@pytest.mark.parametrize("sm", ["layer", "graph"])
def test_split_hybrid_decode_loop_equals_steps(tiny4, monkeypatch, sm):
    """Under -sm layer and -sm graph with -ot exps=CPU, generation runs the decode loop (the
    pipeline's stages queued for every token of a dispatch; the mesh's loop inside the shard_map,
    a host call a MoE layer a token), and its greedy tokens equal one step a dispatch's
    (IKJAX_DECODE_LOOP=0). Before, the split modes ran host experts one token a dispatch."""
    prompt = list(range(3, 20))
    got = {}
    for loop in ("1", "0"):
        monkeypatch.setenv("IKJAX_DECODE_LOOP", loop)
        eng = ikjax.load(tiny4, ctx=256, ubatch=64, dtype="f32", ot="exps=CPU", t=4, sm=sm)
        assert eng.decode_loop() == (loop == "1")
        got[loop] = [int(t) for t in eng.generate(prompt, max_tokens=24)]
    assert len(got["1"]) == 24 and got["1"] == got["0"], got


@pytest.mark.parametrize("split", ["", "graph", "jax-cache"])
def test_ot_steps_served_by_the_compile_cache(tiny4, tmp_path, split):
    """The same `-ot exps=CPU` sweep-bench twice in one compile cache: the second run compiles no
    step (every one from the cache) and gives the first run's table shape. Before the host tensors'
    slots, the experts' addresses were in each step's HLO and every run compiled again (RESULTS
    §25h); before the lowering's fixes (compile_cache.lower: one at a time, arrays as
    ShapeDtypeStructs, locations from the innermost frame) no step holding a Pallas kernel was
    served by JAX's cache on a GPU at all (§25j). "jax-cache": the same without -ot and with steps
    not stored whole (IKJAX_STORE_STEPS=0), so JAX's own cache serves them as it does for -ot and
    several devices."""
    import os
    import re
    import subprocess
    import sys
    if split == "graph" and len(jax.devices()) < 2:
        pytest.skip("-sm graph needs 2 or more GPUs")
    env = dict(os.environ, IKJAX_COMPILE_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "ikjax.cli", "sweep-bench", "-m", tiny4, "-c", "512", "-ub", "256", "-n", "4"]
    if split == "jax-cache":
        env["IKJAX_STORE_STEPS"] = "0"
    else:
        cmd += ["-ot", "exps=CPU", "-t", "4"] + (["-sm", split] if split else [])
    runs = [subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    # the last compile line: "... in all" where rows compile apart (a CPU), the only one where all
    # steps compile before the first row (a GPU)
    totals = [re.findall(r"compiled (\d+) steps, (\d+) from the cache in [0-9.]+s", r.stderr) for r in runs]
    assert all(totals), [r.stderr[-1500:] for r in runs]
    compiled2, cached2 = map(int, totals[1][-1])
    assert compiled2 == 0 and cached2 >= 2, totals
    rows = [[l for l in r.stdout.splitlines() if re.match(r"\|\s+256\s", l)] for r in runs]
    assert len(rows[0]) == len(rows[1]) >= 1


def test_host_call_forms_agree(tiny4):
    """The two ways a step hands routed experts to the host (IKJAX_HOST_CALL: `flag`, the stream's
    memory operations and a worker a stream; `hostfunc`, CUDA host functions) run the same kernel
    on the same inputs: a prompt step's logits and a greedy decode loop (32 tokens, a host call a
    MoE layer a token) agree bit for bit, and each process reports the form it ran."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json, sys, numpy as np, ikjax\n"
            "from ikjax import ops\n"
            "eng = ikjax.load(sys.argv[1], ctx=256, ubatch=64, dtype='f32', ot='exps=CPU', t=4)\n"
            "lg = np.asarray(eng.logits(np.arange(1, 40) % 200))\n"
            "toks = [int(t) for t in eng.generate(list(range(3, 20)), max_tokens=32)]\n"
            "print(json.dumps({'form': ops.host_kernel_stats()['host_call'], 'logits': lg.ravel()[:4096].tolist(),"
            " 'tokens': toks}))\n")
    got = {}
    for form in ("flag", "hostfunc"):
        r = subprocess.run([sys.executable, "-c", code, tiny4], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, IKJAX_HOST_CALL=form))
        assert r.returncode == 0, r.stderr[-2000:]
        got[form] = json.loads(r.stdout.strip().splitlines()[-1])
        assert got[form]["form"] == form
    assert got["flag"]["logits"] == got["hostfunc"]["logits"]
    assert got["flag"]["tokens"] == got["hostfunc"]["tokens"] and len(got["flag"]["tokens"]) == 32


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory):
    """The tiny preset at 6 layers (1 dense + 5 MoE), Q4_K: five host layers in one group."""
    from ikjax.tools.synthetic import make_model
    p = tmp_path_factory.mktemp("hybrid6") / "tiny6-Q4_K.gguf"
    make_model(p, "tiny", "Q4_K", layers=6)
    return str(p)


@pytest.mark.parametrize("stream", ["chunks", "active"])
def test_host_layers_scanned_equal_unrolled(tiny6, monkeypatch, stream):
    """-ot exps=CPU: the five MoE layers whose experts stay in host memory are one scanned group
    (a HostStack a tensor; the host calls pick each layer's bytes by the scan's index at run time),
    and compute what the all-GPU run of the same layer form does (IKJAX_LAYERS scan or unroll; the
    unrolled -ot form is IKJAX_HOST_LAYERS=unroll, a group a layer): a 200-token prompt step
    streaming the experts (runs of experts by the copy engine, or the active ones by round: the
    layer index read before the copy), then greedy decode through the decode loop (the host
    kernel, the index handed over with the ids). Each form against its own all-GPU run: at f32 on
    a GPU the scanned and unrolled models round apart (1e-3 on this prompt, one token's routing
    near a tie: RESULTS §22x)."""
    from ikjax.placement.host import HostStack
    monkeypatch.setenv("IKJAX_STREAM", stream)
    monkeypatch.setenv("IKJAX_STREAM_MIB", "0.05")  # several runs / rounds a layer
    tokens = (np.arange(STREAM_TOKENS) * 7 + 5) % 1000
    prompt = list(range(3, 30))
    for form in ("scan", "unroll"):
        monkeypatch.setenv("IKJAX_LAYERS", form)
        ref_eng = ikjax.load(tiny6, ctx=512, ubatch=256, dtype="f32")
        ref, ref_toks = ref_eng.logits(tokens), [int(t) for t in ref_eng.generate(prompt, max_tokens=24)]
        del ref_eng
        monkeypatch.delenv("IKJAX_LAYERS")
        monkeypatch.setenv("IKJAX_HOST_LAYERS", form)
        eng = ikjax.load(tiny6, ctx=512, ubatch=256, dtype="f32", ot="exps=CPU", t=4)
        moe = [g for g in eng.weights["groups"] if "gate_exps" in g.tensors]
        if form == "scan":
            assert [(g.first, g.count) for g in moe] == [(1, 5)]
            assert all(isinstance(moe[0].tensors[k], HostStack) for k in ("gate_exps", "up_exps", "down_exps"))
        else:
            assert [(g.first, g.count) for g in moe] == [(i, 1) for i in range(1, 6)]
        _check_host_resident(eng)
        host_moe.stream_stats(reset=True)
        logits = eng.logits(tokens)
        assert ops.selected("moe_experts").startswith("stream:")
        assert host_moe.stream_stats(reset=True)["copied"] > 0
        assert eng.decode_loop()
        toks = [int(t) for t in eng.generate(prompt, max_tokens=24)]
        assert ops.selected("moe_experts") == "host"
        assert rel_err(logits, ref) <= TOL, (form, rel_err(logits, ref))
        assert toks == ref_toks, form
