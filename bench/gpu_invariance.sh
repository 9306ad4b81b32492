#!/bin/bash
# Issue 23 on one GPU, no HTTP: the row-invariant decode kernels on (default) and off — greedy
# answers of the in-process scheduler against generate, a batched row's logits against alone,
# the server iteration's cost, a second turn's TTFT — and sweep-bench's S_TG with each (the cost
# of the invariant schedules at batch 1), then the step cost with every layer unrolled.
#   OUT=/tmp/o bash bench/gpu_invariance.sh          (carry .whl: the gguf wheel)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-inv}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -m pip install -q --no-index --no-deps .whl/gguf-*.whl .whl/prometheus_client-*.whl || exit 1
"$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
M=/tmp/v2lite-27L-Q4_0.gguf
[ -f "$M" ] || "$PY" -m ikjax.cli make-model --preset v2-lite --type Q4_0 -o "$M" > /dev/null || exit 1
echo "ready after $(( $(date +%s) - T0 )) s"
export IKJAX_COMPILE_CACHE=${IKJAX_COMPILE_CACHE:-/tmp/ikjax-xla}
probe() {  # probe NAME PARTS [env...]
    local name=$1 parts=$2; shift 2
    env "$@" timeout 300 "$PY" bench/gpu_batch_invariance.py "$M" --parts "$parts" > "$OUT/probe-$name.txt" 2>&1
    echo "== probe $name ($*) rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^ *$" "$OUT/probe-$name.txt" | grep -v Warning | tail -16
}
sweep() {  # sweep NAME [env...]
    local name=$1; shift
    env "$@" timeout 200 "$PY" -m ikjax.cli sweep-bench -m "$M" -c 4096 -ub 512 -n 64 -mla 3 -fa 1 > "$OUT/sweep-$name.txt" 2>&1
    echo "== sweep $name ($*) rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^\|" "$OUT/sweep-$name.txt" | head -12
}
# STAGES: which of these run (default all), e.g. STAGES="inv1 sweep1 long"
STAGES=${STAGES:-inv1 inv0 sweep1 sweep0 unroll}
for st in $STAGES; do case $st in
    inv1) probe inv1 "${PARTS1:-greedy,logits,steps,turn}" IKJAX_BATCH_INVARIANT=1 ;;
    inv0) probe inv0 "${PARTS0:-logits,steps}" IKJAX_BATCH_INVARIANT=0 ;;
    sweep1) sweep inv1 IKJAX_BATCH_INVARIANT=1 ;;
    sweep0) sweep inv0 IKJAX_BATCH_INVARIANT=0 ;;
    unroll) probe unroll steps IKJAX_LAYERS=unroll ;;
    long)  # the issue-22 row set: -c 16384 -ub 2048 -n 128
        timeout 200 "$PY" -m ikjax.cli sweep-bench -m "$M" -c 16384 -ub 2048 -n 128 -mla 3 -fa 1 > "$OUT/sweep-long.txt" 2>&1
        echo "== sweep long rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^\|" "$OUT/sweep-long.txt" | head -12 ;;
esac; done
echo "done at $(( $(date +%s) - T0 )) s"
