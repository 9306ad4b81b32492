"""The placement layer (ikjax/placement/): -ot rules (first match wins), --cpu-moe / --n-cpu-moe,
-ngl, the devices present, logical axes of every tensor, ik's op-offload rule, the memory plan it
feeds, and logits unchanged by host placement on CPU (where host and device are one RAM)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

import ikjax
from conftest import fixture_entry, fixtures_dir, load_ref, rel_err
from ikjax.cli import app
from ikjax.errors import OptionError
from ikjax.gguf_io.config import ModelConfig
from ikjax.gguf_io.reader import GGUFModelFile
from ikjax.runtime.memory_plan import plan_memory
from ikjax.options import RunOptions
from ikjax.gguf_io.tensors import is_routed_expert, logical_axes
from ikjax.placement.rules import DEVICE, HOST, TensorPlacement, plan_placement, runs_on
from ikjax.model.groups import layer_tensors

CPU_ONLY = [SimpleNamespace(platform="cpu")]
ONE_GPU = [SimpleNamespace(platform="gpu")]
TWO_GPUS = [SimpleNamespace(platform="gpu"), SimpleNamespace(platform="gpu")]


def _open(path) -> tuple[ModelConfig, GGUFModelFile]:
    f = GGUFModelFile(str(path))
    emb = f.tensors["token_embd.weight"]
    return ModelConfig.from_metadata(f.metadata, source=str(path), vocab_from_tensor=emb.shape[0]), f


@pytest.fixture(scope="module")
def model4(tiny4_model):
    return _open(tiny4_model)


def _place(model, devices=CPU_ONLY, **opts):
    cfg, f = model
    return plan_placement(cfg, f.tensors.values(), RunOptions.from_kwargs(**opts), devices=devices)


# -- rules ----------------------------------------------------------------------------------------

def test_default_everything_on_the_device(model4):
    p = _place(model4)
    assert len(p.tensors) == len(model4[1].tensors)
    assert all(t.memory == DEVICE for t in p.tensors)
    assert p.host_bytes == 0 and p.unified and p.devices == ("CPU",)


def test_first_matching_rule_wins(model4):
    # the first rule keeps layer 1's experts on the device; the second sends every other expert home
    p = _place(model4, devices=ONE_GPU, ot=r"blk\.1\.ffn_.*_exps=CUDA0,exps=CPU")
    for t in p.tensors:
        if is_routed_expert(t.name):
            want = DEVICE if t.layer == 1 else HOST
            assert t.memory == want, t
            assert t.rule == (r"-ot blk\.1\.ffn_.*_exps=CUDA0" if t.layer == 1 else "-ot exps=CPU"), t
        else:
            assert t.memory == DEVICE and t.device == "GPU0" and t.rule == "default", t
    # the reverse order: the broad rule matches first, so the narrow one never applies
    p = _place(model4, devices=ONE_GPU, ot=r"exps=CPU,blk\.1\.ffn_.*_exps=CUDA0")
    assert all(t.memory == HOST for t in p.tensors if is_routed_expert(t.name))


@pytest.mark.parametrize("opts, host_layers", [({"cpu_moe": True}, {1, 2, 3}), ({"n_cpu_moe": 1}, set()),
                                               ({"n_cpu_moe": 2}, {1}), ({"n_cpu_moe": 3}, {1, 2}),
                                               ({"n_cpu_moe": 9}, {1, 2, 3})])
def test_cpu_moe_places_exactly_the_routed_experts(model4, opts, host_layers):
    p = _place(model4, devices=ONE_GPU, **opts)
    host = {t.name for t in p.tensors if t.on_host}
    want = {t.name for t in p.tensors if is_routed_expert(t.name) and t.layer in host_layers}
    assert host == want
    assert len(want) == 3 * len(host_layers)  # gate, up, down of each MoE layer
    # shared experts, router and attention of the same layers stay on the device
    assert all(p[f"blk.1.{n}"].memory == DEVICE for n in ("ffn_gate_shexp.weight", "ffn_gate_inp.weight",
                                                           "attn_kv_b.weight"))


def test_cpu_moe_names_on_r1_scale_layer_numbers():
    """--n-cpu-moe N's regex must not match layer 10..19 for N=2 (blk.1 is a prefix of blk.10)."""
    cfg = SimpleNamespace(n_layer=61, n_nextn=0, n_expert=256, n_expert_used=8)
    names = [(f"blk.{i}.ffn_{w}_exps.weight", (256, 2048, 7168), 1) for i in range(61) for w in ("up", "gate", "down")]
    names += [(f"blk.{i}.ffn_up_shexp.weight", (2048, 7168), 1) for i in range(61)]
    p = plan_placement(cfg, names, RunOptions.from_kwargs(n_cpu_moe=2), devices=ONE_GPU)
    assert {t.name for t in p.tensors if t.on_host} == {f"blk.{i}.ffn_{w}_exps.weight" for i in (0, 1)
                                                         for w in ("up", "gate", "down")}
    o = RunOptions.from_kwargs(cpu_moe=True)
    assert RunOptions.from_kwargs(ot=o.ot, cpu_moe=True).ot == o.ot  # rebuilt options do not grow
    p = plan_placement(cfg, names, o, devices=ONE_GPU)
    assert {t.name for t in p.tensors if t.on_host} == {n for n, _, _ in names if "exps" in n}


def test_ngl_as_llama_cpp(model4):
    """llama.cpp: layers i < n_layer - ngl on the host, the output head on the device only when
    ngl > n_layer; -ot takes precedence."""
    def where(p):
        return {t.name: t.memory for t in p.tensors}

    p = _place(model4, devices=ONE_GPU, ngl=0)
    assert all(t.on_host for t in p.tensors) and p.host_bytes == p.total_bytes
    p = _place(model4, devices=ONE_GPU, ngl=2)
    for t in p.tensors:
        if t.layer is not None:
            assert t.memory == (DEVICE if t.layer >= 2 else HOST), t
            assert t.rule == "-ngl 2"
    w = where(p)
    assert w["output.weight"] == HOST and w["output_norm.weight"] == HOST and w["token_embd.weight"] == DEVICE
    w = where(_place(model4, devices=ONE_GPU, ngl=4))
    assert w["output.weight"] == HOST and w["blk.0.attn_norm.weight"] == DEVICE
    w = where(_place(model4, devices=ONE_GPU, ngl=5))
    assert set(w.values()) == {DEVICE}
    # an -ot rule wins over -ngl both ways
    w = where(_place(model4, devices=ONE_GPU, ngl=0, ot=r"output\.=CUDA0"))
    assert w["output.weight"] == DEVICE and w["blk.3.attn_norm.weight"] == HOST
    w = where(_place(model4, devices=ONE_GPU, ngl=99, ot=r"blk\.0\.=CPU"))
    assert {n for n, m in w.items() if m == HOST} == {n for n in w if n.startswith("blk.0.")}


def test_ngl_counts_the_mtp_layers_as_ik_does(model4):
    """ik's -ngl counts block_count, a trailing MTP (nextn) layer included: the last ngl blocks on the
    device, the head only past all of them. Counted over the layers run, -ngl N put N + 1 blocks on
    the device and -ngl block_count the head too (an outside review, stop 68; GLM-4.7-Flash, V3 with
    its MTP layer). The 4-block file read as 3 layers run and one MTP block (blk.3)."""
    import dataclasses
    cfg, f = model4
    mtp = (dataclasses.replace(cfg, n_layer=3, n_nextn=1), f)

    def device_blocks(p):
        return {t.layer for t in p.tensors if t.layer is not None and t.memory == DEVICE}

    def head(p):
        return next(t.memory for t in p.tensors if t.name == "output.weight")
    p = _place(mtp, devices=ONE_GPU, ngl=2)
    assert device_blocks(p) == {2, 3} and head(p) == HOST
    p = _place(mtp, devices=ONE_GPU, ngl=4)
    assert device_blocks(p) == {0, 1, 2, 3} and head(p) == HOST
    assert head(_place(mtp, devices=ONE_GPU, ngl=5)) == DEVICE


# -- devices --------------------------------------------------------------------------------------

def test_ot_devices_that_do_not_exist_are_refused(model4):
    with pytest.raises(OptionError, match=r"^ot: 'exps=CUDA1' names accelerator 1, but this machine has 1 "
                                          r"\(GPU0; use CUDA0 or CPU\)$"):
        _place(model4, devices=ONE_GPU, ot="exps=CUDA1")
    with pytest.raises(OptionError, match=r"has 2 \(GPU0, GPU1; use CUDA0..CUDA1 or CPU\)$"):
        _place(model4, devices=TWO_GPUS, ot="attn=GPU2")
    with pytest.raises(OptionError, match="no accelerator"):
        _place(model4, devices=CPU_ONLY, ot="exps=GPU1")
    # -sm none runs on one device (-mg): a rule naming another is refused, not planned there and
    # loaded elsewhere (an outside probe: the plan said CPU2, the weights sat on the main device)
    with pytest.raises(OptionError, match=r"^ot: 'exps=CUDA1' names GPU1, but with -sm none the model runs on one "
                                          r"device, GPU0 \(-mg 0\)"):
        _place(model4, devices=TWO_GPUS, ot="exps=CUDA1,attn=CPU")
    p = _place(model4, devices=TWO_GPUS, ot="exps=CUDA1,attn=CPU", main_gpu=1)
    assert p.devices == ("GPU0", "GPU1")
    assert {t.device for t in p.tensors if "exps" in t.name} == {"GPU1"}
    assert all(t.device == "CPU" and t.on_host for t in p.tensors if "attn" in t.name)
    by_dev = p.device_bytes()
    assert by_dev["GPU1"] == sum(t.nbytes for t in p.tensors if not t.on_host)  # -mg 1: the one device
    assert sum(by_dev.values()) + p.host_bytes == p.total_bytes


def test_gpu_target_on_a_cpu_only_machine_is_the_cpu_with_a_note(model4):
    p = _place(model4, devices=CPU_ONLY, ngl=0, ot="exps=CUDA0")
    assert all(t.memory == DEVICE and t.device == "CPU" for t in p.tensors if "exps" in t.name)
    assert len(p.notes) == 2 and all("no accelerator here" in n for n in p.notes)
    assert "exps=CUDA0" in p.notes[0] and p.notes[1].startswith("-ngl 0 has no effect")
    assert _place(model4, devices=CPU_ONLY, ot="exps=CPU").notes == ()
    # -ngl on a CPU-only machine: a note, as for the other accelerator options (an outside probe found none);
    # the default and any count of every layer say nothing
    assert [n.split(":")[0] for n in _place(model4, devices=CPU_ONLY, ngl=2).notes] == ["-ngl 2 has no effect"]
    assert _place(model4, devices=CPU_ONLY, ngl=4).notes == () == _place(model4, devices=CPU_ONLY, ngl=99).notes


HOST_NON_EXPERTS = r"blk\.1\.attn=CPU,blk\.2\.ffn_norm=CPU,blk\.0\.ffn_(gate|up)=CPU,_shexp=CPU,token_embd=CPU,output=CPU"


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_host_placed_non_experts_next_to_an_accelerator(model4, tiny4_model, backend, monkeypatch):
    """Any tensor may stay in host memory next to an accelerator (deliverable 5): the loader builds
    it on the host CPU (no stacking with device parts; the kernel layout made there), holds it in
    the stage device's pinned host memory as a HostTensor, and the step moves it to the device
    where it reads it: the same logits as every tensor on the device. Here the "accelerator" is
    the CPU device itself (it has a pinned_host memory too); tests/test_hybrid_gpu.py runs it on a GPU."""
    import jax
    from ikjax.placement.host import HostTensor
    from ikjax.model.weights import load_weights, placer_for
    monkeypatch.setenv("IKJAX_KERNELS", backend)
    cfg, f = model4
    p = _place(model4, devices=ONE_GPU, ot=HOST_NON_EXPERTS)
    host_names = {t.name for t in p.tensors if t.on_host}
    assert "blk.1.attn_norm.weight" in host_names and "token_embd.weight" in host_names
    assert not any(is_routed_expert(n) for n in host_names)
    base = placer_for(p)  # no refusal: non-expert host tensors need no CUDA handler
    dev = jax.devices()[0]

    def place(name, data):  # the device-placed ones onto this machine's only device
        return base(name, data) if p[name].on_host else jax.device_put(data, dev)

    place.host_device = lambda name: dev
    w = load_weights(f, cfg, place=place, placement=p)
    assert isinstance(w["token_embd"], HostTensor) and isinstance(layer_tensors(w, 1)["attn_norm"], HostTensor)
    assert isinstance(layer_tensors(w, 2)["ffn_norm"], HostTensor) and not isinstance(layer_tensors(w, 2)["attn_norm"], HostTensor)
    kinds = {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(layer_tensors(w, 1)["attn_norm"])}
    assert kinds == {"pinned_host"}
    # a layer with host parts is not stacked; the others are, as on one device
    assert "ffn_gate_up" not in layer_tensors(w, 0) and isinstance(layer_tensors(w, 0)["ffn_gate"], HostTensor)
    assert "attn_in" not in layer_tensors(w, 1) and isinstance(layer_tensors(w, 1)["kv_a_mqa"], HostTensor)
    eng = ikjax.load(tiny4_model, ctx=64, dtype="f32")
    tokens = [3, 17, 5, 9, 100, 2, 44]
    want = eng.logits(tokens)
    eng.weights = w
    eng.spans = tuple((g.first, g.count) for g in w["groups"])  # its layer groups, as loaded
    eng._cache_specs.clear()
    eng._executables.clear()
    eng._compiled.clear()
    got = eng.logits(tokens)
    # not bit for bit: the layers with host parts are not stacked, so XLA fuses and sums them in
    # another order (on an AVX-512 host 9e-5 of the largest logit at worst)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_accelerator_loader_keeps_host_experts_in_place(model4, monkeypatch):
    """Host-placed routed experts stay the memory map's bytes (the very array, no copy) with
    IKJAX_HOST_EXPERTS=mmap where the CUDA host-experts handler is built (the default, pinned, copies
    them into an accelerator's pinned memory: tests/test_hybrid_gpu.py); without the handler the
    loader says how to build it."""
    from ikjax.model.weights import placer_for
    from pallas_kernels.moe_matmul import host as host_moe
    p = _place(model4, devices=ONE_GPU, ot="exps=CPU")
    if not host_moe.available():
        with pytest.raises(OptionError, match=r"^ot: blk\.\d+\.ffn_\w+_exps\.weight is placed in host memory "
                                              r"\(-ot exps=CPU\), but the CUDA host-experts handler is not built"):
            placer_for(p)
        return
    monkeypatch.setenv("IKJAX_HOST_EXPERTS", "mmap")
    data = np.zeros(64, np.uint8)
    assert placer_for(p)("blk.1.ffn_up_exps.weight", data) is data


def test_load_refuses_an_absent_device_in_one_line(tiny_model):
    with pytest.raises(OptionError) as e:
        ikjax.load(tiny_model, ctx=64, ubatch=16, ot="exps=CUDA3")
    assert "\n" not in str(e.value) and "CUDA3" in str(e.value)


# -- logical axes ---------------------------------------------------------------------------------

def _axes_complete(cfg, f):
    p = plan_placement(cfg, f.tensors.values(), RunOptions(), devices=CPU_ONLY)
    for t in p.tensors:
        info = f.tensors[t.name]
        assert t.axes is not None and len(t.axes) == len(info.shape), (t.name, t.axes, info.shape)
        assert None not in t.axes, (t.name, t.axes)
    return p


def test_logical_axes_for_every_tensor(model4):
    p = _axes_complete(*model4)
    cfg = model4[0]
    assert p["blk.1.ffn_gate_exps.weight"].axes == ("expert", "ffn", "embed")
    assert p["blk.1.ffn_down_exps.weight"].axes == ("expert", "embed", "ffn")
    assert p["token_embd.weight"].axes == ("vocab", "embed") and p["output.weight"].axes == ("vocab", "embed")
    assert p["blk.0.attn_output.weight"].axes == ("embed", "heads")
    # the "expert" axis is the experts' dimension and "vocab" the vocabulary's, in the NumPy shape
    shape = model4[1].tensors["blk.1.ffn_up_exps.weight"].shape
    assert shape[p["blk.1.ffn_up_exps.weight"].axes.index("expert")] == cfg.n_expert
    assert model4[1].tensors["output.weight"].shape[0] == cfg.vocab_size
    # a tensor the graph does not read (e.g. the MTP block) is recorded, unsplit
    assert logical_axes("blk.61.nextn.eh_proj.weight", 2) == (None, None)
    assert logical_axes("blk.0.attn_k_b.weight", 3) == ("heads", "kv_lora", "head_dim")


@pytest.mark.parametrize("name", ["v3tiny-mainline-Q8_0.gguf", "v2lite_tiny-kvb-Q5_1.gguf", "v3tiny-all-Q4_0.gguf"])
def test_logical_axes_on_converter_files(name):
    _axes_complete(*_open(fixtures_dir() / name))


# -- where ops run --------------------------------------------------------------------------------

def _t(name, memory):
    return TensorPlacement(name, memory, "CPU" if memory == HOST else "GPU0", 1, None, 1, "test")


def test_runs_on_follows_ik_offload_rule():
    exps = [_t("blk.1.ffn_up_exps.weight", HOST), _t("blk.1.ffn_gate_exps.weight", HOST)]
    kw = dict(n_expert=256, n_expert_used=8)
    # routed experts on the host: the device only from batch * 8 >= 32 * 256, i.e. 1024 tokens
    assert runs_on(exps, 1, **kw) == HOST
    assert runs_on(exps, 1023, **kw) == HOST
    assert runs_on(exps, 1024, **kw) == DEVICE
    assert runs_on(exps, 512, min_batch=16, **kw) == DEVICE  # the threshold is configurable
    # other host matrices: the device from 32 tokens
    dense = [_t("blk.0.ffn_up.weight", HOST)]
    assert runs_on(dense, 31, **kw) == HOST and runs_on(dense, 32, **kw) == DEVICE
    # an embedding gather on the host stays there at any batch; device weights run on the device
    assert runs_on([_t("token_embd.weight", HOST)], 4096, **kw) == HOST
    assert runs_on([_t("blk.0.ffn_up.weight", DEVICE)], 1, **kw) == DEVICE
    # mixed: the host-resident part decides
    assert runs_on([_t("blk.0.attn_q.weight", DEVICE), dense[0]], 8, **kw) == HOST
    with pytest.raises(ValueError):
        runs_on(dense, 0)


def test_placement_runs_on_uses_the_model(model4):
    cfg = model4[0]
    p = _place(model4, devices=ONE_GPU, cpu_moe=True)
    names = ["blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"]
    at = -(-32 * cfg.n_expert // cfg.n_expert_used)
    assert p.runs_on(names, at - 1) == HOST and p.runs_on(names, at) == DEVICE
    assert p.runs_on(["blk.1.attn_q.weight"], 1) == DEVICE


# -- memory plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [{}, {"ot": "exps=CPU"}, {"n_cpu_moe": 2}, {"ngl": 1}, {"ngl": 0}])
def test_memory_plan_split_sums_to_the_file(model4, opts):
    cfg, f = model4
    p = _place(model4, **opts)
    plan = plan_memory(cfg, RunOptions.from_kwargs(**opts), placement=p)
    total = sum(t.nbytes for t in f.tensors.values())
    assert plan.weights_bytes == total
    assert plan.host_weights_bytes + sum(n for _, n in plan.device_weights) == total
    want_host = sum(t.nbytes for t in f.tensors.values()
                    if ("ngl" in opts and opts["ngl"] == 0)
                    or (opts.get("ot") and "_exps" in t.name)
                    or (opts.get("n_cpu_moe") and re.match(r"blk\.[01]\.ffn_.*_exps", t.name))
                    or (opts.get("ngl") == 1 and t.name.startswith(("blk.0.", "blk.1.", "blk.2.", "output"))))
    assert plan.host_weights_bytes == want_host
    # the same plan from names and sizes alone (what `ikjax info` makes)
    again = plan_memory(cfg, RunOptions.from_kwargs(**opts), ((t.name, t.nbytes) for t in f.tensors.values()))
    assert again.lines() == plan.lines()


def test_info_shows_host_and_device_weights(tiny_model):
    res = CliRunner().invoke(app, ["info", tiny_model, "-ot", "exps=CPU"])
    assert res.exit_code == 0, res.stdout + res.stderr
    cfg, f = _open(tiny_model)
    host = sum(t.nbytes for t in f.tensors.values() if "_exps" in t.name)
    dev = sum(t.nbytes for t in f.tensors.values()) - host
    assert re.search(rf"on host\s+{host / (1 << 20):.2f} MiB \(no accelerator here", res.stdout), res.stdout
    assert re.search(rf"on device CPU\s+{dev / (1 << 20):.2f} MiB", res.stdout), res.stdout


def test_engine_plan_reads_its_placement(tiny_model):
    eng = ikjax.load(tiny_model, ctx=64, ubatch=16, n_cpu_moe=2)
    assert eng.placement.host_bytes > 0
    assert {t.name for t in eng.placement.tensors if t.on_host} == \
        {t.name for t in eng.placement.tensors if is_routed_expert(t.name)}
    assert eng.memory_plan().host_weights_bytes == eng.placement.host_bytes


# -- logits unchanged by host placement (CPU: one memory) ------------------------------------------

def _logits(path, tokens, **opts):
    return ikjax.load(path, ctx=128, ubatch=32, ctk="f32", **opts).logits(tokens)


def test_host_placement_keeps_logits_tiny(tiny_model):
    tokens = np.arange(1, 20) * 7 % 200
    plain = _logits(tiny_model, tokens)
    for opts in ({"ot": "exps=CPU"}, {"n_cpu_moe": 1}, {"cpu_moe": True}, {"ngl": 0}):
        got = _logits(tiny_model, tokens, **opts)
        np.testing.assert_array_equal(got, plain, err_msg=str(opts))


@pytest.mark.parametrize("name", ["v3tiny-mainline-Q8_0.gguf", "v2lite_tiny-kvb-Q5_1.gguf"])
def test_host_placement_keeps_logits_fixtures(name):
    entry = fixture_entry(name)
    tokens, ref = load_ref(entry)
    path = fixtures_dir() / name
    plain = _logits(path, tokens[:48])
    for opts in ({"ot": "exps=CPU"}, {"n_cpu_moe": 1}):
        np.testing.assert_array_equal(_logits(path, tokens[:48], **opts), plain, err_msg=f"{name} {opts}")
    assert rel_err(plain, ref[:48]) <= entry["tol"]


def test_memory_plan_counts_the_stream_buffer(model4, monkeypatch):
    """Next to an accelerator, host experts streamed by big prompt steps take device memory: one
    round (IKJAX_STREAM_MIB of blocks, capped at a layer) twice (as stored + kernel layout) with
    IKJAX_STREAM=active, IKJAX_STREAM_AHEAD runs of experts twice with =chunks (and =auto, the
    default, at these batches unless --gpu-experts holds hot experts), two layers twice with =layer
    where they fit; none below ik's threshold or on a CPU."""
    cfg, f = model4
    layer = max(sum(t.nbytes for n, t in f.tensors.items() if n.startswith(f"blk.{i}.") and "_exps" in n)
                for i in range(cfg.n_layer))
    per_expert = layer // cfg.n_expert

    def plan(ub, devices=ONE_GPU, **kw):
        o = RunOptions.from_kwargs(ot="exps=CPU", ubatch=ub, **kw)
        return plan_memory(cfg, o, placement=_place(model4, devices=devices, ot="exps=CPU", ubatch=ub))

    big = 32 * cfg.n_expert // cfg.n_expert_used  # ik's rule: the smallest batch that streams
    # auto: 32 picks an expert, every expert by runs; all of this tiny layer fits one run, two held
    assert plan(big).stream_buffer_bytes == 2 * 2 * layer
    assert plan(big, gpu_experts="2").stream_buffer_bytes == 2 * layer  # hot experts: the rest, by round
    assert cfg.n_expert % 2 == 0
    monkeypatch.setenv("IKJAX_STREAM_MIB", str(2 * per_expert / 2**20))
    assert plan(big).stream_buffer_bytes == 2 * 2 * 2 * per_expert  # runs of 2 experts, two held
    monkeypatch.setenv("IKJAX_STREAM_AHEAD", "3")
    assert plan(big).stream_buffer_bytes == 2 * 3 * 2 * per_expert
    monkeypatch.delenv("IKJAX_STREAM_AHEAD")
    monkeypatch.setenv("IKJAX_STREAM", "layer")
    assert plan(big).stream_buffer_bytes == 4 * layer
    # the engine's fallback where two whole layers do not fit the device: runs of experts
    assert plan_memory(cfg, RunOptions.from_kwargs(ot="exps=CPU", ubatch=big), stream_whole=False,
                       placement=_place(model4, devices=ONE_GPU, ot="exps=CPU", ubatch=big)
                       ).stream_buffer_bytes == 2 * 2 * 2 * per_expert
    monkeypatch.delenv("IKJAX_STREAM_MIB")
    monkeypatch.setenv("IKJAX_STREAM", "active")
    assert plan(big).stream_buffer_bytes == 2 * layer
    assert plan(big - 1).stream_buffer_bytes == 0 and plan(big, CPU_ONLY).stream_buffer_bytes == 0
    monkeypatch.setenv("IKJAX_STREAM_MIB", str(3 * per_expert / 2**20))
    p = plan(big)
    assert p.stream_buffer_bytes == 2 * 3 * per_expert and any("stream buffer" in l for l in p.lines())
    assert p.device_bytes - plan(big - 1).device_bytes == p.stream_buffer_bytes + (
        p.attention_buffer_bytes - plan(big - 1).attention_buffer_bytes)
    monkeypatch.setenv("IKJAX_STREAM", "layer")
    assert plan(big).stream_buffer_bytes == 4 * layer


def test_memory_plan_counts_host_non_experts_in_flight(model4):
    """Host-placed non-expert tensors cross to the device each step: the plan holds the largest
    layer's (or the top-level tensors') worth on the device at a time, for any batch size."""
    cfg, f = model4
    p = _place(model4, devices=ONE_GPU, ot=r"blk\.1\.attn=CPU,blk\.2\.=CPU")
    plan = plan_memory(cfg, RunOptions.from_kwargs(ubatch=1), placement=p)
    layer2 = sum(t.nbytes for n, t in f.tensors.items() if n.startswith("blk.2.") and not is_routed_expert(n))
    assert plan.stream_buffer_bytes == layer2  # layer 2's non-experts (its experts run on the host at ubatch 1)
    assert plan_memory(cfg, RunOptions.from_kwargs(ubatch=1), placement=_place(model4, ot=r"blk\.2\.=CPU")
                       ).stream_buffer_bytes == 0  # a CPU-only machine: one RAM


def test_ot_rules_as_ik_reads_them_and_notes_for_rules_that_do_nothing(model4):
    """-ot splits a rule at its first "=" (ik: `exps=CPU=CPU` names the device "CPU=CPU"), refuses an
    empty regex, and a rule that matches no tensor, or only tensors an earlier rule took, gets a note
    (an outside probe: both passed silently). -mg under -sm layer gets a note too; -ts shares whose
    sum overflows are refused (they put every layer on the last device)."""
    with pytest.raises(OptionError, match=r"unknown device 'CPU=CPU'"):
        _place(model4, ot="exps=CPU=CPU")
    with pytest.raises(OptionError, match=r"^ot: empty regex in '=CPU'"):
        _place(model4, ot="=CPU")
    p = _place(model4, ot="nomatch=CPU,exps=CPU,ffn_.*_exps=CPU")
    assert "-ot nomatch=CPU: matches no tensor of this file" in p.notes
    assert "-ot ffn_.*_exps=CPU: every tensor it matches is taken by an earlier rule" in p.notes
    assert not [n for n in p.notes if n.startswith("-ot exps=CPU")]
    p = _place(model4, devices=TWO_GPUS, split_mode="layer", main_gpu=1)
    assert any(n.startswith("-mg 1 has no effect with -sm layer") for n in p.notes), p.notes
    with pytest.raises(OptionError, match=r"^ts: shares .* do not add up to a finite number"):
        _place(model4, devices=TWO_GPUS, split_mode="layer", tensor_split="1e308,1e308")
