// XLA FFI binding of the float cast: ikjax_cpu_cast_bf16.
//   operand: x f32 [...];  attribute: n_threads (<= 0: every core);  result: bf16 [...] of x's shape,
//   each value rounded to nearest even (NaN stays NaN), as XLA's convert.
//
// Why: XLA:CPU's converts ran at a few GB/s and did not grow with threads on a 16-core host
// (bench/RESULTS.md §26q); the -mla prompt's K and V (the kv_b product, 16 MiB of f32 at V2-Lite's
// N_KV 512) are cast to bf16 before the attention reads them, and that convert stood beside the
// kernels it was meant to speed up. Compiled once, at the baseline: a memory-bound pass.
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu/common.h"
#include "cpu/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error CastBf16Impl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::BF16> out, int64_t n_threads) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (static_cast<int64_t>(out->element_count()) != n)
    return ffi::Error::InvalidArgument("cast_bf16: out must have x's shape");
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x.typed_data());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out->typed_data());
  constexpr int64_t kChunk = 1 << 14;  // values a part: whole cache lines, enough to pay a hand-off
  const int64_t parts = (n + kChunk - 1) / kChunk;
  ikj::parallel(static_cast<int>(n_threads),
                [&](int ith, int nth) {
                  int64_t p0, p1;
                  ikj::split_range(parts, ith, nth, &p0, &p1);
                  const int64_t e = p1 * kChunk < n ? p1 * kChunk : n;
                  int64_t i = p0 * kChunk;
#if defined(__SSE2__)
                  // 8 values a step: the rounding on 4 lanes of int32, the upper halves packed
                  // with a signed pack after an arithmetic shift (exact: no value saturates)
                  const __m128i one = _mm_set1_epi32(1), bias = _mm_set1_epi32(0x7fff);
                  const __m128i absm = _mm_set1_epi32(0x7fffffff), inf = _mm_set1_epi32(0x7f800000);
                  const __m128i quiet = _mm_set1_epi32(0x400000);
                  auto round4 = [&](__m128i u) {
                    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), one);
                    const __m128i r = _mm_add_epi32(_mm_add_epi32(u, bias), lsb);
                    const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, absm), inf);
                    const __m128i v = _mm_or_si128(_mm_and_si128(nan, _mm_or_si128(u, quiet)), _mm_andnot_si128(nan, r));
                    return _mm_srai_epi32(v, 16);
                  };
                  for (; i + 8 <= e; i += 8) {
                    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 4));
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi32(round4(a), round4(b)));
                  }
#endif
                  for (; i < e; ++i) dst[i] = ikj::f32_to_bf16(x.typed_data()[i]);
                });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastBf16Ffi, CastBf16Impl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::BF16>>().Attr<int64_t>("n_threads"));

static ikj::FfiRegistration reg("ikjax_cpu_cast_bf16", reinterpret_cast<void*>(CastBf16Ffi));
