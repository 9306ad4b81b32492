#!/usr/bin/env bash
# Issue 13's first measurement on a multi-GPU lease: the 27-layer V2-Lite-shape Q4_0 model,
# sweep-bench on 1 GPU, then -sm layer and -sm graph over every visible GPU (same file, one run).
#   bash bench/multi_gpu.sh [CTX] [TG]        (results under $OUT, or ./multi_gpu_out)
set -uo pipefail
OUT=${OUT:-multi_gpu_out}; mkdir -p "$OUT"
CTX=${1:-8192}; TG=${2:-128}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1   # the device has no network: the gguf wheel travels in .whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
t0=$(date +%s)
python3 -m ikjax.cli make-model --preset v2-lite --type Q4_0 -o /tmp/v2l.gguf 2>&1 | tail -1
echo "make-model $(( $(date +%s) - t0 )) s"
n=$(nvidia-smi -L | wc -l)
run() {
  local name=$1; shift
  echo "== $name: $*"
  timeout 240 python3 -m ikjax.cli sweep-bench -m /tmp/v2l.gguf -c "$CTX" -ub 2048 -n "$TG" -mla 3 -fa 1 "$@" \
    > "$OUT/$name.md" 2> "$OUT/$name.err"; echo "rc=$?"
  cat "$OUT/$name.md"; grep -iE "memory|device|compiled|error" "$OUT/$name.err" | tail -12
}
CUDA_VISIBLE_DEVICES=0 run gpu1
run layer$n -sm layer
run graph$n -sm graph
