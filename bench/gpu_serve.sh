#!/bin/bash
# On the GPU device machine (no network): `ikjax serve` under load (issue 23). Installs this
# checkout (the gguf and prometheus-client wheels carried in .whl/; aiohttp is in the device's
# Python), makes the synthetic V2-Lite shape (27 layers, Q4_0), serves it with -np 8, and runs
# bench/serve_load.py: load at concurrency 1 and 8, a 2048-token prompt arriving while 7 streams
# decode, a second turn over a 4000-token history against a 64-token prompt (--prompt-cache exact,
# then prefix); and checks the server's greedy answers against Engine.generate on this GPU.
#   OUT=/tmp/o bash bench/gpu_serve.sh [LAYERS]      (SKIP_IKJAX=1: only llama-server, when IK has a build)
#   MODEL=/tmp/r1-8.gguf EXTRA="-ot exps=CPU -t 16" NO_CHECK=1 bash bench/gpu_serve.sh   (issue 23's R1
#   rows: another file and flags for both servers; NO_CHECK: no greedy check, no expanded A/B;
#   REQS, MAXTOK, STREAM_TOKENS: shorter loads for a slower model; LOAD_ONLY=1: the load rows
#   alone, both servers; NO_EXPANDED=1: not the expanded short steps' A/B)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-serve-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
LAYERS=${1:-27}
NP=8; CTX=$((NP * 8192)); UB=512
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -m pip install -q --no-index --no-deps .whl/gguf-*.whl .whl/prometheus_client-*.whl || exit 1
"$PY" -c "import aiohttp; print('aiohttp', aiohttp.__version__)" || exit 1
t0=$(date +%s)
"$PY" -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; exit 1; }
echo "install: $(( $(date +%s) - t0 )) s"
M=${MODEL:-/tmp/v2lite-${LAYERS}L-Q4_0.gguf}
EXTRA=${EXTRA:-}
t0=$(date +%s)
[ -f "$M" ] || "$PY" -m ikjax.cli make-model --preset v2-lite --type Q4_0 --layers "$LAYERS" -o "$M" > /dev/null || exit 1
echo "make-model: $(( $(date +%s) - t0 )) s ($(du -h "$M" | cut -f1))"
export IKJAX_COMPILE_CACHE=${IKJAX_COMPILE_CACHE:-/tmp/ikjax-xla}
# the server and the checking engine share the GPU: neither may take XLA's default 75 %
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45

serve() {  # serve MODE [GIL switch interval, s]: start a server, wait until it listens
    t0=$(date +%s)
    IKJAX_SERVE_TRACE="$OUT/trace-$1.jsonl" "$PY" -c 'import os, runpy, sys
if os.environ.get("ROWS_GRID") == "columns":  # the rows schedule launch order before RESULTS 23ao
    import pallas_kernels.quant_matmul.kernel as qk
    qk.ROWS_FIRST = False
if os.environ.get("BUCKETS") == "two":  # the prompt steps of 64 and ubatch tokens only (before RESULTS 23ao)
    import ikjax.runtime.engine as e
    e.CHUNK_GROWTH = 1 << 30
if len(sys.argv) > 1 and sys.argv[1] != "-":
    sys.setswitchinterval(float(sys.argv[1]))
sys.argv = ["ikjax"] + sys.argv[2:]
runpy.run_module("ikjax.cli", run_name="__main__")' "${2:--}" serve -m "$M" -c $CTX -np $NP -ub $UB --port 8080 \
        --prompt-cache "$1" $EXTRA > /dev/null 2> "$OUT/serve-$1.log" &
    SERVER=$!
    for _ in $(seq 600); do
        grep -q "^listening on" "$OUT/serve-$1.log" && break
        kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/serve-$1.log"; exit 1; }
        sleep 0.5
    done
    echo "server ($1): up in $(( $(date +%s) - t0 )) s; $(grep warm-up "$OUT/serve-$1.log")"
}
load() { timeout 300 "$PY" bench/serve_load.py --url http://127.0.0.1:8080 "$@"; }

if [ -n "${QUICK:-}" ]; then  # only the interference: default GIL switch interval, then ${SWITCH:-0.0005} s
    serve exact
    load --mode interference --concurrency 7 --long-prompt 2048 --ubatch $UB --stream-tokens 1500
    kill -TERM $SERVER; wait $SERVER
    "$PY" bench/serve_trace.py "$OUT/trace-exact.jsonl" | tail -3
    [ "$QUICK" = one ] && exit 0
    serve exact "${SWITCH:-0.0005}"
    load --mode interference --concurrency 7 --long-prompt 2048 --ubatch $UB --stream-tokens 1500
    kill -TERM $SERVER; wait $SERVER
    "$PY" bench/serve_trace.py "$OUT/trace-exact.jsonl" | tail -3
    exit 0
fi
if [ -z "${SKIP_IKJAX:-}" ]; then
serve ${MODE1:-auto}
load --mode load --concurrency 1,8 --requests ${REQS:-16} --prompt-tokens 128 --max-tokens ${MAXTOK:-128} --json "$OUT/load.json"
if [ -z "${LOAD_ONLY:-}" ]; then   # LOAD_ONLY=1: the load rows only (llama-server's too)
load --mode interference --concurrency 7 --long-prompt 2048 --ubatch $UB --stream-tokens ${STREAM_TOKENS:-1500} \
    --json "$OUT/interference.json"
load --mode multiturn --history 4000 --json "$OUT/multiturn-${MODE1:-auto}.json"
# greedy answers equal generate on this GPU (an engine in this process with one slot's options)
[ -z "${NO_CHECK:-}" ] && IKJAX_BATCH_INVARIANT=1 timeout 300 "$PY" - "$M" $((CTX / NP)) $UB <<'EOF'  # the server's decode form (its default)
import json, sys, urllib.request
import numpy as np
import ikjax
path, ctx, ub = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = ikjax.load(path, ctx=ctx, ubatch=ub)
rng = np.random.default_rng(0)
same = 0
for n in (7, 300, 700, 1100):
    ids = [int(t) for t in rng.integers(100, eng.config.vocab_size, n)]
    req = urllib.request.Request("http://127.0.0.1:8080/completion", json.dumps(
        {"prompt": ids, "n_predict": 32, "temperature": 0, "return_tokens": True}).encode(),
        {"Content-Type": "application/json"})
    got = json.load(urllib.request.urlopen(req))["tokens"]
    want = list(eng.generate(ids, 32))
    same += got == want
    print(f"prompt {n}: server == generate: {got == want}" + ("" if got == want else f"\n  {got}\n  {want}"))
print(f"greedy equal: {same}/4")
EOF
kill -TERM $SERVER; wait $SERVER
"$PY" bench/serve_trace.py "$OUT/trace-${MODE1:-auto}.jsonl"   # the server's side of the interference
# the second turn's short steps in the expanded form they had before 5d09b7c (deepseek2.absorbed_pays)
if [ -z "${NO_CHECK:-}" ] && [ -z "${NO_EXPANDED:-}" ]; then
IKJAX_SHORT_STEPS=expanded serve ${MODE1:-auto}
load --mode multiturn --history 4000 --json "$OUT/multiturn-expanded.json"
kill -TERM $SERVER; wait $SERVER
fi
fi   # LOAD_ONLY
[ -n "${LOAD_ONLY:-}" ] && { kill -TERM $SERVER; wait $SERVER; }
grep -E "compiled|warm-up|Traceback|Error" "$OUT"/serve-*.log | head -20
fi
# llama-server beside it, same file, same loads (IK: an ik_llama.cpp CUDA build's bin/, bench/gpu_ik_build.sh)
IK=${IK:-/tmp/ikc/build/bin}
if [ -x "$IK/llama-server" ]; then
    t0=$(date +%s)
    "$IK/llama-server" -m "$M" -c $CTX -np $NP -cb -ub $UB -b 2048 -mla 3 -fa on -ngl 99 --port 8081 $EXTRA \
        > "$OUT/llama-server.log" 2>&1 &
    IKS=$!
    for _ in $(seq 600); do
        "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8081/health', timeout=2)" 2>/dev/null && break
        kill -0 $IKS 2>/dev/null || { tail -20 "$OUT/llama-server.log"; exit 1; }
        sleep 0.5
    done
    echo "llama-server: up in $(( $(date +%s) - t0 )) s"
    iload() { timeout 300 "$PY" bench/serve_load.py --url http://127.0.0.1:8081 "$@"; }
    iload --mode load --concurrency 1,8 --requests ${REQS:-16} --prompt-tokens 128 --max-tokens ${MAXTOK:-128} --json "$OUT/ik-load.json"
    if [ -z "${LOAD_ONLY:-}" ]; then
    iload --mode interference --concurrency 7 --long-prompt 2048 --ubatch $UB --stream-tokens ${STREAM_TOKENS:-1500} \
        --json "$OUT/ik-interference.json"
    iload --mode multiturn --history 4000 --json "$OUT/ik-multiturn.json"
    fi
    kill -TERM $IKS; wait $IKS
fi
