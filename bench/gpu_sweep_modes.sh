#!/usr/bin/env bash
# Issue 11's sweep-bench rows on one GPU: the 27-layer V2-Lite-shape Q4_0 model
# (`make-model --preset v2-lite --type Q4_0`), `-c 16384 -ub 2048 -n 128 -fa 1`, for `-mla 3` and
# `-mla 2`, each once cold (empty persistent compile cache) and once warm (the same command again),
# with the seconds from the command's start to its first table row and to its end.
#
# On the device, from the repo root, carrying .whl (the gguf wheel):
#   bash bench/gpu_sweep_modes.sh        results: $OUT/sweep_modes.md and one log per run
# Knobs: MODES ("3 2"), CTX (16384), UB (2048), TG (128), MODEL (/tmp/v2l27-Q4_0.gguf), LOGDIR ($OUT:
# the per-run logs; the device returns a few files only).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/sweep_modes_out}
mkdir -p "$OUT" "${LOGDIR:-$OUT}"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
MODEL=${MODEL:-/tmp/v2l27-Q4_0.gguf} CTX=${CTX:-16384} UB=${UB:-2048} TG=${TG:-128}
export IKJAX_COMPILE_CACHE=/tmp/ikjax-xla-cache
[ -f "$MODEL" ] || python3 -m ikjax.cli make-model -o "$MODEL" --preset v2-lite --type Q4_0 > /dev/null || exit 1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
{
  echo "$card, jax $(python3 -c 'import jax; print(jax.__version__)'), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  echo
} > "$OUT/sweep_modes.md"
for mla in ${MODES:-3 2}; do
  rm -rf "$IKJAX_COMPILE_CACHE"
  for start in cold warm; do
    log="${LOGDIR:-$OUT}/mla${mla}_${start}.log"
    t0=$(date +%s.%N)
    stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done; }
    python3 -m ikjax.cli sweep-bench -m "$MODEL" -c "$CTX" -ub "$UB" -n "$TG" -mla "$mla" -fa 1 \
      2> >(stamp > "$log.err") | stamp > "$log"
    sleep 0.2
    t1=$(date +%s.%N)
    first=$(awk '$2 ~ /^\|/ && $3 ~ /^[0-9]+$/ {print $1; exit}' "$log")
    {
      echo "### -mla $mla, $start start: first row after $(python3 -c "print(f'{$first - $t0:.1f}')") s, all done after $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
      # where the time to the first row goes: stderr's lines, seconds after the command started
      grep -h ' compiled\| loaded\| compiling' "$log.err" | awk -v t0="$t0" '{ $1 = sprintf("    +%.1fs", $1 - t0); print }'
      echo
      cut -d' ' -f2- "$log" | grep '^|'
      echo
    } >> "$OUT/sweep_modes.md"
    tail -12 "$OUT/sweep_modes.md"
  done
done
