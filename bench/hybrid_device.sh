#!/bin/bash
# On the device machine (no network): build the CUDA host-experts handler, run the GPU tests of
# the hybrid path and bench/hybrid_gpu.py. Needs the gguf wheel in .whl and the fixtures in
# .gpufix (both carried: see bench/RESULTS.md "Hybrid (issue 10)").
#   bash bench/hybrid_device.sh [hybrid_gpu.py args...]
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/hybrid-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; echo "host cores: $(nproc)"; which nvcc
t0=$(date +%s)
# the same CMakeLists as `pip install --no-build-isolation -e . -Ccmake.define.IKJAX_BUILD_CUDA=ON`,
# only the CUDA target, its .so dropped next to the sources (PYTHONPATH=$PWD)
cmake -S pallas_kernels -B /tmp/ikb -G Ninja -DIKJAX_BUILD_CUDA=ON -DPython_EXECUTABLE="$(which python3)" \
    > "$OUT/build.log" 2>&1 && ninja -C /tmp/ikb _cuda_host >> "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
cp /tmp/ikb/_cuda_host*.so pallas_kernels/ && echo "build: $(( $(date +%s) - t0 )) s"
[ -n "$SKIP_TESTS" ] || IKJAX_FIXTURES=$PWD/.gpufix timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/test_hybrid_gpu.py ${TEST_K:+-k "$TEST_K"} \
    -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -30
timeout "${BENCH_TIMEOUT:-330}" python3 bench/hybrid_gpu.py --out "$OUT" "$@" 2>&1 | tail -60
