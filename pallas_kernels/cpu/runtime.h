// Shared runtime of the CPU kernels: a persistent thread pool sized per call (-t / -tb), and the
// registry through which each op's FFI handlers reach the Python module.
#pragma once

#include <cstdint>
#include <atomic>
#include <functional>
#include <string>
#include <vector>

namespace ikj {

// Cores this process may run on (sched_getaffinity), at least 1.
int available_cores();

// The CPU row gather (embed_rows/cpu_ffi.cc) keeps an open descriptor of each model file it reads rows
// from; this lets go of file (st_dev, st_ino)'s. True where one was open.
bool embed_rows_forget_file(uint64_t dev, uint64_t inode);

// A kernel form's switch: false only where the environment variable `var` is "0" (read per call,
// so a test or an A/B can flip it between calls). IKJAX_AMX_FUSED, IKJAX_AMX_PREFETCH, ...
bool env_on(const char* var);

// Run fn(ith, nth) for ith = 0..nth-1, nth = min(n_threads, available); returns when all have
// finished. n_threads <= 0 means every available core. The calling thread runs part 0 and then
// every part no worker has started yet, so a part may run on any thread, several parts on one
// thread one after another, and a part must not wait for another. Workers persist between calls
// and spin briefly (yielding the core to anything else that wants it) before sleeping, so a decode
// step's many small calls do not pay a thread wake-up each (the reason for our own pool instead of
// std::async or OpenMP's defaults); the caller spins ~50 us at most for parts in progress, then
// sleeps, so a busy machine's scheduler is never fought over a core (cpu/runtime.cc).
void parallel(int n_threads, const std::function<void(int ith, int nth)>& fn);

// Inside a parallel() job: wait (spinning, yielding every 256 pauses) until v >= target. Only for
// counts that threads already running parts of the job will raise: a part the pool has not handed
// out yet is never waited for (see moe_matmul/cpu_kernel.cc's decode job).
void wait_at_least(const std::atomic<int>& v, int target);

// Split [0, n) into near-equal contiguous chunks: the part of thread ith of nth.
inline void split_range(int64_t n, int ith, int nth, int64_t* begin, int64_t* end) {
  int64_t per = n / nth, rem = n % nth;
  *begin = ith * per + (ith < rem ? ith : rem);
  *end = *begin + per + (ith < rem ? 1 : 0);
}

// FFI handler registry: each <op>/cpu_ffi.cc adds its handlers at static-init time with
//   static ikj::FfiRegistration reg("ikjax_cpu_quant_matmul", QuantMatmulFfi);
struct FfiEntry {
  std::string name;
  void* handler;
};
std::vector<FfiEntry>& ffi_registry();
struct FfiRegistration {
  FfiRegistration(const char* name, void* handler) { ffi_registry().push_back({name, handler}); }
};

}  // namespace ikj
