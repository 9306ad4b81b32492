// Instruction-set levels of the CPU kernels and the run-time choice among them.
//
// Each kernel source is compiled once per level into namespace ikj_<level> (CMakeLists.txt); an
// FFI handler calls IKJ_DISPATCH(fn)(args...) to reach the best level this CPU runs. The choice
// can be capped with IKJAX_CPU_ISA=generic|avx2|avx512 (tests run every level on one machine).
#pragma once

#include <string>

namespace ikj {

enum class Isa { generic = 0, avx2 = 1, avx512 = 2 };

// Best level both compiled in and supported by this CPU, capped by IKJAX_CPU_ISA (read per call,
// so a test can switch levels in one process).
Isa current_isa();
const char* isa_name(Isa isa);
// One line for `ikjax info`: the level that runs, why (the cap, or what a higher compiled-in level
// needs that this CPU lacks) and its int8 paths, e.g.
// "avx2 (avx512 compiled in, CPU lacks avx512f, ...); int8 decode and prompt products: AVX2 (...)".
std::string isa_report();

}  // namespace ikj

#if defined(IKJ_HAVE_AVX512) && defined(IKJ_HAVE_AVX2)
#define IKJ_DISPATCH(fn)                                                          \
  (::ikj::current_isa() == ::ikj::Isa::avx512 ? &ikj_avx512::fn                   \
   : ::ikj::current_isa() == ::ikj::Isa::avx2 ? &ikj_avx2::fn : &ikj_generic::fn)
#else
#define IKJ_DISPATCH(fn) (&ikj_generic::fn)
#endif

// Declare a kernel function in every level's namespace: IKJ_DECLARE(void, qmatmul, (const float*, ...));
#define IKJ_DECLARE(ret, name, params) \
  namespace ikj_generic { ret name params; } \
  namespace ikj_avx2 { ret name params; } \
  namespace ikj_avx512 { ret name params; }
