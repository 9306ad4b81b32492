#!/usr/bin/env bash
# Issue 26's table on a device host's CPU (items 2 and 4): sweep-bench of the issue's 4-layer V2-Lite
# files (+ q_lora 1536; RESULTS §26c), ik_llama.cpp built CPU-only twice (AVX2 only, and native)
# beside ikjax capped per level (IKJAX_CPU_ISA=avx2 / avx512 / amx), each run pinned with taskset to
# T distinct physical cores. No network; nothing of ik is committed (its source comes as
# .whl/ikfull.tar.gz, carried like the gguf wheel).
#
#   bash bench/cpu_isa_table.sh                       (repo root; carry .whl)
#
# Writes $OUT/table.md (the table, the host, `ikjax info`'s level line, the test results) and a log
# per step and run in $OUT. Nothing new starts after DEADLINE seconds (default 540): runs not done
# by then are marked "-" in the table. Order: install ikjax and build both iks in parallel, then the
# kernel tests (in the background, 150 s at most), the models, then -t 16 (every file), then -t 2.
#
# Knobs (environment): OUT (default $OUT or /tmp/cpu_isa_out), DEADLINE, THREADS ("16 2"),
# TYPES ("Q8_0 Q4_0 Q4_K IQ4_XS"), JOBS (ik build -j, default cores / 2), IK_TGZ
# (.whl/ikfull.tar.gz), IK_DIR (/tmp/ikt: sources and build-avx2 / build-native; a build whose
# llama-sweep-bench exists is reused), IK_AVX2_BIN / IK_NATIVE_BIN (use these binaries, build
# nothing), NO_INSTALL=1 (ikjax already installed), CPUTABLE_FAKE=1 (rehearsal on a small CPU machine:
# 1-layer files, -c 256 -ub 128 -n 8, -t 2, Q8_0 Q4_0, ik's AVX2 build from /tmp/ikfull/build for both
# ik columns when present and IK_DIR is not set, DEADLINE 420).
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
# the columns run (VARIANTS="ik_native jx_amx jx_amxint8": only those, and only the ik builds named);
# jx_amxint8: the amx level's int8 form (IKJAX_AMX=int8; jx_amx runs its default, bf16 where the CPU has it);
# jx_avx2plain: the avx2 level without its AVX-VNNI build (IKJAX_AVXVNNI=0; jx_avx2 runs it where the CPU has it)
VARIANTS=${VARIANTS:-"ik_avx2 jx_avx2 ik_native jx_avx512 jx_amx"}
START=$(date +%s)
FAKE=${CPUTABLE_FAKE:-0}
OUT=${OUT:-/tmp/cpu_isa_out}
mkdir -p "$OUT"
if [ "$FAKE" = 1 ]; then
  DEADLINE=${DEADLINE:-420}; THREADS=${THREADS:-2}; TYPES=${TYPES:-"Q8_0 Q4_0"}
  LAYERS=1; SWEEP="-c 256 -ub 128 -n 8"
  if [ -z "${IK_DIR:-}" ] && [ -x /tmp/ikfull/build/bin/llama-sweep-bench ]; then
    IK_AVX2_BIN=${IK_AVX2_BIN:-/tmp/ikfull/build/bin/llama-sweep-bench}
    IK_NATIVE_BIN=${IK_NATIVE_BIN:-/tmp/ikfull/build/bin/llama-sweep-bench}
  fi
else
  DEADLINE=${DEADLINE:-540}; THREADS=${THREADS:-"16 2"}; TYPES=${TYPES:-"Q8_0 Q4_0 Q4_K IQ4_XS"}
  LAYERS=4; SWEEP="-c 1024 -ub 512 -n 32"
fi
FLAGS="$SWEEP -mla 3 -fa 1"
IK_TGZ=${IK_TGZ:-.whl/ikfull.tar.gz}
IK_DIR=${IK_DIR:-/tmp/ikt}
NCPU=$(nproc)
JOBS=${JOBS:-$(( NCPU / 2 > 1 ? NCPU / 2 : 1 ))}
PY=${PYTHON:-python3}
elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
log() { echo "[$(elapsed)s] $*" | tee -a "$OUT/progress.log"; }

# ---- (a) ikjax, (c) the two ik builds, all in parallel ------------------------------------------
if [ "${NO_INSTALL:-0}" != 1 ]; then
  ( $PY -m pip install -q --no-index --no-deps .whl/gguf-*.whl \
      && timeout $(( DEADLINE * 2 / 3 )) $PY -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/ikjax-install.log" 2>&1 &
  PID_INSTALL=$!
else
  PID_INSTALL=""
fi

ik_build() {  # $1 = avx2 | native; prints the binary's path on success
  local kind=$1 b="$IK_DIR/build-$1" opts
  [ -x "$b/bin/llama-sweep-bench" ] && { echo "$b/bin/llama-sweep-bench"; return 0; }
  if [ "$kind" = avx2 ]; then opts="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF"; else opts="-DGGML_NATIVE=ON"; fi
  { cmake -S "$IK_DIR/src" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF $opts \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    && timeout $(( DEADLINE * 2 / 3 - $(elapsed) )) cmake --build "$b" -j "$JOBS" --target llama-sweep-bench; } \
    > "$OUT/ik-build-$kind.log" 2>&1 \
    && [ -x "$b/bin/llama-sweep-bench" ] && echo "$b/bin/llama-sweep-bench"
}
if [ -z "${IK_AVX2_BIN:-}" ] || [ -z "${IK_NATIVE_BIN:-}" ]; then
  if [ ! -f "$IK_DIR/src/CMakeLists.txt" ]; then
    log "unpacking $IK_TGZ into $IK_DIR/src"
    rm -rf "$IK_DIR/src" && mkdir -p "$IK_DIR/src" && tar -xzf "$IK_TGZ" -C "$IK_DIR/src" \
      || { log "no ik source ($IK_TGZ)"; }
    # only llama-sweep-bench: the examples list trimmed (as bench/ik_tools_ab.sh), pocs empty
    mkdir -p "$IK_DIR/src/pocs" && : > "$IK_DIR/src/pocs/CMakeLists.txt"
    printf 'add_subdirectory(sweep-bench)\n' > "$IK_DIR/src/examples/CMakeLists.txt"
  fi
  log "building ik (avx2, native) with -j $JOBS each"
  [[ " $VARIANTS " == *" ik_avx2 "* ]] || IK_AVX2_BIN=${IK_AVX2_BIN:-none}
  [[ " $VARIANTS " == *" ik_native "* ]] || IK_NATIVE_BIN=${IK_NATIVE_BIN:-none}
  [ -z "${IK_AVX2_BIN:-}" ] && { ik_build avx2 > "$OUT/.ik-avx2" & PID_IKA=$!; }
  [ -z "${IK_NATIVE_BIN:-}" ] && { ik_build native > "$OUT/.ik-native" & PID_IKN=$!; }
fi
if [ -n "$PID_INSTALL" ]; then
  if wait "$PID_INSTALL"; then
    log "ikjax installed"
  else
    log "ikjax install FAILED: $OUT/ikjax-install.log"
    { echo "# cpu_isa_table: the ikjax install failed"; echo; tail -n 40 "$OUT/ikjax-install.log" | sed 's/^/    /'; } > "$OUT/table.md"
    cat "$OUT/table.md"
    exit 1
  fi
fi

# ---- host and level report ---------------------------------------------------------------------
{
  echo "host: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs, $(lscpu | sed -n 's/^Thread(s) per core: *//p') thread(s) per core, $(lscpu | sed -n 's/^Socket(s): *//p') socket(s)"
  echo "flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  echo "ikjax $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)"
  for lv in "" avx2 avx512 amx; do
    echo "IKJAX_CPU_ISA=${lv:-unset}: $(IKJAX_CPU_ISA=$lv $PY -c 'from pallas_kernels import cpu; print(cpu.isa_report())' 2>&1 | tail -1)"
  done
} > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

# ---- (b) the kernel tests: in the background on CPUs the runs do not use (the last 8 by number, the
# siblings / cores farthest from the runs' first ones) where the host has room, else now ------------
TESTK="amx or avx_vnni or isa_report or (test_bf16_compute and (Q8_0 or Q4_0 or Q4_K or IQ4_XS)) or (int8_decode and (Q4_K or Q6_K))"
MAXT=0; for t in $THREADS; do [ "$t" -gt "$MAXT" ] && MAXT=$t; done
XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 0"
run_tests() {
  if ! $PY -c "import pytest" 2>/dev/null; then echo "pytest is not installed: no kernel tests" > "$OUT/tests.log"; return; fi
  timeout 150 "$@" $PY -m pytest -q -rs $XDIST -p no:cacheprovider tests/test_cpu_amx.py tests/test_cpu_quant_matmul.py \
    -k "$TESTK" > "$OUT/tests.log" 2>&1
  echo "rc=$?" >> "$OUT/tests.log"
}
if [ "$NCPU" -ge $(( 2 * MAXT + 8 )) ]; then
  run_tests taskset -c "$(( NCPU - 8 ))-$(( NCPU - 1 ))" &
  PID_TESTS=$!
else
  log "kernel tests (foreground: $NCPU CPUs)"
  run_tests env
  PID_TESTS=""
fi

# ---- (d) the models, in parallel (while ik builds) -------------------------------------------------
PIDS_MODELS=""
for T in $TYPES; do
  f=/tmp/cpuisa_${LAYERS}l_$T.gguf
  [ -s "$f" ] && continue
  log "make-model $T"
  ( timeout $(( $(left) > 300 ? 240 : ($(left) > 90 ? $(left) - 60 : 30) )) $PY -m ikjax.cli make-model --preset v2-lite --layers $LAYERS --q-lora-rank 1536 --type $T -o "$f.part" \
      > "$OUT/make-model-$T.log" 2>&1 && mv "$f.part" "$f" || log "make-model $T FAILED ($OUT/make-model-$T.log)" ) &
  PIDS_MODELS="$PIDS_MODELS $!"
done
for p in $PIDS_MODELS; do wait "$p"; done
log "models made"

[ -n "${PID_IKA:-}" ] && { wait "$PID_IKA"; IK_AVX2_BIN=$(cat "$OUT/.ik-avx2"); }
[ -n "${PID_IKN:-}" ] && { wait "$PID_IKN"; IK_NATIVE_BIN=$(cat "$OUT/.ik-native"); }
log "ik AVX2: ${IK_AVX2_BIN:-build FAILED ($OUT/ik-build-avx2.log)}; ik native: ${IK_NATIVE_BIN:-build FAILED ($OUT/ik-build-native.log)}"

# ---- pinning: T distinct physical cores (one CPU of each core; the first socket / node first) ----
# (fewer physical cores than T: their SMT siblings fill up to T CPUs; the table says so)
cores_for() {  # $1 = T -> a taskset CPU list
  lscpu -p=CPU,CORE,SOCKET,NODE | grep -v '^#' | sort -t, -k4,4n -k3,3n -k2,2n -k1,1n \
    | awk -F, -v n="$1" '{ cpu[NR] = $1; first[NR] = !seen[$3","$2]++ }
        END { for (i = 1; i <= NR && c < n; i++) if (first[i]) { out = out (c ? "," : "") cpu[i]; c++ }
              for (i = 1; i <= NR && c < n; i++) if (!first[i]) { out = out (c ? "," : "") cpu[i]; c++ }
              print out }'
}
physical_of() {  # $1 = CPU list -> how many distinct physical cores it covers
  lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | awk -F, -v l=",$1," 'index(l, "," $1 ",") && !s[$3","$2]++ { c++ } END { print c + 0 }'
}
declare -A PIN

# ---- (e) the runs (ik's from $OUT: it writes llama.log into its working directory) -----------------
# one run: $1 = label (file name part), $2.. = command; prints "S_PP / S_TG" (medians of its rows)
parse() {  # sweep-bench's markdown rows -> "pp / tg" medians (or "err")
  awk -F'|' 'BEGIN { n = 0 } $2 ~ /^ *[0-9]+ *$/ && NF >= 8 { pp[n] = $6 + 0; tg[n] = $8 + 0; n++ }
    function med(a, n,   i, j, t) { for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      return n % 2 ? a[(n - 1) / 2] : (a[n / 2 - 1] + a[n / 2]) / 2 }
    END { if (n == 0) print "err"; else printf "%.0f / %.1f\n", med(pp, n), med(tg, n) }' "$1"
}
declare -A CELL
run_one() {  # $1 = key, $2 = log name, $3 = timeout s, rest = command
  local key=$1 name=$2 to=$3; shift 3
  if [ "$(left)" -lt 15 ]; then CELL[$key]="-"; log "skip $name (deadline)"; return; fi
  [ "$to" -gt "$(left)" ] && to=$(left)
  log "run $name"
  timeout "$to" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  CELL[$key]=$(parse "$OUT/$name.log")
  [ $rc -ne 0 ] && CELL[$key]="${CELL[$key]} (rc $rc)"
  log "  $name: ${CELL[$key]}"
}
for t in $THREADS; do
  CPUS=$(cores_for "$t")
  PIN[$t]="-t $t: taskset -c $CPUS ($(physical_of "$CPUS") physical cores)"
  log "${PIN[$t]}"
  for T in $TYPES; do
    f=/tmp/cpuisa_${LAYERS}l_$T.gguf
    for v in $VARIANTS; do
      key="$T,$t,$v"
      case $v in
        ik_avx2) [ -n "${IK_AVX2_BIN:-}" ] || { CELL[$key]="no build"; continue; }
                 run_one "$key" "ik-avx2-$T-t$t" 120 taskset -c "$CPUS" env -C "$OUT" "$IK_AVX2_BIN" -m "$f" $FLAGS -t "$t" ;;
        ik_native) [ -n "${IK_NATIVE_BIN:-}" ] || { CELL[$key]="no build"; continue; }
                 run_one "$key" "ik-native-$T-t$t" 120 taskset -c "$CPUS" env -C "$OUT" "$IK_NATIVE_BIN" -m "$f" $FLAGS -t "$t" ;;
        jx_amxint8) run_one "$key" "ikjax-amxint8-$T-t$t" 180 env IKJAX_CPU_ISA=amx IKJAX_AMX=int8 taskset -c "$CPUS" \
                   $PY -m ikjax.cli sweep-bench -m "$f" $FLAGS -t "$t" ;;
        jx_avx2plain) run_one "$key" "ikjax-avx2plain-$T-t$t" 180 env IKJAX_CPU_ISA=avx2 IKJAX_AVXVNNI=0 taskset -c "$CPUS" \
                   $PY -m ikjax.cli sweep-bench -m "$f" $FLAGS -t "$t" ;;
        jx_*_longspin) lv=${v#jx_}; lv=${lv%_longspin}  # the pool's workers spinning 2 ms after long parts too (before IKJAX_SPIN_LONG)
                 run_one "$key" "ikjax-$lv-longspin-$T-t$t" 180 env IKJAX_CPU_ISA=$lv IKJAX_SPIN_LONG=2000 taskset -c "$CPUS" \
                   $PY -m ikjax.cli sweep-bench -m "$f" $FLAGS -t "$t" ;;
        jx_*)    lv=${v#jx_}
                 run_one "$key" "ikjax-$lv-$T-t$t" 180 env IKJAX_CPU_ISA=$lv taskset -c "$CPUS" \
                   $PY -m ikjax.cli sweep-bench -m "$f" $FLAGS -t "$t" ;;
      esac
    done
  done
done

[ -n "$PID_TESTS" ] && wait "$PID_TESTS" 2>/dev/null
# ---- the table -----------------------------------------------------------------------------------
ratio() {  # "$1" / "$2" S_PP ratio (cells "pp / tg")
  awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " / "); split(b, y, " / "); if (x[1] + 0 > 0 && y[1] + 0 > 0) printf "%.2f", x[1] / y[1]; else print "-" }'
}
{
  echo "# issue 26: ikjax per level vs ik_llama.cpp per build, sweep-bench $FLAGS ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  sed 's/^/    /' "$OUT/host.txt"
  echo
  echo "Files: \`make-model --preset v2-lite --layers $LAYERS --q-lora-rank 1536 --type T\`; cells S_PP / S_TG (t/s, median of the"
  echo "run's rows); each run pinned with taskset to T distinct physical cores. ik AVX2: \`-DGGML_NATIVE=OFF -DGGML_AVX2=ON"
  echo "-DGGML_AVX512=OFF\`; ik native: \`-DGGML_NATIVE=ON\`. ratio: S_PP over the ik build beside it."
  echo
  for t in $THREADS; do echo "    ${PIN[$t]:--t $t: not run}"; done
  echo
  echo "| file, -t | ik AVX2 | ikjax avx2 | avx2 / ik AVX2 | ik native | ikjax avx512 | ikjax amx | avx512 / ik native | amx / ik native | ikjax amx int8 | int8 / ik native | ikjax avx2, no AVX-VNNI | / ik AVX2 |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  for t in $THREADS; do
    for T in $TYPES; do
      a="${CELL[$T,$t,ik_avx2]:--}"; b="${CELL[$T,$t,jx_avx2]:--}"; c="${CELL[$T,$t,ik_native]:--}"
      d="${CELL[$T,$t,jx_avx512]:--}"; e="${CELL[$T,$t,jx_amx]:--}"; g="${CELL[$T,$t,jx_amxint8]:--}"
      p="${CELL[$T,$t,jx_avx2plain]:--}"
      echo "| $T, -t $t | $a | $b | $(ratio "$b" "$a") | $c | $d | $e | $(ratio "$d" "$c") | $(ratio "$e" "$c") | $g | $(ratio "$g" "$c") | $p | $(ratio "$p" "$a") |"
    done
  done
  extra=""; for v in $VARIANTS; do case " ik_avx2 jx_avx2 ik_native jx_avx512 jx_amx jx_amxint8 jx_avx2plain " in
    *" $v "*) ;; *) extra="$extra $v" ;; esac; done
  if [ -n "$extra" ]; then  # the columns the table has no place for (jx_*_longspin, ...)
    echo; echo "| file, -t | variant | S_PP / S_TG |"; echo "|---|---|---|"
    for t in $THREADS; do for T in $TYPES; do for v in $extra; do echo "| $T, -t $t | $v | ${CELL[$T,$t,$v]:--} |"; done; done; done
  fi
  echo
  echo "Kernel tests (tests/test_cpu_amx.py, tests/test_cpu_quant_matmul.py -k '$TESTK'):"
  echo
  grep -E "passed|failed|skipped|error|rc=|not installed" "$OUT/tests.log" | tail -n 4 | sed 's/^/    /'
  grep -E "^(FAILED|ERROR|SKIPPED) " "$OUT/tests.log" | head -n 20 | sed 's/^/    /'
  echo
  echo "Wall time $(elapsed) s (deadline $DEADLINE s); logs in $OUT."
} > "$OUT/table.md"
cat "$OUT/table.md"
