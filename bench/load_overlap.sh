#!/usr/bin/env bash
# Issue 22 item 4 on whatever machine runs it: a cold sweep-bench (fresh compile cache each) with the
# load beside the compile (IKJAX_LOAD_OVERLAP=1) and after it (=0), alternating; then the load
# alone with and without the next layer's pages mapped ahead (IKJAX_PREFETCH), page cache warm.
#   MODEL=/tmp/ov/v2l8.gguf ROUNDS=2 bash bench/load_overlap.sh
# (make the model with `ikjax make-model --preset v2-lite --layers 8 --type Q4_0 -o $MODEL`)
set -euo pipefail
MODEL=${MODEL:?a GGUF file} ROUNDS=${ROUNDS:-2} ARGS=${ARGS:-"-c 1024 -ub 256 -n 16"} OUT=${OUT:-/tmp/load_overlap}
mkdir -p "$OUT"
cat "$MODEL" > /dev/null
echo "| run | overlap | wall s | compile line | load line |"
echo "|---|---|---|---|---|"
for r in $(seq "$ROUNDS"); do
  for ov in 0 1; do
    rm -rf "$OUT/cc"
    s=$(date +%s.%N)
    IKJAX_LOAD_OVERLAP=$ov IKJAX_COMPILE_CACHE="$OUT/cc" ikjax sweep-bench -m "$MODEL" $ARGS > "$OUT/out" 2> "$OUT/err"
    e=$(date +%s.%N)
    echo "| $r | $ov | $(python3 -c "print(f'{$e-$s:.1f}')") | $(grep -m1 '^compiled' "$OUT/err" | cut -c1-60) | $(grep -m1 '^loaded' "$OUT/err") |"
  done
done
echo
echo "load alone (ikjax.load + wait_loaded), seconds, page cache warm:"
for r in $(seq $((ROUNDS * 2))); do
  for p in 0 1; do
    IKJAX_PREFETCH=$p python3 -c "
import sys, time, ikjax
t0 = time.perf_counter(); e = ikjax.load(sys.argv[1], ctx=1024, ubatch=256); e.wait_loaded()
print('prefetch', sys.argv[2], f'{time.perf_counter() - t0:.2f}')" "$MODEL" $p 2>/dev/null
  done
done | sort | awk '{a[$2]=a[$2]" "$3} END {for (k in a) print "  IKJAX_PREFETCH=" k ":" a[k]}'
