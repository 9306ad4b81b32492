#!/bin/bash
# bench/cpu_qmm_ab/build.sh A_DIR B_DIR [OUT]: the avx2 objects of A_DIR's and B_DIR's
# cpu_kernel.cc + cpu_kernel_kquants.cc (e.g. `git show REV:pallas_kernels/quant_matmul/cpu_kernel.cc`
# into a directory) as namespaces ikj_A / ikj_B, linked with ik_llama.cpp's libggml.so from
# $IK_DIR (default /tmp/ikfull: its sources' ggml/include and build/ggml/src) for IKB=1 runs.
set -e
here=$(cd "$(dirname "$0")" && pwd)
PK=$here/../../pallas_kernels
IK=${IK_DIR:-/tmp/ikfull}
out=${3:-$here/harness}
tmp=$(mktemp -d)
mkdir -p $tmp/inc/cpu
# IKJ_DECLARE also in ikj_A / ikj_B
# (after the namespace line of ikj_avx512: the last one, or followed by ikj_amx's)
sed 's/^\(  namespace ikj_avx512 { ret name params; }\)\( \\\)\{0,1\}$/\1 \\\n  namespace ikj_A { ret name params; } \\\n  namespace ikj_B { ret name params; }\2/' $PK/cpu/isa.h > $tmp/inc/cpu/isa.h
FL="-O3 -fno-math-errno -fno-trapping-math -mavx2 -mfma -mf16c -mbmi2 -std=c++17 -I$tmp/inc -I$PK -DIKJ_LEVEL_avx2=1"
g++ $FL -DIKJ_NS=ikj_A -c $1/cpu_kernel.cc -o $tmp/kA.o &
g++ $FL -DIKJ_NS=ikj_A -c $1/cpu_kernel_kquants.cc -o $tmp/kqA.o &
g++ $FL -DIKJ_NS=ikj_B -c $2/cpu_kernel.cc -o $tmp/kB.o &
g++ $FL -DIKJ_NS=ikj_B -c $2/cpu_kernel_kquants.cc -o $tmp/kqB.o &
g++ -O2 -std=c++17 -I$PK -c $PK/cpu/runtime.cc -o $tmp/rt.o &
g++ -O2 -std=c++17 -I$IK/ggml/include -c $here/harness.cc -o $tmp/h.o &
wait
g++ $tmp/h.o $tmp/kA.o $tmp/kqA.o $tmp/kB.o $tmp/kqB.o $tmp/rt.o -o $out -lpthread \
  -L$IK/build/ggml/src -lggml -Wl,-rpath,$IK/build/ggml/src
rm -rf $tmp
echo "built $out"
