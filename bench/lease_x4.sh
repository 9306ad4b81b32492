#!/usr/bin/env bash
# Issues 24 and 25 beside ik_llama.cpp on one 4-GPU lease (nvidia-h100-x4 / nvidia-h200-x4), in
# three calls on the same warm machine (each under 10 minutes; the machine stays between them):
#   STAGE=0: the ik build and the R1-8 file started as in 1; the Pallas prompt attention against
#            XLA's (bench/gpu_prompt_attn.py, then the V2-Lite sweep on one GPU both ways); the
#            -sm graph host-experts streaming test on 2 GPUs.
#   STAGE=1: install; start ik_llama.cpp's CUDA build in the background (bench/gpu_ik_build.sh,
#            nice'd, most cores); write the 8-layer R1 (issue 24) in the background; the R1 of
#            R1_LAYERS layers (16 on H100s, 28 on H200s: more than one GPU holds) on 2 and 4 GPUs
#            under -sm layer / graph (bench/multi_gpu.sh).
#   STAGE=2: issue 24's ikjax runs on GPU 0 (bench/gpu_hybrid_r1.sh: auto stream, the old active
#            form, -ub 4096 / 8192, hot experts), then R1 -ot exps=CPU under both split modes.
#   STAGE=3: ik_llama.cpp on the same files and flags: the R1 split rows and the hybrid rows.
#   STAGE=4: issues 22 and 23 on GPU 0: the cold start with the load beside the compile and
#            without (bench/gpu_coldstart.sh default / nooverlap), then serve beside llama-server
#            (bench/gpu_serve.sh; its second server runs the short steps expanded, the A/B of
#            the absorbed second turn).
#   STAGE=5: after STAGE=0 (the ik build): issue 22's cold start with compile_side_by_side and the
#            4-layer decode iterations (default) against two halves (IKJAX_LAYERS=halves, the decode
#            form before dd68929: S_TG and compile) and XLA's kernel cache file (kcache: do the steps
#            compiled after the first reuse its Triton kernels?), then serve beside llama-server
#            (bench/gpu_serve.sh, a connection per request).
#   STAGE=6: issue 22 without the ik build: each cold step's compile profiled (PROFILE=1), the cold
#            start default / halves at -c 4096 -ub 512 and default at -c 16384 -ub 2048 (the first
#            row); then the 8-layer R1 written in the background for STAGE=7.
#   STAGE=7: issue 24's ikjax rows on the R1-8 file (PARTS7, bench/gpu_hybrid_r1.sh), then issue 23's
#            R1 rows: serve -ot exps=CPU -t 16 under load (bench/gpu_serve.sh, MODEL=/tmp/r1-8.gguf).
#   STAGE=8: issue 22's cold start, default (e6a3892: the later rows' steps compiled while the first
#            rows run) against `before` (every step first) and `kcache`, at -c 4096 -ub 512 and the
#            default at -c 16384 -ub 2048 (its first row's time); then the 8-layer R1 written in the
#            background while serve's load rows run on V2-Lite (the idle-slot fix, 0b69011).
#   STAGE=9: serve's load rows on the R1-8 file with -ot exps=CPU (the idle-slot fix), then
#            sweep-bench's active / default rows.
#   STAGE=10: issue 22's one prompt step for every depth (ccd6438): the GPU kernel tests, the cold
#            start default (one step) against `many` (a step per KV bucket) at -c 4096 -ub 512 and at
#            -c 16384 -ub 2048 (every row's S_PP / S_TG), then the ik build (all cores) and the R1-8
#            file started in the background, and the bounded kv_b expansion alone (bench/gpu_live_kv.py).
#   STAGE=11: waits for the ik build (its progress every 30 s) until DEADLINE.
#   STAGE=12: after the build: serve beside llama-server, same loads, same lease: the V2-Lite shape
#            (load, interference, second turn), then the 8-layer R1 with -ot exps=CPU (load rows).
#   STAGE=13: a short lease: the cold start at -c 4096 -ub 512 with the load beside the compile
#            (80b1963), then serve's load rows on the V2-Lite shape (idle slots skipped, 154e713).
#   STAGE=14: the GPU kernel tests of the decode products (invariant rows, live rows, real sizes),
#            then for each IKJAX_INVARIANT_FORM in FORMS (rows dot) the [8,1] decode step's kernels
#            (profile8: every row live, one live, against [1,1]) and serve's load rows.
#   STAGE=15: serve on the V2-Lite shape (load, interference, second turn, greedy against generate).
#            (§23k: both ran for 77b3bfb's shared-row form, backed out; its A/B variable is gone.)
#   STAGE=17: issue 26's CPU prompt step by op at -t 2 / 16, avx2 and amx (cpu_prompt_profile.py);
#            issue 22's cold and warm sweep-bench, then bench/gpu_load_probe.py (the load's rate from
#            1..8 threads; whether JAX's backend start holds the GIL).
#   STAGE=18: issue 22's warm start: the load's stack samples, cold / warm, and the backend started
#            early or not (IKJAX_EARLY_BACKEND), interleaved warm runs.
#   STAGE=19: issue 22's cold / warm sweep-bench, then issue 26's CPU table at -t 16 beside ik.
#   STAGE=20: issue 22's diagnosis: each first-row step's trace + lower under cProfile
#            (gpu_compile_profile.py --cprofile), then a cold sweep-bench and warm ones, one under
#            bench/warm_timeline.py (every thread's stack sampled from the start).
#   STAGE=21: STAGE=20 without the cProfile (SKIP_CPROFILE=1), then STAGE=19's CPU table
#            (VARIANTS19, default here: the avx2 columns only).
#   STAGE=22: issue 26's CPU table alone (THREADS22, default 2; VARIANTS22, default the avx2 columns;
#            DEADLINE22): cpu_isa_table.sh with its kernel tests, no GPU work.
#   STAGE=23: issue 22's autotuned fusions dumped, cold / warm with autotuning off and on; issue 26's -t 2
#            table (STAGE=22) and the -t 16 prompt step by op per level (TYPES23, LEVELS23).
#   STAGE=25: issue 22 after IKJAX_GPU_AUTOTUNE: jaxlib's compile flags, the steps' compile profiled,
#            default / tune1 cold and warm, the deep shape, the issue's commit's rows (ikjax uninstalled).
#   STAGE=26: issue 22's cold / warm variants (VARIANTS26, SHAPE26), every row's S_PP and S_TG.
#   STAGE=27: issue 22's decode loop kernel by kernel, scanned against unrolled (LAYERS27), then STAGE=26.
#   STAGE=28: issue 22's scanned decode after a prompt step with JAX's preallocation on and off.
#   STAGE=29: issue 26's avx2 cells beside ik's AVX2 build carried prebuilt (THREADS29, TYPES29).
#   STAGE=30: issue 22's decode after a prompt step under SKIP_TEMP / GRAPH_UNROLL (CANDIDATES30), then
#            STAGE=26 with VARIANTS30 (e.g. "default skiptemp graphunroll graphunroll1").
#   STAGE=31: issue 22's decode after a prompt step under SKIP_TEMP / VMM_PERSISTENT_TEMP (CANDIDATES31), the
#            deep shape's rows (VARIANTS31, SHAPE31) and the issue's commit's rows beside them.
#   STAGE=32: issue 26's amx prompt step at -t 16 under XLA:CPU / pool settings (VARIANTS32, TYPES32).
#   STAGE=33: issue 22's decode after a prompt step: per call or per token, fresh or stable inputs.
#   STAGE=34: issue 22: what a prompt step leaves behind for the scanned decode (VARIANTS34: "ENV|ARGS;..."
#            of bench/gpu_decode_profile.py, RESULTS §22u).
#   STAGE=35: STAGE=34, then sweep-bench's rows with each prompt attention form (PROMPT35).
#   STAGE=36: the decode graph's kernels one by one under nsys (if the host has it), the decode loop's
#            optimized HLO, then STAGE=34's VARIANTS34 (e.g. "|--other step2idle;|--other step2all").
#   STAGE=37, 38, 39: issue 25 on a 2-GPU lease (see each); STAGE=40: call 1 of 40, 38, 39 (the host's
#            decode kernel alone, ik's build and the R1 file in the background, the hybrid GPU tests).
#   STAGE=42: issue 26's -t 16 table (ik AVX2 carried, ik native built) and the amx prefetch A/B at -t 16.
#   STAGE=46: issue 26: the jitter run under strace (who hands the step's pages back on the device host).
#   STAGE=45: issue 26: the amx prompt step's run-to-run spread at -t 16 under pool / malloc settings.
#   STAGE=44: issue 26: sweep-bench's amx rows under malloc / THP variants beside ik native, interleaved rounds.
#   STAGE=43: issue 26: sweep-bench's amx S_PP against the steady-state step (after a decode loop, cache on / off).
#   STAGE=41: the -ot decode's host part under VARIANTS41 on one GPU, then the split runs (PARTS41).
#   STAGE=50: issue 26: the pinned int8 loops against the loops before them (cpu_moe_ab.py, VNNI and plain).
#   STAGE=51: issues 25 / 22: the hybrid GPU tests, then R1-8 -ot exps=CPU cold / warm in one fresh cache.
#   STAGE=52: issues 25 / 22: why -ot steps miss JAX's cache (bench/ot_cache_probe.sh, tiny preset).
#   STAGE=55: IKJAX_HOST_CALL flag / hostfunc: the hybrid GPU tests, R1-8 -ot rows and decode profiles per form.
#   STAGE=58: issue 24: the TG rows' gap (§24i): decode profiles after 2048-token prompts, API sweeps counting off / on.
#   STAGE=57: issue 24 interleaved on one lease: auto / active / --gpu-experts rows, decode profiles hot / auto.
#   STAGE=56: issue 24's --gpu-experts auto (24 GB) on R1-8 beside the default and the active form.
#   STAGE=54: the same probe on the 8-layer R1, then a hybrid decode token's profile (gpu_decode_profile --cpu-moe).
#   STAGE=62: issue 25: call 1 of 62, 41, 39 (ik's build and the R1 file in the background, the split modes'
#            hybrid decode-loop GPU tests).
#   STAGE=61: issue 24: host experts streamed by runs of experts (chunks) against whole layers, R1-8 rows + memory.
#   STAGE=63: issue 22: -ot host layers scanned: R1-shape files of 4 / 16 layers (few experts) written in the
#            background, the hybrid GPU tests. STAGE=64: those files' -ot runs cold / warm, scan against unroll.
#   STAGE=16: the matrix-unit invariant schedule's tuning sweep on V2-Lite's dense matrices
#            (bench/gpu_gemv_tune.py --form dot) at 1 and 8 rows, beside the row form's schedule.
#   STAGE=75: HEAD's health (the gpu-marked tests, the deep shape cold then warm). STAGE=76: the RMSNorm
#            folded into the decode products (IKJAX_FOLD_NORM) on / off: GPU tests, deep-shape rows, kernels.
#   STAGE=98: issue 22: which loaded program slows the scanned decode (bench/decode_neighbour_probe.py).
#   STAGE=95: issue 22: XLA's command-buffer log for the scanned decode plain and after a 2-token step.
# Every stage prints the ik build's progress. Carry .whl (gguf, prometheus_client, ikfull.tar.gz).
#   STAGE=1 bash bench/lease_x4.sh      results under $OUT, packed into $OUT/stage-N.tgz (the device
#                                       tool returns only a few files a call: one archive returns all)
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/lease_out}
mkdir -p "$OUT"
export CUDA_DEVICE_ORDER=PCI_BUS_ID XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGE=${STAGE:-1}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
ikprog() {
  if [ -f /tmp/ikc/build.log ]; then
    el "ik build: $(grep -o '^\[[0-9]*/[0-9]*\]' /tmp/ikc/build.log | tail -1) $(grep BUILD_DONE /tmp/ikc/build.log)"
  else el "ik build: not started"; fi
}
if [ ! -f /tmp/lease_installed ]; then
  python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl .whl/prometheus_client-*.whl || exit 1
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; exit 1; }
  python3 -c "import pallas_kernels._cuda_host" || { echo "no CUDA host handler"; exit 1; }
  touch /tmp/lease_installed
  # whether this machine's Python writes bytecode: with PYTHONDONTWRITEBYTECODE set every process compiles
  # the package's modules from source again (~0.15 s of an engine start on this workplace's EPYC, stop 63)
  el "installed; python $(python3 -c 'import sys; print(sys.version.split()[0], "dont_write_bytecode", sys.dont_write_bytecode)')"
  # ml_dtypes 0.7.0's import takes ~1 s of CPU (its ufunc loops registered one by one: RESULTS §22aj), before JAX starts
  el "ml_dtypes $(python3 -c 'import time; t = time.perf_counter(); import numpy; t1 = time.perf_counter(); import ml_dtypes; print(ml_dtypes.__version__, f"imported in {time.perf_counter() - t1:.3f} s")')"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
el "$(nproc) cores; $(lscpu | grep 'Model name' | sed 's/ \+/ /g'); $(lscpu | grep -o -E 'amx_[a-z0-9]+' | sort -u | tr '\n' ' ')"
ikprog

start_r1_8() {  # the 8-layer R1 written in the background (idempotent)
  if [ ! -f /tmp/r1-8.gguf ] && [ ! -f /tmp/r1-8.started ]; then
    touch /tmp/r1-8.started
    setsid nohup bash -c "python3 -m ikjax.cli make-model -o /tmp/r1-8.tmp.gguf --preset r1 --layers 8 --type Q4_0 \
      > /tmp/r1-8.log 2>&1 && mv /tmp/r1-8.tmp.gguf /tmp/r1-8.gguf" > /dev/null 2>&1 < /dev/null &
  fi
}
r1_8_hybrid_setup() {  # stages 57 / 58: the 8-layer R1 and its expert statistics; sets S (the file), F (the
  # sweep flags) and frac (XLA's memory fraction for a 24 GB budget); $1: the compile cache
  start_r1_8
  export CUDA_VISIBLE_DEVICES=0 IKJAX_COMPILE_CACHE=$1
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-300} ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail -3 /tmp/r1-8.log; exit 1; }
  S=/tmp/r1-stats.json; F="-c 4096 -ub 2048 -b 2048 -mla 3 -fa 1 -ot exps=CPU -t $(nproc)"
  frac=$(python3 -c "print(round(24 * 1024 / $(nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits | head -1), 3))")
  [ -f $S ] || { el "statistics run"; timeout 120 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 8 --expert-stats $S 2>&1 | grep -E "rror" ; }
}
start_ik_and_r1() {  # ik's CUDA build (all cores) and the R1 file of R1_LAYERS (7) in /tmp/mg, in the background
  [ -f /tmp/ikc/build.log ] || bash bench/gpu_ik_build.sh ${IK_JOBS:-$(nproc)}
  mkdir -p /tmp/mg
  R1ARGS="--preset r1 --layers ${R1_LAYERS:-7} --type Q4_0"
  if [ ! -f /tmp/mg/r1.gguf ] && [ ! -f /tmp/mg/r1.started ]; then
    touch /tmp/mg/r1.started
    setsid nohup bash -c "python3 -m ikjax.cli make-model -o /tmp/mg/r1.tmp.gguf $R1ARGS > /tmp/mg/r1.log 2>&1 \
      && printf %s '$R1ARGS' > /tmp/mg/r1.args && mv /tmp/mg/r1.tmp.gguf /tmp/mg/r1.gguf" > /dev/null 2>&1 < /dev/null &
  fi
}
start_bg() {  # the ik build and the 8-layer R1 in the background (idempotent; NO_BG=1: neither)
  [ -n "${NO_BG:-}" ] && return
  [ -f /tmp/ikc/build.log ] || bash bench/gpu_ik_build.sh "${IK_JOBS:-44}"
  start_r1_8
}
first_row_ab() {  # first_row_ab AB_SCRIPT "new old ..." "SHAPE" OUTFILE: issue 22's deep first row cold on GPU 0
  # per form of an A/B wrapper (bench/*_ab.py FORM COMMAND...), after one discarded run (a fresh machine's first
  # model process is 2.3 s slower, RESULTS §22ab), a fresh compile cache each, the first row's line time-stamped
  for v in discard $2; do
    rm -rf /tmp/cc_ab; t0=$(date +%s.%N)
    IKJAX_COMPILE_CACHE=/tmp/cc_ab CUDA_VISIBLE_DEVICES=0 timeout 60 python3 $1 ${v/discard/${DISCARD_FORM:-new}} \
      sweep-bench -m $V2L -mla 3 -fa 1 $3 2> /tmp/e_ab | while read -r line; do
      case "$line" in "|"*[0-9]*" |"*) echo "$v: first row at $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s; $line"; break;; esac; done
    sleep 1
    echo "   $(grep -E "compiled|loaded" /tmp/e_ab | sed 's/(.tmp[^)]*)//' | tr '\n' ' ')"
  done 2>&1 | tee $4
}
cold_warm_sweep() {  # cold_warm_sweep "SHAPE": the V2-Lite shape's sweep-bench cold (a fresh cache) then warm, every
  # row's line time-stamped from the command's start, then the end and the compile / load lines
  rm -rf /tmp/cc_cw
  for v in cold warm; do
    t0=$(date +%s.%N)
    IKJAX_COMPILE_CACHE=/tmp/cc_cw CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 \
      $1 2> /tmp/e_cw | while read -r line; do
      case "$line" in "|"*[0-9]*" |"*) echo "$v $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s: $line";; esac; done
    echo "   $v end $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s; $(grep -E "compiled|loaded" /tmp/e_cw | sed 's/(.tmp[^)]*)//' | tr '\n' ' ')"
  done
}

cold_timeline() {  # cold_timeline TAG RUNS LINES: the deep shape's cold run under bench/lowering_timeline.py RUNS times,
  # a fresh cache each, its timeline's first LINES lines (events of 0.00 s left out)
  for k in $(seq $2); do
    IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 100 python3 bench/lowering_timeline.py sweep-bench -m $V2L -mla 3 -fa 1 \
      -c 16384 -ub 2048 -n 128 > /dev/null 2> "$OUT/lock_timeline$1-$k.txt"
    sed -n '/# lowering timeline/,$p' "$OUT/lock_timeline$1-$k.txt" | grep -v "( 0.00)" | head -$3
  done
}

throwaway_run() {  # a cold run discarded: a fresh machine's first model process pays the binaries' first reads (§22ab)
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 60 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 -c 4096 -ub 512 -n 16 \
    > /dev/null 2>&1; echo "throwaway run rc=$?"
}

greedy_same() {  # greedy_same FORM_A FORM_B TAG: generate's greedy text (64 tokens) under two forms of
  # bench/first_row_forms.py, a fresh compile cache each, compared byte for byte
  for v in $1 $2; do
    IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 120 python3 bench/first_row_forms.py $v generate -m $V2L -mla 3 -fa 1 -c 4096 \
      -p "The history of the printing press begins" -n 64 --temp 0 > $OUT/gen$3-$v.txt 2> $OUT/gen$3-$v.err
    echo "generate $v: rc=$? $(wc -c < $OUT/gen$3-$v.txt) bytes"
  done
  cmp -s $OUT/gen$3-$1.txt $OUT/gen$3-$2.txt && echo "greedy text: the same" || { echo "greedy text DIFFERS"; head -c 300 $OUT/gen$3-*.txt; }
}

load_probe() {  # load_probe TAG: the load's programs the cold deep run compiles itself, and why (bench/load_programs_probe.py)
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 100 python3 bench/load_programs_probe.py sweep-bench -m $V2L -mla 3 -fa 1 \
    -c 16384 -ub 2048 -n 128 2>&1 >/dev/null | grep -v Warn | sed -n '/# the load/,$p' | cut -c1-700 | tee $OUT/probe$1.txt
}

v2l_ready() {  # the 27-layer V2-Lite shape at $V2L, made once a machine, read into the page cache
  V2L=/tmp/v2l-Q4_0.gguf
  [ -f $V2L ] || { el "make-model"; python3 -m ikjax.cli make-model -o $V2L --preset v2-lite --type Q4_0 > /dev/null; }
  cat $V2L > /dev/null
}
case $STAGE in
14)
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_kernels_quant_matmul.py \
    tests/test_kernels_moe.py -k "${GPU_TESTS:-invariant or live_rows or real_size or v2_lite}" 2>&1 | tail -5
  for form in ${FORMS:-rows dot}; do
    el "profile8, IKJAX_INVARIANT_FORM=$form"
    OUT=$OUT/inv-$form STAGES=inv1 PARTS1=profile8 IKJAX_INVARIANT_FORM=$form bash bench/gpu_invariance.sh 2>&1 \
      | grep -E "wall|ready|rc="
  done
  for form in ${FORMS:-rows dot}; do
    [ -n "${NO_SERVE14:-}" ] && break
    el "serve load rows, IKJAX_INVARIANT_FORM=$form"
    OUT=$OUT/serve-$form LOAD_ONLY=1 IKJAX_INVARIANT_FORM=$form timeout 200 bash bench/gpu_serve.sh 2>&1 \
      | grep -E "^\||up in"
  done
  ;;
16)
  for rows in 1 8; do
    el "dot schedules, $rows rows"
    PYTHONPATH=$PWD timeout 280 python3 bench/gpu_gemv_tune.py --form dot --rows $rows --budget ${TUNE_S:-240} \
      --out "$OUT" 2>&1 | grep -v Warning | tail -40
  done
  ;;
17)
  # issue 26: where the CPU prompt step goes at -t 2 and -t 16 per level (bench/cpu_prompt_profile.py),
  # then issue 22: a warm sweep-bench's own timeline (cProfile of the whole command, after a cold run)
  for t in ${TYPES17:-Q8_0 Q4_0}; do
    f=/tmp/m26_$t.gguf
    [ -f $f ] || python3 -m ikjax.cli make-model -o $f --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t > /dev/null
    for lv in ${LEVELS17:-avx2 amx}; do for th in ${THREADS17:-2 16}; do
      JAX_PLATFORMS=cpu IKJAX_CPU_ISA=$lv taskset -c 0-$((th - 1)) timeout 200 python3 bench/cpu_prompt_profile.py $f --threads $th 2>&1 \
        | grep -v Warn | head -${TOP17:-9}
    done; done
  done
  [ -n "${NO_COLD17:-}" ] || OUT=$OUT/cold VARIANTS=default NO_PROBE=1 timeout 200 bash bench/gpu_coldstart.sh 2>&1 | grep -E "^###|^\||compiled|loaded" | head -30
  [ -f /tmp/v2l-Q4_0.gguf ] || python3 -m ikjax.cli make-model -o /tmp/v2l-Q4_0.gguf --preset v2-lite --type Q4_0 > /dev/null
  timeout 120 python3 bench/gpu_load_probe.py /tmp/v2l-Q4_0.gguf 2>&1 | grep -v Warn
  ;;
18)
  # issue 22's warm start: where the load's time goes (bench/load_sampler.py), then cold / warm
  # sweep-bench and warm runs with and without the backend started early, interleaved
  V2L=/tmp/v2l-Q4_0.gguf
  [ -f $V2L ] || python3 -m ikjax.cli make-model -o $V2L --preset v2-lite --type Q4_0 > /dev/null
  timeout 120 python3 bench/load_sampler.py $V2L 2>&1 | grep -v Warn | head -40
  [ -n "${NO_COLD18:-}" ] || OUT=$OUT/cold VARIANTS=default NO_PROBE=1 timeout 200 bash bench/gpu_coldstart.sh 2>&1 \
    | grep -E "^###|compiled|loaded" | head -12
  for r in 1 2; do for e in 1 0; do
    t0=$(date +%s.%N)
    IKJAX_EARLY_BACKEND=$e IKJAX_COMPILE_CACHE=/tmp/cc-default python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 \
      -c 4096 -ub 512 -n 64 2>&1 | grep -E "loaded|sweep took" | tr '\n' ' '
    echo " early=$e: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s command to end"
  done; done
  ;;
19)
  # the session's last lease: issue 22's cold / warm sweep-bench (the load's programs folded, the
  # backend started early), then issue 26's CPU table at -t 16 with both ik builds (cpu_isa_table.sh)
  OUT=$OUT/cold VARIANTS=default NO_PROBE=1 timeout 150 bash bench/gpu_coldstart.sh 2>&1 \
    | grep -E "^###|^\||compiled|loaded" | head -16
  THREADS=16 TYPES="${TYPES19:-Q8_0 Q4_0 Q4_K IQ4_XS}" VARIANTS="${VARIANTS19:-ik_avx2 jx_avx2 jx_avx2plain ik_native jx_amx jx_amxint8}" \
    DEADLINE=${DEADLINE19:-400} JOBS=8 NO_INSTALL=1 IK_DIR=/tmp/ikt OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 \
    | grep -E "^\||passed|failed|rc=|physical" | head -20
  ;;
20|21)
  v2l_ready
  if [ $STAGE = 20 ]; then
    el "cProfile of the first row's steps"
    IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 150 python3 bench/gpu_compile_profile.py $V2L --cprofile --top ${TOP20:-30} \
      --steps ${STEPS20:-0,3} 2>&1 | grep -v Warning > "$OUT/cprofile.txt"; head -c 20000 "$OUT/cprofile.txt"
  fi
  SB="-m $V2L -mla 3 -fa 1 ${SB21:--c 4096 -ub 512 -n 64}"
  rm -rf /tmp/cc20; el "cold"
  if [ -n "${COLD_TIMELINE:-}" ]; then  # the cold run under the sampler too (its own cache, then the plain one)
    t0=$(date +%s.%N)
    IKJAX_COMPILE_CACHE=/tmp/cc20t timeout 100 python3 bench/warm_timeline.py --min-ms 50 -- sweep-bench $SB > /dev/null 2> "$OUT/cold_timeline.txt"
    echo "cold under the sampler: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s"
    grep -v "^|" "$OUT/cold_timeline.txt" | grep -v Warn | grep -v "^  \[" | head -${COLD_TL_LINES:-70}
  fi
  # cold variants, each in a fresh cache (the last one's cache is the warm runs'): default;
  # nodry: IKJAX_DRY_SHAPES=0 (the steps compile from the shapes the load gives after its first layers)
  for c in ${COLD21:-default}; do
    case $c in default) cenv="" ;; nodry) cenv="IKJAX_DRY_SHAPES=0" ;; esac
    rm -rf /tmp/cc20; t0=$(date +%s.%N)
    env $cenv IKJAX_COMPILE_CACHE=/tmp/cc20 timeout 100 python3 -m ikjax.cli sweep-bench $SB > /tmp/c21.out 2> /tmp/c21.err
    echo "cold $c: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s command to end; $(grep -E "compiled|loaded" /tmp/c21.err | sed 's/(.tmp[^)]*)//' | tr '\n' ' ')"
    grep "^|" /tmp/c21.out | sed -n 3,4p
  done
  # default: steps read ahead and the load's programs kept whole; noprefetch: IKJAX_PREFETCH_STEPS=0;
  # noprograms: IKJAX_STORE_PROGRAMS=0 (the load's programs traced each run); neither: both off
  for r in ${WARM21:-default noprefetch noprograms neither default noprefetch noprograms neither}; do
    case $r in
      default) wenv="" ;; noprefetch) wenv="IKJAX_PREFETCH_STEPS=0" ;; noprograms) wenv="IKJAX_STORE_PROGRAMS=0" ;;
      neither) wenv="IKJAX_PREFETCH_STEPS=0 IKJAX_STORE_PROGRAMS=0" ;;
    esac
    t0=$(date +%s.%N)
    env $wenv IKJAX_COMPILE_CACHE=/tmp/cc20 python3 -m ikjax.cli sweep-bench $SB > /tmp/w21.out 2> /tmp/w21.err
    t1=$(python3 -c "import time; print(f'{time.time() - $t0:.2f}')")
    echo "warm $r: $t1 s command to end; $(grep -E "compiled|loaded" /tmp/w21.err | sed 's/(.tmp[^)]*)//' | tr '\n' ' ')"
    grep "^|" /tmp/w21.out | sed -n 3,4p
  done
  t0=$(date +%s.%N)
  IKJAX_COMPILE_CACHE=/tmp/cc20 python3 bench/warm_timeline.py --min-ms 30 -- sweep-bench $SB > /dev/null 2> "$OUT/timeline.txt"
  echo "warm under the sampler: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s; python -c pass: $( { /usr/bin/time -f %e python3 -c pass; } 2>&1 )"
  grep -v "^|" "$OUT/timeline.txt" | grep -v Warn | head -${TL_LINES:-150}
  if [ $STAGE = 21 ] && [ -z "${NO_TABLE:-}" ]; then
    THREADS=16 TYPES="${TYPES19:-Q8_0 Q4_0 Q4_K IQ4_XS}" VARIANTS="${VARIANTS19:-ik_avx2 jx_avx2 jx_avx2plain}" \
      DEADLINE=${DEADLINE19:-400} JOBS=12 NO_INSTALL=1 IK_DIR=/tmp/ikt OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 \
      | grep -E "^\||passed|failed|rc=|physical" | head -20
  fi
  ;;
22)
  THREADS="${THREADS22:-2}" TYPES="${TYPES22:-Q8_0 Q4_0 Q4_K IQ4_XS}" VARIANTS="${VARIANTS22:-ik_avx2 jx_avx2}" \
    DEADLINE=${DEADLINE22:-230} JOBS=14 NO_INSTALL=1 IK_DIR=/tmp/ikt OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 \
    | grep -E "^\||passed|failed|rc=|physical" | head -20
  tail -5 "$OUT/cpu/progress.log"
  ;;
23)
  # issue 22: which fusions XLA's autotuner tunes in a cold run (their HLO and picks dumped), then
  # cold / warm with autotuning off and on (S_PP's cost); issue 26: the -t 2 table (as STAGE=22),
  # then the prompt step by op at -t 16 per level (bench/cpu_prompt_profile.py) on the table's files
  if [ -z "${NO_GPU23:-}" ]; then
    V2L=/tmp/v2l-Q4_0.gguf
    [ -f $V2L ] || { el "make-model"; python3 -m ikjax.cli make-model -o $V2L --preset v2-lite --type Q4_0 > /dev/null; }
    cat $V2L > /dev/null; rm -rf /tmp/cc23; el "cold, autotune results dumped"
    XLA_FLAGS="--xla_gpu_dump_autotune_results_to=$OUT/autotune.txt" IKJAX_COMPILE_CACHE=/tmp/cc23 JAX_LOG_COMPILES=1 \
      timeout 100 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 -c 4096 -ub 512 -n 64 > /tmp/c23.out 2> /tmp/c23.err
    grep "^|" /tmp/c23.out | sed -n 3,4p; grep -E "compiled" /tmp/c23.err | head -3
    grep -h "Finished XLA compilation of" /tmp/c23.err | sed -E 's/.*compilation of ([^ ]*) in ([0-9.]+) sec.*/\2 \1/' | sort -rn | head -5
    python3 - "$OUT/autotune.txt" <<'PYEOF'
import re, sys
try:
    s = open(sys.argv[1]).read()
except OSError as e:
    print("no autotune dump:", e); sys.exit()
res = s.split("results {")[1:]
print(f"{len(res)} autotune results, {len(s)} bytes")
for r in res[:40]:
    hlo = re.search(r'hlo: "(.*?)"\n', r, re.S)
    pick = re.search(r"result \{\s*(\w+)", r)
    h = (hlo.group(1) if hlo else "").replace("\\n", " ")
    dots = re.findall(r"(\w+\[[\d,]*\]\{?[\d,]*\}?) (?:dot|convolution)\(([^)]*)\)", h)
    print(f"  pick={pick.group(1) if pick else '?'}: {h[:40]} ... dots={dots[:2]} len={len(h)}")
PYEOF
    OUT=$OUT/cold VARIANTS="${VARIANTS23:-noautotune default}" NO_PROBE=1 timeout 200 bash bench/gpu_coldstart.sh 2>&1 \
      | grep -E "^###|^\||compiled|loaded" | head -30
  fi
  el "CPU table -t ${THREADS22:-2}"
  THREADS="${THREADS22:-2}" TYPES="${TYPES22:-Q8_0 Q4_0 Q4_K IQ4_XS}" VARIANTS="${VARIANTS22:-ik_avx2 jx_avx2}" \
    DEADLINE=${DEADLINE22:-300} JOBS=14 NO_INSTALL=1 IK_DIR=/tmp/ikt OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 \
    | grep -E "^\||passed|failed|rc=|physical" | head -20
  tail -3 "$OUT/cpu/progress.log"
  for t in ${TYPES23:-Q8_0 Q4_0}; do
    f=/tmp/cpuisa_4l_$t.gguf; [ -f $f ] || continue
    for lv in ${LEVELS23:-amx avx512}; do
      el "profile $t $lv -t 16"
      JAX_PLATFORMS=cpu IKJAX_CPU_ISA=$lv taskset -c 0-15 timeout 150 python3 bench/cpu_prompt_profile.py $f --threads 16 --detail ${DETAIL23:-0} 2>&1 \
        | grep -v Warn | head -${TOP23:-22}
    done
  done
  ;;
25)
  # issue 22 after IKJAX_GPU_AUTOTUNE (autotuning off for the Pallas path): this jaxlib's compile
  # flags, each first-row step's compile profiled, cold / warm default against tune1 at -c 4096,
  # the deep shape cold / warm, then the issue's commit's rows (ikjax uninstalled first: the
  # editable install's finder would win over PYTHONPATH)
  v2l_ready
  strings $(python3 -c "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))")/*.so $(python3 -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__path__[0]))" 2>/dev/null)/jax*cuda*/*.so 2>/dev/null \
    | grep -E "^xla_gpu_[a-z_]*(parallel|thread|ptxas|compil|autotun|emitter)[a-z_]*$" | sort -u | tr '\n' ' '; echo
  [ -n "${NO_PROF25:-}" ] || IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 120 python3 bench/gpu_compile_profile.py $V2L --top 22 --steps 0,1 2>&1 | grep -v Warning | head -70
  if [ -z "${SKIP_COLD25:-}" ]; then
    OUT=$OUT/cold VARIANTS="${VARIANTS25:-default tune1}" NO_PROBE=1 timeout 200 bash bench/gpu_coldstart.sh 2>&1 \
      | grep -E "^###|^\||compiled|loaded" | grep -v -- "-|-" | head -40
    el "deep shape"
    OUT=$OUT/deep SHAPE="${SHAPE24:--c 16384 -ub 2048 -n 128}" VARIANTS="default" NO_PROBE=1 \
      timeout 200 bash bench/gpu_coldstart.sh 2>&1 | grep -E "^###|^\||compiled|loaded" | grep -v -- "-|-" | head -40
  fi
  if [ -z "${NO_OLD24:-}" ] && [ -f .whl/ikjax-old.tar.gz ]; then
    el "the issue's commit"
    python3 -m pip uninstall -y -q ikjax; rm -f /tmp/lease_installed
    rm -rf /tmp/old && mkdir -p /tmp/old && tar -xzf .whl/ikjax-old.tar.gz -C /tmp/old
    ( cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/site IKJAX_COMPILE_CACHE=/tmp/cc-old timeout 240 python3 -m ikjax.cli sweep-bench \
        -m $V2L -mla 3 -fa 1 ${SHAPE24:--c 16384 -ub 2048 -n 128} > $OUT/old.out 2> $OUT/old.err; echo "rc=$?" )
    grep "^|" $OUT/old.out; grep -E "compil|Error" $OUT/old.err | tail -4; python3 -c "import ikjax; print(ikjax.__file__)" 2>&1 | tail -1
  fi
  ;;
26)
  # issue 22: cold / warm variants (VARIANTS26) at SHAPE26, every row printed
  v2l_ready
  OUT=$OUT/cold SHAPE="${SHAPE26:--c 4096 -ub 512 -n 64}" VARIANTS="${VARIANTS26:-default nvptxlib par16 unroll8 unroll}" NO_PROBE=1 \
    timeout 500 bash bench/gpu_coldstart.sh > /dev/null 2>&1
  for f in $OUT/cold/cold-*.stamped; do v=${f##*/cold-}; v=${v%.stamped}
    echo "$v: cold $(grep -m1 "^### cold-$v:" $OUT/cold/cold.md | sed 's/.*rc [0-9]*, //'); warm $(grep -m1 "^### warm-$v:" $OUT/cold/cold.md | sed 's/.*rc [0-9]*, //')"
    grep -h "compiled" $OUT/cold/cold-$v.err | sed 's/(.tmp[^)]*)//' | head -1
    for w in cold warm; do echo "  $w S_PP: $(grep '^|' $OUT/cold/$w-$v.out | awk -F'|' '$2 ~ /[0-9]/ {printf "%s ", $6+0}')  S_TG: $(grep '^|' $OUT/cold/$w-$v.out | awk -F'|' '$2 ~ /[0-9]/ {printf "%s ", $8+0}')"; done
  done
  grep -A4 "XLA compiles over" $OUT/cold/cold.md | grep -v "^--" | head -30
  ;;
27)
  # issue 22: the decode loop's kernels, scanned layers against unrolled (bench/gpu_decode_profile.py),
  # then STAGE=26's variants (VARIANTS26)
  v2l_ready
  for l in ${LAYERS27:-auto unroll}; do
    for il in ${INTERLEAVE27:-plain}; do  # plain | interleave (a prompt step before each decode call) | prefill (a cache of real rows)
      for cb in ${CMDBUF27:-on}; do  # off: XLA's command buffers off, each kernel in the profile
        IKJAX_LAYERS=$l IKJAX_COMPILE_CACHE=/tmp/cc27-$l-$cb timeout 150 env $([ $cb = off ] && echo DPROF_NO_CMDBUF=1) \
          python3 bench/gpu_decode_profile.py $V2L --top ${TOP27:-30} $([ $il != plain ] && echo --$il) \
          2>&1 | grep -v Warn | tee $OUT/dprof-$l-$il-$cb.txt | head -${HEAD27:-200}
      done
    done
  done
  [ -n "${VARIANTS26:-}" ] && STAGE=26 bash bench/lease_x4.sh 2>&1 | grep -v "installed\|ik build\|H200, \|cores;"
  ;;
34)
  # issue 22: what a single prompt step leaves behind that slows the scanned decode's CUDA graph for
  # good (RESULTS §22u): variants of bench/gpu_decode_profile.py, each "ENV=..|ARGS" (';'-separated)
  v2l_ready
  IFS=';' read -ra vs <<< "${VARIANTS34:-|--prefill;|--prefill --decode-first;|--prefill --prefill-tokens 16;XLA_PYTHON_CLIENT_ALLOCATOR=platform|--prefill;XLA_PYTHON_CLIENT_ALLOCATOR=platform|}"
  for v in "${vs[@]}"; do
    envs=${v%%|*}; args=${v#*|}
    echo "== ${envs:-(default env)} | ${args:-plain}"
    env $envs IKJAX_COMPILE_CACHE=/tmp/cc34 timeout 150 python3 bench/gpu_decode_profile.py $V2L --top 5 $args 2>&1 | grep -v Warn | head -1
  done
  ;;
35)
  # issue 22: which kernel of a short prompt step leaves the scanned decode slower (§22u): STAGE=34's
  # variants (VARIANTS34), then sweep-bench's rows with the prompt attention's two forms (PROMPT35)
  v2l_ready
  STAGE=34 bash bench/lease_x4.sh 2>&1 | grep -E "^==|a token wall|Error"
  for pa in ${PROMPT35:-xla pallas}; do
    IKJAX_PROMPT_ATTN=$pa IKJAX_COMPILE_CACHE=/tmp/cc35-$pa timeout 100 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 \
      -c 4096 -ub 512 -n 64 > /tmp/s35.out 2> /tmp/s35.err
    echo "IKJAX_PROMPT_ATTN=$pa: S_PP $(grep '^|' /tmp/s35.out | awk -F'|' '$2 ~ /[0-9]/ {printf "%s ", $6+0}')  S_TG $(grep '^|' /tmp/s35.out | awk -F'|' '$2 ~ /[0-9]/ {printf "%s ", $8+0}')"
    tail -2 /tmp/s35.err | grep -i error
  done
  ;;
36)
  # issue 22, the scanned decode's loss left by a step of T >= 2 (§22u), next steps: (1) the graph's
  # kernels one by one where nsys can trace a CUDA graph's nodes (plain against one 2-token step
  # first; a scanned and an unrolled form), (2) the decode loop's optimized HLO (copies in the
  # loop body), (3) more steps that may or may not leave it (VARIANTS34 of STAGE=34)
  v2l_ready
  echo "nsys: $(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)"
  NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$NSYS" ]; then
    for l in auto unroll; do for p in "" "--prefill --prefill-tokens 2"; do
      tag=$l$([ -n "$p" ] && echo -prefill)
      IKJAX_LAYERS=$l IKJAX_COMPILE_CACHE=/tmp/cc36-$l timeout 150 $NSYS profile -q --cuda-graph-trace=node -t cuda -o /tmp/n36-$tag -f true \
        python3 bench/gpu_decode_profile.py $V2L --top 3 $p 2>&1 | grep "a token wall"
      $NSYS stats -q -r cuda_gpu_kern_sum -f csv -o $OUT/kern-$tag /tmp/n36-$tag.nsys-rep > /dev/null 2>&1
      head -12 $OUT/kern-${tag}_cuda_gpu_kern_sum.csv 2>/dev/null | cut -c1-160
    done; done
  fi
  for l in auto unroll; do
    rm -rf /tmp/hlo36-$l; IKJAX_LAYERS=$l IKJAX_COMPILE_CACHE=0 XLA_FLAGS="--xla_dump_to=/tmp/hlo36-$l --xla_dump_hlo_as_text" \
      timeout 150 python3 bench/gpu_decode_profile.py $V2L --top 3 2>&1 | grep "a token wall"
    f=$(ls -S /tmp/hlo36-$l/*decode_steps*after_optimizations.txt 2>/dev/null | head -1)
    echo "$l: $f: copies $(grep -c ' copy(' $f), copy-starts $(grep -c 'copy-start' $f), while $(grep -c ' while(' $f)"
    cp "$f" $OUT/decode-$l.hlo.txt 2>/dev/null
  done
  # a two-token step's parts, each left out in turn (§22u's next step): the top-k's form (the
  # router's sort), the routed experts (last = -1: no expert), the head on every row, a batch of two
  VARIANTS34="${VARIANTS34:-|--prefill --prefill-tokens 2;IKJAX_TOPK=lax|;IKJAX_TOPK=lax|--prefill --prefill-tokens 2;|--other step2idle;|--other step2all;|--other batch2}" \
    STAGE=34 bash bench/lease_x4.sh 2>&1 | grep -E "^==|a token wall|Error"
  ;;
28)
  # issue 22: the scanned decode after a prompt step with JAX's default allocator (preallocation on,
  # as users run it; the lease exports XLA_PYTHON_CLIENT_PREALLOCATE=false), then sweep-bench both ways
  v2l_ready
  for pre in ${PRE28:-true false}; do
    XLA_PYTHON_CLIENT_PREALLOCATE=$pre timeout 150 python3 bench/gpu_decode_profile.py $V2L --top 2 --interleave 2>&1 | grep -v Warn | head -1 | sed "s/^/preallocate=$pre: /"
  done
  rm -rf /tmp/cc28
  for pre in true false true false; do
    XLA_PYTHON_CLIENT_PREALLOCATE=$pre IKJAX_COMPILE_CACHE=/tmp/cc28 timeout 100 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 \
      -c 4096 -ub 512 -n 64 > /tmp/s28.out 2> /tmp/s28.err
    echo "preallocate=$pre sweep-bench S_TG: $(grep '^|' /tmp/s28.out | awk -F'|' '$2 ~ /[0-9]/ {printf "%s ", $8+0}')"
  done
  ;;
29)
  # issue 26: the -t 2 / -t 16 avx2 cells beside ik's AVX2 build carried prebuilt (.whl/ik_avx2_bin.tar.gz:
  # llama-sweep-bench and its two libraries, built -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF
  # on a workplace CPU machine, unpacked where their RUNPATH points), no ik build in the call
  tar -xzf .whl/ik_avx2_bin.tar.gz -C / || exit 1
  # VARIANTS29: e.g. "ik_avx2 jx_avx2 jx_avx2_longspin jx_amx jx_amx_longspin" (_longspin: the pool's workers
  # spinning 2 ms after long parts too, as before IKJAX_SPIN_LONG; RESULTS §26o)
  THREADS="${THREADS29:-2 16}" TYPES="${TYPES29:-Q8_0 IQ4_XS}" VARIANTS="${VARIANTS29:-ik_avx2 jx_avx2}" IK_AVX2_BIN=/tmp/ikfull/build/bin/llama-sweep-bench \
    IK_NATIVE_BIN=none DEADLINE=${DEADLINE29:-170} NO_INSTALL=1 OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 \
    | grep -E "^\||passed|failed|rc=|physical" | head -20
  tail -3 "$OUT/cpu/progress.log"
  ;;
30)
  # issue 22's S_TG after a prompt step (RESULTS §22r): the decode loop's calls after a prompt step
  # under each candidate (SKIP_TEMP: the CUDA graphs' temporaries at stable addresses, so a replay
  # after another executable updates no node; GRAPH_UNROLL: the layer loops laid out flat in the
  # graph), then sweep-bench cold / warm for each (VARIANTS30)
  v2l_ready
  # the update mode's names differ between XLA versions (SKIP_TEMP; NEVER_UPDATE in older ones;
  # VMM_PERSISTENT_TEMP): each is checked first, XLA aborting on a value it does not know
  for c in ${CANDIDATES30:-scan skiptemp neverupdate vmmtemp graphunroll graphunroll1 unroll}; do
    e="" x=""
    case $c in
      skiptemp) x="--xla_gpu_command_buffer_update_mode=SKIP_TEMP" ;;
      neverupdate) x="--xla_gpu_command_buffer_update_mode=NEVER_UPDATE" ;;
      vmmtemp) x="--xla_gpu_command_buffer_update_mode=VMM_PERSISTENT_TEMP" ;;
      graphunroll) e="IKJAX_DECODE_GRAPH_UNROLL=1" ;;
      graphunroll1) e="IKJAX_DECODE_GRAPH_UNROLL=1 IKJAX_DECODE_UNROLL=1" ;;  # + a quarter of the kernels to compile
      unroll) e="IKJAX_LAYERS=unroll" ;;
    esac
    if [ -n "$x" ] && ! XLA_FLAGS="$x" python3 -c "import jax; jax.devices()" > /dev/null 2>&1; then echo "$c: $x rejected"; continue; fi
    env $e XLA_FLAGS="$x" timeout 150 python3 bench/gpu_decode_profile.py $V2L --top 1 --interleave 2>&1 | grep -v Warn | head -1 | sed "s/^/$c: /"
  done
  [ -n "${VARIANTS30:-}" ] && STAGE=26 VARIANTS26="$VARIANTS30" bash bench/lease_x4.sh 2>&1 | grep -v "installed\|ik build\|H200, \|cores;"
  ;;
31)
  # issue 22: the scanned decode after a prompt step under the update modes that keep a graph's
  # temporaries at stable addresses (each flag checked first), alone and with graphunroll1; then
  # the deep shape's rows for VARIANTS31 and the issue's commit beside them (as STAGE=25)
  v2l_ready
  for c in ${CANDIDATES31:-skiptemp vmmtemp g1skiptemp}; do
    e="" x=""
    case $c in
      skiptemp) x="--xla_gpu_command_buffer_update_mode=SKIP_TEMP" ;;
      vmmtemp) x="--xla_gpu_command_buffer_update_mode=VMM_PERSISTENT_TEMP" ;;
      g1skiptemp) x="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"; e="IKJAX_DECODE_GRAPH_UNROLL=1 IKJAX_DECODE_UNROLL=1" ;;
      graphunroll1) e="IKJAX_DECODE_GRAPH_UNROLL=1 IKJAX_DECODE_UNROLL=1" ;;
      scan) ;;
    esac
    if [ -n "$x" ] && ! XLA_FLAGS="$x" python3 -c "import jax; jax.devices()" > /dev/null 2>&1; then echo "$c: $x rejected"; continue; fi
    env $e XLA_FLAGS="$x" timeout 150 python3 bench/gpu_decode_profile.py $V2L --top 1 --interleave 2>&1 \
      | grep "us a token wall" | head -1 | sed "s/^/$c: /"
  done
  el "deep shape"
  OUT=$OUT/deep SHAPE="${SHAPE31:--c 16384 -ub 2048 -n 128}" VARIANTS="${VARIANTS31:-graphunroll1 default}" NO_PROBE=1 \
    timeout 260 bash bench/gpu_coldstart.sh 2>&1 | grep -E "^###|^\||compiled|cold|warm" | grep -v -- "-|-" | head -60
  [ -n "${NO_OLD31:-}" ] || STAGE=25 NO_PROF25=1 VARIANTS25=none SHAPE24="${SHAPE31:--c 16384 -ub 2048 -n 128}" \
    SKIP_COLD25=1 bash bench/lease_x4.sh 2>&1 | grep -v "installed\|ik build\|H200, \|cores;"
  ;;
32)
  # issue 26: the amx level's 512-token prompt step at -t 16 (bench/cpu_prompt_profile.py, cores
  # 0-15) under XLA:CPU / pool settings that change how XLA's own ops share the cores with the
  # C++ pool (VARIANTS32), per file (TYPES32)
  for t in ${TYPES32:-Q4_0 IQ4_XS}; do
    f=/tmp/cpuisa_4l_$t.gguf
    [ -f $f ] || JAX_PLATFORMS=cpu python3 -m ikjax.cli make-model -o $f --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t > /dev/null
    for v in ${VARIANTS32:-default sched0 spin0 t15 eigen1}; do
      e="" x="" th=16
      case $v in
        sched0) x="--xla_cpu_enable_concurrency_optimized_scheduler=false" ;;
        spin0) e="IKJAX_SPIN=0" ;;
        t15) th=15 ;;
        eigen1) x="--xla_cpu_multi_thread_eigen=false" ;;
      esac
      env $e XLA_FLAGS="$x" JAX_PLATFORMS=cpu IKJAX_CPU_ISA=${LEVEL32:-amx} taskset -c 0-15 timeout 120 python3 bench/cpu_prompt_profile.py $f \
        --threads $th --reps 5 ${DETAIL32:+--detail $DETAIL32} 2>&1 | grep -v Warn | head -${TOP32:-1} | sed "s/^/$v: /"
    done
  done
  ;;
33)
  # issue 22: the scanned decode's loss after a prompt step, per call or per token, fresh or stable
  # input buffers (bench/gpu_decode_inputs.py), the default form then FORMS33 (e.g. unroll)
  v2l_ready
  for f in ${FORMS33:-auto unroll}; do
    tgs="${TGS33:-16 64 128}"; [ $f = unroll ] && tgs="${TGSU33:-16 128}"
    IKJAX_LAYERS=$f timeout 200 python3 bench/gpu_decode_inputs.py $V2L --tgs $tgs 2>&1 | grep -E "fresh|stable|rror" | head -4
    [ -n "${B2B33:-}" ] && IKJAX_LAYERS=$f timeout 100 python3 bench/gpu_decode_inputs.py $V2L --tgs $tgs --no-prompt 2>&1 | grep -E "fresh|stable|rror" | head -4
  done
  ;;
15)
  OUT=$OUT/serve NO_EXPANDED=1 timeout 400 bash bench/gpu_serve.sh 2>&1 | grep -v "^$" | tail -40
  ;;
0)
  # the Pallas prompt attention (IKJAX_PROMPT_ATTN=pallas) against XLA's form: the kernel alone,
  # then the 27-layer V2-Lite sweep on one GPU both ways; the -sm graph host-experts stream test
  start_bg
  timeout 150 python3 bench/gpu_prompt_attn.py --heads 128 16 --bq 64 128 --bk 64 128 2>&1 | grep -v Warning
  V2L=/tmp/mg/v2l.gguf; mkdir -p /tmp/mg
  [ -f $V2L ] || { python3 -m ikjax.cli make-model -o $V2L --preset v2-lite --type Q4_0 > /dev/null \
    && printf %s "--preset v2-lite --type Q4_0" > /tmp/mg/v2l.args; }  # multi_gpu.sh reuses it
  # xla: XLA's blocked form up to the last query's block (default); bucket: over the whole bucket
  # (IKJAX_FLASH_LOOP=bucket, the form before 640540b); pallas: the Pallas kernel
  for form in xla bucket pallas; do
    el "v2l one GPU, prompt attention $form"
    case $form in bucket) fenv="IKJAX_PROMPT_ATTN=xla IKJAX_FLASH_LOOP=bucket" ;; *) fenv="IKJAX_PROMPT_ATTN=$form" ;; esac
    env CUDA_VISIBLE_DEVICES=0 $fenv timeout 150 python3 -m ikjax.cli sweep-bench -m $V2L -c 16384 \
      -ub 2048 -n 32 -mla 3 -fa 1 2> "$OUT/v2l_$form.err" | grep '^|'
    grep -h "compiled\|rror" "$OUT/v2l_$form.err" | head -3
  done
  CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 \
    tests/test_hybrid_gpu.py -k "graph_split or layer_split or prompt_streams" 2>&1 | tail -5
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_prompt_attention.py 2>&1 | tail -3
  ;;
1)
  start_bg
  # R1 deeper than one GPU holds: 16 layers (80.5 GiB) past an H100's 80 GiB, 28 (~160 GiB) past an H200's 141
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  export R1_LAYERS=${R1_LAYERS:-$([ "${gib:-0}" -gt 100000 ] && echo 28 || echo 16)}
  el "R1 file: $R1_LAYERS layers (a GPU holds ${gib} MiB)"
  OUT=$OUT/mg1 PARTS=${PARTS1:-"r1_layer4 r1_graph4 r1_layer2 r1_graph2"} DEADLINE=${DEADLINE:-500} BUILD_CUDA=0 \
    MG_NO_INSTALL=1 MG_WORK=/tmp/mg bash bench/multi_gpu.sh 2>&1 | tail -40
  ;;
2)
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt 200 ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail /tmp/r1-8.log; exit 1; }
  OUT=$OUT/hyb HYB_GPU=0 timeout ${HYB_BUDGET:-360} bash bench/gpu_hybrid_r1.sh \
    "${PARTS2:-ikjax-default ikjax-ub8192 ikjax-active ikjax-ub4096}" 2>&1 | tail -60
  left=$(( ${DEADLINE:-540} - ($(date +%s) - T0) ))
  if [ $left -gt 120 ]; then
    OUT=$OUT/mg2 PARTS=${PARTS2MG:-"r1_ot_layer4 r1_ot_graph4"} DEADLINE=$left BUILD_CUDA=0 MG_NO_INSTALL=1 \
      MG_WORK=/tmp/mg bash bench/multi_gpu.sh 2>&1 | tail -30
  fi
  ;;
3)
  IK=/tmp/ikc/build/bin
  [ -x $IK/llama-sweep-bench ] || { tail -5 /tmp/ikc/build.log; exit 1; }
  R1=$(ls /tmp/mg/r1*.gguf | head -1)
  ikr() {  # ikr LABEL GPUS ARGS...: one ik sweep on these GPUs, its table
    local label=$1 gpus=$2; shift 2
    el "ik $label"
    CUDA_VISIBLE_DEVICES=$gpus timeout ${IK_RUN_S:-150} $IK/llama-sweep-bench -m "$R1" -ngl 99 -mla 3 -fa on "$@" \
      > "$OUT/ik_$label.out" 2> "$OUT/ik_$label.err"; echo "rc $?" >> "$OUT/ik_$label.out"
    grep -h '^|' "$OUT/ik_$label.out" "$OUT/ik_$label.err"; grep -i -E 'error|failed|CUDA0 buffer|model buffer' "$OUT/ik_$label.err" | head -4
  }
  for run in ${IK_RUNS:-hyb layer4 graph4 layer2 graph2}; do
    [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-500} ] || { el "deadline: not run: $run"; continue; }
    case $run in
      hyb) OUT=$OUT/hyb3 HYB_GPU=0 IK=$IK timeout 200 bash bench/gpu_hybrid_r1.sh "${IK_HYB:-ik-ooae ik-ub4096}" 2>&1 | grep -v '^$' | tail -30 ;;
      layer4) ikr layer4 0,1,2,3 -c 16384 -ub 2048 -n 128 -sm layer ;;
      graph4) ikr graph4 0,1,2,3 -c 16384 -ub 2048 -n 128 -sm graph ;;
      layer2) ikr layer2 2,3 -c 16384 -ub 2048 -n 128 -sm layer ;;
      graph2) ikr graph2 0,1 -c 16384 -ub 2048 -n 128 -sm graph ;;
      ot_layer4) ikr ot_layer4 0,1,2,3 -c 4096 -ub 2048 -n 32 -sm layer -ot exps=CPU -t 16 ;;
    esac
  done
  ;;
4)
  export CUDA_VISIBLE_DEVICES=0
  OUT=$OUT/cold VARIANTS=${VARIANTS:-"default nooverlap"} timeout ${COLD_S:-240} bash bench/gpu_coldstart.sh > /dev/null 2>&1
  cat "$OUT/cold/cold.md" 2>/dev/null | head -60
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  OUT=$OUT/serve IK=/tmp/ikc/build/bin timeout $left bash bench/gpu_serve.sh 2>&1 | tail -60
  ;;
5)
  export CUDA_VISIBLE_DEVICES=0
  OUT=$OUT/cold VARIANTS="${VARIANTS:-default halves kcache}" timeout ${COLD_S:-240} bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -v "^jit\|tracing\|Finished\|XLA comp" "$OUT/cold/cold.md" 2>/dev/null | head -40
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  OUT=$OUT/serve IK=/tmp/ikc/build/bin timeout $left bash bench/gpu_serve.sh 2>&1 | tail -60
  ;;
6)
  export CUDA_VISIBLE_DEVICES=0
  OUT=$OUT/cold PROFILE=1 VARIANTS="${VARIANTS:-default halves}" timeout ${COLD_S:-330} bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -v "^jit\|tracing\|Finished\|XLA comp" "$OUT/cold/cold.md" 2>/dev/null | head -150
  OUT=$OUT/cold16k SHAPE="-c 16384 -ub 2048 -n 32" VARIANTS=default timeout 150 bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -A8 "^### " "$OUT/cold16k/cold.md" | grep -v "^jit\|tracing\|Finished\|XLA comp"
  start_r1_8
  ;;
7)
  export CUDA_VISIBLE_DEVICES=0
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt 300 ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail /tmp/r1-8.log; exit 1; }
  OUT=$OUT/hyb HYB_GPU=0 timeout ${HYB_BUDGET:-300} bash bench/gpu_hybrid_r1.sh \
    "${PARTS7:-ikjax-default ikjax-active ikjax-gpu-experts-24GB}" > /dev/null 2>&1
  cat "$OUT/hyb/hybrid.md"
  left=$(( ${DEADLINE:-570} - ($(date +%s) - T0) ))
  OUT=$OUT/serve_r1 MODEL=/tmp/r1-8.gguf EXTRA="-ot exps=CPU -t 16" NO_CHECK=1 IK=/none REQS=8 MAXTOK=64 STREAM_TOKENS=200 timeout $left \
    bash bench/gpu_serve.sh 2>&1 | tail -40
  ;;
8)
  export CUDA_VISIBLE_DEVICES=0
  OUT=$OUT/cold VARIANTS="${VARIANTS:-default before kcache}" timeout ${COLD_S:-300} bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -E "^###|^\|  +[0-9]|compiled|loaded|sweep took" "$OUT/cold/cold.md" | head -80
  OUT=$OUT/cold16k SHAPE="-c 16384 -ub 2048 -n 32" VARIANTS="default" timeout 120 bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -E "^###|^\|  +[0-9]|compiled|loaded|sweep took" "$OUT/cold16k/cold.md" | head -40
  start_r1_8
  left=$(( ${DEADLINE:-570} - ($(date +%s) - T0) ))
  OUT=$OUT/serve MODEL=/tmp/v2l-Q4_0.gguf LOAD_ONLY=1 IK=/none timeout $left bash bench/gpu_serve.sh 2>&1 | tail -12
  ;;
9)
  export CUDA_VISIBLE_DEVICES=0
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt 300 ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail /tmp/r1-8.log; exit 1; }
  OUT=$OUT/serve_r1 MODEL=/tmp/r1-8.gguf EXTRA="-ot exps=CPU -t 16" NO_CHECK=1 LOAD_ONLY=1 IK=/none REQS=8 MAXTOK=64 \
    timeout 300 bash bench/gpu_serve.sh 2>&1 | tail -12
  left=$(( ${DEADLINE:-570} - ($(date +%s) - T0) ))
  [ $left -gt 100 ] && { OUT=$OUT/hyb HYB_GPU=0 timeout $left bash bench/gpu_hybrid_r1.sh "${PARTS9:-ikjax-active ikjax-default}" > /dev/null 2>&1
    cat "$OUT/hyb/hybrid.md"; }
  ;;
10)
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_quant_matmul.py \
    tests/test_prompt_attention.py 2>&1 | tail -4
  OUT=$OUT/cold VARIANTS="${VARIANTS:-default many}" timeout ${COLD_S:-230} bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -E "^###|^\|  +[0-9]|compiled|loaded|sweep took" "$OUT/cold/cold.md" | head -60
  OUT=$OUT/cold16k SHAPE="-c 16384 -ub 2048 -n 32" VARIANTS="default many" timeout 170 bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -E "^###|^\|  +[0-9]|compiled|loaded|sweep took" "$OUT/cold16k/cold.md" | head -40
  NO_BG= IK_JOBS=16 start_bg
  left=$(( ${DEADLINE:-570} - ($(date +%s) - T0) ))
  [ $left -gt 30 ] && timeout $left python3 bench/gpu_live_kv.py 2>&1 | grep -v Warning
  ;;
11)
  while ! grep -q BUILD_DONE /tmp/ikc/build.log 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-560} ]; do
    sleep 30; ikprog; done
  ls -la /tmp/r1-8.gguf 2>&1 | tail -1
  ;;
12)
  export CUDA_VISIBLE_DEVICES=0
  while ! grep -q BUILD_DONE /tmp/ikc/build.log 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 300 ]; do sleep 10; done
  ikprog
  OUT=$OUT/serve NO_CHECK=1 MODEL=/tmp/v2l-Q4_0.gguf IK=/tmp/ikc/build/bin timeout ${SERVE_S:-330} bash bench/gpu_serve.sh 2>&1 | tail -40
  left=$(( ${DEADLINE:-575} - ($(date +%s) - T0) ))
  [ -f /tmp/r1-8.gguf ] && [ $left -gt 60 ] && OUT=$OUT/serve_r1 MODEL=/tmp/r1-8.gguf EXTRA="-ot exps=CPU -t 16" NO_CHECK=1 \
    LOAD_ONLY=1 IK=/tmp/ikc/build/bin REQS=8 MAXTOK=64 timeout $left bash bench/gpu_serve.sh 2>&1 | tail -20
  ;;
13)
  export CUDA_VISIBLE_DEVICES=0
  OUT=$OUT/cold NO_PROBE=1 VARIANTS=default timeout ${COLD_S:-100} bash bench/gpu_coldstart.sh > /dev/null 2>&1
  grep -E "^###|^\|  +[0-9]|compiled|loaded|sweep took" "$OUT/cold/cold.md" | head -20
  left=$(( ${DEADLINE:-230} - ($(date +%s) - T0) ))
  OUT=$OUT/serve MODEL=/tmp/v2l-Q4_0.gguf LOAD_ONLY=1 IK=/none timeout $left bash bench/gpu_serve.sh 2>&1 | tail -8
  ;;
37)
  # issue 25 on a 2-GPU lease, call 1 of 3: ik's CUDA build and the R1 file (R1_LAYERS, 16) in the
  # background; the V2-Lite table (multi_gpu.sh PARTS37, default v2l: 1 GPU, -sm layer / graph on 2)
  [ -f /tmp/ikc/build.log ] || bash bench/gpu_ik_build.sh ${IK_JOBS:-20}
  mkdir -p /tmp/mg
  R1ARGS="--preset r1 --layers ${R1_LAYERS:-16} --type Q4_0"
  if [ ! -f /tmp/mg/r1.gguf ] && [ ! -f /tmp/mg/r1.started ]; then
    touch /tmp/mg/r1.started
    setsid nohup bash -c "nice -n 5 python3 -m ikjax.cli make-model -o /tmp/mg/r1.tmp.gguf $R1ARGS > /tmp/mg/r1.log 2>&1 \
      && printf %s '$R1ARGS' > /tmp/mg/r1.args && mv /tmp/mg/r1.tmp.gguf /tmp/mg/r1.gguf" > /dev/null 2>&1 < /dev/null &
  fi
  OUT=$OUT/mg37 PARTS=${PARTS37:-v2l} DEADLINE=${DEADLINE:-480} BUILD_CUDA=0 MG_NO_INSTALL=1 MG_WORK=/tmp/mg \
    bash bench/multi_gpu.sh 2>&1 | tail -30
  ls -la /tmp/mg; tail -2 /tmp/mg/r1.log
  ;;
40)
  # issue 25 on a 2-GPU lease, call 1 of 3 (then STAGE=38, STAGE=39): the host CPU's expert kernel on
  # R1's experts alone (threads 8 / 16 / all; 1 and 8 tokens: the -ot decode's host part; 256 tokens,
  # 64 rows an expert: what the host could take of a prompt step's experts), then ik's CUDA build (all
  # cores) and the R1 file (R1_LAYERS, 7) in the background, the multi-GPU GPU tests, and the build
  # waited for until DEADLINE, so that no later call's figures share the host with it
  lscpu | grep -E "Model name|Socket|Core|Thread|NUMA|L3"; cat /sys/devices/system/node/node*/meminfo 2>/dev/null | grep MemTotal
  for t in 8 16 $(nproc); do
    timeout 90 python3 bench/cpu_moe_matmul.py --shape r1 --experts 32 --types Q4_0 --tokens 1,8,256 --no-xla --reps 30 \
      --threads $t --compute bf16 2>&1 | grep -v "^type"
  done
  start_ik_and_r1
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py 2>&1 | tail -4
  while ! grep -q BUILD_DONE /tmp/ikc/build.log 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-560} ]; do
    sleep 20; ikprog; ls -la /tmp/mg/*.gguf 2>/dev/null | tail -1
  done
  ls -la /tmp/mg; tail -2 /tmp/mg/r1.log
  ;;
41)
  # issue 25 / 24: the -ot exps=CPU decode's host part on the R1 file (R1_LAYERS, 7), one GPU, -t all
  # cores, under VARIANTS41 ("ENV|ENV ..."; sweep-bench's host-kernel line splits each TG token),
  # then the split runs (PARTS41) with the defaults of this commit
  mkdir -p /tmp/mg
  R1ARGS="--preset r1 --layers ${R1_LAYERS:-7} --type Q4_0"
  [ -f /tmp/mg/r1.gguf ] || { python3 -m ikjax.cli make-model -o /tmp/mg/r1.tmp.gguf $R1ARGS > /tmp/mg/r1.log 2>&1 \
    && printf %s "$R1ARGS" > /tmp/mg/r1.args && mv /tmp/mg/r1.tmp.gguf /tmp/mg/r1.gguf; tail -1 /tmp/mg/r1.log; }
  IFS='|' read -ra V41 <<< "${VARIANTS41:-IKJAX_MOE_ONE_JOB=0| |IKJAX_SPIN=100|IKJAX_MOE_ONE_JOB=0 IKJAX_SPIN=100|IKJAX_SPIN=1000}"
  for v in "${V41[@]}"; do
    el "-ot exps=CPU 1 GPU: ${v:-default}"
    env $v CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m ikjax.cli sweep-bench -m /tmp/mg/r1.gguf -c 4096 -ub 2048 -n 32 \
      -mla 3 -fa 1 -ot exps=CPU -t ${T41:-$(nproc)} > "$OUT/ot41.out" 2> "$OUT/ot41.err"
    grep -h "^|  *2048" "$OUT/ot41.out"; grep -h "host experts in decode\|rror" "$OUT/ot41.err" | head -3
  done
  R1L=$(grep -o -- '--layers [0-9]*' /tmp/mg/r1.args | cut -d' ' -f2)
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  [ -n "${PARTS41:-r1_layer2 r1_ot_graph2 r1_ot_layer2}" ] && OUT=$OUT/mg41 PARTS=${PARTS41:-"r1_layer2 r1_ot_graph2 r1_ot_layer2"} \
    DEADLINE=$left R1_LAYERS=${R1L:-7} WARM=0 BUILD_CUDA=0 MG_NO_INSTALL=1 MG_WORK=/tmp/mg bash bench/multi_gpu.sh 2>&1 | tail -14
  [ -n "${TESTS41:-}" ] && timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py \
    -k "$TESTS41" 2>&1 | tail -3
  ;;
38)
  # call 2: the R1 file's runs (PARTS38: -ot exps=CPU under both split modes first, then the splits),
  # after ik's build if one was started (its compile jobs beside a run made rows jump, RESULTS §25e)
  while [ -f /tmp/ikc/build.log ] && ! grep -q BUILD_DONE /tmp/ikc/build.log && [ $(( $(date +%s) - T0 )) -lt 240 ]; do
    sleep 10; done
  ikprog
  while [ ! -f /tmp/mg/r1.gguf ] && [ $(( $(date +%s) - T0 )) -lt 240 ]; do sleep 5; done
  ls -la /tmp/mg/r1.gguf || { tail /tmp/mg/r1.log; exit 1; }
  # the layers of the file the first call wrote (multi_gpu.sh rewrites a file of other layers)
  R1L=$(grep -o -- '--layers [0-9]*' /tmp/mg/r1.args | cut -d' ' -f2)
  OUT=$OUT/mg38 PARTS=${PARTS38:-"r1_ot_graph2 r1_ot_layer2 r1_layer2 r1_graph2"} DEADLINE=${DEADLINE:-540} R1_LAYERS=${R1L:-16} \
    BUILD_CUDA=0 MG_NO_INSTALL=1 MG_WORK=/tmp/mg bash bench/multi_gpu.sh 2>&1 | tail -30
  ;;
39)
  # call 3: ik_llama.cpp on the same files and flags (IK39: v2l_layer2 v2l_graph2 r1_ot_layer2
  # r1_ot_graph2 r1_layer2 r1_graph2, r1_ot_gpu1, or the 4-GPU names: the last digit is the GPUs),
  # sweep-bench's table of each
  while ! grep -q BUILD_DONE /tmp/ikc/build.log 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 300 ]; do sleep 10; done
  ikprog
  IK=/tmp/ikc/build/bin
  [ -x $IK/llama-sweep-bench ] || { tail -5 /tmp/ikc/build.log; exit 1; }
  for run in ${IK39:-v2l_layer2 v2l_graph2 r1_ot_layer2 r1_ot_graph2 r1_layer2 r1_graph2}; do
    [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-540} ] || { el "deadline: not run: $run"; continue; }
    case $run in
      v2l_*) m=/tmp/mg/v2l.gguf ;; *) m=/tmp/mg/r1.gguf ;;
    esac
    n=${run: -1}; [ "$n" -ge 1 ] 2>/dev/null || n=2  # the run name's GPU count (r1_graph4: 4)
    gpus=$(seq -s, 0 $((n - 1)))
    case $run in
      *_ot_*) a="-c 4096 -ub 2048 -n 32 -ot exps=CPU -t ${IK_T:-$(nproc)}" ;; *) a="-c 16384 -ub 2048 -n 128" ;;
    esac
    case $run in *layer[0-9]) a="$a -sm layer" ;; *graph[0-9]) a="$a -sm graph" ;; esac
    el "ik $run: $a"
    CUDA_VISIBLE_DEVICES=$gpus timeout ${IK_RUN_S:-150} $IK/llama-sweep-bench -m $m -ngl 99 -mla 3 -fa on $a \
      > "$OUT/ik_$run.out" 2> "$OUT/ik_$run.err"; echo "rc $?" >> "$OUT/ik_$run.out"
    grep -h '^|' "$OUT/ik_$run.out" "$OUT/ik_$run.err"; grep -i -E 'error|failed|CUDA[0-9] buffer|model buffer' "$OUT/ik_$run.err" | head -4
  done
  ;;
42)
  # issue 26 at -t 16 (THREADS42): the table with ik's AVX2 build carried prebuilt (.whl/ik_avx2_bin.tar.gz,
  # as STAGE=29) and its native build made in the call (VARIANTS42, TYPES42), then the amx level's
  # tile-loop prefetch on / off on the routed-experts call at -t 16 (bench/cpu_moe_ab.py, in one process)
  tar -xzf .whl/ik_avx2_bin.tar.gz -C / || exit 1
  # ik's native build carried too where a lease saved it (STAGE=44: .whl/ik_native_bin.tar.gz, -march=native
  # of the nvidia-h200 hosts' Xeon: delete it for another CPU), else built here
  if [ -f .whl/ik_native_bin.tar.gz ]; then tar -xzf .whl/ik_native_bin.tar.gz -C / && export IK_NATIVE_BIN=/tmp/ikt/build-native/bin/llama-sweep-bench; fi
  THREADS="${THREADS42:-16}" TYPES="${TYPES42:-Q8_0 Q4_0 Q4_K IQ4_XS}" VARIANTS="${VARIANTS42:-ik_native jx_amx ik_avx2 jx_avx2}" \
    IK_AVX2_BIN=/tmp/ikfull/build/bin/llama-sweep-bench JOBS=15 DEADLINE=${DEADLINE42:-420} NO_INSTALL=1 IK_DIR=/tmp/ikt \
    OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 | grep -E "^\||passed|failed|rc=|physical" | head -24
  tail -3 "$OUT/cpu/progress.log"
  for spec in ${AB42:-"Q4_0 r1 256" "IQ4_XS v2-lite 512"}; do
    [ "$spec" = skip ] && break
    set -- $spec
    el "moe A/B $1 $2 -t 16: IKJAX_AMX_PREFETCH 0 / 1"
    IKJAX_CPU_ISA=amx taskset -c 0-15 timeout 100 python3 bench/cpu_moe_ab.py --type $1 --shape $2 --tokens $3 --threads 16 \
      $([ $2 = v2-lite ] && echo --down-type Q8_0) --a IKJAX_AMX_PREFETCH=0 --b IKJAX_AMX_PREFETCH=1 --rounds 12 2>&1 | grep -v Warn | tail -4
  done
  # PROF42: "TYPE:LEVEL:START ..." prompt steps by op at -t 16 (bench/cpu_prompt_profile.py)
  for spec in ${PROF42:-}; do
    IFS=: read -r t lv st <<< "$spec"
    el "profile $t $lv -t 16 N_KV $st"
    JAX_PLATFORMS=cpu IKJAX_CPU_ISA=$lv taskset -c 0-15 timeout 100 python3 bench/cpu_prompt_profile.py /tmp/cpuisa_4l_$t.gguf \
      --threads 16 --start $st 2>&1 | grep -v Warn | head -${TOP42:-12}
  done
  ;;
43)
  # issue 26: why sweep-bench's amx S_PP at -t 16 is below the profile's steady-state step (TYPES43):
  # the prompt step right after a decode loop against back to back (bench/cpu_step_jitter.py --compare), then
  # sweep-bench with the compile cache on (a second run: steps from the cache) and off
  for t in ${TYPES43:-Q4_K}; do
    f=/tmp/cpuisa_4l_$t.gguf
    [ -f $f ] || python3 -m ikjax.cli make-model --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t -o $f > /dev/null
    IKJAX_CPU_ISA=amx taskset -c 0-15 timeout 150 python3 bench/cpu_step_jitter.py $f 16 6 --compare 2>&1 | grep -E "back to back|sweep_bench.run" 
    for cc in /tmp/cc43 /tmp/cc43 0; do
      IKJAX_CPU_ISA=amx IKJAX_COMPILE_CACHE=$cc taskset -c 0-15 timeout 120 python3 -m ikjax.cli sweep-bench -m $f -c 1024 -ub 512 -n 32 \
        -mla 3 -fa 1 -t 16 2>/dev/null | grep "^|" | tail -2 | awk -F'|' -v cc=$cc '{printf "cache %s: S_PP %s S_TG %s\n", cc, $6+0, $8+0}'
    done
  done
  ;;
44)
  # issue 26: sweep-bench's amx rows (what the table reads) under malloc / THP variants of the process
  # (VARIANTS44: "name|ENV=V,ENV=V ..."; "default|" runs as shipped), REPS44 rounds, each round every
  # variant and ik's native build once, interleaved (ik's rows move 10-30 % between runs too); ik's
  # native build carried (.whl/ik_native_bin.tar.gz) or built here and saved to $OUT for the next lease.
  # THREADS44 (default 16: taskset to the first N cores), LEVEL44 (ikjax's level, default amx), IK44
  # (native, or avx2: ik's AVX2 build carried as STAGE=42 does)
  T44=${THREADS44:-16}; L44=${LEVEL44:-amx}; TYPES="${TYPES44:-IQ4_XS Q4_0}"
  CORES44=0-$((T44 - 1))
  el "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled) defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
  if [ -f .whl/ik_native_bin.tar.gz ]; then tar -xzf .whl/ik_native_bin.tar.gz -C / || exit 1; fi
  IKN=/tmp/ikt/build-native/bin/llama-sweep-bench
  [ -x $IKN ] && export IK_NATIVE_BIN=$IKN
  if [ "${IK44:-native}" = avx2 ]; then tar -xzf .whl/ik_avx2_bin.tar.gz -C / || exit 1; IKN=/tmp/ikfull/build/bin/llama-sweep-bench; fi
  [ "${IK44:-native}" = native ] && THREADS=16 TYPES="$TYPES" VARIANTS="ik_native" JOBS=15 DEADLINE=300 NO_INSTALL=1 IK_DIR=/tmp/ikt \
    OUT=$OUT/cpu bash bench/cpu_isa_table.sh 2>&1 | grep -E "^\|" | head -6
  [ -f .whl/ik_native_bin.tar.gz ] || tar -czf $OUT/ik_native_bin.tar.gz -C / tmp/ikt/build-native/bin/llama-sweep-bench \
    tmp/ikt/build-native/src/libllama.so tmp/ikt/build-native/ggml/src/libggml.so 2>&1 | tail -2
  for t in $TYPES ${PROF44:-}; do  # (the table script writes them; IK44=avx2 runs without it)
    t=${t%%|*}; f=/tmp/cpuisa_4l_$t.gguf
    [ -f $f ] || python3 -m ikjax.cli make-model --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t -o $f > /dev/null
  done
  # PROF44: "TYPE|ENV=V,ENV=V ..." the 512-token step by op at -t T44, N_KV 0, level L44 (cpu_prompt_profile.py)
  for spec in ${PROF44:-}; do
    t=${spec%%|*}; envs=$(echo "${spec#*|}" | tr ',' ' ')
    el "profile $t [$envs]"
    env $envs JAX_PLATFORMS=cpu IKJAX_CPU_ISA=$L44 taskset -c $CORES44 timeout 100 python3 bench/cpu_prompt_profile.py \
      /tmp/cpuisa_4l_$t.gguf --threads $T44 2>&1 | grep -v Warn | head -${TOP44:-10}
  done
  for t in $TYPES; do
    f=/tmp/cpuisa_4l_$t.gguf
    for r in $(seq ${REPS44:-3}); do
      for spec in ${VARIANTS44:-"default|" "ik|" "arena1|MALLOC_ARENA_MAX=1,MALLOC_MMAP_THRESHOLD_=33554432,MALLOC_TRIM_THRESHOLD_=1073741824,MALLOC_TOP_PAD_=268435456" "thp|GLIBC_TUNABLES=glibc.malloc.hugetlb=1"}; do
        name=${spec%%|*}; envs=$(echo "${spec#*|}" | tr ',' ' ')
        if [ "$name" = ik ]; then
          row=$(taskset -c $CORES44 timeout 120 $IKN -m $f -c 1024 -ub 512 -n 32 -mla 3 -fa 1 -t $T44 2>&1 | grep "^|  *512")
        else
          row=$(env $envs IKJAX_CPU_ISA=$L44 JAX_PLATFORMS=cpu taskset -c $CORES44 timeout 120 python3 -m ikjax.cli sweep-bench -m $f -c 1024 -ub 512 -n 32 \
            -mla 3 -fa 1 -t $T44 2>/dev/null | grep "^|  *512")
        fi
        echo "$row" | awk -F'|' -v n="$t r$r $name" '{pp=pp" "$6+0; tg=tg" "$8+0} END {printf "%-22s S_PP%s  S_TG%s\n", n, pp, tg}'
      done
    done
  done
  ;;
45)
  # issue 26: the amx prompt step's run-to-run spread at -t 16 under settings (VARIANTS45: "TYPE|ENV=V,..."),
  # sweep-bench's order in one process (bench/cpu_step_jitter.py: time / faults / switches per step)
  for spec in ${VARIANTS45:-"IQ4_XS|" "IQ4_XS|IKJAX_SPIN_LONG=2000" "IQ4_XS|IKJAX_SPIN=0,IKJAX_SPIN_LONG=0" "Q4_0|"}; do
    t=${spec%%|*}; envs=$(echo "${spec#*|}" | tr ',' ' '); f=/tmp/cpuisa_4l_$t.gguf
    [ -f $f ] || python3 -m ikjax.cli make-model --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t -o $f > /dev/null
    el "jitter $t [$envs]"
    grep -E "thp_(split_page |underused|fault_alloc |collapse_alloc )|nr_anon_transparent|pgmigrate_success|compact_daemon_migrate_scanned|numa_hint_faults " /proc/vmstat | tr '\n' ' ' > /tmp/vm0
    env $envs JAX_PLATFORMS=cpu IKJAX_CPU_ISA=amx taskset -c 0-15 timeout 120 python3 bench/cpu_step_jitter.py $f 16 ${ROUNDS45:-10} 2>&1 | grep -v Warn | tail -5
    echo "  vmstat before: $(cat /tmp/vm0)"; echo "  vmstat after:  $(grep -E "thp_(split_page |underused|fault_alloc |collapse_alloc )|nr_anon_transparent|pgmigrate_success|compact_daemon_migrate_scanned|numa_hint_faults " /proc/vmstat | tr '\n' ' ')"
  done
  ;;
46)
  # issue 26: who hands a prompt step's pages back between runs on the device host (RESULTS §26ai: with
  # one glibc arena and mmap off the N_KV 512 steps still faulted 22-27 thousand pages a run, which this
  # workplace's VM never showed): the jitter run under strace (madvise / munmap / brk / mmap counted
  # during the timed rounds, between cpu_step_jitter.py's markers)
  t=${TYPE46:-Q8_0}; f=/tmp/cpuisa_4l_$t.gguf
  [ -f $f ] || python3 -m ikjax.cli make-model --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t -o $f > /dev/null
  grep -E "pgmigrate_success|compact_daemon_migrate_scanned|compact_stall" /proc/vmstat | tr '\n' ' ' > /tmp/vm46
  if command -v strace > /dev/null; then
    JAX_PLATFORMS=cpu IKJAX_CPU_ISA=amx taskset -c 0-15 timeout 200 strace -f -tt -e trace=madvise,munmap,brk,mmap,mremap,mprotect,access,faccessat,faccessat2 \
      -o $OUT/strace46.txt python3 bench/cpu_step_jitter.py $f 16 ${ROUNDS46:-6} 2>&1 | grep -v Warn | tail -5
    python3 - "$OUT/strace46.txt" <<'PY'
import collections, re, sys
lines = open(sys.argv[1]).read().splitlines()
calls = collections.Counter(); big = collections.Counter()
start = next((i for i, l in enumerate(lines) if "ikjax-jitter-runs-start" in l), 0)
end = next((i for i, l in enumerate(lines) if "ikjax-jitter-runs-end" in l), len(lines))
for l in lines[start:end]:  # the timed rounds (cpu_step_jitter.py's markers)
    m = re.match(r"(\d+)\s+\S+\s+(\w+)\((.*)", l)
    if not m:
        continue
    calls[m.group(2)] += 1
    nums = [int(x) for x in re.findall(r", (\d{6,})", m.group(3))]
    if nums and max(nums) >= 1 << 20:
        big[(m.group(2), m.group(3).split(",")[-1].strip()[:20])] += 1
print("syscalls during the timed rounds:", dict(calls))
print("of them on 1 MiB or more:", dict(big.most_common(8)))
PY
  else
    el "no strace on this host"
  fi
  echo "vmstat before: $(cat /tmp/vm46)"
  echo "vmstat after:  $(grep -E "pgmigrate_success|compact_daemon_migrate_scanned|compact_stall" /proc/vmstat | tr '\n' ' ') (page migration by compaction faults the moved pages in again)"
  ;;
47)
  # issue 26: how the amx level's routed-experts call scales with threads on the device host (RESULTS
  # §26aj: its 512-token call took ~37 ms at -t 16 against ~192 ms at -t 1 on this workplace's Xeon, a
  # third of a linear split): bench/cpu_moe_ab.py's process CPU and wall time per thread count (MOE47:
  # "TYPE DOWN_TYPE ..."; THREADS47), A = B = the shipped settings, or VAR47A / VAR47B
  lscpu | grep -E "^(Thread|Core|Socket|NUMA node|L1d|L2|L3|CPU max|CPU MHz)" | tr -s ' ' | tr '\n' ';'; echo
  for spec in ${MOE47:-"IQ4_XS Q8_0" "Q4_0 Q4_0"}; do
    set -- $spec
    for th in ${THREADS47:-1 4 8 16}; do
      el "moe $1 / $2 down, v2-lite 512 tokens, -t $th"
      IKJAX_CPU_ISA=${LEVEL47:-amx} taskset -c 0-$((th - 1)) timeout 150 python3 bench/cpu_moe_ab.py --type $1 --down-type $2 \
        --shape v2-lite --tokens 512 --threads $th --a ${VAR47A:-IKJAX_AMX_PREFETCH=1} --b ${VAR47B:-IKJAX_AMX_PREFETCH=1} \
        --rounds ${ROUNDS47:-6} 2>&1 | grep -v Warn | tail -3
    done
  done
  ;;
48)
  # issue 26: does a step compiled in a process pinned to 2 cores run slower at -t 16 when a later
  # process takes it from the compile cache? (§26aj: the avx2 Q4_0 decode at -t 16 ran 96-113 t/s in a
  # lease whose steps all came from -t 2 runs' cache, 190-212 where they were compiled at -t 16.)
  # TYPE48 (default Q4_0), LEVEL48 (default avx2): the -t 16 sweep-bench with a cache filled by a -t 16 run,
  # by a -t 2 run, and with the cache off, ROUNDS48 rounds interleaved
  t=${TYPE48:-Q4_0}; lv=${LEVEL48:-avx2}; f=/tmp/cpuisa_4l_$t.gguf
  [ -f $f ] || python3 -m ikjax.cli make-model --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t -o $f > /dev/null
  sb() {  # cache dir, cores, threads
    IKJAX_CPU_ISA=$lv JAX_PLATFORMS=cpu IKJAX_COMPILE_CACHE=$1 taskset -c $2 timeout 150 python3 -m ikjax.cli sweep-bench -m $f \
      -c 1024 -ub 512 -n 32 -mla 3 -fa 1 -t $3 2>/dev/null | grep "^|  *512" | awk -F'|' '{pp=pp" "$6+0; tg=tg" "$8+0} END {printf "S_PP%s  S_TG%s\n", pp, tg}'
  }
  rm -rf /tmp/cc48a /tmp/cc48b
  echo "filling cache a at -t 16: $(sb /tmp/cc48a 0-15 16)"
  echo "filling cache b at -t 2:  $(sb /tmp/cc48b 0,1 2)"
  for r in $(seq ${ROUNDS48:-2}); do
    echo "r$r -t 16, cache a (compiled at -t 16): $(sb /tmp/cc48a 0-15 16)"
    echo "r$r -t 16, cache b (compiled at -t 2):  $(sb /tmp/cc48b 0-15 16)"
    echo "r$r -t 16, cache off:                   $(sb 0 0-15 16)"
  done
  ;;
49)
  # issue 26: the avx2 Q4_0 decode at -t 16 that halved on two leases (RESULTS §26ak): PROCS49 fresh
  # processes of bench/cpu_decode_threads.py (each: a prompt step, then ROUNDS49 decode loops of 32
  # tokens, every busy thread's run-queue wait and last CPU), TYPE49 / LEVEL49 / THREADS49; a slow
  # process beside a fast one says whether threads share cores when it is slow
  t=${TYPE49:-Q4_0}; lv=${LEVEL49:-avx2}; th=${THREADS49:-16}; f=/tmp/cpuisa_4l_$t.gguf
  [ -f $f ] || python3 -m ikjax.cli make-model --preset v2-lite --layers 4 --q-lora-rank 1536 --type $t -o $f > /dev/null
  for i in $(seq ${PROCS49:-4}); do
    el "process $i: $t $lv -t $th"
    IKJAX_CPU_ISA=$lv taskset -c 0-$((th - 1)) timeout 120 python3 bench/cpu_decode_threads.py $f $th ${ROUNDS49:-3} -v \
      2>&1 | grep -v Warn | head -${LINES49:-60}
  done
  ;;
50)
  # issue 26: the pinned int8 loops (IKJAX_Q8_PINNED) against the loops before them, the routed-experts
  # call of each type (TYPES50) alternated in one process (bench/cpu_moe_ab.py, -t THREADS50, one core
  # a thread), under AVX-VNNI and the plain AVX2 build (BUILDS50: "1 0", IKJAX_AVXVNNI)
  th=${THREADS50:-1}
  for vn in ${BUILDS50:-1 0}; do
    for t in ${TYPES50:-Q8_0 Q4_0 Q4_K IQ4_XS}; do
      el "moe A/B $t avx2 AVXVNNI=$vn -t $th: IKJAX_Q8_PINNED 0 / 1"
      IKJAX_AVXVNNI=$vn IKJAX_CPU_ISA=avx2 taskset -c 0-$((th - 1)) timeout 150 python3 bench/cpu_moe_ab.py --type $t \
        --down-type Q8_0 --shape v2-lite --tokens 512 --threads $th --a IKJAX_Q8_PINNED=0 --b IKJAX_Q8_PINNED=1 \
        --rounds ${ROUNDS50:-8} 2>&1 | grep -v Warn | tail -3
    done
  done
  ;;
51)
  # issues 25 / 22: -ot steps served by the compile cache (host tensors named by slots, RESULTS §25i):
  # the hybrid GPU tests (the handler through slots; two -ot runs in one cache, 1 GPU and -sm graph),
  # then the 8-layer R1 (written here unless /tmp/r1-8.gguf exists) with -ot exps=CPU, cold then warm
  # in a fresh cache: each run's load, compile and rows (the warm run should compile no step)
  start_r1_8
  timeout ${TESTS51_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py 2>&1 | tail -6
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-420} ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail -3 /tmp/r1-8.log; exit 1; }
  export IKJAX_COMPILE_CACHE=/tmp/cc51_$$
  for run in cold warm; do
    el "r1-8 -ot exps=CPU, $run"
    CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf -c 4096 -ub 2048 -n 32 -mla 3 \
      -fa 1 -ot exps=CPU -t $(nproc) > "$OUT/r1ot_$run.out" 2> "$OUT/r1ot_$run.err"; echo "rc $?"
    grep -h "^|  *2048\|loaded\|compiled\|rror" "$OUT/r1ot_$run.out" "$OUT/r1ot_$run.err" | head -8
  done
  ;;
52)
  OUT=$OUT/probe52 bash bench/ot_cache_probe.sh 2>&1 | tail -${TAIL52:-60}
  ;;
54)
  # issues 25 / 22 / 24: the 8-layer R1 (written here unless it exists), then why its -ot steps still compile
  # on a warm run (ot_cache_probe.sh on it, MODES54), then where a hybrid decode token goes
  # (gpu_decode_profile.py --cpu-moe: kernels, gaps, the host kernel's share) unless PROFILE54=0
  start_r1_8
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-300} ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail -3 /tmp/r1-8.log; exit 1; }
  if [ "${MODES54:-ot}" != none ]; then
    MODES=${MODES54:-ot} MODEL52=/tmp/r1-8.gguf ARGS52="-c 4096 -ub 2048 -n 32 -mla 3 -fa 1" THREADS52=$(nproc) \
      OUT=$OUT/probe54 bash bench/ot_cache_probe.sh 2>&1 | tail -${TAIL52:-60}
  fi
  if [ "${PROFILE54:-1}" != 0 ]; then
    el "hybrid decode profile, r1-8 -ot exps=CPU"
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/gpu_decode_profile.py /tmp/r1-8.gguf --cpu-moe --threads $(nproc) \
      --ubatch 2048 --tg 32 --kv 512 --prefill --top 30 2>&1 | grep -v Warn | tail -75
  fi
  ;;
55)
  # issue 24 / 25: how a step hands host experts over (IKJAX_HOST_CALL flag / hostfunc): the hybrid GPU tests
  # (both forms bit for bit), then R1-8 -ot exps=CPU sweep-bench rows per form, one cache (FORMS55), then
  # each form's decode token profile unless PROFILE55=0
  start_r1_8
  timeout ${TESTS55_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py \
    -k "${TESTK55:-host_call_forms or tiny4_host_experts_equal or n_cpu_moe}" 2>&1 | tail -4
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-300} ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail -3 /tmp/r1-8.log; exit 1; }
  export IKJAX_COMPILE_CACHE=/tmp/cc55
  for form in ${FORMS55:-flag hostfunc flag}; do
    el "r1-8 -ot sweep-bench, IKJAX_HOST_CALL=$form"
    IKJAX_HOST_CALL=$form CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf -c 4096 \
      -ub 2048 -n ${TG55:-64} -mla 3 -fa 1 -ot exps=CPU -t $(nproc) 2>&1 | grep -E "^\|  *2048|host experts in decode|rror" | cut -c1-300
  done
  if [ "${PROFILE55:-1}" != 0 ]; then
    for form in ${PFORMS55:-flag hostfunc}; do
      el "hybrid decode profile, IKJAX_HOST_CALL=$form"
      IKJAX_HOST_CALL=$form CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/gpu_decode_profile.py /tmp/r1-8.gguf --cpu-moe \
        --threads $(nproc) --ubatch 2048 --tg 32 --kv 512 --prefill --top 8 2>&1 | grep -v Warn | grep -E "a token wall|^ +[0-9]|host experts|idle" | head -14
    done
  fi
  ;;
56)
  # issue 24: --gpu-experts auto under a 24 GB budget on the 8-layer R1 with this code (the statistics counted
  # on the device, handed over once a dispatch; the host calls by flag), beside the default with
  # --expert-stats (which writes the statistics) and the active stream form (bench/gpu_hybrid_r1.sh, PARTS56)
  start_r1_8
  export CUDA_VISIBLE_DEVICES=0
  while [ ! -f /tmp/r1-8.gguf ] && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-300} ]; do sleep 5; done
  ls -la /tmp/r1-8.gguf || { tail -3 /tmp/r1-8.log; exit 1; }
  OUT=$OUT/hyb HYB_GPU=0 timeout ${HYB_BUDGET:-400} bash bench/gpu_hybrid_r1.sh \
    "${PARTS56:-ikjax-default ikjax-gpu-experts-24GB ikjax-active}" > /dev/null 2>&1
  cat "$OUT/hyb/hybrid.md"
  ;;
57)
  # issue 24: one lease, interleaved: R1-8 -ot sweep-bench rows in the auto and active stream forms and with
  # --gpu-experts auto (24 GB), then the decode token's profile with the hot experts and without
  r1_8_hybrid_setup /tmp/cc57
  for v in ${VARIANTS57:-auto active hot}; do
    el "r1-8 sweep-bench: $v"
    case $v in
      auto) timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 ;;
      active) IKJAX_STREAM=active timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 ;;
      stats) timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 --expert-stats /tmp/r1-stats2.json ;;
      hot) XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 \
             --gpu-experts auto --expert-stats $S ;;
    esac 2>&1 | grep -E "^\|  *2048|host experts in decode|gpu experts|rror" | cut -c1-260
  done
  for v in ${PROFILES57:-hot auto}; do
    el "decode profile: $v"
    extra=""; envs=""
    [ $v = hot ] && { extra="--gpu-experts auto --expert-counts $S"; envs="XLA_PYTHON_CLIENT_MEM_FRACTION=$frac"; }
    [ $v = active ] && envs="IKJAX_STREAM=active"
    env $envs timeout 150 python3 bench/gpu_decode_profile.py /tmp/r1-8.gguf --cpu-moe --threads $(nproc) --ubatch 2048 \
      --tg 32 --kv 512 --prefill --top 10 $extra 2>&1 | grep -v Warn | grep -E "gpu experts|a token wall|^ +[0-9]|host experts|idle" | head -16
  done
  ;;
58)
  # issue 24 (RESULTS §24i): why sweep-bench's TG rows with host experts run 2-7 ms a token slower than the same
  # decode call profiled alone. One lease: the decode call profiled with a 2048-token prompt step (which streams
  # the experts to the GPU) before each call, hot and auto; then sweep-bench's rows through the API with the hot
  # experts and counting off / on (bench/hybrid_sweep_api.py), against the CLI's row
  r1_8_hybrid_setup /tmp/cc58
  for v in ${PROFILES58:-hot auto}; do
    [ "$v" = none ] && continue  # (PROFILES58=none: skip these)
    el "decode profile after 2048-token prompt steps: $v"
    extra=""; envs=""
    [ $v = hot ] && { extra="--gpu-experts auto --expert-counts $S"; envs="XLA_PYTHON_CLIENT_MEM_FRACTION=$frac"; }
    env $envs timeout 150 python3 bench/gpu_decode_profile.py /tmp/r1-8.gguf --cpu-moe --threads $(nproc) --ubatch 2048 \
      --tg 32 --kv 512 --interleave --interleave-tokens 2048 --top 8 $extra 2>&1 | grep -v Warn | grep -E "a token wall|^ +[0-9]|host experts|idle" | head -12
  done
  for sp in ${SPINS58:-100 400}; do  # the pool's workers spinning between the flag hand-overs (IKJAX_SPIN; default 0 next to a GPU)
    [ "$sp" = none ] && continue  # (SPINS58=none: skip these)
    el "decode profile, hot, IKJAX_SPIN=$sp"
    IKJAX_SPIN=$sp XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 bench/gpu_decode_profile.py /tmp/r1-8.gguf --cpu-moe \
      --threads $(nproc) --ubatch 2048 --tg 32 --kv 512 --prefill --top 3 --gpu-experts auto --expert-counts $S 2>&1 \
      | grep -v Warn | grep -E "a token wall|host experts" | head -3
  done
  for v in ${SWEEPS58:-hot hot-count}; do  # (cli: the CLI's row with the hot experts, for a second chained call)
    [ "$v" = none ] && continue  # (SWEEPS58=none: skip these)
    el "sweep-bench rows: $v"
    if [ $v = cli ]; then
      XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 \
        --gpu-experts auto --expert-stats $S 2>&1 | grep -E "^\|  *2048|host experts in decode|rror" | cut -c1-260
      continue
    fi
    extra=""; envs=""
    case $v in hot*) extra="--gpu-experts auto --expert-counts $S"; envs="XLA_PYTHON_CLIENT_MEM_FRACTION=$frac" ;; esac
    case $v in *count) extra="$extra --count" ;; esac
    env $envs timeout 150 python3 bench/hybrid_sweep_api.py /tmp/r1-8.gguf --threads $(nproc) $extra 2>&1 | grep -v Warn | tail -6
  done
  ;;
61)
  # issue 24 (§24k): host experts streamed as runs of experts (IKJAX_STREAM=chunks, the default now) against
  # whole layers (=layer, the default before): R1-8 sweep-bench rows and peak device memory (nvidia-smi)
  start_r1_8
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py \
    -k "${GPU_TESTS61:-active_stream_rounds or prompt_streams}" 2>&1 | tail -3
  r1_8_hybrid_setup /tmp/cc61
  for v in ${VARIANTS61:-chunks layer chunks256 ahead3}; do
    cap=""  # NAME@MiB: XLA may hold at most that much device memory (ik's run: 7641 MiB, §24e)
    case $v in *@*) cap="XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(${v#*@} / $(nvidia-smi -i 0 \
      --query-gpu=memory.total --format=csv,noheader,nounits | head -1), 4))")"; v=${v%@*} ;; esac
    case $v in
      chunks) envs="" ;; layer) envs="IKJAX_STREAM=layer" ;; active) envs="IKJAX_STREAM=active" ;;
      chunks256) envs="IKJAX_STREAM_MIB=256" ;; chunks1024) envs="IKJAX_STREAM_MIB=1024" ;; ahead3) envs="IKJAX_STREAM_AHEAD=3" ;;
      ahead1) envs="IKJAX_STREAM_AHEAD=1" ;;
    esac
    el "r1-8 sweep-bench: $v ($envs)"
    ( while true; do nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits; sleep 0.3; done ) > /tmp/mem61 &
    mp=$!
    el "  $cap"
    env $envs $cap timeout 170 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n ${N61:-32} --sweep-memory 2>&1 \
      | grep -E "^\|  *2048|host experts|stream buffer|device|rror" | cut -c1-260
    kill $mp; el "peak device memory: $(sort -n /tmp/mem61 | tail -1) MiB"
  done
  ;;
60)
  # issue 24 (§24j): the decode loop with host experts on one GPU: the GPU tests (loop = steps, both
  # hand-over forms), then the R1-8 CLI rows: --gpu-experts auto with --expert-stats (counting), plain -ot
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py \
    -k "${GPU_TESTS60:-decode_loop_equals or host_call_forms or n_cpu_moe}" 2>&1 | tail -4
  r1_8_hybrid_setup /tmp/cc60
  for v in ${SWEEPS60:-hot plain hot}; do
    el "r1-8 sweep-bench (CLI): $v"
    case $v in
      hot) XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 \
             --gpu-experts auto --expert-stats $S ;;
      plain) timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 ;;
      steps) IKJAX_DECODE_LOOP=0 timeout 150 python3 -m ikjax.cli sweep-bench -m /tmp/r1-8.gguf $F -n 64 ;;
    esac 2>&1 | grep -E "^\|  *2048|host experts in decode|gpu experts|rror" | cut -c1-260
  done
  ;;
59)
  # issue 24 (§24i): sweep-bench's TG rows lose ~3 ms a token with expert statistics counted (the CLI's
  # --gpu-experts auto --expert-stats FILE counts too): the decode call profiled with counting on and off
  r1_8_hybrid_setup /tmp/cc58
  for v in ${PROFILES59:-hot-count hot}; do
    el "decode profile: $v"
    extra="--gpu-experts auto --expert-counts $S"
    case $v in *count) extra="$extra --count" ;; esac
    XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 bench/gpu_decode_profile.py /tmp/r1-8.gguf --cpu-moe --threads $(nproc) \
      --ubatch 2048 --tg 64 --kv 512 --prefill --top 12 $extra 2>&1 | grep -v Warn | grep -E "a token wall|^ +[0-9]|host experts|idle" | head -16
  done
  for v in ${SWEEPS59:-}; do  # API sweeps: count, count-freeze (gc.freeze after the compile), nocount
    el "sweep-bench rows (API, hot): $v"
    extra="--gpu-experts auto --expert-counts $S"
    case $v in count*) extra="$extra --count" ;; esac
    case $v in *freeze) extra="$extra --gc-freeze" ;; esac
    XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 150 python3 bench/hybrid_sweep_api.py /tmp/r1-8.gguf --threads $(nproc) $extra 2>&1 \
      | grep -v Warn | tail -7
  done
  ;;
62)
  # issue 25 on a 2-GPU lease, call 1 of 3 (then STAGE=41 for ikjax's -ot rows, STAGE=39 for ik's):
  # ik's CUDA build (all cores) and the R1 file (R1_LAYERS, 7) in the background, the hybrid GPU tests
  # of the split modes' decode loop (TESTS62), then the build waited for until DEADLINE
  start_ik_and_r1
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py \
    -k "${TESTS62:-split_hybrid or graph_split or layer_split or decode_loop_equals}" 2>&1 | tail -4
  while ! grep -q BUILD_DONE /tmp/ikc/build.log 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-560} ]; do
    sleep 20; ikprog; ls -la /tmp/mg/*.gguf 2>/dev/null | tail -1
  done
  ls -la /tmp/mg; tail -2 /tmp/mg/r1.log
  ;;
63)
  # issue 22: -ot host layers scanned (HostStack, IKJAX_HOST_LAYERS), call 1 of 63, 64: R1-shape files of 4 and
  # 16 layers with EXPERTS63 (32) experts written in the background, the hybrid GPU tests (TESTS63: all)
  for L in 4 16; do
    if [ ! -f /tmp/r1e-$L.gguf ] && [ ! -f /tmp/r1e-$L.started ]; then
      touch /tmp/r1e-$L.started
      setsid nohup bash -c "python3 -m ikjax.cli make-model -o /tmp/r1e-$L.tmp.gguf --preset r1 --layers $L \
        --experts ${EXPERTS63:-32} --type Q4_0 > /tmp/r1e-$L.log 2>&1 && mv /tmp/r1e-$L.tmp.gguf /tmp/r1e-$L.gguf" \
        > /dev/null 2>&1 < /dev/null &
    fi
  done
  timeout ${TESTS63_S:-400} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_hybrid_gpu.py \
    -k "${TESTS63:-not nothing}" 2>&1 | tail -${TAIL63:-8}
  ls -la /tmp/r1e-*.gguf 2>/dev/null; tail -1 /tmp/r1e-*.log
  ;;
64)
  # issue 22, call 2: each -ot run cold in a fresh cache (command to end, compile lines, rows): RUNS64 of
  # "LAYERS:FORM" (FORM: scan, unroll = IKJAX_HOST_LAYERS), then warm reruns (WARM64) of the same
  R64=${RUNS64:-4:scan 16:scan 16:unroll} W64=${WARM64:-16:scan 16:unroll}
  for L in $(echo $R64 $W64 | tr ' ' '\n' | cut -d: -f1 | sort -u); do  # the files these runs read
    while [ ! -f /tmp/r1e-$L.gguf ] && [ $(( $(date +%s) - T0 )) -lt ${DEADLINE:-300} ]; do sleep 5; done
  done
  ls -la /tmp/r1e-*.gguf || exit 1
  run64() {  # $1 LAYERS:FORM  $2 cold|warm
    L=${1%%:*} form=${1##*:} cc=/tmp/cc64_${1//:/_}
    [ $2 = cold ] && rm -rf $cc
    el "r1e-$L -ot exps=CPU $form $2"
    t0=$(date +%s.%N)
    IKJAX_HOST_LAYERS=$form IKJAX_COMPILE_CACHE=$cc CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m ikjax.cli sweep-bench \
      -m /tmp/r1e-$L.gguf -c 4096 -ub 2048 -n 32 -mla 3 -fa 1 -ot exps=CPU -t $(nproc) > "$OUT/r1e_${L}_${form}_$2.out" 2>&1
    echo "rc $? wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
    grep -h "^|  *2048\|^|  *[0-9]* |  *32 \|loaded\|compiled\|rror" "$OUT/r1e_${L}_${form}_$2.out" | cut -c1-200 | head -12
  }
  for r in $R64; do run64 $r cold; done
  for r in $W64; do run64 $r warm; done
  ;;
65)
  # issue 22, call 3: the scanned -ot form's f32 logits against the unrolled one and the all-GPU run
  # (bench/ot_scan_check.py on the tiny preset at 6 layers), then STAGE=64's warm runs interleaved (WARM65)
  M=/tmp/tiny6-Q4_K.gguf
  [ -f $M ] || python3 -m ikjax.cli make-model -o $M --preset tiny --layers 6 --type Q4_K > /dev/null
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/ot_scan_check.py $M ${CHECK65:-} 2>&1 | grep -E "^mib|rror"
  WARM64="${WARM65:-16:scan 16:unroll 16:scan 16:unroll}" RUNS64=" " STAGE=64 bash "$0" 2>&1 | grep -E "^\[|^rc|^\|"
  ;;
66)
  # issue 22, one call: r1e-16 written in the background; the tiny6 f32 logits of the all-GPU run scanned and
  # unrolled against the CPU's (which form is off by 1e-3, §22x), the -ot forms against the all-GPU run;
  # then r1e-16 -ot cold scan / unroll (fresh caches) and warm, interleaved (WARM66)
  if [ ! -f /tmp/r1e-16.gguf ] && [ ! -f /tmp/r1e-16.started ]; then
    touch /tmp/r1e-16.started
    setsid nohup bash -c "python3 -m ikjax.cli make-model -o /tmp/r1e-16.tmp.gguf --preset r1 --layers 16 \
      --experts 32 --type Q4_0 > /tmp/r1e-16.log 2>&1 && mv /tmp/r1e-16.tmp.gguf /tmp/r1e-16.gguf" > /dev/null 2>&1 < /dev/null &
  fi
  M=/tmp/tiny6-Q4_K.gguf
  [ -f $M ] || python3 -m ikjax.cli make-model -o $M --preset tiny --layers 6 --type Q4_K > /dev/null
  JAX_PLATFORMS=cpu timeout 100 python3 bench/ot_scan_check.py $M --save /tmp/tiny6_cpu.npy 2>&1 | grep rror
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/ot_scan_check.py $M --against /tmp/tiny6_cpu.npy --mibs 512 \
    --streams chunks 2>&1 | grep -E "^mib|^all-GPU|rror"
  RUNS64="16:scan 16:unroll" WARM64="${WARM66:-16:scan 16:unroll 16:scan 16:unroll}" STAGE=64 bash "$0" 2>&1 | grep -E "^\[|^rc|^\||compiled"
  ;;
67)
  # the kernels' float32 tile products (IEEE, not TF32) and the weight-first matrix-unit schedule: the GPU
  # kernel tests, the dot schedules' sweep at 1 and 8 rows, then (STAGE=14) profile8 per invariant form
  V2L=/tmp/v2lite-27L-Q4_0.gguf  # gpu_invariance.sh's and gpu_serve.sh's file
  [ -f $V2L ] || setsid nohup python3 -m ikjax.cli make-model -o $V2L --preset v2-lite --type Q4_0 > /tmp/v2l.log 2>&1 < /dev/null &
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_kernel_precision.py tests/test_kernels_quant_matmul.py \
    tests/test_prompt_attention.py tests/test_kernels_mla.py -k "${GPU_TESTS67:-precision or invariant or real_size or compiled}" 2>&1 | tail -4
  for rows in ${ROWS67:-1 8}; do
    el "dot schedules, $rows rows"
    PYTHONPATH=$PWD timeout 200 python3 bench/gpu_gemv_tune.py --form dot --rows $rows --budget ${TUNE67:-80} \
      --out "$OUT" 2>&1 | grep -v Warning | grep -E "invariant_config|rows form|^\\|.*\\| [0-9.]+ \\| [0-9]+ \\|$" | head -60
  done
  while [ ! -f $V2L ] || pgrep -f "make-model -o $V2L" > /dev/null; do sleep 3; done
  [ -n "${FORMS67:-}" ] && FORMS="$FORMS67" NO_SERVE14=1 STAGE=14 GPU_TESTS="none_at_all" bash "$0" 2>&1 | grep -E "wall|ready|rc=|^\\["
  ;;
69)
  # the float32 kernels' GPU test with its failure shown, the invariant schedule's bit-for-bit test, then issue
  # 22's deep shape cold under the stack sampler, cold, warm (STAGE=21 with SB21)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_kernel_precision.py tests/test_kernels_quant_matmul.py \
    -k "precision or invariant_rows" 2>&1 | grep -E "^E |Error|passed|failed" | head -30
  SB21="${SB69:--c 16384 -ub 2048 -n 128}" STAGE=21 NO_TABLE=1 COLD_TIMELINE=1 COLD21=default WARM21=default \
    COLD_TL_LINES=${TL69:-90} TL_LINES=40 bash "$0" 2>&1 | grep -v "installed\|ik build\|H200, \|cores;"
  ;;
70)
  # the float32 kernels' GPU test, then serve's load rows per invariant form (STAGE=14's serve part)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_kernel_precision.py 2>&1 \
    | grep -E "^E |Error|passed|failed" | head -20
  FORMS="${FORMS70:-rows dot}" STAGE=14 GPU_TESTS="none_at_all" bash "$0" 2>&1 | grep -E "^\\||up in|^\\["
  ;;
71)
  # issue 22's targets as a user times them: each SHAPES71 cold (fresh cache) then warm, every stdout line
  # stamped with the seconds since the command started (the first row's line is the first-row time)
  v2l_ready
  stamp() { python3 -c "
import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    print(f'{time.time() - t0:7.2f}s {line}', end='', flush=True)" "$1"; }
  for shape in "${SHAPE71A:--c 16384 -ub 2048 -n 128}" "${SHAPE71B:--c 4096 -ub 512 -n 64}"; do
    rm -rf /tmp/cc71
    for run in cold warm; do
      t0=$(date +%s.%N)
      IKJAX_COMPILE_CACHE=/tmp/cc71 timeout 100 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 $shape 2> /tmp/e71 \
        | stamp $t0 | grep -E "\\|  +[0-9]" | sed -n "1,2p;\$p"
      echo "$shape $run: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s command to end; $(grep -E "compiled" /tmp/e71 | sed 's/(.tmp[^)]*)//')"
    done
  done
  ;;
73)
  # issue 22 then 25 on an nvidia-h200-x2 lease, call 1: the deep first row cold on GPU 0 with the start of
  # this commit against the one before it (bench/early_start_ab.py new / old, alternating, a fresh cache each,
  # after one discarded cold run: a fresh machine's first model process is 2.3 s slower, RESULTS §22ab);
  # then the R1 file (R1_LAYERS, 7) written in the background and the V2-Lite table's runs on 2 GPUs
  v2l_ready
  first_row_ab bench/early_start_ab.py "${AB73:-new old new old new old}" "${SHAPE73:--c 16384 -ub 2048 -n 128}" \
    $OUT/ab73.txt | tail -${AB73_LINES:-8}
  [ "${PARTS73:-}" = none ] && exit 0
  mkdir -p /tmp/mg; ln -sf $V2L /tmp/mg/v2l.gguf; printf %s "--preset v2-lite --type Q4_0" > /tmp/mg/v2l.args
  R1ARGS="--preset r1 --layers ${R1_LAYERS:-7} --type Q4_0"
  if [ ! -f /tmp/mg/r1.gguf ] && [ ! -f /tmp/mg/r1.started ]; then
    touch /tmp/mg/r1.started
    setsid nohup bash -c "python3 -m ikjax.cli make-model -o /tmp/mg/r1.tmp.gguf $R1ARGS > /tmp/mg/r1.log 2>&1 \
      && printf %s '$R1ARGS' > /tmp/mg/r1.args && mv /tmp/mg/r1.tmp.gguf /tmp/mg/r1.gguf" > /dev/null 2>&1 < /dev/null &
  fi
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  OUT=$OUT/mg73 PARTS=${PARTS73:-"v2l_layer2 v2l_graph2"} DEADLINE=$left BUILD_CUDA=0 MG_NO_INSTALL=1 MG_WORK=/tmp/mg \
    bash bench/multi_gpu.sh 2>&1 | tail -24
  ls -la /tmp/mg; tail -1 /tmp/mg/r1.log
  ;;
75)
  # HEAD's health on one GPU: every gpu-marked test file (no fixtures carried: those tests skip, saying so),
  # then issue 22's deep shape (SHAPE75) cold with its first row time-stamped, then warm (same cache)
  v2l_ready
  # (test_hybrid_gpu.py alone runs past 300 s: its own call, TESTFILES75=tests/test_hybrid_gpu.py TESTS75_S=560)
  timeout ${TESTS75_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 -rs ${TESTFILES75:-tests/test_decode_gpu.py \
    tests/test_kernels_quant_matmul.py tests/test_kernels_moe.py tests/test_kernels_mla.py tests/test_prompt_attention.py \
    tests/test_kernel_precision.py tests/test_norm_linear.py} 2>&1 | tee $OUT/tests75.txt \
    | grep -E "passed|failed|^FAILED|^ERROR|SKIPPED" | head -30
  [ "${PARTS75:-}" = tests ] && exit 0
  cold_warm_sweep "${SHAPE75:--c 16384 -ub 2048 -n 128}" 2>&1 | tee $OUT/health75.txt
  ;;
76)
  # the RMSNorm folded into the decode products (IKJAX_FOLD_NORM, stop 61): its GPU tests and the decode
  # tests (the model file written meanwhile), then issue 22's deep shape (SHAPE76) with the fold on / off
  # alternating in one cache (each form's cold run first), then the decode token's kernels both ways
  # (bench/gpu_decode_profile.py, command buffers off: every kernel in the profile)
  v2l_ready > /dev/null 2>&1 &
  timeout ${TESTS76_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 -rs tests/test_norm_linear.py \
    tests/test_decode_gpu.py tests/test_kernels_quant_matmul.py 2>&1 | tee $OUT/tests76.txt \
    | grep -E "passed|failed|^FAILED|^ERROR|SKIPPED|Error" | head -20
  wait; v2l_ready
  rm -rf /tmp/cc76
  for v in ${FOLDS76:-1 0 1 0 1 0}; do
    t0=$(date +%s.%N)
    IKJAX_FOLD_NORM=$v IKJAX_COMPILE_CACHE=/tmp/cc76 CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m ikjax.cli sweep-bench -m $V2L \
      -mla 3 -fa 1 ${SHAPE76:--c 16384 -ub 2048 -n 128} 2> /tmp/e76 | while read -r line; do
      case "$line" in "|  "[0-9]*) echo "fold=$v $line";; esac; done
    echo "   fold=$v end $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s; $(grep -E "compiled" /tmp/e76 | sed 's/(.tmp[^)]*)//' | tr '\n' ' ')"
  done 2>&1 | tee $OUT/fold76.txt
  for v in ${PROF76:-1 0}; do
    IKJAX_FOLD_NORM=$v IKJAX_COMPILE_CACHE=/tmp/cc76p timeout 150 env DPROF_NO_CMDBUF=1 python3 bench/gpu_decode_profile.py $V2L \
      --top ${TOP76:-14} 2>&1 | grep -v Warn | tee $OUT/dprof76-$v.txt | head -${HEAD76:-30}
  done
  ;;
77)
  # the decode step's optimized HLO with the norms folded (bench/gpu_decode_hlo.py: what each layer
  # still launches), then STAGE=75 (HEAD's health: the gpu-marked tests, the deep shape cold / warm)
  v2l_ready
  timeout 150 python3 bench/gpu_decode_hlo.py --model $V2L --out $OUT 2>&1 | grep -v Warn | head -${HEAD77:-60}
  STAGE=75 bash bench/lease_x4.sh 2>&1 | grep -v "installed\|ik build\|stage 75 done"
  ;;
78)
  # issue 22's deep first row on the 16-core host, where its 5 s of compile go now (stop 62): a throwaway
  # cold run first (a fresh machine's first model process pays the binaries' first reads), then the two
  # first-row steps each compiled alone under jax.profiler (trace + lower against XLA, XLA's events),
  # the decode loop's trace + lower under cProfile, then the cold run under the stack sampler (STAGE=69's)
  v2l_ready
  throwaway_run
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 150 python3 bench/gpu_compile_profile.py $V2L --ctx 16384 --ubatch 2048 --tg 128 \
    --top ${TOP78:-24} --steps 0,1 2>&1 | grep -v Warning | tee $OUT/prof78.txt | head -${HEAD78:-80}
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 150 python3 bench/gpu_compile_profile.py $V2L --ctx 16384 --ubatch 2048 --tg 128 \
    --cprofile --top ${TOP78C:-30} --steps ${CSTEPS78:-0,1} 2>&1 | grep -v Warning | tee $OUT/cprof78.txt | head -${HEADC78:-150}
  t0=$(date +%s.%N)
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 100 python3 bench/warm_timeline.py --min-ms 50 -- sweep-bench -m $V2L -mla 3 -fa 1 \
    -c 16384 -ub 2048 -n 128 > /dev/null 2> "$OUT/cold_timeline78.txt"
  echo "cold under the sampler: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s"
  grep -v "^|" "$OUT/cold_timeline78.txt" | grep -v Warn | grep -v "^  \[" | head -${TL78:-90}
  ;;
79)
  # the RMSNorm folded into the batch-invariant row form (serve's decode, stop 62), call 1: its GPU tests, then
  # the in-process probe per IKJAX_FOLD_NORM (greedy scheduler answers against generate, a batched row's
  # logits against alone, the invariant step's GPU time at [1,1] / [8,1]: bench/gpu_batch_invariance.py)
  timeout ${TESTS79_S:-220} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 -rs tests/test_norm_linear.py \
    tests/test_kernels_quant_matmul.py -k "${TESTK79:-norm or invariant or live_rows}" 2>&1 | tee $OUT/tests79.txt \
    | grep -E "passed|failed|^FAILED|^ERROR|SKIPPED|Error" | head -20
  for fold in ${FOLDS79:-1 0}; do
    el "invariant probe, IKJAX_FOLD_NORM=$fold"
    OUT=$OUT/inv-f$fold STAGES=inv1 PARTS1=${PARTS79:-greedy,logits,profile8} IKJAX_FOLD_NORM=$fold timeout 250 \
      bash bench/gpu_invariance.sh 2>&1 | grep -vE "Warning|^ *$" | tail -${TAIL79:-18}
  done
  ;;
104)
  # HEAD's health after stop 71's GPU changes (rows-first schedule, capped prompt-step blocks, 16-row expert
  # tiles, 64/256/ub prompt steps): the gpu-marked tests (STAGE=75's files), then issue 22's two shapes cold
  # and warm, each line time-stamped from the command's start (a discarded cold run first: the page cache)
  PARTS75=tests STAGE=75 bash "$0" 2>&1 | grep -v "installed\|ik build\|stage 75 done"
  v2l_ready
  throwaway_run
  el "deep shape"; cold_warm_sweep "-c 16384 -ub 2048 -n 128"
  el "shallow shape"; cold_warm_sweep "-c 4096 -ub 512 -n 64"
  ;;
100)
  # the rows schedule launched row tiles first (pallas_kernels.quant_matmul.kernel.ROWS_FIRST, §23ao) against column
  # tiles first (ROWS_GRID=columns): its GPU bit-for-bit test, the invariant step's GPU time (profile8) each way, then
  # serve's load rows (STAGE=99's variants: prompt steps of 64 / 256 / 512 tokens against 64 / 512, BUCKETS=two)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 tests/test_kernels_quant_matmul.py \
    -k "${TESTS100:-rows_schedule_bit_for_bit}" 2>&1 | grep -E "^E |Error|passed|failed" | head -12
  for grid in ${GRIDS100:-rows columns}; do
    el "profile8, grid $grid"
    OUT=$OUT/inv-$grid STAGES=inv1 PARTS1=profile8 ROWS_GRID=$grid IKJAX_COMPILE_CACHE=/tmp/xla-$grid \
      timeout 200 bash bench/gpu_invariance.sh > /dev/null 2>&1
    grep -E -A${KERNELS100:-6} "wall" $OUT/inv-$grid/probe-inv1.txt | grep -v "^--" | cut -c1-110
  done
  [ -n "${NO_SERVE100:-}" ] && exit 0
  VARIANTS99="${VARIANTS100:-sizes3|ROWS_GRID=rows IKJAX_COMPILE_CACHE=/tmp/xla-rows;sizes2|ROWS_GRID=rows BUCKETS=two IKJAX_COMPILE_CACHE=/tmp/xla-rows}" \
    STAGE=99 bash "$0" 2>&1 | grep -v "installed\|ik build\|H200, \|cores;\|ml_dtypes"
  ;;
101)
  # a first prompt's step at each GPU prompt size (64 / 256 / 512 tokens at -ub 512), every kernel's GPU time
  OUT=$OUT/prompt STAGES=inv1 PARTS1=${PARTS101:-greedy,profileprompt} timeout 400 bash bench/gpu_invariance.sh > /dev/null 2>&1
  grep -vE "Warning|^ *$|ms  x|wall" $OUT/prompt/probe-inv1.txt | head -24  # the greedy part's lines
  grep -E -A${KERNELS101:-14} "wall" $OUT/prompt/probe-inv1.txt | grep -v "^--" | cut -c1-120
  ;;
103)
  # the short prompt steps after §23ao's fixes (blocks of GPU_LIVE_ROWS, 16-row expert tiles): their costliest
  # kernels (STAGE=102 in serve's mode), then the scheduler's greedy answers against generate's (STAGE=101's part)
  TOKENS102=${TOKENS103:-64,256} STAGE=102 bash "$0" 2>&1 | grep -E "^==|ms  x" | grep -v "with_exit"
  PARTS101=greedy STAGE=101 bash "$0" 2>&1 | grep -E "prompt|greedy"
  ;;
102)
  # the GPU prompt steps' most expensive XLA kernels and what they compute (bench/gpu_fusion_show.py), in serve's
  # batch-invariant mode at 64 / 256 tokens and without it at 64
  v2l_ready
  V2L=/tmp/v2l-Q4_0.gguf
  IKJAX_COMPILE_CACHE=off IKJAX_BATCH_INVARIANT=1 timeout 200 python3 bench/gpu_fusion_show.py $V2L --tokens ${TOKENS102:-64,256} \
    2>&1 | grep -v Warning | cut -c1-700
  [ -n "${TOKENS102:-}" ] || IKJAX_COMPILE_CACHE=off IKJAX_BATCH_INVARIANT=0 timeout 150 python3 bench/gpu_fusion_show.py \
    $V2L --tokens 64 2>&1 | grep -v Warning | cut -c1-700
  ;;
99)
  # serve's load rows (1 and 8 streams, bench/gpu_serve.sh LOAD_ONLY=1) per variant "TAG|ENV ..." (IKJAX_SERVE_AHEAD:
  # the next decode dispatch queued before the host reads the last one's tokens), alternating; each trace summarized
  IFS=';' read -ra V99 <<< "${VARIANTS99:-ahead|IKJAX_SERVE_AHEAD=1;sync|IKJAX_SERVE_AHEAD=0;ahead|IKJAX_SERVE_AHEAD=1;sync|IKJAX_SERVE_AHEAD=0}"
  i=0
  for v in "${V99[@]}"; do
    tag=${v%%|*}; envs=${v#*|}; i=$((i + 1))
    el "serve load rows: $tag ($envs)"
    env $envs OUT=$OUT/serve-$i-$tag LOAD_ONLY=1 timeout 200 bash bench/gpu_serve.sh 2>&1 | grep -E "^\||up in"
    python3 bench/serve_trace.py $OUT/serve-$i-$tag/trace-auto.jsonl 2>&1 | head -2
  done
  ;;
80)
  # call 2: serve's load rows (1 and 8 streams, bench/gpu_serve.sh LOAD_ONLY=1) per IKJAX_FOLD_NORM, alternating
  for fold in ${FOLDS80:-1 0 1 0}; do
    el "serve load rows, IKJAX_FOLD_NORM=$fold"
    OUT=$OUT/serve-f$fold LOAD_ONLY=1 IKJAX_FOLD_NORM=$fold timeout 200 bash bench/gpu_serve.sh 2>&1 | grep -E "^\||up in"
  done
  ;;
94)
  # HEAD's health at the end of stop 65 (STAGE=75: the gpu-marked tests, the deep shape cold / warm), then
  # Engine.close on a GPU: the device memory in use before, loaded, after close (bench/close_probe.py)
  STAGE=75 bash bench/lease_x4.sh 2>&1 | grep -v "installed\|ik build\|stage 75 done"
  v2l_ready
  timeout 120 python3 bench/close_probe.py $V2L 2>&1 | grep -v Warn | tail -5
  ;;
93)
  # issue 22 (stop 65): the decode loop's XLA option checked before its lowering (old-check: after it, a trivial
  # compile between the decode loop's lowering and its compile, §22am) and the load's programs ahead on 8 threads
  # (old-threads: 4); the deep first row cold, alternating after a discarded run, then one cold timeline
  v2l_ready
  throwaway_run
  first_row_ab bench/first_row_forms.py "${AB93:-old-check new old-check new old-check new}" "-c 16384 -ub 2048 -n 128" $OUT/ab93.txt
  [ "${AB93T-x}" = "" ] || first_row_ab bench/first_row_forms.py "${AB93T:-old-threads new old-threads new}" \
    "-c 16384 -ub 2048 -n 128" $OUT/ab93t.txt
  cold_timeline 93 ${TL93:-1} ${TLH93:-45}
  ;;
92)
  # issue 22 (stop 65): which kernel modules the first row's two steps compile longest (each step alone, XLA's trace
  # events with their modules' names: --longest), to pick the kernels whose compile to shorten; then the deep first
  # row cold at HEAD on this lease's host (its speed: hosts differ by ~1.3x, RESULTS §22al)
  v2l_ready
  throwaway_run
  for s in ${STEPS92:-1 0}; do
    IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 120 python3 bench/gpu_compile_profile.py $V2L --ctx 16384 --ubatch 2048 --tg 128 \
      --top ${TOP92:-30} --longest ${LONG92:-40} --steps $s 2>&1 | grep -v Warning > $OUT/prof92-$s.txt
    head -${HEAD92:-80} $OUT/prof92-$s.txt
  done
  cold_timeline 92 ${TL92:-2} ${TLH92:-70}  # the prompt step lowered first (§22al's was the old order)
  [ "${AB92-x}" = "" ] || first_row_ab bench/first_row_forms.py "${AB92:-new new}" "-c 16384 -ub 2048 -n 128" $OUT/ab92.txt
  ;;
91)
  # issue 22 (stop 64): STAGE=90's A/B again, each pair the other way round (new first), at both shapes
  v2l_ready
  throwaway_run
  first_row_ab bench/first_row_forms.py "${AB91:-new old-order new old-order new old-order}" "-c 16384 -ub 2048 -n 128" $OUT/ab91.txt
  [ "${AB91S-x}" = "" ] || first_row_ab bench/first_row_forms.py "${AB91S:-new old-order new old-order new old-order}" \
    "-c 4096 -ub 512 -n 64" $OUT/ab91s.txt
  # XLA's own LLVM passes lighter (the prompt step's kernel modules took 6.5 CPU-s of LLVM, §22ai): first row and
  # the row's S_PP / S_TG; then the prompt step's compile alone under jax.profiler, its events by name
  export AB_FORMS="lite=XLA_FLAGS=--xla_llvm_disable_expensive_passes=true"
  first_row_ab bench/first_row_forms.py "${AB91L:-lite new lite new}" "-c 16384 -ub 2048 -n 128" $OUT/ab91l.txt
  [ -n "${NO_PROF91:-}" ] || { IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 120 python3 bench/gpu_compile_profile.py $V2L --ctx 16384 \
    --ubatch 2048 --tg 128 --top ${TOP91:-45} --steps 1 2>&1 | grep -v Warning > $OUT/prof91.txt; head -${HEAD91:-70} $OUT/prof91.txt; }
  ;;
90)
  # issue 22 (stop 64): sweep-bench's first-row steps lower in a set order, the prompt step first (its XLA compile is
  # the longest: §22al's timeline); the first row cold A/B against the decode loop first (old-order) at the deep
  # shape and at the issue's -c 4096 -ub 512 -n 64, then the deep sweep cold and warm
  v2l_ready
  throwaway_run
  first_row_ab bench/first_row_forms.py "${AB90:-old-order new old-order new old-order new}" "-c 16384 -ub 2048 -n 128" $OUT/ab90.txt
  first_row_ab bench/first_row_forms.py "${AB90S:-old-order new old-order new}" "-c 4096 -ub 512 -n 64" $OUT/ab90s.txt
  cold_warm_sweep "-c 16384 -ub 2048 -n 128"
  ;;
89)
  # issue 22 (stop 64): the deep first row's cold timeline, phase by phase: the main thread's engine start, the
  # dry load and the load's programs ahead, who holds the lowering lock (bench/lowering_timeline.py, run as the
  # console script), then every thread's stack sampled (bench/warm_timeline.py), after a throwaway run
  v2l_ready
  throwaway_run
  for k in 1 2; do
    IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 100 python3 bench/lowering_timeline.py sweep-bench -m $V2L -mla 3 -fa 1 \
      -c 16384 -ub 2048 -n 128 > /dev/null 2> "$OUT/lock_timeline89-$k.txt"
    sed -n '/# lowering timeline/,$p' "$OUT/lock_timeline89-$k.txt" | head -${TL89:-80}
  done
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 100 python3 bench/warm_timeline.py --min-ms ${MINMS89:-30} -- sweep-bench -m $V2L \
    -mla 3 -fa 1 -c 16384 -ub 2048 -n 128 > /dev/null 2> "$OUT/cold_timeline89.txt"
  grep -v "^|" "$OUT/cold_timeline89.txt" | grep -v Warn | grep -v "^  \[" | head -${TLS89:-120}
  ;;
88)
  # issue 22 (stop 64): each accelerator's first allocation (XLA's memory reserve, 1.5-1.8 s on an H200:
  # bench/backend_start_probe.py) made on the early backend thread, beside the imports: the deep first row cold,
  # A/B against the thread making the devices only (IKJAX_EARLY_BACKEND=devices, before), then the deep sweep
  # cold and warm as a user runs it. Run at 6577400 (RESULTS §22ak: no gain, the load's thread had paid the
  # reserve beside the compile; the change was taken back, so `devices` is no value of IKJAX_EARLY_BACKEND since)
  v2l_ready
  throwaway_run
  export DISCARD_FORM=new AB_FORMS="new=;devices=IKJAX_EARLY_BACKEND=devices"
  first_row_ab bench/first_row_forms.py "${AB88:-devices new devices new devices new}" "${SHAPE88:--c 16384 -ub 2048 -n 128}" \
    $OUT/ab88.txt
  cold_warm_sweep "${SHAPE88:--c 16384 -ub 2048 -n 128}"
  ;;
87)
  # issue 22 (stop 63): the load on shapes alone records the groups' zeroed stacks and put (compiled ahead, off the
  # steps' lowering lock): which load programs the load still compiles itself; greedy text of the two forms; the
  # deep first row cold, A/B (bench/first_row_forms.py new / old-stacks)
  v2l_ready
  throwaway_run
  load_probe 87
  greedy_same new old-stacks 87
  first_row_ab bench/first_row_forms.py "${AB87:-new old-stacks new old-stacks new old-stacks}" "${SHAPE87:--c 16384 -ub 2048 -n 128}" \
    $OUT/ab87.txt
  ;;
86)
  # issue 22 (stop 63): which load programs the cold load compiles itself (not ahead), and why their keys differ
  # from the recorded ones, after a throwaway run
  v2l_ready
  throwaway_run
  load_probe 86
  ;;
85)
  # issue 22 (stop 63): after one group per run of identical layers, the load is as long as the compile on the
  # deep first row. Does a put hold the GIL, do parallel puts add up (bench/gil_probe.py on the model file);
  # then the cold run under the stack sampler, every thread's timeline (STAGE=78's last part)
  v2l_ready
  timeout 100 python3 bench/gil_probe.py $V2L 2>&1 | grep -v Warn | tee $OUT/gil85.txt
  throwaway_run
  t0=$(date +%s.%N)
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 100 python3 bench/warm_timeline.py --min-ms ${MINMS85:-40} -- sweep-bench -m $V2L \
    -mla 3 -fa 1 -c 16384 -ub 2048 -n 128 > /dev/null 2> "$OUT/cold_timeline85.txt"
  echo "cold under the sampler: $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s"
  grep -v "^|" "$OUT/cold_timeline85.txt" | grep -v Warn | grep -v "^  \[" | head -${TL85:-140}
  ;;
84)
  # issue 22 (stop 63): one layer group per run of identical layers on the GPU (Pallas's offsets 64-bit past 2^31
  # elements; V2-Lite's MoE layers one group of 26, not 20 + 6): the gpu-marked kernel tests; greedy text of the
  # two forms compared (generate, 64 tokens); the deep first row cold, A/B (bench/first_row_forms.py new / old-groups); the new
  # form's whole sweep cold then warm (every row's S_PP / S_TG against the issue's)
  v2l_ready
  timeout ${TESTS84_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 -rs ${TESTFILES84:-tests/test_decode_gpu.py \
    tests/test_kernels_quant_matmul.py tests/test_kernels_moe.py tests/test_kernels_mla.py} 2>&1 | tee $OUT/tests84.txt \
    | grep -E "passed|failed|^FAILED|^ERROR|SKIPPED" | head -20
  greedy_same new old-groups 84
  first_row_ab bench/first_row_forms.py "${AB84:-new old-groups new old-groups new old-groups}" "${SHAPE84:--c 16384 -ub 2048 -n 128}" $OUT/ab84.txt
  cold_warm_sweep "${SHAPE84:--c 16384 -ub 2048 -n 128}"
  ;;
83)
  # issue 22 (stop 63): what XLA compiles for the deep first row's two steps (bench/gpu_hlo_census.py: fusions
  # by emitter, Pallas kernels by name and size, the optimized HLO saved), then the first row cold A/B over
  # XLA_FLAGS forms (bench/first_row_forms.py; AB_FORMS83 names them)
  v2l_ready
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 150 python3 bench/gpu_hlo_census.py $V2L --ctx 16384 --ubatch 2048 --tg 128 \
    --save $OUT/hlo83 2>&1 | grep -v Warning > $OUT/census83.txt; head -${HEAD83:-80} $OUT/census83.txt
  export DISCARD_FORM=base AB_FORMS=${AB_FORMS83:-"base=;nogemm=XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"}
  first_row_ab bench/first_row_forms.py "${AB83:-nogemm base nogemm base}" "${SHAPE83:--c 16384 -ub 2048 -n 128}" $OUT/ab83.txt
  ;;
82)
  # issue 22's deep first row on the 16-core host (stop 63): which single compile jobs are long (one long
  # ptxas / LLVM job is a serial floor of its step), each first-row step compiled alone under jax.profiler,
  # after a throwaway cold run; then the cold first row three times (a fresh cache each) as this lease's baseline
  v2l_ready
  throwaway_run
  IKJAX_COMPILE_CACHE=$(mktemp -d) timeout 150 python3 bench/gpu_compile_profile.py $V2L --ctx 16384 --ubatch 2048 --tg 128 \
    --top ${TOP82:-30} --longest ${LONG82:-40} --steps 0,1 2>&1 | grep -v Warning > $OUT/prof82.txt; head -${HEAD82:-150} $OUT/prof82.txt
  first_row_ab bench/first_row_forms.py "${AB82:-new new new}" "${SHAPE82:--c 16384 -ub 2048 -n 128}" $OUT/base82.txt
  ;;
81)
  # issue 22: the deep first row cold with pallas_kernels' Triton dialect registration (new) and without (old:
  # ~230 failed imports a kernel's lowering), alternating after a discarded run, a fresh cache each
  # (bench/first_row_forms.py new / old-triton), the first row's line time-stamped from the command's start; then the
  # quant_matmul / norm GPU tests
  v2l_ready
  first_row_ab bench/first_row_forms.py "${AB81:-new old-triton new old-triton new old-triton}" "${SHAPE81:--c 16384 -ub 2048 -n 128}" \
    $OUT/ab81.txt
  timeout ${TESTS81_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -n 0 -rs tests/test_norm_linear.py \
    tests/test_kernels_quant_matmul.py tests/test_decode_gpu.py 2>&1 | tee $OUT/tests81.txt \
    | grep -E "passed|failed|^FAILED|^ERROR|SKIPPED|Error" | head -20
  ;;
74)
  # call 2: the R1 file's split runs on 2 GPUs (PARTS74), nothing else on the host
  while [ ! -f /tmp/mg/r1.gguf ] && [ $(( $(date +%s) - T0 )) -lt 200 ]; do sleep 5; done
  ls -la /tmp/mg/r1.gguf || { tail /tmp/mg/r1.log; exit 1; }
  R1L=$(grep -o -- '--layers [0-9]*' /tmp/mg/r1.args | cut -d' ' -f2)
  left=$(( ${DEADLINE:-560} - ($(date +%s) - T0) ))
  OUT=$OUT/mg74 PARTS=${PARTS74:-"r1_layer2 r1_graph2"} DEADLINE=$left R1_LAYERS=${R1L:-7} BUILD_CUDA=0 MG_NO_INSTALL=1 \
    MG_WORK=/tmp/mg bash bench/multi_gpu.sh 2>&1 | tail -30
  ;;
72)
  # the load's programs compiled ahead (IKJAX_PROGRAMS_AHEAD) against the load compiling them, cold, alternating
  v2l_ready
  for a in ${AHEAD72:-1 0 1 0}; do
    rm -rf /tmp/cc72; t0=$(date +%s.%N)
    IKJAX_PROGRAMS_AHEAD=$a IKJAX_COMPILE_CACHE=/tmp/cc72 timeout 60 python3 -m ikjax.cli sweep-bench -m $V2L -mla 3 -fa 1 \
      ${SHAPE72:--c 16384 -ub 2048 -n 128} 2> /tmp/e72 | while read -r line; do case "$line" in "|  "[0-9]*)
      echo "first row at $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s"; break;; esac; done
    sleep 1
    echo "ahead=$a: $(grep -E "compiled|loaded" /tmp/e72 | sed 's/(.tmp[^)]*)//' | tr '\n' ' ')"
  done
  ;;
53)
  # the nested jits that come out as several jaxprs alike (bench/jaxpr_dedup_probe.py), two -ot runs in one cache
  M=/tmp/tiny4-Q4_K.gguf
  [ -f $M ] || python3 -m ikjax.cli make-model -o $M --preset tiny --layers 4 --type Q4_K > /dev/null
  export IKJAX_COMPILE_CACHE=/tmp/cc53_$$
  for run in 1 2; do
    el "dedup probe, -ot run $run"
    timeout 150 python3 bench/jaxpr_dedup_probe.py $M -c 512 -ub 256 -n 4 -ot exps=CPU -t 4 2>&1 | grep -E "^step|^    |compiled .* in all|rror" | cut -c1-700 | head -40
  done
  ;;
95)
  # issue 22, the scanned decode's loss after a step of T >= 2 (§22u, §22v): does XLA update or record
  # the decode's command buffers again on every token after such a step? XLA's command-buffer log
  # counted for the decode calls plain and after one 2-token step (VARIANTS95: "TAG|ENV|ARGS;..."),
  # and the wall a token with command buffers off both ways
  v2l_ready
  IFS=';' read -ra vs <<< "${VARIANTS95:-log-plain|LOG95=1|;log-step2|LOG95=1|--prefill --prefill-tokens 2;nocmd-plain|DPROF_NO_CMDBUF=1|;nocmd-step2|DPROF_NO_CMDBUF=1|--prefill --prefill-tokens 2}"
  for v in "${vs[@]}"; do
    tag=${v%%|*}; rest=${v#*|}; envs=${rest%%|*}; args=${rest#*|}
    echo "== $tag: ${envs:-(default env)} | ${args:-plain}"
    if [[ $envs == *LOG95=1* ]]; then
      env $envs TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE="command_buffer_thunk=3,command_buffer_cmd=2,command_executor=2,gpu_command_buffer=2,cuda_command_buffer=2,command_buffer_conversion_pass=2,while_thunk=2" \
        IKJAX_COMPILE_CACHE=/tmp/cc95 timeout 170 python3 bench/gpu_decode_profile.py $V2L --top 3 $args > /tmp/d95.out 2> /tmp/d95.err
      grep "a token wall" /tmp/d95.out; echo "log lines: $(wc -l < /tmp/d95.err)"
      grep -v Warn /tmp/d95.err | sed 's/^.*\] //' | sed -E 's/0x[0-9a-f]+|[0-9]+/N/g' | cut -c1-150 | sort | uniq -c | sort -rn | head -${TOP95:-18}
      cp /tmp/d95.err $OUT/log95-$tag.txt 2>/dev/null; gzip -f $OUT/log95-$tag.txt
    else
      env $envs IKJAX_COMPILE_CACHE=/tmp/cc95-$tag timeout 170 python3 bench/gpu_decode_profile.py $V2L --top 3 $args 2>&1 | grep -v Warn | head -${HEAD95:-1}
    fi
    el "done $tag"
  done
  ;;
96)
  # issue 22, §22aq: where the scanned decode's loss after a 2-token step lives: the weights' buffers
  # (copied after the step), the prompt step's loaded programs (dropped after it), the GPU's clocks
  # (sampled during each run); VARIANTS96 "TAG|ENV|ARGS;..."
  v2l_ready
  IFS=';' read -ra vs <<< "${VARIANTS96:-plain||;step2||--prefill --prefill-tokens 2;msoff-step2|XLA_FLAGS=--xla_gpu_disable_multi_streaming=true|--prefill --prefill-tokens 2;dsfoff-step2|XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false|--prefill --prefill-tokens 2;promptms-step512|DPROF_PROMPT_OPTIONS=xla_gpu_disable_multi_streaming=true|--prefill --prefill-tokens 512}"
  for v in "${vs[@]}"; do
    tag=${v%%|*}; rest=${v#*|}; envs=${rest%%|*}; args=${rest#*|}
    echo "== $tag: ${envs:-(default env)} | ${args:-plain}"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,pstate,temperature.gpu --format=csv,noheader -lms 200 > /tmp/smi96.txt 2>&1 &
    smi=$!
    env $envs IKJAX_COMPILE_CACHE=/tmp/cc96 timeout 170 python3 bench/gpu_decode_profile.py $V2L --top 3 $args 2>&1 | grep -v Warn | grep -B20 -m1 "a token wall"
    kill $smi 2>/dev/null
    echo "clocks (sm MHz, mem MHz, W, pstate, C) sampled while it ran, busiest 5: $(sort -t, -k3 -rn /tmp/smi96.txt | head -5 | tr '\n' ';')"
    el "done $tag"
  done
  ;;
97)
  # issue 22, §22aq: the custom calls and fusions a 2-token step holds that a one-token step does not
  # (bench/gpu_step_hlo_diff.py), then STAGE=96's decode variants (VARIANTS96)
  v2l_ready
  timeout 200 python3 bench/gpu_step_hlo_diff.py $V2L 2>&1 | grep -v Warn | tail -40
  el "hlo diff done"
  STAGE=96 bash bench/lease_x4.sh 2>&1 | grep -v "clocks (sm\|cuda limits\|installed\|ik build\|H200, \|cores;"
  ;;
98)
  # issue 22, §22as: which loaded neighbour program slows the scanned decode (bench/decode_neighbour_probe.py,
  # one process: plain, each neighbour held, then dropped), then the same with CUDA_MODULE_LOADING=EAGER
  v2l_ready
  for envs in ${ENVS98:-CUDA_MODULE_LOADING=LAZY CUDA_MODULE_LOADING=EAGER}; do
    echo "== $envs"
    env $envs IKJAX_COMPILE_CACHE=/tmp/cc98 timeout ${T98:-240} python3 bench/decode_neighbour_probe.py $V2L ${ARGS98:-} 2>&1 | grep -v Warn | tail -12
    el "done $envs"
  done
  ;;
esac
ikprog
el "stage $STAGE done"
tar -czf "/tmp/stage-$STAGE.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/stage-$STAGE.tgz" "$OUT/"
