// XLA FFI binding of the CPU quantized matmul: ikjax_cpu_quant_matmul.
//   operands: x f32 [..., K], w u8 [L, N, row_bytes] (a stack of layers' weights; [1, ..., L, N,
//             row_bytes] under vmap), layer s32 (which of them: see cpu/stack.h)
//   attributes: type (ggml type id), n_threads (0 = all cores), compute (QM_F32 / QM_BF16)
//   result:   y f32 [..., N]
#include <algorithm>
#include <atomic>
#include <string>

#include "quant_matmul/cpu_kernel.h"

#include "cpu/runtime.h"
#include "cpu/stack.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The checks both handlers share: a known compute mode and a type with a C++ path.
static ffi::Error check_mode_and_type(const char* op, int64_t compute, int64_t type) {
  if (compute != QM_F32 && compute != QM_BF16)
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown compute mode " + std::to_string(compute));
  if (!IKJ_DISPATCH(quant_matmul_supported)(static_cast<int>(type)))
    return ffi::Error::InvalidArgument(std::string(op) + ": unsupported type id " + std::to_string(type));
  return ffi::Error::Success();
}

static ffi::Error QuantMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                                  ffi::ResultBuffer<ffi::F32> y, int64_t type, int64_t n_threads, int64_t compute) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 1 || wd.size() < 3) return ffi::Error::InvalidArgument("quant_matmul: bad ranks");
  // under jax.vmap (vmap_method="expand_dims") an unbatched weight arrives as [1, ..., L, N, row_bytes]
  int64_t offset = 0;
  if (auto err = ikj::layer_offset("quant_matmul", wd, 2, layer, 1, &offset); err.failure()) return err;
  int64_t K = xd.back();
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  int64_t N = wd[wd.size() - 2], row_bytes = wd[wd.size() - 1];
  if (y->element_count() != M * N) return ffi::Error::InvalidArgument("quant_matmul: result size is not M * N");
  if (auto err = check_mode_and_type("quant_matmul", compute, type); err.failure()) return err;
  IKJ_DISPATCH(quant_matmul_ex)(x.typed_data(), w.typed_data() + offset, y->typed_data(), M, N, K, row_bytes,
                                static_cast<int>(type), static_cast<int>(n_threads), static_cast<int>(compute));
  return ffi::Error::Success();
}

// Both handlers take (x f32, w u8, layer s32) -> y f32 with the attributes type, n_threads, compute.
static auto Binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::U8>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<int64_t>("type")
      .Attr<int64_t>("n_threads")
      .Attr<int64_t>("compute");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulFfi, QuantMatmulImpl, Binding());

static ikj::FfiRegistration reg("ikjax_cpu_quant_matmul", reinterpret_cast<void*>(QuantMatmulFfi));

// ikjax_cpu_quant_matmul_heads: one product per group (attention head), y[g] = x[g] · W[g]ᵀ.
//   operands: x f32 [G, M, K], w u8 [L, G, N, row_bytes], layer s32; result y f32 [G, M, N]
// MLA's absorbed form multiplies every head's query by that head's own W_kb and W_vb slice: G small
// products in one call, threads over (head, row chunk) pairs instead of one pool dispatch per head.
static ffi::Error QuantMatmulHeadsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                                       ffi::ResultBuffer<ffi::F32> y, int64_t type, int64_t n_threads,
                                       int64_t compute) {
  auto xd = x.dimensions();
  auto wd_all = w.dimensions();
  if (xd.size() != 3 || wd_all.size() != 4 || xd[0] != wd_all[1])
    return ffi::Error::InvalidArgument("quant_matmul_heads: need x [G, M, K] and w [L, G, N, row_bytes]");
  int64_t offset = 0;
  if (auto err = ikj::layer_offset("quant_matmul_heads", wd_all, 3, layer, 1, &offset); err.failure()) return err;
  auto wd = wd_all.last(3);
  const int64_t G = xd[0], M = xd[1], K = xd[2], N = wd[1], row_bytes = wd[2];
  if (y->element_count() != G * M * N) return ffi::Error::InvalidArgument("quant_matmul_heads: bad result size");
  if (auto err = check_mode_and_type("quant_matmul_heads", compute, type); err.failure()) return err;
  auto tile = IKJ_DISPATCH(qgemm_tile_ex);
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data() + offset;
  float* yp = y->typed_data();
  // work items: chunks of the G * N output rows taken in memory order (a chunk may span heads), 4
  // per thread, from a shared counter (a descheduled thread does not hold the call back). One
  // head's matrix is small (MLA's W_kb / W_vb: ~70 KB of Q8_0), and chunks inside one head were
  // ~17 KB: each thread's reads jumped every 17 KB and the decode ran at ~19 GB/s from DRAM.
  const int nth_max = std::max(1, std::min(n_threads > 0 ? static_cast<int>(n_threads) : ikj::available_cores(),
                                           ikj::available_cores()));
  const int64_t rows = G * N;
  const int64_t chunk = std::max<int64_t>(16, (rows + 4 * nth_max - 1) / (4 * nth_max) + 15) / 16 * 16;
  std::atomic<int64_t> next{0};
  ikj::parallel(static_cast<int>(n_threads), [&](int, int) {
    for (int64_t r0; (r0 = next.fetch_add(chunk, std::memory_order_relaxed)) < rows;) {
      const int64_t r1 = std::min(rows, r0 + chunk);
      for (int64_t g = r0 / N; g * N < r1; ++g) {
        const int64_t n0 = std::max(r0, g * N) - g * N, n1 = std::min(r1, (g + 1) * N) - g * N;
        tile(xp + g * M * K, M, K, wp + g * N * row_bytes, row_bytes, static_cast<int>(type), n0, n1,
             yp + g * M * N, N, static_cast<int>(compute));
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulHeadsFfi, QuantMatmulHeadsImpl, Binding());

static ikj::FfiRegistration reg_heads("ikjax_cpu_quant_matmul_heads", reinterpret_cast<void*>(QuantMatmulHeadsFfi));
