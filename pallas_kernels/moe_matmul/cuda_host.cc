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
// The experts are static for an engine: the step names their bytes by a slot number (an int64
// attribute; a scanned group of layers names one slot per layer, and the call's layer index, a
// device value, picks one), which this process maps to a host address and size (`set_host_slot`, called by the
// Python side when it builds the call; the bytes live as long as the engine's weight tree). Why
// not the address itself: an address differs from process to process, so a step carrying one had
// another HLO in every run and JAX's persistent cache never served it (a 65-73 s recompile of R1's
// -sm graph -ot steps each run, RESULTS §25h); a slot is derived from the tensor's name and shape.
// Built only with -DIKJAX_BUILD_CUDA=ON into the extension pallas_kernels._cuda_host (CMakeLists.txt).
//
//   operands:   x f32 [N, d], weights f32 [N, k], ids s32 [N * k + 1] (device buffers: the expert ids,
//               then the index of the layer in the slot tables, which the host reads with the ids)
//   attributes: gate_slots, up_slots, down_slots (per layer of the call's group, the slots of the
//               [E, F, .], [E, F, .], [E, d, .] GGUF bytes), gate/up/down_row_bytes, gate/up/down_type (ggml type ids), n_expert, n_ff,
//               n_threads (0 = all cores), compute (0 f32, 1 bf16: QmCompute)
//   result:     out f32 [N, d] (device buffer)
#include <cuda.h>  // the stream memory operations' types and flags (their entry points come from cudart)
#include <cuda_runtime.h>
#include <immintrin.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <memory>
#include <new>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
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

// Slots: the host byte ranges steps name by number (see the top). Set from Python before a step
// that names them is traced; a slot no one set is an error of the call, never a guess.
struct HostBytes {
  const char* base = nullptr;
  size_t size = 0;
};
std::mutex slots_mu;
std::unordered_map<int64_t, HostBytes> host_slots;

ffi::Error slot_bytes(const char* what, int64_t slot, size_t need, const char** out) {
  HostBytes b;
  {
    std::lock_guard<std::mutex> lock(slots_mu);
    auto it = host_slots.find(slot);
    if (it != host_slots.end()) b = it->second;
  }
  if (!b.base)
    return ffi::Error::InvalidArgument(std::string(what) + ": host bytes slot " + std::to_string(slot) +
                                       " is not set in this process (a step run without the tracing that sets it)");
  if (b.size < need)
    return ffi::Error::InvalidArgument(std::string(what) + ": host bytes slot " + std::to_string(slot) + " holds " +
                                       std::to_string(b.size) + " bytes, the call reads " + std::to_string(need));
  *out = b.base;
  return ffi::Error::Success();
}

// The host bytes of every layer a call may read, for gate, up and down: each tensor's slot table
// (one slot, or one per layer of a scanned group, whose step passes the layer's index as a device
// value), each entry checked to hold `need[t]` bytes, the three tables of one length.
struct ExpertTables {
  std::vector<const char*> t[3];

  ffi::Error resolve(const char* what, const ffi::Span<const int64_t> (&slots)[3], const size_t (&need)[3]) {
    for (int k = 0; k < 3; ++k) {
      if (slots[k].size() < 1) return ffi::Error::InvalidArgument(std::string(what) + ": an empty slot table");
      t[k].assign(slots[k].size(), nullptr);
      for (size_t l = 0; l < slots[k].size(); ++l)
        if (ffi::Error e = slot_bytes(what, slots[k][l], need[k], &t[k][l]); e.failure()) return e;
    }
    if (t[1].size() != t[0].size() || t[2].size() != t[0].size())
      return ffi::Error::InvalidArgument(std::string(what) + ": gate, up and down slot tables differ in length");
    return ffi::Error::Success();
  }

  size_t layers() const { return t[0].size(); }

  // Layer `layer`'s gate, up and down bytes; false for an index outside the tables.
  bool pick(int32_t layer, const char* (&out)[3]) const {
    if (layer < 0 || static_cast<size_t>(layer) >= layers()) return false;
    for (int k = 0; k < 3; ++k) out[k] = t[k][layer];
    return true;
  }

  ffi::Error pick_or_error(const char* what, int32_t layer, const char* (&out)[3]) const {
    return pick(layer, out) ? ffi::Error::Success()
                            : ffi::Error::Internal(std::string(what) + ": layer index " + std::to_string(layer) +
                                                   " outside its table of " + std::to_string(layers()));
  }
};

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
  ExpertTables tables;  // the call's layers' bytes, one picked once the index is on the host
};

// Time spent inside the host kernel, for sweep-bench's report (`host_stats`): decode-sized calls
// (N <= kSmallCall rows) apart from prompt-sized ones, with the bytes of the experts they read,
// so a TG row's time splits into the host kernel's part (and its GB/s) and everything else.
constexpr int64_t kSmallCall = 16;
struct HostStats {
  int64_t calls = 0, ns = 0, bytes = 0, small_calls = 0, small_ns = 0, small_bytes = 0;
};
std::mutex host_stats_mu;
HostStats host_stats;

// Runs once the D2H copies are done, on CUDA's host-callback thread (hostfunc) or the stream's
// worker (flag); the stream waits for it either way.
void CUDART_CB run_job(void* p) {
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  const MoeExpertsArgs& a = job->args;
  // ids come from the router's top_k over E experts: out of range is a bug, never a user error,
  // and a host callback cannot return an error to XLA, so stop loudly instead of reading past
  // the expert tensors. The same pass counts the experts the call reads (a non-zero weight) for
  // host_stats' bytes.
  const int32_t layer = a.ids[a.N * a.k];  // copied with the ids (HostMoeImpl)
  const char* layer_bytes[3];
  if (!job->tables.pick(layer, layer_bytes)) {
    std::fprintf(stderr, "ikjax host moe_experts: layer index %d outside its table of %zu\n", layer,
                 job->tables.layers());
    std::abort();
  }
  MoeExpertsArgs& am = job->args;
  am.gate = reinterpret_cast<const uint8_t*>(layer_bytes[0]);
  am.up = reinterpret_cast<const uint8_t*>(layer_bytes[1]);
  am.down = reinterpret_cast<const uint8_t*>(layer_bytes[2]);
  thread_local std::vector<char> seen;
  seen.assign(a.E, 0);
  int64_t used = 0;
  for (int64_t i = 0; i < a.N * a.k; ++i) {
    if (a.ids[i] < 0 || a.ids[i] >= a.E) {
      std::fprintf(stderr, "ikjax host moe_experts: expert id %d outside [0, %lld)\n", a.ids[i],
                   static_cast<long long>(a.E));
      std::abort();
    }
    if (a.weights[i] != 0.f && !seen[a.ids[i]]) {
      seen[a.ids[i]] = 1;
      ++used;
    }
  }
  const int64_t bytes = used * (a.F * a.gate_row_bytes + a.F * a.up_row_bytes + a.d * a.down_row_bytes);
  const auto t0 = std::chrono::steady_clock::now();
  IKJ_DISPATCH(moe_experts)(a);
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  if (bytes == 0) return;  // -sm graph: the other devices' calls of a decode step (every weight 0)
  std::lock_guard<std::mutex> lock(host_stats_mu);
  HostStats& h = host_stats;
  ++h.calls;
  h.ns += ns;
  h.bytes += bytes;
  if (a.N <= kSmallCall) {
    ++h.small_calls;
    h.small_ns += ns;
    h.small_bytes += bytes;
  }
}

// ---- How the stream hands the host a call and gets it back --------------------------------------
//
// "hostfunc" (IKJAX_HOST_CALL=hostfunc): cudaLaunchHostFunc; CUDA's callback thread runs the
// kernel while the stream waits for it to return. Each hand-over goes through the driver's
// callback machinery on both sides.
// "flag" (the default where the driver has the stream memory operations): the stream writes a
// sequence number into pinned host memory once the inputs are copied (cuStreamWriteValue32) and
// waits for the host to write it back (cuStreamWaitValue32); a worker thread per stream, handed
// the call when XLA enqueued it (the host runs ahead of the GPU), spins on the first number, runs
// the kernel and writes the second. Why: at one token a step the hand-over is what separates the
// host kernel from the GPU's next layer, 13 times a token on R1-16 (RESULTS §25k measured ~200 us
// of GPU idle a call beyond the kernel's own time with the callback).
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
struct StreamOps {
  StreamValueFn write = nullptr, wait = nullptr;
  bool ok = false;
};

const StreamOps& stream_ops() {
  static const StreamOps ops = [] {
    StreamOps o;
    void *w = nullptr, *v = nullptr;
    cudaDriverEntryPointQueryResult qw{}, qv{};
#if CUDART_VERSION >= 12050
    cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &w, 12000, cudaEnableDefault, &qw);
    cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &v, 12000, cudaEnableDefault, &qv);
#else
    cudaGetDriverEntryPoint("cuStreamWriteValue32", &w, cudaEnableDefault, &qw);
    cudaGetDriverEntryPoint("cuStreamWaitValue32", &v, cudaEnableDefault, &qv);
#endif
    if (w && v && qw == cudaDriverEntryPointSuccess && qv == cudaDriverEntryPointSuccess) {
      o.write = reinterpret_cast<StreamValueFn>(w);
      o.wait = reinterpret_cast<StreamValueFn>(v);
      o.ok = true;
    }
    return o;
  }();
  return ops;
}

// IKJAX_HOST_CALL, read once: true for "flag" (the default), false for "hostfunc".
bool flag_mode() {
  static const bool flag = [] {
    const char* e = std::getenv("IKJAX_HOST_CALL");
    return !(e && std::strcmp(e, "hostfunc") == 0);
  }();
  return flag;
}

void CUDART_CB run_job(void* p);

struct Lane {
  std::atomic<uint32_t>* go = nullptr;    // written by the stream: the last call whose inputs are on the host
  std::atomic<uint32_t>* done = nullptr;  // written by the worker: the last call whose output is on the host
  CUdeviceptr go_dev = 0, done_dev = 0;
  uint32_t seq = 0;  // the last call enqueued (under mu)
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<void*, uint32_t>> queue;  // (Job*, its number) in stream order
  std::thread worker;

  void serve() {
    for (;;) {
      std::pair<void*, uint32_t> item;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !queue.empty(); });
        item = queue.front();
        queue.pop_front();
      }
      // the GPU reaches the call a layer's work after XLA enqueued it: spin (one core, while the
      // kernel's pool sleeps), and nap once the wait is long (a prompt step's GPU work)
      const auto t0 = std::chrono::steady_clock::now();
      for (uint32_t spins = 0; static_cast<int32_t>(go->load(std::memory_order_acquire) - item.second) < 0; ++spins) {
        _mm_pause();
        if ((spins & 1023) == 1023 && std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(2))
          std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      run_job(item.first);
      done->store(item.second, std::memory_order_release);
    }
  }
};
std::mutex lanes_mu;
std::unordered_map<cudaStream_t, Lane*> lanes;  // never freed: queued stream work may still name them

ffi::Error lane_for(cudaStream_t s, Lane** out) {
  std::lock_guard<std::mutex> lock(lanes_mu);
  Lane*& lane = lanes[s];
  if (!lane) {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, 128, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess)
      return ffi::Error::Internal(std::string("host moe_experts: cudaHostAlloc of the call flags: ") +
                                  cudaGetErrorString(e));
    void* dev = nullptr;
    if ((e = cudaHostGetDevicePointer(&dev, p, 0)) != cudaSuccess)
      return ffi::Error::Internal(std::string("host moe_experts: the call flags' device address: ") +
                                  cudaGetErrorString(e));
    auto* l = new Lane();
    l->go = new (p) std::atomic<uint32_t>(0);
    l->done = new (static_cast<char*>(p) + 64) std::atomic<uint32_t>(0);
    l->go_dev = reinterpret_cast<CUdeviceptr>(dev);
    l->done_dev = reinterpret_cast<CUdeviceptr>(static_cast<char*>(dev) + 64);
    l->worker = std::thread([l] { l->serve(); });
    l->worker.detach();
    lane = l;
  }
  *out = lane;
  return ffi::Error::Success();
}

// The stream's side of a call in flag mode: hand the host the number once the inputs are copied,
// wait for it back; the worker gets the job now.
ffi::Error enqueue_flag(cudaStream_t stream, void* job) {
  Lane* lane = nullptr;
  if (ffi::Error e = lane_for(stream, &lane); e.failure()) return e;
  const StreamOps& ops = stream_ops();
  {
    // the number, the stream's operations and the worker's queue in one order, whatever thread
    // enqueues: the worker serves calls in the order their numbers reach the stream
    std::lock_guard<std::mutex> lock(lane->mu);
    const uint32_t seq = lane->seq + 1;
    CUresult r = ops.write(reinterpret_cast<CUstream>(stream), lane->go_dev, seq, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r == CUDA_SUCCESS)
      r = ops.wait(reinterpret_cast<CUstream>(stream), lane->done_dev, seq, CU_STREAM_WAIT_VALUE_EQ);
    if (r != CUDA_SUCCESS)
      return ffi::Error::Internal("host moe_experts: stream memory operation failed (CUresult " + std::to_string(r) +
                                  "); IKJAX_HOST_CALL=hostfunc hands calls over by CUDA host functions instead");
    lane->seq = seq;
    lane->queue.emplace_back(job, seq);
  }
  lane->cv.notify_one();
  return ffi::Error::Success();
}

ffi::Error HostMoeImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int64_t> gate_slots,
                       ffi::Span<const int64_t> up_slots, ffi::Span<const int64_t> down_slots,
                       int64_t gate_row_bytes, int64_t up_row_bytes,
                       int64_t down_row_bytes, int64_t gate_type, int64_t up_type, int64_t down_type,
                       int64_t n_expert, int64_t n_ff, int64_t n_threads, int64_t compute) {
  auto xd = x.dimensions(), wd = weights.dimensions(), idd = ids.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || idd.size() != 1 || od.size() != 2)
    return ffi::Error::InvalidArgument("host moe_experts: expected x [N, d], weights [N, k], ids [N * k + 1], out [N, d]");
  const int64_t N = xd[0], d = xd[1], k = wd[1];
  if (wd[0] != N || idd[0] != N * k + 1 || od[0] != N || od[1] != d)
    return ffi::Error::InvalidArgument("host moe_experts: weights must be [N, k], ids [N * k + 1], out [N, d], N = x rows");
  if (n_expert < 1 || n_ff < 1 || gate_row_bytes < 1 || up_row_bytes < 1 || down_row_bytes < 1)
    return ffi::Error::InvalidArgument("host moe_experts: expert sizes must be set");
  auto job = std::make_unique<Job>();
  if (ffi::Error e = job->tables.resolve("host moe_experts", {gate_slots, up_slots, down_slots},
                                         {size_t(n_expert * n_ff * gate_row_bytes), size_t(n_expert * n_ff * up_row_bytes),
                                          size_t(n_expert * d * down_row_bytes)});
      e.failure())
    return e;
  for (int64_t t : {gate_type, up_type, down_type})
    if (!IKJ_DISPATCH(quant_matmul_supported)(static_cast<int>(t)))
      return ffi::Error::InvalidArgument("host moe_experts: unsupported type id " + std::to_string(t));
  if (compute != QM_F32 && compute != QM_BF16)
    return ffi::Error::InvalidArgument("host moe_experts: compute must be 0 (f32) or 1 (bf16)");
  if (N == 0) return ffi::Error::Success();

  const size_t xb = N * d * sizeof(float), wb = N * k * sizeof(float), ib = (N * k + 1) * sizeof(int32_t);
  const size_t off_w = align64(xb), off_i = off_w + align64(wb), off_o = off_i + align64(ib);
  char* st = nullptr;
  if (ffi::Error e = staging_for(stream, off_o + align64(xb), &st); e.failure()) return e;
  float* hx = reinterpret_cast<float*>(st);
  float* hw = reinterpret_cast<float*>(st + off_w);
  int32_t* hi = reinterpret_cast<int32_t*>(st + off_i);
  float* ho = reinterpret_cast<float*>(st + off_o);

  job->args = MoeExpertsArgs{hx, hw, hi, N, k, d, n_ff, n_expert,
                             nullptr, gate_row_bytes, static_cast<int>(gate_type),  // the layer's: run_job
                             nullptr, up_row_bytes, static_cast<int>(up_type),
                             nullptr, down_row_bytes, static_cast<int>(down_type),
                             ho, static_cast<int>(n_threads), static_cast<int>(compute)};
  cudaError_t e;
  if ((e = cudaMemcpyAsync(hx, x.typed_data(), xb, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaMemcpyAsync(hw, weights.typed_data(), wb, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaMemcpyAsync(hi, ids.typed_data(), ib, cudaMemcpyDeviceToHost, stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("host moe_experts: D2H copy: ") + cudaGetErrorString(e));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (flag_mode() && stream_ops().ok && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusNone) {
    if (ffi::Error err = enqueue_flag(stream, job.get()); err.failure()) return err;
  } else if ((e = cudaLaunchHostFunc(stream, run_job, job.get())) != cudaSuccess) {
    return ffi::Error::Internal(std::string("host moe_experts: cudaLaunchHostFunc: ") + cudaGetErrorString(e));
  }
  job.release();  // owned by run_job from here
  if ((e = cudaMemcpyAsync(out->typed_data(), ho, xb, cudaMemcpyHostToDevice, stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("host moe_experts: H2D copy: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ---- Streaming only the routed experts a big batch uses (ik's -ooae) ------------------------------
//
// "ikjax_stream_experts": for a prompt-sized batch the GPU computes the host-resident experts, so
// their blocks must cross PCIe (~55 GB/s); a whole R1 layer is 6.3 GB, but a batch often routes to a
// fraction of the 256 experts. This call reads the batch's expert ids, then copies only the experts
// with a non-zero routing weight, into `slots` device slots per round: round r takes the active
// experts ranked [r * slots, (r + 1) * slots) in ascending id order (the caller runs every round
// and sums the MoE outputs, so the device holds one round's blocks at a time, whatever the batch
// routes to). It returns slot_of [E] (the slot of each expert copied in this round, else -1).
// Slots not named in slot_of hold unspecified bytes, except slot 0, which always holds real blocks
// (an expert's, or zeros when the round copies nothing), so a consumer may read slot 0 with a
// zero weight.
//
// The host needs the ids before it can say what to copy: the call copies ids and weights D2H and
// waits for the stream (the GPU has nothing else queued that the copies could overlap: the MoE
// that follows needs them). Experts adjacent both in the file and in the slots go in one copy.
//
//   operands:   weights f32 [N, k], ids s32 [N * k + 1] (device: the ids, then the layer's index in
//               the slot tables, read with them)
//   attributes: gate_slots, up_slots, down_slots (per layer of the call's group, the slots of the
//               pinned host [E, rows, row_bytes] blocks), n_expert, round
//   results:    gate u8 [slots, ...], up u8 [slots, ...], down u8 [slots, ...], slot_of s32 [E]
struct StreamStats {
  int64_t calls = 0, active = 0, copied = 0, bytes = 0, copies = 0;
};
std::mutex stream_mu;
std::unordered_map<cudaStream_t, Staging> stream_staging;
std::vector<char*> stream_retired;
StreamStats stream_stats;

ffi::Error StreamExpertsImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> ids,
                             ffi::ResultBuffer<ffi::U8> gate, ffi::ResultBuffer<ffi::U8> up,
                             ffi::ResultBuffer<ffi::U8> down, ffi::ResultBuffer<ffi::S32> slot_of,
                             ffi::Span<const int64_t> gate_slots, ffi::Span<const int64_t> up_slots,
                             ffi::Span<const int64_t> down_slots, int64_t n_expert, int64_t round) {
  auto wd = weights.dimensions(), idd = ids.dimensions();
  if (wd.size() != 2 || idd.size() != 1 || idd[0] != wd[0] * wd[1] + 1)
    return ffi::Error::InvalidArgument("stream_experts: weights must be [N, k] and ids [N * k + 1]");
  const int64_t E = n_expert;
  if (E < 1 || slot_of->element_count() != static_cast<size_t>(E))
    return ffi::Error::InvalidArgument("stream_experts: slot_of must be [n_expert]");
  if (round < 0) return ffi::Error::InvalidArgument("stream_experts: round must be >= 0");
  ffi::ResultBuffer<ffi::U8>* outs[3] = {&gate, &up, &down};
  auto gdims = gate->dimensions();
  if (gdims.size() < 1 || gdims[0] < 1) return ffi::Error::InvalidArgument("stream_experts: no slots");
  const int64_t slots = gdims[0];
  size_t per_expert[3];
  for (int t = 0; t < 3; ++t) {
    auto d = (*outs[t])->dimensions();
    if (d.size() < 1 || d[0] != slots)
      return ffi::Error::InvalidArgument("stream_experts: gate, up and down need the same number of slots");
    per_expert[t] = (*outs[t])->size_bytes() / slots;
  }
  ExpertTables tables;
  if (ffi::Error e = tables.resolve("stream_experts", {gate_slots, up_slots, down_slots},
                                    {per_expert[0] * E, per_expert[1] * E, per_expert[2] * E});
      e.failure())
    return e;
  const int64_t nk = wd[0] * wd[1];
  const size_t ib = (nk + 1) * sizeof(int32_t), wb = nk * sizeof(float), tb = E * sizeof(int32_t);
  const size_t off_w = align64(ib), off_t = off_w + align64(wb);
  char* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(stream_mu);
    Staging& s = stream_staging[stream];
    const size_t need = off_t + align64(tb);
    if (s.bytes < need) {
      // the old area may still be read by a queued table copy: kept, as the host-experts staging
      char* p = nullptr;
      cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&p), std::max(need, 2 * s.bytes));
      if (e != cudaSuccess)
        return ffi::Error::Internal(std::string("stream_experts: cudaMallocHost: ") + cudaGetErrorString(e));
      if (s.base) stream_retired.push_back(s.base);
      s.base = p;
      s.bytes = std::max(need, 2 * s.bytes);
    }
    st = s.base;
  }
  int32_t* hi = reinterpret_cast<int32_t*>(st);
  float* hw = reinterpret_cast<float*>(st + off_w);
  int32_t* table = reinterpret_cast<int32_t*>(st + off_t);
  cudaError_t e;
  if ((e = cudaMemcpyAsync(hi, ids.typed_data(), ib, cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (nk && (e = cudaMemcpyAsync(hw, weights.typed_data(), wb, cudaMemcpyDeviceToHost, stream)) != cudaSuccess))
    return ffi::Error::Internal(std::string("stream_experts: D2H copy: ") + cudaGetErrorString(e));
  if ((e = cudaStreamSynchronize(stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("stream_experts: stream: ") + cudaGetErrorString(e));
  const char* srcs[3];
  if (ffi::Error le = tables.pick_or_error("stream_experts", hi[nk], srcs); le.failure()) return le;

  std::vector<char> used(E, 0);
  for (int64_t i = 0; i < nk; ++i) {
    if (hi[i] < 0 || hi[i] >= E)
      return ffi::Error::Internal("stream_experts: expert id " + std::to_string(hi[i]) + " outside [0, " +
                                  std::to_string(E) + ")");
    if (hw[i] != 0.0f) used[hi[i]] = 1;
  }
  const int64_t lo = round * slots;
  int64_t rank = 0, in_round = 0, active = 0;
  int64_t run_e = -1, run_slot = 0, run_n = 0, n_copies = 0;
  auto flush = [&]() -> cudaError_t {
    if (run_n == 0) return cudaSuccess;
    for (int t = 0; t < 3; ++t) {
      cudaError_t ce = cudaMemcpyAsync(static_cast<char*>((*outs[t])->untyped_data()) + run_slot * per_expert[t],
                                       srcs[t] + run_e * per_expert[t], run_n * per_expert[t],
                                       cudaMemcpyHostToDevice, stream);
      if (ce != cudaSuccess) return ce;
    }
    ++n_copies;
    run_n = 0;
    return cudaSuccess;
  };
  for (int64_t x = 0; x < E; ++x) {
    table[x] = -1;
    if (!used[x]) continue;
    ++active;
    const int64_t r = rank++;
    if (r < lo || r >= lo + slots) continue;
    const int64_t slot = r - lo;
    table[x] = static_cast<int32_t>(slot);
    ++in_round;
    if (run_n && run_e + run_n == x && run_slot + run_n == slot) {
      ++run_n;
    } else {
      if ((e = flush()) != cudaSuccess) break;
      run_e = x, run_slot = slot, run_n = 1;
    }
  }
  if (e == cudaSuccess) e = flush();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("stream_experts: H2D copy: ") + cudaGetErrorString(e));
  if (in_round == 0)
    for (int t = 0; t < 3; ++t)
      if ((e = cudaMemsetAsync((*outs[t])->untyped_data(), 0, per_expert[t], stream)) != cudaSuccess)
        return ffi::Error::Internal(std::string("stream_experts: memset: ") + cudaGetErrorString(e));
  if ((e = cudaMemcpyAsync(slot_of->untyped_data(), table, tb, cudaMemcpyHostToDevice, stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("stream_experts: H2D table: ") + cudaGetErrorString(e));
  std::lock_guard<std::mutex> lock(stream_mu);
  stream_stats.calls += 1;
  stream_stats.active += round == 0 ? active : 0;
  stream_stats.copied += in_round;
  stream_stats.bytes += in_round * int64_t(per_expert[0] + per_expert[1] + per_expert[2]);
  stream_stats.copies += n_copies;
  return ffi::Error::Success();
}

// ---- Every expert of a layer, a run at a time, beside the compute (IKJAX_STREAM=chunks) -------------
//
// A prompt batch of a realistically routed model uses every expert of a layer, so all of its blocks
// must cross PCIe; holding two whole layers on the device for that (R1: 2 x 6.3 GB, twice with the
// kernels' layout) is what a 24 GB card cannot give. These two calls move a fixed run of experts
// [lo, lo + n) by the copy engine on a side stream, so the copy of run j + 1 overlaps the MoE of
// run j on XLA's stream:
//
// "ikjax_chunk_copy_start": the side stream waits for XLA's stream to reach the call (the results'
// device memory is then free: XLA allocated it for this call), copies the run's bytes of the three
// pinned host tensors into the results, and records an event under the first result's address.
//   operands:   after (any small device buffer: a data dependence that orders the call in the step),
//               layer s32 [1] (the layer's index in the slot tables; read, with a wait for the
//               stream, only where a table has several: a scanned group's layer)
//   attributes: gate_slots, up_slots, down_slots (per layer of the call's group, the slots of the
//               pinned host [E, rows, row_bytes] blocks), n_expert, lo (the run's first expert; n =
//               the results' leading dimension)
//   results:    gate u8 [n, ...], up u8 [n, ...], down u8 [n, ...]
// "ikjax_chunk_copy_done": XLA's stream waits for the event of its first operand's address (the
// start's results, aliased to its own results); an address no start recorded is an error of the
// call (XLA copied the buffer in between), never a read of half-copied bytes.
//   operands:   after, gate, up, down (the start's results)      results: gate, up, down (aliased)
std::mutex chunk_mu;
std::unordered_map<cudaStream_t, cudaStream_t> side_streams;      // XLA's stream -> its copy stream
std::unordered_map<const void*, cudaEvent_t> chunk_pending;        // a run's first result -> copied
// free events per XLA stream: an event belongs to the device it was made on, and a process with
// several GPUs (-sm layer stages with host experts) runs these calls on each device's stream
std::unordered_map<cudaStream_t, std::vector<cudaEvent_t>> chunk_events;

ffi::Error chunk_event(cudaStream_t stream, cudaEvent_t* ev) {  // under chunk_mu
  std::vector<cudaEvent_t>& pool = chunk_events[stream];
  if (!pool.empty()) {
    *ev = pool.back();
    pool.pop_back();
    return ffi::Error::Success();
  }
  cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
  return e == cudaSuccess ? ffi::Error::Success()
                          : ffi::Error::Internal(std::string("chunk_copy: cudaEventCreate: ") + cudaGetErrorString(e));
}

// A scanned group's layer index, read from the device: the copy's source must be known when it is
// enqueued, so the host waits for the stream here (a run of experts takes milliseconds to cross
// PCIe; the wait costs the stream one hand-over, tens of microseconds).
ffi::Error read_layer(cudaStream_t stream, const ffi::Buffer<ffi::S32>& layer, int32_t* out) {
  static thread_local int32_t* pinned = nullptr;
  cudaError_t e;
  if (!pinned && (e = cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(int32_t))) != cudaSuccess) {
    pinned = nullptr;
    return ffi::Error::Internal(std::string("chunk_copy_start: cudaMallocHost: ") + cudaGetErrorString(e));
  }
  if ((e = cudaMemcpyAsync(pinned, layer.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaStreamSynchronize(stream)) != cudaSuccess)
    return ffi::Error::Internal(std::string("chunk_copy_start: reading the layer index: ") + cudaGetErrorString(e));
  *out = *pinned;
  return ffi::Error::Success();
}

ffi::Error ChunkStartImpl(cudaStream_t stream, ffi::AnyBuffer after, ffi::Buffer<ffi::S32> layer_index,
                          ffi::ResultBuffer<ffi::U8> gate, ffi::ResultBuffer<ffi::U8> up,
                          ffi::ResultBuffer<ffi::U8> down, ffi::Span<const int64_t> gate_slots,
                          ffi::Span<const int64_t> up_slots, ffi::Span<const int64_t> down_slots, int64_t n_expert,
                          int64_t lo) {
  (void)after;
  ffi::ResultBuffer<ffi::U8>* outs[3] = {&gate, &up, &down};
  auto gd = gate->dimensions();
  if (gd.size() < 1 || gd[0] < 1) return ffi::Error::InvalidArgument("chunk_copy_start: no experts in the run");
  const int64_t n = gd[0];
  if (lo < 0 || lo + n > n_expert)
    return ffi::Error::InvalidArgument("chunk_copy_start: experts [" + std::to_string(lo) + ", " +
                                       std::to_string(lo + n) + ") outside [0, " + std::to_string(n_expert) + ")");
  size_t per_expert[3];
  for (int t = 0; t < 3; ++t) {
    auto d = (*outs[t])->dimensions();
    if (d.size() < 1 || d[0] != n)
      return ffi::Error::InvalidArgument("chunk_copy_start: gate, up and down need the same number of experts");
    per_expert[t] = (*outs[t])->size_bytes() / n;
  }
  ExpertTables tables;
  if (ffi::Error e = tables.resolve("chunk_copy_start", {gate_slots, up_slots, down_slots},
                                    {per_expert[0] * n_expert, per_expert[1] * n_expert, per_expert[2] * n_expert});
      e.failure())
    return e;
  if (layer_index.element_count() != 1)
    return ffi::Error::InvalidArgument("chunk_copy_start: the layer index must be s32 [1]");
  int32_t layer = 0;
  if (tables.layers() > 1)
    if (ffi::Error le = read_layer(stream, layer_index, &layer); le.failure()) return le;
  const char* srcs[3];
  if (ffi::Error le = tables.pick_or_error("chunk_copy_start", layer, srcs); le.failure()) return le;
  std::lock_guard<std::mutex> lock(chunk_mu);
  cudaError_t e;
  cudaStream_t& side = side_streams[stream];
  if (!side && (e = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking)) != cudaSuccess) {
    side = nullptr;
    return ffi::Error::Internal(std::string("chunk_copy_start: cudaStreamCreate: ") + cudaGetErrorString(e));
  }
  cudaEvent_t reached, copied;
  if (ffi::Error fe = chunk_event(stream, &reached); fe.failure()) return fe;
  if (ffi::Error fe = chunk_event(stream, &copied); fe.failure()) return fe;
  if ((e = cudaEventRecord(reached, stream)) != cudaSuccess || (e = cudaStreamWaitEvent(side, reached, 0)) != cudaSuccess)
    return ffi::Error::Internal(std::string("chunk_copy_start: event: ") + cudaGetErrorString(e));
  chunk_events[stream].push_back(reached);  // the wait is enqueued: the event may be recorded again
  for (int t = 0; t < 3; ++t)
    if ((e = cudaMemcpyAsync((*outs[t])->untyped_data(), srcs[t] + lo * per_expert[t], n * per_expert[t],
                             cudaMemcpyHostToDevice, side)) != cudaSuccess)
      return ffi::Error::Internal(std::string("chunk_copy_start: H2D copy: ") + cudaGetErrorString(e));
  if ((e = cudaEventRecord(copied, side)) != cudaSuccess)
    return ffi::Error::Internal(std::string("chunk_copy_start: event: ") + cudaGetErrorString(e));
  auto [it, fresh] = chunk_pending.emplace(gate->untyped_data(), copied);
  if (!fresh) {  // a run never waited for at this address: a bug of the step, not a user error
    chunk_events[stream].push_back(it->second);
    it->second = copied;
  }
  std::lock_guard<std::mutex> slock(stream_mu);
  stream_stats.calls += 1;
  stream_stats.copied += n;
  stream_stats.bytes += n * int64_t(per_expert[0] + per_expert[1] + per_expert[2]);
  stream_stats.copies += 1;
  return ffi::Error::Success();
}

ffi::Error ChunkDoneImpl(cudaStream_t stream, ffi::AnyBuffer after, ffi::Buffer<ffi::U8> gate, ffi::Buffer<ffi::U8> up,
                         ffi::Buffer<ffi::U8> down, ffi::ResultBuffer<ffi::U8> gate_out,
                         ffi::ResultBuffer<ffi::U8> up_out, ffi::ResultBuffer<ffi::U8> down_out) {
  (void)after;
  cudaEvent_t copied;
  {
    std::lock_guard<std::mutex> lock(chunk_mu);
    auto it = chunk_pending.find(gate.untyped_data());
    if (it == chunk_pending.end())
      return ffi::Error::Internal("chunk_copy_done: no copy was started into this buffer (the step moved it "
                                  "between the two calls)");
    copied = it->second;
    chunk_pending.erase(it);
  }
  cudaError_t e = cudaStreamWaitEvent(stream, copied, 0);
  {
    std::lock_guard<std::mutex> lock(chunk_mu);
    chunk_events[stream].push_back(copied);  // Done runs on the stream its Start ran on
  }
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("chunk_copy_done: wait: ") + cudaGetErrorString(e));
  const ffi::Buffer<ffi::U8>* ins[3] = {&gate, &up, &down};
  ffi::ResultBuffer<ffi::U8>* outs[3] = {&gate_out, &up_out, &down_out};
  for (int t = 0; t < 3; ++t)  // aliased: nothing to do; else the bytes, in stream order after the wait
    if ((*outs[t])->untyped_data() != ins[t]->untyped_data() &&
        (e = cudaMemcpyAsync((*outs[t])->untyped_data(), ins[t]->untyped_data(), ins[t]->size_bytes(),
                             cudaMemcpyDeviceToDevice, stream)) != cudaSuccess)
      return ffi::Error::Internal(std::string("chunk_copy_done: D2D copy: ") + cudaGetErrorString(e));
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
                                  .Attr<ffi::Span<const int64_t>>("gate_slots")
                                  .Attr<ffi::Span<const int64_t>>("up_slots")
                                  .Attr<ffi::Span<const int64_t>>("down_slots")
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(StreamExpertsFfi, StreamExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<ffi::Span<const int64_t>>("gate_slots")
                                  .Attr<ffi::Span<const int64_t>>("up_slots")
                                  .Attr<ffi::Span<const int64_t>>("down_slots")
                                  .Attr<int64_t>("n_expert")
                                  .Attr<int64_t>("round"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkStartFfi, ChunkStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<ffi::Span<const int64_t>>("gate_slots")
                                  .Attr<ffi::Span<const int64_t>>("up_slots")
                                  .Attr<ffi::Span<const int64_t>>("down_slots")
                                  .Attr<int64_t>("n_expert")
                                  .Attr<int64_t>("lo"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkDoneFfi, ChunkDoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::U8>>());

// A stats struct's fields as a dict, read under its mutex (then zeroed if `reset`).
template <class S>
nb::dict counters(std::mutex& mu, S& stats, bool reset,
                  std::initializer_list<std::pair<const char*, int64_t S::*>> fields) {
  std::lock_guard<std::mutex> lock(mu);
  nb::dict d;
  for (const auto& [name, field] : fields) d[name] = stats.*field;
  if (reset) stats = S{};
  return d;
}

NB_MODULE(_cuda_host, m) {
  m.doc() = "ikjax: routed experts in host RAM computed by the CPU from a GPU step (XLA FFI, platform CUDA)";
  m.def("registrations", [] {
    nb::dict d;
    d["ikjax_host_moe_experts"] = nb::capsule(reinterpret_cast<void*>(HostMoeExpertsFfi));
    d["ikjax_stream_experts"] = nb::capsule(reinterpret_cast<void*>(StreamExpertsFfi));
    d["ikjax_chunk_copy_start"] = nb::capsule(reinterpret_cast<void*>(ChunkStartFfi));
    d["ikjax_chunk_copy_done"] = nb::capsule(reinterpret_cast<void*>(ChunkDoneFfi));
    return d;
  });
  // totals since the process started (or the last reset): stream_experts calls, experts active in
  // their batches (counted once per batch, at round 0), experts and bytes copied, copy runs
  m.def("stream_stats", [](bool reset) {
    return counters(stream_mu, stream_stats, reset, {{"calls", &StreamStats::calls}, {"active", &StreamStats::active},
                    {"copied", &StreamStats::copied}, {"bytes", &StreamStats::bytes}, {"copies", &StreamStats::copies}});
  }, nb::arg("reset") = false);
  // totals of the host kernel's calls since the process started (or the last reset): all calls and
  // the decode-sized ones (N <= 16), the nanoseconds spent in the kernel and the expert bytes read
  m.def("host_stats", [](bool reset) {
    return counters(host_stats_mu, host_stats, reset, {{"calls", &HostStats::calls}, {"ns", &HostStats::ns},
                    {"bytes", &HostStats::bytes}, {"small_calls", &HostStats::small_calls},
                    {"small_ns", &HostStats::small_ns}, {"small_bytes", &HostStats::small_bytes}});
  }, nb::arg("reset") = false);
  // a slot's host bytes (see the top): set before a step naming the slot runs; read back for tests
  m.def("set_host_slot", [](int64_t slot, uintptr_t address, size_t size) {
    if (!address || !size) throw std::invalid_argument("set_host_slot: address and size must be non-zero");
    std::lock_guard<std::mutex> lock(slots_mu);
    host_slots[slot] = HostBytes{reinterpret_cast<const char*>(address), size};
  }, nb::arg("slot"), nb::arg("address"), nb::arg("size"));
  m.def("host_slot", [](int64_t slot) -> nb::object {
    std::lock_guard<std::mutex> lock(slots_mu);
    auto it = host_slots.find(slot);
    if (it == host_slots.end()) return nb::none();
    return nb::make_tuple(reinterpret_cast<uintptr_t>(it->second.base), it->second.size);
  }, nb::arg("slot"));
  m.def("isa", [] { return std::string(ikj::isa_name(ikj::current_isa())); });
  // how calls are handed over: "flag" (stream memory operations) or "hostfunc" (see above)
  m.def("host_call", [] { return std::string(flag_mode() && stream_ops().ok ? "flag" : "hostfunc"); });
  m.def("quant_type_supported", [](int type) { return IKJ_DISPATCH(quant_matmul_supported)(type); });
}
