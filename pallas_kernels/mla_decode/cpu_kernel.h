// Absorbed-MLA attention on the latent cache (CPU), declared for every instruction-set level.
//
// out[b, t, h, :v_dim] = softmax_k(scale * q[b,t,h,:D] . K[b,k,:D]) . K[b,k,:v_dim] over the keys
// k <= q_pos[b, t] (and k < S), with K the cache entries read as stored (f32 / f16 / bf16, or q8_0
// blocks of 32 int8 with one f16 or f32 scale) and converted to f32 once per key for all heads and
// query rows of a tile. Softmax in f32 with online rescaling (flash); the key range is split over
// threads when there are fewer (batch, query tile) pairs than threads (decode), and the partial
// (m, l, acc) merged by a log-sum-exp combine.
//
// The same kernel is standard (per-head) attention when K and V have a head axis (Hk == H, the
// `-mla 0/2/3` prompt steps' decompressed keys and values): K [B, S, H, W] and V [B, S, H, Wv]
// (float kinds only), each head's query rows against its own rows; then a work item is
// (batch, head, query tile, key range).
#pragma once
#include <cstdint>

#include "cpu/isa.h"

namespace ikj {

enum MlaCacheKind : int {
  MLA_F32 = 0,
  MLA_F16 = 1,
  MLA_BF16 = 2,
  MLA_Q8_0_F16D = 3,  // data int8 [B, S, nb, 32] + scales f16 [B, S, nb] (ikjax/model/cache.py)
  MLA_Q8_0_F32D = 4,  // same with f32 scales
};

struct MlaArgs {
  const float* q;          // [B, T, H, D]
  const void* cache;       // f32/f16/bf16 [B, S, W] or int8 [B, S, W/32, 32]
  const void* scales;      // q8_0 only: [B, S, W/32]
  const int32_t* q_pos;    // [B, T]: the query at position p sees keys 0..p
  float* out;              // [B, T, H, v_dim]
  int64_t B, T, H, D, S, W, v_dim;  // W: values per cache row (>= D; >= v_dim when V is in K's row)
  int kind;                // MlaCacheKind (of K, and of V when separate)
  int64_t Hk = 1;          // heads of K / V: 1 (one latent row for every head) or H (per head)
  const void* v = nullptr; // nullptr: V is the first v_dim values of K's row; else [B, S, Hk, Wv]
  int64_t Wv = 0;          // values per V row (>= v_dim) when v is given
  // bf16 queries [B, T, H, D] instead of q (with v given): K, V and p are taken at bf16 (K and V
  // rounded where stored wider, p before p·V), as the XLA form of bf16 attention does, and the
  // products run in bf16 (AVX512_BF16; exact products, f32 accumulation; other levels round alike
  // and multiply in f32)
  const uint16_t* q16 = nullptr;
  // K in two parts (the -mla 2/3 prompt's decompressed keys, no concatenated copy): the first D1
  // values of K's row (b, s, h) and the first D - D1 values of row (b, s) of k2 [B, S, W2], shared
  // by every head (the rope part); k2 of a float kind kind2. nullptr: K's row alone.
  const void* k2 = nullptr;
  int64_t D1 = 0, W2 = 0;
  int kind2 = 0;
  float scale;
  int n_threads;           // <= 0: all cores
};

}  // namespace ikj

IKJ_DECLARE(void, mla_attention, (const ikj::MlaArgs& args))
