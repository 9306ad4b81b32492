#!/usr/bin/env bash
# Issues 25 / 22: why `-ot` steps miss JAX's persistent cache on a GPU (RESULTS §25i/§25j). The tiny
# preset (4 layers, Q4_K) through sweep-bench twice in one fresh cache, with JAX's cache-key log
# (each part of the key hashed alone) and the steps' HLO before optimization dumped; the same pair
# without -ot and with IKJAX_STORE_STEPS=0 (JAX's own cache, not ikjax's whole steps) as the control.
# The dump directory is the same path in every run (XLA_FLAGS is part of ikjax's cache key) and is
# moved under $OUT after each run. Prints each run's compile line and the parts whose hash differs.
set -uo pipefail
OUT=${OUT:-/tmp/ot_probe}
# MODEL52 / ARGS52: another file and its flags (the 8-layer R1: MODEL52=/tmp/r1-8.gguf ARGS52="-c 4096 -ub 2048
# -n 32 -mla 3 -fa 1", which still compiled on a warm -ot run after 46ce482: RESULTS §25j)
M=${MODEL52:-/tmp/tiny4-Q4_K.gguf}
[ -f $M ] || python3 -m ikjax.cli make-model -o $M --preset tiny --layers 4 --type Q4_K > /dev/null
export JAX_DEBUG_LOG_MODULES=jax._src.cache_key,jax._src.compiler,jax._src.compilation_cache
export XLA_FLAGS="--xla_dump_to=/tmp/dump52 --xla_dump_hlo_as_text"
for mode in ${MODES:-ot plain}; do
  cache=/tmp/cc52_$mode; rm -rf $cache
  extra=""; envs=""
  [ $mode = ot ] && extra="-ot exps=CPU -t ${THREADS52:-4}"
  [ $mode = plain ] && envs="IKJAX_STORE_STEPS=0"
  for run in 1 2; do
    d=$OUT/$mode$run; mkdir -p $d; rm -rf /tmp/dump52
    env $envs IKJAX_COMPILE_CACHE=$cache timeout 200 python3 -m ikjax.cli sweep-bench -m $M ${ARGS52:--c 512 -ub 256 -n 4} \
      $extra > $d/out 2> $d/err
    echo "$mode run $run rc $? $(grep -ho 'compiled [0-9]* steps, [0-9]* from the cache[^(]*' $d/err | tail -1)"
    grep -h "Not writing\|Persistent compilation cache hit\|Writing .* to persistent" $d/err | sed 's/^.*\] //' | sort | uniq -c | head -8
    mkdir -p $d/hlo; find /tmp/dump52 -name "*before_optimizations.txt" -exec cp {} $d/hlo/ \; 2>/dev/null
    grep -h "get_cache_key hash of serialized" $d/err | sed 's/^.*hash of serialized //' > $d/keyparts
  done
  echo "$mode: key parts that differ between the runs:"
  diff $OUT/${mode}1/keyparts $OUT/${mode}2/keyparts | head -12
  for f in $OUT/${mode}1/hlo/*.txt; do
    b=$(basename $f | sed 's/^module_[0-9]*\.//'); g=$(ls $OUT/${mode}2/hlo/*."$b" 2>/dev/null | head -1)
    [ -n "$g" ] || continue
    if ! cmp -s <(sed 's/, metadata={[^}]*}//g' $f) <(sed 's/, metadata={[^}]*}//g' $g); then
      echo "HLO differs: $b"; diff <(sed 's/, metadata={[^}]*}//g' $f) <(sed 's/, metadata={[^}]*}//g' $g) | head -6 | cut -c1-400
    fi
  done
done
