"""Where the GPU decode loop's time goes, kernel by kernel (issue 22: the scanned layers against the
unrolled ones). Loads MODEL at sweep-bench's shape, runs the decode loop (TG tokens a dispatch, as
sweep-bench's TG rows) a few times, then once under jax.profiler, and sums the GPU's kernels by
name (numbers folded): the wall time a token against the kernels' busy time shows the gaps; the
kernel table shows what a form adds.

    IKJAX_LAYERS=unroll python3 bench/gpu_decode_profile.py MODEL.gguf [--ctx 4096 --tg 64 --kv 512]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_trace import gpu_kernels, host_events  # noqa: E402


def cuda_limits(set_stack: int | None = None) -> dict:
    """The CUDA primary context's per-thread stack (local memory) and heap limits, through the
    driver API (ctypes): a kernel that needs more local memory than the context holds grows it at
    launch, and since CUDA 11 it never shrinks back (CU_CTX_LMEM_RESIZE_TO_MAX is the default)."""
    import ctypes
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {}
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    if cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return {}
    cu.cuCtxPushCurrent(ctx)
    try:
        if set_stack is not None:
            rc = cu.cuCtxSetLimit(0, ctypes.c_size_t(set_stack))
            print(f"cuCtxSetLimit(STACK_SIZE, {set_stack}) -> {rc}")
        out = {}
        for name, k in (("stack", 0), ("printf", 1), ("heap", 2)):
            v = ctypes.c_size_t()
            cu.cuCtxGetLimit(ctypes.byref(v), k)
            out[name] = v.value
        return out
    finally:
        cu.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))
        cu.cuDevicePrimaryCtxRelease(dev)


_LOCAL_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry biglocal(.param .u64 p_out, .param .u32 p_n)
{
    .local .align 16 .b8 depot[%(bytes)d];
    .reg .b32 %%r<8>;
    .reg .b64 %%rd<10>;
    mov.u64 %%rd1, depot;
    ld.param.u64 %%rd2, [p_out];
    ld.param.u32 %%r1, [p_n];
    mov.u32 %%r2, %%tid.x;
    add.u32 %%r3, %%r1, %%r2;
    and.b32 %%r3, %%r3, %(mask)d;
    mul.wide.u32 %%rd3, %%r3, 4;
    add.u64 %%rd4, %%rd1, %%rd3;
    st.local.u32 [%%rd4], %%r2;
    xor.b32 %%r5, %%r3, 1;
    mul.wide.u32 %%rd8, %%r5, 4;
    add.u64 %%rd9, %%rd1, %%rd8;
    ld.local.u32 %%r4, [%%rd9];
    cvta.to.global.u64 %%rd5, %%rd2;
    mul.wide.u32 %%rd6, %%r2, 4;
    add.u64 %%rd7, %%rd5, %%rd6;
    st.global.u32 [%%rd7], %%r4;
    ret;
}
"""


def big_local_kernel(nbytes: int, unload: bool) -> str:
    """A kernel of `nbytes` of local memory a thread launched once through the driver API in JAX's
    context (its module kept loaded unless `unload`): whether a context's grown local-memory
    reservation is the state a T >= 2 step's program leaves for the scanned decode (§22aq)."""
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    cu.cuCtxPushCurrent(ctx)
    try:
        mod, fn, buf = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
        ptx = (_LOCAL_PTX % {"bytes": nbytes, "mask": nbytes // 4 - 1}).encode() + b"\0"
        rc = cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(ptx))
        if rc:
            return f"cuModuleLoadData -> {rc}"
        cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"biglocal")
        local = ctypes.c_int()
        cu.cuFuncGetAttribute(ctypes.byref(local), 3, fn)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
        cu.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(4096))
        n = ctypes.c_uint32(1)
        params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(buf), ctypes.c_void_p),
                                       ctypes.cast(ctypes.byref(n), ctypes.c_void_p))
        rc = cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, params, None)
        rc2 = cu.cuCtxSynchronize()
        if unload:
            cu.cuModuleUnload(mod)
        else:
            big_local_kernel.kept = mod
        return f"local {local.value} B a thread, launch {rc}, sync {rc2}, {'unloaded' if unload else 'kept'}"
    finally:
        cu.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--kv", type=int, default=512, help="the cache position the tokens start at")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--interleave", action="store_true",
                    help="a 512-token prompt step before each decode call, as sweep-bench's rows (only the decode timed)")
    ap.add_argument("--interleave-tokens", type=int, default=512,
                    help="--interleave's prompt step length (2048 at -ub 2048: with -ot, a batch that streams the experts "
                         "to the GPU, as sweep-bench's PP rows; 512 is computed by the host kernel)")
    ap.add_argument("--prefill", action="store_true",
                    help="one 512-token prompt step first, then the decode calls back to back: a cache of real "
                         "rows (tokens routed as after a prompt) without a prompt step between the calls")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="the prefill's tokens (ending at --kv)")
    ap.add_argument("--other", choices=("compile", "trivial", "matmul", "matmulkeep", "dot2keep", "discard", "random", "step1", "headdot", "headrows", "step2idle",
                                        "step2all", "batch2"), help="what else runs before the calls")
    ap.add_argument("--other-after", action="store_true", help="--other after the --prefill, not before")
    ap.add_argument("--decode-first", action="store_true", help="one decode call before the prefill")
    ap.add_argument("--after", choices=("copyweights", "clear", "both", "stack", "dropdecode", "dropprompt"),
                    help="after the --prefill: the weights copied into new buffers (copyweights), or every compiled "
                         "program dropped and the decode loaded again (clear: the prompt step's modules unloaded)")
    ap.add_argument("--big-local", type=int, default=0,
                    help="launch a kernel of this many bytes of local memory a thread before the calls (driver API)")
    ap.add_argument("--big-local-unload", action="store_true", help="--big-local's module unloaded after its launch")
    ap.add_argument("--cpu-moe", action="store_true", help="routed experts in host RAM (-ot exps=CPU): a hybrid token")
    ap.add_argument("--threads", type=int, default=0, help="-t for the host experts (0: all cores)")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--gpu-experts", default="", help="with --cpu-moe: --gpu-experts auto|N from --expert-counts")
    ap.add_argument("--expert-counts", default="", help="an --expert-stats JSON file (read only: this run counts nothing)")
    ap.add_argument("--count", action="store_true", help="count expert statistics (what --expert-stats turns on)")
    a = ap.parse_args()
    os.environ.setdefault("IKJAX_COMPILE_CACHE", tempfile.mkdtemp(prefix="cc-dprof-"))
    import jax
    import numpy as np

    import ikjax
    if os.environ.get("DPROF_MAX_STACK"):  # layer groups whose stacked tensors stay under this many bytes
        from ikjax import ops
        limit = int(float(os.environ["DPROF_MAX_STACK"]))
        ops.pallas_stack_limit = lambda: limit
    if os.environ.get("DPROF_PROMPT_OPTIONS"):  # XLA compile options for the prompt steps only, §22aq:
        # "name=value,name=value" (true / false / integers as such)
        from ikjax.runtime import executables

        def value(v: str):
            return {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
        extra = {k: value(v) for k, v in (kv.split("=", 1) for kv in os.environ["DPROF_PROMPT_OPTIONS"].split(","))}
        real = executables.gpu_options

        def prompt_options(plan, decode, gpu=True):
            out = real(plan, decode, gpu)
            return out if decode or not gpu else {**(out or {}), **extra}
        executables.gpu_options = prompt_options
    if os.environ.get("DPROF_NO_CMDBUF"):  # every kernel on its own in the profile (no CUDA graph hides them)
        from ikjax.runtime import executables
        executables._DECODE_GPU_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
    eng = ikjax.load(a.model, ctx=a.ctx, ubatch=a.ubatch, mla=3, flash_attn=True, cpu_moe=a.cpu_moe, threads=a.threads,
                      expert_stats=a.count, **({"gpu_experts": a.gpu_experts, "expert_counts": a.expert_counts} if a.gpu_experts else {}))
    if a.gpu_experts:
        print(eng.gpu_experts_note)
    eng.precompile_decode(1, a.tg, a.kv + a.tg)
    rng = np.random.default_rng(0)
    cache = eng.new_cache(1)
    if a.decode_first:  # the decode loop's first call (its graph recorded) before anything else runs
        out, cache = eng.decode(cache, rng.integers(0, eng.config.vocab_size, (1,)), [a.kv], a.tg)
        jax.block_until_ready(out)
    if a.other_after and a.prefill:  # the prefill first, then the other program
        out, cache = eng.step(cache, rng.integers(0, eng.config.vocab_size, (1, a.prefill_tokens)),
                              np.array([a.kv - a.prefill_tokens]))
        out.block_until_ready()
        a.prefill = False
    if a.other == "compile":  # the prompt step compiled (and its kernels loaded), never run
        eng.precompile(1, 512, a.kv)
    elif a.other == "trivial":  # some other XLA GPU program, not ours
        jax.block_until_ready(jax.jit(lambda v: (v * 2 + 1).sum())(jax.numpy.ones((1 << 26,))))
    elif a.other in ("matmulkeep", "dot2keep"):  # as matmul / a two-row product, its program kept loaded
        import jax.numpy as jnp
        shape = ((8192, 8192), (8192, 8192)) if a.other == "matmulkeep" else ((2, 2048), (2048, 3072))
        x, y = jnp.ones(shape[0], jnp.bfloat16), jnp.ones(shape[1], jnp.bfloat16)
        main.kept = jax.jit(lambda u, v: (u @ v).sum()).lower(x, y).compile()
        jax.block_until_ready(main.kept(x, y))
    elif a.other == "matmul":  # a large product on the matrix unit (what a prompt step is mostly made of)
        m = jax.numpy.ones((8192, 8192), jax.numpy.bfloat16)
        jax.block_until_ready(jax.jit(lambda v: (v @ v).sum())(m))
    if a.other == "discard":  # a prompt step run on a cache of its own, thrown away: ours stays zeros
        out, _ = eng.step(eng.new_cache(1), rng.integers(0, eng.config.vocab_size, (1, 512)), np.array([0]))
        out.block_until_ready()
    elif a.other == "step1":  # a one-token forward (decode-sized kernels) on a cache of its own
        out, _ = eng.step(eng.new_cache(1), rng.integers(0, eng.config.vocab_size, (1, 1)), np.array([0]))
        out.block_until_ready()
    elif a.other in ("headdot", "headrows"):  # the output head's product alone: 512 rows (dot tiles) or 1 (rows)
        from ikjax import ops
        w = eng.weights["output"]
        rows = 512 if a.other == "headdot" else 1
        x = jax.numpy.ones((rows, eng.config.d_model), jax.numpy.bfloat16)
        jax.block_until_ready(jax.jit(lambda v: ops.quant_linear(v, w, jax.numpy.bfloat16))(x))
    elif a.other == "step2idle":  # a two-token step whose tokens route to no expert (last = -1: an idle row)
        out, _ = eng.step(eng.new_cache(1), rng.integers(0, eng.config.vocab_size, (1, 2)), np.array([0]),
                          last=np.array([-1]))
        out.block_until_ready()
    elif a.other == "step2all":  # a two-token step keeping every row's logits (the head on all rows, no gather)
        out, _ = eng.step(eng.new_cache(1), rng.integers(0, eng.config.vocab_size, (1, 2)), np.array([0]),
                          all_logits=True)
        out.block_until_ready()
    elif a.other == "batch2":  # the decode loop for a batch of two (the server's batched decode), a call
        c2 = eng.new_cache(2)
        out, _ = eng.decode(c2, rng.integers(0, eng.config.vocab_size, (2,)), [a.kv, a.kv], a.tg)
        jax.block_until_ready(out)
    elif a.other == "random":  # the cache filled with random values by a plain program: rows, no prompt step
        keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(cache))))
        cache = jax.tree.map(lambda c: (jax.random.normal(next(keys), c.shape, jax.numpy.float32) * 0.5).astype(c.dtype)
                             if jax.numpy.issubdtype(c.dtype, jax.numpy.floating) else c, cache)
        jax.block_until_ready(cache)
    if a.big_local:
        print(f"big-local kernel: {big_local_kernel(a.big_local, a.big_local_unload)}")
    limits_before = cuda_limits()
    print(f"cuda limits before the prefill: {limits_before}")
    if a.prefill:
        n = a.prefill_tokens
        out, cache = eng.step(cache, rng.integers(0, eng.config.vocab_size, (1, n)), np.array([a.kv - n]))
        out.block_until_ready()
    print(f"cuda limits after the prefill: {cuda_limits()}")
    if a.after == "stack" and limits_before:
        print(f"cuda limits after setting the stack back: {cuda_limits(limits_before['stack'])}")
    if a.after in ("copyweights", "both"):
        import jax.numpy as jnp
        eng.weights = jax.tree.map(lambda x: jnp.array(x, copy=True), eng.weights)
        jax.block_until_ready(eng.weights)
        import gc
        gc.collect()
    if a.after in ("clear", "both"):
        import gc
        eng._steps.forget_all()
        jax.clear_caches()
        gc.collect()
        eng.precompile_decode(1, a.tg, a.kv + a.tg)
        print(f"cuda limits after clearing: {cuda_limits()}")
    if a.after in ("dropdecode", "dropprompt"):
        import gc
        steps = eng._steps
        with steps._lock:
            for k in [k for k in steps.table if (k[3] is None) == (a.after == "dropprompt")]:
                del steps.table[k]
        jax.clear_caches()
        gc.collect()
        eng.precompile_decode(1, a.tg, a.kv + a.tg)
        print(f"after {a.after}: {len(steps.table)} step(s) kept")
    moved = collections.Counter()

    def ptrs(c):
        return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(c)]

    def run(cache):
        """-> (cache, seconds of the decode call)"""
        if a.interleave:
            before = ptrs(cache)
            out, cache = eng.step(cache, rng.integers(0, eng.config.vocab_size, (1, a.interleave_tokens)), np.array([0]))
            out.block_until_ready()
            moved["prompt step"] += sum(x != y for x, y in zip(before, ptrs(cache)))
        before = ptrs(cache)
        t = time.perf_counter()
        out, cache = eng.decode(cache, rng.integers(0, eng.config.vocab_size, (1,)), [a.kv], a.tg)
        jax.block_until_ready(out)
        dt = time.perf_counter() - t
        moved["decode"] += sum(x != y for x, y in zip(before, ptrs(cache)))
        return cache, dt
    for _ in range(3):
        cache, _ = run(cache)
    reps = 5
    spent = 0.0
    for _ in range(reps):
        cache, dt = run(cache)
        spent += dt
    wall = spent / reps / a.tg
    from ikjax.ops import moe as moe_ops
    moe_ops.host_kernel_stats(reset=True)
    d = tempfile.mkdtemp(prefix="dprof-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        cache, _ = run(cache)
    tot, cnt = collections.Counter(), collections.Counter()
    spans = []
    for e in gpu_kernels(d):
        name = re.sub(r"[._]?\d+$", "", e["name"])[:90]
        tot[name] += e["dur"]
        cnt[name] += 1
        spans.append((e["ts"], e["ts"] + e["dur"]))
    busy = sum(tot.values()) / a.tg
    spans.sort()
    span = (spans[-1][1] - spans[0][0]) / a.tg if spans else 0.0
    print(f"{os.environ.get('IKJAX_LAYERS', 'auto')}: {wall * 1e6:.0f} us a token wall ({1 / wall:.1f} t/s), "
          f"kernels busy {busy:.0f} us a token, first kernel to last {span:.0f} us a token, "
          f"{sum(cnt.values()) / a.tg:.0f} kernels a token; cache buffers moved by the calls: {dict(moved)}"
          f"{' (a prompt step before each)' if a.interleave else ''}{' (cache prefilled once)' if a.prefill else ''}")
    for n, t in tot.most_common(a.top):
        print(f"  {t / a.tg:8.1f} us  {cnt[n] / a.tg:6.1f}x  {n}")
    hs = moe_ops.host_kernel_stats()
    if hs.get("small_calls"):  # the host experts' kernel inside the profiled call (-ot: a hybrid token)
        print(f"host experts kernel: {hs['small_ns'] / 1e3 / a.tg:.0f} us a token in {hs['small_calls'] / a.tg:.1f} "
              f"calls ({hs['small_bytes'] / max(hs['small_ns'], 1):.1f} GB/s of experts; handed over by {hs['host_call']})")
    # the host's side of the same call: XLA's thunks and the CUDA API calls (a graph update or a
    # re-record a token would show here, not among the kernels)
    htot, hcnt = collections.Counter(), collections.Counter()
    for e in host_events(d):
        name = re.sub(r"[._]?\d+$", "", e["name"])[:90]
        htot[name] += e.get("dur", 0)
        hcnt[name] += 1
    print("host events (us a token, count a token):")
    for n, t in htot.most_common(a.top):
        print(f"  {t / a.tg:8.1f} us  {hcnt[n] / a.tg:6.2f}x  {n}")
    # gaps between consecutive kernels: idle GPU time a token, and the largest gaps
    gaps = sorted((b[0] - e0 for (_, e0), b in zip(spans, spans[1:]) if b[0] > e0), reverse=True)
    print(f"GPU idle between kernels: {sum(gaps) / a.tg:.0f} us a token; largest gaps (us): "
          f"{[round(g) for g in gaps[:12]]}; gaps > 5 us: {sum(g > 5 for g in gaps) / a.tg:.1f} a token")


if __name__ == "__main__":
    main()
