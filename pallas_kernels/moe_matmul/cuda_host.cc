// Routed experts in host RAM, computed by the host CPU from inside a GPU step: the XLA FFI target
// "ikjax_host_moe_experts", registered for platform "CUDA" (ktransformers' pattern; DESIGN.md
// "Host-resident experts on an accelerator" measured it at ~63 us a round trip on an H200).
//
// On XLA's stream, in order:
//   1. cudaMemcpyAsync D2H of x [N, d], weights [N, k], ids [N, k] into pinned staging;
//   2. cudaLaunchHostFunc: the CPU fused-experts kernel (moe_matmul/cpu_kernel.cc, its own thread
//      pool, -t threads) reads the experts' GGUF bytes where the file's memory map has them and
//      writes out [N, d] into pinned staging;
//   3. cudaMemcpyAsync H2D of out.
// Only activations, expert ids and weights cross PCIe; the stream waits for the host function, so
// the GPU ops after it see the result and the staging is free again when the next layer's copy
// runs (one staging area per stream, reused by every layer in stream order).
//
// The experts are static for an engine: their host addresses come as int64 attributes (the
// Python side keeps the memory map alive as long as the compiled step). Built only with
// -DIKJAX_BUILD_CUDA=ON into the extension pallas_kernels._cuda_host (CMakeLists.txt).
//
//   operands:   x f32 [N, d], weights f32 [N, k], ids s32 [N, k] (device buffers)
//   attributes: gate_ptr, up_ptr, down_ptr (host addresses of [E, F, .], [E, F, .], [E, d, .] GGUF
//               bytes), gate/up/down_row_bytes, gate/up/down_type (ggml type ids), n_expert, n_ff,
//               n_threads (0 = all cores), compute (0 f32, 1 bf16: QmCompute)
//   result:     out f32 [N, d] (device buffer)
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu/isa.h"
#include "cpu/runtime.h"
#include "moe_matmul/cpu_kernel.h"
#include "quant_matmul/cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace {

// Pinned staging per stream. Grown (never shrunk, never freed while the process runs: a copy
// enqueued earlier may still read the old area) when a call needs more than it has.
struct Staging {
  char* base = nullptr;
  size_t bytes = 0;
};
std::mutex staging_mu;
std::unordered_map<cudaStream_t, Staging> staging_by_stream;
std::vector<char*> retired;  // superseded areas: still possibly read by queued work, kept

size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

ffi::Error staging_for(cudaStream_t s, size_t need, char** out) {
  std::lock_guard<std::mutex> lock(staging_mu);
  Staging& st = staging_by_stream[s];
  if (st.bytes < need) {
    size_t bytes = std::max(need, 2 * st.bytes);
    char* p = nullptr;
    cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&p), bytes);
    if (e != cudaSuccess)
      return ffi::Error::Internal(std::string("host moe_experts: cudaMallocHost of ") + std::to_string(bytes) +
                                  " bytes failed: " + cudaGetErrorString(e));
    if (st.base) retired.push_back(st.base);
    st.base = p;
    st.bytes = bytes;
  }
  *out = st.base;
  return ffi::Error::Success();
}

struct Job {
  MoeExpertsArgs args;
};

// Runs on CUDA's host-callback thread once the D2H copies are done; the stream waits for it.
void CUDART_CB run_job(void* p) {
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  const MoeExpertsArgs& a = job->args;
  // ids come from the router's top_k over E experts: out of range is a bug, never a user error,
  // and a host callback cannot return an error to XLA, so stop loudly instead of reading past
  // the expert tensors.
  for (int64_t i = 0; i < a.N * a.k; ++i)
    if (a.ids[i] < 0 || a.ids[i] >= a.E) {
      std::fprintf(stderr, "ikjax host moe_experts: expert id %d outside [0, %lld)\n", a.ids[i],
                   static_cast<long long>(a.E));
      std::abort();
    }
  IKJ_DISPATCH(moe_experts)(a);
}

ffi::Error HostMoeImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> out, int64_t gate_ptr,
                       int64_t up_ptr, int64_t down_ptr, int64_t gate_row_bytes, int64_t up_row_bytes,
                       int64_t down_row_bytes, int64_t gate_type, int64_t up_type, int64_t down_type,
                       int64_t n_expert, int64_t n_ff, int64_t n_threads, int64_t compute) {
  auto xd = x.dimensions(), wd = weights.dimensions(), idd = ids.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || idd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("host moe_experts: expected x [N, d], weights/ids [N, k], out [N, d]");
  const int64_t N = xd[0], d = xd[1], k = idd[1];
  if (wd[0] != N || wd[1] != k || idd[0] != N || od[0] != N || od[1] != d)
    return ffi::Error::InvalidArgument("host moe_experts: weights and ids must be [N, k], out [N, d], N = x rows");
  if (!gate_ptr || !up_ptr || !down_ptr || n_expert < 1 || n_ff < 1)
    return ffi::Error::InvalidArgument("host moe_experts: expert addresses and sizes must be set");
  for (int64_t t : {gate_type, up_type, down_type})
    if (!IKJ_DISPATCH(quant_matmul_supported)(static_cast<int>(t)))
      return ffi::Error::InvalidArgument("host moe_experts: unsupported type id " + std::to_string(t));
  if (compute != QM_F32 && compute != QM_BF16)
    return ffi::Error::InvalidArgument("host moe_experts: compute must be 0 (f32) or 1 (bf16)");
  if (N == 0) return ffi::Error::Success();

  const size_t xb = N * d * sizeof(float), wb = N * k * sizeof(float), ib = N * k * sizeof(int32_t);
  const size_t off_w = align64(xb), off_i = off_w + align64(wb), off_o = off_i + align64(ib);
  char* st = nullptr;
  if (ffi::Error e = staging_for(stream, off_o + align64(xb), &st); e.failure()) return e;
  float* hx = reinterpret_cast<float*>(st);
  float* hw = reinterpret_cast<float*>(st + off_w);
  int32_t* hi = reinterpret_cast<int32_t*>(st + off_i);
  float* ho = reinterpret_cast<float*>(st + off_o);

  auto job = std::make_unique<Job>();
  job->args = MoeExpertsArgs{hx, hw, hi, N, k, d, n_ff, n_expert,
                             reinterpret_cast<const uint8_t*>(gate_ptr), gate_row_bytes, static_cast<int>(gate_type),
                             reinterpret_cast<const uint8_t*>(up_ptr), up_row_bytes, static_cast<int>(up_type),
                             reinterpret_cast<const uint8_t*>(down_ptr), down_row_bytes, static_cast<int>(down_type),
                             ho, static_cast<int>(n_threads), static_cast<int>(compute)};
  cudaError_t e;
  if ((e = cudaMemcpyAsync(hx, x.typed_data(), xb, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaMemcpyAsync(hw, weights.typed_data(), wb, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaMemcpyAsync(hi, ids.typed_data(), ib, cudaMemcpyDeviceToHost, stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("host moe_experts: D2H copy: ") + cudaGetErrorString(e));
  if ((e = cudaLaunchHostFunc(stream, run_job, job.get())) != cudaSuccess)
    return ffi::Error::Internal(std::string("host moe_experts: cudaLaunchHostFunc: ") + cudaGetErrorString(e));
  job.release();  // owned by run_job from here
  if ((e = cudaMemcpyAsync(out->typed_data(), ho, xb, cudaMemcpyHostToDevice, stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("host moe_experts: H2D copy: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostMoeExpertsFfi, HostMoeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("gate_ptr")
                                  .Attr<int64_t>("up_ptr")
                                  .Attr<int64_t>("down_ptr")
                                  .Attr<int64_t>("gate_row_bytes")
                                  .Attr<int64_t>("up_row_bytes")
                                  .Attr<int64_t>("down_row_bytes")
                                  .Attr<int64_t>("gate_type")
                                  .Attr<int64_t>("up_type")
                                  .Attr<int64_t>("down_type")
                                  .Attr<int64_t>("n_expert")
                                  .Attr<int64_t>("n_ff")
                                  .Attr<int64_t>("n_threads")
                                  .Attr<int64_t>("compute"));

NB_MODULE(_cuda_host, m) {
  m.doc() = "ikjax: routed experts in host RAM computed by the CPU from a GPU step (XLA FFI, platform CUDA)";
  m.def("registrations", [] {
    nb::dict d;
    d["ikjax_host_moe_experts"] = nb::capsule(reinterpret_cast<void*>(HostMoeExpertsFfi));
    return d;
  });
  m.def("isa", [] { return std::string(ikj::isa_name(ikj::current_isa())); });
  m.def("quant_type_supported", [](int type) { return IKJ_DISPATCH(quant_matmul_supported)(type); });
}
