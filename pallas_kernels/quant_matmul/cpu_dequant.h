// Row dequantizers of the CPU kernels: GGUF blocks as stored -> float32, declared for every
// instruction-set level (see cpu/isa.h).
//
// Split over two sources so two people can work on them: cpu_kernel.cc handles the float and
// legacy block types (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and delegates every other
// type to dequant_row_kquants (cpu_kernel_kquants.cc: the K-quants and ik's types). The matmul
// engine only calls dequant_row; dequant_supported says which types it can take.
#pragma once
#include <cstdint>

#include "cpu/isa.h"

// Dequantize one row of K values (K a multiple of the type's block) of ggml type id `type` into
// out; false if this file does not handle the type. Implemented in cpu_kernel_kquants.cc.
// With K == 0 it touches nothing (row and out may be null) and only answers whether the type is
// handled: dequant_supported asks it that way.
IKJ_DECLARE(bool, dequant_row_kquants, (int type, const uint8_t* row, int64_t K, float* out))

// Dequantize one row of K values (K a multiple of the type's block) of ggml type id `type` into
// out; false if neither source handles the type. Implemented in cpu_kernel.cc.
IKJ_DECLARE(bool, dequant_row, (int type, const uint8_t* row, int64_t K, float* out))

// Whether dequant_row handles `type` (either source).
IKJ_DECLARE(bool, dequant_supported, (int type))
