"""Expert statistics (issue 24): tokens each MoE layer routes to each expert, over every step."""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

import ikjax
from ikjax.errors import OptionError


def _stats(path, monkeypatch, mode, **kw):
    monkeypatch.setenv("IKJAX_LAYERS", mode)
    eng = ikjax.load(path, ctx=256, ubatch=32, expert_stats=True, **kw)
    toks = list(eng.generate(np.arange(2, 22), 5))
    return eng, toks, eng.expert_stats()


def test_counts_every_fed_token_once_per_pick(tiny4_model, monkeypatch, tmp_path):
    eng, _, st = _stats(tiny4_model, monkeypatch, "auto")
    cfg = eng.config
    # the 20 prompt tokens (not the 12 rows padding their 32-token step) and the 4 tokens fed back
    assert st["tokens"] == 20 + 4
    moe_layers = [i for i in range(cfg.n_layer) if cfg.is_moe_layer(i)]
    assert sorted(int(k) for k in st["layers"]) == moe_layers
    for counts in st["layers"].values():
        assert len(counts) == cfg.n_expert and sum(counts) == st["tokens"] * cfg.n_expert_used
        assert max(counts) < st["tokens"]  # an expert is picked once per token at most
    # scanned or unrolled layers: the same counts
    _, _, st2 = _stats(tiny4_model, monkeypatch, "unroll")
    assert st2 == st
    eng.save_expert_stats(tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == st
    # a second run adds to the counts
    list(eng.generate(np.arange(2, 22), 5))
    st3 = eng.expert_stats()
    assert st3["tokens"] == 2 * st["tokens"]
    assert all(np.array_equal(np.array(st3["layers"][k]), 2 * np.array(v)) for k, v in st["layers"].items())


def test_dropped_picks_are_not_counted(tiny4_model, monkeypatch):
    """-ser drops picks (weight 0): they route no token to their expert."""
    eng, _, st = _stats(tiny4_model, monkeypatch, "auto", ser="1,1.0")
    total = sum(sum(v) for v in st["layers"].values())
    n_layers = len(st["layers"])
    assert n_layers * st["tokens"] <= total < n_layers * st["tokens"] * eng.config.n_expert_used


def test_asked_without_counting_is_one_line(tiny4_model):
    eng = ikjax.load(tiny4_model, ctx=128)
    with pytest.raises(OptionError, match="expert_stats=True"):
        eng.expert_stats()


def test_cli_writes_the_file_at_the_end(tiny4_model, tmp_path):
    import subprocess
    import sys
    out = tmp_path / "stats" / "e.json"
    cmd = [sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hi", "-n", "1", "--expert-stats", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)  # a directory that does not exist: refused, not made
    assert r.returncode == 1 and "does not exist" in r.stderr.strip().splitlines()[-1] and not out.parent.exists()
    out.parent.mkdir()
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hello there", "-n", "4",
                        "--temp", "0", "-c", "128", "--expert-stats", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(out.read_text())
    assert st["tokens"] > 4 and all(sum(v) == st["tokens"] * 4 for v in st["layers"].values())
    assert f"-> {out}" in r.stderr
    # a run that feeds nothing keeps the earlier profile (it was wiped to {"tokens": 0})
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hi", "-n", "0",
                        "--expert-stats", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(out.read_text()) == st and "kept as it was" in r.stderr
    # an empty path is refused (it was silently off)
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hi", "-n", "1",
                        "--expert-stats", ""], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "error: expert-stats: empty path (give a file name)"


def test_bench_counts_its_timed_runs(tiny4_model, tmp_path):
    """bench --expert-stats: the timed runs' tokens of every test (pp16 twice, tg4 twice: each
    generated token fed once), not the warm-ups'; --gpu-experts without statistics is refused
    (it was ignored)."""
    import subprocess
    import sys
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "bench", "-m", tiny4_model, "-p", "16", "-n", "4", "-r", "2",
                        "--expert-stats", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(out.read_text())
    assert st["tokens"] == 2 * 16 + 2 * 4, st["tokens"]
    assert all(sum(v) == st["tokens"] * 4 for v in st["layers"].values())
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "bench", "-m", tiny4_model, "-p", "16", "-n", "0", "-r", "1",
                        "--gpu-experts", "2"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: gpu-experts: needs expert statistics")


def test_padding_and_finished_rows_are_not_counted(tiny4_model, tmp_path):
    """generate_batch pads its batch to a power of two and keeps finished rows in it; perplexity
    pads its last group of chunks with copies: none of those rows is counted (a probe counted 25
    tokens for 21, and 1024 for perplexity's 640)."""
    from ikjax.runtime.perplexity import perplexity
    for loop in (True, False):
        eng = ikjax.load(tiny4_model, ctx=128, ubatch=32, expert_stats=True)
        if not loop:
            eng.decode_loop = lambda: False
        prompts = [list(range(3, 10)), list(range(5, 9)), list(range(2, 14))]
        out = eng.generate_batch(prompts, 5)
        fed = sum(len(p) for p in prompts) + sum(max(len(o) - 1, 0) for o in out)
        assert eng.expert_stats()["tokens"] == fed, (loop, eng.expert_stats()["tokens"], fed)
    eng = ikjax.load(tiny4_model, ctx=64, ubatch=256, batch=256, expert_stats=True)
    ids = (np.arange(64 * 5) * 7 + 3) % 1000
    perplexity(eng, ids, 64)  # 4 chunks a step: the second step holds 1 real chunk and 3 copies
    st = eng.expert_stats()
    assert st["tokens"] == 5 * 64, st["tokens"]
    assert all(sum(v) == st["tokens"] * 4 for v in st["layers"].values())


def test_stats_files_are_checked(tiny4_model, tmp_path):
    """The API never writes statistics over a file that is not an earlier run's (it replaced the
    loaded GGUF); --gpu-experts refuses counts of a layer that is not one of the model's MoE
    layers, JSON booleans as counts, and non-ASCII digits."""
    import shutil
    model = tmp_path / "m.gguf"
    shutil.copy(tiny4_model, model)
    eng = ikjax.load(str(model), ctx=128, expert_stats=True)
    with pytest.raises(OptionError, match="is not an expert-stats file"):
        eng.save_expert_stats(model)
    ikjax.load(str(model), ctx=128)  # still the model
    good = {"tokens": 1, "layers": {str(i): [1, 1, 1, 1] + [0] * 12 for i in (1, 2, 3)}}
    for bad, why in (({**good, "layers": {**good["layers"], "7": [0] * 16}}, "not a MoE layer"),
                     ({**good, "layers": {**good["layers"], "0": [0] * 16}}, "not a MoE layer"),
                     ({**good, "layers": {"1": [True] + [0] * 15}}, "token counts"),
                     ({**good, "layers": {"\u00b2": [0] * 16}}, "token counts")):
        f = tmp_path / "bad.json"
        f.write_text(json.dumps(bad))
        with pytest.raises(OptionError, match=why):
            ikjax.load(tiny4_model, ctx=128, ot="exps=CPU", gpu_experts="1", expert_counts=str(f))
    with pytest.raises(OptionError, match="gpu-experts: expected auto"):
        ikjax.load(tiny4_model, ctx=128, ot="exps=CPU", gpu_experts="\u0663")


def test_split_modes_count_alike(tiny4_model):
    """-sm graph (every device routes alike: counted once) and -sm layer give the one-device counts
    (two fake CPU devices, in a process of their own)."""
    import subprocess
    import sys
    from conftest import TEST_XLA_FLAGS
    code = (f"import os\nos.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}'\n"
            "import json, numpy as np, ikjax\nres = {}\n"
            "for sm in ('none', 'graph', 'layer'):\n"
            f"    eng = ikjax.load({tiny4_model!r}, ctx=128, ubatch=32, expert_stats=True, split_mode=sm)\n"
            "    list(eng.generate(np.arange(2, 22), 4))\n    res[sm] = eng.expert_stats()\n"
            "print(json.dumps(res))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["none"]["tokens"] == 20 + 3
    assert res["graph"] == res["none"] and res["layer"] == res["none"]


def test_gpu_experts_split_the_picks_and_change_nothing(tiny4_model, tmp_path):
    """--gpu-experts: the top experts of each host-resident layer get a second copy (on a GPU; on
    this CPU-only machine a second set in RAM), each routed pick runs on exactly one side, and
    the logits are the run's without them (f32: the two partial sums only reassociate)."""
    from ikjax.placement import hot
    stats = tmp_path / "stats.json"
    base = ikjax.load(tiny4_model, ctx=256, ubatch=32, ot="exps=CPU", expert_stats=True, dtype="f32")
    ids = np.arange(2, 40)
    want = base.logits(ids)
    base.save_expert_stats(stats)
    counts = hot.read_counts(str(stats), base.config.n_expert)
    eng = ikjax.load(tiny4_model, ctx=256, ubatch=32, ot="exps=CPU", dtype="f32", gpu_experts="2",
                     expert_counts=str(stats))
    chosen = dict(eng.placement.hot_experts)
    assert sorted(chosen) == sorted(counts)  # every MoE layer (all host-resident)
    for i, e in chosen.items():
        assert len(e) == 2 and set(e) == set(np.argsort(-counts[i], kind="stable")[:2].tolist())
    assert eng.gpu_experts_note.startswith(f"gpu experts: {2 * len(chosen)} of ")  # what the CLI prints
    got = eng.logits(ids)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the split really ran: the layers carry the copies and their slot map
    from ikjax.model.groups import layer_tensors
    layer = layer_tensors(eng.weights, max(chosen))
    assert "hot_experts" in layer and int((np.asarray(layer["hot_experts"]["slot"]) >= 0).sum()) == 2


def test_gpu_experts_budget_and_refusals(tiny4_model, tmp_path):
    from ikjax.placement import hot
    counts = {3: np.array([5, 0, 9, 1]), 4: np.array([1, 1, 1, 40])}
    # budget: the pairs with the largest share of their layer first, while their bytes fit
    assert hot.choose(counts, [3, 4], {3: 10, 4: 10}, budget=25) == {3: (2,), 4: (3,)}
    assert hot.choose(counts, [3, 4], {3: 10, 4: 10}, per_layer=3) == {3: (0, 2, 3), 4: (0, 1, 3)}
    assert hot.coverage(counts, {4: (3,)}) == pytest.approx(40 / 58)
    with pytest.raises(OptionError, match="no routed experts are in host memory"):
        ikjax.load(tiny4_model, ctx=256, gpu_experts="2", expert_counts=str(tmp_path / "x.json"))
    with pytest.raises(OptionError, match="needs expert statistics"):
        ikjax.load(tiny4_model, ctx=256, ot="exps=CPU", gpu_experts="auto")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tokens": 3, "layers": {"1": [1, 2]}}))
    with pytest.raises(OptionError, match="token counts"):
        ikjax.load(tiny4_model, ctx=256, ot="exps=CPU", gpu_experts="1", expert_counts=str(bad))
    with pytest.raises(OptionError, match="gpu-experts: expected auto"):
        ikjax.load(tiny4_model, ctx=256, ot="exps=CPU", gpu_experts="many")
    # a machine with two GPUs and -sm none runs on one of them: not refused for the GPUs present
    # (it was, on a 2-GPU lease); a split over them is
    from ikjax.placement.rules import Placement
    two = Placement(tensors=(), devices=("GPU0", "GPU1"), unified=False)
    with pytest.raises(OptionError, match="no routed experts are in host memory"):
        hot.plan(two, 4, {}, "2", "", None)
    with pytest.raises(OptionError, match="one GPU only for now .*-sm layer"):
        hot.plan(dataclasses.replace(two, split_mode="layer"), 4, {}, "2", "", None)


def test_cli_gpu_experts_reads_then_adds_to_the_file(tiny4_model, tmp_path):
    """`--gpu-experts N --expert-stats F`: the placement comes from F's counts (the CLI prints
    what it kept), and at the end F holds F's counts plus this run's; without F's statistics the
    command ends with one error line."""
    import subprocess
    import sys
    f = tmp_path / "e.json"
    gen = [sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hello there", "-n", "4",
           "--temp", "0", "-c", "128", "-ot", "exps=CPU", "--expert-stats", str(f)]
    r = subprocess.run(gen, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    first = json.loads(f.read_text())
    r = subprocess.run(gen + ["--gpu-experts", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gpu experts: 6 of 48 host-resident experts" in r.stderr  # 2 in each of the 3 MoE layers
    both = json.loads(f.read_text())
    assert both["tokens"] == 2 * first["tokens"]  # the same prompt, 4 tokens each: twice the tokens
    assert all(sum(v) == both["tokens"] * 4 for v in both["layers"].values())
    assert all(all(b >= a for a, b in zip(v, both["layers"][k])) for k, v in first["layers"].items())
    missing = tmp_path / "none.json"
    r = subprocess.run(gen[:-1] + [str(missing), "--gpu-experts", "2"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: gpu-experts: no expert statistics")


def test_idle_rows_route_to_no_expert(tiny4_model):
    """The server's free slots in a decode batch (Engine.step's last -1, Engine.decode's idle):
    their rows write a throw-away KV entry but pick no expert (with experts in host RAM every
    pick is bytes read from RAM: an idle slot made a one-stream decode read 8 slots' experts),
    and the live rows compute what they compute in a full batch."""
    eng = ikjax.load(tiny4_model, ctx=128, ubatch=32, expert_stats=True)
    cfg = eng.config
    toks = np.array([[5], [7], [9], [11]], np.int32)
    start = np.array([3, 0, 6, 2], np.int32)
    full, _ = eng.step(eng.new_cache(4), toks, start)
    before = eng.expert_stats()
    some, _ = eng.step(eng.new_cache(4), toks, start, np.array([0, -1, 0, -1]))
    after = eng.expert_stats()
    np.testing.assert_array_equal(np.asarray(some)[[0, 2]], np.asarray(full)[[0, 2]])
    assert after["tokens"] - before["tokens"] == 2
    for k, v in after["layers"].items():
        assert sum(v) - sum(before["layers"][k]) == 2 * cfg.n_expert_used
    # the decode loop: idle rows stay -1, the live ones make the tokens a loop without them makes
    want, _ = eng.decode(eng.new_cache(4), toks[:, 0], start, 5)
    before = eng.expert_stats()
    got, _ = eng.decode(eng.new_cache(4), toks[:, 0], start, 5, idle=np.array([False, True, False, True]))
    after = eng.expert_stats()
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])
    assert (got[[1, 3]] == -1).all()
    assert after["tokens"] - before["tokens"] == 2 * 5
    with pytest.raises(OptionError, match="idle"):
        eng.step(eng.new_cache(4), toks, start, np.array([0, -2, 0, 0]))


def test_one_host_call_a_step(tiny4_model, monkeypatch):
    """The MoE layers' counts are made on the device and handed to the host once a step (each
    layer's own callback stalled the device's stream: 25 % of a host-experts R1 decode, RESULTS
    §24e): one call for a prompt step, one a dispatch of the decode loop (its steps' counts summed
    on the device), every MoE layer in it (the scanned group's from the scan's outputs)."""
    from ikjax.model.moe import ExpertCounts
    calls = []
    record = ExpertCounts.record_counts

    def spy(self, layers, counts, n_valid):
        calls.append(sorted(np.asarray(layers).reshape(-1).tolist()))
        return record(self, layers, counts, n_valid)
    monkeypatch.setattr(ExpertCounts, "record_counts", spy)
    eng = ikjax.load(tiny4_model, ctx=128, ubatch=64, expert_stats=True)
    moe_layers = [i for i in range(eng.config.n_layer) if eng.config.is_moe_layer(i)]
    assert len(moe_layers) > 1
    eng.logits(list(range(2, 14)))
    assert calls == [moe_layers], calls
    calls.clear()
    list(eng.generate(list(range(2, 14)), 9))
    # the decode loop sums its steps' counts and calls once a dispatch: fewer calls than tokens
    assert calls and all(c == moe_layers for c in calls), calls
    assert len(calls) < 9 or not eng.decode_loop(), calls


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_stopped_run_still_writes_its_counts(tiny4_model, tmp_path, sig):
    """Ctrl-C (status 130, "error: interrupted") and SIGTERM (a death by the signal) in the middle
    of a generation: the file holds what was counted so far (both lost it: the exits skip atexit)."""
    import signal
    import subprocess
    import sys
    import threading
    import time
    out = tmp_path / "s.json"
    # an xdist worker ignores SIGINT, which a child inherits (Python then installs no KeyboardInterrupt):
    # the child starts with SIGINT's default, as a terminal's Ctrl-C finds it (test_surfaces does the same)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "ikjax.cli", "generate", "-m", tiny4_model, "-p", "hello", "-n",
                              "4000", "-c", "4096", "--ignore-eos", "--temp", "0", "--expert-stats", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, old)
    got = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: p.stdout.read(1), b"")), daemon=True)
    reader.start()
    t0 = time.time()
    while not got and time.time() - t0 < 120 and p.poll() is None:  # generating now
        time.sleep(0.05)
    time.sleep(0.5)
    assert got and p.poll() is None, (got, p.returncode)
    p.send_signal(getattr(signal, sig))
    p.wait(timeout=60)
    stderr = p.stderr.read().decode()
    if sig == "SIGINT":
        lines = stderr.strip().splitlines()
        assert p.returncode == 130 and lines[-2:] == ["error: interrupted", lines[-1]], stderr[-800:]
        assert lines[-1].startswith("expert stats: ") and str(out) in lines[-1]
    else:
        assert p.returncode == -signal.SIGTERM, (p.returncode, stderr[-800:])
    st = json.loads(out.read_text())
    assert st["tokens"] > 1 and all(sum(v) == st["tokens"] * 4 for v in st["layers"].values())


def test_short_synthetic_models_keep_a_moe_layer(tmp_path, monkeypatch):
    """make-model --layers N below a preset's dense lead (R1: 3) keeps one MoE layer (it made a
    file of dense layers only, whose expert statistics counted 0 tokens); counting a model with no
    MoE layer is refused in one line."""
    from ikjax.tools import synthetic
    for preset, layers in (("tiny", 1), ("r1", 2), ("r1", 3)):
        cfg = synthetic.preset_config(preset, layers=layers)
        assert cfg["first_k_dense_replace"] == layers - 1, (preset, layers)
    assert synthetic.preset_config("r1", layers=4)["first_k_dense_replace"] == 3
    p = synthetic.make_model(tmp_path / "one.gguf", "tiny", "Q8_0", layers=1)
    eng = ikjax.load(p, ctx=64, expert_stats=True)
    eng.logits([1, 2, 3])
    assert eng.expert_stats()["tokens"] == 3 and list(eng.expert_stats()["layers"]) == ["0"]
    real = synthetic.preset_config
    monkeypatch.setattr(synthetic, "preset_config", lambda *a, **k: dict(real(*a, **k), first_k_dense_replace=2))
    dense = synthetic.make_model(tmp_path / "dense.gguf", "tiny", "Q8_0", layers=2)  # dense layers only
    with pytest.raises(OptionError, match="has no MoE layer"):
        ikjax.load(dense, ctx=64, expert_stats=True)


def test_interrupt_anywhere_in_a_record_leaves_whole_steps():
    """A Ctrl-C lands between any two bytecodes of the main thread, where a CPU step's callback may
    run: raised at every line of `record_counts` in turn, the figures are the step before or the step
    after, never a step counted in some layers only (CI caught `tokens*k != sum` after a SIGINT)."""
    from ikjax.model.moe import ExpertCounts
    fn = ExpertCounts.record_counts
    code = fn.__code__
    lines = sorted({ln for _, _, ln in code.co_lines() if ln is not None})
    E, layers = 6, [1, 2, 3]
    step = (np.array(layers), np.array([[1, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]]), 1)
    hits = 0
    for stop_at in lines:
        c = ExpertCounts(E, layers)
        c.record_counts(*step)
        before = c.as_json()

        def tracer(frame, event, arg, stop_at=stop_at):
            if frame.f_code is code:
                def local(frame, event, arg):
                    if event == "line" and frame.f_lineno == stop_at:
                        raise KeyboardInterrupt
                    return local
                return local
            return None
        sys.settrace(tracer)
        try:
            c.record_counts(*step)
        except KeyboardInterrupt:
            hits += 1
        finally:
            sys.settrace(None)
        got = c.as_json()
        after = {"tokens": 2, "layers": {k: [2 * x for x in v] for k, v in before["layers"].items()}}
        assert got in (before, after), (stop_at, got)
        assert all(sum(v) == got["tokens"] * 2 for v in got["layers"].values())
    assert hits >= 5  # the interrupt really landed inside, at many places
