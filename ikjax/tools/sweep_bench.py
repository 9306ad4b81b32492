"""sweep-bench as ik_llama.cpp runs it (SPEC §4): PP and TG speed as the KV cache fills.

For n_kv = 0, ub, 2ub, ... while n_kv + ub <= c: generate `tg` tokens at positions n_kv.. (timed),
drop them (the next step simply starts at n_kv again: later rows are masked), then process `ub`
random tokens at n_kv (timed). A row's `ub` is ik's `-ub` as given (the PP column): ik feeds the
row's tokens to llama_decode in `-b`-sized calls and each call is computed in micro-batches of
min(b, ub) tokens, so `-ub 4096 -b 2048` gives rows of PP 4096 run as two 2048-token steps. Here
the row runs in compiled steps of min(ub, b) tokens (the engine's `ubatch`), the same split.

The `tg` tokens are generated as `generate` does, each step feeding the token the last one picked
(greedy), all of them in one dispatch where the engine decodes in a loop (Engine.decode_loop;
IKJAX_DECODE_LOOP=0: one dispatch and host round trip per token, as ik's sweep-bench, which feeds
random tokens). Every step shape a row runs is compiled before that row's timers start; compile
time is reported separately. `nrep` (ik's `-nrep`) repeats the first row's TG and PP that many
times and reports the mean, as ik's sweep-bench does; `stride` (ik's `--sweep-stride`) measures and
prints only every Nth row; `memory` (ik's `--sweep-memory`) adds the process's RSS high-water mark
and the accelerator memory in use since the start to each row.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ikjax.errors import OptionError
from ikjax.ops import registry
from ikjax.runtime.executables import compile_side_by_side
from ikjax.runtime.memory_plan import cache_capacity

HEADER = "|%6s | %6s | %6s | %8s | %8s | %8s | %8s |" % (
    "PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")
SEPARATOR = "|%6s-|-%6s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|" % (
    "------", "------", "------", "--------", "--------", "--------", "--------")
# with --sweep-memory (ik's column names and widths)
HEADER_MEMORY = HEADER + " %10s | %10s |" % ("RSS HWM", "VRAM delta")
SEPARATOR_MEMORY = SEPARATOR[:-1] + "|-%10s-|-%10s-|" % ("----------", "----------")
ROW = "|%6d | %6d | %6d | %8.3f | %8.2f | %8.3f | %8.2f |"
JSONL = ('{"n_kv_max": %d, "n_batch": %d, "n_ubatch": %d, "flash_attn": %d, "n_gpu_layers": %d, '
         '"n_threads": %d, "n_threads_batch": %d, "pp": %d, "tg": %d, "n_kv": %d, "t_pp": %f, '
         '"speed_pp": %f, "t_tg": %f, "speed_tg": %f }')
JSONL_KEYS = ("n_kv_max", "n_batch", "n_ubatch", "flash_attn", "n_gpu_layers", "n_threads", "n_threads_batch",
              "pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg")
JSONL_MEMORY_KEYS = ("rss_hwm_mib", "vram_delta_mib")


def _mib(value: float, precision: int, missing: str) -> str:
    """ik's format_mib: a negative value means 'not measured here'."""
    return missing if value < 0 else "%.*f" % (precision, value)


def rss_hwm_mib() -> float:
    """The process's resident-set high-water mark in MiB (getrusage ru_maxrss, KiB on Linux), as
    ik's --sweep-memory reports it; -1 where getrusage is unavailable."""
    try:
        import resource
    except ImportError:  # Windows: ik reports n/a there too
        return -1.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class MemoryTracker:
    """ik's VRAM delta: accelerator memory in use now minus at `start()` (taken before the model
    loads), summed over this process's devices, in MiB; -1 (printed n/a / null) on CPU, where ik
    reports no VRAM either. ik reads the driver's free memory; XLA reserves most of a GPU's memory
    up front, so that number would say nothing here: the allocator's `bytes_in_use` is what the
    weights, cache and buffers actually hold."""

    def __init__(self) -> None:
        self.baseline: list[int] | None = None

    @staticmethod
    def _in_use() -> list[int] | None:
        import jax
        out = []
        for d in jax.local_devices():
            if d.platform == "cpu":
                return None
            stats = d.memory_stats() or {}
            if "bytes_in_use" not in stats:
                return None
            out.append(int(stats["bytes_in_use"]))
        return out or None

    def start(self) -> None:
        self.baseline = self._in_use()

    def sample(self) -> float:
        now = self._in_use() if self.baseline is not None else None
        if now is None or self.baseline is None:
            return -1.0
        return sum(max(n - b, 0) for n, b in zip(now, self.baseline)) / (1024.0 * 1024.0)


@dataclass(frozen=True)
class RunInfo:
    """The run-wide fields of ik's jsonl rows and its `main: n_kv_max = ...` line."""
    n_kv_max: int
    n_batch: int
    n_ubatch: int
    flash_attn: int
    n_gpu_layers: int
    n_threads: int
    n_threads_batch: int

    @classmethod
    def of(cls, eng, ubatch: int | None = None) -> "RunInfo":
        """`ubatch`: the -ub as given (ik prints it unclamped; the engine's is min(ub, b))."""
        o = eng.options
        threads = o.threads or registry.default_threads()  # the kernels' -t 0: the affinity's cores
        return cls(sweep_ctx(o), o.batch, o.ubatch if ubatch is None else ubatch, int(o.fa), o.ngl, threads,
                   o.threads_batch or threads)

    def banner(self) -> str:
        return ("main: n_kv_max = %d, n_batch = %d, n_ubatch = %d, flash_attn = %d, n_gpu_layers = %d, "
                "n_threads = %d, n_threads_batch = %d" % (self.n_kv_max, self.n_batch, self.n_ubatch,
                                                           self.flash_attn, self.n_gpu_layers, self.n_threads,
                                                           self.n_threads_batch))


@dataclass(frozen=True)
class SweepRow:
    pp: int
    tg: int
    n_kv: int
    t_pp: float
    t_tg: float
    rss_hwm_mib: float | None = None  # set with --sweep-memory (-1: not measurable here)
    vram_delta_mib: float | None = None

    @property
    def speed_pp(self) -> float:
        return self.pp / self.t_pp if self.t_pp > 0 else 0.0

    @property
    def speed_tg(self) -> float:
        # TG 0 (ub < 4): ik divides 0 by ~0 s; 0 t/s says the same without a nan in the JSONL
        return self.tg / self.t_tg if self.t_tg > 0 else 0.0

    @property
    def has_memory(self) -> bool:
        return self.rss_hwm_mib is not None

    def markdown(self) -> str:
        line = ROW % (self.pp, self.tg, self.n_kv, self.t_pp, self.speed_pp, self.t_tg, self.speed_tg)
        if self.has_memory:
            line += " %10s | %10s |" % (_mib(self.rss_hwm_mib, 1, "n/a"), _mib(self.vram_delta_mib, 1, "n/a"))
        return line

    def jsonl(self, info: RunInfo) -> str:
        line = JSONL % (info.n_kv_max, info.n_batch, info.n_ubatch, info.flash_attn, info.n_gpu_layers,
                        info.n_threads, info.n_threads_batch, self.pp, self.tg, self.n_kv, self.t_pp,
                        self.speed_pp, self.t_tg, self.speed_tg)
        if self.has_memory:
            line = line[:-2] + ', "rss_hwm_mib": %s, "vram_delta_mib": %s }' % (
                _mib(self.rss_hwm_mib, 3, "null"), _mib(self.vram_delta_mib, 3, "null"))
        return line


def sweep_points(ctx: int, ubatch: int) -> list[int]:
    """The N_KV values of the sweep: 0, ub, 2ub, ... while n_kv + ub <= ctx."""
    return list(range(0, ctx - ubatch + 1, ubatch)) if ubatch <= ctx else []


def sweep_ctx(options) -> int:
    """The context ik's sweep-bench sweeps and prints as n_kv_max: -c padded as llama_context pads
    n_ctx (to 256 with flash attention, 32 without: llama_kv_cache::get_padding), so `-c 500 -ub
    128 -fa 1` sweeps 4 rows as ik does, not 3; never past the cache (`cache_capacity`: -c in
    whole KV blocks, 256 unless -kvb says otherwise)."""
    pad = 256 if options.fa else 32
    return min(-(-options.ctx // pad) * pad, cache_capacity(options))


def measured_points(ctx: int, ubatch: int, stride: int = 1) -> list[int]:
    """The rows ik measures and prints with --sweep-stride N: every Nth of `sweep_points`, from the first."""
    return sweep_points(ctx, ubatch)[::stride]


def check_tg_room(ctx: int, capacity: int, pp: int, tg: int, stride: int = 1) -> None:
    """Refuse, before anything loads or runs, a TG count that the last measured row cannot hold:
    its tokens go at N_KV .. N_KV + tg - 1, which must lie inside the KV cache (`capacity`: -c
    in whole KV blocks, as ik pads n_ctx). ik's sweep-bench stops at that row with "llama_decode()
    failed"; here the run would end in the middle with the engine's error, after the rows before
    it, so the one line comes first. The default tg (ub/4) always fits: every row's N_KV + ub
    lies within -c."""
    points = measured_points(ctx, pp, stride)
    if points and points[-1] + tg > capacity:
        last = points[-1]
        raise OptionError(f"-n {tg}: the last row (N_KV {last}) would generate up to position {last + tg - 1}, "
                          f"past the KV cache ({capacity} rows for -c {ctx}); use -n {capacity - last} or less, "
                          f"or a larger -c")


def _pp_chunks(eng, pp: int) -> list[int]:
    """A row's `pp` tokens as the compiled steps that process them: min(ub, b)-token steps (the
    engine's ubatch; ik's -b-sized llama_decode calls, each one micro-batch of min(b, ub)) and the
    remainder."""
    step = min(pp, eng.options.ubatch)
    return [step] * (pp // step) + ([pp % step] if pp % step else [])


def _row_steps(eng, tg: int, pp: int, n_kv: int) -> list[tuple[str, int, int]]:
    """(kind, n_tokens, kv_needed) of each step the row at n_kv runs, in order: kind "loop" is the
    tg-token decode loop in one dispatch (kv_needed: its last step's), "step" one compiled step."""
    out: list[tuple[str, int, int]] = []
    if tg and eng.decode_loop():
        out.append(("loop", 1, n_kv + tg))
    else:
        out += [("step", 1, n_kv + i + 1) for i in range(tg)]
    off = n_kv
    for n in _pp_chunks(eng, pp):
        off += n
        out.append(("step", n, off))
    return out


def _key(eng, kind: str, n_tokens: int, kv_needed: int) -> tuple[str, int, int]:
    """What tells two steps' executables apart."""
    return kind, n_tokens, eng.kv_bucket(kv_needed, n_tokens)


def _shapes(eng, tg: int, pp: int | None, n_kv: int | None, stride: int) -> list[tuple[str, int, int]]:
    pp = eng.options.ubatch if pp is None else pp
    seen: dict[tuple[str, int, int], tuple[str, int, int]] = {}
    points = measured_points(sweep_ctx(eng.options), pp, stride) if n_kv is None else [n_kv]
    for p in points:
        for kind, n, kv in _row_steps(eng, tg, pp, p):
            seen.setdefault(_key(eng, kind, n, kv), (kind, n, kv))
    return sorted(seen.values(), key=lambda s: (eng.kv_bucket(s[2], s[1]), s[1], s[0]))


def step_shapes(eng, tg: int, n_kv: int | None = None, *, pp: int | None = None,
                stride: int = 1) -> list[tuple[int, int]]:
    """(n_tokens, kv_needed) of every distinct compiled step the sweep runs (or only the row at
    `n_kv` runs), smallest first. `pp`: the row's prompt tokens (-ub as given; default the
    engine's ubatch); `stride`: only the measured rows of --sweep-stride run."""
    return [(n, kv) for _, n, kv in _shapes(eng, tg, pp, n_kv, stride)]


def lowering_order(jobs: list[tuple[int, str, int, int]]) -> list[tuple[int, str, int, int]]:
    """Jobs (k, kind, n_tokens, kv_needed) in the order they lower when they compile side by side:
    prompt steps first, the most tokens first, then the decode loops. Why: the lowerings run one
    at a time and each XLA compile starts when its lowering ends, so the longest compile should
    start first. On the deep V2-Lite shape (H200, 16-core host) the 2048-token prompt step lowers
    in 0.92 s and compiles in 3.1 s, the decode loop 1.35 s and 1.8 s: prompt first, the pair is
    done about 1.3 s sooner than decode first (RESULTS §22al)."""
    return sorted(jobs, key=lambda j: (j[1] == "loop", -j[2]))


def precompile(eng, tg: int, on_shape: Callable[[int, int, float], None] | None = None,
               on_begin: Callable[[int, int, int, int], None] | None = None, n_kv: int | None = None,
               *, pp: int | None = None, stride: int = 1) -> float:
    """Compile every step of the sweep (or of the row at `n_kv`) ahead of time; total seconds.
    Steps already compiled cost nothing.

    on_begin(k, n, n_tokens, kv_bucket) is called before step k of n compiles (a compile can take
    many seconds: the CLI shows it), on_shape(n_tokens, kv_needed, seconds) after."""
    shapes = _shapes(eng, tg, pp, n_kv, stride)

    def one(k: int, kind: str, n_tokens: int, kv: int) -> float:
        if on_begin:
            on_begin(k, len(shapes), n_tokens, eng.kv_bucket(kv, n_tokens))
        s = eng.precompile_decode(1, tg, kv) if kind == "loop" else eng.precompile(1, n_tokens, kv)
        if on_shape:
            on_shape(n_tokens, kv, s)
        return s
    jobs = [(k, *shape) for k, shape in enumerate(shapes, 1)]
    if eng.compile_in_parallel() and len(jobs) > 1:
        jobs = lowering_order(jobs)
        # XLA compiles (and loads cached executables) with the GIL released: a row's steps side
        # by side take about as long as the longest (warm start: the first row's 2 steps came from
        # the cache in 4.8 s one after the other); the first step of each (kind, token count)
        # before the rest of its family (compile_side_by_side: they reuse its GEMM autotuning)
        # ... and the program that makes the sweep's cache (a no-op once it exists)
        cache = ("cache", lambda: (eng.prepare_cache(1), 0.0)[1])
        return sum(compile_side_by_side([((j[1], j[2]), functools.partial(one, *j)) for j in jobs] + [cache]))
    return sum(one(*j) for j in jobs)


# Tokens of the decode loop a sweep's warm-up runs (its row then runs all of them, timed).
WARM_LOOP_TOKENS = 4


def run(eng, tg: int | None = None, seed: int = 0, warmup: bool = True,
        on_progress: Callable[[int, int], None] | None = None, nrep: int = 1,
        before_row: Callable[[int], None] | None = None, *, pp: int | None = None, stride: int = 1,
        memory: MemoryTracker | None = None) -> Iterator[SweepRow]:
    """Yield one SweepRow per measured N_KV point (compile first with `precompile`, or the first
    rows pay it).

    `pp`: the row's prompt tokens, ik's -ub as given (default: the engine's ubatch), run in steps
    of the engine's ubatch = min(ub, b). The first row's TG and PP run `nrep` times each and report
    the mean time (ik's -nrep). With `stride` N only rows 0, N, 2N, ... run and are reported (ik's
    --sweep-stride): ik still processes the skipped rows' prompts to fill its cache, which sets
    how many cache cells its attention reads; here a step reads the cache up to its start
    position whatever the cache holds, so the skipped rows change nothing the measured ones time
    and are not run. `memory` (a started MemoryTracker): each row carries the RSS high-water mark
    and the accelerator memory delta (ik's --sweep-memory). `before_row(n_kv)` runs before each
    row, outside its timings (the CLI compiles that row's steps there, so the first row comes
    after compiling only its own steps)."""
    if nrep < 1:
        raise ValueError(f"nrep must be >= 1, got {nrep}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    o = eng.options
    pp = o.ubatch if pp is None else pp
    tg = pp // 4 if tg is None else tg
    check_tg_room(sweep_ctx(o), eng.capacity, pp, tg, stride)
    vocab = eng.config.vocab_size
    rng = np.random.default_rng(seed)
    cache = eng.new_cache(1)
    warmed: set[tuple[str, int, int]] = set()

    def execute(kind: str, n_tokens: int, kv_needed: int, n_loop: int | None = None) -> None:
        """Run one step (tokens at kv_needed - n_tokens..) and wait for it; the decode loop's
        compiled `tg` tokens, or its first `n_loop` of them."""
        nonlocal cache
        if kind == "loop":
            out, cache = eng.decode(cache, rng.integers(0, vocab, (1,)), [kv_needed - tg], n_loop or tg, chunk=tg)
        else:
            out, cache = eng.step(cache, rng.integers(0, vocab, (1, n_tokens)), np.array([kv_needed - n_tokens]))
        out.block_until_ready()

    # A CPU-only engine runs each new step shape twice before timing it: on the device host's 16
    # cores the first run after one warm-up page-faulted 30-38 thousand fresh pages and took 157-176
    # ms against a 118-130 ms median (most of those faults were the C++ kernels' per-thread buffers,
    # since made per process); after that fix it still took 166-167 ms against a 152-161 median
    # (3 thousand faults; RESULTS §26ai, bench/cpu_step_jitter.py). ik sizes and touches its
    # buffers once, at its start.
    warm_runs = 2 if eng.executor.on_cpu_only else 1

    def warm(n_kv: int) -> None:
        """Run each step shape the row at n_kv uses before it is timed, the first time it comes
        (ik warms up too, and runs no new code later): a new executable's first run loads its
        kernels onto the device and grows the allocator (on the CPU alone, twice: see warm_runs).
        Its cache writes land at or past n_kv, which the row's own steps write again before
        anything reads them. The decode loop warms up on its first WARM_LOOP_TOKENS tokens (the
        same executable, every kernel of its body run): the whole loop cost the deep shape's first
        row 0.33 s more (RESULTS §22z)."""
        for kind, n_tokens, kv_needed in _row_steps(eng, tg, pp, n_kv):
            key = _key(eng, kind, n_tokens, kv_needed)
            if key not in warmed:
                with eng.uncounted():  # --expert-stats counts the rows' tokens, not the warm-ups'
                    for _ in range(warm_runs):
                        execute(kind, n_tokens, kv_needed, min(tg, WARM_LOOP_TOKENS))
                warmed.add(key)
    done = 0
    for row, n_kv in enumerate(measured_points(sweep_ctx(o), pp, stride)):
        reps = nrep if row == 0 else 1
        if before_row is not None:
            before_row(n_kv)
        if warmup:
            warm(n_kv)
        steps = _row_steps(eng, tg, pp, n_kv)
        tg_steps = [s for s in steps[:len(steps) - len(_pp_chunks(eng, pp))]]
        pp_steps = steps[len(tg_steps):]
        t_tg = 0.0  # TG 0 (ub < 4, as ik's ub/4): nothing to time
        if tg_steps:
            t0 = time.perf_counter()
            for _ in range(reps):
                for s in tg_steps:
                    execute(*s)
                    done += tg if s[0] == "loop" else 1
                    if on_progress:
                        on_progress(done, 0)
            t_tg = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            for s in pp_steps:  # the tg tokens at n_kv.. are overwritten
                execute(*s)
                done += s[1]
                if on_progress:
                    on_progress(done, 0)
        t_pp = (time.perf_counter() - t0) / reps
        if memory is not None:
            yield SweepRow(pp, tg, n_kv, t_pp, t_tg, rss_hwm_mib(), memory.sample())
        else:
            yield SweepRow(pp, tg, n_kv, t_pp, t_tg)


def total_work(eng, tg: int, nrep: int = 1, *, pp: int | None = None, stride: int = 1) -> int:
    """Progress units: one per TG token plus one per PP token of each measured row (the first `nrep` times)."""
    pp = eng.options.ubatch if pp is None else pp
    n = len(measured_points(sweep_ctx(eng.options), pp, stride))
    return (n + (nrep - 1 if n else 0)) * (tg + pp)


# -- host experts crossing the link (issue 24: bytes a prompt step moves, against the link) --------

def streamed_bytes(eng, n_tokens: int) -> tuple[int, str] | None:
    """(bytes, form) of routed experts a prompt step of `n_tokens` moves from host RAM to the
    device, or None when none cross (no host experts, a batch computed on the host, a CPU-only
    run). "layer" / "chunks": every host expert of every such layer (whole, or a run of experts at a
    time), known before the step runs; "active": only the experts the batch routes to, counted by
    the custom call (bytes None until measured)."""
    from ikjax import ops
    from ikjax.model.groups import host_layers
    from ikjax.placement.host import is_host_resident
    total, form = 0, None
    for lay in host_layers(eng.weights):
        ts = [lay.get(k) for k in ("gate_exps", "up_exps", "down_exps")]
        if not all(is_host_resident(t) for t in ts):
            continue
        E, k = ts[0].shape[0], eng.config.n_expert_used
        if not all(t.pinned and t.runs_on(n_tokens, E, k) == "device" for t in ts):
            continue
        mode = ops.stream_form(*ts, n_tokens, k, hot="hot_experts" in lay)
        form = mode if form in (None, mode) else "active"
        total += sum(t.nbytes for t in ts)
    return None if form is None else (total, form)


def h2d_bandwidth(device, nbytes: int = 512 << 20, reps: int = 3) -> float:
    """Pinned host -> `device` copy rate in bytes/s: the best of `reps` copies of `nbytes` (what a
    step's stream of host experts can reach at most)."""
    import jax
    from ikjax.placement.host import to_pinned
    src = to_pinned(np.zeros(nbytes, np.uint8), device)
    best = float("inf")
    for _ in range(reps + 1):  # the first copy warms up the path
        t0 = time.perf_counter()
        jax.device_put(src, jax.memory.Space.Device).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def host_decode_report(eng, rows: list, stats: dict) -> str | None:
    """One line for the log: the host CPU's share of a TG token where routed experts live in host
    RAM next to a GPU (`stats`: ops.host_kernel_stats over the sweep): the mean decode-sized call's
    time in the host kernel and the expert bytes it read a second, times the host layers a token
    passes, against the TG rows' mean time a token; the rest is the GPU's part and the round trips."""
    from ikjax.model.groups import host_layers
    from ikjax.placement.host import is_host_resident
    calls = stats.get("small_calls", 0)
    tg = [r.t_tg / r.tg for r in rows if r.tg and r.t_tg > 0]
    if not calls or not tg:
        return None
    n_layers = sum(1 for lay in host_layers(eng.weights) if is_host_resident(lay.get("gate_exps")))
    per_call = stats["small_ns"] / calls / 1e6
    rate = stats["small_bytes"] / stats["small_ns"] if stats["small_ns"] else 0.0
    token = sum(tg) / len(tg) * 1e3
    return (f"host experts in decode steps: {per_call:.3f} ms a call in the host kernel ({rate:.1f} GB/s of "
            f"experts read, {calls} calls, handed over by {stats['host_call']}); x {n_layers} layers = {per_call * n_layers:.2f} ms of the TG rows' "
            f"mean {token:.2f} ms a token ({100 * per_call * n_layers / token:.0f} %)")


def stream_report(eng, pp: int, rows: list, active_bytes: int = 0) -> str | None:
    """One line for the log. Whole layers: the bytes each prompt step of the sweep moved over the
    link, the rate that is at the rows' mean prompt time, and the measured pinned host -> device
    bandwidth. By round (`active_bytes`: what the custom call counted over the sweep, warm-up steps
    included): the total."""
    import jax
    step = eng.options.ubatch
    got = streamed_bytes(eng, step)
    if got is None or not rows:
        return None
    per_step, form = got
    if form == "active":
        return (f"host experts: the routed experts cross to the device by round: {active_bytes / 1e9:.2f} GB over "
                f"the sweep's prompt steps (warm-ups included)") if active_bytes else None
    t_step = sum(r.t_pp for r in rows) / len(rows) / -(-pp // step)
    rate = per_step / t_step
    peak = h2d_bandwidth(jax.devices()[0])
    how = "whole layers" if form == "layer" else "every expert, a run at a time"
    return (f"host experts: {per_step / 1e9:.2f} GB cross to the device per {step}-token prompt step ({how}); at the PP rows' mean {t_step:.3f} s a step that is {rate / 1e9:.1f} GB/s; pinned host -> "
            f"device copies measured {peak / 1e9:.1f} GB/s ({100 * rate / peak:.0f} %)")
