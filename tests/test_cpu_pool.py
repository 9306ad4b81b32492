"""The C++ kernels' thread pool on a machine whose cores are taken (issue 21).

With every core running something else, a pool thread the OS has not scheduled used to hold each
kernel call back: the caller spun on it (and workers spun between calls) for whole scheduler
slices, so the same tiny-model decode step took 15 ms or 2.5 s on a 2-core box with one busy
neighbour. The pool now lets the caller run every part no worker has started, spins for at most
~50 us (yielding the core), then sleeps (pallas_kernels/cpu/runtime.cc). These tests run a chain
of small kernel calls, as a decode step is, with more threads asked for than there are cores and
a busy-loop process per core beside it, and check that it stays within a few times the
single-thread time of the same chain under the same load, and gives the same numbers.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ikjax  # noqa: F401  (first: the quant_matmul package imports ikjax, which imports it back)
from ikjax.quant import QuantArray, by_name
from pallas_kernels import cpu as _cpu
from pallas_kernels.quant_matmul import cpu
from pallas_kernels.testing import random_bytes

pytestmark = pytest.mark.skipif(not _cpu.available(), reason=_cpu.unavailable_reason() or "no C++ kernels")

CALLS = 48  # kernel calls per "step": a small decode step's count (tiny model: ~40)
STEPS = 25


def _chain(n_threads: int):
    """A jitted step of CALLS small quantized matmuls in a row (decode-sized, M = 1, and
    prompt-sized, M = 8, so both the row-chunk and the static-partition paths of the kernels run)."""
    rng = np.random.default_rng(21)
    K = N = 256
    raw = random_bytes("Q8_0", (N,), K, rng, fast=True)
    w = QuantArray.from_bytes(np.ascontiguousarray(raw.reshape(N, -1)), by_name("Q8_0"), (N, K))

    @jax.jit
    def step(x):
        for _ in range(CALLS // 2):
            x = jnp.tanh(cpu.quant_matmul(x, w, n_threads=n_threads))
            x = jnp.tanh(cpu.quant_matmul(jnp.tile(x, (8, 1)), w, n_threads=n_threads)[3:4])
        return x

    return step, jnp.asarray(rng.standard_normal((1, K)).astype(np.float32))


def _times(step, x) -> tuple[list[float], np.ndarray]:
    out = step(x).block_until_ready()  # compile and warm the pool
    ts = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        out = step(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return ts, np.asarray(out)


@pytest.fixture
def busy_cores():
    """One busy-loop process per core this process may run on, for the test's duration."""
    n = len(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.2)  # let them start spinning
    try:
        yield n
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def test_more_threads_than_cores_stay_fast_under_load(busy_cores):
    """-t 8 (more than the cores) next to a busy process per core: each step's time within a few
    times that of -t 1 under the same load, never a scheduler slice per call. Before the fix, on 2
    cores: a 48-call step's median was tens of ms against ~1-2 ms for -t 1."""
    step1, x = _chain(1)
    step8, _ = _chain(8)
    t8, out8 = _times(step8, x)
    t1, out1 = _times(step1, x)
    t8b, _ = _times(step8, x)  # again after -t 1: the load's phase is not what decides
    np.testing.assert_array_equal(out8, out1)  # parts run on whichever thread: the same numbers
    med1 = float(np.median(t1))
    med8 = float(np.median(t8 + t8b))
    assert med8 <= 4 * med1 + 0.005, (f"-t 8 step median {med8 * 1e3:.1f} ms vs -t 1 {med1 * 1e3:.1f} ms "
                                      f"with {busy_cores} busy processes; -t 8: "
                                      f"{[round(t * 1e3, 1) for t in t8 + t8b]}")
    # no step stalls for long either (a slice per call was 100s of ms per step)
    assert max(t8 + t8b) <= 20 * med1 + 0.1, [round(t * 1e3, 1) for t in t8 + t8b]


def test_unloaded_parallel_matches_serial():
    """Without load, every thread count gives the single thread's numbers (each output element is
    computed whole by one part, whichever thread runs it)."""
    step1, x = _chain(1)
    ref = np.asarray(step1(x))
    for nt in (2, 3, 8, 0):
        step, _ = _chain(nt)
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(step(x)), ref)
