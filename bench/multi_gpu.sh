#!/usr/bin/env bash
# Issue 13's matrix on one multi-GPU lease (nvidia-h100-x4 / nvidia-h200-x4), inside one call:
#   v2l: the 27-layer V2-Lite-shape Q4_0 model (`make-model --preset v2-lite --type Q4_0`),
#        sweep-bench -c 16384 -ub 2048 -n 128 -mla 3 -fa 1 on 1 GPU, -sm layer and -sm graph on 2 and 4;
#        the TG rows run the decode loop under every split mode (issue 25: the -sm graph loop is one
#        executable, the -sm layer loop dispatches its stages without host waits); each -sm graph
#        run prints its collectives per decode step (its log, the table's notes);
#        issue 25's V2-Lite table on 2 GPUs in one call: PARTS="v2l v2l_cmdbuf v2l_mb1 v2l_step" on
#        nvidia-h100-x2, A/B runs after the three main ones (v2l_cmdbuf: -sm graph with
#        IKJAX_MESH_GRAPH=1, the collectives inside the loop's CUDA graph; v2l_mb1: -sm layer with
#        IKJAX_PIPELINE_MB=1, prompts without micro-batches in flight; v2l_step: -sm layer / graph
#        with IKJAX_DECODE_LOOP=0, one token per dispatch, the path before the loop);
#   r1:  the R1 shape cut to R1_LAYERS (16) layers (80.5 GiB), the same runs, plus
#        -ot exps=CPU -sm graph and -sm layer (-c OT_CTX 4096 -n OT_TG 32);
#   fix: bench/multi_gpu_fixtures.py, the fixtures at f32 on 2- and 4-GPU meshes.
# Per-GPU memory (nvidia-smi every 0.5 s, only while a run is alone on a GPU) and the memory plan
# of every run; for -sm graph the collectives of each compiled step (XLA's optimized HLO, dumped
# by the warm-up pass: counts and bytes per step).
#
# On the device, from the repo root, carrying .whl (the gguf wheel) and .gpufix (the fixtures):
#   bash bench/multi_gpu.sh          results: $OUT/{table.md,multi_gpu.log,runs.log,mem.csv,hlo.txt,fixtures.txt}
#   PARTS="r1_graph4 r1_ot_graph4" bash bench/multi_gpu.sh   # a second call: parts or single runs
# PARTS: v2l, r1, fix, v2l_cmdbuf, v2l_mb1, v2l_step and/or run names (v2l_gpu1 v2l_layer2 v2l_layer4
# v2l_graph2 v2l_graph4 v2l_graph2_cmdbuf v2l_layer2_mb1 v2l_layer2_step ... r1_layer2 r1_layer4 r1_gpu1 r1_graph4
# r1_graph2 r1_ot_graph4 r1_ot_layer4); the log's last line names the
# runs the deadline left out. A second call on the same warm machine reuses the model files
# (/tmp/mg) and the compiled steps (JAX's persistent cache under ~/.cache/ikjax).
#
# How it fits a 10-minute call: compiling is most of every run (68 s for one GPU, RESULTS §4) and
# needs only CPU, so every configuration is first started in a *warm-up* process, all at once
# (memory permitting), stopped as soon as the CLI prints "compiled ...": the executables land in
# JAX's persistent compilation cache (ikjax.runtime.compile_cache). The *measured* runs then go one at a
# time, each the plain CLI command, loading its steps from the cache; no other job runs on a
# measured run's GPUs, and with ISOLATE=1 (default) no warm-up of a later run starts on GPUs an
# earlier run still needs. Each row names what ran beside it on other GPUs (the R1 file is written
# in the background from the start: ~0.6 GB/s, ~2.5 min for 80.5 GiB). Nothing starts that cannot
# finish before DEADLINE (540 s after the start). `-ot exps=CPU` needs the CUDA host-experts
# handler: built first (cmake + ninja, as bench/hybrid_device.sh) when that run is selected, and
# every GPU job waits for it (the .so is part of the compile cache's key).
#
# Knobs (environment): OUT, PARTS, DEADLINE, CTX (16384), UB (2048), TG (128), GRAPH_CTX and
# GRAPH_TG (-sm graph; default CTX, TG), R1_LAYERS (16; fewer if /tmp lacks the room, logged),
# R1_CTX, R1_TG, R1_GRAPH_CTX, OT_CTX (4096), OT_TG (32), ISOLATE, WARM (1; 0 = every run compiles
# itself), HLO (1; 0 = no dump), BUILD_CUDA (auto/1/0), FIX_BUDGET (110 s for the fixtures
# script), COMMIT (recorded when the tree has no .git), MG_WORK (/tmp/mg), MG_NO_INSTALL=1 (no
# wheel install). A CPU rehearsal: MG_FAKE_DEVICES=4 (fake CPU devices; MG_FAKE_GIB their memory),
# V2L_MAKE / R1_MAKE (make-model arguments of small models), MG_CLI (a stand-in for
# `python3 -m ikjax.cli`) with MG_TIME_SCALE (every time budget scaled).
set -uo pipefail
export PYTHONUNBUFFERED=1
export OUT=${OUT:-$PWD/multi_gpu_out}
mkdir -p "$OUT"
if [ -z "${MG_NO_INSTALL:-}" ] && ls .whl/*.whl > /dev/null 2>&1; then
  # the device has no network: the gguf wheel travels in .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# nvidia-smi's GPU index = CUDA's; memory on demand (nvidia-smi then shows what a run holds, not
# JAX's 75 % preallocation); NVLink multicast stays off (the device README)
export CUDA_DEVICE_ORDER=PCI_BUS_ID XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec python3 - "$@" <<'PY'
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

T0 = time.time()
REPO = Path.cwd()
sys.path.insert(0, str(REPO / "bench"))
import multi_gpu_table as tbl  # noqa: E402

E = os.environ.get
OUT = Path(E("OUT"))
WORK = Path(E("MG_WORK", "/tmp/mg"))
WORK.mkdir(parents=True, exist_ok=True)
DEADLINE = float(E("DEADLINE", "540"))
SCALE = float(E("MG_TIME_SCALE", "1"))  # rehearsals with a stand-in CLI: every time budget below x SCALE
RESERVE = 10.0 * SCALE  # seconds kept at the end for the table
PARTS = set(E("PARTS", "v2l r1 fix").replace(",", " ").split())
FAKE = int(E("MG_FAKE_DEVICES", "0"))
CTX, UB, TG = int(E("CTX", "16384")), int(E("UB", "2048")), int(E("TG", "128"))
GCTX, GTG = int(E("GRAPH_CTX", str(CTX))), int(E("GRAPH_TG", str(TG)))
R1_LAYERS = int(E("R1_LAYERS", "16"))
R1_CTX, R1_TG = int(E("R1_CTX", str(CTX))), int(E("R1_TG", str(TG)))
R1_GCTX = int(E("R1_GRAPH_CTX", str(R1_CTX)))
OT_CTX, OT_TG = int(E("OT_CTX", "4096")), int(E("OT_TG", "32"))
V2L_MAKE = E("V2L_MAKE", "--preset v2-lite --type Q4_0")
R1_MAKE = E("R1_MAKE", "")
WARM = E("WARM", "1") != "0"
HLO = E("HLO", "1") != "0"
FIX_BUDGET = float(E("FIX_BUDGET", "110"))
CLI = shlex.split(E("MG_CLI", "")) or [sys.executable, "-m", "ikjax.cli"]  # MG_CLI: a stand-in, for rehearsals
for f in ("multi_gpu.log", "runs.log", "mem.csv", "hlo.txt", "fixtures.txt", "table.md"):
    (OUT / f).unlink(missing_ok=True)
LOCK = threading.RLock()


def now() -> float:
    return time.time() - T0


def left() -> float:
    return DEADLINE - now()


def log(msg: str) -> None:
    line = f"[{now():6.1f}s] {msg}"
    print(line, flush=True)
    with LOCK, open(OUT / "multi_gpu.log", "a") as f:
        f.write(line + "\n")


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except subprocess.TimeoutExpired:
        return ""


# -- the machine -------------------------------------------------------------------------------------
if FAKE:
    GPUS = [dict(index=i, name="fake CPU device", total=float(E("MG_FAKE_GIB", str(1 << 20)))) for i in range(FAKE)]
else:
    GPUS = []
    for line in sh("nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits").splitlines():
        i, name, total = [x.strip() for x in line.split(",")]
        GPUS.append(dict(index=int(i), name=name, total=float(total) / 1024))
if not GPUS:
    log("no GPU found (nvidia-smi printed nothing); for a CPU rehearsal set MG_FAKE_DEVICES=4")
    sys.exit(1)
NG = len(GPUS)
commit = E("COMMIT") or sh("git rev-parse --short HEAD 2>/dev/null") or "unknown (no .git here: give COMMIT=...)"
ram = sh("free -g | awk '/Mem:/ {print $2}'")
disk = sh(f"df -h {WORK} | tail -1")
jaxv = sh(sys.executable + " -c 'import jax; print(jax.__version__)'")
log(f"machine: {NG} x {GPUS[0]['name']} ({GPUS[0]['total']:.1f} GiB each), {os.cpu_count()} host cores, "
    f"{ram} GiB RAM; {WORK}: {disk}")
log(f"commit: {commit}; jax: {jaxv}")
log(f"parts: {' '.join(sorted(PARTS))}; deadline {DEADLINE:.0f}s; warm-up pass {'on' if WARM else 'off'}")
if not FAKE:
    log("topology:\n" + sh("nvidia-smi topo -m"))

MESHES = [m for m in (2, 4) if m <= NG] + ([NG] if NG > 4 else [])


# -- jobs --------------------------------------------------------------------------------------------
class Job:
    """One subprocess: kind make / warm / measure / fixtures; its output goes to WORK, and into
    OUT/runs.log as one block when it ends."""

    def __init__(self, kind, name, cmd, gpus=(), mem=0.0, timeout=300.0, env=None, meta=None):
        self.kind, self.name, self.cmd, self.gpus = kind, name, list(cmd), list(gpus)
        self.mem, self.timeout, self.env, self.meta = mem, timeout, dict(env or {}), dict(meta or {})
        self.logpath = WORK / f"{kind}_{name}.log"
        self.proc = None
        self.t_start = self.t_end = None
        self.kill_at = None
        self.stopped = ""
        self.beside: set[str] = set()
        self.offset = 0
        self.rc = None

    def desc(self) -> str:
        return f"{self.kind} {self.name}" + (f" (GPUs {','.join(map(str, self.gpus))})" if self.gpus else "")

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.env)
        xla = env.pop("MG_XLA_JOB", "")
        if FAKE:
            env["XLA_FLAGS"] = " ".join(x for x in (f"--xla_force_host_platform_device_count={max(1, len(self.gpus))}",
                                                    E("MG_XLA_EXTRA", ""), xla) if x)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
            if xla:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla).strip()
        self.fh = open(self.logpath, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=REPO, start_new_session=True)
        self.t_start = now()
        log(f"start {self.desc()}: {self.cmdline()}")

    def cmdline(self) -> str:
        pre = "" if FAKE or not self.gpus else f"CUDA_VISIBLE_DEVICES={','.join(map(str, self.gpus))} "
        return pre + " ".join(shlex.quote(c) for c in self.cmd).replace(sys.executable + " -m ikjax.cli", "ikjax")

    def stop(self, why: str) -> None:
        if self.proc and self.proc.poll() is None and not self.kill_at:
            self.stopped = why
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.kill_at = now() + 5

    def poll(self):
        rc = self.proc.poll()
        if rc is None:
            if self.kill_at and now() > self.kill_at:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            elif not self.kill_at and now() - self.t_start > self.timeout:
                self.stop(f"timeout {self.timeout:.0f}s")
            return None
        if self.t_end is None:
            self.t_end, self.rc = now(), rc
            self.fh.close()
        return rc

    def new_output(self) -> str:
        try:
            with open(self.logpath, errors="replace") as f:
                f.seek(self.offset)
                s = f.read()
                self.offset = f.tell()
                return s
        except OSError:
            return ""

    def text(self) -> str:
        return self.logpath.read_text(errors="replace") if self.logpath.exists() else ""

    def record(self, **extra) -> None:
        meta = dict(self.meta, kind=self.kind, name=self.name, gpus=",".join(map(str, self.gpus)),
                    cmd=self.cmdline(), rc=self.rc, t_start=round(self.t_start or 0, 1),
                    t_end=round(self.t_end or now(), 1), stopped=self.stopped,
                    timed_out=self.stopped.startswith("timeout") or self.stopped == "deadline",
                    timeout_s=round(self.timeout), beside=sorted(self.beside), **extra)
        meta["concurrent"] = meta["beside"]
        with LOCK, open(OUT / "runs.log", "a") as f:
            f.write(f"=== BEGIN {self.kind} {self.name}\n")
            f.write(self.text().rstrip("\n") + "\n")
            f.write(f"=== END {self.kind} {self.name} {json.dumps(meta)}\n")


def skip(name: str, why: str) -> None:
    log(f"skip {name}: {why}")
    with LOCK, open(OUT / "runs.log", "a") as f:
        f.write(f"=== BEGIN skip {name}\n=== END skip {name} {json.dumps(dict(name=name, why=why))}\n")


RUNNING: list[Job] = []


# -- memory sampler ----------------------------------------------------------------------------------
STOP = threading.Event()


def sampler() -> None:
    with open(OUT / "mem.csv", "w") as f:
        f.write("t,gpu,used_mib,jobs\n")
        while not STOP.is_set():
            out = sh("nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
            t = now()
            with LOCK:
                running = [(f"{j.kind}:{j.name}", set(j.gpus)) for j in RUNNING]
            for line in out.splitlines():
                try:
                    idx, used = [int(float(x)) for x in line.split(",")]
                except ValueError:
                    continue
                f.write(f"{t:.1f},{idx},{used},{';'.join(n for n, g in running if idx in g)}\n")
            f.flush()
            STOP.wait(0.5)


if not FAKE:
    threading.Thread(target=sampler, daemon=True).start()


# -- the models --------------------------------------------------------------------------------------
def planned_gib(make_args: str) -> float:
    """The file size make-model will write (ikjax.tools.synthetic's plan), GiB."""
    from ikjax.tools import synthetic
    a = make_args.split()
    get = lambda k, d=None: a[a.index(k) + 1] if k in a else d  # noqa: E731
    cfg = synthetic.preset_config(get("--preset", "tiny"), int(get("--layers")) if get("--layers") else None)
    return sum(t.nbytes for t in synthetic.plan_tensors(cfg, get("--type", "Q8_0").upper())) / 2**30


def free_gib(d: Path) -> float:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize / 2**30


MODELS: dict[str, dict] = {}


def want_model(key: str, make_args: str) -> None:
    path = WORK / f"{key}.gguf"
    stamp = WORK / f"{key}.args"
    MODELS[key] = dict(path=path, args=make_args, ready=False, failed=False, job=None,
                       gib=planned_gib(make_args))
    if path.exists() and stamp.exists() and stamp.read_text() == make_args:
        MODELS[key]["ready"] = True
        log(f"model {key}: reusing {path} ({path.stat().st_size / 2**30:.2f} GiB, make-model {make_args})")
        return
    stamp.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    job = Job("make", key, CLI + ["make-model"] + make_args.split() + ["-o", str(path)], timeout=DEADLINE)
    MODELS[key]["job"] = job
    job.start()
    RUNNING.append(job)




# -- the configurations ------------------------------------------------------------------------------
class Config:
    def __init__(self, model, name, gpus, flags, ctx, tg, sensitive, measure_cap, measure_min, warm_cap=300.0,
                 env=None, note=""):
        self.model, self.name, self.gpus, self.flags = model, name, gpus, flags
        self.env, self.note = dict(env or {}), note  # e.g. IKJAX_DECODE_LOOP=0 for the *_step runs
        self.ctx, self.tg, self.sensitive = ctx, tg, sensitive
        self.measure_cap, self.measure_min, self.warm_cap = measure_cap * SCALE, measure_min * SCALE, warm_cap * SCALE
        self.state = "pending"  # pending, warming, ready, measuring, done, refused, skipped
        self.warm_alone = True
        self.graph = "graph" in flags

    def args(self) -> list[str]:
        m = MODELS[self.model]
        return ["sweep-bench", "-m", str(m["path"]), "-c", str(self.ctx), "-ub", str(UB), "-n", str(self.tg),
                "-mla", "3", "-fa", "1"] + self.flags

    def est_gib(self) -> float:
        """Device memory per GPU this run will take (weights share + compute buffers + context)."""
        size = MODELS[self.model]["gib"]
        n = len(self.gpus)
        if "exps=CPU" in " ".join(self.flags):
            return 2.0
        need = size * (1.1 if self.graph else 1.0) / n + 2.5
        if need > 0.75 * min(GPUS[g]["total"] for g in self.gpus):
            return 1.0  # cannot fit: the memory plan refuses it at load (what we record)
        return need

    def meta(self) -> dict:
        m = MODELS[self.model]
        return dict(model=self.model, model_desc=f"make-model {m['args']} ({m['gib']:.2f} GiB)",
                    n_gpus=len(self.gpus), flags=" ".join([f"{k}={v}" for k, v in self.env.items()] + self.flags + ([f"-c {self.ctx}", f"-n {self.tg}"]
                                                                     if (self.ctx, self.tg) != (CTX, TG) else [])),
                    cmd_base=f"ikjax sweep-bench -m {m['path']} -c {CTX} -ub {UB} -n {TG} -mla 3 -fa 1",
                    sensitive=self.sensitive, order=CONFIGS.index(self) if self in CONFIGS else 0,
                    note=self.note)


# priority order (what the deadline cuts last comes first); model, name, GPUs, flags, -c, -n,
# sensitive (no job beside it on its GPUs), measured run's cap and least time, warm-up cap
# -ot: the host's cores, as ik's -t (the host kernel runs one call at a time: under -sm graph the
# first device's call computes every pick of a decode step, under -sm layer each stage's in turn)
HOST_T = str(os.cpu_count() or NG)
ALL: list[Config] = [Config("v2l", "v2l_gpu1", [0], [], CTX, TG, True, 150, 30)]
ALL += [Config("v2l", f"v2l_layer{m}", list(range(m)), ["-sm", "layer"], CTX, TG, True, 150, 35) for m in MESHES]
ALL += [Config("v2l", f"v2l_graph{m}", list(range(m)), ["-sm", "graph"], GCTX, GTG, True, 150, 35) for m in MESHES]
# only when named in PARTS: the split modes one token per dispatch (IKJAX_DECODE_LOOP=0, the path
# before the decode loop), side by side with the loop's rows of the same call
STEP_RUNS = [Config("v2l", f"v2l_{sm}{m}_step", list(range(m)), ["-sm", sm], GCTX if sm == "graph" else CTX,
                    GTG if sm == "graph" else TG, True, 150, 35, env={"IKJAX_DECODE_LOOP": "0"},
                    note="one token per dispatch")
             for sm in ("layer", "graph") for m in MESHES]
# v2l_cmdbuf: -sm graph's decode loop with its collectives inside the CUDA graph (IKJAX_MESH_GRAPH=1)
STEP_RUNS += [Config("v2l", f"v2l_graph{m}_cmdbuf", list(range(m)), ["-sm", "graph"], GCTX, GTG, True, 150, 35,
                     env={"IKJAX_MESH_GRAPH": "1"}, note="collectives captured in the loop's CUDA graph")
              for m in MESHES]
# v2l_mb1: -sm layer prompts without micro-batches in flight (IKJAX_PIPELINE_MB=1; auto: 4 of 512 at -ub 2048)
STEP_RUNS += [Config("v2l", f"v2l_layer{m}_mb1", list(range(m)), ["-sm", "layer"], CTX, TG, True, 150, 35,
                     env={"IKJAX_PIPELINE_MB": "1"}, note="prompt steps without micro-batches")
              for m in MESHES]
# r1_layer2_mb1 / _mb2: R1's -sm layer prompts as 1 or 2 micro-batches (auto: 4 of 512 at -ub 2048, where
# each of R1's 256 experts sees ~16 tokens a micro-batch and every micro-batch reads all their weights)
STEP_RUNS += [Config("r1", f"r1_layer{m}_mb{mb}", list(range(NG - m, NG)), ["-sm", "layer"], R1_CTX, R1_TG, True,
                     200, 60, env={"IKJAX_PIPELINE_MB": str(mb)}, note=f"prompt steps as {mb} micro-batches")
              for m in MESHES for mb in (1, 2)]
GROUPS = ("v2l_cmdbuf", "v2l_mb1", "v2l_step")  # their runs, in this order, after the others
# the 2-GPU layer split on the last two GPUs: its warm-up fits beside others on the first two
ALL += [Config("r1", f"r1_layer{m}", list(range(NG - m, NG)), ["-sm", "layer"], R1_CTX, R1_TG, True, 200, 60)
        for m in MESHES]
ALL += [Config("r1", "r1_gpu1", [0], [], R1_CTX, R1_TG, True, 200, 50)]
ALL += [Config("r1", f"r1_graph{m}", list(range(m)), ["-sm", "graph"], R1_GCTX, GTG, True, 200, 60)
        for m in reversed(MESHES)]
ALL += [Config("r1", "r1_ot_gpu1", [0], ["-ot", "exps=CPU", "-t", HOST_T], OT_CTX, OT_TG, True, 200, 60)]
ALL += [Config("r1", f"r1_ot_graph{NG}", list(range(NG)), ["-ot", "exps=CPU", "-sm", "graph", "-t", HOST_T],
               OT_CTX, OT_TG, True, 200, 60)]
ALL += [Config("r1", f"r1_ot_layer{NG}", list(range(NG)), ["-ot", "exps=CPU", "-sm", "layer", "-t", HOST_T],
               OT_CTX, OT_TG, True, 200, 60)]
# PARTS names a model (all its runs) or single runs (e.g. PARTS="r1_graph4 r1_graph2")
CONFIGS: list[Config] = [c for c in ALL if c.model in PARTS or c.name in PARTS] + \
    sorted([c for c in STEP_RUNS if c.name in PARTS or any(g in PARTS and c.name.endswith(g[3:]) for g in GROUPS)],
           key=lambda c: next((i for i, g in enumerate(GROUPS) if c.name.endswith(g[3:])), len(GROUPS)))
unknown = PARTS - {"v2l", "r1", "fix", *GROUPS} - {c.name for c in ALL + STEP_RUNS}
if unknown:
    log(f"PARTS: unknown {', '.join(sorted(unknown))}: give v2l, r1, fix, {', '.join(GROUPS)} or run names "
        f"({', '.join(c.name for c in ALL + STEP_RUNS)})")
    sys.exit(1)
WANT = {c.model for c in CONFIGS}
if "v2l" in WANT:
    want_model("v2l", V2L_MAKE)
if "r1" in WANT:
    layers = R1_LAYERS
    make = R1_MAKE or f"--preset r1 --layers {layers} --type Q4_0"
    if not R1_MAKE:
        # an R1 file already there is replaced (or reused): its bytes count as room (a second call
        # on a 128 GiB disk rewrote the 16-layer file of the first call as 7 layers, RESULTS §25e)
        old = WORK / "r1.gguf"
        room = free_gib(WORK) - 8 - (0 if "v2l" not in MODELS else MODELS["v2l"]["gib"]) + \
            (old.stat().st_size / 2**30 if old.exists() else 0.0)
        while layers > 4 and planned_gib(make) > room:
            layers -= 1
            make = f"--preset r1 --layers {layers} --type Q4_0"
        if layers != R1_LAYERS:
            log(f"model r1: {R1_LAYERS} layers do not fit the {free_gib(WORK):.0f} GiB free under {WORK}: "
                f"cut to {layers} layers")
    want_model("r1", make)
for k, m in MODELS.items():
    log(f"model {k}: make-model {m['args']} -> {m['gib']:.2f} GiB")
log("configurations, in priority order: " + ", ".join(f"{c.name} (GPUs {','.join(map(str, c.gpus))})" for c in CONFIGS))

COMPILED = re.compile(r"^compiled \d+ step", re.M)
# a warm-up refused for memory while other jobs held some of its GPUs is tried again alone
MEMORYISH = re.compile(r"MiB|GiB|RESOURCE_EXHAUSTED|out of memory|which has", re.I)
ISOLATE = E("ISOLATE", "1") != "0"
FIX_JOB = None
if "fix" in PARTS:
    FIX_JOB = Job("fixtures", "mesh", [sys.executable, "bench/multi_gpu_fixtures.py", "--budget", str(FIX_BUDGET)],
                  gpus=range(NG), mem=1.0, timeout=FIX_BUDGET + 60, env={"IKJAX_DTYPE": "f32"})
    FIX_JOB.start()
    RUNNING.append(FIX_JOB)

# -ot exps=CPU next to GPUs calls the CUDA host-experts handler (pallas_kernels._cuda_host)
BUILT = True  # GPU jobs wait while False: the .so's bytes are part of the compile cache's key
BUILD = E("BUILD_CUDA", "auto")
if not FAKE and (BUILD == "1" or (BUILD == "auto" and any("exps=CPU" in c.flags for c in CONFIGS))):
    b = WORK / "ikb"
    BUILT = False
    bj = Job("build", "cuda_host", ["bash", "-c",
             f"cmake -S pallas_kernels -B {b} -G Ninja -DIKJAX_BUILD_CUDA=ON -DPython_EXECUTABLE={sys.executable} "
             f"&& ninja -C {b} _cuda_host && cp {b}/_cuda_host*.so pallas_kernels/"], timeout=300)
    bj.start()
    RUNNING.append(bj)


def on_gpus(job_or_cfg, kinds=None) -> list[Job]:
    g = set(job_or_cfg.gpus)
    return [j for j in RUNNING if set(j.gpus) & g and (kinds is None or j.kind in kinds)]


def mem_fits(cfg: Config) -> bool:
    need = cfg.est_gib()
    for g in cfg.gpus:
        used = sum(j.mem for j in RUNNING if g in j.gpus)
        total = GPUS[g]["total"]
        # every job's estimate together within 95 % of the card (a wrong guess costs a retry: see
        # finish); one process is held to JAX's default limit, 75 % of the card, by est_gib
        if used + need > 0.95 * total:
            return False
    return True


def finish(job: Job) -> None:
    """A job ended: record it and move its configuration on."""
    global BUILT
    cfg = next((c for c in CONFIGS if c.name == job.name), None)
    txt = job.text()
    if job.kind == "build":
        BUILT = True
        log(f"build of the CUDA host-experts handler: {'ok' if job.rc == 0 else 'FAILED (rc %s)' % job.rc} in "
            f"{job.t_end - job.t_start:.0f}s" + ("" if job.rc == 0 else ": " + txt.strip()[-600:]))
        job.record()
    elif job.kind == "make":
        m = MODELS[job.name]
        if job.rc == 0 and m["path"].exists():
            m["ready"] = True
            (WORK / f"{job.name}.args").write_text(m["args"])
            m["gib"] = m["path"].stat().st_size / 2**30
            log(f"model {job.name} ready in {job.t_end - job.t_start:.0f}s: " + (txt.strip().splitlines() or [""])[-1])
        else:
            m["failed"] = True
            log(f"model {job.name} FAILED (rc {job.rc}): {txt.strip()[-400:]}")
        job.record()
    elif job.kind == "fixtures":
        (OUT / "fixtures.txt").write_text(txt)
        log("fixtures: " + next((l for l in reversed(txt.splitlines()) if l.startswith("summary:")),
                                f"no summary (rc {job.rc}, {job.stopped or 'ended'})"))
        job.record()
    elif job.kind == "warm":
        compiled = COMPILED.search(txt)
        err = next((l for l in txt.splitlines() if l.startswith("error: ")), None)
        if compiled:
            cfg.state = "ready"
            log(f"warm {job.name}: " + txt[compiled.start():].splitlines()[0])
            job.record()
        elif err and (cfg.warm_alone or not MEMORYISH.search(err)):
            cfg.state = "refused"
            log(f"warm {job.name} refused: {err}")
            job.record(refused=err[len('error: '):])
        elif job.stopped and job.stopped != "compiled":
            cfg.state = "skipped"
            log(f"warm {job.name}: no compile within {job.timeout:.0f}s ({job.stopped}); not measured")
            job.record()
            skip(cfg.name, f"its warm-up did not finish compiling ({job.stopped})")
        else:  # an error beside other jobs (memory?) or a crash: the measured run tries it alone, cold
            cfg.state = "ready"
            log(f"warm {job.name} failed (rc {job.rc}) beside other jobs: {(err or txt.strip()[-300:])}; "
                f"the measured run compiles it")
            job.record()
        if cfg.graph and HLO:
            dump = WORK / f"hlo_{job.name}"
            if dump.exists():
                lines = tbl.hlo_summary(dump)
                with open(OUT / "hlo.txt", "a") as f:
                    f.write(f"{job.name}:\n" + "".join(f"  {l}\n" for l in lines or ["no optimized step module in the dump"]))
                subprocess.run(["rm", "-rf", str(dump)])
    elif job.kind == "measure":
        cfg.state = "done"
        rows = [l for l in txt.splitlines() if tbl.ROW.match(l)]
        err = next((l for l in txt.splitlines() if l.startswith("error: ")), None)
        log(f"measured {job.name} (rc {job.rc}{', ' + job.stopped if job.stopped else ''}): {len(rows)} rows"
            + (f"; {err}" if err else ""))
        for l in rows:
            log("    " + l)
        for l in txt.splitlines():  # -sm graph: what each step pays between the GPUs (Engine.collectives)
            if l.startswith("-sm graph ") and "collectives a step" in l:
                log("    " + l)
        job.record(refused=err[len('error: '):] if err and not rows else None)
        (OUT / "table.md").write_text(tbl.build(OUT) + "\n")


def start_warm(cfg: Config) -> None:
    env = {}
    if cfg.graph and HLO:
        env["MG_XLA_JOB"] = (f"--xla_dump_to={WORK / ('hlo_' + cfg.name)} --xla_dump_hlo_as_text "
                             f"--xla_dump_hlo_module_re=step|forward|decode")
    env.update(cfg.env)
    job = Job("warm", cfg.name, CLI + cfg.args(), cfg.gpus, cfg.est_gib(), cfg.warm_cap, env, cfg.meta())
    cfg.warm_alone = not on_gpus(cfg, ("warm", "measure", "fixtures"))
    cfg.state = "warming"
    job.start()
    RUNNING.append(job)


def start_measure(cfg: Config) -> None:
    timeout = min(cfg.measure_cap, left() - RESERVE)
    job = Job("measure", cfg.name, CLI + cfg.args(), cfg.gpus, cfg.est_gib(), timeout, cfg.env, cfg.meta())
    cfg.state = "measuring"
    job.start()
    RUNNING.append(job)


# -- the loop ----------------------------------------------------------------------------------------
def tick() -> bool:
    """One round: reap, stop compiled warm-ups, start what may start. False when all is done."""
    for job in list(RUNNING):
        if job.kind == "warm" and not job.kill_at and COMPILED.search(job.text()):
            job.stop("compiled")
        if job.poll() is not None:
            RUNNING.remove(job)
            finish(job)
    for job in RUNNING:
        if job.kind == "measure":
            job.beside |= {j.desc() for j in RUNNING if j is not job}
    measuring = any(j.kind == "measure" for j in RUNNING)
    # a measured run: the first ready configuration whose GPUs are quiet enough
    if not measuring and BUILT:
        for cfg in CONFIGS:
            if cfg.state != "ready":
                continue
            blockers = on_gpus(cfg, ("warm", "fixtures", "measure")) if cfg.sensitive else on_gpus(cfg, ("measure",))
            if blockers:
                continue
            if left() - RESERVE < cfg.measure_min:
                cfg.state = "skipped"
                skip(cfg.name, f"{left():.0f}s left, a measured run needs ~{cfg.measure_min:.0f}s")
                continue
            start_measure(cfg)
            break
    # warm-ups: in priority order, where the model is there, memory allows, and no ready
    # configuration of higher priority waits for these GPUs
    waiting = [c for c in CONFIGS if c.state in ("warming", "ready", "measuring") and c.sensitive] if ISOLATE else []
    reserved: set[int] = set()  # GPUs of a warm-up that waits for memory: nothing of lower priority jumps it
    for i, cfg in enumerate(CONFIGS):
        if cfg.state != "pending":
            continue
        m = MODELS[cfg.model]
        if m["failed"]:
            cfg.state = "skipped"
            skip(cfg.name, f"model {cfg.model} could not be made")
            continue
        if not m["ready"]:
            continue
        if left() - RESERVE < cfg.measure_min:
            cfg.state = "skipped"
            skip(cfg.name, f"{left():.0f}s left: no time to compile and measure it")
            continue
        if not WARM:
            cfg.state = "ready"
            continue
        if not BUILT:
            continue
        if any(set(c.gpus) & set(cfg.gpus) and CONFIGS.index(c) < i for c in waiting):
            continue
        if on_gpus(cfg, ("measure",)) and any(j.kind == "measure" and next(c for c in CONFIGS if c.name == j.name).sensitive
                                              for j in on_gpus(cfg, ("measure",))):
            continue
        if set(cfg.gpus) & reserved:
            continue
        if not mem_fits(cfg):
            reserved |= set(cfg.gpus)
            continue
        start_warm(cfg)
    if left() < RESERVE:
        return False
    # go on while a configuration is open or a job other than an unneeded make-model runs
    return any(c.state not in ("done", "refused", "skipped") for c in CONFIGS) or \
        any(j.kind != "make" for j in RUNNING)


try:
    while tick():
        time.sleep(0.5)
finally:
    for job in list(RUNNING):
        job.stop("deadline")
    t_kill = time.time()
    while RUNNING and time.time() - t_kill < 8:
        for job in list(RUNNING):
            if job.poll() is not None:
                RUNNING.remove(job)
                finish(job) if job.kind in ("measure", "fixtures", "build") else job.record()
        time.sleep(0.2)
    for job in RUNNING:
        job.record()
    for cfg in CONFIGS:
        if cfg.state in ("pending", "ready", "warming"):
            skip(cfg.name, f"not measured by the deadline ({DEADLINE:.0f}s; state {cfg.state})")
    STOP.set()
    table = tbl.build(OUT)
    (OUT / "table.md").write_text(table + "\n")
    log("states: " + ", ".join(f"{c.name} {c.state}" for c in CONFIGS))
    rest = [c.name for c in CONFIGS if c.state not in ("done", "refused")]
    if rest:
        log(f"not measured; for another call: PARTS=\"{' '.join(rest)}\" bash bench/multi_gpu.sh")
    log(f"done in {now():.0f}s; table:\n{table}")
PY
