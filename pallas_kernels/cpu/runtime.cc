#include "cpu/runtime.h"

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define IKJ_PAUSE() _mm_pause()
#else
#define IKJ_PAUSE() ((void)0)
#endif

#include "cpu/isa.h"

namespace ikj {

int available_cores() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

namespace {

// Microseconds a worker spins before sleeping (IKJAX_SPIN overrides; read once). A decode step
// calls back within microseconds, but between two steps the host (Python, XLA's dispatch) takes
// ~0.4-0.7 ms: the former limit, 20000 pauses (~0.5 ms on Zen 4, where a pause is ~25 ns), let
// the worker fall asleep there and the step's first call paid the wake-up (Q4_0 decode step median
// 11.1 -> 10.8 ms at 2 ms). Time, not a pause count: a pause costs 1 to 40+ ns across CPUs.
// The GPU build's pool (pallas_kernels._cuda_host: host experts called from a GPU step) does not
// spin by default: its workers would hold every core while XLA's launch thread and CUDA's
// callback thread need one, and a hybrid decode step ran 52-53 t/s spinning vs 59-65 without
// (R1 8-layer shape, H100 host, 16 threads; RESULTS §8).
#ifndef IKJ_DEFAULT_SPIN_US
#define IKJ_DEFAULT_SPIN_US 2000
#endif
int64_t spin_limit_us() {
  static const int64_t n = [] {
    const char* e = std::getenv("IKJAX_SPIN");
    return e && *e ? static_cast<int64_t>(std::atoll(e)) : int64_t{IKJ_DEFAULT_SPIN_US};
  }();
  return n;
}

// One job at a time (a mutex serializes callers from concurrent XLA threads); workers wait for a
// new generation number, spinning up to spin_limit_us() first because a decode step calls back
// within microseconds, then sleeping on a condition variable so an idle process burns no CPU.
class Pool {
 public:
  void run(int nth, const std::function<void(int, int)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mu_);
    ensure_workers(nth - 1);
    fn_ = &fn;
    nth_ = nth;
    pending_.store(nth - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> l(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0, nth);
    while (pending_.load(std::memory_order_acquire) > 0) IKJ_PAUSE();
    fn_ = nullptr;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.detach();  // process exit: do not block on sleeping workers
  }

 private:
  void ensure_workers(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      int id = static_cast<int>(workers_.size()) + 1;
      // the generation seen at creation, before run() publishes the job this worker must take
      uint64_t seen = gen_.load(std::memory_order_acquire);
      workers_.emplace_back([this, id, seen] { loop(id, seen); });
    }
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      uint64_t g;
      const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_limit_us());
      for (int spins = 0; (g = gen_.load(std::memory_order_acquire)) == seen; ++spins) {
        IKJ_PAUSE();
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() >= spin_end) break;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        g = gen_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_) return;
      if (id < nth_) {
        (*fn_)(id, nth_);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::mutex job_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int, int)>* fn_ = nullptr;
  int nth_ = 1;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: workers may outlive static destruction order
  return *p;
}

}  // namespace

void parallel(int n_threads, const std::function<void(int, int)>& fn) {
  int avail = available_cores();
  int nth = n_threads <= 0 ? avail : (n_threads < avail ? n_threads : avail);
  if (nth <= 1) {
    fn(0, 1);
    return;
  }
  pool().run(nth, fn);
}

std::vector<FfiEntry>& ffi_registry() {
  static std::vector<FfiEntry> r;
  return r;
}

// ---- instruction-set level -------------------------------------------------------------------

static Isa detected_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
#if defined(IKJ_HAVE_AVX512)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16"))
    return Isa::avx512;
#endif
#if defined(IKJ_HAVE_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2"))
    return Isa::avx2;
#endif
#endif
  return Isa::generic;
}

Isa current_isa() {
  static const Isa best = detected_isa();
  const char* cap = std::getenv("IKJAX_CPU_ISA");
  if (!cap || !*cap) return best;
  Isa want = std::strcmp(cap, "generic") == 0 ? Isa::generic
             : std::strcmp(cap, "avx2") == 0  ? Isa::avx2
                                              : Isa::avx512;
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

}  // namespace ikj
