// Instruction-set levels of the CPU kernels and the run-time choice among them.
//
// Each kernel source is compiled once per level into namespace ikj_<level> (CMakeLists.txt); an
// FFI handler calls IKJ_DISPATCH(fn)(args...) to reach the best level this CPU runs. The choice
// can be capped with IKJAX_CPU_ISA=generic|avx2|avx512|amx (tests run every level on one machine).
// The avx2 level has two builds: plain AVX2, and with AVX-VNNI (ikj_avxvnni), which runs in its place
// where the CPU has AVX-VNNI (avx_vnni_on).
// amx is the avx512 level plus AMX int8 tiles for prompt-sized int8 products (quant_matmul/cpu_amx.h);
// it needs the CPU's AMX-TILE and AMX-INT8 and the Linux kernel's permission for the tile data
// state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once, before any tile is used).
#pragma once

#include <cstdint>
#include <string>

namespace ikj {

enum class Isa { generic = 0, avx2 = 1, avx512 = 2, amx = 3 };

// Best level both compiled in and supported by this CPU, capped by IKJAX_CPU_ISA (read per call,
// so a test can switch levels in one process).
Isa current_isa();
const char* isa_name(Isa isa);
// One line for `ikjax info`: the level that runs, why (the cap, or what a higher compiled-in level
// needs that this CPU lacks) and its int8 paths, e.g.
// "avx2 (avx512 compiled in, CPU lacks avx512f, ...); int8 decode and prompt products: AVX2 (...)".
std::string isa_report();
// Why the amx level does not run here ("" where it can): "not compiled in", "cpu has no amx_int8",
// "kernel refused XTILEDATA (...)", ...
const char* amx_unavailable_reason();
// Whether the amx level multiplies prompt products in its bf16 form (quant_matmul/cpu_amx.h): the
// CPU has amx_bf16 (CPUID.(7,0):EDX bit 22) and IKJAX_AMX is not "int8" (read per call).
bool amx_bf16_on();
// Rows of x from which the amx level multiplies a prompt product on its tiles (fewer: the avx512
// engine's vpdpbusd on the same panels): IKJAX_AMX_MIN_ROWS (read per call; an integer >= 16, one A
// tile), else kAmxMinRowsDefault. Each product converts its weight panels for the tiles, which pays
// only over enough rows, and a prompt's routed experts see few rows each (512 tokens x 6 picks / 64
// experts = 48; R1 at -ub 2048: 64). With the panels built in two passes (int8, then bf16) the tiles
// lost to vpdpbusd below ~64-96 rows on a Sapphire Rapids core (RESULTS §26v); built in one pass
// (quant_matmul build_panel_bf16) they win from 32: one R1 MoE layer at 64 rows an expert 5-15 %
// faster, V2-Lite's at 48 rows level to 16 % (RESULTS §26aa, in-process alternation).
constexpr int64_t kAmxMinRowsDefault = 32;
int64_t amx_min_rows();

// Whether the avx2 level runs its AVX-VNNI build (the avxvnni objects: the same code with vpdpbusd
// on ymm, the same integers): compiled in, the CPU has AVX-VNNI (CPUID.(7,1):EAX bit 4),
// and IKJAX_AVXVNNI is not "0" (read per call).
bool avx_vnni_on();

// The function of the level that runs now (one per level, in order; avxvnni: the avx2 level's AVX-VNNI
// build, in its place where avx_vnni_on()).
template <class F>
F isa_pick(F generic, F avx2, F avxvnni, F avx512, F amx) {
  switch (current_isa()) {
    case Isa::amx: return amx;
    case Isa::avx512: return avx512;
    case Isa::avx2: return avx_vnni_on() ? avxvnni : avx2;
    default: return generic;
  }
}

}  // namespace ikj

#if defined(IKJ_HAVE_AVXVNNI)
#define IKJ_AVXVNNI_FN(fn) &ikj_avxvnni::fn
#else
#define IKJ_AVXVNNI_FN(fn) &ikj_avx2::fn
#endif
#if defined(IKJ_HAVE_AMX) && defined(IKJ_HAVE_AVX512) && defined(IKJ_HAVE_AVX2)
#define IKJ_DISPATCH(fn) (::ikj::isa_pick(&ikj_generic::fn, &ikj_avx2::fn, IKJ_AVXVNNI_FN(fn), &ikj_avx512::fn, &ikj_amx::fn))
#elif defined(IKJ_HAVE_AVX512) && defined(IKJ_HAVE_AVX2)
#define IKJ_DISPATCH(fn) (::ikj::isa_pick(&ikj_generic::fn, &ikj_avx2::fn, IKJ_AVXVNNI_FN(fn), &ikj_avx512::fn, &ikj_avx512::fn))
#else
#define IKJ_DISPATCH(fn) (&ikj_generic::fn)
#endif

// Declare a kernel function in every level's namespace: IKJ_DECLARE(void, qmatmul, (const float*, ...));
#define IKJ_DECLARE(ret, name, params) \
  namespace ikj_generic { ret name params; } \
  namespace ikj_avx2 { ret name params; } \
  namespace ikj_avxvnni { ret name params; } \
  namespace ikj_avx512 { ret name params; } \
  namespace ikj_amx { ret name params; }
