// Quantized matmul on the CPU, y[m, n] = sum_k x[m, k] * W[n, k], W read as stored GGUF blocks.
// Compiled once per instruction-set level (namespace IKJ_NS); see pallas_kernels/CMakeLists.txt.
//
// Two engines, both built on dequant_row (a weight row -> f32, SIMD per type):
// - decode (few activation rows): each weight row is dequantized once into an L1/L2-resident
//   buffer and dotted against every activation row; the product is bound by reading the weights,
//   so threads split N (and K when N is too small to keep every thread busy).
// - prompt (many rows): a panel of NR weight rows is dequantized once, transposed to [K][NR] and
//   swept by a register-blocked microkernel over all M rows (AVX-512: 8 rows x 32 columns of
//   accumulators in zmm registers); threads split the N panels. With compute = bf16 the panel is
//   stored as bf16 pairs and the microkernel uses _mm512_dpbf16_ps (x and W rounded to bf16,
//   f32 accumulation); levels without AVX512_BF16 round the same way and multiply in f32, which
//   is exact for bf16 products.
// With compute = bf16, decode-sized products of the legacy block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// IQ4_NL) at the avx512 (VNNI) and avx2 levels take a third path, as ik_llama.cpp does
// for token generation: x quantized to 8 bits per block of 32 and vpdpbusd (avx2: vpmaddubsw +
// vpmaddwd) per weight block (see "int8-activation decode" below); so do Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
// and IQ4_XS at both levels (avx512: decode_kq8, decode_kq2; avx2: decode_kqa). Every other
// decode-sized product is f32 in both modes. Prompt-sized products of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
// and IQ4_NL with compute = bf16 at the avx512 (VNNI) and avx2 levels take the int8 prompt engine
// instead of bf16 panels (see "int8 prompt engine" below); so do Q4_K, Q5_K and IQ4_XS (one scale
// per 32 weights) at every level that has the engine. The same x
// quantization everywhere (dx = max|x| / 127, round to nearest even, per block of 32).
#include "quant_matmul/cpu_kernel.h"
#include "quant_matmul/cpu_amx.h"
#include "quant_matmul/cpu_dequant.h"

#include "cpu/common.h"
#include "cpu/runtime.h"
#include "cpu/transpose.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <mutex>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace IKJ_NS {

namespace {

using ikj::bf16_to_f32;
using ikj::round_bf16;
using ikj::load_u16;

inline float f16(const uint8_t* p) {
#if defined(__F16C__)
  return _cvtsh_ss(load_u16(p));
#else
  return ikj::fp16_to_f32(load_u16(p));
#endif
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

const int8_t kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// ---- row dequantizers of the legacy block types ------------------------------------------------

void dq_f16(const uint8_t* row, int64_t K, float* out) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= K; k += 16)
    _mm512_storeu_ps(out + k, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k))));
#elif defined(__F16C__)
  for (; k + 8 <= K; k += 8)
    _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
#endif
  for (; k < K; ++k) out[k] = f16(row + 2 * k);
}

void dq_bf16(const uint8_t* row, int64_t K, float* out) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= K; k += 16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k)));
    _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#elif defined(__AVX2__)
  for (; k + 8 <= K; k += 8) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
    _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
#endif
  for (; k < K; ++k) out[k] = bf16_to_f32(load_u16(row + 2 * k));
}

void dq_q8_0(const uint8_t* row, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b, row += 34, out += 32) {
    const float d = f16(row);
    const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
#if defined(__AVX512F__)
    __m512 vd = _mm512_set1_ps(d);
    __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    _mm512_storeu_ps(out, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(q0)));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(q1)));
#elif defined(__AVX2__)
    __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) {
      __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(qi)));
    }
#else
    for (int i = 0; i < 32; ++i) out[i] = d * q[i];
#endif
  }
}

// Q4_0 / Q4_1 / IQ4_NL: 16 bytes of nibbles, value j in the low nibble of byte j, value j+16 in
// its high nibble. Q4_0: d * (q - 8); Q4_1: d * q + m; IQ4_NL: d * table[q].
template <int kind>  // 0 = Q4_0, 1 = Q4_1, 2 = IQ4_NL
void dq_q4(const uint8_t* row, int64_t nb, float* out) {
  constexpr int bs = kind == 1 ? 20 : 18;
  constexpr int qoff = kind == 1 ? 4 : 2;
#if defined(__AVX512F__)
  const __m512 table = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl))));
#elif defined(__AVX2__)
  const __m256 tlo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kIq4nl))));
  const __m256 thi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kIq4nl + 8))));
#endif
  for (int64_t b = 0; b < nb; ++b, row += bs, out += 32) {
    const float d = f16(row);
    const float m = kind == 1 ? f16(row + 2) : (kind == 0 ? -8.f * d : 0.f);
    const uint8_t* q = row + qoff;
#if defined(__AVX512F__)
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    __m512 vd = _mm512_set1_ps(d);
    if (kind == 2) {
      _mm512_storeu_ps(out, _mm512_mul_ps(vd, _mm512_permutexvar_ps(lo, table)));
      _mm512_storeu_ps(out + 16, _mm512_mul_ps(vd, _mm512_permutexvar_ps(hi, table)));
    } else {
      __m512 vm = _mm512_set1_ps(m);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(lo), vm));
      _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(hi), vm));
    }
#elif defined(__AVX2__)
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i nib[2] = {_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask)};
    __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 2; ++i) {
        __m256i qi = _mm256_cvtepu8_epi32(i == 0 ? nib[h] : _mm_srli_si128(nib[h], 8));
        __m256 v;
        if (kind == 2) {
          __m256 a = _mm256_permutevar8x32_ps(tlo, qi), c = _mm256_permutevar8x32_ps(thi, qi);
          v = _mm256_mul_ps(vd, _mm256_blendv_ps(a, c, _mm256_castsi256_ps(_mm256_slli_epi32(qi, 28))));
        } else {
          v = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(qi), vm);
        }
        _mm256_storeu_ps(out + 16 * h + 8 * i, v);
      }
    }
#else
    for (int j = 0; j < 16; ++j) {
      int lo = q[j] & 0x0f, hi = q[j] >> 4;
      if (kind == 2) {
        out[j] = d * kIq4nl[lo];
        out[j + 16] = d * kIq4nl[hi];
      } else {
        out[j] = d * lo + m;
        out[j + 16] = d * hi + m;
      }
    }
#endif
  }
}

// Q5_0 / Q5_1: d, (m,) 32 high bits qh (bit i for value i), 16 bytes of low nibbles as Q4.
template <int kind>  // 0 = Q5_0 (d * (q - 16)), 1 = Q5_1 (d * q + m)
void dq_q5(const uint8_t* row, int64_t nb, float* out) {
  constexpr int bs = kind == 1 ? 24 : 22;
  constexpr int hoff = kind == 1 ? 4 : 2;
  for (int64_t b = 0; b < nb; ++b, row += bs, out += 32) {
    const float d = f16(row);
    const float m = kind == 1 ? f16(row + 2) : -16.f * d;
    const uint32_t qh = load_u32(row + hoff);
    const uint8_t* q = row + hoff + 4;
#if defined(__AVX512F__)
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    const __m512i sixteen = _mm512_set1_epi32(16);
    lo = _mm512_mask_add_epi32(lo, static_cast<__mmask16>(qh & 0xffff), lo, sixteen);
    hi = _mm512_mask_add_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
    __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    _mm512_storeu_ps(out, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(lo), vm));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(hi), vm));
#elif defined(__AVX2__)
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i nib[2] = {_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask)};
    __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i vqh = _mm256_set1_epi32(static_cast<int>(qh));
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 2; ++i) {
        __m256i qi = _mm256_cvtepu8_epi32(i == 0 ? nib[h] : _mm_srli_si128(nib[h], 8));
        __m256i sh = _mm256_add_epi32(shifts, _mm256_set1_epi32(16 * h + 8 * i));
        __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(vqh, sh), _mm256_set1_epi32(1));
        qi = _mm256_or_si256(qi, _mm256_slli_epi32(bit, 4));
        _mm256_storeu_ps(out + 16 * h + 8 * i, _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(qi), vm));
      }
    }
#else
    for (int j = 0; j < 16; ++j) {
      int lo = (q[j] & 0x0f) | (((qh >> j) & 1) << 4);
      int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      out[j] = d * lo + m;
      out[j + 16] = d * hi + m;
    }
#endif
  }
}

bool own_type(int type) {
  switch (type) {
    case ikj::T_F32: case ikj::T_F16: case ikj::T_BF16: case ikj::T_Q4_0: case ikj::T_Q4_1:
    case ikj::T_Q5_0: case ikj::T_Q5_1: case ikj::T_Q8_0: case ikj::T_IQ4_NL:
      return true;
    default:
      return false;
  }
}

// ---- f32 helpers ---------------------------------------------------------------------------------

inline float hsum_dot(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 32), _mm512_loadu_ps(b + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 48), _mm512_loadu_ps(b + k + 48), a3);
  }
  for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), a0);
  if (k < K) {
    __mmask16 mk = static_cast<__mmask16>((1u << (K - k)) - 1);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, a + k), _mm512_maskz_loadu_ps(mk, b + k), a1);
    k = K;
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
  __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#else
  float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; k + 8 <= K; k += 8)
    for (int i = 0; i < 8; ++i) p[i] += a[k + i] * b[k + i];
  s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
#endif
  for (; k < K; ++k) s += a[k] * b[k];
  return s;
}


void round_bf16_inplace(float* v, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16) {
    __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(v + i));
    __m512i w = _mm512_cvtepu16_epi32((__m256i)h);
    _mm512_storeu_ps(v + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) v[i] = round_bf16(v[i]);
}

// ---- decode engine ---------------------------------------------------------------------------

#if defined(__AVX512F__)
// One 32-value block of a legacy type decoded into two zmm registers (values 0..15, 16..31).
template <int type>
inline void block512(const uint8_t* b, __m512& v0, __m512& v1) {
  const __m512 vd = _mm512_set1_ps(f16(b));
  if constexpr (type == ikj::T_Q8_0) {
    v0 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))));
    v1 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))));
  } else {
    constexpr int qoff = type == ikj::T_Q4_1 ? 4 : type == ikj::T_Q5_0 ? 6 : type == ikj::T_Q5_1 ? 8 : 2;
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qoff));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    if constexpr (type == ikj::T_IQ4_NL) {
      const __m512 table = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
      v0 = _mm512_mul_ps(vd, _mm512_permutexvar_ps(lo, table));
      v1 = _mm512_mul_ps(vd, _mm512_permutexvar_ps(hi, table));
      return;
    }
    if constexpr (type == ikj::T_Q5_0 || type == ikj::T_Q5_1) {
      const uint32_t qh = load_u32(b + qoff - 4);
      const __m512i sixteen = _mm512_set1_epi32(16);
      lo = _mm512_mask_add_epi32(lo, static_cast<__mmask16>(qh & 0xffff), lo, sixteen);
      hi = _mm512_mask_add_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen);
    }
    float m;
    if constexpr (type == ikj::T_Q4_1 || type == ikj::T_Q5_1) m = f16(b + 2);
    else m = (type == ikj::T_Q5_0 ? -16.f : -8.f) * f16(b);
    const __m512 vm = _mm512_set1_ps(m);
    v0 = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(lo), vm);
    v1 = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(hi), vm);
  }
}

// Bytes ahead to prefetch weights in the fused decode. Measured on DRAM-resident weights (V2-Lite's
// output matrix, 2 threads): Xeon (Sapphire Rapids) +50 % for Q8_0 at 2048; Zen 4 -25 %, so only
// Intel prefetches in software.
inline int64_t decode_prefetch_bytes() {
  static const int64_t pf = __builtin_cpu_is("intel") ? 2048 : 0;
  return pf;
}

// Decode without a buffer: each block is decoded into registers and multiplied straight into
// MM rows of x (two blocks per step, four accumulators per row, to cover the FMA latency).
template <int type, int bs, int MM>
void decode_fused(const float* x, int64_t ldx, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                  int64_t n1, float* y, int64_t ldy, bool accumulate) {
  const int64_t pf = decode_prefetch_bytes();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[MM][4];
    for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      __m512 v0, v1, v2, v3;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(wr + b * bs + pf), _MM_HINT_T0);
      block512<type>(wr + b * bs, v0, v1);
      block512<type>(wr + (b + 1) * bs, v2, v3);
      for (int m = 0; m < MM; ++m) {
        const float* xm = x + m * ldx + b * 32;
        acc[m][0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xm), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xm + 16), acc[m][1]);
        acc[m][2] = _mm512_fmadd_ps(v2, _mm512_loadu_ps(xm + 32), acc[m][2]);
        acc[m][3] = _mm512_fmadd_ps(v3, _mm512_loadu_ps(xm + 48), acc[m][3]);
      }
    }
    if (b < nb) {
      __m512 v0, v1;
      block512<type>(wr + b * bs, v0, v1);
      for (int m = 0; m < MM; ++m) {
        const float* xm = x + m * ldx + b * 32;
        acc[m][0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xm), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xm + 16), acc[m][1]);
      }
    }
    for (int m = 0; m < MM; ++m) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

template <int type, int bs>
bool decode_fused_m(const float* x, int64_t M, int64_t ldx, int64_t nb, const uint8_t* w, int64_t row_bytes,
                    int64_t n0, int64_t n1, float* y, int64_t ldy, bool accumulate) {
  switch (M) {
    case 1: decode_fused<type, bs, 1>(x, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return true;
    case 2: decode_fused<type, bs, 2>(x, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return true;
    case 3: decode_fused<type, bs, 3>(x, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return true;
    default: return false;
  }
}

// The fused path for legacy block types at up to 3 rows; false where it does not apply.
bool try_decode_fused(const float* x, int64_t M, int64_t ldx, int64_t Kc, const uint8_t* w, int64_t row_bytes,
                      int type, int64_t n0, int64_t n1, float* y, int64_t ldy, bool accumulate) {
  const int64_t nb = Kc / 32;
  switch (type) {
    case ikj::T_Q8_0: return decode_fused_m<ikj::T_Q8_0, 34>(x, M, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
    case ikj::T_Q4_0: return decode_fused_m<ikj::T_Q4_0, 18>(x, M, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
    case ikj::T_Q4_1: return decode_fused_m<ikj::T_Q4_1, 20>(x, M, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
    case ikj::T_Q5_0: return decode_fused_m<ikj::T_Q5_0, 22>(x, M, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
    case ikj::T_Q5_1: return decode_fused_m<ikj::T_Q5_1, 24>(x, M, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
    case ikj::T_IQ4_NL: return decode_fused_m<ikj::T_IQ4_NL, 18>(x, M, ldx, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
    default: return false;
  }
}
#endif

// ---- int8-activation decode (compute = bf16, fewer than kGemmMinRows rows) ---------------------
//
// As ik_llama.cpp does for token generation: each x row is quantized once per call to 8-bit blocks
// of 32 (dx = max|x| / 127, round to nearest even), and each weight block's dot with it is an int32
// sum from AVX-512 VNNI's vpdpbusd (u8 x s8 -> i32, 4 products per lane). The weights become
// unsigned bytes by an offset (Q8_0 and IQ4_NL: +128 on the value, Q4_0 / Q5_0: the stored 4/5-bit
// code is value + 8 / + 16), whose contribution offset * sum(x) is removed exactly: each lane's int32
// sum starts at -offset * (sum of the x values it covers). Q4_1 / Q5_1 (d * q + m) add m * dx * sum(x)
// per block in float. Each block's int sum is scaled by dw * dx in float and accumulated. The f32
// fused decode is compute-bound (convert, multiply and FMA per 16 weights: ~20 cycles per 4 blocks
// on Zen 4, ~14 GB/s of Q8_0 per core); this takes ~10 (Q8_0) and ~7 (Q4_0) cycles, so decode reads
// the weights at about the memory's speed. The error is x's 8-bit rounding: ~0.5 % of the result's
// norm for Gaussian activations (tests/test_cpu_quant_matmul.py states the tolerance).
//
// x layouts, per type: Q8_0 keeps x's order and takes two blocks per 64-byte vpdpbusd (lanes 0-7
// one block, 8-15 the next). The nibble types take four blocks per two vpdpbusd into one
// accumulator: a group of 4 blocks of x is stored as 64 bytes of their values 0-15 (block j at
// 16 j) then 64 bytes of their values 16-31, matching the low and the high nibbles of the 4 blocks'
// 16-byte quant fields loaded side by side; lanes 4j..4j+3 then hold block j.
//
// AVX2 (no vpdpbusd): one block per ymm, x in its order; vpmaddubsw (u8 x s8 -> pairs of i16) then
// vpmaddwd by ones (-> i32 sums of 4). Q8_0 and IQ4_NL take ggml's sign trick (|w| x sign(x, w)),
// so their offset is 0 there; 16-bit pair sums cannot saturate (|w| <= 128, |x| <= 127; nibbles
// <= 31).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define IKJ_HAVE_Q8DOT 1
#define IKJ_Q8DOT_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define IKJ_HAVE_Q8DOT 1
#endif

#if defined(IKJ_HAVE_Q8DOT)
// The offset that makes a type's weight values unsigned bytes; -1: no int8 path for the type.
constexpr int q8_offset(int type) {
#if defined(IKJ_Q8DOT_512)
  constexpr int signed_off = 128;
#else
  constexpr int signed_off = 0;  // sign trick
#endif
  return type == ikj::T_Q8_0 || type == ikj::T_IQ4_NL ? signed_off
       : type == ikj::T_Q4_0 ? 8
       : type == ikj::T_Q5_0 ? 16
       : type == ikj::T_Q4_1 || type == ikj::T_Q5_1 ? 0
       : -1;
}
#else
constexpr int q8_offset(int) { return -1; }
#endif
#if defined(IKJ_Q8DOT_512)
// The super-block types with an int8 decode (decode_kq8; avx512 VNNI only).
constexpr bool kq8_type(int type) {
  return type == ikj::T_Q2_K || type == ikj::T_Q3_K || type == ikj::T_Q4_K || type == ikj::T_Q5_K ||
         type == ikj::T_Q6_K || type == ikj::T_IQ4_XS;
}
// The K-quants with 16 sub-blocks of 16 weights per super-block (their dots need x's sums per 16).
constexpr bool kq16_type(int type) { return type == ikj::T_Q2_K || type == ikj::T_Q3_K || type == ikj::T_Q6_K; }
// The 2-bit-field K-quants: x laid out per super-block to match their codes (decode_kq2).
constexpr bool kq2_type(int type) { return type == ikj::T_Q2_K || type == ikj::T_Q3_K; }
#elif defined(IKJ_HAVE_Q8DOT)
// The super-block types with an int8 decode (decode_kqa at the avx2 level: vpmaddubsw / vpmaddwd).
constexpr bool kq8_type(int type) {
  return type == ikj::T_Q2_K || type == ikj::T_Q3_K || type == ikj::T_Q4_K || type == ikj::T_Q5_K ||
         type == ikj::T_Q6_K || type == ikj::T_IQ4_XS;
}
#else
constexpr bool kq8_type(int) { return false; }  // no int8 decode at the generic level
#endif

#if defined(IKJ_HAVE_Q8DOT)  // (both int8 levels)
// Four f16 fields at p, p + bs, p + 2 bs, p + 3 bs as floats.
template <int bs>
inline __m128 f16x4(const uint8_t* p) {
  const uint64_t v = static_cast<uint64_t>(load_u16(p)) | static_cast<uint64_t>(load_u16(p + bs)) << 16 |
                     static_cast<uint64_t>(load_u16(p + 2 * bs)) << 32 |
                     static_cast<uint64_t>(load_u16(p + 3 * bs)) << 48;
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(v)));
}

inline float hsum128(__m128 h) {
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

#if defined(IKJ_Q8DOT_512)

// x [M, K] quantized for one weight type (the layout depends on it). The weights' unsigned offset
// (q8_offset) adds offset * dw * dx * sum(q_x) to each block's dot; decode_q8 sums dw * ds over the
// row in float and subtracts offset times it at the end, instead of starting vpdpbusd from int32
// -offset * (lane's x sum) values: x's working set stays ~40 bytes a block (those start values
// doubled it and at K = 10944 pushed it out of L1: Q8_0 27 -> 54 GB/s in L3, Q4_0 from DRAM
// 25 -> 35 GB/s). The float sum's rounding is ~1e-7 of its terms, far under the 8-bit error.
struct XQ8 {
  int64_t nb = 0;               // blocks per row
  bool grouped = false;         // nibble types' layout (groups of 4 blocks; see above)
  std::vector<int8_t> q;        // [M][nb * 32 rounded up to the group]
  std::vector<float> d;         // [M][nb] dx
  std::vector<float> ds;        // [M][nb] dx * sum(q) (types with a minimum or an offset)
  std::vector<int32_t> sx;      // [M][nb] sum(q) (the one-block tail)
  std::vector<float> ds16;      // [M][2 nb] dx * sum(q) per 16 values (Q6_K; Q2_K, Q3_K in dl16's order)
  std::vector<float> dl16;      // [M][2 nb] dx per 16 values in decode_kq2's lane order (Q2_K, Q3_K)
  int64_t row_q() const { return grouped ? (nb + 3) / 4 * 128 : nb * 32; }
};

void quantize_x8(const float* x, int64_t M, int64_t K, int type, XQ8& o) {
  const int64_t nb = K / 32;
  o.nb = nb;
  o.grouped = type != ikj::T_Q8_0 && !kq8_type(type);
  const bool half_sums = kq16_type(type);
  if (half_sums && static_cast<int64_t>(o.ds16.size()) < 2 * M * nb) o.ds16.resize(2 * M * nb);
  const int64_t rq = o.row_q();
  if (static_cast<int64_t>(o.q.size()) < M * rq) o.q.resize(M * rq);
  if (static_cast<int64_t>(o.d.size()) < M * nb) o.d.resize(M * nb), o.ds.resize(M * nb), o.sx.resize(M * nb);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* qr = o.q.data() + m * rq;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + (m * nb + b) * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      if (o.grouped) {
        int8_t* g = qr + b / 4 * 128 + b % 4 * 16;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(g), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(g + 64), _mm512_cvtepi32_epi8(q1));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * 32), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
      }
      const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      // a NaN in the block (which max drops) makes its scale NaN, so it reaches y as in f32; so does an
      // inf (its codes, inf * 0, are the integer-indefinite -128: scaled by inf they gave an inf of
      // either sign, or NaN, by level and type; an outside probe, stop 68)
      const bool nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
      const float d = nan || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
      o.d[m * nb + b] = d;
      o.ds[m * nb + b] = d * static_cast<float>(s);
      o.sx[m * nb + b] = s;
      if (half_sums) {
        o.ds16[2 * (m * nb + b)] = d * static_cast<float>(_mm512_reduce_add_epi32(q0));
        o.ds16[2 * (m * nb + b) + 1] = d * static_cast<float>(_mm512_reduce_add_epi32(q1));
      }
    }
    if (kq2_type(type)) {
      // decode_kq2's layout, per super-block: 4 vectors X_t of 64 bytes, 32-bit lane (L, j) (L = 2n +
      // h) = x[128 n + 32 j + 16 h + 4 t .. + 3] (the 16-weight sub-block s = 8 n + 2 j + h, its
      // weights 4t..4t+3); dl16 / ds16 lane (L, j) = dx of 32-block 4 n + j / dx * sum16(q) of s.
      if (static_cast<int64_t>(o.dl16.size()) < 2 * M * nb) o.dl16.resize(2 * M * nb);
      alignas(64) int8_t tmp[256];
      float sums[16];
      for (int64_t sb = 0; sb < nb / 8; ++sb) {
        int8_t* xs = qr + sb * 256;
        float* dl = o.dl16.data() + 2 * (m * nb + sb * 8);
        float* ds = o.ds16.data() + 2 * (m * nb + sb * 8);
        const float* dd = o.d.data() + m * nb + sb * 8;
        std::memcpy(tmp, xs, 256);
        std::memcpy(sums, ds, sizeof(sums));
        for (int L = 0; L < 4; ++L)
          for (int j = 0; j < 4; ++j) {
            const int n = L >> 1, h = L & 1;
            for (int t = 0; t < 4; ++t) std::memcpy(xs + 64 * t + 16 * L + 4 * j, tmp + 128 * n + 32 * j + 16 * h + 4 * t, 4);
            dl[4 * L + j] = dd[4 * n + j];
            ds[4 * L + j] = sums[2 * (4 * n + j) + h];
          }
      }
    }
  }
}

template <int type>
constexpr int q8_qoff() {
  return type == ikj::T_Q8_0 ? 2 : type == ikj::T_Q4_1 ? 4 : type == ikj::T_Q5_0 ? 6 : type == ikj::T_Q5_1 ? 8 : 2;
}

inline __m512i iq4nl_table512() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153,
                                              (char)166, (char)181, (char)197, (char)217, (char)241));  // kIq4nl + 128
}

// Q8_0: two consecutive blocks (at b and b + bs) as 64 unsigned bytes, x's order.
template <int bs>
inline __m512i q8_pair(const uint8_t* b) {
  const __m512i v = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + bs + 2)), 1);
  return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Nibble types: four consecutive blocks as unsigned bytes, lo = values 0-15 of each (block j at
// 16 j), hi = values 16-31.
template <int type, int bs>
inline void nib_group(const uint8_t* b, __m512i& lo, __m512i& hi) {
  constexpr int qoff = q8_qoff<type>();
  __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qoff)));
  z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + bs + qoff)), 1);
  z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * bs + qoff)), 2);
  z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 3 * bs + qoff)), 3);
  const __m512i mask = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(z, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), mask);
  if constexpr (type == ikj::T_IQ4_NL) {
    const __m512i t = iq4nl_table512();
    lo = _mm512_shuffle_epi8(t, lo);
    hi = _mm512_shuffle_epi8(t, hi);
  }
  if constexpr (type == ikj::T_Q5_0 || type == ikj::T_Q5_1) {  // bit j of qh: + 16 on value j
    constexpr int h = qoff - 4;
    const uint64_t ml = static_cast<uint64_t>(load_u16(b + h)) | static_cast<uint64_t>(load_u16(b + bs + h)) << 16 |
                        static_cast<uint64_t>(load_u16(b + 2 * bs + h)) << 32 |
                        static_cast<uint64_t>(load_u16(b + 3 * bs + h)) << 48;
    const uint64_t mh = static_cast<uint64_t>(load_u16(b + h + 2)) |
                        static_cast<uint64_t>(load_u16(b + bs + h + 2)) << 16 |
                        static_cast<uint64_t>(load_u16(b + 2 * bs + h + 2)) << 32 |
                        static_cast<uint64_t>(load_u16(b + 3 * bs + h + 2)) << 48;
    const __m512i sixteen = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(ml), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(mh), hi, sixteen);
  }
}

// One block as 32 unsigned bytes, values 0-31 in order (the tail of a row).
template <int type>
inline __m256i wblock1(const uint8_t* b) {
  constexpr int qoff = q8_qoff<type>();
  if constexpr (type == ikj::T_Q8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + qoff)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qoff));
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
    if constexpr (type == ikj::T_IQ4_NL) v = _mm256_shuffle_epi8(_mm512_castsi512_si256(iq4nl_table512()), v);
    if constexpr (type == ikj::T_Q5_0 || type == ikj::T_Q5_1)
      v = _mm256_mask_add_epi8(v, _cvtu32_mask32(load_u32(b + qoff - 4)), v, _mm256_set1_epi8(16));
    return v;
  }
}


// Rows [n0, n1) of W against MM quantized x rows, blocks [kb0, kb0 + nb) of x (kb0 a multiple of
// 4; w already points at block kb0 of row 0). Four blocks per step into two f32 accumulators per
// row (steps alternate between them to cover the FMA latency).
template <int type, int bs, int MM>
void decode_q8(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
               int64_t n1, float* y, int64_t ldy, bool accumulate) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  constexpr int off = q8_offset(type);
  constexpr bool q8 = type == ikj::T_Q8_0;
  const __m512i i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i i23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i i0123 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t pf = decode_prefetch_bytes();
  const int64_t rq = xq.row_q();
  const int8_t* xqs[MM];
  const float *xd[MM], *xs[MM];
  const int32_t* xsum[MM];
  for (int m = 0; m < MM; ++m) {
    xqs[m] = xq.q.data() + m * rq + kb0 * 32;  // kb0 % 4 == 0: the same offset in both layouts
    xd[m] = xq.d.data() + m * xq.nb + kb0;
    xs[m] = xq.ds.data() + m * xq.nb + kb0;
    xsum[m] = xq.sx.data() + m * xq.nb + kb0;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[MM][2];
    __m128 accm[MM];
    float tail[MM];
    for (int m = 0; m < MM; ++m) {
      acc[m][0] = acc[m][1] = _mm512_setzero_ps();
      accm[m] = _mm_setzero_ps();
      tail[m] = 0.f;
    }
    auto step = [&](int64_t b, int a) {  // blocks [b, b + 4) into acc[.][a]
      const uint8_t* wb = wr + b * bs;
      if (pf)  // every cache line of the 4 blocks (72 to 136 bytes)
        for (int o = 0; o < 4 * bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + pf + o), _MM_HINT_T0);
      const __m128 dw = f16x4<bs>(wb);
      if constexpr (q8) {
        const __m512i w01 = q8_pair<bs>(wb), w23 = q8_pair<bs>(wb + 2 * bs);
        for (int m = 0; m < MM; ++m) {
          const __m512i c0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w01, _mm512_loadu_si512(xqs[m] + b * 32));
          const __m512i c1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w23, _mm512_loadu_si512(xqs[m] + b * 32 + 64));
          const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(xd[m] + b)));
          acc[m][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), _mm512_permutexvar_ps(i01, s), acc[m][a]);
          acc[m][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), _mm512_permutexvar_ps(i23, s), acc[m][a]);
        }
      } else {
        __m512i lo, hi;
        nib_group<type, bs>(wb, lo, hi);
        for (int m = 0; m < MM; ++m) {
          __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xqs[m] + b * 32));
          c = _mm512_dpbusd_epi32(c, hi, _mm512_loadu_si512(xqs[m] + b * 32 + 64));
          const __m512 s = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(xd[m] + b)));
          acc[m][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(i0123, s), acc[m][a]);
        }
      }
      if constexpr (has_min) {
        const __m128 mw = f16x4<bs>(wb + 2);
        for (int m = 0; m < MM; ++m) accm[m] = _mm_fmadd_ps(mw, _mm_loadu_ps(xs[m] + b), accm[m]);
      }
      if constexpr (off != 0)  // the offset's share, scaled by -off at the end (see XQ8)
        for (int m = 0; m < MM; ++m) accm[m] = _mm_fmadd_ps(dw, _mm_loadu_ps(xs[m] + b), accm[m]);
    };
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      step(b, 0);
      step(b + 4, 1);
    }
    if (b + 4 <= nb) step(b, 0), b += 4;
    for (; b < nb; ++b) {  // the last 1-3 blocks, one at a time
      const uint8_t* wb = wr + b * bs;
      const __m256i wv = wblock1<type>(wb);
      const float dw = f16(wb), mw = has_min ? f16(wb + 2) : 0.f;
      for (int m = 0; m < MM; ++m) {
        __m256i xv;
        if constexpr (q8) {
          xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs[m] + b * 32));
        } else {
          const int8_t* g = xqs[m] + (b - b % 4) * 32 + b % 4 * 16;
          xv = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 64)),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
        }
        const __m256i c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
        const int s = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(c)) - off * xsum[m][b];
        tail[m] += dw * xd[m][b] * static_cast<float>(s) + mw * xs[m][b];
      }
    }
    for (int m = 0; m < MM; ++m) {
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) +
                      (off != 0 ? -static_cast<float>(off) : 1.f) * hsum128(accm[m]) + tail[m];
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

// M = 1: two weight rows per pass, sharing every load of x (the nibble types' kernel is bound by
// loads: per 4 blocks 4 weight fields, 4 f16 scales and 4 loads of x) and giving the core two
// memory streams. Same arithmetic as decode_q8<type, bs, 1>, so the results are identical.
// Measured from DRAM (bench_cpu.py --cold, 2 threads, Zen 4): Q4_0 2048x10944 18-21 -> 25-27 GB/s,
// 102400x2048 30-32 -> 34-35 GB/s; Q8_0 unchanged (already at the read bandwidth).
template <int type, int bs>
void decode_q8_r2(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                  int64_t n1, float* y, bool accumulate) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  constexpr int off = q8_offset(type);
  constexpr bool q8 = type == ikj::T_Q8_0;
  const __m512i i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i i23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i i0123 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t pf = decode_prefetch_bytes();
  const int8_t* xqs = xq.q.data() + kb0 * 32;
  const float* xd = xq.d.data() + kb0;
  const float* xs = xq.ds.data() + kb0;
  const int32_t* xsum = xq.sx.data() + kb0;
  // the two rows of a pass are n and n + h, h = half the range: two sequential streams (adjacent
  // rows read side by side measured at half the speed on Zen 4: the L2 stream prefetcher sees
  // lines taken out of order)
  const int64_t h = (n1 - n0) / 2;
  int64_t n = n0;
  for (; n < n0 + h; ++n) {
    const int64_t rn[2] = {n, n + h};
    const uint8_t* wr[2] = {w + n * row_bytes, w + (n + h) * row_bytes};
    __m512 acc[2][2];
    __m128 accm[2];
    float tail[2] = {0.f, 0.f};
    for (int r = 0; r < 2; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps(), accm[r] = _mm_setzero_ps();
    // a as a compile-time constant: with a run-time index the accumulators would live in memory
    // should the compiler not inline this (larger) step
    auto step = [&](int64_t b, auto a_c) {  // blocks [b, b + 4) of both rows into acc[.][a]
      constexpr int a = decltype(a_c)::value;
      const __m128 xdv = _mm_loadu_ps(xd + b);
      const __m512i xa = _mm512_loadu_si512(xqs + b * 32), xb = _mm512_loadu_si512(xqs + b * 32 + 64);
      [[maybe_unused]] __m128 xsv = _mm_setzero_ps();
      if constexpr (off != 0 || has_min) xsv = _mm_loadu_ps(xs + b);
      for (int r = 0; r < 2; ++r) {
        const uint8_t* wb = wr[r] + b * bs;
        if (pf)
          for (int o = 0; o < 4 * bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + pf + o), _MM_HINT_T0);
        const __m128 dw = f16x4<bs>(wb);
        const __m512 sc = _mm512_castps128_ps512(_mm_mul_ps(dw, xdv));
        if constexpr (q8) {
          const __m512i c0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q8_pair<bs>(wb), xa);
          const __m512i c1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q8_pair<bs>(wb + 2 * bs), xb);
          acc[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), _mm512_permutexvar_ps(i01, sc), acc[r][a]);
          acc[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), _mm512_permutexvar_ps(i23, sc), acc[r][a]);
        } else {
          __m512i lo, hi;
          nib_group<type, bs>(wb, lo, hi);
          const __m512i c = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xa), hi, xb);
          acc[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(i0123, sc), acc[r][a]);
          if constexpr (has_min) accm[r] = _mm_fmadd_ps(f16x4<bs>(wb + 2), xsv, accm[r]);
        }
        if constexpr (off != 0) accm[r] = _mm_fmadd_ps(dw, xsv, accm[r]);
      }
    };
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      step(b, std::integral_constant<int, 0>());
      step(b + 4, std::integral_constant<int, 1>());
    }
    if (b + 4 <= nb) step(b, std::integral_constant<int, 0>()), b += 4;
    for (; b < nb; ++b) {  // the last 1-3 blocks, one at a time (as decode_q8)
      __m256i xv;
      if constexpr (q8) {
        xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs + b * 32));
      } else {
        const int8_t* g = xqs + (b - b % 4) * 32 + b % 4 * 16;
        xv = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 64)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
      }
      for (int r = 0; r < 2; ++r) {
        const uint8_t* wb = wr[r] + b * bs;
        const float dw = f16(wb), mw = has_min ? f16(wb + 2) : 0.f;
        const __m256i c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wblock1<type>(wb), xv);
        const int si = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(c)) - off * xsum[b];
        tail[r] += dw * xd[b] * static_cast<float>(si) + mw * xs[b];
      }
    }
    for (int r = 0; r < 2; ++r) {
      const float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) +
                      (off != 0 ? -static_cast<float>(off) : 1.f) * hsum128(accm[r]) + tail[r];
      y[rn[r]] = accumulate ? y[rn[r]] + v : v;
    }
  }
  if (n0 + 2 * h < n1) decode_q8<type, bs, 1>(xq, kb0, nb, w, row_bytes, n0 + 2 * h, n1, y, 1, accumulate);
}


// ---- K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS) in the int8-activation decode (avx512 VNNI) -----------
//
// x is quantized as for Q8_0 (blocks of 32 in x's order, dx and dx * sum(q) per block; Q6_K also
// dx * sum(q) per half block of 16, XQ8::ds16). Per super-block of 256 weights:
// - Q4_K: the 128 quant bytes are loaded as two zmm; their low/high nibbles are sub-blocks
//   (0, 2) / (1, 3) (and 4-7 likewise), recombined by 128-bit lane shuffles into pairs (2j, 2j + 1)
//   that line up with 64 bytes of x. vpdpbusd (the nibbles are unsigned already) gives 16 int32
//   lanes, 8 per sub-block, scaled by d * scale[s] * dx[s] in float; the minimum's share
//   dmin * min[s] * dx[s] * sum(q_x)[s] is summed apart and subtracted at the end.
// - Q6_K: ql (64 bytes) and qh (32 bytes, paired with itself shifted by 2) give the 6-bit codes
//   (value + 32) of 64 consecutive weights per vpdpbusd; lanes 4k..4k+3 are the 16-weight sub-block
//   k with its int8 scale. The +32 offset's share 32 * d * sc[k] * dx * sum16(q_x)[k] is summed
//   apart (float, as the legacy types' offset) and subtracted at the end.
// - Q5_K: Q4_K's layout and scales with qh's 32 bytes: bit j of qh[l] is the fifth bit (+16) of
//   weight l of sub-block j; qh and qh >> 1 side by side, shifted so bits 2j / 2j + 1 land on 0x10
//   of the pair (2j, 2j + 1), are ORed into Q4_K's nibble pairs.
// - IQ4_XS: 8 sub-blocks of 32 as IQ4_NL blocks (16 bytes: values 0-15 in the low nibbles, 16-31
//   in the high), each nibble -> the IQ4_NL table + 128 (unsigned, as the legacy IQ4_NL decode),
//   the 128-bit lanes of low / high nibbles interleaved into Q4_K's pairs; the 6-bit scales
//   (ls - 32, signed) take Q4_K's scale role and the +128 offset's share 128 * d * (ls - 32) * dx *
//   sum(q_x) takes the minimum's.
// - Q2_K and Q3_K: decode_kq2 below (16 sub-blocks of 16; x laid out to match the 2-bit fields).
//   Q3_K's code is value + 4 (0..7: the 2 low bits and hmask's bit), its 6-bit scales (ls - 32) the
//   sub-block scales, and the +4 offset's share 4 * d * (ls - 32) * dx * sum16(q_x) is subtracted at
//   the end; Q2_K's codes are the values (0..3) with a 4-bit scale and a 4-bit minimum per
//   sub-block, and the minimum's share dmin * min * dx * sum16(q_x) is subtracted (as ggml / ik do
//   with q8's block sums).
// Error: x's 8-bit rounding only, as the legacy types (the int32 sums are exact).

// A Q4_K super-block's 12 scale bytes -> 8 scales and 8 minimums (ggml's get_scale_min_k4, as a
// 32-bit-word unpack).
inline void q4k_scales(const uint8_t* p, __m256& sc, __m256& mn) {
  uint32_t u[4];
  std::memcpy(u, p, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t a = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = a;
  u[0] &= k1;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}

// Rows [n0, n1) of W (a kq8_type but Q2_K / Q3_K, w at super-block kb0 / 8 of row 0) against MM quantized x
// rows, 32-blocks [kb0, kb0 + nb) (nb a multiple of 8).
template <int type, int MM>
void decode_kq8(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                int64_t n1, float* y, int64_t ldy, bool accumulate) {
  constexpr bool q4k = !kq16_type(type);  // 8 sub-blocks of 32, W[j] = the pair (2j, 2j + 1)
  static_assert(!kq2_type(type), "Q2_K / Q3_K: decode_kq2");
  constexpr int bs = type == ikj::T_Q4_K ? 144 : type == ikj::T_Q5_K ? 176 : type == ikj::T_IQ4_XS ? 136 : 210;
  constexpr float off = type == ikj::T_IQ4_XS ? 128.f : type == ikj::T_Q6_K ? 32.f : 1.f;  // accm's factor
  const int64_t nsb = nb / 8;
  const int64_t pf = decode_prefetch_bytes();
  const int64_t rq = xq.row_q();
  const int8_t* xqs[MM];
  const float *xd[MM], *xs[MM];
  for (int m = 0; m < MM; ++m) {
    xqs[m] = xq.q.data() + m * rq + kb0 * 32;
    xd[m] = xq.d.data() + m * xq.nb + kb0;
    xs[m] = q4k ? xq.ds.data() + m * xq.nb + kb0 : xq.ds16.data() + 2 * (m * xq.nb + kb0);
  }
  // lane -> scale index, per product
  __m512i idx[4];
  for (int j = 0; j < 4; ++j)
    idx[j] = q4k ? _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1,
                                     2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1)
                 : _mm512_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                                     4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 3, 4 * j + 3, 4 * j + 3,
                                     4 * j + 3);
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30), m10 = _mm512_set1_epi8(0x10);
  const __m512i tbl = iq4nl_table512();
  const __m512i lo2 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi2 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m256i xs_shl = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), xs_shh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[MM][2], accm[MM];
    for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = accm[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* wb = wr + i * bs;
      if (pf)
        for (int o = 0; o < bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + pf + o), _MM_HINT_T0);
      __m512i W[4];
      if constexpr (q4k) {
        __m256 dsc, dmn;
        if constexpr (type == ikj::T_IQ4_XS) {
          const __m512i z0 = _mm512_loadu_si512(wb + 8), z1 = _mm512_loadu_si512(wb + 72);
          const __m512i l0 = _mm512_shuffle_epi8(tbl, _mm512_and_si512(z0, m4));
          const __m512i h0 = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(z0, 4), m4));
          const __m512i l1 = _mm512_shuffle_epi8(tbl, _mm512_and_si512(z1, m4));
          const __m512i h1 = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(z1, 4), m4));
          W[0] = _mm512_permutex2var_epi64(l0, lo2, h0);
          W[1] = _mm512_permutex2var_epi64(l0, hi2, h0);
          W[2] = _mm512_permutex2var_epi64(l1, lo2, h1);
          W[3] = _mm512_permutex2var_epi64(l1, hi2, h1);
          uint16_t sh;
          uint32_t sl;
          std::memcpy(&sh, wb + 2, 2);
          std::memcpy(&sl, wb + 4, 4);
          const __m256i ls = _mm256_or_si256(
              _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(sl)), xs_shl), _mm256_set1_epi32(0xf)),
              _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), xs_shh), _mm256_set1_epi32(3)), 4));
          dsc = _mm256_mul_ps(_mm256_set1_ps(f16(wb)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
          dmn = dsc;
        } else {
          constexpr int qs = type == ikj::T_Q4_K ? 16 : 48;
          const __m512i z0 = _mm512_loadu_si512(wb + qs), z1 = _mm512_loadu_si512(wb + qs + 64);
          const __m512i l0 = _mm512_and_si512(z0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(z0, 4), m4);
          const __m512i l1 = _mm512_and_si512(z1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(z1, 4), m4);
          W[0] = _mm512_shuffle_i64x2(l0, h0, 0x44);
          W[1] = _mm512_shuffle_i64x2(l0, h0, 0xEE);
          W[2] = _mm512_shuffle_i64x2(l1, h1, 0x44);
          W[3] = _mm512_shuffle_i64x2(l1, h1, 0xEE);
          if constexpr (type == ikj::T_Q5_K) {  // + 16 where qh's bit (sub-block) is set
            const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16));
            const __m512i Hs = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 1), 1);
            W[0] = _mm512_or_si512(W[0], _mm512_and_si512(_mm512_slli_epi16(Hs, 4), m10));
            W[1] = _mm512_or_si512(W[1], _mm512_and_si512(_mm512_slli_epi16(Hs, 2), m10));
            W[2] = _mm512_or_si512(W[2], _mm512_and_si512(Hs, m10));
            W[3] = _mm512_or_si512(W[3], _mm512_and_si512(_mm512_srli_epi16(Hs, 2), m10));
          }
          const float d = f16(wb), dmin = f16(wb + 2);
          __m256 sc, mn;
          q4k_scales(wb + 4, sc, mn);
          dsc = _mm256_mul_ps(_mm256_set1_ps(d), sc);
          dmn = _mm256_mul_ps(_mm256_set1_ps(dmin), mn);
        }
        for (int m = 0; m < MM; ++m) {
          const int8_t* xb = xqs[m] + i * 256;
          const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(dsc, _mm256_loadu_ps(xd[m] + i * 8)));
          for (int j = 0; j < 4; ++j) {
            const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[j], _mm512_loadu_si512(xb + 64 * j));
            acc[m][j & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(idx[j], s), acc[m][j & 1]);
          }
          accm[m] = _mm512_castps256_ps512(
              _mm256_fmadd_ps(dmn, _mm256_loadu_ps(xs[m] + i * 8), _mm512_castps512_ps256(accm[m])));
        }
      } else {
        __m512 dsc, dmn;
        {  // Q6_K
          for (int h = 0; h < 2; ++h) {
            const __m512i L = _mm512_loadu_si512(wb + 64 * h);
            const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * h));
            const __m512i Hz = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
            W[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_and_si512(_mm512_slli_epi16(Hz, 4), m30));
            W[2 * h + 1] =
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4), _mm512_and_si512(Hz, m30));
          }
          dsc = _mm512_mul_ps(
              _mm512_set1_ps(f16(wb + 208)),
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192)))));
          dmn = dsc;
        }
        for (int m = 0; m < MM; ++m) {
          const int8_t* xb = xqs[m] + i * 256;
          const __m512 s =
              _mm512_mul_ps(dsc, _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(xd[m] + i * 8))));
          for (int j = 0; j < 4; ++j) {
            const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[j], _mm512_loadu_si512(xb + 64 * j));
            acc[m][j & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(idx[j], s), acc[m][j & 1]);
          }
          accm[m] = _mm512_fmadd_ps(dmn, _mm512_loadu_ps(xs[m] + i * 16), accm[m]);
        }
      }
    }
    for (int m = 0; m < MM; ++m) {
      const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) - off * _mm512_reduce_add_ps(accm[m]);
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

// Q2_K / Q3_K at M < 4 (decode_kq8's Q6_K form did them in ~38 zmm ops a super-block; this ~27):
// one int32 vector of the 16 sub-blocks' dots per super-block, so one convert and one FMA. qs's
// 128-bit lane L = 2 n + h holds weights i = 0..15 of the sub-blocks s = 8 n + 2 j + h (j = 0..3, bits
// 2 j of byte i). V_t = the dword t of each 128-bit lane broadcast over it (pshufd), shifted right by
// 2 j in dword j, masked to 2 bits: 32-bit lane (L, j) = weights 4t..4t+3 of sub-block (n, j, h); x
// laid out the same by quantize_x8 (X_t), so vpdpbusd over t = 0..3 accumulates each sub-block in
// its own lane. Q3_K ORs in hmask's bit 4 n + j of byte 16 h + i (a byte-mask test and masked add of
// 4). The scales are permuted to that lane order by one pshufb; dx per lane (dl16) and the
// minimum's / offset's dx * sum16(q) (ds16) come in that order from quantize_x8.
template <int type, int MM>
void decode_kq2(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                int64_t n1, float* y, int64_t ldy, bool accumulate) {
  constexpr bool q3 = type == ikj::T_Q3_K;
  constexpr int bs = q3 ? 110 : 84;
  constexpr float off = q3 ? 4.f : 1.f;
  const int64_t nsb = nb / 8;
  const int64_t pf = decode_prefetch_bytes();
  const int64_t rq = xq.row_q();
  const int8_t* xqs[MM];
  const float *xl[MM], *xs[MM];
  for (int m = 0; m < MM; ++m) {
    xqs[m] = xq.q.data() + m * rq + kb0 * 32;
    xl[m] = xq.dl16.data() + 2 * (m * xq.nb + kb0);
    xs[m] = xq.ds16.data() + 2 * (m * xq.nb + kb0);
  }
  const __m512i shv = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  const __m512i m3 = _mm512_set1_epi8(0x03), four = _mm512_set1_epi8(0x04);
  // Q3_K: lane (L, j) tests bit 4 (L >> 1) + j of each byte
  const __m512i hbit = _mm512_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x01010101, 0x02020202,
                                         0x04040404, 0x08080808, 0x10101010, 0x20202020, 0x40404040,
                                         static_cast<int>(0x80808080), 0x10101010, 0x20202020, 0x40404040,
                                         static_cast<int>(0x80808080));
  const __m128i sperm = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);  // lane <- s
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m512 acc[MM], accm[MM];
    for (int m = 0; m < MM; ++m) acc[m] = accm[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* wb = wr + i * bs;
      if (pf)
        for (int o = 0; o < bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + pf + o), _MM_HINT_T0);
      const __m512i Q = _mm512_loadu_si512(wb + (q3 ? 32 : 16));
      __m512i V[4];
      V[0] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(Q, _MM_PERM_AAAA), shv), m3);
      V[1] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(Q, _MM_PERM_BBBB), shv), m3);
      V[2] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(Q, _MM_PERM_CCCC), shv), m3);
      V[3] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi32(Q, _MM_PERM_DDDD), shv), m3);
      __m512 dsc, dmn;
      if constexpr (q3) {
        const __m512i Hz = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb)));
        V[0] = _mm512_mask_add_epi8(V[0], _mm512_test_epi8_mask(_mm512_shuffle_epi32(Hz, _MM_PERM_AAAA), hbit), V[0], four);
        V[1] = _mm512_mask_add_epi8(V[1], _mm512_test_epi8_mask(_mm512_shuffle_epi32(Hz, _MM_PERM_BBBB), hbit), V[1], four);
        V[2] = _mm512_mask_add_epi8(V[2], _mm512_test_epi8_mask(_mm512_shuffle_epi32(Hz, _MM_PERM_CCCC), hbit), V[2], four);
        V[3] = _mm512_mask_add_epi8(V[3], _mm512_test_epi8_mask(_mm512_shuffle_epi32(Hz, _MM_PERM_DDDD), hbit), V[3], four);
        // the 6-bit scales as in decode_kq8, then into lane order
        const __m128i v = _mm_srli_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 94)), 2);
        const __m128i lo4 = _mm_unpacklo_epi64(_mm_and_si128(v, _mm_set1_epi8(0x0f)),
                                               _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)));
        const __m128i t = _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
        const __m128i hi2 =
            _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(t, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3)), 4);
        const __m512i ls = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_or_si128(lo4, hi2), sperm));
        dsc = _mm512_mul_ps(_mm512_set1_ps(f16(wb + 108)), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
        dmn = dsc;
      } else {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)), sperm));
        dsc = _mm512_mul_ps(_mm512_set1_ps(f16(wb + 80)), _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xf))));
        dmn = _mm512_mul_ps(_mm512_set1_ps(f16(wb + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
      }
      for (int m = 0; m < MM; ++m) {
        const int8_t* xb = xqs[m] + i * 256;
        __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), V[0], _mm512_loadu_si512(xb));
        c = _mm512_dpbusd_epi32(c, V[1], _mm512_loadu_si512(xb + 64));
        c = _mm512_dpbusd_epi32(c, V[2], _mm512_loadu_si512(xb + 128));
        c = _mm512_dpbusd_epi32(c, V[3], _mm512_loadu_si512(xb + 192));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(dsc, _mm512_loadu_ps(xl[m] + i * 16)), acc[m]);
        accm[m] = _mm512_fmadd_ps(dmn, _mm512_loadu_ps(xs[m] + i * 16), accm[m]);
      }
    }
    for (int m = 0; m < MM; ++m) {
      const float s = _mm512_reduce_add_ps(acc[m]) - off * _mm512_reduce_add_ps(accm[m]);
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

#elif defined(IKJ_HAVE_Q8DOT)  // AVX2

// Bytes ahead to prefetch weights in the int8 decode. On this workplace's Zen 3 (AVX2 only), DRAM-
// resident weights (65536 x 2048 IQ4_XS, M = 1): +25-35 % at 1 and 2 threads (RESULTS §26e), no
// change on L3-resident ones; Intel gained 50 % at the avx512 level.
inline int64_t decode_prefetch_bytes() { return 2048; }

// x [M, K] quantized for one weight type: blocks of 32 in x's order.
struct XQ8 {
  int64_t nb = 0;               // blocks per row
  std::vector<int8_t> q;        // [M][nb * 32]
  std::vector<float> d;         // [M][nb] dx
  std::vector<float> ds;        // [M][nb] dx * sum(q) (types with a minimum)
  std::vector<int32_t> corr;    // [M][nb * 8] -offset * (sum of q[4i .. 4i + 3]), added to the lane sums
  std::vector<float> ds16;      // [M][2 nb] dx * sum(q) per 16 values, x's order (Q2_K's minimum)
  int64_t row_q() const { return nb * 32; }
};

inline float hmax256(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}


inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// max |x| over 32 floats (a NaN may or may not survive: q8_block_avx2 marks NaN blocks itself)
inline __m256 absmax32_avx2(const float* xb) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * j));
  return _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
}

// One block of 32 floats as the int8 paths quantize x (the avx512 level's arithmetic): the 32
// signed bytes round(x * 127 / amax) in x's order (stored at q), their sums per 4 values (s4, dword
// lanes), and the scale amax / 127, NaN where the block holds a NaN (max drops it; the NaN then
// reaches y as in f32). amax: the block's own max |x|, or its super-block's (the K-quant decode's
// x per 256). One copy for quantize_x8 (decode) and pack_x8 (the prompt engine).
inline float q8_block_avx2(const float* xb, void* q, __m256i* s4, float amax) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xb + 8 * j);
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i qi[4];
  for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
  // packs work per 128-bit lane: the dword order comes out 0 2 4 6 1 3 5 7 of 4-value groups
  const __m256i p = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  *s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p), _mm256_set1_epi16(1));
  const __m256 un = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q), _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                                 _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q), _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
  return _mm256_movemask_ps(un) || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
}
inline float q8_block_avx2(const float* xb, void* q, __m256i* s4) {
  return q8_block_avx2(xb, q, s4, hmax256(absmax32_avx2(xb)));
}

// Blocks [i0, i1) of x (32 floats each) into q (32 bytes each) in groups of g blocks sharing one
// scale (g = 1: a scale per block; 8: per 256), each block's scale into d[i] (NaN for a whole group
// where one block holds a NaN) and store(i, its scale, its s4) for what else the caller keeps.
template <class Store>
void q8_groups_avx2(const float* x, void* q, int64_t i0, int64_t i1, int64_t g, float* d, Store store) {
  uint8_t* qb = static_cast<uint8_t*>(q);
  for (int64_t j0 = i0; j0 < i1; j0 += g) {
    float amax = 0.f;
    if (g > 1) {
      __m256 a = absmax32_avx2(x + j0 * 32);
      for (int64_t j = 1; j < g; ++j) a = _mm256_max_ps(a, absmax32_avx2(x + (j0 + j) * 32));
      amax = hmax256(a);
    }
    bool nan = false;
    for (int64_t i = j0; i < j0 + g; ++i) {
      __m256i s4;
      const float di = g > 1 ? q8_block_avx2(x + i * 32, qb + i * 32, &s4, amax) : q8_block_avx2(x + i * 32, qb + i * 32, &s4);
      nan |= di != di;
      d[i] = di;
      store(i, di, s4);
    }
    if (nan)
      for (int64_t i = j0; i < j0 + g; ++i) d[i] = std::numeric_limits<float>::quiet_NaN();
  }
}

// x for the int8 decode: blocks of 32, each with its own scale; for the K-quants and IQ4_XS
// (decode_kqa) one scale per super-block of 256 (Q8_K's grouping: the 8 blocks' int32 sums then add
// up before one convert and FMA), d[] repeating it for each of the 8 blocks (NaN for all 8 when one
// holds a NaN), ds[] / ds16[] that scale times the block's (half-block's) sum of q.
void quantize_x8(const float* x, int64_t M, int64_t K, int type, XQ8& o) {
  const int64_t nb = K / 32;
  const int offset = q8_offset(type);
  o.nb = nb;
  if (static_cast<int64_t>(o.q.size()) < M * nb * 32) o.q.resize(M * nb * 32), o.corr.resize(M * nb * 8);
  if (static_cast<int64_t>(o.d.size()) < M * nb) o.d.resize(M * nb), o.ds.resize(M * nb);
  const bool half_sums = type == ikj::T_Q2_K;
  if (half_sums && static_cast<int64_t>(o.ds16.size()) < 2 * M * nb) o.ds16.resize(2 * M * nb);
  const __m256i moff = _mm256_set1_epi32(-offset);
  const int64_t g = kq8_type(type) && nb % 8 == 0 ? 8 : 1;  // blocks sharing a scale (rows hold whole groups)
  q8_groups_avx2(x, o.q.data(), 0, M * nb, g, o.d.data(), [&](int64_t i, float d, __m256i s4) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.corr.data() + i * 8), _mm256_mullo_epi32(s4, moff));
    o.ds[i] = d * hsum256(_mm256_cvtepi32_ps(s4));  // exact: |sum| <= 4064
    if (half_sums) {  // s4's lanes 0-3 cover values 0-15, 4-7 values 16-31
      o.ds16[2 * i] = d * hsum128(_mm_cvtepi32_ps(_mm256_castsi256_si128(s4)));
      o.ds16[2 * i + 1] = d * hsum128(_mm_cvtepi32_ps(_mm256_extracti128_si256(s4, 1)));
    }
  });
}

// One block as 32 bytes in x's order: signed values for Q8_0 / IQ4_NL (sign trick), unsigned
// codes for the others.
template <int type>
inline __m256i wblock_avx2(const uint8_t* b) {
  if constexpr (type == ikj::T_Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    constexpr int qoff = type == ikj::T_Q4_1 ? 4 : type == ikj::T_Q5_0 ? 6 : type == ikj::T_Q5_1 ? 8 : 2;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qoff));
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
    if constexpr (type == ikj::T_IQ4_NL)
      v = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl))), v);
    if constexpr (type == ikj::T_Q5_0 || type == ikj::T_Q5_1) {
      // bit j of qh -> byte j all ones (ggml's bytes_from_bits_32), then + 16
      const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
      __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load_u32(b + qoff - 4))), shuf);
      bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
      bytes = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
      v = _mm256_or_si256(v, _mm256_and_si256(bytes, _mm256_set1_epi8(16)));
    }
    return v;
  }
}

// ---- the nibble types' decode in groups of 4 blocks (Q4_0, Q4_1, Q5_0, Q5_1) ----------------------
//
// Per block, the one-block form (decode_q8 below, the sign types) spends vpmaddubsw, vpmaddwd, a
// convert, a broadcast scale and an FMA: on Zen 3 both integer multiplies and half the FMAs share
// one pipe, and the Q4_0 decode ran compute-bound at ~12 GB/s a core (bench/cpu_quant_matmul.py
// --cold, one thread; 2 threads 16-24 GB/s of a 29 GB/s read bandwidth; RESULTS §26an). Here 4
// blocks' i16 pair sums are folded by two vphaddw into [A A B B C C D D] per 128-bit half (8
// products a lane: |sum| <= 8 x 31 x 127 = 31496, no saturation for codes up to 31), then one
// vpmaddwd, one convert and one FMA against the 4 blocks' scales serve all 4 (AVX-VNNI: 4 vpdpbusd
// and two vphaddd give the same int32 lanes). The offset (Q4_0 8, Q5_0 16) leaves in float, as the
// avx512 level's: - off x d_w x d_x x sum(q_x) per block, 4 at a time; Q4_1 / Q5_1's minimum the same
// way. The last nb % 4 blocks go one at a time (exact int sums). decode_nib4 (2-3 x rows) and
// decode_nib4_r2 (1 x row, 2 weight rows) run the same operations per (weight row, x row), so a row
// alone and in a batch get the same bits. IKJAX_NIB4=0: the one-block form, for A/B.
inline bool nib4_on() { return ikj::env_on("IKJAX_NIB4"); }  // (read per call: A/B in one process)

// Blocks wb[0..3] against x blocks xq[0..3] (32 values each): int32 lanes [A B C D | A B C D], each
// half of a block's 32 products (the two halves of the register hold the two halves of each block).
template <int type, int bs>
inline __m256i nib4_dot(const uint8_t* wb, const int8_t* xq) {
  __m256i p[4];
  for (int j = 0; j < 4; ++j) {
    const __m256i wv = wblock_avx2<type>(wb + j * bs);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * 32));
#if defined(__AVXVNNI__)
    p[j] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wv, xv);
#else
    p[j] = _mm256_maddubs_epi16(wv, xv);
#endif
  }
#if defined(__AVXVNNI__)
  return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
#else
  return _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])),
                           _mm256_set1_epi16(1));
#endif
}

// x rows [0, MM) of xq from block kb0 on: the int8 values, their per-lane offset corrections, the
// block scales and scaled sums (what the decode kernels read of each row).
template <int MM>
struct XRowsQ8 {
  const int8_t* q[MM];
  const int32_t* c[MM];
  const float *d[MM], *s[MM];
  XRowsQ8(const XQ8& xq, int64_t kb0) {
    for (int m = 0; m < MM; ++m) {
      q[m] = xq.q.data() + (m * xq.nb + kb0) * 32;
      c[m] = xq.corr.data() + (m * xq.nb + kb0) * 8;
      d[m] = xq.d.data() + m * xq.nb + kb0;
      s[m] = xq.ds.data() + m * xq.nb + kb0;
    }
  }
};

// One weight row's running sums against one x row: acc (the 4-block groups), aoff (their offset
// term), amin (their minimum term), tail (the last nb % 4 blocks, whole).
struct Nib4Acc {
  __m256 acc = _mm256_setzero_ps();
  __m128 aoff = _mm_setzero_ps(), amin = _mm_setzero_ps();
  float tail = 0.f;
};

// Blocks [b, b + 4) of weight row wr (dw4 / mw4: their scales / minimums) into a against x row m.
template <int type, int bs>
inline void nib4_group(const uint8_t* wr, int64_t b, __m128 dw4, __m128 mw4, const int8_t* xqs, const float* xd,
                       const float* xs, Nib4Acc& a) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  constexpr int off = q8_offset(type);
  const __m256i s = nib4_dot<type, bs>(wr + b * bs, xqs + b * 32);
  const __m128 sc = _mm_mul_ps(dw4, _mm_loadu_ps(xd + b));
  a.acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set_m128(sc, sc), a.acc);
  if constexpr (off != 0) a.aoff = _mm_fmadd_ps(dw4, _mm_loadu_ps(xs + b), a.aoff);
  if constexpr (has_min) a.amin = _mm_fmadd_ps(mw4, _mm_loadu_ps(xs + b), a.amin);
}

// Block b alone (the tail): its exact int32 sum (offset included, by x's per-lane corrections).
template <int type, int bs>
inline void nib4_block(const uint8_t* wr, int64_t b, const int8_t* xqs, const int32_t* xc, const float* xd,
                       const float* xs, Nib4Acc& a) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  constexpr int off = q8_offset(type);
  const uint8_t* wb = wr + b * bs;
  __m256i p = ikj::dot4_u8s8(_mm256_setzero_si256(), wblock_avx2<type>(wb),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs + b * 32)));
  if constexpr (off != 0) p = _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + b * 8)));
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  const int si = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xb1)));
  a.tail += f16(wb) * xd[b] * static_cast<float>(si);
  if constexpr (has_min) a.tail += f16(wb + 2) * xs[b];
}

template <int type>
inline float nib4_total(const Nib4Acc& a) {
  constexpr int off = q8_offset(type);
  return hsum256(a.acc) - static_cast<float>(off) * hsum128(a.aoff) + hsum128(a.amin) + a.tail;
}

// Rows [n0, n1) of W against MM (2-3) x rows.
template <int type, int bs, int MM>
void decode_nib4(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                 int64_t n1, float* y, int64_t ldy, bool accumulate) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  const int64_t pf = decode_prefetch_bytes();
  const XRowsQ8<MM> x(xq, kb0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    Nib4Acc a[MM];
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
      for (int o = 0; o < 4 * bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + b * bs + pf + o), _MM_HINT_T0);
      const __m128 dw4 = f16x4<bs>(wr + b * bs);
      const __m128 mw4 = has_min ? f16x4<bs>(wr + b * bs + 2) : _mm_setzero_ps();
      for (int m = 0; m < MM; ++m) nib4_group<type, bs>(wr, b, dw4, mw4, x.q[m], x.d[m], x.s[m], a[m]);
    }
    for (; b < nb; ++b)
      for (int m = 0; m < MM; ++m) nib4_block<type, bs>(wr, b, x.q[m], x.c[m], x.d[m], x.s[m], a[m]);
    for (int m = 0; m < MM; ++m) {
      const float v = nib4_total<type>(a[m]);
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + v : v;
    }
  }
}

// M = 1: weight rows n and n + h (h = half the range: two sequential memory streams) per pass,
// sharing x's loads; the same operations per row as decode_nib4, so the same bits.
template <int type, int bs>
void decode_nib4_r2(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                    int64_t n1, float* y, bool accumulate) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  const XRowsQ8<1> x(xq, kb0);
  const int64_t h = (n1 - n0) / 2, pf = decode_prefetch_bytes();
  for (int64_t n = n0; n < n0 + h; ++n) {
    const uint8_t* wr[2] = {w + n * row_bytes, w + (n + h) * row_bytes};
    Nib4Acc a[2];
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4)
      for (int r = 0; r < 2; ++r) {
        for (int o = 0; o < 4 * bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + b * bs + pf + o), _MM_HINT_T0);
        const __m128 dw4 = f16x4<bs>(wr[r] + b * bs);
        const __m128 mw4 = has_min ? f16x4<bs>(wr[r] + b * bs + 2) : _mm_setzero_ps();
        nib4_group<type, bs>(wr[r], b, dw4, mw4, x.q[0], x.d[0], x.s[0], a[r]);
      }
    for (; b < nb; ++b)
      for (int r = 0; r < 2; ++r) nib4_block<type, bs>(wr[r], b, x.q[0], x.c[0], x.d[0], x.s[0], a[r]);
    for (int r = 0; r < 2; ++r) {
      const float v = nib4_total<type>(a[r]);
      float* dst = y + n + r * h;
      *dst = accumulate ? *dst + v : v;
    }
  }
  if ((n1 - n0) % 2) decode_nib4<type, bs, 1>(xq, kb0, nb, w, row_bytes, n0 + 2 * h, n1, y, 1, accumulate);
}

// Rows [n0, n1) of W against MM quantized x rows, blocks [kb0, kb0 + nb) (w at block kb0 of row
// 0). One block per step, steps alternating between two accumulators per row.
template <int type, int bs, int MM>
void decode_q8(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
               int64_t n1, float* y, int64_t ldy, bool accumulate) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  constexpr bool sgn = type == ikj::T_Q8_0 || type == ikj::T_IQ4_NL;
  constexpr int off = q8_offset(type);
  if constexpr (!sgn)
    if (nib4_on()) return decode_nib4<type, bs, MM>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
  const int64_t pf = decode_prefetch_bytes();
  const XRowsQ8<MM> xr(xq, kb0);
  const int8_t* const* xqs = xr.q;
  const float *const *xd = xr.d, *const *xs = xr.s;
  const int32_t* const* xc = xr.c;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MM][2];
    float accm[MM];
    for (int m = 0; m < MM; ++m) {
      acc[m][0] = acc[m][1] = _mm256_setzero_ps();
      accm[m] = 0.f;
    }
    auto step = [&](int64_t b, int a) {
      const uint8_t* wb = wr + b * bs;
      const __m256i wv = wblock_avx2<type>(wb);
      const __m256i uw = sgn ? _mm256_sign_epi8(wv, wv) : wv;  // |w| for the sign trick
      const float dw = f16(wb);
      for (int m = 0; m < MM; ++m) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs[m] + b * 32));
        if constexpr (sgn) xv = _mm256_sign_epi8(xv, wv);
        __m256i p = ikj::dot4_u8s8(_mm256_setzero_si256(), uw, xv);
        if constexpr (off != 0) p = _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc[m] + b * 8)));
        acc[m][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd[m][b]), acc[m][a]);
        if constexpr (has_min) accm[m] += f16(wb + 2) * xs[m][b];
      }
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      for (int o = 0; o < 2 * bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + b * bs + pf + o), _MM_HINT_T0);
      step(b, 0);
      step(b + 1, 1);
    }
    if (b < nb) step(b, 0);
    for (int m = 0; m < MM; ++m) {
      const float s = hsum256(_mm256_add_ps(acc[m][0], acc[m][1])) + accm[m];
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

// M = 1: two weight rows per pass (n and n + h, h = half the range: two sequential memory streams,
// as avx512's decode_q8_r2), sharing each block's load of x and its scale; four blocks' f16 scales
// converted at once. Same integer sums and float products as decode_q8<type, bs, 1>.
template <int type, int bs>
void decode_q8_r2(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                  int64_t n1, float* y, bool accumulate) {
  constexpr bool has_min = type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
  constexpr bool sgn = type == ikj::T_Q8_0 || type == ikj::T_IQ4_NL;
  constexpr int off = q8_offset(type);
  if constexpr (!sgn)
    if (nib4_on()) return decode_nib4_r2<type, bs>(xq, kb0, nb, w, row_bytes, n0, n1, y, accumulate);
  const int8_t* xqs = xq.q.data() + kb0 * 32;
  const int32_t* xc = xq.corr.data() + kb0 * 8;
  const float* xd = xq.d.data() + kb0;
  const float* xs = xq.ds.data() + kb0;
  const int64_t h = (n1 - n0) / 2, pf = decode_prefetch_bytes();
  for (int64_t n = n0; n < n0 + h; ++n) {
    const uint8_t* wr[2] = {w + n * row_bytes, w + (n + h) * row_bytes};
    __m256 acc[2][2];
    float accm[2] = {0.f, 0.f};
    for (int r = 0; r < 2; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    alignas(16) float sc[2][4];
    // one block of both rows into acc[.][a] (a a compile-time constant: with a run-time index the
    // accumulators lived in memory and the pass ran at half the speed)
    auto step = [&](int64_t b, auto a_c) {
      constexpr int a = decltype(a_c)::value;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs + b * 32));
      for (int r = 0; r < 2; ++r) {
        const uint8_t* wb = wr[r] + b * bs;
        const __m256i wv = wblock_avx2<type>(wb);
        __m256i xv = x0, uw = wv;
        if constexpr (sgn) xv = _mm256_sign_epi8(x0, wv), uw = _mm256_sign_epi8(wv, wv);
        __m256i p = ikj::dot4_u8s8(_mm256_setzero_si256(), uw, xv);
        if constexpr (off != 0) p = _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + b * 8)));
        acc[r][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sc[r][b % 4]), acc[r][a]);
        if constexpr (has_min) accm[r] += f16(wb + 2) * xs[b];
      }
    };
    for (int64_t b = 0; b < nb; b += 4) {  // dw * dx of (up to) 4 blocks of both rows, then the blocks
      const int nq = static_cast<int>(std::min<int64_t>(4, nb - b));
      const __m128 xdv = nq == 4 ? _mm_loadu_ps(xd + b) : _mm_setr_ps(xd[b], nq > 1 ? xd[b + 1] : 0.f, nq > 2 ? xd[b + 2] : 0.f, 0.f);
      for (int r = 0; r < 2; ++r) {  // (vpinsrw, not a store of 4 halves and a 16-byte load: that
                                     // load cannot take its data from the narrow stores)
        const uint8_t* p0 = wr[r] + b * bs;
        for (int o = 0; o < 4 * bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p0 + pf + o), _MM_HINT_T0);
        const __m128i hv = _mm_setr_epi16(static_cast<short>(load_u16(p0)), static_cast<short>(nq > 1 ? load_u16(p0 + bs) : 0),
                                          static_cast<short>(nq > 2 ? load_u16(p0 + 2 * bs) : 0),
                                          static_cast<short>(nq > 3 ? load_u16(p0 + 3 * bs) : 0), 0, 0, 0, 0);
        _mm_store_ps(sc[r], _mm_mul_ps(_mm_cvtph_ps(hv), xdv));
      }
      if (nq == 4) {
        step(b, std::integral_constant<int, 0>());
        step(b + 1, std::integral_constant<int, 1>());
        step(b + 2, std::integral_constant<int, 0>());
        step(b + 3, std::integral_constant<int, 1>());
      } else {  // the last 1-3 blocks on the accumulators decode_q8 gives them (by the block's
                // parity): the same sums in the same order, so a row alone (this pass) and in a
                // batch of 2-3 (decode_q8<type, bs, MM>) get the same bits
        step(b, std::integral_constant<int, 0>());
        if (nq > 1) step(b + 1, std::integral_constant<int, 1>());
        if (nq > 2) step(b + 2, std::integral_constant<int, 0>());
      }
    }
    for (int r = 0; r < 2; ++r) {
      const float s = hsum256(_mm256_add_ps(acc[r][0], acc[r][1])) + accm[r];
      float* dst = y + n + r * h;
      *dst = accumulate ? *dst + s : s;
    }
  }
  if ((n1 - n0) % 2) decode_q8<type, bs, 1>(xq, kb0, nb, w, row_bytes, n0 + 2 * h, n1, y, 1, accumulate);
}

// ---- K-quants (Q2_K..Q6_K, IQ4_XS) in the int8-activation decode at the avx2 level ------------
//
// x in blocks of 32 in x's order with one scale per super-block of 256 (quantize_x8; Q8_K's
// grouping, where the avx512 level's decode keeps one per 32). Each super-block's 8 blocks of 32
// weights are formed in registers in x's order (the per-type layouts below), multiplied by
// vpmaddubsw (weights the unsigned operand, x signed: pairs of i16) and summed in pairs by vpmaddwd
// against the sub-block scales as int16 (lanes 0-7 the scale of weights 0-15, 8-15 that of 16-31),
// so a block's 8 int32 lanes carry scale * q * q_x exactly; the 8 blocks' lanes add up in int32
// (|sum| < 2^24 for every type: exact, also as a float), then one convert and one FMA by d * dx per
// super-block (per 32 before: 1.14-1.24x slower than ik's Q8_K decode, RESULTS §26b). Signed weights
// (Q3_K, Q6_K, IQ4_XS) take ggml's sign trick (|w| and sign(x, w)); i16 pair sums stay below
// 2 * 127 * 127. Q4_K / Q5_K / Q2_K keep unsigned codes and subtract the minimum's share
// dmin * min * dx * sum(q_x) per 32 (per 16 for Q2_K: XQ8::ds16) in float, as the avx512 level does.
template <int type>
struct KqBlocks {
  __m256i q[8];        // unsigned operand: codes, or |w| for the signed types
  __m256i sg[8];       // signed types: the weights (the sign source)
  __m256i sc[8];       // int16 scales, lanes 0-7 / 8-15
  float d = 0.f;       // super-block scale
  __m256 mn[2];        // dmin * min per 32 (mn[0]) or per 16 (mn[0..1]); minimum types only
  int s32[8];          // IQ4_XS: the scale of each block of 32 (the prompt engine's)
  __m256 dsc;          // Q4_K / Q5_K: d * scale of each block of 32 (the prompt engine's)
};

inline __m256i sc16_pair(int a, int b) { return _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(a)), _mm_set1_epi16(static_cast<int16_t>(b))); }

// prompt: for the prompt engine's panels, which take s32 and not the int16 scale vectors
template <int type, bool prompt = false>
inline void kq_unpack(const uint8_t* s, KqBlocks<type>& o) {
  const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  if constexpr (type == ikj::T_Q4_K || type == ikj::T_Q5_K) {
    o.d = f16(s);
    const float dmin = f16(s + 2);
    const uint8_t* sc = s + 4;
    // the 12 bytes as 32-bit words: 8 6-bit scales (words 0-1) and 8 mins (words 2-3) as bytes, in
    // registers (the scalar per-byte decode stored ints that one wide load then read back: a
    // failed store forward per super-block, half the panel build's time)
    uint32_t u[4];
    std::memcpy(u, sc, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mlo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mlo;
    u[0] &= k1;
    const __m128i sm = _mm_setr_epi32(static_cast<int>(u[0]), static_cast<int>(u[1]), static_cast<int>(u[2]), static_cast<int>(u[3]));
    if constexpr (!prompt) {  // block j's scale into every word: one vpshufb of the 8 as int16 each
      const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
      for (int j = 0; j < 8; ++j) o.sc[j] = _mm256_shuffle_epi8(s16, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j)));
    }
    o.dsc = _mm256_mul_ps(_mm256_set1_ps(o.d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    o.mn[0] = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
    const uint8_t* qs = s + (type == ikj::T_Q4_K ? 16 : 48);
    __m256i qh = type == ikj::T_Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {  // bytes 32g..: low nibbles block 2g, high nibbles block 2g + 1
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
      o.q[2 * g] = _mm256_and_si256(raw, m4);
      o.q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if constexpr (type == ikj::T_Q5_K) {  // bit j of qh[l]: + 16 on weight l of block j
        o.q[2 * g] = _mm256_or_si256(o.q[2 * g], _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        o.q[2 * g + 1] = _mm256_or_si256(o.q[2 * g + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
        qh = _mm256_srli_epi16(qh, 2);
      }
    }
  } else if constexpr (type == ikj::T_Q6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(s + 192);
    o.d = f16(s + 208);
    const __m256i m32 = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64 * n));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64 * n + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 128 + 32 * n));
      const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
      for (int t = 0; t < 4; ++t) {  // block 4n + t: ql nibble, qh bits 2t, 2t + 1 -> bits 4, 5
        const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * t), m3), 4);
        const __m256i w = _mm256_sub_epi8(_mm256_or_si256(lo[t], hb), m32);
        o.sg[4 * n + t] = w;
        o.q[4 * n + t] = _mm256_sign_epi8(w, w);
        o.sc[4 * n + t] = sc16_pair(sc[8 * n + 2 * t], sc[8 * n + 2 * t + 1]);
      }
    }
  } else if constexpr (type == ikj::T_Q3_K || type == ikj::T_Q2_K) {
    const uint8_t* qs = s + (type == ikj::T_Q3_K ? 32 : 16);
    int scl[16];
    if constexpr (type == ikj::T_Q3_K) {
      o.d = f16(s + 108);
      const uint8_t* sc = s + 96;
      for (int k = 0; k < 16; ++k)
        scl[k] = ((k < 8 ? (sc[k] & 0xf) : (sc[k - 8] >> 4)) | (((sc[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
    } else {
      o.d = f16(s + 80);
      for (int k = 0; k < 16; ++k) scl[k] = s[k] & 0xf;
      const __m256 dm = _mm256_set1_ps(f16(s + 82));
      const __m128i mb = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)), 4), _mm_set1_epi8(0x0f));
      o.mn[0] = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mb)));
      o.mn[1] = _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mb, 8))));
    }
    const __m256i hm = type == ikj::T_Q3_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)) : _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * n));
      for (int j = 0; j < 4; ++j, x = _mm256_srli_epi16(x, 2)) {  // block 4n + j: bits 2j of qs[32n + l]
        const int b = 4 * n + j;
        __m256i v = _mm256_and_si256(x, m3);
        if constexpr (type == ikj::T_Q3_K) {  // hmask bit b set: value = low bits, clear: - 4
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << b));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
          v = _mm256_sub_epi8(v, _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
          o.sg[b] = v;
          o.q[b] = _mm256_sign_epi8(v, v);
        } else {
          o.q[b] = v;
        }
        o.sc[b] = sc16_pair(scl[2 * b], scl[2 * b + 1]);
      }
    }
  } else {  // IQ4_XS
    o.d = f16(s);
    const unsigned sh = load_u16(s + 2);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl)));
    for (int j = 0; j < 8; ++j) {
      const int ls = ((s[4 + j / 2] >> (4 * (j % 2))) & 0xf) | (((sh >> (2 * j)) & 3) << 4);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8 + 16 * j));
      const __m256i w = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4));
      o.sg[j] = w;
      if constexpr (!prompt) {
        o.q[j] = _mm256_sign_epi8(w, w);
        o.sc[j] = _mm256_set1_epi16(static_cast<int16_t>(ls - 32));
      }
      o.s32[j] = ls - 32;
    }
  }
}

// IQ4_XS's 8 block scales of a super-block (6 bits: 4 in scales_l, 2 in scales_h) as int16 - 32, in
// both 128-bit lanes: two pdep and one widening instead of 8 scalar decodes and broadcasts
inline __m256i iq4xs_scales16(const uint8_t* s) {
  const uint64_t ls = _pdep_u64(load_u32(s + 4), 0x0f0f0f0f0f0f0f0fULL) | _pdep_u64(load_u16(s + 2), 0x3030303030303030ULL);
  const __m128i v = _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(ls))), _mm_set1_epi16(32));
  return _mm256_broadcastsi128_si256(v);
}

// IQ4_XS at the decode (decode_kqa's arithmetic and sums, exact): two blocks' codes from one
// 32-byte load, split into blocks by a 128-bit permute, the values by one table lookup; block j's
// scale by one vpshufb of the vector of 8 (iq4xs_scales16) in place of a scalar decode and a
// broadcast per block; the weights prefetched ahead. 1408 x 2048, M = 1, one thread: 1.15x the
// kq_unpack form (L3-resident), 1.3x on DRAM-resident rows (RESULTS §26e). (|w| by a second lookup
// in place of vpsignb, and two rows per pass, measured the same.)
template <int MM>
void decode_iq4xs(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                  int64_t n1, float* y, int64_t ldy, bool accumulate) {
  constexpr int64_t bs = 136;
  const int64_t nsb = nb / 8, pf = decode_prefetch_bytes();
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl)));
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const int8_t* xqs[MM];
  const float* xd[MM];
  for (int m = 0; m < MM; ++m) {
    xqs[m] = xq.q.data() + (m * xq.nb + kb0) * 32;
    xd[m] = xq.d.data() + m * xq.nb + kb0;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MM];
    for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* s = wr + sb * bs;
      for (int o = 0; o < bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(s + pf + o), _MM_HINT_T0);
      const __m256i sc8 = iq4xs_scales16(s);
      __m256i is[MM];
      for (int m = 0; m < MM; ++m) is[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 8 + 16 * j));
        const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        for (int t = 0; t < 2; ++t) {
          const __m256i idx = t == 0 ? _mm256_permute2x128_si256(lo, hi, 0x20) : _mm256_permute2x128_si256(lo, hi, 0x31);
          const __m256i wv = _mm256_shuffle_epi8(tab, idx), aw = _mm256_sign_epi8(wv, wv);
          const __m256i sc = _mm256_shuffle_epi8(sc8, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (j + t))));
          for (int m = 0; m < MM; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs[m] + (8 * sb + j + t) * 32));
            is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), sc));
          }
        }
      }
      const float d = f16(s);
      for (int m = 0; m < MM; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_set1_ps(d * xd[m][8 * sb]), acc[m]);
    }
    for (int m = 0; m < MM; ++m) {
      const float sum = hsum256(acc[m]);
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + sum : sum;
    }
  }
}

// Rows [n0, n1) of W (w at super-block kb0 / 8 of row 0) against MM quantized x rows, 32-blocks
// [kb0, kb0 + nb) (nb a multiple of 8).
template <int type, int MM>
void decode_kqa(const XQ8& xq, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes, int64_t n0,
                int64_t n1, float* y, int64_t ldy, bool accumulate) {
  if constexpr (type == ikj::T_IQ4_XS) return decode_iq4xs<MM>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate);
  constexpr int bs = type == ikj::T_Q2_K ? 84 : type == ikj::T_Q3_K ? 110 : type == ikj::T_Q4_K ? 144
                   : type == ikj::T_Q5_K ? 176 : type == ikj::T_Q6_K ? 210 : 136;
  constexpr bool sgn = type == ikj::T_Q3_K || type == ikj::T_Q6_K || type == ikj::T_IQ4_XS;
  constexpr bool min32 = type == ikj::T_Q4_K || type == ikj::T_Q5_K, min16 = type == ikj::T_Q2_K;
  const int64_t nsb = nb / 8, pf = decode_prefetch_bytes();
  const int8_t* xqs[MM];
  const float *xd[MM], *xs[MM];
  for (int m = 0; m < MM; ++m) {
    xqs[m] = xq.q.data() + (m * xq.nb + kb0) * 32;
    xd[m] = xq.d.data() + m * xq.nb + kb0;
    xs[m] = min16 ? xq.ds16.data() + 2 * (m * xq.nb + kb0) : xq.ds.data() + m * xq.nb + kb0;
  }
  KqBlocks<type> kb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    __m256 acc[MM], accm[MM];
    for (int m = 0; m < MM; ++m) acc[m] = accm[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int o = 0; o < bs; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + sb * bs + pf + o), _MM_HINT_T0);
      kq_unpack<type>(wr + sb * bs, kb);
      // x's one scale per super-block (quantize_x8): the 8 blocks' int32 sums add up exactly
      // (|sum| < 2^24 for every type) before one convert and one FMA by d * dx
      __m256i is[MM];
      for (int m = 0; m < MM; ++m) is[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        for (int m = 0; m < MM; ++m) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xqs[m] + (8 * sb + j) * 32));
          if constexpr (sgn) xv = _mm256_sign_epi8(xv, kb.sg[j]);
          is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(_mm256_maddubs_epi16(kb.q[j], xv), kb.sc[j]));
        }
      for (int m = 0; m < MM; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[m]), _mm256_set1_ps(kb.d * xd[m][8 * sb]), acc[m]);
      for (int m = 0; m < MM; ++m) {
        if constexpr (min32) accm[m] = _mm256_fmadd_ps(kb.mn[0], _mm256_loadu_ps(xs[m] + 8 * sb), accm[m]);
        if constexpr (min16) {
          accm[m] = _mm256_fmadd_ps(kb.mn[0], _mm256_loadu_ps(xs[m] + 16 * sb), accm[m]);
          accm[m] = _mm256_fmadd_ps(kb.mn[1], _mm256_loadu_ps(xs[m] + 16 * sb + 8), accm[m]);
        }
      }
    }
    for (int m = 0; m < MM; ++m) {
      const float s = hsum256(_mm256_sub_ps(acc[m], accm[m]));
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}
#endif  // IKJ_Q8DOT_512 / AVX2

#if defined(IKJ_HAVE_Q8DOT)
template <int type, int bs>
void decode_q8_m(const XQ8& xq, int64_t M, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes,
                 int64_t n0, int64_t n1, float* y, int64_t ldy, bool accumulate) {
  w += kb0 * bs;  // legacy rows are plain sequences of equal blocks
  switch (M) {
    case 1:
      return decode_q8_r2<type, bs>(xq, kb0, nb, w, row_bytes, n0, n1, y, accumulate);
    case 2: decode_q8<type, bs, 2>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    default: decode_q8<type, bs, 3>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
  }
}

#if defined(IKJ_Q8DOT_512) || defined(IKJ_HAVE_Q8DOT)
template <int type, int bs>
void decode_kq8_m(const XQ8& xq, int64_t M, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes,
                  int64_t n0, int64_t n1, float* y, int64_t ldy, bool accumulate) {
  w += kb0 / 8 * bs;  // K-quant rows are plain sequences of super-blocks of 8 x 32
#if !defined(IKJ_Q8DOT_512)
  switch (M) {
    case 1: decode_kqa<type, 1>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case 2: decode_kqa<type, 2>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    default: decode_kqa<type, 3>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
  }
#else
  if constexpr (kq2_type(type)) {
    switch (M) {
      case 1: decode_kq2<type, 1>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
      case 2: decode_kq2<type, 2>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
      default: decode_kq2<type, 3>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    }
  } else {
    switch (M) {
      case 1: decode_kq8<type, 1>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
      case 2: decode_kq8<type, 2>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
      default: decode_kq8<type, 3>(xq, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    }
  }
#endif
}
#endif

// y rows [0, M) (M <= 3), columns [n0, n1), from the quantized x's blocks [kb0, kb0 + nb) (kb0 a
// multiple of 4: the K-split decode's chunks are multiples of 256 values).
void decode_q8_rows(const XQ8& xq, int64_t M, int64_t kb0, int64_t nb, const uint8_t* w, int64_t row_bytes,
                    int type, int64_t n0, int64_t n1, float* y, int64_t ldy, bool accumulate) {
  switch (type) {
    case ikj::T_Q8_0: decode_q8_m<ikj::T_Q8_0, 34>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q4_0: decode_q8_m<ikj::T_Q4_0, 18>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q4_1: decode_q8_m<ikj::T_Q4_1, 20>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q5_0: decode_q8_m<ikj::T_Q5_0, 22>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q5_1: decode_q8_m<ikj::T_Q5_1, 24>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_IQ4_NL: decode_q8_m<ikj::T_IQ4_NL, 18>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
#if defined(IKJ_HAVE_Q8DOT)
    case ikj::T_Q2_K: decode_kq8_m<ikj::T_Q2_K, 84>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q3_K: decode_kq8_m<ikj::T_Q3_K, 110>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q4_K: decode_kq8_m<ikj::T_Q4_K, 144>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q5_K: decode_kq8_m<ikj::T_Q5_K, 176>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_Q6_K: decode_kq8_m<ikj::T_Q6_K, 210>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
    case ikj::T_IQ4_XS: decode_kq8_m<ikj::T_IQ4_XS, 136>(xq, M, kb0, nb, w, row_bytes, n0, n1, y, ldy, accumulate); return;
#endif
    default: return;
  }
}
#endif

// Few rows of x: dequantize each weight row (the K range [k0, k1) of it, block aligned) and dot it
// with every x row. y[m * ldy + n] = (accumulate ? y : 0) + dot.
void decode_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                 int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* y, int64_t ldy, bool accumulate,
                 int compute) {
  thread_local std::vector<float> buf, xr;
  const int64_t Kc = k1 - k0;
  const float* xs = x;
  int64_t ldx = K;
  if (compute == QM_BF16) {  // x rounded to bf16 once
    if (static_cast<int64_t>(xr.size()) < M * Kc) xr.resize(M * Kc);
    for (int64_t m = 0; m < M; ++m) {
      std::memcpy(xr.data() + m * Kc, x + m * K + k0, Kc * 4);
      round_bf16_inplace(xr.data() + m * Kc, Kc);
    }
    xs = xr.data();
    ldx = Kc;
  } else {
    xs = x + k0;
  }
  // a K sub-range starts at a byte offset proportional to it (callers split K only for types
  // whose rows are plain sequences of blocks)
  const int64_t off = K ? row_bytes / (K / Kc) * (k0 / Kc) : 0;
#if defined(__AVX512F__)
  if (compute == QM_F32 && try_decode_fused(xs, M, ldx, Kc, w + off, row_bytes, type, n0, n1, y, ldy, accumulate))
    return;
#endif
  if (static_cast<int64_t>(buf.size()) < K) buf.resize(K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes + off;
    const float* wf;
    if (type == ikj::T_F32 && compute != QM_BF16) {
      wf = reinterpret_cast<const float*>(wr);
    } else {
      dequant_row(type, wr, Kc, buf.data());
      if (compute == QM_BF16) round_bf16_inplace(buf.data(), Kc);
      wf = buf.data();
    }
    for (int64_t m = 0; m < M; ++m) {
      float s = hsum_dot(wf, xs + m * ldx, Kc);
      float* dst = y + m * ldy + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

// ---- prompt engine: packed panels + register-blocked microkernel -----------------------------

#if defined(__AVX512F__)
constexpr int NR = 32;  // panel width: 2 zmm of output columns
constexpr int MR = 8;   // rows of x per microkernel: 16 zmm accumulators
#elif defined(__AVX2__)
constexpr int NR = 16;  // 2 ymm
constexpr int MR = 6;   // 12 ymm accumulators
#else
constexpr int NR = 16;
constexpr int MR = 4;
#endif
#ifndef IKJ_QM_KC
#define IKJ_QM_KC 256
#endif
constexpr int64_t KC = IKJ_QM_KC;

// Call f(integral_constant<int, mr>) for a run-time mr in [1, Max]: a microkernel's row count as a
// template argument.
template <int Max, int R = 1, typename F>
void for_rows(int mr, F&& f) {
  if constexpr (R <= Max) {
    if (mr == R) {
      f(std::integral_constant<int, R>());
      return;
    }
    for_rows<Max, R + 1>(mr, f);
  }
}  // K chunk: a 32 KiB (f32) or 16 KiB (bf16) panel slice, L1-resident (256 beat 128 and none on Xeon)

// C[mr][NR] (row stride ldc) (+)= A x Bp: A packed [K][MR] (rows of x interleaved), Bp [K][NR]
// (packed f32 panel); acc_c adds to C (K chunks after the first).
template <int mr>
void micro_f32(const float* A, const float* Bp, int64_t K, float* C, int64_t ldc, bool acc_c) {
#if defined(__AVX512F__)
  __m512 acc0[mr], acc1[mr];
  for (int i = 0; i < mr; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b0 = _mm512_loadu_ps(Bp + k * NR), b1 = _mm512_loadu_ps(Bp + k * NR + 16);
    for (int i = 0; i < mr; ++i) {
      __m512 a = _mm512_set1_ps(A[k * MR + i]);
      acc0[i] = _mm512_fmadd_ps(a, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(a, b1, acc1[i]);
    }
  }
  for (int i = 0; i < mr; ++i) {
    if (acc_c) {
      acc0[i] = _mm512_add_ps(acc0[i], _mm512_loadu_ps(C + i * ldc));
      acc1[i] = _mm512_add_ps(acc1[i], _mm512_loadu_ps(C + i * ldc + 16));
    }
    _mm512_storeu_ps(C + i * ldc, acc0[i]);
    _mm512_storeu_ps(C + i * ldc + 16, acc1[i]);
  }
#elif defined(__AVX2__)
  __m256 acc0[mr], acc1[mr];
  for (int i = 0; i < mr; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0 = _mm256_loadu_ps(Bp + k * NR), b1 = _mm256_loadu_ps(Bp + k * NR + 8);
    for (int i = 0; i < mr; ++i) {
      __m256 a = _mm256_broadcast_ss(A + k * MR + i);
      acc0[i] = _mm256_fmadd_ps(a, b0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(a, b1, acc1[i]);
    }
  }
  for (int i = 0; i < mr; ++i) {
    if (acc_c) {
      acc0[i] = _mm256_add_ps(acc0[i], _mm256_loadu_ps(C + i * ldc));
      acc1[i] = _mm256_add_ps(acc1[i], _mm256_loadu_ps(C + i * ldc + 8));
    }
    _mm256_storeu_ps(C + i * ldc, acc0[i]);
    _mm256_storeu_ps(C + i * ldc + 8, acc1[i]);
  }
#else
  float acc[mr][NR];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float* b = Bp + k * NR;
    for (int i = 0; i < mr; ++i) {
      const float a = A[k * MR + i];
      for (int j = 0; j < NR; ++j) acc[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NR; ++j) C[i * ldc + j] = acc_c ? C[i * ldc + j] + acc[i][j] : acc[i][j];
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16: A as bf16 pairs packed [K/2][MR] (u32 each), Bp as [K/2][NR][2] bf16; f32 accumulation.
template <int mr>
void micro_bf16(const uint32_t* A, const uint16_t* Bp, int64_t Kp, float* C, int64_t ldc, bool acc_c) {
  __m512 acc0[mr], acc1[mr];
  for (int i = 0; i < mr; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; ++k) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(Bp + k * 2 * NR);
    __m512bh b1 = (__m512bh)_mm512_loadu_si512(Bp + k * 2 * NR + 32);
    for (int i = 0; i < mr; ++i) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(A[k * MR + i]));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], a, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], a, b1);
    }
  }
  for (int i = 0; i < mr; ++i) {
    if (acc_c) {
      acc0[i] = _mm512_add_ps(acc0[i], _mm512_loadu_ps(C + i * ldc));
      acc1[i] = _mm512_add_ps(acc1[i], _mm512_loadu_ps(C + i * ldc + 16));
    }
    _mm512_storeu_ps(C + i * ldc, acc0[i]);
    _mm512_storeu_ps(C + i * ldc + 16, acc1[i]);
  }
}
#define IKJ_HAVE_DPBF16 1
#endif

#if defined(IKJ_HAVE_DPBF16)
// n floats -> ceil(n / 2) bf16 pairs (u32: value 2p in the low half, 2p + 1 in the high half; a
// missing last value is 0), round to nearest even as ikj::f32_to_bf16 (vcvtne2ps2bf16).
inline void to_bf16_pairs(const float* r, int64_t n, uint32_t* out) {
  int64_t k = 0;
  for (; k + 32 <= n; k += 32)
    _mm512_storeu_si512(out + k / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + k + 16), _mm512_loadu_ps(r + k)));
  if (k < n) {
    const int64_t left = n - k;
    const __mmask16 m0 = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, r + k + 16), _mm512_maskz_loadu_ps(m0, r + k));
    _mm512_mask_storeu_epi32(out + k / 2, static_cast<__mmask16>((1u << ((left + 1) / 2)) - 1), v);
  }
}

// rows[i] (i < 16; null: zeros) are bf16-pair rows of Kp u32; writes out[kp * ld + i] for kp < Kp
// (16 columns i = the 16 rows), 16 pairs at a time through the register transpose.
inline void scatter_pairs16(const uint32_t* const rows[16], int64_t Kp, uint32_t* out, int64_t ld, int width) {
  for (int64_t kp0 = 0; kp0 < Kp; kp0 += 16) {
    const int64_t w = std::min<int64_t>(16, Kp - kp0);
    const __mmask16 m = static_cast<__mmask16>((1u << w) - 1);
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_maskz_loadu_epi32(m, rows[i] + kp0) : _mm512_setzero_si512();
    transpose16x16(r);
    const __mmask16 wm = static_cast<__mmask16>((1u << width) - 1);
    for (int64_t c = 0; c < w; ++c) _mm512_mask_storeu_epi32(out + (kp0 + c) * ld, wm, r[c]);
  }
}
#endif

// ---- int8 prompt engine (compute = bf16, Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL, avx512 VNNI) -
//
// As ik_llama.cpp does for prompts: x quantized per row to 8-bit blocks of 32 (dx = max|x| / 127,
// round to nearest even, as the int8 decode), the weights' own int8 values (Q8_0 as stored, Q4_0's
// nibble - 8, Q5_0's 5-bit code - 16, IQ4_NL's table value, Q4_1's nibble and Q5_1's 5-bit code as
// they are) used directly by vpdpbusd, and each block's int32 sum scaled by dw * dx in float. Q4_1
// and Q5_1 add their minimum's share m * dx * sum(q_x) per block (as ik does with q8_1's block
// sums): the x8 pack carries dx * sum(q_x) per block, the panel each row's m next to its d, one FMA
// more per accumulator and block. No
// dequantized f32/bf16 panel: a panel of 32 weight rows is only re-laid out as [block][quad][row]
// (4 bytes of each row per 32-bit lane, 16 rows per zmm) through the 16 x 16 register transpose,
// with each block's 16-row dw vector and sum(w) next to it. vpdpbusd takes u8 x s8, so x is stored
// as q + 128 (1..255) and its offset is removed exactly by starting every block's int32 sum at
// -128 * sum(w) of that row's block. The microkernel broadcasts 4 bytes of one x row and
// multiplies them into 32 weight rows (2 zmm), MQ x rows at a time, 8 quads per block; per block
// one convert and one FMA per accumulator. Same arithmetic as the int8 decode, so the same stated
// tolerance (tests/test_cpu_quant_matmul.py X8_TOL); the bf16 panel's build (dequantize, convert,
// transpose) was ~25 % of an expert's prompt product, and vpdpbusd does 64 MACs an instruction
// against dpbf16's 32.
#if defined(IKJ_Q8DOT_512) && defined(IKJ_HAVE_DPBF16)
#define IKJ_HAVE_Q8GEMM 1
constexpr int QNR = 32;            // weight rows per panel (2 zmm of 16 rows)
constexpr int MQ = 4;              // x rows per microkernel: 8 int32 + 8 f32 accumulators
constexpr int64_t QBLK = 1280;     // panel bytes per block: 2 x 8 quads x 64, 2 x 64 -128*sum(w), 2 x 64 dw
constexpr int64_t QBLK_MIN = 1408; // the same + 2 x 64 mw (types with a minimum)
constexpr int64_t QKB = 8;         // blocks per K chunk: a 10 KiB slice of the panel, L1-resident
constexpr int64_t QUNIT = QNR;    // output columns per unit of quant_matmul_ex's thread split

static_assert(QBLK == amx::kBlk && QBLK_MIN == amx::kBlkMin && QNR == amx::kPanelRows, "cpu_amx.h's panel layout");

// Q4_K / Q5_K / IQ4_XS (one scale per 32 weights: wvals / wscale below; the scalar amx::build_panel
// is their reference) take it too. At the amx level (this code plus AMX tiles, cpu_amx.h) prompt
// products of ikj::amx_min_rows() rows or more (cpu/isa.h) run on the tiles, fewer through micro_q8 below (the same
// panels); at the avx512 level all of them run through micro_q8 (its bf16 panels for these types ran
// at 0.51x ik's native build on a Sapphire Rapids host at -t 16, RESULTS §26g, against 1.09-1.18x
// for the amx level's same panels).
inline bool q8gemm_type(int type) {
  if (type == ikj::T_Q4_K || type == ikj::T_Q5_K || type == ikj::T_IQ4_XS) return true;
  return type == ikj::T_Q8_0 || type == ikj::T_Q4_0 || type == ikj::T_Q5_0 || type == ikj::T_IQ4_NL ||
         type == ikj::T_Q4_1 || type == ikj::T_Q5_1;
}
constexpr bool q8gemm_k256(int) { return false; }  // x per 256 (QM_Q8K): the avx2 engine's IQ4_XS only
inline bool iq4xs_k256() { return false; }
constexpr bool q8gemm_min(int type) {
  return type == ikj::T_Q4_1 || type == ikj::T_Q5_1 || type == ikj::T_Q4_K || type == ikj::T_Q5_K;
}

// x8 pack: [M][K] bytes q + 128, then (64-byte aligned) [M][K / 32] floats dx, then [M][K / 32]
// floats dx * sum(q) (the minimum's share; one layout for every type, so a pack serves any weight).
inline int64_t x8_dx_offset(int64_t M, int64_t K) { return (M * K + 63) / 64 * 64; }
inline int64_t x8_ds_offset(int64_t M, int64_t K) { return x8_dx_offset(M, K) + M * (K / 32) * 4; }
#if defined(IKJ_HAVE_AMX_BF16)
// the amx level's bf16 form (cpu_amx.h): after them, 64-byte aligned, x as bf16 rows
// [bf_rows(M)][bf_ld(K)] (written only where bf16_tiles(M))
inline int64_t x8_bf_offset(int64_t M, int64_t K) { return (x8_ds_offset(M, K) + M * (K / 32) * 4 + 63) / 64 * 64; }
inline size_t x8_bytes(int64_t M, int64_t K) { return x8_bf_offset(M, K) + amx::bf_rows(M) * amx::bf_ld(K) * 2; }
// whether a product of M rows runs on bf16 tiles: the pack writes its bf16 rows, the gemm reads them
inline bool bf16_tiles(int64_t M) { return M >= ikj::amx_min_rows() && ikj::amx_bf16_on(); }
#else
inline size_t x8_bytes(int64_t M, int64_t K) { return x8_ds_offset(M, K) + M * (K / 32) * 4; }
#endif

// rows [r0, r1) of x [M, K] into the x8 pack at out (K a multiple of 32)
void pack_x8(const float* x, int64_t M, int64_t K, uint8_t* out, int64_t r0, int64_t r1, bool /*k256: never here*/ = false) {
  const int64_t nb = K / 32;
#if defined(IKJ_HAVE_AMX_BF16)
  if (bf16_tiles(M)) {  // the bf16 rows (vcvtneps2bf16), the padding rows zero with the last rows
    uint16_t* xb = reinterpret_cast<uint16_t*>(out + x8_bf_offset(M, K));
    const int64_t ld = amx::bf_ld(K);
    for (int64_t m = r0; m < r1; ++m)
      for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + m * ld + k),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + k))));
    if (r0 < r1 && r1 == M)  // (one writer: the thread whose rows end the pack)
      std::memset(xb + M * ld, 0, static_cast<size_t>((amx::bf_rows(M) - M) * ld * 2));
  }
#endif
  float* dx = reinterpret_cast<float*>(out + x8_dx_offset(M, K));
  float* ds = reinterpret_cast<float*>(out + x8_ds_offset(M, K));
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t m = r0; m < r1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i s0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), s1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      const int32_t sq = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
      const __m512i q0 = _mm512_add_epi32(s0, bias), q1 = _mm512_add_epi32(s1, bias);
      uint8_t* o = out + m * K + b * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm512_cvtepi32_epi8(q1));
      // a NaN in the block (which max drops) makes its scale NaN, so it reaches y as in f32
      const bool nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
      dx[m * nb + b] = nan || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
      ds[m * nb + b] = dx[m * nb + b] * static_cast<float>(sq);
    }
}

// One block's 32 signed weight values in order (the dequantized value / d, exactly).
template <int type>
inline __m256i wsigned(const uint8_t* blk) {
  if constexpr (type == ikj::T_Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {  // value j in the low nibble of byte j, j + 16 in its high nibble
    constexpr int qoff = type == ikj::T_Q5_0 ? 6 : type == ikj::T_Q4_1 ? 4 : type == ikj::T_Q5_1 ? 8 : 2;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qoff));
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f));
    if constexpr (type == ikj::T_IQ4_NL)  // kIq4nl[nibble]
      return _mm256_shuffle_epi8(
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nl))), v);
    if constexpr (type == ikj::T_Q5_0) {  // bit j of qh (bytes 2-5): + 16 on value j; minus 16
      v = _mm256_mask_add_epi8(v, _cvtu32_mask32(load_u32(blk + 2)), v, _mm256_set1_epi8(16));
      return _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    }
    if constexpr (type == ikj::T_Q5_1)  // bit j of qh (bytes 4-7): + 16 on value j (codes 0..31)
      return _mm256_mask_add_epi8(v, _cvtu32_mask32(load_u32(blk + 4)), v, _mm256_set1_epi8(16));
    if constexpr (type == ikj::T_Q4_1) return v;  // codes 0..15 (the minimum is added apart)
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));  // Q4_0
  }
}

constexpr bool q8gemm_kq(int type) { return type == ikj::T_Q4_K || type == ikj::T_Q5_K || type == ikj::T_IQ4_XS; }

// Block b (32 weights) of a row of `type` (bs bytes per block; the K-quants' per super-block of 256,
// whose block b is sub-block b % 8 of super-block b / 8, the amx level's only): its 32 values in
// order, and (wscale) its dw and mw, the dequantized value being dw * v + mw. The K-quants' as
// amx::build_panel (cpu_kernel_amx.cc) forms them, which the tests compare against.
template <int type, int bs>
inline __m256i wvals(const uint8_t* row, int64_t b) {
  if constexpr (type == ikj::T_Q4_K || type == ikj::T_Q5_K) {
    const uint8_t* p = row + (b / 8) * bs;
    const int s = static_cast<int>(b % 8);
    // sub-blocks 2i / 2i + 1: the low / high nibbles of the 32 bytes at qs + 32 i
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (type == ikj::T_Q5_K ? 48 : 16) + 32 * (s / 2)));
    __m256i v = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (s & 1))), _mm256_set1_epi8(0x0f));
    if constexpr (type == ikj::T_Q5_K) {  // + 16 where bit s of qh[l] (32 bytes at 16) is set
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
      const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1));
      v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
    }
    return v;
  } else if constexpr (type == ikj::T_IQ4_XS) {  // sub-block s: an IQ4_NL block's 16 bytes at 8 + 16 s
    return wsigned<ikj::T_IQ4_NL>(row + (b / 8) * bs + 8 + 16 * (b % 8) - 2);  // (wsigned reads at blk + 2)
  } else {
    return wsigned<type>(row + b * bs);
  }
}
template <int type, int bs>
inline void wscale(const uint8_t* row, int64_t b, float& dw, float& mw) {
  mw = 0.f;
  if constexpr (type == ikj::T_Q4_K || type == ikj::T_Q5_K) {
    const uint8_t* p = row + (b / 8) * bs;
    const uint8_t* q = p + 4;  // 12 scale bytes: ggml's get_scale_min_k4
    const int j = static_cast<int>(b % 8);
    const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    dw = f16(p) * static_cast<float>(sc);
    mw = -f16(p + 2) * static_cast<float>(m);
  } else if constexpr (type == ikj::T_IQ4_XS) {
    const uint8_t* p = row + (b / 8) * bs;
    const int s = static_cast<int>(b % 8);
    const int ls = ((p[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((load_u16(p + 2) >> (2 * s)) & 3) << 4);
    dw = f16(p) * static_cast<float>(ls - 32);
  } else {
    dw = f16(row + b * bs);
    if constexpr (q8gemm_min(type)) mw = f16(row + b * bs + 2);
  }
}

// A super-block's scale words for 16 rows, gathered once for its 8 blocks (the K types and IQ4_XS
// keep every sub-block's scales in one 12- or 8-byte field per super-block): a builder walks a
// super-block's blocks in turn, so the gathers wscale16 made per block (2-4 of 16 rows each, ~8 %
// of the IQ4_XS bf16 panel builder's time) are made once in 8. The same words, the same floats.
struct ScaleWords {
  const uint8_t* base = nullptr;
  int64_t sb = -1;
  __m512i w[4];
};

// wscale for 16 rows at once: dw and mw of block b of the rows at base + j * row_bytes (lane j;
// lanes outside `valid` zero), their bytes gathered (vpgatherdd) and the scales unpacked in vector
// lanes: the same floats as wscale row by row (the same f16 conversion, the same one multiply).
// Why: the panel builders called wscale 16 times a block, ~20-30 scalar instructions each for the
// K-quants' and IQ4_XS's 6-bit scales, about as many instructions as the block's 512 weights took.
// The K types' and IQ4_XS's words come from `c` (ScaleWords), gathered once a super-block.
template <int type, int bs>
__attribute__((always_inline)) inline void wscale16(const uint8_t* base, __m512i vidx, __mmask16 valid, int64_t b,
                                                    ScaleWords& c, __m512& dw, __m512& mw) {
  constexpr bool kq = type == ikj::T_Q4_K || type == ikj::T_Q5_K;
  const __m512i z = _mm512_setzero_si512();
  auto lo16 = [](__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); };
  auto hi16 = [](__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); };
  if constexpr (!kq && type != ikj::T_IQ4_XS) {
    const __m512i h = _mm512_mask_i32gather_epi32(z, valid, vidx, base + b * bs, 1);  // d (| the minimum)
    dw = _mm512_maskz_mov_ps(valid, lo16(h));
    mw = q8gemm_min(type) ? _mm512_maskz_mov_ps(valid, hi16(h)) : _mm512_setzero_ps();
  } else {
    if (c.base != base || c.sb != b / 8) {
      const uint8_t* p = base + (b / 8) * bs;
      for (int i = 0; i < (kq ? 4 : 2); ++i) c.w[i] = _mm512_mask_i32gather_epi32(z, valid, vidx, p + 4 * i, 1);
      c.base = base, c.sb = b / 8;
    }
    const __m512i m3 = _mm512_set1_epi32(3), m15 = _mm512_set1_epi32(15), m63 = _mm512_set1_epi32(63);
    const __m512i h = c.w[0];
    if constexpr (kq) {
      const int j = static_cast<int>(b % 8);
      const __m512i q0 = c.w[1], q1 = c.w[2], q2 = c.w[3];
      __m512i sc, m;
      if (j < 4) {
        sc = _mm512_and_si512(_mm512_srli_epi32(q0, 8 * j), m63);
        m = _mm512_and_si512(_mm512_srli_epi32(q1, 8 * j), m63);
      } else {
        const int i = 8 * (j - 4);
        sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q2, i), m15),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q0, i + 6), m3), 4));
        m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q2, i + 4), m15),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q1, i + 6), m3), 4));
      }
      dw = _mm512_maskz_mul_ps(valid, lo16(h), _mm512_cvtepi32_ps(sc));
      const __m512 negmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi16(h)), _mm512_set1_epi32(INT32_MIN)));
      mw = _mm512_maskz_mul_ps(valid, negmin, _mm512_cvtepi32_ps(m));
    } else {
      const int s = static_cast<int>(b % 8);
      const __m512i l = c.w[1];
      const __m512i ls = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l, 4 * s), m15),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 16 + 2 * s), m3), 4));
      dw = _mm512_maskz_mul_ps(valid, lo16(h), _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
      mw = _mm512_setzero_ps();
    }
  }
}

// IKJAX_AMX_VSCALE=0: the panel builders' scales row by row (wscale), as before wscale16: read per call
inline bool vector_scales() { return ikj::env_on("IKJAX_AMX_VSCALE"); }

// The scales of the panel's 16 rows of half g as wscale16 wants them: the first row, the rows'
// offsets, and which rows there are (rows are present from the first on).
struct Rows16 {
  const uint8_t* base;
  __m512i vidx;
  __mmask16 valid;
};
inline Rows16 rows16(const uint8_t* const* rows, int64_t row_bytes) {
  int n = 0;
  while (n < 16 && rows[n]) ++n;
  return {rows[0], _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(static_cast<int>(row_bytes))),
          static_cast<__mmask16>((1u << n) - 1)};
}

// Both panel builders' scales of block b for the 16 rows (null: missing, zeros): gathered (VS, the
// default) or row by row (IKJAX_AMX_VSCALE=0), the same floats.
template <int type, int bs, bool VS>
__attribute__((always_inline)) inline void panel_scales(const uint8_t* const* rows, int64_t row_bytes, int64_t b,
                                                        ScaleWords& cache, __m512& dw, __m512& mw) {
  if constexpr (VS) {
    const Rows16 rr = rows16(rows, row_bytes);
    wscale16<type, bs>(rr.base, rr.vidx, rr.valid, b, cache, dw, mw);
  } else {
    alignas(64) float d[16], m[16];
    for (int j = 0; j < 16; ++j) {
      d[j] = m[j] = 0.f;
      if (rows[j]) wscale<type, bs>(rows[j], b, d[j], m[j]);
    }
    dw = _mm512_load_ps(d), mw = _mm512_load_ps(m);
  }
}

// Blocks b and b + 1 (`two`; else zeros) of 16 weight rows (null: a missing row, zeros), transposed:
// r[c] holds 4 bytes c of each row (c < 8: block b, else b + 1). Both panel builders' first step.
template <int type, int bs>
__attribute__((always_inline)) inline void rows_block_pair(const uint8_t* const* rows, int64_t b, bool two, __m512i* r) {
  constexpr int64_t bpb = q8gemm_kq(type) ? bs / 8 : bs;  // bytes per block of 32 (for the prefetch)
  for (int j = 0; j < 16; ++j) {
    if (!rows[j]) {
      r[j] = _mm512_setzero_si512();
      continue;
    }
    // 8 blocks ahead on each of the 16 row streams (an expert's rows come from DRAM; the MoE
    // prompt layer measured Q4_0 116 -> 105-110 ms, Q8_0 within noise; 16 ahead no better)
    _mm_prefetch(reinterpret_cast<const char*>(rows[j] + (b + 8) * bpb), _MM_HINT_T0);
    r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(wvals<type, bs>(rows[j], b)),
                              two ? wvals<type, bs>(rows[j], b + 1) : _mm256_setzero_si256(), 1);
  }
  transpose16x16(r);
}

// f(type, bs) with both as std::integral_constant, for the types the vectorized panel builders take
// (the avx512 engine's six legacy types, Q4_K, Q5_K, IQ4_XS); false for any other type.
template <class F>
inline bool with_panel_type(int type, F&& f) {
  using std::integral_constant;
  switch (type) {
    case ikj::T_Q8_0: f(integral_constant<int, ikj::T_Q8_0>(), integral_constant<int, 34>()); return true;
    case ikj::T_Q4_0: f(integral_constant<int, ikj::T_Q4_0>(), integral_constant<int, 18>()); return true;
    case ikj::T_Q5_0: f(integral_constant<int, ikj::T_Q5_0>(), integral_constant<int, 22>()); return true;
    case ikj::T_Q4_1: f(integral_constant<int, ikj::T_Q4_1>(), integral_constant<int, 20>()); return true;
    case ikj::T_Q5_1: f(integral_constant<int, ikj::T_Q5_1>(), integral_constant<int, 24>()); return true;
    case ikj::T_IQ4_NL: f(integral_constant<int, ikj::T_IQ4_NL>(), integral_constant<int, 18>()); return true;
    case ikj::T_Q4_K: f(integral_constant<int, ikj::T_Q4_K>(), integral_constant<int, 144>()); return true;
    case ikj::T_Q5_K: f(integral_constant<int, ikj::T_Q5_K>(), integral_constant<int, 176>()); return true;
    case ikj::T_IQ4_XS: f(integral_constant<int, ikj::T_IQ4_XS>(), integral_constant<int, 136>()); return true;
    default: return false;
  }
}

// Both panel builders' walk: for each half g of a panel's 32 weight rows [p0, p0 + nr) (missing rows
// null) and each pair of blocks b, b + 1 (`two`: b + 1 < nb), f(g, rows, b, two, r) with r as
// rows_block_pair leaves it.
template <int type, int bs, class F>
__attribute__((always_inline)) inline void for_block_pairs(const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb,
                                                            F&& f) {
  for (int g = 0; g < 2; ++g) {
    const uint8_t* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = g * 16 + j < nr ? w + (p0 + g * 16 + j) * row_bytes : nullptr;
    for (int64_t b = 0; b < nb; b += 2) {
      const bool two = b + 1 < nb;
      __m512i r[16];
      rows_block_pair<type, bs>(rows, b, two, r);
      f(g, static_cast<const uint8_t* const*>(rows), b, two, r);
    }
  }
}

// Weight rows [p0, p0 + nr) (nr <= QNR; missing rows zero) of nb blocks into the panel layout.
template <int type, int bs, bool VS = true>
void build_panel_q8(const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb, uint8_t* panel) {
  constexpr int64_t qblk = q8gemm_min(type) ? QBLK_MIN : QBLK;
  const __m512i ones = _mm512_set1_epi8(1);
  ScaleWords cache;
  for_block_pairs<type, bs>(w, row_bytes, p0, nr, nb, [&](int g, const uint8_t* const* rows, int64_t b, bool two,
                                                          const __m512i* r) {
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      uint8_t* pb = panel + (b + h) * qblk;
      __m512i s = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        _mm512_storeu_si512(pb + g * 512 + c * 64, r[8 * h + c]);
        s = _mm512_dpbusd_epi32(s, ones, r[8 * h + c]);
      }
      _mm512_storeu_si512(pb + 1024 + g * 64, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7)));
      __m512 dw, mw;
      panel_scales<type, bs, VS>(rows, row_bytes, b + h, cache, dw, mw);
      _mm512_storeu_ps(pb + 1152 + g * 64, dw);
      if constexpr (q8gemm_min(type)) _mm512_storeu_ps(pb + 1280 + g * 64, mw);
    }
  });
}

#if defined(IKJ_HAVE_AMX_BF16)
// The bf16 tiles' panel built straight from the blocks: the bytes amx::panel_to_bf16_hw would make
// from build_panel_q8's panel (the same 16 x 16 transpose, the same values and scales, the same
// fma and rounding: the same bits), without writing the int8 panel, its sums and scales and reading
// them back. Why: at the ~64 rows a prompt's expert sees, the two passes were about as long as the
// tiles' own work (perf on an R1 expert layer at 64 rows a expert, one thread: build_panel_q8 ~21 %,
// panel_to_bf16_hw ~7 %, the tiles ~38 % of the kernel's time).
template <int type, int bs, bool VS = true>
void build_panel_bf16(const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb, uint16_t* out) {
  // even / odd dwords of two vectors; lane i of quarter j: row 4j + i / 4 (as panel_to_bf16_hw)
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
  const __m512i q0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512i is[4];
  for (int j = 0; j < 4; ++j) is[j] = _mm512_add_epi32(q0, _mm512_set1_epi32(4 * j));
  ScaleWords cache;
  for_block_pairs<type, bs>(w, row_bytes, p0, nr, nb, [&](int g, const uint8_t* const* rows, int64_t b, bool two,
                                                          const __m512i* r) {
    for (int h = 0; h < (two ? 2 : 1); ++h) {
      __m512 dw, mw;
      panel_scales<type, bs, VS>(rows, row_bytes, b + h, cache, dw, mw);
      __m512 dx[4], mx[4];
      for (int j = 0; j < 4; ++j) dx[j] = _mm512_permutexvar_ps(is[j], dw), mx[j] = _mm512_permutexvar_ps(is[j], mw);
      uint16_t* ob = out + (b + h) * amx::kBfBlk + g * 512;
      for (int c = 0; c < 8; ++c) {
        const __m512i q = r[8 * h + c];
        __m512 f[4];
        f[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(q))), dx[0], mx[0]);
        f[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 1))), dx[1], mx[1]);
        f[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 2))), dx[2], mx[2]);
        f[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, 3))), dx[3], mx[3]);
        const __m512i lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0]));
        const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[3], f[2]));
        _mm512_storeu_si512(ob + (2 * c) * 32, _mm512_permutex2var_epi32(lo, ie, hi));
        _mm512_storeu_si512(ob + (2 * c + 1) * 32, _mm512_permutex2var_epi32(lo, io, hi));
      }
    }
  });
}

// IKJAX_AMX_FUSED=0 builds the bf16 panel in two passes (int8 panel, then bf16), as before: read per call
inline bool amx_fused_build() { return ikj::env_on("IKJAX_AMX_FUSED"); }
// IKJAX_AMX_PREFETCH=0: the tiles' loop without its prefetch of x's rows (panel_gemm_bf16_hw): read per call
inline bool amx_prefetch() { return ikj::env_on("IKJAX_AMX_PREFETCH"); }
#endif

// C[mr][QNR] (row stride ldc) (+)= x8 rows (xu: row 0's bytes, stride K; dx: row 0's scales and
// ds its dx * sum(q), stride nbx) x panel blocks [b0, b1); has_min: the panel's QBLK_MIN layout.
template <int mr, bool has_min>
void micro_q8(const uint8_t* xu, int64_t K, const float* dx, const float* ds, int64_t nbx, const uint8_t* panel,
              int64_t b0, int64_t b1, float* C, int64_t ldc, bool acc_c) {
  constexpr int64_t qblk = has_min ? QBLK_MIN : QBLK;
  __m512 f0[mr], f1[mr];
  for (int i = 0; i < mr; ++i) f0[i] = f1[i] = _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* pb = panel + b * qblk;
    const __m512i z0 = _mm512_loadu_si512(pb + 1024), z1 = _mm512_loadu_si512(pb + 1088);
    __m512i c0[mr], c1[mr];
    for (int i = 0; i < mr; ++i) c0[i] = z0, c1[i] = z1;
    const uint8_t* xb = xu + b * 32;
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      const __m512i w0 = _mm512_loadu_si512(pb + q * 64), w1 = _mm512_loadu_si512(pb + 512 + q * 64);
      for (int i = 0; i < mr; ++i) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(load_u32(xb + i * K + 4 * q)));
        c0[i] = _mm512_dpbusd_epi32(c0[i], a, w0);
        c1[i] = _mm512_dpbusd_epi32(c1[i], a, w1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(pb + 1152), d1 = _mm512_loadu_ps(pb + 1216);
    for (int i = 0; i < mr; ++i) {
      const __m512 s = _mm512_set1_ps(dx[i * nbx + b]);
      f0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0[i]), _mm512_mul_ps(d0, s), f0[i]);
      f1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1[i]), _mm512_mul_ps(d1, s), f1[i]);
    }
    if constexpr (has_min) {
      const __m512 m0 = _mm512_loadu_ps(pb + 1280), m1 = _mm512_loadu_ps(pb + 1344);
      for (int i = 0; i < mr; ++i) {
        const __m512 s = _mm512_set1_ps(ds[i * nbx + b]);
        f0[i] = _mm512_fmadd_ps(m0, s, f0[i]);
        f1[i] = _mm512_fmadd_ps(m1, s, f1[i]);
      }
    }
  }
  for (int i = 0; i < mr; ++i) {
    if (acc_c) {
      f0[i] = _mm512_add_ps(f0[i], _mm512_loadu_ps(C + i * ldc));
      f1[i] = _mm512_add_ps(f1[i], _mm512_loadu_ps(C + i * ldc + 16));
    }
    _mm512_storeu_ps(C + i * ldc, f0[i]);
    _mm512_storeu_ps(C + i * ldc + 16, f1[i]);
  }
}

// Weight rows [n0, n1) against the x8 pack xp of M rows.
void gemm_rows_q8(const void* xp, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                  int64_t n0, int64_t n1, float* y, int64_t ldy, bool k256 = false) {
  (void)k256;  // (the avx2 engine's IQ4_XS only)
  const int64_t nb = K / 32;
  const uint8_t* xu = static_cast<const uint8_t*>(xp);
  const float* dx = reinterpret_cast<const float*>(xu + x8_dx_offset(M, K));
  const float* ds = reinterpret_cast<const float*>(xu + x8_ds_offset(M, K));
  const bool has_min = q8gemm_min(type);
  thread_local std::vector<uint8_t> panel;
  thread_local std::vector<float> ctile;
  if (static_cast<int64_t>(panel.size()) < nb * QBLK_MIN) panel.resize(nb * QBLK_MIN);
#if defined(IKJ_HAVE_AMX_TILES)
  const bool tiles = M >= ikj::amx_min_rows();  // (once a call: these read the environment)
#endif
#if defined(IKJ_HAVE_AMX_BF16)
  const bool bf16 = bf16_tiles(M);
#endif
  if (static_cast<int64_t>(ctile.size()) < M * QNR) ctile.resize(M * QNR);
  const bool vs = vector_scales();
#if defined(IKJ_HAVE_AMX_BF16)
  const bool fused = tiles && bf16 && amx_fused_build();
  const bool prefetch = tiles && bf16 && amx_prefetch();
  thread_local std::vector<uint16_t> bpanel;
  if (tiles && bf16 && static_cast<int64_t>(bpanel.size()) < nb * amx::kBfBlk) bpanel.resize(nb * amx::kBfBlk);
#endif
  // the panel of weight rows [p0, p0 + nr) in the int8 layout (the portable builder for a type the
  // vectorized one lacks: none gets here)
  auto build_q8 = [&](int64_t p0, int64_t nr) {
    const bool vec = with_panel_type(type, [&](auto t, auto bs) {
      if (vs) build_panel_q8<decltype(t)::value, decltype(bs)::value, true>(w, row_bytes, p0, nr, nb, panel.data());
      else build_panel_q8<decltype(t)::value, decltype(bs)::value, false>(w, row_bytes, p0, nr, nb, panel.data());
    });
    if (!vec) amx::build_panel(type, w, row_bytes, p0, nr, nb, panel.data());
  };
  for (int64_t p0 = n0; p0 < n1; p0 += QNR) {
    const int64_t nr = std::min<int64_t>(QNR, n1 - p0);
#if defined(IKJ_HAVE_AMX_BF16)
    if (tiles && bf16) {  // the bf16 tiles: the panel built straight in their layout, or in two passes
      uint16_t* bp = bpanel.data();
      const bool built = fused && with_panel_type(type, [&](auto t, auto bs) {
        if (vs) build_panel_bf16<decltype(t)::value, decltype(bs)::value, true>(w, row_bytes, p0, nr, nb, bp);
        else build_panel_bf16<decltype(t)::value, decltype(bs)::value, false>(w, row_bytes, p0, nr, nb, bp);
      });
      if (!built) {
        build_q8(p0, nr);
        amx::panel_to_bf16_hw(panel.data(), nb, has_min, bp);
      }
      amx::panel_gemm_bf16_hw(reinterpret_cast<const uint16_t*>(xu + x8_bf_offset(M, K)), amx::bf_ld(K), M, bp, nb,
                              y + p0, ldy, nr, prefetch);
      continue;
    }
#endif
    build_q8(p0, nr);
#if defined(IKJ_HAVE_AMX_TILES)
    if (tiles) {
      amx::panel_gemm_hw(xu, M, K, dx, ds, panel.data(), nb, has_min, y + p0, ldy, nr);
      continue;
    }
#endif
    const bool direct = nr == QNR;
    float* Cbase = direct ? y + p0 : ctile.data();
    const int64_t ldc = direct ? ldy : QNR;
    for (int64_t kb = 0; kb < nb; kb += QKB) {
      const int64_t kb1 = std::min(nb, kb + QKB);
      for (int64_t m0 = 0; m0 < M; m0 += MQ) {
        const int mr = static_cast<int>(std::min<int64_t>(MQ, M - m0));
        const uint8_t* xr = xu + m0 * K;
        const float *dr = dx + m0 * nb, *sr = ds + m0 * nb;
        float* C = Cbase + m0 * ldc;
        auto run = [&](auto hm) {
          constexpr bool H = decltype(hm)::value;
          switch (mr) {
            case 4: micro_q8<4, H>(xr, K, dr, sr, nb, panel.data(), kb, kb1, C, ldc, kb > 0); break;
            case 3: micro_q8<3, H>(xr, K, dr, sr, nb, panel.data(), kb, kb1, C, ldc, kb > 0); break;
            case 2: micro_q8<2, H>(xr, K, dr, sr, nb, panel.data(), kb, kb1, C, ldc, kb > 0); break;
            default: micro_q8<1, H>(xr, K, dr, sr, nb, panel.data(), kb, kb1, C, ldc, kb > 0); break;
          }
        };
        if (has_min) run(std::true_type());
        else run(std::false_type());
      }
    }
    if (!direct)
      for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * ldy + p0, ctile.data() + i * QNR, nr * 4);
  }
}
#elif defined(IKJ_HAVE_Q8DOT) && !defined(IKJ_Q8DOT_512)  // AVX2: the int8 prompt engine with vpmaddubsw / vpmaddwd
// The same x quantization and weight values as the avx512 engine above, for the same types (ik's
// AVX2 prompt kernels are int8 too; the bf16-rounded f32 panels ran at 0.4-0.6x ik there). Panels
// of QNR = 8 weight rows laid out [block][quad][row] (4 bytes of each row per 32-bit lane, an
// 8 x 8 dword transpose of the rows' blocks), dw (and mw) per block as 8 floats. The microkernel
// broadcasts 4 bytes of one x row against the 8 rows: vpmaddubsw (weights unsigned, x signed ->
// i16 pairs) and vpmaddwd by ones -> i32 per row, the block's sum one convert and one FMA by
// dw * dx. Weight operands per type:
// - Q8_0 / IQ4_NL: signed values with ggml's sign trick (|w| stored beside w; sign(x, w) per
//   product, pair sums <= 2 * 128 * 127 cannot saturate);
// - Q4_0 / Q5_0 / Q4_1 / Q5_1: the stored codes (0..15 / 0..31, unsigned); Q4_0 / Q5_0's offset
//   (8 / 16) and Q4_1 / Q5_1's minimum both become mw * dx * sum(q_x) per block (mw = -8 dw, -16 dw
//   or m), one FMA with the x8 pack's ds. Their i16 pair sums are added over 8 (Q4) / 4 (Q5) quads
//   before vpmaddwd (<= 8 * 2 * 15 * 127 < 2^15).
// The int32 block sums equal avx512's exactly (same integers), so results differ from it only by
// float summation order (tests/test_cpu_quant_matmul.py checks both against the reference).
#define IKJ_HAVE_Q8GEMM 1
constexpr int QNR = 8;             // weight rows per panel (one ymm of 8 int32 / f32 lanes)
constexpr int MQ = 4;              // x rows per microkernel (q8gemm_mq: 6 for the sign types)
constexpr int64_t QKB = 16;        // blocks per K chunk: <= 9 KiB of a panel (QNP of them: L2)
constexpr int QNP = 4;             // panels swept together by each x tile (gemm_rows_q8_t)
constexpr int64_t QUNIT = QNP * QNR;  // output columns per unit of quant_matmul_ex's thread split

inline bool q8gemm_type(int type) {
  return type == ikj::T_Q8_0 || type == ikj::T_Q4_0 || type == ikj::T_Q5_0 || type == ikj::T_IQ4_NL ||
         type == ikj::T_Q4_1 || type == ikj::T_Q5_1 || type == ikj::T_Q4_K || type == ikj::T_Q5_K ||
         type == ikj::T_IQ4_XS;
}
// IQ4_XS with x per block of 32 (QM_Q8, the default since the two-panel kernel): an engine-internal type
// tag, IQ4_XS's blocks with a float dw = d * (ls - 32) a block (exact: an f16 times a 6-bit integer),
// run as a sign type like Q8_0 (micro_q8x2 under AVX-VNNI). Why: the per-256 form multiplies each
// block's sums by its scale in integers (vpmulld under AVX-VNNI) and has no two-panel form.
constexpr int kIQ4XS32 = 0x1000 + ikj::T_IQ4_XS;
constexpr int kq_base(int type) { return type == kIQ4XS32 ? ikj::T_IQ4_XS : type; }
constexpr bool q8gemm_sign(int type) {
  return type == ikj::T_Q8_0 || type == ikj::T_IQ4_NL || type == ikj::T_IQ4_XS || type == kIQ4XS32;
}
// x per 256 (QM_Q8K: Q8_K's grouping), the block scales in vpmaddwd, one FMA per super-block: IQ4_XS
// where IKJAX_IQ4XS_K256=1 (the form before kIQ4XS32)
constexpr bool q8gemm_k256(int type) { return type == ikj::T_IQ4_XS; }
inline bool iq4xs_k256() {  // (read per call)
  const char* e = std::getenv("IKJAX_IQ4XS_K256");
  return e && std::strcmp(e, "1") == 0;
}
// x rows per microkernel: 6 for the sign types (their two weight loads a quad, w and |w|, shared by
// more rows; one thread, M = 32..512: Q8_0 +5-9 %, IQ4_XS +3-8 %, RESULTS §26e), 4 for the nibble
// types (3-15 % slower with 6)
#if defined(__AVXVNNI__)
constexpr int q8gemm_mq(int) { return MQ; }  // AVX-VNNI: two sums a row (micro_q8), 4 rows fit the registers
#else
constexpr int q8gemm_mq(int type) { return q8gemm_sign(type) ? 6 : MQ; }
#endif
// super-block types of the engine: one scale (and minimum) per block of 32, so a block of a row is a
// Q4_1 / Q5_1 / IQ4_NL block with dw = d * scale (float), mw = -dmin * min
constexpr bool q8gemm_kq(int type) {
  return type == ikj::T_Q4_K || type == ikj::T_Q5_K || type == ikj::T_IQ4_XS || type == kIQ4XS32;
}
// panel bytes per block: 8 quads x 32 (+ 8 x 32 |w|), 32 dw (+ 32 mw); IQ4_XS (x per 256: QM_Q8K):
// the 8 rows' int16 block scales, each twice (32), and their super-block's d (32) in place of dw
constexpr int64_t q8gemm_blk(int type) { return type == ikj::T_IQ4_XS ? 576 : q8gemm_sign(type) ? 544 : 320; }

// x8 pack: [M][K] signed bytes q, then (64-byte aligned) [M][K / 32] floats dx, then [M][K / 32]
// floats dx * sum(q), then [M][K / 32] int32 sum(q) (the AVX-VNNI build's sign types: their panels
// hold w + 128, whose products with x carry 128 * sum(q) too).
inline int64_t x8_dx_offset(int64_t M, int64_t K) { return (M * K + 63) / 64 * 64; }
inline int64_t x8_ds_offset(int64_t M, int64_t K) { return x8_dx_offset(M, K) + M * (K / 32) * 4; }
inline int64_t x8_sx_offset(int64_t M, int64_t K) { return x8_ds_offset(M, K) + M * (K / 32) * 4; }
inline size_t x8_bytes(int64_t M, int64_t K) { return x8_sx_offset(M, K) + M * (K / 32) * 4; }

inline int32_t hsum_epi32(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
}

// rows [r0, r1) of x [M, K] into the x8 pack at out (K a multiple of 32); quantize_x8's arithmetic:
// one scale per block of 32, or (k256: QM_Q8K, K a multiple of 256) per 256 values, dx repeating it
// for the super-block's 8 blocks (all NaN when one holds a NaN)
void pack_x8(const float* x, int64_t M, int64_t K, uint8_t* out, int64_t r0, int64_t r1, bool k256 = false) {
  const int64_t nb = K / 32;
  float* ds = reinterpret_cast<float*>(out + x8_ds_offset(M, K));
  int32_t* sx = reinterpret_cast<int32_t*>(out + x8_sx_offset(M, K));
  q8_groups_avx2(x, out, r0 * nb, r1 * nb, k256 ? 8 : 1, reinterpret_cast<float*>(out + x8_dx_offset(M, K)),
                 [&](int64_t i, float d, __m256i s4) {
                   sx[i] = hsum_epi32(s4);
                   ds[i] = d * static_cast<float>(sx[i]);  // the float sum's value: |sum| <= 4064 is exact
                 });
}

// Weight rows [p0, p0 + nr) (nr <= QNR; missing rows zero) of nb blocks into the panel layout.
template <int type, int bs>
void build_panel_q8(const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb, uint8_t* panel) {
  constexpr int64_t qblk = q8gemm_blk(type);
  constexpr bool sgn = q8gemm_sign(type);
  const uint8_t* rows[QNR];
  for (int j = 0; j < QNR; ++j) rows[j] = j < nr ? w + (p0 + j) * row_bytes : nullptr;
  // super-block types: the 8 rows' current super-block unpacked once (kq_unpack, as the decode)
  alignas(32) uint8_t kq_q[8][8][32];
  alignas(32) float kq_d[8][8], kq_m[8][8];
  alignas(32) int16_t kq_s[8][8];  // IQ4_XS: the block scales (kq_d[j][0] its d)
  for (int64_t b = 0; b < nb; ++b) {
    __m256i r[8];
    // dw / mw straight into the panel (8 scalar stores read back by one 32-byte load stalled on the
    // store forward once per block)
    uint8_t* pb = panel + b * qblk;
    float* d = reinterpret_cast<float*>(pb + (sgn ? 512 : 256));
    float* mw = d + 8;  // (sign types: unused, past their dw)
    if constexpr (q8gemm_kq(type)) {
      if (b % 8 == 0) {
        for (int j = 0; j < 8; ++j) {
          if (!rows[j]) continue;
          const uint8_t* sb = rows[j] + b / 8 * bs;
          _mm_prefetch(reinterpret_cast<const char*>(sb + 2 * bs), _MM_HINT_T0);
          KqBlocks<kq_base(type)> kb;
          kq_unpack<kq_base(type), true>(sb, kb);
          for (int t = 0; t < 8; ++t)
            _mm256_store_si256(reinterpret_cast<__m256i*>(kq_q[j][t]), sgn ? kb.sg[t] : kb.q[t]);
          if constexpr (type == ikj::T_IQ4_XS) {
            for (int t = 0; t < 8; ++t) kq_s[j][t] = static_cast<int16_t>(kb.s32[t]);
            kq_d[j][0] = kb.d;
          } else if constexpr (type == kIQ4XS32) {  // dw a block: d * (ls - 32), exact in float
            for (int t = 0; t < 8; ++t) kq_d[j][t] = kb.d * static_cast<float>(kb.s32[t]);
          } else {
            _mm256_store_ps(kq_d[j], kb.dsc);
            _mm256_store_ps(kq_m[j], _mm256_sub_ps(_mm256_setzero_ps(), kb.mn[0]));
          }
        }
      }
    }
    if constexpr (type == ikj::T_IQ4_XS) {  // [16] int16 scales (row j at lanes 2j, 2j + 1), [8] d
      int16_t* sc = reinterpret_cast<int16_t*>(pb + 512);
      float* dd = reinterpret_cast<float*>(pb + 544);
      for (int j = 0; j < 8; ++j) {
        r[j] = rows[j] ? _mm256_load_si256(reinterpret_cast<const __m256i*>(kq_q[j][b % 8])) : _mm256_setzero_si256();
        sc[2 * j] = sc[2 * j + 1] = rows[j] ? kq_s[j][b % 8] : int16_t{0};
        dd[j] = rows[j] ? kq_d[j][0] : 0.f;
      }
    } else
    for (int j = 0; j < 8; ++j) {
      if (!rows[j]) {
        r[j] = _mm256_setzero_si256();
        d[j] = 0.f;
        if constexpr (!sgn) mw[j] = 0.f;
        continue;
      }
      if constexpr (q8gemm_kq(type)) {
        r[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(kq_q[j][b % 8]));
        d[j] = kq_d[j][b % 8];
        if constexpr (!sgn) mw[j] = kq_m[j][b % 8];
        continue;
      } else {
        const uint8_t* blk = rows[j] + b * bs;
        _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * bs), _MM_HINT_T0);
        r[j] = wblock_avx2<type>(blk);  // signed values (Q8_0, IQ4_NL) or unsigned codes
        const float dj = f16(blk);
        d[j] = dj;
        if constexpr (!sgn)
          mw[j] = type == ikj::T_Q4_0 ? -8.f * dj : type == ikj::T_Q5_0 ? -16.f * dj
                : (type == ikj::T_Q4_1 || type == ikj::T_Q5_1) ? f16(blk + 2) : 0.f;
      }
    }
    // 8 x 8 dword transpose: out[c] = dword c (bytes 4c..4c+3) of each of the 8 rows
    __m256i t[8], u[8];
    for (int k = 0; k < 4; ++k) {
      t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
      t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {
      u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
      u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
      u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
      u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m256i lo = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20), hi = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 32 * c), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 32 * (c + 4)), hi);
      if constexpr (sgn) {
#if defined(__AVX2__) && defined(__AVXVNNI__)  // w + 128 (unsigned): block_sums_vnni's operand
        const __m256i m80 = _mm256_set1_epi8(static_cast<char>(0x80));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 256 + 32 * c), _mm256_xor_si256(lo, m80));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 256 + 32 * (c + 4)), _mm256_xor_si256(hi, m80));
#else  // |w| for the sign trick
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 256 + 32 * c), _mm256_sign_epi8(lo, lo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + 256 + 32 * (c + 4)), _mm256_sign_epi8(hi, hi));
#endif
      }
    }
  }
}

// pin(v): an empty asm that takes and gives back v in a register. The int8 loops below pin each
// accumulator after its add, their 8 quads unrolled (the U forms): GCC 12 otherwise keeps a loop's
// accumulators in one set of registers and their new values in another, with a vmovdqa back per
// product (and under AVX-VNNI's 12 sums of micro_q8x2, a store to the stack per product as well):
// up to a third of the loop's instructions.
__attribute__((always_inline)) inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// fn(q) for q = q0, q0 + step, .. < q1: unrolled in the pinned forms (U), a loop in the forms before them
template <bool U, int step = 1, class Fn>
__attribute__((always_inline)) inline void for_quads(int q0, int q1, Fn&& fn) {
  if constexpr (U) {
#pragma GCC unroll 8
    for (int q = q0; q < q1; q += step) fn(q);
  } else {
#pragma GCC unroll 1  // (unrolled without the pins, GCC hoists every product ahead of its add and spills them)
    for (int q = q0; q < q1; q += step) fn(q);
  }
}

#if defined(__AVXVNNI__)
// AVX-VNNI: a panel block's plain int32 sums for x rows [0, mr) into s, one vpdpbusd a product (for
// vpmaddubsw + vpmaddwd + vpaddd) into two sums a row, even and odd quads, added at the end: one sum
// would wait ~5 cycles (the instruction's latency) between a row's quads. The nibble types: their
// unsigned codes (pb) against x. The sign types (sgn): w + 128 (pb + 256, build_panel_q8) against x,
// each row's sum started at -128 * sum(x) (sx: row 0's block sum, stride nbx) -- no sign(x, w) a
// product as the plain AVX2 form's sign trick needs, one vector op a product instead of two
// (|sum| <= 32 * 255 * 128 < 2^31). The same integers as the AVX2 forms in micro_q8.
template <int mr, bool sgn, bool U>
__attribute__((always_inline)) inline void block_sums_vnni(const uint8_t* pb, const int8_t* xb, int64_t K, __m256i* s,
                                                           const int32_t* sx, int64_t nbx) {
  __m256i s2[mr];
  for (int i = 0; i < mr; ++i) {
    s[i] = sgn ? _mm256_set1_epi32(-128 * sx[i * nbx]) : _mm256_setzero_si256();
    s2[i] = _mm256_setzero_si256();
  }
  const uint8_t* pu = pb + (sgn ? 256 : 0);
  auto quads = [&](int q) {
    const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pu + 32 * q));
    const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pu + 32 * q + 32));
    for (int i = 0; i < mr; ++i) {
      const uint8_t* xr = reinterpret_cast<const uint8_t*>(xb + i * K + 4 * q);
      s[i] = ikj::dot4_u8s8(s[i], u0, _mm256_set1_epi32(static_cast<int>(load_u32(xr))));
      s2[i] = ikj::dot4_u8s8(s2[i], u1, _mm256_set1_epi32(static_cast<int>(load_u32(xr + 4))));
      if constexpr (U) pin(s[i]), pin(s2[i]);
    }
  };
  for_quads<U, 2>(0, 8, quads);
  for (int i = 0; i < mr; ++i) s[i] = _mm256_add_epi32(s[i], s2[i]);
}
#endif

// C[mr][QNR] (row stride ldc) (+)= x8 rows (xq: row 0's bytes, stride K; dx / ds / sx: row 0's
// scales, dx * sum(q) and sum(q), stride nbx) x panel blocks [b0, b1).
template <int type, int mr, bool U = true>
void micro_q8(const int8_t* xq, int64_t K, const float* dx, const float* ds, const int32_t* sx, int64_t nbx,
              const uint8_t* panel, int64_t b0, int64_t b1, float* C, int64_t ldc, bool acc_c) {
  (void)sx;  // the AVX-VNNI build's sign types only
  constexpr int64_t qblk = q8gemm_blk(type);
  constexpr bool sgn = q8gemm_sign(type);
  constexpr int run16 = type == ikj::T_Q5_0 || type == ikj::T_Q5_1 || type == ikj::T_Q5_K ? 4 : 8;  // quads summed in i16
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[mr];
  for (int i = 0; i < mr; ++i) f[i] = _mm256_setzero_ps();
  if constexpr (type == ikj::T_IQ4_XS) {
    // x per 256 (QM_Q8K): each block's int16 scales in vpmaddwd, the int32 sums of a super-block's
    // 8 blocks added up (|sum| < 2^28), one convert and FMA by d * dx per super-block ([b0, b1) are
    // whole super-blocks: the chunks are multiples of 8 blocks)
    __m256i c[mr];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* pb = panel + b * qblk;
      const int8_t* xb = xq + b * 32;
      const __m256i sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 512));
      if (b % 8 == 0)
        for (int i = 0; i < mr; ++i) c[i] = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
      // AVX-VNNI: the block's plain sums (block_sums_vnni), then times the block scale once
      // (vpmulld): 2 vector ops a quad and row for vpmaddubsw + vpmaddwd + vpaddd; the same
      // integers (|block sum| < 2^20, times |scale| <= 32, 8 blocks)
      const __m256i sc32 = _mm256_srai_epi32(sc, 16);  // lane j: row j's scale (both halves hold it)
      __m256i p[mr];
      block_sums_vnni<mr, true, U>(pb, xb, K, p, sx + b, nbx);
      for (int i = 0; i < mr; ++i) c[i] = _mm256_add_epi32(c[i], _mm256_mullo_epi32(p[i], sc32));
#else
#pragma GCC unroll 1
      for (int q = 0; q < 8; ++q) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32 * q));
        const __m256i uw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 256 + 32 * q));
        for (int i = 0; i < mr; ++i) {
          const __m256i a = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(xb + i * K + 4 * q))));
          c[i] = _mm256_add_epi32(c[i], _mm256_madd_epi16(_mm256_maddubs_epi16(uw, _mm256_sign_epi8(a, w)), sc));
        }
      }
#endif
      if (b % 8 == 7) {
        const __m256 dv = _mm256_loadu_ps(reinterpret_cast<const float*>(pb + 544));
        for (int i = 0; i < mr; ++i)
          f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[i]), _mm256_mul_ps(dv, _mm256_broadcast_ss(dx + i * nbx + b)), f[i]);
      }
    }
  } else
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* pb = panel + b * qblk;
    const int8_t* xb = xq + b * 32;
    __m256i c[mr];
    if constexpr (sgn) {
#if defined(__AVXVNNI__)
      block_sums_vnni<mr, true, U>(pb, xb, K, c, sx + b, nbx);
#else
      for (int i = 0; i < mr; ++i) c[i] = _mm256_setzero_si256();
      auto quad = [&](int q) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32 * q));
        const __m256i uw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 256 + 32 * q));
        for (int i = 0; i < mr; ++i) {
          const __m256i a = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(xb + i * K + 4 * q))));
          c[i] = ikj::dot4_u8s8(c[i], uw, _mm256_sign_epi8(a, w));
          if constexpr (U) pin(c[i]);
        }
      };
      for_quads<U>(0, 8, quad);
#endif
    } else {
#if defined(__AVXVNNI__)
      block_sums_vnni<mr, false, U>(pb, xb, K, c, sx, nbx);  // the codes by x: no i16 runs, no vpmaddwd by ones
      (void)run16;
      (void)ones;
#else
      for (int h = 0; h < 8 / run16; ++h) {
        __m256i s[mr];
        for (int i = 0; i < mr; ++i) s[i] = _mm256_setzero_si256();
        auto quad = [&](int q) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb + 32 * q));
          for (int i = 0; i < mr; ++i) {
            const __m256i a = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(xb + i * K + 4 * q))));
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(w, a));
            if constexpr (U) pin(s[i]);
          }
        };
        for_quads<U>(h * run16, (h + 1) * run16, quad);
        for (int i = 0; i < mr; ++i) {
          const __m256i p = _mm256_madd_epi16(s[i], ones);
          c[i] = h == 0 ? p : _mm256_add_epi32(c[i], p);
        }
      }
#endif
    }
    const __m256 dv = _mm256_loadu_ps(reinterpret_cast<const float*>(pb + (sgn ? 512 : 256)));
    for (int i = 0; i < mr; ++i)
      f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[i]), _mm256_mul_ps(dv, _mm256_broadcast_ss(dx + i * nbx + b)), f[i]);
    if constexpr (!sgn) {
      const __m256 mv = _mm256_loadu_ps(reinterpret_cast<const float*>(pb + 288));
      for (int i = 0; i < mr; ++i) f[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(ds + i * nbx + b), f[i]);
    }
  }
  for (int i = 0; i < mr; ++i) {
    if (acc_c) f[i] = _mm256_add_ps(f[i], _mm256_loadu_ps(C + i * ldc));
    _mm256_storeu_ps(C + i * ldc, f[i]);
  }
}

// Two panels (16 weight rows) against mr x rows: each x broadcast feeds both panels' products, one
// sum a row and panel. Why: micro_q8's one panel spends a broadcast (a load) and, under AVX-VNNI, two
// sums' bookkeeping on each product; perf put it at ~80 % of a V2-Lite Q8_0 prompt layer's experts at
// the avx2 level. Under AVX-VNNI 2 mr independent sums (12 at mr = 6) keep both VNNI ports fed with
// one load a product instead of ~1.25: every type of the engine but x-per-256 IQ4_XS. The plain AVX2
// build (4 rows) takes the Q4 nibble types (Q4_0, Q4_1, Q4_K) this way: 0.75 loads a vpmaddubsw
// instead of 1.25 (two 256-bit loads a cycle, Zen 3's, bound micro_q8 there), V2-Lite Q4_0 experts
// 1.14-1.16x at -t 1 on an Intel Xeon; its sign types (their vpsignb / vpmaddwd a product bound them,
// not loads: Q8_0 0.97-1.00x) and the Q5 types (i16 runs of 4 quads) keep micro_q8. The chunk's
// float sums live in an L1 buffer (4 mr more ymm would not fit the 16). The same integer block sums,
// and per output the same float operations in the same order as micro_q8 (a chunk's sum from zero,
// then + C): the same bits.
#if defined(__AVXVNNI__)
constexpr int kQ8x2Rows = 6;  // x rows a two-panel call
constexpr bool q8x2_type(int type) { return type != ikj::T_IQ4_XS; }
#else
constexpr int kQ8x2Rows = 4;
constexpr bool q8x2_type(int type) { return type == ikj::T_Q4_0 || type == ikj::T_Q4_1 || type == ikj::T_Q4_K; }
#endif
// IKJAX_Q8X2=0: the prompt products one panel at a time (micro_q8), as before: read per call
inline bool q8x2_on() { return ikj::env_on("IKJAX_Q8X2"); }

template <int type, int mr, bool U = true>
void micro_q8x2(const int8_t* xq, int64_t K, const float* dx, const float* ds, const int32_t* sx, int64_t nbx,
                const uint8_t* pa, const uint8_t* pb, int64_t b0, int64_t b1, float* Ca, float* Cb, int64_t ldc,
                bool acc_c) {
  constexpr int64_t qblk = q8gemm_blk(type);
  constexpr bool sgn = q8gemm_sign(type);
  constexpr int64_t dvo = sgn ? 512 : 256;         // dw
  (void)ds;
  (void)sx;
  alignas(32) float f[mr][2][8];
  for (int i = 0; i < mr; ++i)
    for (int h = 0; h < 2; ++h) _mm256_store_ps(f[i][h], _mm256_setzero_ps());
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* qa = pa + b * qblk;
    const uint8_t* qb = pb + b * qblk;
    const int8_t* xb = xq + b * 32;
    __m256i c0[mr], c1[mr];
    auto xa = [&](int i, int q) {
      return _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(xb + i * K + 4 * q))));
    };
    auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
#if defined(__AVXVNNI__)
    constexpr int64_t wo = sgn ? 256 : 0;  // the operand bytes: w + 128 (sign types) or the codes
    for (int i = 0; i < mr; ++i) c0[i] = c1[i] = sgn ? _mm256_set1_epi32(-128 * sx[i * nbx + b]) : _mm256_setzero_si256();
    auto quad = [&](int q) {
      const __m256i u0 = ld(qa + wo + 32 * q), u1 = ld(qb + wo + 32 * q);
      for (int i = 0; i < mr; ++i) {
        const __m256i a = xa(i, q);
        c0[i] = ikj::dot4_u8s8(c0[i], u0, a);
        c1[i] = ikj::dot4_u8s8(c1[i], u1, a);
        if constexpr (U) pin(c0[i]), pin(c1[i]);
      }
    };
    for_quads<U>(0, 8, quad);
#else
    static_assert(!sgn, "the plain AVX2 build pairs the Q4 nibble types only (q8x2_type)");
    {  // the codes against x, the 8 quads summed in i16 (<= 8 * 2 * 15 * 127 < 2^15), then by ones
      __m256i s0[mr], s1[mr];
      for (int i = 0; i < mr; ++i) s0[i] = s1[i] = _mm256_setzero_si256();
      auto quad = [&](int q) {
        const __m256i w0 = ld(qa + 32 * q), w1 = ld(qb + 32 * q);
        for (int i = 0; i < mr; ++i) {
          const __m256i a = xa(i, q);
          s0[i] = _mm256_add_epi16(s0[i], _mm256_maddubs_epi16(w0, a));
          s1[i] = _mm256_add_epi16(s1[i], _mm256_maddubs_epi16(w1, a));
          if constexpr (U) pin(s0[i]), pin(s1[i]);
        }
      };
      for_quads<U>(0, 8, quad);
      const __m256i ones = _mm256_set1_epi16(1);
      for (int i = 0; i < mr; ++i) c0[i] = _mm256_madd_epi16(s0[i], ones), c1[i] = _mm256_madd_epi16(s1[i], ones);
    }
#endif
    const __m256 da = _mm256_loadu_ps(reinterpret_cast<const float*>(qa + dvo));
    const __m256 db = _mm256_loadu_ps(reinterpret_cast<const float*>(qb + dvo));
    for (int i = 0; i < mr; ++i) {
      const __m256 s = _mm256_broadcast_ss(dx + i * nbx + b);
      _mm256_store_ps(f[i][0], _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0[i]), _mm256_mul_ps(da, s), _mm256_load_ps(f[i][0])));
      _mm256_store_ps(f[i][1], _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1[i]), _mm256_mul_ps(db, s), _mm256_load_ps(f[i][1])));
    }
    if constexpr (!sgn) {
      const __m256 ma = _mm256_loadu_ps(reinterpret_cast<const float*>(qa + 288));
      const __m256 mb = _mm256_loadu_ps(reinterpret_cast<const float*>(qb + 288));
      for (int i = 0; i < mr; ++i) {
        const __m256 s = _mm256_broadcast_ss(ds + i * nbx + b);
        _mm256_store_ps(f[i][0], _mm256_fmadd_ps(ma, s, _mm256_load_ps(f[i][0])));
        _mm256_store_ps(f[i][1], _mm256_fmadd_ps(mb, s, _mm256_load_ps(f[i][1])));
      }
    }
  }
  for (int i = 0; i < mr; ++i) {
    __m256 ya = _mm256_load_ps(f[i][0]), yb = _mm256_load_ps(f[i][1]);
    if (acc_c) {
      ya = _mm256_add_ps(ya, _mm256_loadu_ps(Ca + i * ldc));
      yb = _mm256_add_ps(yb, _mm256_loadu_ps(Cb + i * ldc));
    }
    _mm256_storeu_ps(Ca + i * ldc, ya);
    _mm256_storeu_ps(Cb + i * ldc, yb);
  }
}

template <int type, int bs>
void gemm_rows_q8_t(const int8_t* xq, const float* dx, const float* ds, const int32_t* sx, int64_t M, int64_t K,
                    const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int mq = q8gemm_mq(type);
  const int64_t nb = K / 32, pstride = nb * q8gemm_blk(type);
  thread_local std::vector<uint8_t> panel;
  thread_local std::vector<float> ctile;
  if (static_cast<int64_t>(panel.size()) < QNP * pstride) panel.resize(QNP * pstride);
  if (static_cast<int64_t>(ctile.size()) < M * QNR) ctile.resize(M * QNR);
  // QNP panels at a time, each x tile's K chunk swept against all of them while it is in L1: x (M x K
  // bytes, in L3 once M is prompt-sized: 1 MiB at M = 512, K = 2048) is read once per QNP panels
  // instead of once per panel (M = 512 products +10-15 %, measured in RESULTS §26b)
  const bool x2 = q8x2_on();  // (once a call: it reads the environment)
  const bool pinned = ikj::env_on("IKJAX_Q8_PINNED");  // the U forms (pin): =0 the loops before them, for A/B
  for (int64_t g0 = n0; g0 < n1; g0 += QNP * QNR) {
    const int np = static_cast<int>(std::min<int64_t>(QNP, (n1 - g0 + QNR - 1) / QNR));
    const int64_t nr_last = std::min<int64_t>(QNR, n1 - (g0 + (np - 1) * QNR));
    for (int j = 0; j < np; ++j)
      build_panel_q8<type, bs>(w, row_bytes, g0 + j * QNR, j + 1 < np ? QNR : nr_last, nb, panel.data() + j * pstride);
    // panels in pairs (micro_q8x2), kQ8x2Rows x rows a call; a last odd or partial panel one at a time
    const int npair = q8x2_type(type) && x2 ? (nr_last == QNR ? np : np - 1) / 2 : 0;
    for (int64_t kb = 0; kb < nb; kb += QKB) {
      const int64_t kb1 = std::min(nb, kb + QKB);
      if constexpr (q8x2_type(type)) {
        for (int64_t m0 = 0; npair > 0 && m0 < M; m0 += kQ8x2Rows) {
          const int mr = static_cast<int>(std::min<int64_t>(kQ8x2Rows, M - m0));
          const int8_t* xr = xq + m0 * K;
          const float *dr = dx + m0 * nb, *sr = ds + m0 * nb;
          const int32_t* xr_sx = sx + m0 * nb;
          for (int jp = 0; jp < npair; ++jp) {
            const uint8_t* pa = panel.data() + (2 * jp) * pstride;
            float* Ca = y + g0 + (2 * jp) * QNR + m0 * ldy;
            for_rows<kQ8x2Rows>(mr, [&](auto r) {
              constexpr int R = decltype(r)::value;
              if (pinned)
                micro_q8x2<type, R, true>(xr, K, dr, sr, xr_sx, nb, pa, pa + pstride, kb, kb1, Ca, Ca + QNR, ldy, kb > 0);
              else
                micro_q8x2<type, R, false>(xr, K, dr, sr, xr_sx, nb, pa, pa + pstride, kb, kb1, Ca, Ca + QNR, ldy, kb > 0);
            });
          }
        }
      }
      for (int64_t m0 = 0; 2 * npair < np && m0 < M; m0 += mq) {
        const int mr = static_cast<int>(std::min<int64_t>(mq, M - m0));
        const int8_t* xr = xq + m0 * K;
        const float *dr = dx + m0 * nb, *sr = ds + m0 * nb;
        const int32_t* xr_sx = sx + m0 * nb;
        for (int j = 2 * npair; j < np; ++j) {
          const bool direct = j + 1 < np || nr_last == QNR;  // a partial last panel goes through ctile
          const int64_t ldc = direct ? ldy : QNR;
          float* C = (direct ? y + g0 + j * QNR : ctile.data()) + m0 * ldc;
          const uint8_t* pj = panel.data() + j * pstride;
          for_rows<mq>(mr, [&](auto r) {  // (mr: 1 .. mq)
            constexpr int R = decltype(r)::value;
            if (pinned)
              micro_q8<type, R, true>(xr, K, dr, sr, xr_sx, nb, pj, kb, kb1, C, ldc, kb > 0);
            else
              micro_q8<type, R, false>(xr, K, dr, sr, xr_sx, nb, pj, kb, kb1, C, ldc, kb > 0);
          });
        }
      }
    }
    if (nr_last < QNR) {
      const int64_t p0 = g0 + (np - 1) * QNR;
      for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * ldy + p0, ctile.data() + i * QNR, nr_last * 4);
    }
  }
}

// Weight rows [n0, n1) against the x8 pack xp of M rows.
void gemm_rows_q8(const void* xp, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                  int64_t n0, int64_t n1, float* y, int64_t ldy, bool k256 = false) {
  const uint8_t* xu = static_cast<const uint8_t*>(xp);
  const int8_t* xq = reinterpret_cast<const int8_t*>(xu);
  const float* dx = reinterpret_cast<const float*>(xu + x8_dx_offset(M, K));
  const float* ds = reinterpret_cast<const float*>(xu + x8_ds_offset(M, K));
  const int32_t* sx = reinterpret_cast<const int32_t*>(xu + x8_sx_offset(M, K));
  switch (type) {
    case ikj::T_Q8_0: return gemm_rows_q8_t<ikj::T_Q8_0, 34>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_Q4_0: return gemm_rows_q8_t<ikj::T_Q4_0, 18>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_Q5_0: return gemm_rows_q8_t<ikj::T_Q5_0, 22>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_Q4_1: return gemm_rows_q8_t<ikj::T_Q4_1, 20>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_Q5_1: return gemm_rows_q8_t<ikj::T_Q5_1, 24>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_Q4_K: return gemm_rows_q8_t<ikj::T_Q4_K, 144>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_Q5_K: return gemm_rows_q8_t<ikj::T_Q5_K, 176>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    case ikj::T_IQ4_XS:  // x per 256 (QM_Q8K) or per 32 (kIQ4XS32), as the pack was made
      if (k256) return gemm_rows_q8_t<ikj::T_IQ4_XS, 136>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
      return gemm_rows_q8_t<kIQ4XS32, 136>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
    default: return gemm_rows_q8_t<ikj::T_IQ4_NL, 18>(xq, dx, ds, sx, M, K, w, row_bytes, n0, n1, y, ldy);
  }
}
#endif

// Call f(integral_constant<int, mr>) for a run-time mr in [1, MR].
template <typename F>
void for_mr(int mr, F&& f) {
  for_rows<MR>(mr, f);
}

// Many rows of x: panels of NR weight rows in [n0, n1).
// xp: x packed by pack_x (f32, or bf16 pairs when compute is bf16 and the CPU has dpbf16).
void gemm_rows(const void* xp, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
               int64_t n0, int64_t n1, float* y, int64_t ldy, int compute) {
#if defined(IKJ_HAVE_Q8GEMM)
  if (compute == QM_Q8 || compute == QM_Q8K) return gemm_rows_q8(xp, M, K, w, row_bytes, type, n0, n1, y, ldy, compute == QM_Q8K);
#endif
  thread_local std::vector<float> buf, panel, ctile;
  thread_local std::vector<uint16_t> panel_bf;
  if (static_cast<int64_t>(buf.size()) < K) buf.resize(K);
  if (static_cast<int64_t>(ctile.size()) < M * NR) ctile.resize(M * NR);
#if defined(IKJ_HAVE_DPBF16)
  const bool dp = compute == QM_BF16;
#else
  const bool dp = false;
#endif
  const int64_t Kp = (K + 1) / 2;
  if (dp) {
    if (static_cast<int64_t>(panel_bf.size()) < Kp * 2 * NR) panel_bf.resize(Kp * 2 * NR);
  } else if (static_cast<int64_t>(panel.size()) < NR * K) {
    panel.resize(NR * K);
  }
#if defined(IKJ_HAVE_DPBF16)
  // [NR][lp] the panel's rows as bf16 pairs; lp = Kp rounded up to 16 pairs, + 16 pairs so that the
  // transpose's 16 loads are not 4 KiB apart (K = 2048 gave rows of exactly 4 KiB: every load of a
  // 16 x 16 block fell in one L1 set and the transpose cost as much as 2/3 of the microkernel)
  const int64_t lp = (Kp + 15) / 16 * 16 + 16;
  thread_local std::vector<uint32_t> pairs;
  if (dp && static_cast<int64_t>(pairs.size()) < NR * lp) pairs.resize(NR * lp);
#endif
  for (int64_t p0 = n0; p0 < n1; p0 += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - p0);
#if defined(IKJ_HAVE_DPBF16)
    if (dp) {
      // each row dequantized once, converted to bf16 pairs 32 values at a time, then transposed
      // into [Kp][NR] 16 x 16 pairs at a time (the scalar per-value scatter cost as much as the
      // microkernel when an expert's panel serves ~48 rows)
      const uint32_t* rows[NR];
      for (int64_t j = 0; j < NR; ++j) {
        rows[j] = nullptr;
        if (j >= nr) continue;
        const float* r = buf.data();
        if (type == ikj::T_F32) r = reinterpret_cast<const float*>(w + (p0 + j) * row_bytes);
        else dequant_row(type, w + (p0 + j) * row_bytes, K, buf.data());
        to_bf16_pairs(r, K, pairs.data() + j * lp);
        rows[j] = pairs.data() + j * lp;
      }
      uint32_t* pb = reinterpret_cast<uint32_t*>(panel_bf.data());
      for (int h = 0; h < NR; h += 16) scatter_pairs16(rows + h, Kp, pb + h, NR, 16);
    } else
#endif
    // dequantize each row of the panel once and scatter it into column j of [K][NR]
    for (int64_t j = 0; j < NR; ++j) {
      const float* r = buf.data();
      if (j >= nr) {
        std::memset(buf.data(), 0, K * 4);
      } else if (type == ikj::T_F32) {
        r = reinterpret_cast<const float*>(w + (p0 + j) * row_bytes);
      } else {
        dequant_row(type, w + (p0 + j) * row_bytes, K, buf.data());
      }
      float* pf = panel.data() + j;  // (bf16 pairs: above)
      for (int64_t k = 0; k < K; ++k) pf[k * NR] = r[k];
    }
    if (compute == QM_BF16 && !dp) round_bf16_inplace(panel.data(), NR * K);
    // K in chunks whose slice of the panel (KC x NR) stays in L1 across all M tiles
    const bool direct = nr == NR;
    float* Cbase = direct ? y + p0 : ctile.data();
    const int64_t ldc = direct ? ldy : NR;
    for (int64_t kc0 = 0; kc0 < K; kc0 += KC) {
      const int64_t kcl = std::min<int64_t>(KC, K - kc0);
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, M - m0));
        float* C = Cbase + m0 * ldc;
        for_mr(mr, [&](auto c) {
          constexpr int R = decltype(c)::value;
          if (dp) {
#if defined(IKJ_HAVE_DPBF16)
            micro_bf16<R>(static_cast<const uint32_t*>(xp) + m0 * Kp + kc0 / 2 * MR, panel_bf.data() + kc0 * NR,
                          (kcl + 1) / 2, C, ldc, kc0 > 0);
#endif
          } else {
            micro_f32<R>(static_cast<const float*>(xp) + m0 * K + kc0 * MR, panel.data() + kc0 * NR, kcl, C, ldc,
                         kc0 > 0);
          }
        });
      }
    }
    if (!direct)
      for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * ldy + p0, ctile.data() + i * NR, nr * 4);
  }
}

// x [M, K] f32 -> tiles of MR rows interleaved: [ceil(M / MR)][K][MR] floats (rows past M zero),
// rounded to bf16 when compute is bf16; with dpbf16, bf16 pairs [ceil(M / MR)][ceil(K / 2)][MR] u32.
// Returns the bytes needed when out is null; packs tiles [t0, t1) (all when t1 < 0) otherwise.
// The microkernel then broadcasts sequentially.
size_t pack_x(const float* x, int64_t M, int64_t K, int compute, void* out, int64_t t0 = 0, int64_t t1 = -1) {
  const int64_t tiles = (M + MR - 1) / MR, Kp = (K + 1) / 2;
#if defined(IKJ_HAVE_Q8GEMM)
  if (compute == QM_Q8 || compute == QM_Q8K) {  // the int8 prompt engine's x8 pack (rows of the tiles [t0, t1))
    if (!out) return x8_bytes(M, K);
    if (t1 < 0) t1 = tiles;
    pack_x8(x, M, K, static_cast<uint8_t*>(out), std::min(M, t0 * MR), std::min(M, t1 * MR), compute == QM_Q8K);
    return 0;
  }
#endif
#if defined(IKJ_HAVE_DPBF16)
  const bool dp = compute == QM_BF16;
#else
  const bool dp = false;
#endif
  if (!out) return dp ? tiles * Kp * MR * 4 : tiles * K * MR * 4;
  if (t1 < 0) t1 = tiles;
#if defined(IKJ_HAVE_DPBF16)
  const int64_t lp = (Kp + 15) / 16 * 16 + 16;  // [MR][lp], rows not 4 KiB apart (see gemm_rows)
  thread_local std::vector<uint32_t> pairs;
  if (dp && static_cast<int64_t>(pairs.size()) < MR * lp) pairs.resize(MR * lp);
#endif
  for (int64_t t = t0; t < t1; ++t) {
#if defined(IKJ_HAVE_DPBF16)
    if (dp) {  // rows as bf16 pairs, then [Kp][MR] through the 16 x 16 transpose (rows past M: 0)
      const uint32_t* rows[16] = {};
      for (int i = 0; i < MR; ++i) {
        const int64_t m = t * MR + i;
        if (m >= M) continue;
        to_bf16_pairs(x + m * K, K, pairs.data() + i * lp);
        rows[i] = pairs.data() + i * lp;
      }
      scatter_pairs16(rows, Kp, static_cast<uint32_t*>(out) + t * Kp * MR, MR, MR);
      continue;
    }
#endif
    for (int i = 0; i < MR; ++i) {
      const int64_t m = t * MR + i;
      const float* xr = x + (m < M ? m : 0) * K;
      float* o = static_cast<float*>(out) + t * K * MR + i;  // (bf16 pairs: above)
      for (int64_t k = 0; k < K; ++k) {
        float v = m < M ? xr[k] : 0.f;
        o[k * MR] = compute == QM_BF16 ? round_bf16(v) : v;
      }
    }
  }
  return 0;
}

// Rows of x at which the packed-panel engine beats dequantize-and-dot (bench_cpu.py).
constexpr int64_t kGemmMinRows = 4;
// The fewest rows of x a part of a row-split prompt product has (quant_matmul_ex): two of the amx
// level's 32-row groups, so a part still runs on its tiles.
constexpr int64_t kSplitRows = 64;
// IKJAX_CPU_ROW_SPLIT=0: a prompt product with few column units for the threads splits columns only (read per call)
inline bool row_split_on() { return ikj::env_on("IKJAX_CPU_ROW_SPLIT"); }
// IKJAX_CPU_PART_ROWS=R (>= 64; unset: none): every prompt product's x in parts of at most R rows
// (a part's x then stays in L2 across the weight's panels; each part converts them again). A tuning
// knob for measuring, read per call.
inline int64_t part_rows_cap() {
  const char* v = std::getenv("IKJAX_CPU_PART_ROWS");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return end && *end == 0 && n >= kSplitRows ? n : 0;
}

}  // namespace

// ---- public --------------------------------------------------------------------------------------

bool dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  switch (type) {
    case ikj::T_F32: std::memcpy(out, row, K * 4); return true;
    case ikj::T_F16: dq_f16(row, K, out); return true;
    case ikj::T_BF16: dq_bf16(row, K, out); return true;
    case ikj::T_Q8_0: dq_q8_0(row, K / 32, out); return true;
    case ikj::T_Q4_0: dq_q4<0>(row, K / 32, out); return true;
    case ikj::T_Q4_1: dq_q4<1>(row, K / 32, out); return true;
    case ikj::T_IQ4_NL: dq_q4<2>(row, K / 32, out); return true;
    case ikj::T_Q5_0: dq_q5<0>(row, K / 32, out); return true;
    case ikj::T_Q5_1: dq_q5<1>(row, K / 32, out); return true;
    default: return dequant_row_kquants(type, row, K, out);
  }
}

bool dequant_supported(int type) { return own_type(type) || dequant_row_kquants(type, nullptr, 0, nullptr); }

bool quant_matmul_supported(int type) { return dequant_supported(type); }

void qgemm_tile_ex(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                   int64_t n0, int64_t n1, float* y, int64_t ldy, int compute) {
  if (n1 <= n0 || M <= 0) return;
  if (M < kGemmMinRows) {
    // decode-sized: with compute = bf16, 8-bit activations and int8 dot products where the level
    // has them (VNNI) for the type; otherwise f32 (bf16 rounding would only add work there)
#if defined(IKJ_HAVE_Q8DOT)
    if (compute == QM_BF16 && (q8_offset(type) >= 0 || kq8_type(type))) {
      // callers (the fused MoE) take a few output columns per call, often with the same x: the last
      // x quantized by this thread is kept with a copy of it and reused when it is equal (a compare
      // costs a sixth of quantizing: measured ~10 % of a 128-column Q4_0 tile otherwise)
      thread_local XQ8 xq;
      thread_local std::vector<float> xlast;
      thread_local int64_t last_m = -1, last_k = -1;
      thread_local int last_type = -1;
      if (M != last_m || K != last_k || type != last_type || std::memcmp(x, xlast.data(), M * K * 4) != 0) {
        quantize_x8(x, M, K, type, xq);
        xlast.assign(x, x + M * K);
        last_m = M, last_k = K, last_type = type;
      }
      decode_q8_rows(xq, M, 0, K / 32, w, row_bytes, type, n0, n1, y, ldy, false);
      return;
    }
#endif
    decode_rows(x, M, K, w, row_bytes, type, n0, n1, 0, K, y, ldy, false, QM_F32);
    return;
  }
  compute = qgemm_packed_compute(type, compute);
  thread_local std::vector<uint8_t> xp;
  const size_t bytes = pack_x(x, M, K, compute, nullptr);
  if (xp.size() < bytes) xp.resize(bytes);
  pack_x(x, M, K, compute, xp.data());
  gemm_rows(xp.data(), M, K, w, row_bytes, type, n0, n1, y, ldy, compute);
}

int64_t qgemm_packed_min_rows() { return kGemmMinRows; }

int qgemm_packed_compute(int type, int compute) {
#if defined(IKJ_HAVE_Q8GEMM)
  if (compute == QM_BF16 && q8gemm_type(type)) return q8gemm_k256(type) && iq4xs_k256() ? QM_Q8K : QM_Q8;
#endif
  (void)type;
  return compute;
}

size_t qgemm_pack_x(const float* x, int64_t M, int64_t K, int compute, void* out) {
  return pack_x(x, M, K, compute, out);
}

void qgemm_tile_packed(const void* xp, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                       int64_t n0, int64_t n1, float* y, int64_t ldy, int compute) {
  if (n1 <= n0 || M <= 0) return;
  gemm_rows(xp, M, K, w, row_bytes, type, n0, n1, y, ldy, compute);
}

void qgemm_tile(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                int64_t n0, int64_t n1, float* y, int64_t ldy) {
  qgemm_tile_ex(x, M, K, w, row_bytes, type, n0, n1, y, ldy, QM_F32);
}

void quant_matmul_ex(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                     int64_t row_bytes, int type, int n_threads, int compute) {
  if (M <= 0 || N <= 0) return;
  if (K == 0) {
    std::memset(y, 0, M * N * 4);
    return;
  }
  if (M < kGemmMinRows) {
    // decode-sized: 8-bit activations (x quantized once here) where qgemm_tile_ex would use them,
    // f32 otherwise
#if defined(IKJ_HAVE_Q8DOT)
    const bool q8 = compute == QM_BF16 && (q8_offset(type) >= 0 || kq8_type(type));
    thread_local XQ8 xq_tls;
    XQ8& xq = xq_tls;  // the caller's: a lambda run by the pool's threads would name their own thread_local
    if (q8) quantize_x8(x, M, K, type, xq);
#endif
    compute = QM_F32;
    // rows [a, b) of W over the K range [k0, k1) (block aligned) into y (row stride ldy)
    auto rows = [&](int64_t a, int64_t b, int64_t k0, int64_t k1, float* yy, int64_t ldy) {
#if defined(IKJ_HAVE_Q8DOT)
      if (q8) return decode_q8_rows(xq, M, k0 / 32, (k1 - k0) / 32, w, row_bytes, type, a, b, yy, ldy, false);
#endif
      decode_rows(x, M, K, w, row_bytes, type, a, b, k0, k1, yy, ldy, false, compute);
    };
    // Enough rows of W per thread: split N. Otherwise also split K into block-aligned chunks
    // (own types only: their rows are plain block sequences) and add the parts in order.
    int nth_max = n_threads > 0 ? n_threads : ikj::available_cores();
    nth_max = std::min(nth_max, ikj::available_cores());
    const bool split_k = N < 4 * nth_max && own_type(type) && K % (256 * nth_max) == 0 && nth_max > 1;
    if (!split_k) {
      // chunks of rows taken from a shared counter: a thread that is descheduled (other processes,
      // XLA's own threads) does not hold the whole product back
      const int64_t chunk = std::max<int64_t>(16, N / (8 * nth_max));
      std::atomic<int64_t> next{0};
      ikj::parallel(n_threads, [&](int, int) {
        for (int64_t a; (a = next.fetch_add(chunk, std::memory_order_relaxed)) < N;)
          rows(a, std::min(N, a + chunk), 0, K, y, N);
      });
      return;
    }
    std::vector<float> part(static_cast<size_t>(nth_max) * M * N);
    int used = 1;
    ikj::parallel(n_threads, [&](int ith, int nth) {
      if (ith == 0) used = nth;
      const int64_t kc = K / nth;  // K % (256 * nth_max) == 0 and nth <= nth_max
      rows(0, N, ith * kc, (ith + 1) * kc, part.data() + ith * M * N, N);
    });
    for (int64_t i = 0; i < M * N; ++i) {
      float s = 0.f;
      for (int t = 0; t < used; ++t) s += part[t * M * N + i];
      y[i] = s;
    }
    return;
  }
  // A prompt-sized call's pack buffers are one set per process, not per calling thread: XLA runs a
  // custom call on whichever of its workers picks it up, and per-thread buffers (x packed, up to
  // ~22 MiB) were grown and faulted in again each time a new worker called (RESULTS §26ai).
  // Prompt-sized calls are serialized here (each runs on the whole pool anyway); decode-sized ones
  // keep their caller's small buffer and run as before.
  static std::mutex prompt_mu;
  std::lock_guard<std::mutex> prompt_lock(prompt_mu);
  compute = qgemm_packed_compute(type, compute);
  const int64_t nth = std::min<int64_t>(n_threads > 0 ? n_threads : ikj::available_cores(), ikj::available_cores());
  // output columns per unit of work: the int8 engine's QUNIT (its panels swept together), halved
  // (down to NR) while that would leave fewer than 3 units a thread (-t 16 on a 576-column product:
  // 18 units of 32 kept some threads idle half the time)
  int64_t unit = NR;
#if defined(IKJ_HAVE_Q8GEMM)
  if (compute == QM_Q8 || compute == QM_Q8K) {
    unit = std::max<int64_t>(NR, QUNIT);
    while (unit > NR && N < 3 * nth * unit) unit /= 2;
    unit = std::max<int64_t>(unit, NR);
  }
#endif
  const int64_t units = (N + unit - 1) / unit;
  // Too few column units for the threads (a router's 64 columns are 2 units: 14 of 16 threads
  // idle; a 576-column kv_a is 18, a second round for 2 threads): x's rows are split too, into
  // `parts` of at least kSplitRows rows, each packed on its own and run against every unit (each
  // part converts the weight's panels again: small weights only), where that shortens the rounds
  // of items the threads run (2 units on 2 threads stay whole). Every output is the same sum
  // over the same blocks either way (the same bits). IKJAX_CPU_ROW_SPLIT=0: columns only.
  int64_t parts = 1;
  if (units < 2 * nth && row_split_on()) {  // the fewest parts with the shortest rounds (ceil(items / nth) / parts)
    const int64_t most = std::min<int64_t>((3 * nth + units - 1) / units, M / kSplitRows);
    for (int64_t p = 2; p <= most; ++p)
      if ((p * units + nth - 1) / nth * parts < (parts * units + nth - 1) / nth * p) parts = p;
  }
  if (const int64_t pr = part_rows_cap(); pr > 0) parts = std::max(parts, (M + pr - 1) / pr);
  const int64_t part_rows = (M + parts - 1) / parts;
  parts = (M + part_rows - 1) / part_rows;
  // the call's pack buffer, kept between calls: a fresh one per call (up to ~22 MiB for a
  // 512-row f32 x of K = 10944) was mapped and zeroed by the kernel on every call (clear_page was
  // ~8 % of a Q8_0 sweep-bench profile on the 2-core EPYC)
  static std::vector<uint8_t> xp_buf;
  static std::vector<size_t> xp_off;
  xp_off.assign(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t mp = std::min(M, (p + 1) * part_rows) - p * part_rows;
    xp_off[p + 1] = xp_off[p] + (pack_x(nullptr, mp, K, compute, nullptr) + 63) / 64 * 64;
  }
  if (xp_buf.size() < xp_off[parts]) xp_buf.resize(xp_off[parts]);
  uint8_t* const xp_data = xp_buf.data();
  const size_t* const off = xp_off.data();
  // every part's row tiles split between all the threads (a part a thread left 13 of 16 idle
  // while 3 packed kv_a's three parts)
  ikj::parallel(n_threads, [&](int ith, int nth_) {
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t r0 = p * part_rows, mp = std::min(M, r0 + part_rows) - r0;
      int64_t a, b;
      ikj::split_range((mp + MR - 1) / MR, ith, nth_, &a, &b);
      if (a < b) pack_x(x + r0 * K, mp, K, compute, xp_data + off[p], a, b);
    }
  });
  // (part, unit) items handed out one at a time, part by part (see the decode split)
  const int64_t items = parts * units;
  std::atomic<int64_t> next{0};
  ikj::parallel(n_threads, [&](int, int) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t p = i / units, u = i % units, r0 = p * part_rows;
      gemm_rows(xp_data + off[p], std::min(M, r0 + part_rows) - r0, K, w, row_bytes, type, u * unit,
                std::min(N, (u + 1) * unit), y + r0 * N, N, compute);
    }
  });
}

void quant_matmul(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t row_bytes, int type, int n_threads) {
  quant_matmul_ex(x, w, y, M, N, K, row_bytes, type, n_threads, QM_F32);
}

}  // namespace IKJ_NS
