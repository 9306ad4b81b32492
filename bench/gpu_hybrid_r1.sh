#!/usr/bin/env bash
# Issue 24 on one GPU + its host: the realistically routed 8-layer R1 (make-model --preset r1
# --layers 8 --type Q4_0, 256 experts, routing spread as a trained model's) with its routed
# experts in host RAM, ik_llama.cpp beside ikjax, same file, same flags:
#   ik: -ot exps=CPU (default -ooae), -no-ooae;   ikjax: default, IKJAX_STREAM=layer,
#   --gpu-experts auto under a 24 GB device budget (XLA_PYTHON_CLIENT_MEM_FRACTION), and with the
#   whole card; the statistics from the default run's own sweep (--expert-stats).
# Peak device memory of each run sampled with nvidia-smi. Results: $OUT/hybrid.md
#   IK=/tmp/ikc/build/bin bash bench/gpu_hybrid_r1.sh [PARTS: "ik ikjax"]
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/hybrid_out}
mkdir -p "$OUT"
PARTS=${1:-"ik ikjax"}
IK=${IK:-/tmp/ikc/build/bin}
M=/tmp/r1-8.gguf
[ -f "$M" ] || python3 -m ikjax.cli make-model -o "$M" --preset r1 --layers 8 --type Q4_0 > /dev/null || exit 1
R=$OUT/hybrid.md
FLAGS="-c 4096 -ub 2048 -b 2048 -mla 3 -t 16"
echo "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); $(nproc) cores; $(lscpu | grep 'Model name' | sed 's/ \+/ /g')" >> "$R"
timed() {  # timed LABEL CMD...: wall time, the table, peak device memory
  local label=$1; shift
  ( while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.5; done ) > "$OUT/$label.mem" &
  local sampler=$! t0; t0=$(date +%s)
  "$@" > "$OUT/$label.out" 2> "$OUT/$label.err"; local rc=$?
  kill $sampler 2>/dev/null
  { echo "### $label: rc $rc, $(( $(date +%s) - t0 )) s, peak device memory $(sort -n "$OUT/$label.mem" | tail -1) MiB"
    grep '^|' "$OUT/$label.out"; grep -h 'gpu experts\|compiled\|loaded\|rror' "$OUT/$label.err" | head -4; echo; } >> "$R"
}
if [[ " $PARTS " == *" ik "* ]] && [ -x "$IK/llama-sweep-bench" ]; then
  timed ik-ooae "$IK/llama-sweep-bench" -m "$M" $FLAGS -fa on -ngl 99 -ot exps=CPU -n 64
  timed ik-no-ooae "$IK/llama-sweep-bench" -m "$M" $FLAGS -fa on -ngl 99 -ot exps=CPU -no-ooae -n 64
fi
if [[ " $PARTS " == *" ikjax "* ]]; then
  S=/tmp/r1-stats.json; rm -f "$S"
  ikj() { python3 -m ikjax.cli sweep-bench -m "$M" $FLAGS -fa 1 -ot exps=CPU -n 64 "$@"; }
  timed ikjax-default ikj --expert-stats "$S"
  [ -n "${SKIP_LAYER:-}" ] || timed ikjax-stream-layer env IKJAX_STREAM=layer python3 -m ikjax.cli sweep-bench -m "$M" $FLAGS -fa 1 -ot exps=CPU -n 64
  cp "$S" "$OUT/r1-stats.json"
  frac=$(python3 -c "print(round(24 * 1024 / $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1), 3))")
  timed ikjax-gpu-experts-24GB env XLA_PYTHON_CLIENT_MEM_FRACTION=$frac python3 -m ikjax.cli sweep-bench -m "$M" $FLAGS \
      -fa 1 -ot exps=CPU -n 64 --gpu-experts auto --expert-stats "$S"
  [ -n "${SKIP_ALL:-}" ] || timed ikjax-gpu-experts-all-card ikj --gpu-experts auto --expert-stats "$S"
fi
cat "$R"
