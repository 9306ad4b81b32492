#!/usr/bin/env bash
# Issue 11's measurements in one device call (RESULTS §13b), from the repo root, carrying .whl:
#   1. decode anatomy: bench/gpu_graph.py, one step per dispatch vs a 16-step loop captured as one
#      CUDA graph, with a profiler trace of each (device time per kernel: trace_*.json.gz);
#   2. sweep-bench rows, -mla 3 and -mla 2, cold and warm (bench/gpu_sweep_modes.sh);
#   3. the 8-layer R1 shape all on the GPU, cold and warm (SPEC §5's second row);
#   4. what is left of the time: the routed experts' down GEMV schedules (bench/gpu_gemv_tune.py).
# Results under $OUT: graph.md, sweep_modes.md, r1.md, gemv_tune.md.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/issue11_out}
mkdir -p "$OUT"
python3 -c "import gguf" 2> /dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
MODEL=${MODEL:-/tmp/v2l27-Q4_0.gguf} R1=${R1:-/tmp/r1-8.gguf}
[ -f "$MODEL" ] || python3 -m ikjax.cli make-model -o "$MODEL" --preset v2-lite --type Q4_0 > /dev/null
GRAPH_TRACE=1 timeout 150 python3 bench/gpu_graph.py --model "$MODEL" --budget 130 --only "K=1 off,K=16 cb+while" \
  --out "$OUT" > "$OUT/graph.log" 2>&1; grep '^|' "$OUT/graph.log" > "$OUT/graph.md"; rm -f "$OUT"/*.hlo.txt
cat "$OUT/graph.md"
MODEL=$MODEL timeout 300 bash bench/gpu_sweep_modes.sh > /dev/null 2>&1; rm -f "$OUT"/*.log "$OUT"/*.log.err
grep -v '^|-' "$OUT/sweep_modes.md"
[ -f "$R1" ] || python3 -m ikjax.cli make-model -o "$R1" --preset r1 --layers 8 --type Q4_0 > /dev/null
export IKJAX_COMPILE_CACHE=/tmp/ikjax-r1-cache
rm -rf "$IKJAX_COMPILE_CACHE"
for start in cold warm; do
  t0=$(date +%s.%N)
  timeout 150 python3 -m ikjax.cli sweep-bench -m "$R1" -c 4096 -ub 2048 -b 2048 -mla 3 -fa 1 2>&1 \
    | grep '^|\|compiled' | sed "s/^/$start /"
  echo "$start: $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s in all"
done | tee "$OUT/r1.md"
timeout 90 python3 bench/gpu_gemv_tune.py --budget 70 --only "exps down" --out "$OUT" 2>&1 | grep '^|' | head -8
