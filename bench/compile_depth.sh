#!/usr/bin/env bash
# Issue 22: cold compile against depth. For each layer count, a fresh compile cache and one
# `sweep-bench` of a `make-model` file; the whole command timed, and the sweep's own compile line.
#   bash bench/compile_depth.sh                 (tiny preset, 4 16 61 layers, this checkout)
# Knobs: PRESET (tiny), LAYERS ("4 16 61"), TYPE (Q8_0), ARGS (sweep-bench flags), EXTRA (make-model
# flags, e.g. "--experts 16"), IKJ (the ikjax command: "ikjax" or e.g. "python3 -m ikjax.cli"), OUT.
set -uo pipefail
PRESET=${PRESET:-tiny} LAYERS=${LAYERS:-"4 16 61"} TYPE=${TYPE:-Q8_0}
ARGS=${ARGS:-"-c 1024 -ub 256 -n 16"} EXTRA=${EXTRA:-} IKJ=${IKJ:-ikjax} OUT=${OUT:-/tmp/compile_depth}
mkdir -p "$OUT"
for L in $LAYERS; do
  f="$OUT/${PRESET}-${L}.gguf"
  [ -f "$f" ] || $IKJ make-model -o "$f" --preset "$PRESET" --type "$TYPE" --layers "$L" $EXTRA > /dev/null || exit 1
  rm -rf "$OUT/cache-$L"
  t0=$(date +%s.%N)
  IKJAX_COMPILE_CACHE="$OUT/cache-$L" $IKJ sweep-bench -m "$f" $ARGS > "$OUT/sweep-$L.txt" 2> "$OUT/sweep-$L.err"
  rc=$?
  t1=$(date +%s.%N)
  printf "%s layers=%-3s rc=%s wall=%6.1fs  %s\n" "$PRESET" "$L" "$rc" "$(echo "$t1 - $t0" | bc)" \
    "$(grep -ho 'compiled [^|]*' "$OUT/sweep-$L.err" "$OUT/sweep-$L.txt" | head -1)"
done
