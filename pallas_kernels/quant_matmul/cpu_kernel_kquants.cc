// Row dequantizers of the CPU kernels for the K-quants (Q2_K..Q6_K, IQ4_XS) and ik_llama.cpp's own
// types (IQ2_K..IQ6_K, IQ4_KS and the other per-row-scaled *_KS types, Q6_0): GGUF bytes as stored
// -> float32. Compiled once per instruction-set level (namespace IKJ_NS; pallas_kernels/CMakeLists.txt).
//
// Why these are exact: every value is formed as in the jnp reference (ikjax/quant/dequant.py,
// ik_types.py): a block scale d (f16 widened exactly, or the row's f32), a sub-block scale
// dl = d * float(int scale) rounded to float, then dl * float(q) (and - ml for the types with mins),
// each product rounded on its own. Fusing dl * q - ml into one FMA would change the last bit, so
// contraction is switched off for this file (the build's gnu++17 mode would otherwise allow it).
//
// Why this speed: a decode step reads every weight once; the row is produced as int8 quants (a few
// byte-SIMD ops per 16 weights: nibble/crumb unpack, pshufb lookups of the non-linear IQ tables)
// and widened to float 16 at a time with one multiply (+ one subtract) per vector.
#include "quant_matmul/cpu_dequant.h"

#include <cstring>

#include "cpu/common.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#define IKJ_KQ_SIMD 1
#else
#define IKJ_KQ_SIMD 0
#endif

namespace IKJ_NS {
namespace {

// ik_llama.cpp type ids (ikjax/quant/ik_types.py, from ik's ggml.h); standard ones are in cpu/common.h.
enum : int {
  T_Q6_0 = 133, T_IQ2_K = 137, T_IQ3_K = 138, T_IQ4_K = 139, T_IQ5_K = 140, T_IQ6_K = 141,
  T_IQ4_KS = 144, T_IQ2_KS = 145, T_IQ4_KSS = 146, T_IQ5_KS = 152, T_IQ3_KS = 156,
};

constexpr int QK = 256;

// Non-linear value tables (ggml-common.h / ik's iqk; the same numbers as ikjax's jnp tables).
alignas(16) const int8_t kIQ4K[32] = {-127, -104, -83, -65, -49, -35, -22, -10, 1,  13, 25, 38, 53, 69, 89, 113,
                                      -123, -100, -79, -61, -45, -31, -18, -6,  5,  17, 29, 42, 57, 73, 93, 117};
// IQ2_K: 4 values per half; laid as two 16-byte pshufb tables (entries 4.. unused).
alignas(16) const int8_t kIQ2NL[2][16] = {{-31, -13, 1, 17}, {-26, -8, 6, 22}};
alignas(16) const int8_t kIQ3NL[2][16] = {{-63, -40, -23, -10, 1, 13, 28, 47},
                                          {-59, -36, -19, -6, 5, 17, 32, 51}};
alignas(16) const int8_t kIQ5NL[64] = {
    -126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
    -1,   5,    11,   17,  23,  29,  36,  43,  51,  59,  68,  77,  87,  97,  109, 121,
    -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
    1,    7,    13,   19,  25,  31,  38,  45,  53,  61,  70,  79,  89,  99,  111, 123};
// IQ6_K: the 64 base values; the shifted half is base + 1.
alignas(16) const int8_t kIQ6NL[64] = {
    -127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
    -51,  -47,  -44,  -40,  -37,  -34, -31, -28, -25, -22, -19, -16, -13, -11, -8,  -5,
    -2,   0,    3,    6,    9,    12,  14,  17,  20,  23,  27,  30,  33,  36,  40,  44,
    47,   51,   55,   59,   63,   68,  72,  77,  82,  87,  92,  98,  103, 109, 115, 121};

inline float f16(const uint8_t* p) {
#if defined(__F16C__) && IKJ_KQ_SIMD
  return _cvtsh_ss(ikj::load_u16(p));
#else
  return ikj::fp16_to_f32(ikj::load_u16(p));
#endif
}

inline float f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int bit(unsigned x, int i) { return (x >> i) & 1; }

// ---------------------------------------------------------------------------------------------
// Float stage: n int8 quants -> out = d * q (or d * q - m). Scalar for any n; SIMD for 16 at a time.

inline void emit_s(float* out, const int8_t* q, int n, float d) {
  for (int i = 0; i < n; ++i) out[i] = d * static_cast<float>(q[i]);
}
inline void emit_sm(float* out, const int8_t* q, int n, float d, float m) {
  for (int i = 0; i < n; ++i) out[i] = d * static_cast<float>(q[i]) - m;
}

#if IKJ_KQ_SIMD
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline void emit16(float* out, __m128i q, float d) {
#if defined(__AVX512F__)
  __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(d), v));
#else
  __m256 vd = _mm256_set1_ps(d);
  __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
  _mm256_storeu_ps(out, _mm256_mul_ps(vd, v0));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(vd, v1));
#endif
}

inline void emit16m(float* out, __m128i q, float d, float m) {
#if defined(__AVX512F__)
  __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  _mm512_storeu_ps(out, _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(d), v), _mm512_set1_ps(m)));
#else
  __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
  _mm256_storeu_ps(out, _mm256_sub_ps(_mm256_mul_ps(vd, v0), vm));
  _mm256_storeu_ps(out + 8, _mm256_sub_ps(_mm256_mul_ps(vd, v1), vm));
#endif
}

// n (a multiple of 16) int8 quants with one scale per 16.
inline void emit_q16(float* out, const int8_t* q, int n, const float* dl) {
  for (int s = 0; s < n / 16; ++s) emit16(out + 16 * s, load16(reinterpret_cast<const uint8_t*>(q) + 16 * s), dl[s]);
}
inline __m128i lo4(__m128i x) { return _mm_and_si128(x, _mm_set1_epi8(0x0F)); }
inline __m128i hi4(__m128i x) { return _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(0x0F)); }
#endif

#if defined(__AVX512F__)
// Sub-blocks with at most 16 distinct values: the 16 outputs dl * v[i] (- ml) are formed once per
// sub-block as a float table (the same products as per weight, so still exact) and each group of 16
// weights is one vpermps of it by their 4-bit indices (only bits 0-3 of each index are read).
inline void emit16_tab(float* out, __m512i idx, __m512 tab) {
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, tab));
}
inline __m512i idx_lo(__m128i x) { return _mm512_cvtepu8_epi32(x); }                        // low nibble
inline __m512i idx_hi(__m128i x) { return _mm512_srli_epi32(_mm512_cvtepu8_epi32(x), 4); }  // high nibble
// (a constant array, not a static __m512: no AVX-512 instruction may run at load time on other CPUs)
alignas(64) const float kIota16[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline __m512 tab_iq4k(int shifted) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4K + 16 * shifted))));
}
#endif

// Scalar: a block decoded to int8 quants, one scale per 16 (dl[16]) -> 256 floats.
inline void emit_block16(float* out, const int8_t* q, const float* dl) {
#if IKJ_KQ_SIMD
  emit_q16(out, q, QK, dl);
#else
  for (int s = 0; s < 16; ++s) emit_s(out + 16 * s, q + 16 * s, 16, dl[s]);
#endif
}

// ---------------------------------------------------------------------------------------------
// K-quants

// block_q2_K (84 B): scales[16] (low nibble scale, high nibble min); qs[64]; half d; half dmin.
// Weight w = 128*h + 32*j + t: 2-bit field j of qs[32*h + t]; sub-block w/16.
void block_q2_k(const uint8_t* b, float* out) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  float dl[16], ml[16];
  for (int s = 0; s < 16; ++s) {
    dl[s] = d * static_cast<float>(sc[s] & 0xF);
    ml[s] = dmin * static_cast<float>(sc[s] >> 4);
  }
#if IKJ_KQ_SIMD
  const __m128i m3 = _mm_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    __m128i x0 = load16(qs + 32 * h), x1 = load16(qs + 32 * h + 16);
    for (int j = 0; j < 4; ++j) {
      const int s = 8 * h + 2 * j;
      emit16m(out + 128 * h + 32 * j, _mm_and_si128(x0, m3), dl[s], ml[s]);
      emit16m(out + 128 * h + 32 * j + 16, _mm_and_si128(x1, m3), dl[s + 1], ml[s + 1]);
      x0 = _mm_srli_epi16(x0, 2);
      x1 = _mm_srli_epi16(x1, 2);
    }
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 32; ++t) {
        const int w = 128 * h + 32 * j + t;
        out[w] = dl[w / 16] * static_cast<float>((qs[32 * h + t] >> (2 * j)) & 3) - ml[w / 16];
      }
#endif
}

// block_q3_K (110 B): hmask[32]; qs[64]; scales[12] (16 6-bit scales); half d.
// Weight w = 128*h + 32*j + t: low 2 bits field j of qs[32*h + t], high bit bit (4h+j) of hmask[t]
// (clear: minus 4); q in [-4, 3].
void block_q3_k(const uint8_t* b, float* out) {
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = f16(b + 108);
  float dl[16];
  for (int s = 0; s < 16; ++s) {
    const int lo = s < 8 ? (sc[s] & 0xF) : (sc[s - 8] >> 4);
    const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    dl[s] = d * static_cast<float>((lo | (hi << 4)) - 32);
  }
#if IKJ_KQ_SIMD
  const __m128i m3 = _mm_set1_epi8(3), m4b = _mm_set1_epi8(4);
  const __m128i h0 = load16(hm), h1 = load16(hm + 16);
  for (int h = 0; h < 2; ++h) {
    __m128i x0 = load16(qs + 32 * h), x1 = load16(qs + 32 * h + 16);
    for (int j = 0; j < 4; ++j) {
      const int jb = 4 * h + j;  // hmask bit; moved to bit 2
      __m128i hb0 = jb >= 2 ? _mm_srli_epi16(h0, jb - 2) : _mm_slli_epi16(h0, 2 - jb);
      __m128i hb1 = jb >= 2 ? _mm_srli_epi16(h1, jb - 2) : _mm_slli_epi16(h1, 2 - jb);
      __m128i q0 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(x0, m3), _mm_and_si128(hb0, m4b)), m4b);
      __m128i q1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(x1, m3), _mm_and_si128(hb1, m4b)), m4b);
      const int s = 8 * h + 2 * j;
      emit16(out + 128 * h + 32 * j, q0, dl[s]);
      emit16(out + 128 * h + 32 * j + 16, q1, dl[s + 1]);
      x0 = _mm_srli_epi16(x0, 2);
      x1 = _mm_srli_epi16(x1, 2);
    }
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 32; ++t) {
        const int w = 128 * h + 32 * j + t;
        const int q = ((qs[32 * h + t] >> (2 * j)) & 3) - (bit(hm[t], 4 * h + j) ? 0 : 4);
        out[w] = dl[w / 16] * static_cast<float>(q);
      }
#endif
}

// The 12 packed bytes of Q4_K/Q5_K scales -> 8 6-bit scales and 8 6-bit mins.
inline void k_scale_min(const uint8_t* sc, int* s, int* m) {
  for (int j = 0; j < 4; ++j) {
    s[j] = sc[j] & 0x3F;
    m[j] = sc[4 + j] & 0x3F;
    s[4 + j] = (sc[8 + j] & 0xF) | ((sc[j] >> 2) & 0x30);
    m[4 + j] = (sc[8 + j] >> 4) | ((sc[4 + j] >> 2) & 0x30);
  }
}

// block_q4_K (144 B): half d; half dmin; scales[12]; qs[128]. Weight w = 64*g + 32*h + t: nibble h
// of qs[32*g + t]; 32-sub-block 2g+h.
void block_q4_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  int s[8], m[8];
  k_scale_min(b + 4, s, m);
  float dl[8], ml[8];
  for (int j = 0; j < 8; ++j) {
    dl[j] = d * static_cast<float>(s[j]);
    ml[j] = dmin * static_cast<float>(m[j]);
  }
  const uint8_t* qs = b + 16;
#if defined(__AVX512F__)
  const __m512 iota = _mm512_load_ps(kIota16);
  for (int g = 0; g < 4; ++g) {
    const __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    float* o = out + 64 * g;
    const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dl[2 * g]), iota), _mm512_set1_ps(ml[2 * g]));
    const __m512 t1 =
        _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dl[2 * g + 1]), iota), _mm512_set1_ps(ml[2 * g + 1]));
    emit16_tab(o, idx_lo(x0), t0);
    emit16_tab(o + 16, idx_lo(x1), t0);
    emit16_tab(o + 32, idx_hi(x0), t1);
    emit16_tab(o + 48, idx_hi(x1), t1);
  }
#elif IKJ_KQ_SIMD
  for (int g = 0; g < 4; ++g) {
    const __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    float* o = out + 64 * g;
    emit16m(o, lo4(x0), dl[2 * g], ml[2 * g]);
    emit16m(o + 16, lo4(x1), dl[2 * g], ml[2 * g]);
    emit16m(o + 32, hi4(x0), dl[2 * g + 1], ml[2 * g + 1]);
    emit16m(o + 48, hi4(x1), dl[2 * g + 1], ml[2 * g + 1]);
  }
#else
  for (int g = 0; g < 4; ++g)
    for (int t = 0; t < 32; ++t) {
      out[64 * g + t] = dl[2 * g] * static_cast<float>(qs[32 * g + t] & 0xF) - ml[2 * g];
      out[64 * g + 32 + t] = dl[2 * g + 1] * static_cast<float>(qs[32 * g + t] >> 4) - ml[2 * g + 1];
    }
#endif
}

// block_q5_K (176 B): half d; half dmin; scales[12]; qh[32]; qs[128]. As Q4_K plus a fifth bit:
// bit j of qh[t] for weight 32*j + t.
void block_q5_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  int s[8], m[8];
  k_scale_min(b + 4, s, m);
  float dl[8], ml[8];
  for (int j = 0; j < 8; ++j) {
    dl[j] = d * static_cast<float>(s[j]);
    ml[j] = dmin * static_cast<float>(m[j]);
  }
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
#if IKJ_KQ_SIMD
  const __m128i h0 = load16(qh), h1 = load16(qh + 16), m16 = _mm_set1_epi8(0x10);
  auto hbits = [&](__m128i hv, int j) {  // bit j of each byte -> bit 4
    return _mm_and_si128(j <= 4 ? _mm_slli_epi16(hv, 4 - j) : _mm_srli_epi16(hv, j - 4), m16);
  };
  for (int g = 0; g < 4; ++g) {
    const __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    float* o = out + 64 * g;
    const int j0 = 2 * g, j1 = 2 * g + 1;
    emit16m(o, _mm_or_si128(lo4(x0), hbits(h0, j0)), dl[j0], ml[j0]);
    emit16m(o + 16, _mm_or_si128(lo4(x1), hbits(h1, j0)), dl[j0], ml[j0]);
    emit16m(o + 32, _mm_or_si128(hi4(x0), hbits(h0, j1)), dl[j1], ml[j1]);
    emit16m(o + 48, _mm_or_si128(hi4(x1), hbits(h1, j1)), dl[j1], ml[j1]);
  }
#else
  for (int g = 0; g < 4; ++g)
    for (int t = 0; t < 32; ++t) {
      const int j0 = 2 * g, j1 = 2 * g + 1;
      const int q0 = (qs[32 * g + t] & 0xF) | (bit(qh[t], j0) << 4);
      const int q1 = (qs[32 * g + t] >> 4) | (bit(qh[t], j1) << 4);
      out[64 * g + t] = dl[j0] * static_cast<float>(q0) - ml[j0];
      out[64 * g + 32 + t] = dl[j1] * static_cast<float>(q1) - ml[j1];
    }
#endif
}

// block_q6_K (210 B): ql[128]; qh[64]; int8 scales[16]; half d. Weight w = 128*h + 32*k + t (t < 32):
// low 4 bits nibble k/2 of ql[64*h + 32*(k%2) + t], high 2 bits field k of qh[32*h + t]; minus 32.
void block_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  float dl[16];
  for (int s = 0; s < 16; ++s) dl[s] = d * static_cast<float>(sc[s]);
#if IKJ_KQ_SIMD
  const __m128i m3 = _mm_set1_epi8(0x30), m32 = _mm_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    for (int half = 0; half < 2; ++half) {  // t in [16*half, 16*half + 16)
      const __m128i l0 = load16(ql + 64 * h + 16 * half), l1 = load16(ql + 64 * h + 32 + 16 * half);
      const __m128i hv = load16(qh + 32 * h + 16 * half);
      const __m128i q0 = _mm_or_si128(lo4(l0), _mm_and_si128(_mm_slli_epi16(hv, 4), m3));
      const __m128i q1 = _mm_or_si128(lo4(l1), _mm_and_si128(_mm_slli_epi16(hv, 2), m3));
      const __m128i q2 = _mm_or_si128(hi4(l0), _mm_and_si128(hv, m3));
      const __m128i q3 = _mm_or_si128(hi4(l1), _mm_and_si128(_mm_srli_epi16(hv, 2), m3));
      float* o = out + 128 * h + 16 * half;
      const float* dd = dl + 8 * h + half;
      emit16(o, _mm_sub_epi8(q0, m32), dd[0]);
      emit16(o + 32, _mm_sub_epi8(q1, m32), dd[2]);
      emit16(o + 64, _mm_sub_epi8(q2, m32), dd[4]);
      emit16(o + 96, _mm_sub_epi8(q3, m32), dd[6]);
    }
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int t = 0; t < 32; ++t) {
        const int w = 128 * h + 32 * k + t;
        const int lo = (ql[64 * h + 32 * (k % 2) + t] >> (4 * (k / 2))) & 0xF;
        const int hi = (qh[32 * h + t] >> (2 * k)) & 3;
        out[w] = dl[w / 16] * static_cast<float>((lo | (hi << 4)) - 32);
      }
#endif
}

// block_iq4_xs (136 B): half d; u16 scales_h; scales_l[4]; qs[128]. 32-block j: 6-bit scale (nibble
// j%2 of scales_l[j/2] | 2 bits j of scales_h) - 32; weight 32*j + 16*h + t: iq4nl[nibble h of qs[16*j + t]].
void block_iq4_xs(const uint8_t* b, float* out) {
  const float d = f16(b);
  const unsigned sh = ikj::load_u16(b + 2);
  const uint8_t* sl = b + 4;
  const uint8_t* qs = b + 8;
  float dl[8];
  for (int j = 0; j < 8; ++j) {
    const int ls = ((sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
    dl[j] = d * static_cast<float>(ls - 32);
  }
#if defined(__AVX512F__)
  const __m512 tf = tab_iq4k(0);
  for (int j = 0; j < 8; ++j) {
    const __m128i x = load16(qs + 16 * j);
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(dl[j]), tf);
    emit16_tab(out + 32 * j, idx_lo(x), t);
    emit16_tab(out + 32 * j + 16, idx_hi(x), t);
  }
#elif IKJ_KQ_SIMD
  const __m128i tab = load16(reinterpret_cast<const uint8_t*>(kIQ4K));
  for (int j = 0; j < 8; ++j) {
    const __m128i x = load16(qs + 16 * j);
    emit16(out + 32 * j, _mm_shuffle_epi8(tab, lo4(x)), dl[j]);
    emit16(out + 32 * j + 16, _mm_shuffle_epi8(tab, hi4(x)), dl[j]);
  }
#else
  for (int j = 0; j < 8; ++j)
    for (int t = 0; t < 16; ++t) {
      out[32 * j + t] = dl[j] * static_cast<float>(kIQ4K[qs[16 * j + t] & 0xF]);
      out[32 * j + 16 + t] = dl[j] * static_cast<float>(kIQ4K[qs[16 * j + t] >> 4]);
    }
#endif
}

// ---------------------------------------------------------------------------------------------
// ik_llama.cpp's types

// block_iq4_k (144 B): half d; u16 extra; scales_h[4]; scales_l[8]; qs[128]. 16-sub-block s: 6-bit scale
// (nibble s%2 of scales_l[s/2] | 2 bits s%4 of scales_h[s/4]) - 32, extra bit s: shifted table (+16).
// Weight 32*j + 16*h + t (sub-block 2j+h): nibble h of qs[16*j + t].
void block_iq4_k(const uint8_t* b, float* out) {
  const float d = f16(b);
  const unsigned extra = ikj::load_u16(b + 2);
  const uint8_t* sh = b + 4;
  const uint8_t* sl = b + 8;
  const uint8_t* qs = b + 16;
  float dl[16];
  for (int s = 0; s < 16; ++s) {
    const int ls = ((sl[s / 2] >> (4 * (s % 2))) & 0xF) | (((sh[s / 4] >> (2 * (s % 4))) & 3) << 4);
    dl[s] = d * static_cast<float>(ls - 32);
  }
#if defined(__AVX512F__)
  const __m512 tf[2] = {tab_iq4k(0), tab_iq4k(1)};
  for (int j = 0; j < 8; ++j) {
    const __m128i x = load16(qs + 16 * j);
    emit16_tab(out + 32 * j, idx_lo(x), _mm512_mul_ps(_mm512_set1_ps(dl[2 * j]), tf[bit(extra, 2 * j)]));
    emit16_tab(out + 32 * j + 16, idx_hi(x),
               _mm512_mul_ps(_mm512_set1_ps(dl[2 * j + 1]), tf[bit(extra, 2 * j + 1)]));
  }
#elif IKJ_KQ_SIMD
  const __m128i tab[2] = {load16(reinterpret_cast<const uint8_t*>(kIQ4K)),
                          load16(reinterpret_cast<const uint8_t*>(kIQ4K + 16))};
  for (int j = 0; j < 8; ++j) {
    const __m128i x = load16(qs + 16 * j);
    emit16(out + 32 * j, _mm_shuffle_epi8(tab[bit(extra, 2 * j)], lo4(x)), dl[2 * j]);
    emit16(out + 32 * j + 16, _mm_shuffle_epi8(tab[bit(extra, 2 * j + 1)], hi4(x)), dl[2 * j + 1]);
  }
#else
  for (int j = 0; j < 8; ++j) {
    const int8_t* t0 = kIQ4K + 16 * bit(extra, 2 * j);
    const int8_t* t1 = kIQ4K + 16 * bit(extra, 2 * j + 1);
    for (int t = 0; t < 16; ++t) {
      out[32 * j + t] = dl[2 * j] * static_cast<float>(t0[qs[16 * j + t] & 0xF]);
      out[32 * j + 16 + t] = dl[2 * j + 1] * static_cast<float>(t1[qs[16 * j + t] >> 4]);
    }
  }
#endif
}

// block_iq4_ks (136 B; row prefix: float d): scales[8]; qs[128]. 32-block j: scale (sc & 254) - 127,
// sc & 1: shifted table; weight 32*j + 16*h + t: nibble h of qs[16*j + t].
void block_iq4_ks(const uint8_t* b, float d, float* out) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 8;
#if defined(__AVX512F__)
  const __m512 tf[2] = {tab_iq4k(0), tab_iq4k(1)};
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>((sc[j] & 254) - 127);
    const __m128i x = load16(qs + 16 * j);
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(dl), tf[sc[j] & 1]);
    emit16_tab(out + 32 * j, idx_lo(x), t);
    emit16_tab(out + 32 * j + 16, idx_hi(x), t);
  }
#elif IKJ_KQ_SIMD
  const __m128i tab[2] = {load16(reinterpret_cast<const uint8_t*>(kIQ4K)),
                          load16(reinterpret_cast<const uint8_t*>(kIQ4K + 16))};
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>((sc[j] & 254) - 127);
    const __m128i x = load16(qs + 16 * j);
    const __m128i& tb = tab[sc[j] & 1];
    emit16(out + 32 * j, _mm_shuffle_epi8(tb, lo4(x)), dl);
    emit16(out + 32 * j + 16, _mm_shuffle_epi8(tb, hi4(x)), dl);
  }
#else
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>((sc[j] & 254) - 127);
    const int8_t* tb = kIQ4K + 16 * (sc[j] & 1);
    for (int t = 0; t < 16; ++t) {
      out[32 * j + t] = dl * static_cast<float>(tb[qs[16 * j + t] & 0xF]);
      out[32 * j + 16 + t] = dl * static_cast<float>(tb[qs[16 * j + t] >> 4]);
    }
  }
#endif
}

// block_iq2_k (76 B): half d; u16 extra; scales[8]; qs[64]. 16-sub-block s: scale nibble s%2 of
// scales[s/2] - 8, extra bit s: shifted table (+4). Weight w = 128*h + 32*j + t: field j of qs[32*h + t].
void block_iq2_k(const uint8_t* b, float* out) {
  const float d = f16(b);
  const unsigned extra = ikj::load_u16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qs = b + 12;
  float dl[16];
  for (int s = 0; s < 16; ++s) dl[s] = d * static_cast<float>(((sc[s / 2] >> (4 * (s % 2))) & 0xF) - 8);
#if IKJ_KQ_SIMD
  const __m128i tab[2] = {load16(reinterpret_cast<const uint8_t*>(kIQ2NL[0])),
                          load16(reinterpret_cast<const uint8_t*>(kIQ2NL[1]))};
  const __m128i m3 = _mm_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    __m128i x0 = load16(qs + 32 * h), x1 = load16(qs + 32 * h + 16);
    for (int j = 0; j < 4; ++j) {
      const int s = 8 * h + 2 * j;
      emit16(out + 128 * h + 32 * j, _mm_shuffle_epi8(tab[bit(extra, s)], _mm_and_si128(x0, m3)), dl[s]);
      emit16(out + 128 * h + 32 * j + 16, _mm_shuffle_epi8(tab[bit(extra, s + 1)], _mm_and_si128(x1, m3)),
             dl[s + 1]);
      x0 = _mm_srli_epi16(x0, 2);
      x1 = _mm_srli_epi16(x1, 2);
    }
  }
#else
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 32; ++t) {
        const int w = 128 * h + 32 * j + t, s = w / 16;
        const int q = (qs[32 * h + t] >> (2 * j)) & 3;
        out[w] = dl[s] * static_cast<float>(kIQ2NL[bit(extra, s)][q]);
      }
#endif
}

// block_iq3_k (110 B): half d; u16 extra; u16 scales_h; scales_l[8]; qs[64]; qh[32]. 16-sub-block s:
// scale 2*nibble(s%2 of scales_l[s/2]) + 1, negated if scales_h bit s; extra bit s: shifted table (+8).
// 32-block ib, weight t: 2 bits field ib%4 of qs[32*(ib/4) + t], third bit bit ib of qh[t].
void block_iq3_k(const uint8_t* b, float* out) {
  const float d = f16(b);
  const unsigned extra = ikj::load_u16(b + 2), sh = ikj::load_u16(b + 4);
  const uint8_t* sl = b + 6;
  const uint8_t* qs = b + 14;
  const uint8_t* qh = b + 78;
  float dl[16];
  for (int s = 0; s < 16; ++s) {
    const int ls = (2 * ((sl[s / 2] >> (4 * (s % 2))) & 0xF) + 1) * (1 - 2 * bit(sh, s));
    dl[s] = d * static_cast<float>(ls);
  }
#if IKJ_KQ_SIMD
  const __m128i tab[2] = {load16(reinterpret_cast<const uint8_t*>(kIQ3NL[0])),
                          load16(reinterpret_cast<const uint8_t*>(kIQ3NL[1]))};
  const __m128i m3 = _mm_set1_epi8(3), m4b = _mm_set1_epi8(4);
  const __m128i h0 = load16(qh), h1 = load16(qh + 16);
  for (int g = 0; g < 2; ++g) {
    __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    for (int j = 0; j < 4; ++j) {
      const int ib = 4 * g + j, s = 2 * ib;
      __m128i hb0 = ib >= 2 ? _mm_srli_epi16(h0, ib - 2) : _mm_slli_epi16(h0, 2 - ib);
      __m128i hb1 = ib >= 2 ? _mm_srli_epi16(h1, ib - 2) : _mm_slli_epi16(h1, 2 - ib);
      __m128i q0 = _mm_or_si128(_mm_and_si128(x0, m3), _mm_and_si128(hb0, m4b));
      __m128i q1 = _mm_or_si128(_mm_and_si128(x1, m3), _mm_and_si128(hb1, m4b));
      emit16(out + 32 * ib, _mm_shuffle_epi8(tab[bit(extra, s)], q0), dl[s]);
      emit16(out + 32 * ib + 16, _mm_shuffle_epi8(tab[bit(extra, s + 1)], q1), dl[s + 1]);
      x0 = _mm_srli_epi16(x0, 2);
      x1 = _mm_srli_epi16(x1, 2);
    }
  }
#else
  for (int ib = 0; ib < 8; ++ib)
    for (int t = 0; t < 32; ++t) {
      const int s = 2 * ib + t / 16;
      const int q = ((qs[32 * (ib / 4) + t] >> (2 * (ib % 4))) & 3) | (bit(qh[t], ib) << 2);
      out[32 * ib + t] = dl[s] * static_cast<float>(kIQ3NL[bit(extra, s)][q]);
    }
#endif
}

#if IKJ_KQ_SIMD
// 32-entry int8 table lookup of 5-bit indices (two pshufb, picked by bit 4).
inline __m128i lookup32(const __m128i* tab, __m128i q) {
  const __m128i sel = _mm_slli_epi16(q, 3);  // bit 4 -> bit 7 (the blend's selector)
  return _mm_blendv_epi8(_mm_shuffle_epi8(tab[0], q), _mm_shuffle_epi8(tab[1], q), sel);
}
#endif

// block_iq5_k (176 B): half d; u16 extra; scales_h[4]; scales_l[8]; qs[128]; qh[32]. 32-block ib:
// nibble ib%2 of qs[32*(ib/2) + t] | bit ib of qh[t] << 4; 16-sub-block s: scale as IQ4_K, extra bit s:
// shifted table (+32).
void block_iq5_k(const uint8_t* b, float* out) {
  const float d = f16(b);
  const unsigned extra = ikj::load_u16(b + 2);
  const uint8_t* sh = b + 4;
  const uint8_t* sl = b + 8;
  const uint8_t* qs = b + 16;
  const uint8_t* qh = b + 144;
  float dl[16];
  for (int s = 0; s < 16; ++s) {
    const int ls = ((sl[s / 2] >> (4 * (s % 2))) & 0xF) | (((sh[s / 4] >> (2 * (s % 4))) & 3) << 4);
    dl[s] = d * static_cast<float>(ls - 32);
  }
#if IKJ_KQ_SIMD
  const __m128i* T = reinterpret_cast<const __m128i*>(kIQ5NL);
  const __m128i m16 = _mm_set1_epi8(0x10);
  const __m128i h0 = load16(qh), h1 = load16(qh + 16);
  auto hbits = [&](__m128i hv, int j) {
    return _mm_and_si128(j <= 4 ? _mm_slli_epi16(hv, 4 - j) : _mm_srli_epi16(hv, j - 4), m16);
  };
  for (int g = 0; g < 4; ++g) {
    const __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    for (int hh = 0; hh < 2; ++hh) {
      const int ib = 2 * g + hh, s = 2 * ib;
      const __m128i q0 = _mm_or_si128(hh ? hi4(x0) : lo4(x0), hbits(h0, ib));
      const __m128i q1 = _mm_or_si128(hh ? hi4(x1) : lo4(x1), hbits(h1, ib));
      emit16(out + 32 * ib, lookup32(T + 2 * bit(extra, s), q0), dl[s]);
      emit16(out + 32 * ib + 16, lookup32(T + 2 * bit(extra, s + 1), q1), dl[s + 1]);
    }
  }
#else
  for (int ib = 0; ib < 8; ++ib)
    for (int t = 0; t < 32; ++t) {
      const int s = 2 * ib + t / 16;
      const int q = ((qs[32 * (ib / 2) + t] >> (4 * (ib % 2))) & 0xF) | (bit(qh[t], ib) << 4);
      out[32 * ib + t] = dl[s] * static_cast<float>(kIQ5NL[q + 32 * bit(extra, s)]);
    }
#endif
}

// block_iq6_k (212 B): half d; u16 extra; int8 scales[16]; qs[128]; qh[64]. 32-block ib (64-block
// g = ib/2, nibble h = ib%2): low 4 bits nibble h of qs[32*g + t], high 2 bits field (2*(g%2) + h) of
// qh[32*(g/2) + t]; 16-sub-block s: scale d*scales[s], extra bit s: value + 1.
void block_iq6_k(const uint8_t* b, float* out) {
  const float d = f16(b);
  const unsigned extra = ikj::load_u16(b + 2);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 4);
  const uint8_t* qs = b + 20;
  const uint8_t* qh = b + 148;
  float dl[16];
  for (int s = 0; s < 16; ++s) dl[s] = d * static_cast<float>(sc[s]);
#if IKJ_KQ_SIMD
  const __m128i* T = reinterpret_cast<const __m128i*>(kIQ6NL);
  const __m128i m30 = _mm_set1_epi8(0x30), one = _mm_set1_epi8(1);
  for (int g = 0; g < 4; ++g) {
    const __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    const __m128i y0 = load16(qh + 32 * (g / 2)), y1 = load16(qh + 32 * (g / 2) + 16);
    for (int hh = 0; hh < 2; ++hh) {
      const int ib = 2 * g + hh, s = 2 * ib;
      const int f = 2 * (g % 2) + hh;  // qh field, moved to bits 4-5
      __m128i hb0 = f <= 2 ? _mm_slli_epi16(y0, 4 - 2 * f) : _mm_srli_epi16(y0, 2 * f - 4);
      __m128i hb1 = f <= 2 ? _mm_slli_epi16(y1, 4 - 2 * f) : _mm_srli_epi16(y1, 2 * f - 4);
      __m128i q[2] = {_mm_or_si128(hh ? hi4(x0) : lo4(x0), _mm_and_si128(hb0, m30)),
                      _mm_or_si128(hh ? hi4(x1) : lo4(x1), _mm_and_si128(hb1, m30))};
      for (int p = 0; p < 2; ++p) {
        const __m128i sel4 = _mm_slli_epi16(q[p], 3), sel5 = _mm_slli_epi16(q[p], 2);
        const __m128i v01 = _mm_blendv_epi8(_mm_shuffle_epi8(T[0], q[p]), _mm_shuffle_epi8(T[1], q[p]), sel4);
        const __m128i v23 = _mm_blendv_epi8(_mm_shuffle_epi8(T[2], q[p]), _mm_shuffle_epi8(T[3], q[p]), sel4);
        __m128i v = _mm_blendv_epi8(v01, v23, sel5);
        if (bit(extra, s + p)) v = _mm_add_epi8(v, one);
        emit16(out + 32 * ib + 16 * p, v, dl[s + p]);
      }
    }
  }
#else
  for (int ib = 0; ib < 8; ++ib) {
    const int g = ib / 2, hh = ib % 2;
    for (int t = 0; t < 32; ++t) {
      const int s = 2 * ib + t / 16;
      const int q = ((qs[32 * g + t] >> (4 * hh)) & 0xF) | (((qh[32 * (g / 2) + t] >> (2 * (2 * (g % 2) + hh))) & 3) << 4);
      out[32 * ib + t] = dl[s] * static_cast<float>(kIQ6NL[q] + bit(extra, s));
    }
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// ik's other per-row-scaled types and Q6_0 (IQ4_KSS: scalar decode to int8, vectorized float stage).

// block_iq2_ks (70 B; row prefix: half d): u16 extra; scales[4]; qs[64]. 32-block s: scale (nibble s%2
// of scales[s/2] | extra bit 8+s << 4) - 16; extra bit s: shifted table; field s%4 of qs[32*(s/4) + t].
void block_iq2_ks(const uint8_t* b, float d, float* out) {
  const unsigned extra = ikj::load_u16(b);
  const uint8_t* sc = b + 2;
  const uint8_t* qs = b + 6;
  float dl[8];
  for (int s = 0; s < 8; ++s)
    dl[s] = d * static_cast<float>((((sc[s / 2] >> (4 * (s % 2))) & 0xF) | (bit(extra, 8 + s) << 4)) - 16);
#if IKJ_KQ_SIMD
  const __m128i tab[2] = {load16(reinterpret_cast<const uint8_t*>(kIQ2NL[0])),
                          load16(reinterpret_cast<const uint8_t*>(kIQ2NL[1]))};
  const __m128i m3 = _mm_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    __m128i x0 = load16(qs + 32 * h), x1 = load16(qs + 32 * h + 16);
    for (int j = 0; j < 4; ++j) {
      const int s = 4 * h + j;
      const __m128i& tb = tab[bit(extra, s)];
      emit16(out + 32 * s, _mm_shuffle_epi8(tb, _mm_and_si128(x0, m3)), dl[s]);
      emit16(out + 32 * s + 16, _mm_shuffle_epi8(tb, _mm_and_si128(x1, m3)), dl[s]);
      x0 = _mm_srli_epi16(x0, 2);
      x1 = _mm_srli_epi16(x1, 2);
    }
  }
#else
  for (int s = 0; s < 8; ++s) {
    const int8_t* tb = kIQ2NL[bit(extra, s)];
    for (int t = 0; t < 32; ++t)
      out[32 * s + t] = dl[s] * static_cast<float>(tb[(qs[32 * (s / 4) + t] >> (2 * (s % 4))) & 3]);
  }
#endif
}

// block_iq3_ks (102 B; row prefix: half d): u16 extra; scales[4]; qs[64]; qh[32]. 32-block s: scale
// (nibble s/4 of scales[s%4] | extra bit s << 4) - 16; extra bit 8+s: shifted table; 2 bits field s%4 of
// qs[32*(s/4) + t], third bit bit s of qh[t].
void block_iq3_ks(const uint8_t* b, float d, float* out) {
  const unsigned extra = ikj::load_u16(b);
  const uint8_t* sc = b + 2;
  const uint8_t* qs = b + 6;
  const uint8_t* qh = b + 70;
  float dl[8];
  for (int s = 0; s < 8; ++s)
    dl[s] = d * static_cast<float>((((sc[s % 4] >> (4 * (s / 4))) & 0xF) | (bit(extra, s) << 4)) - 16);
#if IKJ_KQ_SIMD
  const __m128i tab[2] = {load16(reinterpret_cast<const uint8_t*>(kIQ3NL[0])),
                          load16(reinterpret_cast<const uint8_t*>(kIQ3NL[1]))};
  const __m128i m3 = _mm_set1_epi8(3), m4b = _mm_set1_epi8(4);
  const __m128i h0 = load16(qh), h1 = load16(qh + 16);
  for (int g = 0; g < 2; ++g) {
    __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    for (int j = 0; j < 4; ++j) {
      const int s = 4 * g + j;
      const __m128i hb0 = s >= 2 ? _mm_srli_epi16(h0, s - 2) : _mm_slli_epi16(h0, 2 - s);
      const __m128i hb1 = s >= 2 ? _mm_srli_epi16(h1, s - 2) : _mm_slli_epi16(h1, 2 - s);
      const __m128i& tb = tab[bit(extra, 8 + s)];
      emit16(out + 32 * s, _mm_shuffle_epi8(tb, _mm_or_si128(_mm_and_si128(x0, m3), _mm_and_si128(hb0, m4b))), dl[s]);
      emit16(out + 32 * s + 16, _mm_shuffle_epi8(tb, _mm_or_si128(_mm_and_si128(x1, m3), _mm_and_si128(hb1, m4b))),
             dl[s]);
      x0 = _mm_srli_epi16(x0, 2);
      x1 = _mm_srli_epi16(x1, 2);
    }
  }
#else
  for (int s = 0; s < 8; ++s) {
    const int8_t* tb = kIQ3NL[bit(extra, 8 + s)];
    for (int t = 0; t < 32; ++t)
      out[32 * s + t] =
          dl[s] * static_cast<float>(tb[((qs[32 * (s / 4) + t] >> (2 * (s % 4))) & 3) | (bit(qh[t], s) << 2)]);
  }
#endif
}

// block_iq5_ks (168 B; row prefix: float d): scales[8]; qs[128]; qh[32]. 32-block s: scale
// (sc & 254) - 127, sc & 1: shifted table (+32); nibble s%2 of qs[32*(s/2) + t] | bit s of qh[t] << 4.
void block_iq5_ks(const uint8_t* b, float d, float* out) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 8;
  const uint8_t* qh = b + 136;
#if IKJ_KQ_SIMD
  const __m128i* T = reinterpret_cast<const __m128i*>(kIQ5NL);
  const __m128i m16 = _mm_set1_epi8(0x10);
  const __m128i h0 = load16(qh), h1 = load16(qh + 16);
  auto hbits = [&](__m128i hv, int j) {
    return _mm_and_si128(j <= 4 ? _mm_slli_epi16(hv, 4 - j) : _mm_srli_epi16(hv, j - 4), m16);
  };
  for (int g = 0; g < 4; ++g) {
    const __m128i x0 = load16(qs + 32 * g), x1 = load16(qs + 32 * g + 16);
    for (int hh = 0; hh < 2; ++hh) {
      const int s = 2 * g + hh;
      const float dl = d * static_cast<float>((sc[s] & 254) - 127);
      const __m128i* tb = T + 2 * (sc[s] & 1);
      emit16(out + 32 * s, lookup32(tb, _mm_or_si128(hh ? hi4(x0) : lo4(x0), hbits(h0, s))), dl);
      emit16(out + 32 * s + 16, lookup32(tb, _mm_or_si128(hh ? hi4(x1) : lo4(x1), hbits(h1, s))), dl);
    }
  }
#else
  for (int s = 0; s < 8; ++s) {
    const float dl = d * static_cast<float>((sc[s] & 254) - 127);
    const int8_t* tb = kIQ5NL + 32 * (sc[s] & 1);
    for (int t = 0; t < 32; ++t)
      out[32 * s + t] =
          dl * static_cast<float>(tb[((qs[32 * (s / 2) + t] >> (4 * (s % 2))) & 0xF) | (bit(qh[t], s) << 4)]);
  }
#endif
}

// block_iq4_kss (128 B; row prefix: float d): u16 q[64], 8 per 32-block. Bit 0 of q[k] is bit k of the
// block's scale byte ls (dl = d*((ls & 254) - 127), ls & 1: shifted table); v = (q & ~1) ^ ((q & ~1) >> 1)
// holds, as little-endian bytes j, weight j (low nibble) and j+16 (high nibble).
void block_iq4_kss(const uint8_t* b, float d, float* out) {
  alignas(16) int8_t q[QK];
  float dl[16];
  for (int s = 0; s < 8; ++s) {
    uint8_t v8[16];
    int ls = 0;
    for (int k = 0; k < 8; ++k) {
      unsigned v = ikj::load_u16(b + 16 * s + 2 * k);
      ls |= (v & 1) << k;
      v &= 0xFFFEu;
      v ^= v >> 1;
      v8[2 * k] = static_cast<uint8_t>(v & 0xFF);
      v8[2 * k + 1] = static_cast<uint8_t>(v >> 8);
    }
    dl[2 * s] = dl[2 * s + 1] = d * static_cast<float>((ls & 254) - 127);
    const int8_t* tb = kIQ4K + 16 * (ls & 1);
    for (int j = 0; j < 16; ++j) {
      q[32 * s + j] = tb[v8[j] & 0xF];
      q[32 * s + 16 + j] = tb[v8[j] >> 4];
    }
  }
  emit_block16(out, q, dl);
}

// block_q6_0 (26 B, 32 weights): half d; qh[8]; qs[16]. h = qh[j%8] >> 4*(j/8) gives bits 4-5 of weight
// j (h & 3) and of weight j+16 (h >> 2 & 3); value (q - 32) * d.
void block_q6_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  const uint8_t* qh = b + 2;
  const uint8_t* qs = b + 10;
#if IKJ_KQ_SIMD
  const __m128i h8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh));
  const __m128i h = _mm_unpacklo_epi64(lo4(h8), hi4(h8));  // byte j: qh[j%8] >> 4*(j/8)
  const __m128i x = load16(qs), m30 = _mm_set1_epi8(0x30), m32 = _mm_set1_epi8(32);
  const __m128i q0 = _mm_or_si128(lo4(x), _mm_and_si128(_mm_slli_epi16(h, 4), m30));
  const __m128i q1 = _mm_or_si128(hi4(x), _mm_and_si128(_mm_slli_epi16(h, 2), m30));
  emit16(out, _mm_sub_epi8(q0, m32), d);
  emit16(out + 16, _mm_sub_epi8(q1, m32), d);
#else
  for (int j = 0; j < 16; ++j) {
    const int h = (qh[j % 8] >> (4 * (j / 8))) & 0xF;
    out[j] = d * static_cast<float>(((qs[j] & 0xF) | ((h & 3) << 4)) - 32);
    out[j + 16] = d * static_cast<float>(((qs[j] >> 4) | ((h >> 2) << 4)) - 32);
  }
#endif
}

// Blocks of a row in order. Each block's cache lines 1 KiB ahead are prefetched: the hardware
// prefetcher alone leaves a DRAM-bound row 15-35 % slower (bench on a 16-core Xeon, 1 thread: Q4_K
// 9.7 -> 11.3, IQ4_XS 11.5 -> 14.5 G weights/s); past the row's end it reaches the next row, which
// the matmul reads next.
template <class F>
inline void for_blocks(const uint8_t* row, int64_t K, int64_t block_elems, int64_t block_bytes, F&& f) {
  const int64_t nb = K / block_elems;
  for (int64_t i = 0; i < nb; ++i) {
#if IKJ_KQ_SIMD
    const char* p = reinterpret_cast<const char*>(row + i * block_bytes) + 1024;
    for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
#endif
    f(row + i * block_bytes, i * block_elems);
  }
}

bool handles(int type) {
  switch (type) {
    case ikj::T_Q2_K: case ikj::T_Q3_K: case ikj::T_Q4_K: case ikj::T_Q5_K: case ikj::T_Q6_K:
    case ikj::T_IQ4_XS: case T_IQ2_K: case T_IQ3_K: case T_IQ4_K: case T_IQ5_K: case T_IQ6_K:
    case T_Q6_0: case T_IQ4_KS: case T_IQ5_KS: case T_IQ4_KSS: case T_IQ2_KS: case T_IQ3_KS:
      return true;
    default:
      return false;
  }
}

}  // namespace

bool dequant_row_kquants(int type, const uint8_t* row, int64_t K, float* out) {
  // K == 0 is the support query (dequant_supported passes no row): answer without reading.
  if (K <= 0) return handles(type);
  switch (type) {
    case ikj::T_Q2_K:
      for_blocks(row, K, QK, 84, [&](const uint8_t* b, int64_t o) { block_q2_k(b, out + o); });
      return true;
    case ikj::T_Q3_K:
      for_blocks(row, K, QK, 110, [&](const uint8_t* b, int64_t o) { block_q3_k(b, out + o); });
      return true;
    case ikj::T_Q4_K:
      for_blocks(row, K, QK, 144, [&](const uint8_t* b, int64_t o) { block_q4_k(b, out + o); });
      return true;
    case ikj::T_Q5_K:
      for_blocks(row, K, QK, 176, [&](const uint8_t* b, int64_t o) { block_q5_k(b, out + o); });
      return true;
    case ikj::T_Q6_K:
      for_blocks(row, K, QK, 210, [&](const uint8_t* b, int64_t o) { block_q6_k(b, out + o); });
      return true;
    case ikj::T_IQ4_XS:
      for_blocks(row, K, QK, 136, [&](const uint8_t* b, int64_t o) { block_iq4_xs(b, out + o); });
      return true;
    case T_IQ2_K:
      for_blocks(row, K, QK, 76, [&](const uint8_t* b, int64_t o) { block_iq2_k(b, out + o); });
      return true;
    case T_IQ3_K:
      for_blocks(row, K, QK, 110, [&](const uint8_t* b, int64_t o) { block_iq3_k(b, out + o); });
      return true;
    case T_IQ4_K:
      for_blocks(row, K, QK, 144, [&](const uint8_t* b, int64_t o) { block_iq4_k(b, out + o); });
      return true;
    case T_IQ5_K:
      for_blocks(row, K, QK, 176, [&](const uint8_t* b, int64_t o) { block_iq5_k(b, out + o); });
      return true;
    case T_IQ6_K:
      for_blocks(row, K, QK, 212, [&](const uint8_t* b, int64_t o) { block_iq6_k(b, out + o); });
      return true;
    case T_Q6_0:
      for_blocks(row, K, 32, 26, [&](const uint8_t* b, int64_t o) { block_q6_0(b, out + o); });
      return true;
    // Row-scaled types: the row starts with its scale (float, or half for IQ2_KS/IQ3_KS), then blocks.
    case T_IQ4_KS: {
      const float d = f32(row);
      for_blocks(row + 4, K, QK, 136, [&](const uint8_t* b, int64_t o) { block_iq4_ks(b, d, out + o); });
      return true;
    }
    case T_IQ5_KS: {
      const float d = f32(row);
      for_blocks(row + 4, K, QK, 168, [&](const uint8_t* b, int64_t o) { block_iq5_ks(b, d, out + o); });
      return true;
    }
    case T_IQ4_KSS: {
      const float d = f32(row);
      for_blocks(row + 4, K, QK, 128, [&](const uint8_t* b, int64_t o) { block_iq4_kss(b, d, out + o); });
      return true;
    }
    case T_IQ2_KS: {
      const float d = f16(row);
      for_blocks(row + 2, K, QK, 70, [&](const uint8_t* b, int64_t o) { block_iq2_ks(b, d, out + o); });
      return true;
    }
    case T_IQ3_KS: {
      const float d = f16(row);
      for_blocks(row + 2, K, QK, 102, [&](const uint8_t* b, int64_t o) { block_iq3_ks(b, d, out + o); });
      return true;
    }
    default:
      return false;
  }
}

}  // namespace IKJ_NS
