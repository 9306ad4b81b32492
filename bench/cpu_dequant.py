"""Throughput of the C++ row dequantizers (cpu_kernel_kquants.cc), per type and ISA level, one core.

Why a separate harness: the dequantizers have no Python entry of their own (the matmul calls them),
and a matmul timing mixes in the dot product. This script compiles the kernel source three times
(generic / AVX2 / AVX-512, the flags of CMakeLists.txt) with a small C timing loop into a temporary
shared library and times `dequant_row_kquants` over many rows:
  - "cache": 64 rows of K = 2048 (~ 80-150 KiB of blocks, L2-resident): the kernel's own speed;
  - "dram":  rows totalling --mib MiB, each read once per pass: bound by memory bandwidth.
Plus the machine's read bandwidth (a numpy sum over the same bytes) as the floor to compare with.

    python bench/cpu_dequant.py [--types Q4_K,IQ4_K] [--mib 512]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE / "cpu_kernel_kquants.cc"
TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K",
         "Q6_0", "IQ4_KS", "IQ5_KS", "IQ4_KSS", "IQ2_KS", "IQ3_KS"]
LEVEL_FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mavx512vnni", "-mavx512bf16"],
}
WRAPPER = r"""
#include <chrono>
#include <cstdint>
#include <vector>
#include "quant_matmul/cpu_dequant.h"
extern "C" double kq_time(int level, int type, const uint8_t* w, int64_t n, int64_t row_bytes, int64_t K, int reps) {
  auto fn = level == 0 ? &ikj_generic::dequant_row_kquants
          : level == 1 ? &ikj_avx2::dequant_row_kquants : &ikj_avx512::dequant_row_kquants;
  std::vector<float> out(K);  // one row buffer, as the decode engine uses
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (int64_t i = 0; i < n; ++i)
      if (!fn(type, w + i * row_bytes, K, out.data())) return -1.0;
  auto t1 = std::chrono::steady_clock::now();
  volatile float sink = out[0];
  (void)sink;
  return std::chrono::duration<double>(t1 - t0).count();
}
"""


def build(tmp: Path, levels) -> ctypes.CDLL:
    inc = str(HERE.parent)
    common = ["g++", "-std=gnu++17", "-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-I", inc]
    objs = []
    for level in ("generic", "avx2", "avx512"):
        o = tmp / f"{level}.o"
        flags = LEVEL_FLAGS[level] if level in levels else LEVEL_FLAGS["generic"]
        subprocess.run(common + [f"-DIKJ_NS=ikj_{level}", f"-DIKJ_LEVEL_{level}=1", *flags, "-c", str(SRC),
                                 "-o", str(o)], check=True)
        objs.append(str(o))
    (tmp / "wrap.cc").write_text(WRAPPER)
    subprocess.run(common + ["-c", str(tmp / "wrap.cc"), "-o", str(tmp / "wrap.o")], check=True)
    subprocess.run(["g++", "-shared", "-o", str(tmp / "libkq.so"), *objs, str(tmp / "wrap.o")], check=True)
    lib = ctypes.CDLL(str(tmp / "libkq.so"))
    lib.kq_time.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int]
    lib.kq_time.restype = ctypes.c_double
    return lib


def cpu_levels() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    levels = ["generic"]
    if " avx2 " in flags and " fma " in flags and " f16c " in flags:
        levels.append("avx2")
        if all(f" {f} " in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                                            "avx512_bf16")):
            levels.append("avx512")
    return levels


def random_rows(name: str, rows: int, K: int, rng) -> np.ndarray:
    """Random valid rows (f16 scales finite and small; row-scaled types get their row header)."""
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from test_cpu_dequant_kquants import random_weights
    return np.ascontiguousarray(np.asarray(random_weights(name, (rows, K), rng).data))


def bandwidth(nbytes: int) -> float:
    a = np.ones(nbytes // 8, np.float64)
    a.sum()
    t = time.perf_counter()
    for _ in range(3):
        a.sum()
    return 3 * a.nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--mib", type=int, default=256, help="bytes of weights for the DRAM-bound pass")
    args = ap.parse_args()
    from ikjax.quant import by_name

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    levels = cpu_levels()
    rng = np.random.default_rng(0)
    K = args.K
    print(f"read bandwidth, 1 core (numpy sum over {args.mib} MiB): {bandwidth(args.mib << 20):.1f} GB/s")
    print(f"G weights/s per core, K = {K}; dram columns also in GB/s of blocks read")
    print(f"{'type':8s} " + " ".join(f"{lv + ' cache':>13s}" for lv in levels)
          + f" {levels[-1] + ' dram':>14s} {'GB/s':>6s}")
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp), levels)
        for name in args.types.split(","):
            qt = by_name(name)
            hot = random_rows(name, 64, K, rng)
            cols = []
            for li, _ in enumerate(levels):
                reps = 20 if li == 0 else 100
                best = min(lib.kq_time(li, qt.type_id, hot.ctypes.data, hot.shape[0], hot.shape[1], K, reps)
                           for _ in range(3))
                cols.append(hot.shape[0] * K * reps / best / 1e9)
            n_big = max(64, (args.mib << 20) // hot.shape[1])
            big = np.concatenate([hot] * (n_big // 64))
            li = len(levels) - 1
            best = min(lib.kq_time(li, qt.type_id, big.ctypes.data, big.shape[0], big.shape[1], K, 1)
                       for _ in range(3))
            print(f"{name:8s} " + " ".join(f"{c:13.2f}" for c in cols)
                  + f" {big.shape[0] * K / best / 1e9:14.2f} {big.nbytes / best / 1e9:6.1f}")


if __name__ == "__main__":
    main()
