// Quantized matmul kernels, declared for every instruction-set level (see cpu/isa.h).
//
// Two layers: `qgemm_tile` is the single-threaded core (a block of output columns for a block of
// activation rows) that other ops (the fused MoE) call from their own parallel regions;
// `quant_matmul` is the whole product, threaded over the pool. The `_ex` variants take a compute
// mode:
// - QM_F32: float activations and weights, f32 accumulation: matches the f32 reference to rounding,
//   at every level and size (the exact mode).
// - QM_BF16: the fast mode (the model's dtype="bf16"). What it computes depends on the type, the
//   size and the level:
//   - Decode-sized products (M < 4 rows) at the avx512 (VNNI vpdpbusd) and avx2 (vpmaddubsw) levels:
//     8-bit activations for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL: each x row quantized per block
//     of 32 (scale max|x| / 127, round to nearest) and int32 block dots scaled by the two block
//     scales, ~0.5 % of the result's norm for Gaussian x; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS
//     the same (int8 dot products on the super-blocks' quants). Other types, and every type at the
//     generic level, in f32.
//   - Prompt-sized Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL products (M >= 4) at the avx512 and avx2
//     levels: the same 8-bit activations (QM_Q8 below), int8 dot products on the weights' own quants
//     (Q4_1 / Q5_1's minimum times x's block sums in float); at avx2 Q4_K / Q5_K / IQ4_XS too. The
//     amx level is the avx512 one whose engine also takes Q4_K / Q5_K / IQ4_XS and multiplies
//     products of 16+ rows on AMX int8 tiles (cpu_amx.h), the same int32 sums.
//   - Other prompt-sized products: x and the dequantized W rounded to bf16, f32 accumulation
//     (AVX512_BF16 dot products where the CPU has them).
// - QM_Q8: internal to the packed API (never a caller's mode): what qgemm_packed_compute returns
//   for QM_BF16 where the int8 prompt engine applies; x then packed as 8-bit blocks.
// - QM_Q8K: the same pack with one x scale per 256 values (Q8_K's grouping): avx2 IQ4_XS, whose
//   block scales then go into the engine's vpmaddwd and its float work is once per super-block.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "cpu/isa.h"

enum QmCompute : int { QM_F32 = 0, QM_BF16 = 1, QM_Q8 = 2, QM_Q8K = 3 };

// Whether `type` (ggml type id) has a C++ path at this level.
IKJ_DECLARE(bool, quant_matmul_supported, (int type))

// y[m * ldy + n] = sum_k x[m * K + k] * W[n][k] for m in [0, M), n in [n0, n1).
// w points at row 0 of W ([N, row_bytes] GGUF blocks of `type`); x float32 [M, K] row-major.
// Single-threaded; scratch it needs is its own (thread-local).
IKJ_DECLARE(void, qgemm_tile, (const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                               int type, int64_t n0, int64_t n1, float* y, int64_t ldy))
IKJ_DECLARE(void, qgemm_tile_ex, (const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                                  int type, int64_t n0, int64_t n1, float* y, int64_t ldy, int compute))

// Many calls over the same prompt-sized x (the fused MoE's column blocks of gate, up and down): x
// packed once (qgemm_pack_x: bytes needed when out is null), then qgemm_tile_packed per block.
// Only for M >= qgemm_packed_min_rows(); smaller M goes through qgemm_tile_ex.
IKJ_DECLARE(int64_t, qgemm_packed_min_rows, ())
// The compute to pack x with and pass to qgemm_tile_packed for weights of `type` in mode `compute`
// (QM_Q8 for QM_BF16 where the int8 prompt engine takes the type; else `compute` itself).
IKJ_DECLARE(int, qgemm_packed_compute, (int type, int compute))
IKJ_DECLARE(size_t, qgemm_pack_x, (const float* x, int64_t M, int64_t K, int compute, void* out))
IKJ_DECLARE(void, qgemm_tile_packed, (const void* xp, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                                      int type, int64_t n0, int64_t n1, float* y, int64_t ldy, int compute))

// x [M, K] f32 row-major, w [N, row_bytes] GGUF blocks of `type`, y [M, N] f32; n_threads <= 0: all.
IKJ_DECLARE(void, quant_matmul, (const float* x, const uint8_t* w, float* y, int64_t M, int64_t N,
                                 int64_t K, int64_t row_bytes, int type, int n_threads))
// Test-only: y [M, N] (row-major) = the AMX int8 prompt engine (cpu_amx.h) on an exact scalar
// emulation of the tile instructions, with its portable x pack and panel builder; "" or why not
// (a type it does not take, a bad shape, a tile misuse the emulation caught). Any level runs it.
// bf16: the engine's bf16 form (cpu_amx.h) instead of its int8 one.
IKJ_DECLARE(std::string, qgemm_amx_emulated, (const float* x, int64_t M, int64_t K, const uint8_t* w,
                                              int64_t row_bytes, int type, int64_t N, float* y, bool bf16))

IKJ_DECLARE(void, quant_matmul_ex, (const float* x, const uint8_t* w, float* y, int64_t M, int64_t N,
                                    int64_t K, int64_t row_bytes, int type, int n_threads, int compute))
