#include "cpu/runtime.h"

#include <sched.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#include <cerrno>

#include <algorithm>

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

#include <string>
#include <vector>

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

// The calling thread waits this long at most, spinning (whatever IKJAX_SPIN says: that is the
// workers' wait between jobs), for the parts other threads have taken,
// then sleeps until the last one is done. Its own part and every part no worker has taken yet
// are done by then (Pool::run), so it only waits for work in progress: on an idle machine that
// ends within microseconds of its own part; longer means a worker was preempted mid-part, and
// the caller's core is better given up (the scheduler moves that worker onto it) than burnt.
constexpr int64_t kCallerSpinUs = 50;

// Spin until done() or `us` microseconds have passed; returns done(). Every 256 pauses it checks
// the clock and calls sched_yield(), which costs ~0.2 us when nothing else wants this core and
// hands the core over when something does: another process, XLA's own threads, or this pool's
// caller sharing a core with a spinning worker (2 cores, a busy neighbour, -t 2: the waits
// without yielding ran whole scheduler slices, a tiny-model 16-token decode 37 ms .. 2.5 s
// instead of 15 ms; 16-26 ms with it and the caller's part-taking below: issue 21,
// tests/test_cpu_pool.py).
template <class Done>
bool spin_until(Done done, int64_t us) {
  if (us <= 0) return done();
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (unsigned spins = 1;; ++spins) {
    if (done()) return true;
    IKJ_PAUSE();
    if ((spins & 255) == 0) {
      if (std::chrono::steady_clock::now() >= end) return done();
      sched_yield();
    }
  }
}

// One job at a time (a mutex serializes callers from concurrent XLA threads). A job is nth parts
// fn(i, nth); the caller does part 0, then takes every part no worker has taken yet, so a worker
// that the OS has not scheduled (all cores busy) never holds the call back: the call then costs
// what one thread would. Parts are taken from one atomic word, state_ = generation | nth | next
// part, so a worker that wakes late cannot take a part of a newer job than the one it saw.
// Workers wait for a new generation spinning (spin_limit_us(), yielding) and then sleeping on a
// condition variable, so an idle process burns no CPU.
class Pool {
  // state_ layout: generation in the high 40 bits, nth in bits 12..23, the next free part in 0..11
  static constexpr int kBits = 12;
  static constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  static uint64_t gen_of(uint64_t s) { return s >> (2 * kBits); }
  static int nth_of(uint64_t s) { return static_cast<int>((s >> kBits) & kMask); }
  static int next_of(uint64_t s) { return static_cast<int>(s & kMask); }

 public:
  static constexpr int kMaxThreads = static_cast<int>(kMask);

  void run(int nth, const std::function<void(int, int)>& fn) {
    std::lock_guard<std::mutex> job_lock(job_mu_);
    ensure_workers(nth - 1);
    fn_ = &fn;
    pending_.store(nth - 1, std::memory_order_relaxed);
    const uint64_t gen = gen_of(state_.load(std::memory_order_relaxed)) + 1;
    {
      std::lock_guard<std::mutex> l(mu_);
      state_.store((gen << (2 * kBits)) | (static_cast<uint64_t>(nth) << kBits) | 1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0, nth);
    for (int i; (i = take(gen)) >= 0;) {  // the parts no worker has taken: nobody else will
      fn(i, nth);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
    if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; }, kCallerSpinUs)) {
      std::unique_lock<std::mutex> l(done_mu_);
      caller_waiting_.store(true, std::memory_order_seq_cst);
      done_cv_.wait(l, [&] { return pending_.load(std::memory_order_seq_cst) == 0; });
      caller_waiting_.store(false, std::memory_order_relaxed);
    }
    fn_ = nullptr;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_.store(true, std::memory_order_relaxed);
      state_.fetch_add(uint64_t{1} << (2 * kBits), std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.detach();  // process exit: do not block on sleeping workers
  }

 private:
  // Take the next free part of job `gen`: its index, or -1 when all are taken or the job is over.
  // The acquire CAS pairs with run()'s release store of that generation: fn_ is the job's.
  int take(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if (gen_of(s) != gen || next_of(s) >= nth_of(s)) return -1;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return next_of(s);
    }
  }

  void ensure_workers(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      // the generation seen at creation, before run() publishes the job this worker may take
      uint64_t seen = gen_of(state_.load(std::memory_order_acquire));
      workers_.emplace_back([this, seen] { loop(seen); });
    }
  }

  void loop(uint64_t seen) {
    int64_t spin = spin_limit_us();
    for (;;) {
      uint64_t g;
      auto changed = [&] { return (g = gen_of(state_.load(std::memory_order_acquire))) != seen; };
      if (!spin_until(changed, spin)) {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, changed);
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;  // stored before the generation this saw
      const auto t0 = std::chrono::steady_clock::now();
      for (int i; (i = take(g)) >= 0;) {
        (*fn_)(i, nth_of(state_.load(std::memory_order_relaxed)));
        if (pending_.fetch_sub(1, std::memory_order_seq_cst) == 1 && caller_waiting_.load(std::memory_order_seq_cst)) {
          std::lock_guard<std::mutex> l(done_mu_);  // the caller is in done_cv_.wait or about to test pending_
          done_cv_.notify_one();
        }
      }
      // after a long part (a prompt-sized product) the next job comes after XLA's own ops (norms,
      // concatenations, residual adds), which run on XLA's threads on these same cores: spinning
      // there slowed them by a third at -t 2 (24 -> 31-34 ms a V2-Lite prompt step). Those jobs
      // are long, so a wake-up (tens of us) costs them little; short ones (a decode step's) keep
      // the full spin, where the next call comes within microseconds.
      const int64_t part_us =
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
      spin = part_us >= kLongPartUs ? std::min(spin_limit_us(), long_part_spin_us()) : spin_limit_us();
    }
  }
  static constexpr int64_t kLongPartUs = 1000;
  // microseconds a worker spins after a long part (IKJAX_SPIN_LONG overrides; read once)
  static int64_t long_part_spin_us() {
    static const int64_t n = [] {
      const char* e = std::getenv("IKJAX_SPIN_LONG");
      return e && *e ? static_cast<int64_t>(std::atoll(e)) : int64_t{50};
    }();
    return n;
  }

  std::mutex job_mu_, mu_, done_mu_;
  std::condition_variable cv_, done_cv_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> caller_waiting_{false};
  const std::function<void(int, int)>* fn_ = nullptr;
  std::atomic<bool> stop_{false};
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
  if (nth > Pool::kMaxThreads) nth = Pool::kMaxThreads;
  if (nth <= 1) {
    fn(0, 1);
    return;
  }
  pool().run(nth, fn);
}

void wait_at_least(const std::atomic<int>& v, int target) {
  for (unsigned spins = 1; v.load(std::memory_order_acquire) < target; ++spins) {
    IKJ_PAUSE();
    if ((spins & 255) == 0) sched_yield();
  }
}

std::vector<FfiEntry>& ffi_registry() {
  static std::vector<FfiEntry> r;
  return r;
}

// ---- instruction-set level -------------------------------------------------------------------

// Whether the amx level can run: the CPU's AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25), the
// OS's XSAVE of the tile state (XCR0 bits 17, 18) and the Linux kernel's permission for the tile
// data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), granted per process; a tile
// instruction without it faults). Asked once, at the first level query, before any tile is used.
// Returns "" or why not.
static std::string amx_check() {
#if !defined(IKJ_HAVE_AMX)
  return "not compiled in";
#elif !(defined(__x86_64__) && defined(__GNUC__) && defined(__linux__))
  return "not supported on this OS";
#else
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "cpu has no amx_tile (no CPUID leaf 7)";
  const bool tile = d & (1u << 24), int8 = d & (1u << 25);
  if (!tile && !int8) return "cpu has no amx_tile, amx_int8";
  if (!tile) return "cpu has no amx_tile";
  if (!int8) return "cpu has no amx_int8";
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !(c1 & (1u << 27))) return "OS has XSAVE off (no OSXSAVE)";
  unsigned xlo = 0, xhi = 0;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  if ((xlo & (3u << 17)) != (3u << 17)) return "OS does not enable the tile state (XCR0 bits 17, 18)";
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    const int e = errno;
    return std::string("kernel refused XTILEDATA (arch_prctl: ") + std::strerror(e) + ")";
  }
  unsigned long perm = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &perm) != 0 || !(perm & (1ul << kXfeatureXtiledata)))
    return "kernel refused XTILEDATA (not in ARCH_GET_XCOMP_PERM)";
  return "";
#endif
}

static const std::string& amx_why() {
  static const std::string why = amx_check();
  return why;
}

const char* amx_unavailable_reason() { return amx_why().c_str(); }

// CPUID.(leaf, sub):EAX (reg 0) or EDX (reg 3) bit `bit`
static bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned r[4] = {};
  return __get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]) && (r[reg] & (1u << bit));
#else
  (void)leaf, (void)sub, (void)reg, (void)bit;
  return false;
#endif
}

bool env_on(const char* var) {
  const char* v = std::getenv(var);
  return !(v && std::strcmp(v, "0") == 0);
}

// A feature the CPU has (`has`, asked once by the caller), unless `var` (read per call) is `off`.
static bool on_unless(bool has, const char* var, const char* off) {
  const char* v = has ? std::getenv(var) : nullptr;
  return has && !(v && std::strcmp(v, off) == 0);
}

bool avx_vnni_on() {
#if defined(IKJ_HAVE_AVXVNNI)
  static const bool has = cpuid_bit(7, 1, 0, 4);  // AVX-VNNI
#else
  static const bool has = false;
#endif
  return on_unless(has, "IKJAX_AVXVNNI", "0");
}

bool amx_bf16_on() {
#if defined(IKJ_HAVE_AMX)
  static const bool has = cpuid_bit(7, 0, 3, 22);  // AMX-BF16
#else
  static const bool has = false;
#endif
  return on_unless(has, "IKJAX_AMX", "int8");
}

int64_t amx_min_rows() {
  const char* v = std::getenv("IKJAX_AMX_MIN_ROWS");
  if (v && *v) {
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end && *end == 0 && n >= 16) return n;
  }
  return kAmxMinRowsDefault;
}

static Isa detected_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
#if defined(IKJ_HAVE_AVX512)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16"))
    return amx_why().empty() ? Isa::amx : Isa::avx512;
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
  Isa want = std::strcmp(cap, "generic") == 0  ? Isa::generic
             : std::strcmp(cap, "avx2") == 0   ? Isa::avx2
             : std::strcmp(cap, "avx512") == 0 ? Isa::avx512
                                               : Isa::amx;
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

// Which level runs and why: the best compiled-in level the CPU supports, lowered by IKJAX_CPU_ISA;
// names the CPU features a higher compiled-in level needs and this CPU lacks (what a user on a
// Zen 3 or desktop part reads to see why it is not the avx512 level), why amx does not run where it
// is compiled in and the level below it does ("amx: cpu has no amx_int8", "amx: kernel refused
// XTILEDATA (...)"), and the int8 paths of the level that runs.
std::string isa_report() {
  const Isa best = detected_isa(), now = current_isa();
  std::string why;
  const char* cap = std::getenv("IKJAX_CPU_ISA");
  if (now != best) {
    why = std::string("capped by IKJAX_CPU_ISA=") + cap + "; this CPU runs " + isa_name(best);
  } else {
    std::vector<std::string> lacks;
    const char* higher = nullptr;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
#define IKJ_LACKS(f) if (!__builtin_cpu_supports(f)) lacks.push_back(f)  // the builtin takes literals only
#if defined(IKJ_HAVE_AVX512)
    if (best != Isa::avx512 && best != Isa::amx) {
      higher = "avx512";
      IKJ_LACKS("avx512f"); IKJ_LACKS("avx512bw"); IKJ_LACKS("avx512vl"); IKJ_LACKS("avx512dq");
      IKJ_LACKS("avx512vnni"); IKJ_LACKS("avx512bf16");
    }
#endif
#if defined(IKJ_HAVE_AVX2)
    if (best == Isa::generic) {
      higher = "avx2";
      lacks.clear();
      IKJ_LACKS("avx2"); IKJ_LACKS("fma"); IKJ_LACKS("f16c"); IKJ_LACKS("bmi2");
    }
#endif
#undef IKJ_LACKS
#endif
    if (higher) {
      why = std::string(higher) + " compiled in, CPU lacks";
      for (size_t i = 0; i < lacks.size(); ++i) why += (i ? ", " : " ") + lacks[i];
    } else {
      why = best == Isa::generic ? "no x86 SIMD level compiled in" : "the best level compiled in";
    }
#if defined(IKJ_HAVE_AMX)
    if (best != Isa::amx) why += std::string("; amx: ") + amx_why();
#endif
    if (now == best && cap && *cap && std::strcmp(cap, isa_name(best)) != 0) {
      const bool known = std::strcmp(cap, "generic") == 0 || std::strcmp(cap, "avx2") == 0 ||
                         std::strcmp(cap, "avx512") == 0 || std::strcmp(cap, "amx") == 0;
      why += std::string("; IKJAX_CPU_ISA=") + cap +
             (known ? " asks for more than the CPU has" : " is not a level (generic, avx2, avx512, amx): ignored");
    }
  }
  const std::string amx_paths = std::string("dtype bf16: int8 decode and prompt products, ") +
      (amx_bf16_on() ? "AMX bf16 tiles (tdpbf16ps)" : "AMX int8 tiles (tdpbusd)") + " for prompt products of " +
      std::to_string(amx_min_rows()) + "+ rows, AVX-512 VNNI (vpdpbusd) below";
  const char* paths =
      now == Isa::amx      ? amx_paths.c_str()
      : now == Isa::avx512 ? "dtype bf16: int8 decode and prompt products, AVX-512 VNNI (vpdpbusd)"
      : now == Isa::avx2   ? (avx_vnni_on() ? "dtype bf16: int8 decode and prompt products, AVX2 with AVX-VNNI (vpdpbusd)"
                                            : "dtype bf16: int8 decode and prompt products, AVX2 (vpmaddubsw/vpmaddwd)")
                           : "no int8 paths (f32)";
  return std::string(isa_name(now)) + " (" + why + "); " + paths;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx: return "amx";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

}  // namespace ikj
