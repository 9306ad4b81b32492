#!/usr/bin/env bash
# Issue 21: ikjax's sweep-bench and llama-bench tables beside ik_llama.cpp's, same file, same flags,
# on the device's CPU (ik built CPU-only in /tmp from a snapshot carried as .whl/ik.tar.gz, made
# with `git archive` of the fetched mirror; nothing of ik is committed here).
#   bash bench/ik_tools_ab.sh            (carry .whl: the gguf wheel and ik.tar.gz)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
python3 -m pip install -q --no-index --no-deps .whl/gguf-*.whl || exit 1
( python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/ikjax-install.log 2>&1 || echo "ikjax install failed" ) &
rm -rf /tmp/ik && mkdir -p /tmp/ik && tar -xzf .whl/ik.tar.gz -C /tmp/ik
mkdir -p /tmp/ik/pocs && : > /tmp/ik/pocs/CMakeLists.txt
printf 'add_subdirectory(llama-bench)\nadd_subdirectory(sweep-bench)\n' > /tmp/ik/examples/CMakeLists.txt
( cd /tmp/ik && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF > /tmp/ik-cmake.log 2>&1 \
  && cmake --build build -j 16 --target llama-bench llama-sweep-bench > /tmp/ik-build.log 2>&1 ) \
  || { tail -n 20 /tmp/ik-cmake.log /tmp/ik-build.log; exit 1; }
wait
M=/tmp/v2l4-Q8_0.gguf
python3 -m ikjax.cli make-model -o $M --preset v2-lite --layers 4 --type Q8_0 > /dev/null || exit 1
IK=/tmp/ik/build/bin
echo "=== ik llama-bench";   $IK/llama-bench -m $M -p 128 -n 16 -r 2 -t 16 -mla 3 -fa 1 2>/dev/null
echo "=== ikjax bench";      python3 -m ikjax.cli bench -m $M -p 128 -n 16 -r 2 -t 16 -mla 3 -fa 1 2>/dev/null
echo "=== ik llama-bench -o json";   $IK/llama-bench -m $M -p 128 -n 0 -r 1 -t 16 -o json 2>/dev/null | head -60
echo "=== ikjax bench -o json";      python3 -m ikjax.cli bench -m $M -p 128 -n 0 -r 1 -t 16 -o json 2>/dev/null | head -60
echo "=== ik sweep-bench -ub 256 -b 128"; $IK/llama-sweep-bench -m $M -c 1024 -ub 256 -b 128 -n 16 -t 16 -mla 3 -fa 1 2>/dev/null
echo "=== ikjax sweep-bench -ub 256 -b 128"; python3 -m ikjax.cli sweep-bench -m $M -c 1024 -ub 256 -b 128 -n 16 -t 16 -mla 3 -fa 1 2>/dev/null
echo "=== ik sweep-bench --sweep-memory"; $IK/llama-sweep-bench -m $M -c 512 -ub 128 -n 16 -t 16 --sweep-memory 2>/dev/null
echo "=== ikjax sweep-bench --sweep-memory"; python3 -m ikjax.cli sweep-bench -m $M -c 512 -ub 128 -n 16 -t 16 --sweep-memory 2>/dev/null
