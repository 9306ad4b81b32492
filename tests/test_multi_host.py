"""Several processes on localhost through jax.distributed (the multi-host path without hosts):
2 processes x 2 fake CPU devices each, CPU collectives through gloo, -sm graph over the 4 devices.

Oracle: the same model in this one-device process, at f32. Each device runs the kernels on its
part and psum joins the partial sums (sums in another order), so, as in tests/test_multi_device.py,
logits are held to max(1e-5, 2 x the one-device gap between the C++ kernels and the XLA path of the
same model and mode); every process must get the very same logits and the same generated tokens;
each process reads from the file only the parts its own devices hold.
"""
from __future__ import annotations

import json
import re
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ikjax
from ikjax.runtime import distributed
from ikjax.errors import OptionError
from conftest import TEST_XLA_FLAGS

HERE = Path(__file__).parent
WORKER = HERE / "multi_host_worker.py"
TOL = 1e-5
# tests/test_multi_device.py's floor (its comment says why), raised for two processes: their
# all-reduce of the 4 devices' partial f32 sums adds in another order than one process's psum; on
# the AVX2-only Zen 3 EPYC the v3tiny Q4_0 mla 3 case measured 3.95e-5 against a one-device order
# gap of 1.8e-5 (2.2x; the same with the kernels of 37ce1cd, so not a kernel change)
GRAPH_TOL_FLOOR = 5e-5
IDS = (np.arange(1, 14) * 37 % 500 + 3).tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, IKJAX_DTYPE="f32",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}")
    env.pop("IKJAX_KERNELS", None)
    return env


def _launch(argv_of, n: int = 2, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Start n processes (argv_of(i)) together and wait for all of them."""
    procs = [subprocess.Popen(argv_of(i), env=_env(), cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(n)]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def model4(tiny4_model):
    return tiny4_model


def _cases(model4: str) -> list[dict]:
    # mla 0 (its per-head K/V cache split with the heads across the processes) and mla 3 (the
    # latent cache whole on every device): the two cache forms a process holds; every MLA mode of
    # the graph split itself runs on one process's 4 devices in test_multi_device
    cases = [dict(model=model4, mla=m) for m in (0, 3)]
    fx = Path(os.environ.get("IKJAX_FIXTURES") or HERE.parents[1] / "shared" / "fixtures")
    if (fx / "MANIFEST.json").exists():  # ik's converter: MoE with every MLA tensor form
        cases.append(dict(model=str(fx / "v3tiny-all-Q4_0.gguf"), mla=3))
    return cases


@pytest.fixture(scope="module")
def run(model4, tmp_path_factory):
    d = tmp_path_factory.mktemp("mh")
    spec = dict(coordinator=f"localhost:{_free_port()}", num_processes=2, out=str(d), ids=IDS,
                cases=_cases(model4), generate_case=1)
    (d / "spec.json").write_text(json.dumps(spec))
    procs = _launch(lambda i: [sys.executable, str(WORKER), str(d / "spec.json"), str(i)])
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}: {p.stderr[-3000:]}"
    rows = [[json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")] for p in procs]
    arrays = [dict(np.load(d / f"p{i}.npz")) for i in range(2)]
    return spec, rows, arrays


def _reference(model: str, mla: int, kernels: str | None, monkeypatch) -> np.ndarray:
    if kernels:
        monkeypatch.setenv("IKJAX_KERNELS", kernels)
    else:
        monkeypatch.delenv("IKJAX_KERNELS", raising=False)
    return ikjax.load(model, ctx=64, ubatch=16, mla=mla).logits(IDS)


def test_the_mesh_spans_both_processes(run):
    _, rows, _ = run
    for r in rows:
        assert r[0] == {"check": "devices", "global": 4, "local": 2, "processes": 2}


def test_logits_equal_one_process(run, monkeypatch):
    spec, _, arrays = run
    for k, c in enumerate(spec["cases"]):
        a, b = arrays[0][f"logits{k}"], arrays[1][f"logits{k}"]
        assert np.array_equal(a, b), (c, "processes disagree")
        ref = _reference(c["model"], c["mla"], None, monkeypatch)
        gap = rel(_reference(c["model"], c["mla"], "xla", monkeypatch), ref)
        assert a.shape == ref.shape
        # a graph split sums partial products in another order (psum of 4 devices' f32 partials):
        # held to test_multi_device's floor for that, not only to 2 x the one-device gap, which
        # can fall below plain f32 reordering (here 9.5e-6 against 2.5e-5 after the avx2 kernel
        # changes of c09fb40 / 6388c19, which moved the one-device order gap)
        assert rel(a, ref) <= max(TOL, 2 * gap, GRAPH_TOL_FLOOR), (c, rel(a, ref), gap)


def test_generate_same_tokens_everywhere(run, model4, monkeypatch):
    _, _, arrays = run
    monkeypatch.delenv("IKJAX_KERNELS", raising=False)
    one = list(ikjax.load(model4, ctx=64, ubatch=16, mla=3).generate(IDS, 8))
    assert arrays[0]["generated"].tolist() == arrays[1]["generated"].tolist() == one


def test_each_process_reads_only_its_parts(run):
    """Split tensors: each process copies out of the file only its devices' halves; replicated
    ones (norms, router, latent projections) once per local device. Both together cover the file."""
    _, rows, _ = run
    cases = [[r for r in rs if r["check"] == "case"] for rs in rows]
    for a, b in zip(*cases):
        total = a["file_bytes"]
        assert 0 < a["read"] < total and 0 < b["read"] < total, (a, b)
        assert a["read"] + b["read"] >= total
        assert set(a["per_device"]) == {"CPU0", "CPU1", "CPU2", "CPU3"}


def test_layer_split_over_processes_refused(run):
    _, rows, _ = run
    for rs in rows:
        msg = next(r for r in rs if r["check"] == "refusal")["message"]
        assert msg.startswith("sm: 2 processes") and "-sm graph" in msg


def test_cli_two_processes_process_zero_prints(model4):
    """The README's launch: the same command on each process; only process 0's stdout has the table,
    and nothing else (the collectives' own connection lines go to stderr)."""
    port = _free_port()
    procs = _launch(lambda i: [sys.executable, "-m", "ikjax.cli", "sweep-bench", "-m", model4, "-c", "64", "-ub", "16",
                               "-n", "2", "-sm", "graph", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                               "--process-id", str(i)])
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}: {p.stderr[-2000:]}"
    lines = [ln for ln in procs[0].stdout.splitlines() if ln.strip()]
    # (-c 64 with -fa: ik's n_ctx 256, 16 rows of 16)
    assert lines[0].startswith("main: n_kv_max = 256") and lines[1].startswith("|    PP |")
    assert len([ln for ln in lines if ln.startswith("|    16 |")]) == 16, procs[0].stdout
    assert procs[1].stdout == ""


@pytest.mark.parametrize("args, msg", [
    (("localhost:1234", 2, None), "go together"),
    (("localhost", 2, 0), "expected HOST:PORT"),
    (("localhost:99999", 2, 0), "expected HOST:PORT"),
    (("localhost:1234", 0, 0), "num-processes: need >= 1"),
    (("localhost:1234", 2, 2), "process-id: need 0 <= id < 2"),
])
def test_bad_process_options_refused(args, msg):
    with pytest.raises(OptionError, match=msg):
        distributed.check_args(*args)


def test_no_process_options_is_one_process():
    assert distributed.check_args(None, None, None) is False


def _cli(model4, port: int, i: int, *args) -> list[str]:
    return [sys.executable, "-m", "ikjax.cli", *args[:1], "-m", model4, *args[1:], "-sm", "graph",
            "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)]


def test_cli_sampled_generate_without_a_seed_uses_process_0_s(model4):
    """`generate --temp 0.8` with no seed: every process samples from process 0's drawn seed (each
    drew its own before: the processes sampled other tokens, then waited on each other until a
    timeout killed them), and process 0's text is a one-process run's with that seed (f32). Process 1
    gives the same options in another order (the same command: it was "another command" before)."""
    port = _free_port()
    args = ("generate", "-p", "Hello", "-n", "12", "--temp", "0.8", "-c", "128")
    other_order = ("generate", "-c", "128", "--temp", "0.8", "--n-predict", "12", "-p", "Hello")
    procs = _launch(lambda i: _cli(model4, port, i, *(args if i == 0 else other_order)), timeout=300)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-1500:] for p in procs]
    seeds = [re.findall(r"sampler seed: (\d+)", p.stderr) for p in procs]
    assert seeds[0] and seeds[0] == seeds[1], seeds
    one = subprocess.run([sys.executable, "-m", "ikjax.cli", "generate", "-m", model4, *args[1:], "-s", seeds[0][0]],
                         capture_output=True, text=True, env=_env(), cwd=str(HERE), timeout=300)
    assert one.returncode == 0 and procs[0].stdout == one.stdout, (procs[0].stdout, one.stdout)


def test_cli_processes_running_other_commands_are_refused(model4):
    """Another -n on one process: each process says so in one line and exits 1 (they waited on each
    other's collectives until a timeout killed them before)."""
    port = _free_port()
    procs = _launch(lambda i: _cli(model4, port, i, "generate", "-p", "Hi", "-n", str(4 + 4 * i), "-c", "128"),
                    timeout=300)
    for p in procs:
        assert p.returncode == 1 and "process(es) 1 run another command than process 0" in p.stderr, p.stderr[-1500:]
        assert "Traceback" not in p.stderr


def test_cli_coordinator_port_in_use_and_missing_peer_are_one_line(model4, monkeypatch):
    """Process 0 with its coordinator port taken: one line (JAX's service segfaulted); a process whose
    peer never joins: one line after IKJAX_JOIN_TIMEOUT (JAX's client aborted with a page of C++
    log lines after 300 s). serve and chat refuse several processes."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run(_cli(model4, port, 0, "generate", "-p", "Hi", "-n", "2"), capture_output=True, text=True,
                           env=_env(), cwd=str(HERE), timeout=120)
    assert p.returncode == 1 and f"port {port} is in use" in p.stderr and "Traceback" not in p.stderr, p.stderr[-1500:]
    lone = subprocess.run(_cli(model4, _free_port(), 1, "generate", "-p", "Hi", "-n", "2"), capture_output=True,
                          text=True, env=dict(_env(), IKJAX_JOIN_TIMEOUT="3"), cwd=str(HERE), timeout=120)
    assert lone.returncode == 1 and "did not all join" in lone.stderr and "IKJAX_JOIN_TIMEOUT" in lone.stderr, \
        lone.stderr[-1500:]
    assert len([ln for ln in lone.stderr.splitlines() if ln.strip()]) <= 3, lone.stderr
    for cmd in ("serve", "chat"):
        r = subprocess.run(_cli(model4, _free_port(), 0, cmd), capture_output=True, text=True, env=_env(),
                           cwd=str(HERE), timeout=120)
        assert r.returncode == 1 and f"{cmd} runs in one process" in r.stderr, r.stderr[-800:]


def test_command_key_ignores_the_process_id_and_the_model_s_directory():
    a = distributed.command_key("generate", {"model": "/a/m.gguf", "n_predict": 4, "process_id": 0})
    assert a == distributed.command_key("generate", {"process_id": 1, "n_predict": 4, "model": "/b/m.gguf"})
    assert a != distributed.command_key("generate", {"model": "/a/m.gguf", "n_predict": 8, "process_id": 0})
    assert a != distributed.command_key("bench", {"model": "/a/m.gguf", "n_predict": 4, "process_id": 0})


def test_cli_sigterm_ends_both_and_only_process_0_writes(model4, tmp_path):
    """SIGTERM to both processes mid-generate: each ends with "error: terminated" and dies of the
    signal (JAX's preemption service had taken SIGTERM over: both ran to the end and exited 0);
    --expert-stats is written by process 0 only (process 1 wrote an all-zero file beside it)."""
    import signal
    import time
    port = _free_port()
    dirs = [tmp_path / f"p{i}" for i in range(2)]
    procs = []
    for i, d in enumerate(dirs):
        d.mkdir()
        procs.append(subprocess.Popen(_cli(model4, port, i, "generate", "-p", "Hello", "-n", "3000", "--ignore-eos",
                                           "--temp", "0", "-c", "4096", "--expert-stats", "es.json"),
                                      env=_env(), cwd=str(d), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        first = procs[0].stdout.read(8)  # process 0 prints: tokens flow
        assert first, procs[0].stderr.read().decode()[-1500:]
        time.sleep(0.5)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        t0 = time.time()
        errs = [p.communicate(timeout=60)[1].decode() for p in procs]
        assert time.time() - t0 < 30
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errs):
        assert p.returncode == -signal.SIGTERM and "error: terminated" in err, (p.returncode, err[-1500:])
    st = json.loads((dirs[0] / "es.json").read_text())
    assert st["tokens"] > 1 and not (dirs[1] / "es.json").exists()
