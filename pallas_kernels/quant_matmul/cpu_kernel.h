// Quantized matmul kernels, declared for every instruction-set level (see cpu/isa.h).
#pragma once
#include <cstdint>

#include "cpu/isa.h"

// x [M, K] f32 row-major, w [N, row_bytes] GGUF blocks of `type`, y [M, N] f32.
IKJ_DECLARE(void, quant_matmul, (const float* x, const uint8_t* w, float* y, int64_t M, int64_t N,
                                 int64_t K, int64_t row_bytes, int type, int n_threads))
IKJ_DECLARE(bool, quant_matmul_supported, (int type))
