#!/usr/bin/env bash
# Issue 20 (layered packages, behaviour unchanged): the same sweep-bench, before (the flat layout,
# commit eba9e06, unpacked from .whl/old.tar.gz) and after (this checkout), alternated in one lease
# on one GPU, plus the GPU-marked tests of this checkout.
#
# On the device, from the repo root, carrying .whl (the gguf wheel and old.tar.gz):
#   bash bench/gpu_layout_ab.sh          results: $OUT/layout_ab.md
# Knobs: LAYERS (8), CTX (4096), UB (512), TG (64), RUNS (2).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/layout_ab_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl || exit 1
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf .whl/old.tar.gz -C /tmp/old
LAYERS=${LAYERS:-8} CTX=${CTX:-4096} UB=${UB:-512} TG=${TG:-64} RUNS=${RUNS:-2}
MODEL=/tmp/v2l${LAYERS}-Q4_0.gguf
export IKJAX_COMPILE_CACHE=0
new() { PYTHONPATH=$PWD:/tmp/site python3 -m ikjax.cli "$@"; }
old() { (cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/site python3 -c "from ikjax.cli import app; app()" "$@"); }
[ -f "$MODEL" ] || new make-model -o "$MODEL" --preset v2-lite --type Q4_0 --layers "$LAYERS" > /dev/null || exit 1
{
  echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), jax $(python3 -c 'import jax; print(jax.__version__)')"
  echo "sweep-bench -m v2-lite ${LAYERS} layers Q4_0 -c $CTX -ub $UB -n $TG -mla 3 -fa 1, compile cache off"
  echo
} > "$OUT/layout_ab.md"
for r in $(seq "$RUNS"); do
  for which in old new; do
    echo "### $which, run $r" >> "$OUT/layout_ab.md"
    $which sweep-bench -m "$MODEL" -c "$CTX" -ub "$UB" -n "$TG" -mla 3 -fa 1 2> "$OUT/$which$r.err" \
      | grep '^|' >> "$OUT/layout_ab.md"
    grep -h 'compiled' "$OUT/$which$r.err" >> "$OUT/layout_ab.md"
    echo >> "$OUT/layout_ab.md"
  done
done
echo "### GPU-marked tests (this checkout)" >> "$OUT/layout_ab.md"
PYTHONPATH=$PWD:/tmp/site timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_decode_gpu.py tests/test_kernels_mla.py tests/test_kernels_moe.py tests/test_kernels_quant_matmul.py \
  2>&1 | tail -5 >> "$OUT/layout_ab.md"
cat "$OUT/layout_ab.md"
