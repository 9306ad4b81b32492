#!/usr/bin/env bash
# Issue 22 on one GPU: where a cold `sweep-bench -c 4096 -ub 512 -n 64` goes. JAX's start, the
# host->device bandwidth a load can reach (pageable NumPy, the page-cached model file), and the
# cold command under XLA flag variants (autotuning off, ...), each with a fresh compile cache and
# per-step compile lines; then the same command warm. Results: $OUT/cold.md
#   VARIANTS="default noautotune" bash bench/gpu_coldstart.sh
#   VARIANTS="default nooverlap noprefetch" bash bench/gpu_coldstart.sh   (issue 22 item 4's A/B)
#   PROFILE=1: first each step's compile alone under jax.profiler (bench/gpu_compile_profile.py)
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/cold_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
R=$OUT/cold.md
ikj() { python3 -m ikjax.cli "$@"; }
V2L=/tmp/v2l-Q4_0.gguf
t0=$(date +%s)
[ -f "$V2L" ] || ikj make-model -o "$V2L" --preset v2-lite --type Q4_0 > /dev/null || exit 1
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), jax $(python3 -c 'import jax; print(jax.__version__)'), make-model $(( $(date +%s) - t0 )) s" > "$R"
cat /tmp/v2l-Q4_0.gguf > /dev/null  # page cache, as a second run finds it

[ -z "${NO_PROBE:-}" ] && python3 - >> "$R" <<'EOF'   # NO_PROBE=1: no JAX start / bandwidth lines
import time
t0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
t1 = time.perf_counter(); jax.devices(); t2 = time.perf_counter()
print(f"import jax {t1 - t0:.2f} s, first jax.devices() {t2 - t1:.2f} s")
dev = jax.devices()[0]
a = np.random.default_rng(0).integers(0, 255, 1 << 30, dtype=np.uint8)
for _ in range(3):
    t = time.perf_counter(); jax.device_put(a, dev).block_until_ready(); dt = time.perf_counter() - t
print(f"device_put 1 GiB pageable NumPy: {1 / dt:.2f} GiB/s")
m = np.memmap("/tmp/v2l-Q4_0.gguf", np.uint8, mode="r")
n = min(len(m), 4 << 30)
t = time.perf_counter(); jax.device_put(np.asarray(m[:n]), dev).block_until_ready(); dt = time.perf_counter() - t
print(f"device_put {n / 2**30:.1f} GiB memmap slice (page cache): {n / 2**30 / dt:.2f} GiB/s")
chunks = [np.asarray(m[i:i + (256 << 20)]) for i in range(0, n, 256 << 20)]
t = time.perf_counter(); xs = [jax.device_put(c, dev) for c in chunks]; jax.block_until_ready(xs); dt = time.perf_counter() - t
print(f"device_put {len(chunks)} x 256 MiB memmap chunks: {n / 2**30 / dt:.2f} GiB/s")
t = time.perf_counter(); b = np.empty(n, np.uint8); b[:] = m[:n]; dt = time.perf_counter() - t
print(f"memcpy page cache -> NumPy, one thread: {n / 2**30 / dt:.2f} GiB/s")
EOF

[ -n "${PROFILE:-}" ] && python3 bench/gpu_compile_profile.py "$V2L" --top 30 2>&1 | grep -v Warning >> "$R"

timed() {  # timed LABEL CMD...
  local label=$1; shift
  local t0 t1; t0=$(date +%s.%N)
  # each stdout line stamped with the seconds since the command started (the first row's time)
  "$@" 2> "$OUT/$label.err" | python3 -u -c 'import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    print(f"{time.time() - t0:7.2f} {line}", end="", flush=True)' "$t0" > "$OUT/$label.stamped"; local rc=${PIPESTATUS[0]}
  cut -c9- "$OUT/$label.stamped" > "$OUT/$label.out"
  t1=$(date +%s.%N)
  { echo "### $label: rc $rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s from command to end, first row at $(grep -m1 -E '^ *[0-9.]+ \| +[0-9]+ \| +[0-9]+ \| +0 \|' "$OUT/$label.stamped" | awk '{print $1}') s"
    grep '^|' "$OUT/$label.out" | head -4; grep -h 'compiled\|sweep took\|loaded\|Error' "$OUT/$label.err" | head -12; echo; } >> "$R"
}
SB="-m $V2L -mla 3 -fa 1 ${SHAPE:--c 4096 -ub 512 -n 64}"   # SHAPE="-c 16384 -ub 2048 -n 32": the deep shape
for v in ${VARIANTS:-default noautotune}; do
  envv="IKJAX_LAYERS=auto"
  case $v in
    default) flags="" ;;
    xla) flags=""; envv="IKJAX_KERNELS=xla" ;;
    nooverlap) flags=""; envv="IKJAX_LOAD_OVERLAP=0" ;;    # the load before the compile (as before 6f1e339)
    noprefetch) flags=""; envv="IKJAX_PREFETCH=0" ;;
    scan) flags=""; envv="IKJAX_LAYERS=scan" ;;            # GPU decode scanned one layer an iteration
    halves) flags=""; envv="IKJAX_LAYERS=halves" ;;        # GPU decode in two halves of a group (before dd68929)
    before) flags=""; envv="IKJAX_COMPILE_AHEAD=before" ;;  # every step before the first row (before e6a3892)
    many) flags=""; envv="IKJAX_PROMPT_BUCKETS=many" ;;     # a prompt step per KV bucket (before ccd6438)
    kcache) flags="--xla_gpu_kernel_cache_file=/tmp/kc-$v.bin"; rm -f /tmp/kc-$v.bin ;;
    noautotune) flags="--xla_gpu_autotune_level=0" ;;
    notritongemm) flags="--xla_gpu_enable_triton_gemm=false" ;;
    both) flags="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" ;;
    tune1) flags=""; envv="IKJAX_GPU_AUTOTUNE=1" ;;    # XLA's autotuning on (the default before §22q)
    nvptxlib) flags="--xla_gpu_enable_libnvptxcompiler=true" ;;   # PTX -> CUBIN in process, not a ptxas per kernel
    par16) flags="--xla_gpu_force_compilation_parallelism=16" ;;
    unroll8) flags=""; envv="IKJAX_DECODE_UNROLL=8" ;;     # GPU decode: up to 8 layers an iteration
    unroll) flags=""; envv="IKJAX_LAYERS=unroll" ;;         # every layer unrolled (the form of the issue's commit)
    graphunroll) flags=""; envv="IKJAX_DECODE_GRAPH_UNROLL=1" ;;  # the decode graph's layer loops unrolled by XLA
    skiptemp) flags="--xla_gpu_command_buffer_update_mode=SKIP_TEMP" ;;  # stable addresses for graphs' temps (VMM allocator)
    neverupdate) flags="--xla_gpu_command_buffer_update_mode=NEVER_UPDATE" ;;  # the same, older XLA's name (all of a graph's buffers)
    vmmtemp) flags="--xla_gpu_command_buffer_update_mode=VMM_PERSISTENT_TEMP" ;;  # the same, another XLA's name
    graphunroll1) flags=""; envv="IKJAX_DECODE_GRAPH_UNROLL=1 IKJAX_DECODE_UNROLL=1" ;;
    g1skiptemp) flags="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"; envv="IKJAX_DECODE_GRAPH_UNROLL=1 IKJAX_DECODE_UNROLL=1" ;;  # one layer an iteration in the HLO (a quarter of the kernels to compile), the graph unrolled by XLA
    fusionoff) flags="--xla_gpu_experimental_enable_fusion_autotuner=false" ;;  # GEMMs still autotuned
    fusionpar) flags="--xla_gpu_experimental_enable_fusion_autotuner=false --xla_gpu_enable_llvm_module_compilation_parallelism=true" ;;
    noautopar) flags="--xla_gpu_autotune_level=0 --xla_gpu_enable_llvm_module_compilation_parallelism=true" ;;
    *) flags="$v" ;;
  esac
  XLA_FLAGS="$flags" python3 -c "import jax; jax.devices()" 2> "$OUT/flagcheck-$v.err" \
    || { echo "### $v: flags rejected: $(tail -1 "$OUT/flagcheck-$v.err")" >> "$R"; continue; }
  rm -rf /tmp/cc-$v
  # a subshell, not `env`: timed is a shell function, which env cannot run
  ( export $envv XLA_FLAGS="$flags" IKJAX_COMPILE_CACHE=/tmp/cc-$v
    JAX_LOG_COMPILES=1 timed "cold-$v" ikj sweep-bench $SB
    timed "warm-$v" ikj sweep-bench $SB )
  { echo "XLA compiles over 0.5 s ($v, cold), seconds:"; grep -h "Finished XLA compilation of" "$OUT/cold-$v.err" \
      | sed -E 's/.*compilation of ([^ ]*) in ([0-9.]+) sec.*/\2 \1/' | awk '$1 > 0.5' | sort -rn; echo; } >> "$R"
done
if [ -n "${SEQ:-}" ]; then  # each step alone, one after the other, in one process (fresh cache)
  rm -rf /tmp/cc-seq
  IKJAX_COMPILE_CACHE=/tmp/cc-seq python3 - "$V2L" >> "$R" 2>&1 <<'PYEOF'
import sys, time
import ikjax
from ikjax.tools import sweep_bench as sb
eng = ikjax.load(sys.argv[1], ctx=4096, ubatch=512, mla=3, flash_attn=True)
for kind, n, kv in sb._shapes(eng, 64, None, None, 1):
    t = time.perf_counter()
    eng.precompile_decode(1, 64, kv) if kind == "loop" else eng.precompile(1, n, kv)
    print(f"step {kind} T={n} kv={kv}: compiled alone in {time.perf_counter() - t:.2f} s")
PYEOF
fi
cat "$R"
