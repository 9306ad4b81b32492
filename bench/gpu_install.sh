#!/bin/bash
# On the GPU device machine (no network; Python with JAX + its CUDA plugin, cmake, ninja, nanobind
# and scikit-build-core preinstalled; the gguf wheel carried in .whl/): install this checkout the
# README's GPU way minus the network parts, check that the CUDA host-experts handler was built by
# the automatic CUDA detection (no -Ccmake.define.IKJAX_BUILD_CUDA=ON), and run the hybrid tests.
#   bash bench/gpu_install.sh            # fixtures from .gpufix if carried, else ../shared/fixtures
# The README's command on a networked GPU machine: pip install -e '.[cuda13]' (or cuda12).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-install-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "python: $($PY --version 2>&1); jax: $($PY -c 'import jax; print(jax.__version__, jax.default_backend())' 2>&1)"
echo "nvcc: $(command -v nvcc || echo 'not on PATH') $(nvcc --version 2>/dev/null | tail -1)"

# The device's own Python (JAX with CUDA, the build tools) takes this checkout editable: the machine
# is bare at every lease, so nothing outlives the run. (A venv made with --system-site-packages from
# it does not see those packages: the device's python3 is itself a venv.)
VPY=${VPY:-$PY}
"$VPY" -m pip install -q --no-index --no-deps .whl/gguf-*.whl || exit 1

t0=$(date +%s)
"$VPY" -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
    || { tail -40 "$OUT/install.log"; echo "install FAILED"; exit 1; }
echo "install: $(( $(date +%s) - t0 )) s (log: $OUT/install.log)"
grep -E "ikjax: (CUDA toolkit|no CUDA toolkit)" "$OUT/install.log"

"$VPY" - <<'EOF' || exit 1
from pallas_kernels.moe_matmul import host
import pallas_kernels._cuda_host as m
print("pallas_kernels._cuda_host:", m.__file__)
assert host.available(), host.unavailable_reason()
EOF

FIX=${IKJAX_FIXTURES:-$([ -d .gpufix ] && echo "$PWD/.gpufix" || echo "$PWD/../shared/fixtures")}
IKJAX_FIXTURES=$FIX timeout "${TEST_TIMEOUT:-300}" "$VPY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_hybrid_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -30
