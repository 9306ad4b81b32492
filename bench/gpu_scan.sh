#!/usr/bin/env bash
# Issue 22 on one GPU: cold start and speed of the scanned layers (this checkout) beside the
# unrolled ones (IKJAX_LAYERS=unroll) and the code before the change (commit a95e468, unpacked
# from .whl/old22.tar.gz), alternated in one lease. Every command timed from start to end.
#   bash bench/gpu_scan.sh                 results: $OUT/scan.md
# PARTS: any of "cold sweep sweepnew r1 tests" (default "cold sweep"); WHO: "old new" (cold part).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/scan_out}
mkdir -p "$OUT"
PARTS=${PARTS:-"cold sweep"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl || exit 1
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf .whl/old22.tar.gz -C /tmp/old
new() { PYTHONPATH=$PWD:/tmp/site python3 -m ikjax.cli "$@"; }
old() { (cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/site python3 -m ikjax.cli "$@"); }
R=$OUT/scan.md
timed() {  # timed LABEL CMD...: wall seconds of the whole command, its table and compile lines
  local label=$1; shift
  local t0 t1; t0=$(date +%s.%N)
  "$@" > "$OUT/$label.out" 2> "$OUT/$label.err"; local rc=$?
  t1=$(date +%s.%N)
  { echo "### $label: rc $rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s from command to end"
    grep '^|' "$OUT/$label.out"; grep -h 'compiled\|sweep took\|loaded' "$OUT/$label.err" | head -4; echo; } >> "$R"
}
V2L=/tmp/v2l-Q4_0.gguf
[ -f "$V2L" ] || new make-model -o "$V2L" --preset v2-lite --type Q4_0 > /dev/null || exit 1
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), jax $(python3 -c 'import jax; print(jax.__version__)')" > "$R"
echo "model: make-model --preset v2-lite --type Q4_0 (27 layers); -mla 3 -fa 1" >> "$R"; echo >> "$R"
SB="-m $V2L -mla 3 -fa 1"
if [[ " $PARTS " == *" cold "* ]]; then
  for who in ${WHO:-old new}; do
    rm -rf /tmp/cc-$who
    IKJAX_COMPILE_CACHE=/tmp/cc-$who timed "$who-cold-c4096" $who sweep-bench $SB -c 4096 -ub 512 -n 64
    IKJAX_COMPILE_CACHE=/tmp/cc-$who timed "$who-warm-c4096" $who sweep-bench $SB -c 4096 -ub 512 -n 64
  done
fi
if [[ " $PARTS " == *" sweep "* ]]; then
  rm -rf /tmp/cc-16k-new /tmp/cc-16k-unroll /tmp/cc-16k-old
  IKJAX_COMPILE_CACHE=/tmp/cc-16k-new timed new-cold-c16384 new sweep-bench $SB -c 16384 -ub 2048 -n 128
  IKJAX_LAYERS=unroll IKJAX_COMPILE_CACHE=/tmp/cc-16k-unroll timed unroll-cold-c16384 new sweep-bench $SB -c 16384 -ub 2048 -n 128
  IKJAX_COMPILE_CACHE=/tmp/cc-16k-old timed old-cold-c16384 old sweep-bench $SB -c 16384 -ub 2048 -n 128
  IKJAX_COMPILE_CACHE=/tmp/cc-16k-new timed new-warm-c16384 new sweep-bench $SB -c 16384 -ub 2048 -n 128
fi
if [[ " $PARTS " == *" sweepnew "* ]]; then
  rm -rf /tmp/cc-16k-new
  IKJAX_COMPILE_CACHE=/tmp/cc-16k-new timed new-cold-c16384 new sweep-bench $SB -c 16384 -ub 2048 -n 128
fi
if [[ " $PARTS " == *" r1 "* ]]; then
  for L in 8 61; do
    f=/tmp/r1-$L.gguf
    [ -f "$f" ] || new make-model -o "$f" --preset r1 --layers $L --experts 8 --type Q4_0 > /dev/null || exit 1
    rm -rf /tmp/cc-r1-$L
    IKJAX_COMPILE_CACHE=/tmp/cc-r1-$L timed "new-r1-$L-layers" new sweep-bench -m $f -mla 3 -fa 1 -c 4096 -ub 512 -n 32
  done
fi
if [[ " $PARTS " == *" tests "* ]]; then
  echo "### GPU-marked tests (this checkout)" >> "$R"
  PYTHONPATH=$PWD:/tmp/site timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_decode_gpu.py tests/test_kernels_mla.py tests/test_kernels_moe.py tests/test_kernels_quant_matmul.py \
    2>&1 | tail -5 >> "$R"
fi
cat "$R"
