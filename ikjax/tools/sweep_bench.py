"""sweep-bench as ik_llama.cpp runs it (SPEC §4): PP and TG speed as the KV cache fills.

For n_kv = 0, ub, 2ub, ... while n_kv + ub <= c: generate `tg` tokens at positions n_kv.. (timed),
drop them (the next step simply starts at n_kv again: later rows are masked), then process `ub`
random tokens at n_kv (timed). The `tg` tokens are generated as `generate` does, each step
feeding the token the last one picked (greedy), all of them in one dispatch where the engine
decodes in a loop (Engine.decode_loop; IKJAX_DECODE_LOOP=0: one dispatch and host round trip per
token, as ik's sweep-bench, which feeds random tokens). Every step shape the sweep will hit is compiled before
the first timer starts; compile time is reported separately. `nrep` (ik's `-nrep`) repeats the first
row's TG and PP that many times and reports the mean, as ik's sweep-bench does.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

HEADER = "|%6s | %6s | %6s | %8s | %8s | %8s | %8s |" % (
    "PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")
SEPARATOR = "|%6s-|-%6s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|" % (
    "------", "------", "------", "--------", "--------", "--------", "--------")
ROW = "|%6d | %6d | %6d | %8.3f | %8.2f | %8.3f | %8.2f |"
JSONL = ('{"n_kv_max": %d, "n_batch": %d, "n_ubatch": %d, "flash_attn": %d, "n_gpu_layers": %d, '
         '"n_threads": %d, "n_threads_batch": %d, "pp": %d, "tg": %d, "n_kv": %d, "t_pp": %f, '
         '"speed_pp": %f, "t_tg": %f, "speed_tg": %f }')
JSONL_KEYS = ("n_kv_max", "n_batch", "n_ubatch", "flash_attn", "n_gpu_layers", "n_threads", "n_threads_batch",
              "pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg")


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
    def of(cls, eng) -> "RunInfo":
        o = eng.options
        threads = o.threads or os.cpu_count() or 1
        return cls(o.ctx, o.batch, o.ubatch, int(o.fa), o.ngl, threads, o.threads_batch or threads)

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

    @property
    def speed_pp(self) -> float:
        return self.pp / self.t_pp if self.t_pp > 0 else 0.0

    @property
    def speed_tg(self) -> float:
        return self.tg / self.t_tg if self.t_tg > 0 else 0.0

    def markdown(self) -> str:
        return ROW % (self.pp, self.tg, self.n_kv, self.t_pp, self.speed_pp, self.t_tg, self.speed_tg)

    def jsonl(self, info: RunInfo) -> str:
        return JSONL % (info.n_kv_max, info.n_batch, info.n_ubatch, info.flash_attn, info.n_gpu_layers,
                        info.n_threads, info.n_threads_batch, self.pp, self.tg, self.n_kv, self.t_pp,
                        self.speed_pp, self.t_tg, self.speed_tg)


def sweep_points(ctx: int, ubatch: int) -> list[int]:
    """The N_KV values of the sweep: 0, ub, 2ub, ... while n_kv + ub <= ctx."""
    return list(range(0, ctx - ubatch + 1, ubatch)) if ubatch <= ctx else []


def step_shapes(eng, tg: int, n_kv: int | None = None) -> list[tuple[int, int]]:
    """(n_tokens, kv_needed) of every distinct compiled step the sweep runs (or only the row at
    `n_kv` runs), smallest first."""
    ub = eng.options.ubatch
    seen: dict[tuple[int, int], int] = {}
    for p in sweep_points(eng.options.ctx, ub) if n_kv is None else [n_kv]:
        if tg and eng.decode_loop():  # one loop of tg steps: n_tokens 1, its last step's kv
            seen.setdefault((1, eng.kv_bucket(p + tg, 1)), p + tg)
            tg_steps = ()
        else:
            tg_steps = range(tg)
        for i in tg_steps:
            seen.setdefault((1, eng.kv_bucket(p + i + 1, 1)), p + i + 1)
        seen.setdefault((ub, eng.kv_bucket(p + ub, ub)), p + ub)
    return sorted(((t, kv) for (t, _), kv in seen.items()), key=lambda x: (x[1], x[0]))


def precompile(eng, tg: int, on_shape: Callable[[int, int, float], None] | None = None,
               on_begin: Callable[[int, int, int, int], None] | None = None, n_kv: int | None = None) -> float:
    """Compile every step of the sweep (or of the row at `n_kv`) ahead of time; total seconds.
    Steps already compiled cost nothing.

    on_begin(k, n, n_tokens, kv_bucket) is called before step k of n compiles (a compile can take
    many seconds: the CLI shows it), on_shape(n_tokens, kv_needed, seconds) after."""
    shapes = step_shapes(eng, tg, n_kv)

    def one(k: int, n_tokens: int, kv: int) -> float:
        if on_begin:
            on_begin(k, len(shapes), n_tokens, eng.kv_bucket(kv, n_tokens))
        s = eng.precompile_decode(1, tg, kv) if n_tokens == 1 and eng.decode_loop() else \
            eng.precompile(1, n_tokens, kv)
        if on_shape:
            on_shape(n_tokens, kv, s)
        return s
    jobs = [(k, n_tokens, kv) for k, (n_tokens, kv) in enumerate(shapes, 1)]
    if eng.compile_in_parallel() and len(jobs) > 1:
        # XLA compiles (and loads cached executables) with the GIL released: a row's steps side
        # by side take about as long as the longest (warm start: the first row's 2 steps came from
        # the cache in 4.8 s one after the other)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(jobs)) as pool:
            return sum(pool.map(lambda j: one(*j), jobs))
    return sum(one(*j) for j in jobs)


def run(eng, tg: int | None = None, seed: int = 0, warmup: bool = True,
        on_progress: Callable[[int, int], None] | None = None, nrep: int = 1,
        before_row: Callable[[int], None] | None = None) -> Iterator[SweepRow]:
    """Yield one SweepRow per N_KV point (compile first with `precompile`, or the first rows pay it).

    The first row's TG and PP run `nrep` times each and report the mean time (ik's -nrep).
    `before_row(n_kv)` runs before each row, outside its timings (the CLI compiles that row's
    steps there, so the first row comes after compiling only its own steps)."""
    if nrep < 1:
        raise ValueError(f"nrep must be >= 1, got {nrep}")
    o = eng.options
    ub = o.ubatch
    tg = ub // 4 if tg is None else tg
    vocab = eng.config.vocab_size
    rng = np.random.default_rng(seed)
    cache = eng.new_cache(1)
    points = sweep_points(o.ctx, ub)
    warmed: set[tuple[int, int]] = set()
    loop = eng.decode_loop()

    def warm(n_kv: int) -> None:
        """Run each step shape the row at n_kv uses once before it is timed, the first time it
        comes (ik warms up too, and runs no new code later): a new executable's first run loads its
        kernels onto the device and grows the allocator. Its cache writes land at or past n_kv,
        which the row's own steps write again before anything reads them."""
        nonlocal cache
        for n_tokens, kv_needed in step_shapes(eng, tg, n_kv):
            key = (n_tokens, eng.kv_bucket(kv_needed, n_tokens))
            if key in warmed:
                continue
            if n_tokens == 1 and loop:
                out, cache = eng.decode(cache, rng.integers(0, vocab, (1,)), [kv_needed - tg], tg)
            else:
                out, cache = eng.step(cache, rng.integers(0, vocab, (1, n_tokens)), np.array([kv_needed - n_tokens]))
            out.block_until_ready()
            warmed.add(key)
    done = 0
    for row, n_kv in enumerate(points):
        reps = nrep if row == 0 else 1
        if before_row is not None:
            before_row(n_kv)
        if warmup:
            warm(n_kv)
        t0 = time.perf_counter()
        for _ in range(reps):
            if loop and tg:  # tg greedy steps in one dispatch, ready when the last token is
                out, cache = eng.decode(cache, rng.integers(0, vocab, (1,)), [n_kv], tg)
                out.block_until_ready()
                done += tg
                if on_progress:
                    on_progress(done, 0)
                continue
            for i in range(tg):
                out, cache = eng.step(cache, rng.integers(0, vocab, (1, 1)), np.array([n_kv + i]))
                out.block_until_ready()
                done += 1
                if on_progress:
                    on_progress(done, 0)
        t_tg = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            toks = rng.integers(0, vocab, (1, ub))
            out, cache = eng.step(cache, toks, np.array([n_kv]))  # the tg tokens at n_kv.. are overwritten
            out.block_until_ready()
            done += ub
            if on_progress:
                on_progress(done, 0)
        t_pp = (time.perf_counter() - t0) / reps
        yield SweepRow(ub, tg, n_kv, t_pp, t_tg)


def total_work(eng, tg: int, nrep: int = 1) -> int:
    """Progress units: one per TG token plus ub per PP step (the first row `nrep` times)."""
    n = len(sweep_points(eng.options.ctx, eng.options.ubatch))
    return (n + (nrep - 1 if n else 0)) * (tg + eng.options.ubatch)
