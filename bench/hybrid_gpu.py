"""Routed experts in host RAM next to one GPU (issue 10, deliverable 3): the mechanism's cost and
decode speed, in one run on the device.

    bash bench/hybrid_device.sh [--layers 8] [--threads 16] [--ncmoe 4] [--skip-gpu]   (builds, tests, runs this)
    PYTHONPATH=$PWD python bench/hybrid_gpu.py --out $OUT [same options]

1. Mechanism: a GPU-jitted chain of 58 host-expert custom calls (D2H of x/weights/ids, the CPU
   kernel from cudaLaunchHostFunc, H2D of the result) whose routing weights are all 0, so the CPU
   kernel reads no expert (a MoE layer with 0 work), against the same chain with the experts on
   the GPU (the all-GPU layer with the same zero work, through `ops.moe_experts`).
2. Model: `make-model --preset r1 --layers L --type Q4_0`; decode steps from an empty cache
   (N_KV ~0, like sweep-bench's first TG row), `-mla 3 -fa 1 -c 4096`, each step waits for its
   logits; with `-ot exps=CPU -t T`, `--n-cpu-moe N` and all on the GPU. One MoE layer's host experts timed alone
   (the same custom call, N = 1, real routing vs zero weights) say where a hybrid step's time goes.
3. `--sweep` (deliverable 4): sweep-bench `-c 4096 -ub 2048 -b 2048 -mla 3 -fa 1` on the same model,
   `-ot exps=CPU -t T` (2048-token prompt steps stream the pinned experts to the GPU layer by layer;
   decode runs them on the host) then all on the GPU, in one process; the pinned -> GPU copy rate of
   one expert tensor; the device's peak; with `--orders`, one PP step under each IKJAX_STREAM_ORDER.
Results: stdout and $OUT/hybrid_gpu.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ikjax  # noqa: F401  (first: it sets XLA flags before the backend starts)
import jax
import jax.numpy as jnp
import numpy as np
from ikjax.model.groups import all_layers

LINES: list[str] = []
OUT = Path(os.environ.get("OUT", "."))


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    (OUT / "hybrid_gpu.md").write_text("\n".join(LINES) + "\n")


def best_of(f, reps: int, rounds: int = 5) -> float:
    """Seconds per call: best round of `reps` back-to-back calls, each round waited for."""
    f().block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f()
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def mechanism(threads: int) -> None:
    from ikjax import ops
    from ikjax.placement.host import HostQuantArray
    from ikjax.quant.array import QuantArray
    from ikjax.quant.types import by_name
    q = by_name("Q8_0")
    E, F, d, k, L = 16, 256, 7168, 8, 58
    g = HostQuantArray(np.zeros((E, F, q.row_bytes(d)), np.uint8), q, (E, F, d))
    dn = HostQuantArray(np.zeros((E, d, q.row_bytes(F)), np.uint8), q, (E, d, F))
    gd = QuantArray(jnp.asarray(g.data), q, g.shape)
    dd = QuantArray(jnp.asarray(dn.data), q, dn.shape)
    w0 = jnp.zeros((1, k), jnp.float32)
    ids = jnp.tile(jnp.arange(k, dtype=jnp.int32)[None], (1, 1))
    x0 = jnp.ones((1, d), jnp.float32)

    def chain(gate, down):
        @jax.jit
        def f(x):
            with ops.kernel_context(threads=threads):  # read while tracing
                for _ in range(L):
                    x = x + ops.moe_experts(x, w0, ids, gate, gate, down, jnp.float32)
            return x
        return f
    @jax.jit
    def bare(x):  # one tiny GPU kernel per layer: the floor of any per-layer op
        for _ in range(L):
            x = jax.lax.optimization_barrier(x + x * w0[:, :1])
        return x
    host = chain(g, dn)
    dev = chain(ops.prepare_weight(gd), ops.prepare_weight(dd))
    t_host = best_of(lambda: host(x0), 20)
    t_dev = best_of(lambda: dev(x0), 20)
    t_bare = best_of(lambda: bare(x0), 20)
    say("## 1. The mechanism: a MoE layer with 0 work, 58 in one jitted GPU function")
    say("")
    say("| per layer | us | 58 layers, ms |")
    say("|---|---:|---:|")
    say(f"| host experts, weights 0 (custom call: D2H x/w/ids, CPU kernel via cudaLaunchHostFunc reading "
        f"no expert, H2D out) | {t_host / L * 1e6:.1f} | {t_host * 1e3:.2f} |")
    say(f"| GPU experts (`ops.moe_experts`, Pallas, {E} tiny device-resident Q8_0 experts) | "
        f"{t_dev / L * 1e6:.1f} | {t_dev * 1e3:.2f} |")
    say(f"| one elementwise GPU kernel | {t_bare / L * 1e6:.1f} | {t_bare * 1e3:.2f} |")
    say("")


def decode_tps(eng, n: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    V = eng.config.vocab_size
    cache = eng.new_cache(1)
    t0 = time.perf_counter()
    out, cache = eng.step(cache, rng.integers(0, V, (1, 1)), np.array([0]))
    out.block_until_ready()
    first = time.perf_counter() - t0  # compile + first step
    for i in range(1, 4):
        out, cache = eng.step(cache, rng.integers(0, V, (1, 1)), np.array([i]))
        out.block_until_ready()
    t0 = time.perf_counter()
    for i in range(4, 4 + n):
        out, cache = eng.step(cache, rng.integers(0, V, (1, 1)), np.array([i]))
        out.block_until_ready()
    return n / (time.perf_counter() - t0), first


def device_bytes_in_use() -> tuple[float, float]:
    s = jax.devices()[0].memory_stats() or {}
    return s.get("bytes_in_use", 0) / 2**30, s.get("peak_bytes_in_use", 0) / 2**30


def one_layer_host(eng, threads: int) -> tuple[float, float]:
    """ms of one MoE layer's host experts at N = 1 (8 random experts) and with zero weights."""
    from ikjax import ops
    cfg = eng.config
    lay = next(l for l in all_layers(eng.weights) if "gate_exps" in l)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, lay["gate_exps"].shape[2])), jnp.float32)
    k = cfg.n_expert_used
    out = {}
    for name, w in (("work", jnp.full((1, k), 1.0 / k, jnp.float32)), ("zero", jnp.zeros((1, k), jnp.float32))):
        rngs = [jnp.asarray(np.random.default_rng(s).choice(cfg.n_expert, k, replace=False)[None].astype(np.int32))
                for s in range(16)]
        @jax.jit
        def f(x, w, ids):
            with ops.kernel_context(threads=threads):
                return ops.moe_experts(x, w, ids, lay["gate_exps"], lay["up_exps"], lay["down_exps"],
                                           jnp.bfloat16)
        f(x, w, rngs[0]).block_until_ready()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for ids in rngs:  # fresh experts each call: read from DRAM, not a warm cache
                r = f(x, w, ids)
            r.block_until_ready()
            best = min(best, (time.perf_counter() - t0) / len(rngs))
        out[name] = best * 1e3
    return out["work"], out["zero"]


def model_runs(layers: int, threads: int, n: int, skip_gpu: bool, path: Path, ncmoe: int = 0) -> None:
    from ikjax.tools.synthetic import make_model
    if not path.exists():
        t0 = time.perf_counter()
        make_model(path, "r1", "Q4_0", layers=layers)
        say(f"made {path.name} ({path.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s")
    opts = dict(mla=3, fa=True, ctx=4096, ubatch=512, ctk="f16")
    say(f"## 2. Decode, `make-model --preset r1 --layers {layers} --type Q4_0`, "
        f"`-mla 3 -fa 1 -c 4096 -ctk f16`, steps from N_KV 0, {n} timed")
    say("")
    say("| run | load s | first step s (compile) | TG t/s | GPU GiB in use | plan: GPU weights GiB | plan: host weights GiB |")
    say("|---|---:|---:|---:|---:|---:|---:|")
    runs = [("-ot exps=CPU -t %d" % threads, dict(ot="exps=CPU", t=threads))]
    if ncmoe:
        runs.append((f"--n-cpu-moe {ncmoe} -t {threads}", dict(n_cpu_moe=ncmoe, t=threads)))
    if not skip_gpu:
        runs.append(("all on the GPU", {}))
    for label, extra in runs:
        t0 = time.perf_counter()
        eng = ikjax.load(path, **opts, **extra)
        load_s = time.perf_counter() - t0
        tps, first = decode_tps(eng, n)
        used, _ = device_bytes_in_use()
        plan = eng.memory_plan()
        say(f"| {label} | {load_s:.1f} | {first:.1f} | {tps:.1f} | {used:.2f} | "
            f"{(plan.weights_bytes - plan.host_weights_bytes) / 2**30:.2f} | {plan.host_weights_bytes / 2**30:.2f} |")
        if "ot" in extra and extra["ot"] == "exps=CPU":
            work, zero = one_layer_host(eng, threads)
            n_moe = sum(1 for l in all_layers(eng.weights) if "gate_exps" in l)
            say("")
            say(f"one MoE layer's host experts alone (one custom call, N = 1, {eng.config.n_expert_used} of "
                f"{eng.config.n_expert} experts, fresh ids each call, -t {threads}): {work:.2f} ms; the same call "
                f"with zero weights (no expert read): {zero:.3f} ms; x {n_moe} MoE layers = {work * n_moe:.1f} ms "
                f"of a {1e3 / tps:.1f} ms step")
            say("")
        del eng
        gc.collect()
        jax.clear_caches()
    say("")


def _proc(keys=("VmRSS", "VmLck", "VmPin")) -> str:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) / 2**20
    cached = next((int(l.split()[1]) / 2**20 for l in Path("/proc/meminfo").read_text().splitlines()
                   if l.startswith("Cached:")), 0.0)
    return ", ".join(f"{k} {v:.1f} GiB" for k, v in out.items()) + f", page cache {cached:.1f} GiB"


def _pp_step(eng, n_kv: int, reps: int = 2) -> float:
    """Seconds of one ub-token prompt step at N_KV (compiled before; best of `reps`)."""
    rng = np.random.default_rng(7)
    ub, V = eng.options.ubatch, eng.config.vocab_size
    cache = eng.new_cache(1)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out, cache = eng.step(cache, rng.integers(0, V, (1, ub)), np.array([n_kv]))
        out.block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def _step_temp_gib(eng, n_tokens: int) -> float:
    for (B, T, plan, _decode), exe in eng._executables.items():
        if T == n_tokens:
            ma = exe.memory_analysis()
            return ma.temp_size_in_bytes / 2**30 if ma is not None else float("nan")
    return float("nan")


def _stream_anatomy(eng) -> None:
    """What one 2048-token prompt step streams (IKJAX_STREAM=active): experts active per MoE layer,
    bytes copied over PCIe, copy runs, against the whole layers' bytes."""
    from ikjax import ops
    from pallas_kernels.moe_matmul import host as moe_host
    if not moe_host.available():
        return
    lay = [l for l in all_layers(eng.weights) if "gate_exps" in l]
    g, u, d = (lay[0][k] for k in ("gate_exps", "up_exps", "down_exps"))
    if ops.stream_mode(2048, g.shape[0], eng.config.n_expert_used) != "active":
        return
    slots = ops.stream_slots(g, u, d)
    E = g.shape[0]
    rounds = -(-E // slots)
    moe_host.stream_stats(reset=True)
    t = _pp_step(eng, 0, reps=0)
    st = moe_host.stream_stats(reset=True)
    whole = sum(l[k].nbytes for l in lay for k in ("gate_exps", "up_exps", "down_exps"))
    n = len(lay)  # one step: each MoE layer's batch once (rounds past the first run only if needed)
    say(f"  streaming (IKJAX_STREAM=active, {slots} experts a round, {rounds} rounds a layer): one PP step "
        f"{t * 1e3:.0f} ms; per MoE layer {st.get('active', 0) / n:.1f} of {E} experts active, "
        f"{st.get('bytes', 0) / 1e9:.2f} GB copied in {st.get('copies', 0)} runs, {st.get('calls', 0)} rounds run "
        f"over {n} MoE layers "
        f"(whole layers: {whole / 1e9:.2f} GB), {st.get('bytes', 0) / t / 1e9:.1f} GB/s over the step")


def sweep_runs(layers: int, threads: int, path: Path, tg: int, orders: bool, only: str = "", ncmoe: int = 0) -> None:
    """sweep-bench -c 4096 -ub 2048 -b 2048 -mla 3 -fa 1, all on the GPU then `-ot exps=CPU -t T`, in
    one process (the all-GPU run reads the file from the page cache before the hybrid load releases
    the experts' pages). The device's peak is the process's, so the hybrid run's device memory is
    its bytes in use plus the compiled prompt step's temp buffers (XLA's own plan of the step,
    which holds the streamed layers); the other stream orders come last."""
    from ikjax import ops
    from ikjax.tools import sweep_bench
    from ikjax.tools.synthetic import make_model
    from jax.sharding import SingleDeviceSharding
    if not path.exists():
        t0 = time.perf_counter()
        make_model(path, "r1", "Q4_0", layers=layers)
        say(f"made {path.name} ({path.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s")
    opts = dict(mla=3, fa=True, ctx=4096, ubatch=2048, batch=2048, ctk="f16")
    say(f"## 3. sweep-bench `-c 4096 -ub 2048 -b 2048 -mla 3 -fa 1 -ctk f16`, TG {tg} tokens a row, "
        f"`make-model --preset r1 --layers {layers} --type Q4_0`")
    say("")
    say(f"host before loading: {_proc()}")
    rows, keep = [], None
    runs = {"gpu": ("all on the GPU", {}), "hybrid": (f"-ot exps=CPU -t {threads}", dict(ot="exps=CPU", t=threads))}
    if ncmoe:
        runs["ncmoe"] = (f"--n-cpu-moe {ncmoe} -t {threads}", dict(n_cpu_moe=ncmoe, t=threads))
    # `only`: runs in their own process (their device peak and host memory are their own)
    runs = tuple(runs[k] for k in (only.split(",") if only else runs))
    for label, extra in runs:
        t0 = time.perf_counter()
        eng = ikjax.load(path, **opts, **extra)
        load_s = time.perf_counter() - t0
        used_load, _ = device_bytes_in_use()
        say(f"{label}: loaded in {load_s:.1f} s, GPU {used_load:.2f} GiB in use; host: {_proc()}")
        if "ot" in extra:
            lay = next(l for l in all_layers(eng.weights) if "gate_exps" in l)
            g = lay["gate_exps"]
            say(f"  experts: {g!r}, min_batch {g.min_batch}: stream from "
                f"{g.min_batch * eng.config.n_expert // eng.config.n_expert_used} tokens a step")
            dev = SingleDeviceSharding(jax.devices()[0], memory_kind="device")
            best = float("inf")
            for _ in range(3):
                t1 = time.perf_counter()
                d = jax.device_put(g.data, dev)
                d.block_until_ready()
                best = min(best, time.perf_counter() - t1)
                del d
            say(f"  one expert tensor pinned host -> GPU, outside a step: {g.nbytes / best / 1e9:.1f} GB/s "
                f"({g.nbytes / 1e9:.2f} GB in {best * 1e3:.1f} ms)")
        try:
            c = sweep_bench.precompile(eng, tg)
            say(f"  compiled {len(sweep_bench.step_shapes(eng, tg))} steps in {c:.0f} s; PP step temp "
                f"{_step_temp_gib(eng, 2048):.2f} GiB")
            res = list(sweep_bench.run(eng, tg=tg))
        except Exception as e:  # say what failed; the other run and the other orders still run
            import traceback
            traceback.print_exc()
            say(f"  FAILED: {type(e).__name__}: {str(e)[:600]}")
            if "ot" in extra and orders:
                keep = eng
            del eng
            continue
        used, peak = device_bytes_in_use()
        temp = _step_temp_gib(eng, 2048)
        peak = used + temp
        say(f"  moe_experts of the last traced step: {ops.selected('moe_experts')}; GPU after the sweep "
            f"{used:.2f} GiB in use + PP step temp {temp:.2f} GiB = {peak:.2f} GiB (process peak so far "
            f"{device_bytes_in_use()[1]:.2f} GiB); host: {_proc()}")
        say("")
        say(sweep_bench.HEADER)
        say(sweep_bench.SEPARATOR)
        for r in res:
            say(r.markdown())
        say("")
        if "ot" in extra:
            _stream_anatomy(eng)
        rows.append((label, res, peak))
        if "ot" in extra and orders:
            keep = eng
        del eng
        gc.collect()
        jax.clear_caches()
    say("| run | S_PP N_KV 0 | S_PP N_KV 2048 | S_TG N_KV 0 | S_TG N_KV 2048 | GPU GiB (in use + PP temp) |")
    say("|---|---:|---:|---:|---:|---:|")
    for label, res, peak in rows:
        pp = " | ".join(f"{r.speed_pp:.0f}" for r in res[:2])
        tgs = " | ".join(f"{r.speed_tg:.1f}" for r in res[:2])
        say(f"| {label} | {pp} | {tgs} | {peak:.2f} |")
    say("| ik_llama.cpp `-ot exps=CPU -t 16`, H200 (issue 10) | 6.0k | 8.5k | 57 | | 2.2 weights + 4.3 compute |")
    say("")
    if keep is not None:
        eng = keep
        say(f"Other stream orders, one 2048-token PP step at N_KV 0 (`-ot exps=CPU -t {threads}`):")
        for order in ("self", "free") if os.environ.get("HYBRID_ORDERS", "1") == "1" else ():
            os.environ["IKJAX_STREAM_ORDER"] = order
            os.environ["IKJAX_STREAM"] = "layer"  # the orders are the whole-layer copy's
            eng._executables.clear()
            eng._compiled.clear()
            jax.clear_caches()
            try:
                t1 = time.perf_counter()
                eng.precompile(1, 2048, 2048)
                comp = time.perf_counter() - t1
                t = _pp_step(eng, 0)
                say(f"  IKJAX_STREAM_ORDER={order}: PP 2048 at N_KV 0 {t * 1e3:.0f} ms = {2048 / t:.0f} t/s "
                    f"(compile {comp:.0f} s, step temp {_step_temp_gib(eng, 2048):.2f} GiB)")
            except Exception as e:  # report and go on: the default order's numbers stand
                say(f"  IKJAX_STREAM_ORDER={order}: failed: {type(e).__name__}: {str(e)[:300]}")
        os.environ.pop("IKJAX_STREAM_ORDER", None)
        os.environ["IKJAX_STREAM"] = "layer"  # the whole-layer copy, for comparison
        eng._executables.clear()
        eng._compiled.clear()
        jax.clear_caches()
        try:
            eng.precompile(1, 2048, 2048)
            t = _pp_step(eng, 0)
            say(f"  IKJAX_STREAM=layer: PP 2048 at N_KV 0 {t * 1e3:.0f} ms = {2048 / t:.0f} t/s "
                f"(step temp {_step_temp_gib(eng, 2048):.2f} GiB)")
        except Exception as e:
            say(f"  IKJAX_STREAM=layer: failed: {type(e).__name__}: {str(e)[:300]}")
        os.environ.pop("IKJAX_STREAM", None)
        say("")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default="/tmp/r1-L{layers}-Q4_0.gguf")
    ap.add_argument("--skip-gpu", action="store_true", help="no all-GPU run (it loads the whole file on the GPU)")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--ncmoe", type=int, default=4, help="also a --n-cpu-moe N run (0: none)")
    ap.add_argument("--sweep", action="store_true",
                    help="only the sweep-bench runs (-ub 2048: big batches stream the experts, deliverable 4)")
    ap.add_argument("--tg", type=int, default=512, help="TG tokens per sweep row (ik: ub/4)")
    ap.add_argument("--orders", action="store_true",
                    help="also time one PP step with IKJAX_STREAM=layer, and (unless HYBRID_ORDERS=0) under its "
                         "other stream orders")
    ap.add_argument("--only", default="", help="--sweep: these runs only, comma-separated: gpu, hybrid, ncmoe")
    ap.add_argument("--sweep-ncmoe", action="store_true", help="--sweep: also a --n-cpu-moe NCMOE run")
    args = ap.parse_args()
    global OUT
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    say(f"# Hybrid decode: {jax.devices()[0].device_kind}, {os.cpu_count()} host cores, jax {jax.__version__}")
    say("")
    if args.sweep:
        sweep_runs(args.layers, args.threads, Path(args.model.format(layers=args.layers)), args.tg, args.orders, args.only,
                   args.ncmoe if args.sweep_ncmoe else 0)
        return
    mechanism(args.threads)
    if not args.skip_model:
        model_runs(args.layers, args.threads, args.steps, args.skip_gpu,
                   Path(args.model.format(layers=args.layers)), args.ncmoe)


if __name__ == "__main__":
    main()
