// Fused routed-experts FFN on the CPU, declared for every instruction-set level (see cpu/isa.h).
//
//   out[n] = sum_j weights[n, j] * down_e(silu(gate_e x_n) * up_e x_n),  e = ids[n, j]
//
// One call per MoE layer and step. Assignments (token, slot) are bucketed by expert, so each
// selected expert's gate/up/down rows are read once per call however many tokens picked it; the
// threads split every expert's output columns (F for gate/up, d for down) so both decode (1 token,
// a few experts) and prompt (hundreds of tokens, many experts) keep every thread busy and no two
// threads ever write the same output element. Assignments whose weight is exactly 0 (ik's smart
// expert reduction) are skipped: their expert is not read for that token.
#pragma once
#include <cstdint>

#include "cpu/isa.h"

// Arguments of one fused-experts call. Expert tensors are GGUF bytes as stored:
// gate/up [E, F, *_row_bytes] (rows of d values), down [E, d, down_row_bytes] (rows of F values).
struct MoeExpertsArgs {
  const float* x;          // [N, d]
  const float* weights;    // [N, k]
  const int32_t* ids;      // [N, k], each in [0, E) (checked by the caller)
  int64_t N, k, d, F, E;
  const uint8_t* gate; int64_t gate_row_bytes; int gate_type;
  const uint8_t* up; int64_t up_row_bytes; int up_type;
  const uint8_t* down; int64_t down_row_bytes; int down_type;
  float* out;              // [N, d]
  int n_threads;           // <= 0: every available core
  int compute;             // QmCompute (quant_matmul/cpu_kernel.h): QM_F32, or QM_BF16 as the model's
                           // dtype="bf16": x, h and the weights rounded to bf16, f32 accumulation
};

IKJ_DECLARE(void, moe_experts, (const MoeExpertsArgs& a))
