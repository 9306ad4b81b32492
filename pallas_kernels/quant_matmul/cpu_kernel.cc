// Quantized matmul on the CPU, y[m, n] = sum_k x[m, k] * W[n, k], W read as stored GGUF blocks.
// Compiled once per instruction-set level (namespace IKJ_NS); see pallas_kernels/CMakeLists.txt.
#include "quant_matmul/cpu_kernel.h"
#include "quant_matmul/cpu_dequant.h"

#include "cpu/common.h"
#include "cpu/runtime.h"

#include <vector>

namespace IKJ_NS {

// Dequantize one row of K values of a supported type into out (float).
bool dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  using namespace ikj;
  switch (type) {
    case T_F32:
      std::memcpy(out, row, K * 4);
      return true;
    case T_Q8_0:
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * 34;
        float d = fp16_to_f32(load_u16(blk));
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < 32; ++i) out[b * 32 + i] = d * q[i];
      }
      return true;
    default:
      return dequant_row_kquants(type, row, K, out);
  }
}

bool dequant_supported(int type) {
  return type == ikj::T_F32 || type == ikj::T_Q8_0 || dequant_row_kquants(type, nullptr, 0, nullptr);
}

bool quant_matmul_supported(int type) { return type == ikj::T_F32 || type == ikj::T_Q8_0; }

void qgemm_tile(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                int64_t n0, int64_t n1, float* y, int64_t ldy) {
  thread_local std::vector<float> tmp;
  if (static_cast<int64_t>(tmp.size()) < K) tmp.resize(K);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(type, w + n * row_bytes, K, tmp.data());
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * tmp[k];
      y[m * ldy + n] = acc;
    }
  }
}

void quant_matmul(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t row_bytes, int type, int n_threads) {
  ikj::parallel(n_threads, [&](int ith, int nth) {
    int64_t n0, n1;
    ikj::split_range(N, ith, nth, &n0, &n1);
    qgemm_tile(x, M, K, w, row_bytes, type, n0, n1, y, N);
  });
}

}  // namespace IKJ_NS
