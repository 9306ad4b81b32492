// Small helpers every CPU kernel shares: half-precision conversions and GGUF block layouts.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ikj {

inline float fp16_to_f32(uint16_t h) {
  // IEEE half -> float without F16C (the generic level); exact for every value incl. subnormals.
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// f32 -> bf16 bits, round to nearest even (XLA's convert, vcvtneps2bf16's result); NaN stays a
// (quiet) NaN. And the value rounded, kept as f32.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ggml type ids (gguf.GGMLQuantizationType and ik_llama.cpp's ggml.h)
enum TypeId : int {
  T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
  T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
  T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30,
};

#if defined(__AVX2__)
// acc + the sum over each group of 4 bytes of u (unsigned) x s (signed), per int32 lane. The avx2
// level's code is also compiled with AVX-VNNI (the avxvnni objects, picked at run time on CPUs that
// have it: cpu/isa.h), where one VEX instruction does what AVX2 does in three; both give the same
// integers, since the callers keep vpmaddubsw's i16 pair sums from saturating (|u| <= 128 against
// |s| <= 127). Its latency (~5 cycles) is the callers' to hide: a sum updated every step by it
// waits on it (micro_q8 keeps two a row).
inline __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

}  // namespace ikj
