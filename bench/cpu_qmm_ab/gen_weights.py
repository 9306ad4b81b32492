"""Random GGUF weight rows for bench/cpu_qmm_ab (pallas_kernels.testing.random_bytes):
python bench/cpu_qmm_ab/gen_weights.py OUT_DIR  -> OUT_DIR/w_TYPE_N_K.bin"""
import os
import sys

import numpy as np

from pallas_kernels.testing import random_bytes

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/qmm_w"
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
# V2-Lite's prompt products: an expert's gate/up and down at ~48 rows, the dense / shared ones at 512
for name in ["Q8_0", "Q4_0", "Q4_K", "IQ4_XS"]:
    for N, K in [(1408, 2048), (2048, 1408), (2048, 2048), (2816, 2048), (2048, 2816)]:
        if name in ("Q4_K", "IQ4_XS") and K % 256:
            continue  # (make-model writes such matrices as Q8_0)
        raw = random_bytes(name, (N,), K, rng, fast=True)
        np.ascontiguousarray(raw.reshape(N, -1)).tofile(os.path.join(out, f"w_{name}_{N}_{K}.bin"))
