// XLA FFI binding of the query's rope: ikjax_cpu_rope_q.
//   operands:   q f32 [B, T, H, D] (the q projection: each head's nope values, then R = D - nope rope
//               values as adjacent pairs), cos, sin f32 [B, T, R/2]
//   attributes: nope, n_threads (<= 0: every core)
//   result:     out f32 or bf16 [B, T, H, D]: q[..., :nope] as it is, each pair (x0, x1) of the rope
//               part as (x0·c - x1·s, x1·c + x0·s), in f32, then rounded to nearest even (bf16)
//
// Why: XLA:CPU ran the same as a slice, a pair-stack, a concatenate and a convert, four passes over
// q at 1-5 GB/s that did not grow with threads: ~10 ms of a 164 ms amx prompt step at -t 16
// (bench/RESULTS.md §26q). One pass here, split over the pool's threads. Compiled once, at the
// baseline: two products and a sum per value, no FMA contraction, as XLA's own ops round them.
#include <cstdint>
#include <cstring>

#include "cpu/common.h"
#include "cpu/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using ikj::f32_to_bf16;  // round to nearest even; NaN stays NaN (as XLA's convert)

static ffi::Error RopeQImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                            ffi::Result<ffi::AnyBuffer> out, int64_t nope, int64_t n_threads) {
  auto qd = q.dimensions();
  auto cd = cos.dimensions();
  if (qd.size() != 4 || cd.size() != 3 || sin.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("rope_q: q must be [B, T, H, D] and cos, sin [B, T, R/2]");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], R = D - nope, half = R / 2;
  if (nope < 0 || R < 0 || R % 2 != 0 || cd[0] != B || cd[1] != T || cd[2] != half ||
      static_cast<int64_t>(sin.element_count()) != B * T * half)
    return ffi::Error::InvalidArgument("rope_q: need 0 <= nope <= D, D - nope even, cos and sin [B, T, (D - nope) / 2]");
  const auto et = out->element_type();
  if ((et != ffi::DataType::F32 && et != ffi::DataType::BF16) ||
      static_cast<int64_t>(out->element_count()) != B * T * H * D)
    return ffi::Error::InvalidArgument("rope_q: out must be f32 or bf16 of q's shape");
  const float* src = q.typed_data();
  const float* cs = cos.typed_data();
  const float* sn = sin.typed_data();
  const bool bf16 = et == ffi::DataType::BF16;
  float* o32 = bf16 ? nullptr : static_cast<float*>(out->untyped_data());
  uint16_t* o16 = bf16 ? static_cast<uint16_t*>(out->untyped_data()) : nullptr;
  const int64_t rows = B * T * H;
  ikj::parallel(static_cast<int>(n_threads), [&](int ith, int nth) {
    int64_t r0, r1;
    ikj::split_range(rows, ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = src + r * D;
      const float* c = cs + (r / H) * half;
      const float* s = sn + (r / H) * half;
      if (bf16) {
        uint16_t* y = o16 + r * D;
        for (int64_t i = 0; i < nope; ++i) y[i] = f32_to_bf16(x[i]);
        for (int64_t p = 0; p < half; ++p) {
          const float x0 = x[nope + 2 * p], x1 = x[nope + 2 * p + 1];
          y[nope + 2 * p] = f32_to_bf16(x0 * c[p] - x1 * s[p]);
          y[nope + 2 * p + 1] = f32_to_bf16(x1 * c[p] + x0 * s[p]);
        }
      } else {
        float* y = o32 + r * D;
        std::memcpy(y, x, static_cast<size_t>(nope) * sizeof(float));
        for (int64_t p = 0; p < half; ++p) {
          const float x0 = x[nope + 2 * p], x1 = x[nope + 2 * p + 1];
          y[nope + 2 * p] = x0 * c[p] - x1 * s[p];
          y[nope + 2 * p + 1] = x1 * c[p] + x0 * s[p];
        }
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeQFfi, RopeQImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("nope")
                                  .Attr<int64_t>("n_threads"));

static ikj::FfiRegistration reg("ikjax_cpu_rope_q", reinterpret_cast<void*>(RopeQFfi));
