#!/usr/bin/env bash
# Issue 24 on one GPU + its host: the realistically routed 8-layer R1 (make-model --preset r1
# --layers 8 --type Q4_0, 256 experts, routing spread as a trained model's) with its routed
# experts in host RAM, ik_llama.cpp beside ikjax, same file, same flags:
#   ik: -ot exps=CPU (default -ooae), -no-ooae;   ikjax: default, IKJAX_STREAM=layer,
#   --gpu-experts auto under a 24 GB device budget (XLA_PYTHON_CLIENT_MEM_FRACTION), and with the
#   whole card; the statistics from the default run's own sweep (--expert-stats).
# Peak device memory of each run sampled with nvidia-smi. Results: $OUT/hybrid.md
#   IK=/tmp/ikc/build/bin bash bench/gpu_hybrid_r1.sh [PARTS: "ik ikjax" or run names]
# Run names (PARTS "ik" = ik-ooae ik-no-ooae, "ikjax" = ikjax-default ikjax-stream-layer
# ikjax-gpu-experts-24GB ikjax-gpu-experts-all-card): also ikjax-active (IKJAX_STREAM=active, ik's
# -ooae rule), ikjax-ub4096 / ikjax-ub8192 and ik-ub4096 / ik-ub8192 (-ub = -b, -c 4 x -ub).
# HYB_GPU (0): the GPU the runs use (CUDA_VISIBLE_DEVICES).
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
  ( while true; do nvidia-smi -i ${HYB_GPU:-0} --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.5; done ) > "$OUT/$label.mem" &
  local sampler=$! t0; t0=$(date +%s)
  "$@" > "$OUT/$label.out" 2> "$OUT/$label.err"; local rc=$?
  kill $sampler 2>/dev/null
  { echo "### $label: rc $rc, $(( $(date +%s) - t0 )) s, peak device memory $(sort -n "$OUT/$label.mem" | tail -1) MiB"
    grep -h '^|' "$OUT/$label.out" "$OUT/$label.err"; grep -h 'gpu experts\|compiled\|loaded\|rror' "$OUT/$label.err" | head -4; echo; } >> "$R"
}
export CUDA_VISIBLE_DEVICES=${HYB_GPU:-0}
want() { [[ " $PARTS " == *" $1 "* ]] || [[ " $PARTS " == *" ${1%%-*} "* && " $2 " == *" ${1#*-} "* ]]; }
S=/tmp/r1-stats.json
ikj() { python3 -m ikjax.cli sweep-bench -m "$M" -fa 1 -ot exps=CPU -n 64 "$@"; }
iku() { local ub=$1; shift; "$IK/llama-sweep-bench" -m "$M" -c $((4 * ub)) -ub $ub -b $ub -mla 3 -t 16 -fa on -ngl 99 -ot exps=CPU -n 64 "$@"; }
if [ -x "$IK/llama-sweep-bench" ]; then
  want ik-ooae "ooae no-ooae" && timed ik-ooae "$IK/llama-sweep-bench" -m "$M" $FLAGS -fa on -ngl 99 -ot exps=CPU -n 64
  want ik-no-ooae "ooae no-ooae" && timed ik-no-ooae "$IK/llama-sweep-bench" -m "$M" $FLAGS -fa on -ngl 99 -ot exps=CPU -no-ooae -n 64
  want ik-ub4096 "" && timed ik-ub4096 iku 4096
  want ik-ub8192 "" && timed ik-ub8192 iku 8192
elif [[ "$PARTS" == *ik-* || " $PARTS " == *" ik "* ]]; then
  echo "### ik: no $IK/llama-sweep-bench (build not finished?)" >> "$R"
fi
GROUP="default stream-layer gpu-experts-24GB gpu-experts-all-card"
if want ikjax-default "$GROUP" || { [ ! -f "$S" ] && [[ "$PARTS" == *gpu-experts* || " $PARTS " == *" ikjax "* ]]; }; then
  rm -f "$S"; timed ikjax-default ikj $FLAGS --expert-stats "$S"
fi
[ -f "$S" ] && cp "$S" "$OUT/r1-stats.json"
want ikjax-stream-layer "$GROUP" && timed ikjax-stream-layer env IKJAX_STREAM=layer python3 -m ikjax.cli sweep-bench -m "$M" $FLAGS -fa 1 -ot exps=CPU -n 64
want ikjax-active "" && timed ikjax-active env IKJAX_STREAM=active python3 -m ikjax.cli sweep-bench -m "$M" $FLAGS -fa 1 -ot exps=CPU -n 64
for ub in 4096 8192; do
  want ikjax-ub$ub "" && timed ikjax-ub$ub ikj -c $((4 * ub)) -ub $ub -b $ub -mla 3 -t 16
done
if want ikjax-gpu-experts-24GB "$GROUP"; then
  frac=$(python3 -c "print(round(24 * 1024 / $(nvidia-smi -i ${HYB_GPU:-0} --query-gpu=memory.total --format=csv,noheader,nounits | head -1), 3))")
  timed ikjax-gpu-experts-24GB env XLA_PYTHON_CLIENT_MEM_FRACTION=$frac python3 -m ikjax.cli sweep-bench -m "$M" $FLAGS \
      -fa 1 -ot exps=CPU -n 64 --gpu-experts auto --expert-stats "$S"
fi
want ikjax-gpu-experts-all-card "$GROUP" && timed ikjax-gpu-experts-all-card ikj $FLAGS --gpu-experts auto --expert-stats "$S"
cat "$R"
