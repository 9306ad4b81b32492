// Vector math the CPU kernels share (compiled at each ISA level: `static`, so every level's
// translation unit keeps its own copy).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The float-vector operations ikj_exp is written with beyond + and * (GCC / Clang vector arithmetic
// on __m256 / __m512), one specialization per vector type.
template <class V>
struct IkjF;

#if defined(__AVX512F__)
template <>
struct IkjF<__m512> {
  using V = __m512;
  // 2^n by scalef, which takes n = 128: v saturates at ln(FLT_MAX)
  static constexpr float hi = 88.3762626647949f;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale2n(V p, V n) { return _mm512_scalef_ps(p, n); }
  // r where x >= lo or x is NaN, else 0
  static V zero_below(V r, V x, V lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), r); }
};
#endif

template <>
struct IkjF<__m256> {
  using V = __m256;
  // 2^n built in the exponent field, so n <= 127: v saturates at 88.0 (e^88 = 1.65e38)
  static constexpr float hi = 88.0f;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale2n(V p, V n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return p * _mm256_castsi256_ps(e);
  }
  static V zero_below(V r, V x, V lo) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), r); }
};

// e^x per lane, Cephes' expf: x = n ln2 + r, e^r by a degree-7 polynomial, scaled by 2^n; relative
// error ~1e-7. Edges: e^x = 0 for x < -87.34 (e^-inf = 0: masked attention keys), NaN stays NaN,
// and e^x saturates at e^hi above hi (IkjF<V>::hi; e^+inf is that finite maximum).
template <class V>
static inline V ikj_exp(V x) {
  using F = IkjF<V>;
  const V lo = F::set1(-87.3365447504f);
  // the constant first: min / max return their second operand when either is NaN, so NaN goes through
  const V v = F::max(lo, F::min(F::set1(F::hi), x));
  const V n = F::round(v * F::set1(1.44269504088896341f));
  V r = F::fmadd(n, F::set1(-0.693359375f), v);  // = fnmadd(n, ln2_hi, v): negation is exact
  r = F::fmadd(n, F::set1(2.12194440e-4f), r);
  V p = F::set1(1.9875691500e-4f);
  p = F::fmadd(p, r, F::set1(1.3981999507e-3f));
  p = F::fmadd(p, r, F::set1(8.3334519073e-3f));
  p = F::fmadd(p, r, F::set1(4.1665795894e-2f));
  p = F::fmadd(p, r, F::set1(1.6666665459e-1f));
  p = F::fmadd(p, r, F::set1(5.0000001201e-1f));
  p = F::fmadd(p, r * r, r + F::set1(1.f));
  return F::zero_below(F::scale2n(p, n), x, lo);
}
#endif
