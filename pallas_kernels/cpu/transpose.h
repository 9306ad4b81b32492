// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, for the kernels that lay rows out as
// AMX tiles or VNNI panels (quant_matmul's panels, mla_decode's p rows). Included inside each
// level's namespace (IKJ_NS): the avx512 and amx levels compile it with their own flags.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace IKJ_NS {

// r[i] row i in; r[j] column j out (r[j] lane i = row i's lane j before).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // u[4g + c] holds, in 128-bit lane L, element 4L + c of rows 4g..4g+3
  for (int g = 0; g < 2; ++g)
    for (int c = 0; c < 4; ++c) {
      v[8 * g + c] = _mm512_shuffle_i32x4(u[8 * g + c], u[8 * g + 4 + c], 0x88);
      v[8 * g + 4 + c] = _mm512_shuffle_i32x4(u[8 * g + c], u[8 * g + 4 + c], 0xdd);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0xdd);
  }
}

}  // namespace IKJ_NS
#endif
