// XLA FFI binding of RMSNorm on the CPU: ikjax_cpu_rms_norm.
//   operands: x f32 [..., d], weight f32 [d];  attributes: eps, n_threads (<= 0: every core);
//   result: f32 [..., d] = x / sqrt(mean(x^2) + eps) * weight, row by row.
//
// Why: XLA:CPU split a prompt step's norms (the sum of squares, the scale, the weight's multiply)
// into a few partitions each (`outer_dimension_partitions` 4 on a 16-core host) and they did not
// grow with threads: a V2-Lite 512-token step at -t 16 spent 15-18 ms in XLA's own ops, most of
// them the norms' pieces (RESULTS §26ag). Rows go to the C++ pool's threads whole, each row summed
// in one fixed order (8 lanes, then the lanes in order), so a row's result does not depend on the
// batch or the thread count (the server's batched rows stay bit-identical to each alone).
// Compiled once, at the baseline: a memory-bound pass.
#include <cmath>
#include <cstdint>

#include "cpu/common.h"
#include "cpu/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static void norm_row(const float* x, const float* w, int64_t d, float eps, float* y) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) s[l] += x[i + l] * x[i + l];
  float sum = 0.f;
  for (int l = 0; l < 8; ++l) sum += s[l];
  for (; i < d; ++i) sum += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t k = 0; k < d; ++k) y[k] = x[k] * r * w[k];
}

static ffi::Error RmsNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> out,
                              float eps, int64_t n_threads) {
  auto xd = x.dimensions();
  if (xd.size() < 1 || weight.dimensions().size() != 1 || weight.dimensions()[0] != xd[xd.size() - 1])
    return ffi::Error::InvalidArgument("rms_norm: weight must be [d] with x's last dimension");
  const int64_t d = xd[xd.size() - 1];
  const int64_t rows = d ? static_cast<int64_t>(x.element_count()) / d : 0;
  if (rows == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const float* w = weight.typed_data();
  float* y = out->typed_data();
  // rows a part: ~64 KiB of x, at least one row (a decode step's one row runs on the caller)
  const int64_t per = d >= 16384 ? 1 : 16384 / d;
  const int64_t parts = (rows + per - 1) / per;
  ikj::parallel(static_cast<int>(parts < 2 ? 1 : n_threads), [&](int ith, int nth) {
    int64_t p0, p1;
    ikj::split_range(parts, ith, nth, &p0, &p1);
    const int64_t r1 = p1 * per < rows ? p1 * per : rows;
    for (int64_t r = p0 * per; r < r1; ++r) norm_row(xs + r * d, w, d, eps, y + r * d);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFfi, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("n_threads"));

static ikj::FfiRegistration reg("ikjax_cpu_rms_norm", reinterpret_cast<void*>(RmsNormFfi));
