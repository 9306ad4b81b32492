"""This CPU's arithmetic peak, measured (RESULTS §9h): register-only loops of independent
accumulator chains (no memory traffic) for the three product instructions the C++ kernels use:
f32 FMA (vfmadd231ps), bf16 pairs (vdpbf16ps) and int8 quads (vpdpbusd), 512-bit at the avx512
level, on 1 and 2 threads. A tiny C++ file compiled here with g++ -O2 -march=native.

    python bench/cpu_peak.py [--seconds 0.5]

GFLOP/s count a multiply-add as 2 (int8: GOP/s); compare the kernels' rates in §9 with these.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SRC = r"""
#include <immintrin.h>
#include <cstdint>
// 12 independent accumulators as named registers (an array would live in memory at -O2), each
// started from a different run-time value (equal ones would be merged into one chain)
#define ACC12(T, init) T a0 = init(0), a1 = init(1), a2 = init(2), a3 = init(3), a4 = init(4), \
  a5 = init(5), a6 = init(6), a7 = init(7), a8 = init(8), a9 = init(9), a10 = init(10), a11 = init(11)
#define STEP12(op) a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5); \
  a6 = op(a6); a7 = op(a7); a8 = op(a8); a9 = op(a9); a10 = op(a10); a11 = op(a11)
#define SUM12(red) (red(a0) + red(a1) + red(a2) + red(a3) + red(a4) + red(a5) + red(a6) + red(a7) + \
  red(a8) + red(a9) + red(a10) + red(a11))
extern "C" {
double fma_f32(int64_t n) {
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
#define INITF(i) _mm512_set1_ps(static_cast<float>(n % 7 + i))
  ACC12(__m512, INITF);
#define F(a) _mm512_fmadd_ps(a, x, y)
  for (int64_t k = 0; k < n; ++k) { STEP12(F); }
  return SUM12(_mm512_reduce_add_ps);
}
double dp_bf16(int64_t n) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  ACC12(__m512, INITF);
#define B(a) _mm512_dpbf16_ps(a, x, x)
  for (int64_t k = 0; k < n; ++k) { STEP12(B); }
  return SUM12(_mm512_reduce_add_ps);
}
double dp_i8(int64_t n) {
  const __m512i x = _mm512_set1_epi8(1);
#define INITI(i) _mm512_set1_epi32(static_cast<int>(n % 7 + i))
  ACC12(__m512i, INITI);
#define I(a) _mm512_dpbusd_epi32(a, x, x)
  for (int64_t k = 0; k < n; ++k) { STEP12(I); }
  return (double)SUM12(_mm512_reduce_add_epi32);
}
}
"""
# multiply-adds per loop iteration (12 instructions): f32 16 lanes, bf16 16 x 2, int8 16 x 4
MACS = {"fma_f32": 12 * 16, "dp_bf16": 12 * 32, "dp_i8": 12 * 64}
UNIT = {"fma_f32": "GFLOP/s (f32 FMA)", "dp_bf16": "GFLOP/s (bf16 vdpbf16ps)", "dp_i8": "GOP/s (int8 vpdpbusd)"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=0.5)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="ikjax-peak-"))
    (d / "peak.cc").write_text(SRC)
    subprocess.run(["g++", "-O2", "-march=native", "-shared", "-fPIC", "-o", str(d / "peak.so"), str(d / "peak.cc")],
                   check=True)
    lib = ctypes.CDLL(str(d / "peak.so"))
    print("| instruction | 1 thread | 2 threads |\n|---|---:|---:|")
    for name in MACS:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_double
        n = 1 << 20
        t0 = time.perf_counter(); fn(n); dt = time.perf_counter() - t0  # calibrate (ctypes drops the GIL)
        n = max(1, int(n * a.seconds / dt))
        rates = []
        for threads in (1, 2):
            best = 0.0
            for _ in range(3):
                ts = [threading.Thread(target=fn, args=(n,)) for _ in range(threads)]
                t0 = time.perf_counter()
                for t in ts: t.start()
                for t in ts: t.join()
                best = max(best, 2 * MACS[name] * n * threads / (time.perf_counter() - t0) / 1e9)
            rates.append(best)
        print(f"| {UNIT[name]} | {rates[0]:.0f} | {rates[1]:.0f} |")


if __name__ == "__main__":
    main()
