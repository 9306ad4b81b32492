#!/usr/bin/env bash
# Start building ik_llama.cpp (CUDA, sm_90, the host's own CPU level) in the background on the device
# machine, from the source snapshot carried in .whl/ikfull.tar.gz (fetched with the `fetch` tool;
# never committed). Built in /tmp/ikc; the log ends with BUILD_DONE <rc>. Collect it in a later call.
#   bash bench/gpu_ik_build.sh [JOBS]
set -u
J=${1:-14}
rm -rf /tmp/ikc && mkdir -p /tmp/ikc && tar -xzf .whl/ikfull.tar.gz -C /tmp/ikc || exit 1
cd /tmp/ikc
setsid nohup nice -n 10 bash -c "cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release > /tmp/ikc/build.log 2>&1 \
  && cmake --build build -j $J --target llama-server llama-sweep-bench >> /tmp/ikc/build.log 2>&1; echo BUILD_DONE \$? >> /tmp/ikc/build.log" \
  > /dev/null 2>&1 < /dev/null &
sleep 2; echo "ik build started in /tmp/ikc (log /tmp/ikc/build.log)"
