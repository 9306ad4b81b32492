// The AMX int8 prompt engine (see cpu_amx.h for its operands), compiled once per level like every
// kernel source; the tile instructions only where the level's flags have AMX (the amx level).
//
// One engine, written over a tile interface `T` (config / load / store / zero / dpbusd / release):
// - AmxHw: the AMX intrinsics (ldtilecfg, tileloadd, tilestored, tilezero, tdpbusd, tilerelease);
// - AmxEmu: an exact scalar emulation of the same instructions on thread-local tile registers,
//   which also checks what the hardware would fault on or silently get wrong (no config loaded,
//   palette not 1, a tdpbusd whose tiles' shapes disagree, a load or store past a tile's
//   configured rows / bytes). Tests run the engine on it at every level (qgemm_amx_emulated).
//
// Tiling, per panel of 32 weight rows (two B tiles: rows 0-15, 16-31) and group of 32 x rows (two
// A tiles), per block of 32 weights (K = 32: the scales are per block, so each block's int32 sums
// are scaled before the next):
//   tmm0..3  C: 16 x 16 int32 (rows x of A tile a, columns of B tile h: tmm[2 a + h])
//   tmm4, 5  A: 16 rows x 32 bytes: one block of 16 x rows (u8, q + 128), read in place from the
//            x8 pack (stride K); a last group's partial tile from a zero-padded copy of its rows
//   tmm6, 7  B: 8 rows x 64 bytes: the panel's block as stored (VNNI quads of 16 weight rows, s8)
// C tiles are zeroed, multiplied (tdpbusd: u8 x s8 -> int32, 4 products per lane), stored to an
// int32 buffer, and each row's block sum is scaled as the avx512 microkernel does:
// acc += float(c - 128 * sum(w)) * (dw * dx) (+ mw * dx * sum(q_x)). The int32 sums are the
// avx512 engine's (vpdpbusd) exactly; results differ from it by float summation order only.
// AMX state is per thread: each call configures the tiles on its thread and releases them before
// returning (the kernels run in the pool's threads, any of them).
#include "quant_matmul/cpu_amx.h"
#include "quant_matmul/cpu_kernel.h"

#include "cpu/amx_tiles.h"
#include "cpu/common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>
#endif

namespace IKJ_NS {
namespace amx {
namespace {

inline float f16(const uint8_t* p) { return ikj::fp16_to_f32(ikj::load_u16(p)); }
const int8_t kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};  // IQ4_NL's values
inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}


#if defined(IKJ_HAVE_AMX_TILES)
// gcc's tile intrinsics are macros that paste their tile numbers into the assembly text, so each
// tile number is spelled out as a literal here.
#define IKJ_TILE_SWITCH(t, OP)  \
  switch (t) {                  \
    case 0: OP(0); break;       \
    case 1: OP(1); break;       \
    case 2: OP(2); break;       \
    case 3: OP(3); break;       \
    case 4: OP(4); break;       \
    case 5: OP(5); break;       \
    case 6: OP(6); break;       \
    default: OP(7); break;      \
  }
struct AmxHw {
  static void config(const TileCfg& c) { load_tile_config(c); }
  template <int t>
  static void load(const void* p, int64_t stride) {
    static_assert(t >= 0 && t < 8, "tiles 0-7");
#define IKJ_OP(n) _tile_loadd(n, p, stride)
    IKJ_TILE_SWITCH(t, IKJ_OP)
#undef IKJ_OP
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    static_assert(t >= 0 && t < 8, "tiles 0-7");
#define IKJ_OP(n) _tile_stored(n, p, stride)
    IKJ_TILE_SWITCH(t, IKJ_OP)
#undef IKJ_OP
  }
  template <int t>
  static void zero() {
    static_assert(t >= 0 && t < 8, "tiles 0-7");
#define IKJ_OP(n) _tile_zero(n)
    IKJ_TILE_SWITCH(t, IKJ_OP)
#undef IKJ_OP
  }
  // the four products the engines use (C tile 2 a + h, A tile 4 + a, B tile 6 + h), each tile
  // number a literal (see IKJ_TILE_SWITCH)
#define IKJ_TILE_TRIPLES(INSN)                                                                          \
  static_assert((c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) || (c == 2 && a == 5 && b == 6) || \
                    (c == 3 && a == 5 && b == 7),                                                       \
                "add the tile triple here");                                                            \
  if constexpr (c == 0) INSN(0, 4, 6);                                                                  \
  else if constexpr (c == 1) INSN(1, 4, 7);                                                             \
  else if constexpr (c == 2) INSN(2, 5, 6);                                                             \
  else INSN(3, 5, 7);
  template <int c, int a, int b>
  static void dpbusd() { IKJ_TILE_TRIPLES(_tile_dpbusd) }
#if defined(IKJ_HAVE_AMX_BF16)
  template <int c, int a, int b>
  static void dpbf16ps() { IKJ_TILE_TRIPLES(_tile_dpbf16ps) }
#endif
#undef IKJ_TILE_TRIPLES
  static void release() { _tile_release(); }
};
#undef IKJ_TILE_SWITCH
#endif

// The tile instructions on 8 thread-local 1 KiB registers, as the ISA reference defines them
// (ldtilecfg zeroes every tile; a load zeroes the bytes past colsb of each row and the rows past
// rows; tdpbusd: C[m][n] += sum_k u8(A[m][4k + i]) * s8(B[k][4n + i]), int32 wrapping).
struct AmxEmu {
  struct State {
    TileCfg cfg;
    uint8_t t[8][16 * 64];
    bool configured = false;
    std::string error;  // the first misuse seen (the hardware would fault or compute garbage)
  };
  static State& st() {
    thread_local State s;
    return s;
  }
  static void fail(const std::string& what) {
    if (st().error.empty()) st().error = what;
  }
  static bool shape_ok(int t, const char* op) {
    State& s = st();
    if (!s.configured) return fail(std::string(op) + " without a tile config"), false;
    if (s.cfg.rows[t] == 0 || s.cfg.rows[t] > 16 || s.cfg.colsb[t] == 0 || s.cfg.colsb[t] > 64)
      return fail(std::string(op) + ": tile " + std::to_string(t) + " not configured"), false;
    return true;
  }
  static void config(const TileCfg& c) {
    State& s = st();
    if (c.palette != 1) return fail("palette " + std::to_string(c.palette) + ", not 1");
    for (int t = 8; t < 16; ++t)
      if (c.rows[t] || c.colsb[t]) return fail("config names tile " + std::to_string(t) + " (palette 1 has 8)");
    s.cfg = c;
    std::memset(s.t, 0, sizeof(s.t));
    s.configured = true;
  }
  template <int t>
  static void load(const void* p, int64_t stride) {
    if (!shape_ok(t, "tileloadd")) return;
    State& s = st();
    std::memset(s.t[t], 0, sizeof(s.t[t]));
    for (int r = 0; r < s.cfg.rows[t]; ++r)
      std::memcpy(s.t[t] + r * 64, static_cast<const uint8_t*>(p) + r * stride, s.cfg.colsb[t]);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    if (!shape_ok(t, "tilestored")) return;
    State& s = st();
    for (int r = 0; r < s.cfg.rows[t]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.t[t] + r * 64, s.cfg.colsb[t]);
  }
  template <int t>
  static void zero() {
    if (!shape_ok(t, "tilezero")) return;
    std::memset(st().t[t], 0, sizeof(st().t[t]));
  }
  // a product's three tiles configured and of agreeing shapes (4 bytes of A a B row: K / 4 rows of B;
  // C as many rows as A and as many bytes a row as B)
  static bool product_ok(int c, int a, int b, const char* op) {
    if (!shape_ok(c, op) || !shape_ok(a, op) || !shape_ok(b, op)) return false;
    const TileCfg& g = st().cfg;
    if (g.colsb[a] % 4 || g.colsb[c] % 4 || g.colsb[a] / 4 != g.rows[b] || g.rows[c] != g.rows[a] ||
        g.colsb[c] != g.colsb[b])
      return fail(std::string(op) + ": tile shapes disagree (C " + std::to_string(g.rows[c]) + "x" +
                  std::to_string(g.colsb[c]) + ", A " + std::to_string(g.rows[a]) + "x" + std::to_string(g.colsb[a]) +
                  ", B " + std::to_string(g.rows[b]) + "x" + std::to_string(g.colsb[b]) + ")"),
             false;
    return true;
  }
  template <int c, int a, int b>
  static void dpbusd() {
    static_assert(c != a && c != b && a != b, "tdpbusd's three tiles must differ (#UD)");
    if (!product_ok(c, a, b, "tdpbusd")) return;
    State& s = st();
    const TileCfg& g = s.cfg;
    for (int m = 0; m < g.rows[c]; ++m)
      for (int n = 0; n < g.colsb[c] / 4; ++n) {
        int32_t acc;
        std::memcpy(&acc, s.t[c] + m * 64 + 4 * n, 4);
        uint32_t sum = static_cast<uint32_t>(acc);
        for (int k = 0; k < g.colsb[a] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<uint32_t>(static_cast<int32_t>(s.t[a][m * 64 + 4 * k + i]) *
                                         static_cast<int32_t>(static_cast<int8_t>(s.t[b][k * 64 + 4 * n + i])));
        acc = static_cast<int32_t>(sum);
        std::memcpy(s.t[c] + m * 64 + 4 * n, &acc, 4);
      }
  }
  // tdpbf16ps: C[m][n] (f32) += A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1] (bf16 pairs), the
  // two products added in turn
  template <int c, int a, int b>
  static void dpbf16ps() {
    static_assert(c != a && c != b && a != b, "tdpbf16ps's three tiles must differ (#UD)");
    if (!product_ok(c, a, b, "tdpbf16ps")) return;
    State& s = st();
    const TileCfg& g = s.cfg;
    auto bf = [](const uint8_t* p) {
      uint32_t u = static_cast<uint32_t>(p[0] | (p[1] << 8)) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    };
    for (int m = 0; m < g.rows[c]; ++m)
      for (int n = 0; n < g.colsb[c] / 4; ++n) {
        float acc;
        std::memcpy(&acc, s.t[c] + m * 64 + 4 * n, 4);
        for (int k = 0; k < g.colsb[a] / 4; ++k)
          for (int i = 0; i < 2; ++i) acc += bf(s.t[a] + m * 64 + 4 * k + 2 * i) * bf(s.t[b] + k * 64 + 4 * n + 2 * i);
        std::memcpy(s.t[c] + m * 64 + 4 * n, &acc, 4);
      }
  }
  static void release() {
    State& s = st();
    if (!s.configured) fail("tilerelease without a tile config");
    s.configured = false;
    std::memset(s.t, 0, sizeof(s.t));
  }
};

// y rows [0, M), columns [0, nr) = x8 rows [0, M) x the panel's 32 columns (header comment).
template <class T>
void panel_gemm(const uint8_t* xu, int64_t M, int64_t K, const float* dx, const float* ds, const uint8_t* panel,
                int64_t nb, bool has_min, float* y, int64_t ldy, int64_t nr) {
  const int64_t qblk = has_min ? kBlkMin : kBlk;
  TileCfg cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // C: 16 x 16 int32
  for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 32;  // A: 16 x rows, one block
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 8, cfg.colsb[t] = 64;   // B: 8 quads x 16 weight rows
  T::config(cfg);
  thread_local std::vector<uint8_t> tail;  // a last partial A tile's rows, zero-padded to 16
  alignas(64) int32_t cbuf[32 * 32];
  alignas(64) float acc[32 * 32];
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t mr = std::min<int64_t>(32, M - m0);
    const int na = mr > 16 ? 2 : 1;
    const uint8_t* a0 = xu + m0 * K;
    const uint8_t* a1 = a0 + 16 * K;
    if (mr < 16 * na) {
      const int64_t full = 16 * (na - 1);  // rows of the group before the partial tile
      tail.assign(static_cast<size_t>(16 * K), 0);
      std::memcpy(tail.data(), xu + (m0 + full) * K, static_cast<size_t>((mr - full) * K));
      (na == 1 ? a0 : a1) = tail.data();
    }
    std::fill(acc, acc + mr * 32, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* pb = panel + b * qblk;
      T::template load<6>(pb, 64);
      T::template load<7>(pb + 512, 64);
      T::template zero<0>();
      T::template zero<1>();
      T::template load<4>(a0 + b * 32, K);
      T::template dpbusd<0, 4, 6>();
      T::template dpbusd<1, 4, 7>();
      T::template store<0>(cbuf, 128);
      T::template store<1>(cbuf + 16, 128);
      if (na == 2) {
        T::template zero<2>();
        T::template zero<3>();
        T::template load<5>(a1 + b * 32, K);
        T::template dpbusd<2, 5, 6>();
        T::template dpbusd<3, 5, 7>();
        T::template store<2>(cbuf + 16 * 32, 128);
        T::template store<3>(cbuf + 16 * 32 + 16, 128);
      }
      int32_t bias[32];
      float dw[32], mw[32];
      std::memcpy(bias, pb + 1024, 128);
      std::memcpy(dw, pb + 1152, 128);
      if (has_min) std::memcpy(mw, pb + 1280, 128);
      for (int64_t i = 0; i < mr; ++i) {
        const float s = dx[(m0 + i) * nb + b];
        const int32_t* c = cbuf + i * 32;
        float* a = acc + i * 32;
        for (int j = 0; j < 32; ++j) a[j] += static_cast<float>(c[j] + bias[j]) * (dw[j] * s);
        if (has_min) {
          const float t = ds[(m0 + i) * nb + b];
          for (int j = 0; j < 32; ++j) a[j] += mw[j] * t;
        }
      }
    }
    for (int64_t i = 0; i < mr; ++i) std::memcpy(y + (m0 + i) * ldy, acc + i * 32, static_cast<size_t>(nr) * 4);
  }
  T::release();
}

// The bf16 form (cpu_amx.h): y rows [0, M), columns [0, nr) = bf16 x rows (xb, row stride ldx,
// rows to bf_rows(M) readable) x the bf16 panel bp (nb blocks of two B tiles). Per group of 32 rows,
// four C tiles (2 A tiles x 2 B tiles) accumulate over every block and are stored once: straight
// into y where the group's rows and the panel's 32 columns are all there, else through cbuf.
// PF: the A tiles' rows two blocks ahead prefetched into L1. Why: x's bf16 rows are ~4 KiB apart
// (16 or 32 row streams, each 64 bytes a block), which the L1 prefetchers do not follow; the tile
// loads then wait on L2 (a one-thread loop of this shape from L2: ~1.05-1.4x faster with them on a
// Sapphire Rapids core, the B panel, just built, is in L1/L2 already; RESULTS §26ab).
template <class T, bool PF = false>
void panel_gemm_bf16(const uint16_t* xb, int64_t ldx, int64_t M, const uint16_t* bp, int64_t nb, float* y,
                     int64_t ldy, int64_t nr) {
  const TileCfg cfg = tiles_16x64();  // C 16 x 16 f32, A 16 x 32 bf16, B 16 x 16 pairs
  T::config(cfg);
  alignas(64) float cbuf[32 * 32];
  const int64_t sx = ldx * 2;
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t mr = std::min<int64_t>(32, M - m0);
    const bool two = mr > 16;
    const uint16_t* a0 = xb + m0 * ldx;
    const uint16_t* a1 = a0 + 16 * ldx;
    T::template zero<0>();
    T::template zero<1>();
    if (two) {
      T::template zero<2>();
      T::template zero<3>();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint16_t* pb = bp + b * kBfBlk;
      if constexpr (PF) {
        if (b + 2 < nb) {
          const char* p0 = reinterpret_cast<const char*>(a0 + (b + 2) * 32);
          for (int i = 0; i < 16; ++i) __builtin_prefetch(p0 + i * sx, 0, 3);
          if (two) {
            const char* p1 = reinterpret_cast<const char*>(a1 + (b + 2) * 32);
            for (int i = 0; i < 16; ++i) __builtin_prefetch(p1 + i * sx, 0, 3);
          }
        }
      }
      T::template load<6>(pb, 64);
      T::template load<7>(pb + 512, 64);
      T::template load<4>(a0 + b * 32, sx);
      T::template dpbf16ps<0, 4, 6>();
      T::template dpbf16ps<1, 4, 7>();
      if (two) {
        T::template load<5>(a1 + b * 32, sx);
        T::template dpbf16ps<2, 5, 6>();
        T::template dpbf16ps<3, 5, 7>();
      }
    }
    if (nr == 32 && mr == (two ? 32 : 16)) {
      float* yr = y + m0 * ldy;
      T::template store<0>(yr, ldy * 4);
      T::template store<1>(yr + 16, ldy * 4);
      if (two) {
        T::template store<2>(yr + 16 * ldy, ldy * 4);
        T::template store<3>(yr + 16 * ldy + 16, ldy * 4);
      }
      continue;
    }
    T::template store<0>(cbuf, 128);
    T::template store<1>(cbuf + 16, 128);
    if (two) {
      T::template store<2>(cbuf + 16 * 32, 128);
      T::template store<3>(cbuf + 16 * 32 + 16, 128);
    }
    for (int64_t i = 0; i < mr; ++i) std::memcpy(y + (m0 + i) * ldy, cbuf + i * 32, static_cast<size_t>(nr) * 4);
  }
  T::release();
}

// ---- the portable panel builder: one block of a row -> 32 signed values, dw, mw ----------------

// 6-bit scale and minimum j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Block b (of 32 weights) of a row: its values v (the dequantized value = dw * v + mw, exactly).
// A template on the type so that the panel builder's per-block work has no type switch.
template <int type>
inline bool block_values(const uint8_t* row, int64_t b, int8_t v[32], float& dw, float& mw) {
  mw = 0.f;
  switch (type) {
    case ikj::T_Q8_0: {
      const uint8_t* p = row + b * 34;
      dw = f16(p);
      std::memcpy(v, p + 2, 32);
      return true;
    }
    case ikj::T_Q4_0:
    case ikj::T_Q4_1:
    case ikj::T_IQ4_NL: {
      const int bs = type == ikj::T_Q4_1 ? 20 : 18;
      const uint8_t* p = row + b * bs;
      const uint8_t* qs = p + (type == ikj::T_Q4_1 ? 4 : 2);
      dw = f16(p);
      if (type == ikj::T_Q4_1) mw = f16(p + 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = qs[j] & 0xF, hi = qs[j] >> 4;
        if (type == ikj::T_IQ4_NL) v[j] = kIq4nl[lo], v[j + 16] = kIq4nl[hi];
        else if (type == ikj::T_Q4_0) v[j] = static_cast<int8_t>(lo - 8), v[j + 16] = static_cast<int8_t>(hi - 8);
        else v[j] = static_cast<int8_t>(lo), v[j + 16] = static_cast<int8_t>(hi);
      }
      return true;
    }
    case ikj::T_Q5_0:
    case ikj::T_Q5_1: {
      const bool one = type == ikj::T_Q5_1;
      const uint8_t* p = row + b * (one ? 24 : 22);
      dw = f16(p);
      if (one) mw = f16(p + 2);
      const uint32_t qh = u32(p + (one ? 4 : 2));
      const uint8_t* qs = p + (one ? 8 : 6);
      const int off = one ? 0 : 16;
      for (int j = 0; j < 16; ++j) {
        v[j] = static_cast<int8_t>(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - off);
        v[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
      }
      return true;
    }
    case ikj::T_Q4_K:
    case ikj::T_Q5_K: {  // sub-block s = b % 8 of super-block b / 8: codes 0..15 (0..31), d * sc, -dmin * m
      const bool five = type == ikj::T_Q5_K;
      const uint8_t* p = row + (b / 8) * (five ? 176 : 144);
      const int s = static_cast<int>(b % 8);
      int sc, m;
      scale_min_k4(s, p + 4, sc, m);
      dw = f16(p) * static_cast<float>(sc);
      mw = -f16(p + 2) * static_cast<float>(m);
      const uint8_t* qs = p + (five ? 48 : 16) + 32 * (s / 2);  // 32 bytes: sub-blocks 2j (low), 2j + 1 (high)
      for (int l = 0; l < 32; ++l) {
        int q = (s & 1) ? qs[l] >> 4 : qs[l] & 0xF;
        if (five) q |= ((p[16 + l] >> s) & 1) << 4;  // qh: bit s of byte l
        v[l] = static_cast<int8_t>(q);
      }
      return true;
    }
    case ikj::T_IQ4_XS: {  // sub-block s as an IQ4_NL block with d * (ls - 32)
      const uint8_t* p = row + (b / 8) * 136;
      const int s = static_cast<int>(b % 8);
      const int ls = ((p[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((ikj::load_u16(p + 2) >> (2 * s)) & 3) << 4);
      dw = f16(p) * static_cast<float>(ls - 32);
      const uint8_t* qs = p + 8 + 16 * s;
      for (int j = 0; j < 16; ++j) v[j] = kIq4nl[qs[j] & 0xF], v[j + 16] = kIq4nl[qs[j] >> 4];
      return true;
    }
    default:
      return false;
  }
}

}  // namespace

bool type_ok(int type) {
  switch (type) {
    case ikj::T_Q8_0: case ikj::T_Q4_0: case ikj::T_Q4_1: case ikj::T_Q5_0: case ikj::T_Q5_1: case ikj::T_IQ4_NL:
    case ikj::T_Q4_K: case ikj::T_Q5_K: case ikj::T_IQ4_XS:
      return true;
    default:
      return false;
  }
}

bool type_has_min(int type) {  // (cpu_amx.h)
  return type == ikj::T_Q4_1 || type == ikj::T_Q5_1 || type == ikj::T_Q4_K || type == ikj::T_Q5_K;
}

namespace {
template <int type>
void build_panel_t(const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb, uint8_t* panel) {
  const int64_t qblk = type_has_min(type) ? kBlkMin : kBlk;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* pb = panel + b * qblk;
    for (int r = 0; r < kPanelRows; ++r) {
      int8_t v[32] = {};
      float dw = 0.f, mw = 0.f;
      if (r < nr) block_values<type>(w + (p0 + r) * row_bytes, b, v, dw, mw);
      int32_t sum = 0;
      for (int c = 0; c < 8; ++c)  // quad c of row r: B tile (r / 16), row c, bytes 4 (r % 16) ..
        std::memcpy(pb + (r / 16) * 512 + c * 64 + (r % 16) * 4, v + 4 * c, 4);
      for (int k = 0; k < 32; ++k) sum += v[k];
      const int32_t bias = -128 * sum;
      std::memcpy(pb + 1024 + r * 4, &bias, 4);
      std::memcpy(pb + 1152 + r * 4, &dw, 4);
      if (qblk == kBlkMin) std::memcpy(pb + 1280 + r * 4, &mw, 4);
    }
  }
}
}  // namespace

bool build_panel(int type, const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb, uint8_t* panel) {
  switch (type) {
#define IKJ_CASE(T) case ikj::T: build_panel_t<ikj::T>(w, row_bytes, p0, nr, nb, panel); return true;
    IKJ_CASE(T_Q8_0) IKJ_CASE(T_Q4_0) IKJ_CASE(T_Q4_1) IKJ_CASE(T_Q5_0) IKJ_CASE(T_Q5_1) IKJ_CASE(T_IQ4_NL)
    IKJ_CASE(T_Q4_K) IKJ_CASE(T_Q5_K) IKJ_CASE(T_IQ4_XS)
#undef IKJ_CASE
    default: return false;
  }
}

int64_t x8_dx_offset(int64_t M, int64_t K) { return (M * K + 63) / 64 * 64; }
int64_t x8_ds_offset(int64_t M, int64_t K) { return x8_dx_offset(M, K) + M * (K / 32) * 4; }
int64_t x8_bytes(int64_t M, int64_t K) { return x8_ds_offset(M, K) + M * (K / 32) * 4; }

void pack_x8(const float* x, int64_t M, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32;
  float* dx = reinterpret_cast<float*>(out + x8_dx_offset(M, K));
  float* ds = reinterpret_cast<float*>(out + x8_ds_offset(M, K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.f;
      bool nan = false;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xb[k])), nan |= std::isnan(xb[k]);
      const float id = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sq = 0;
      for (int k = 0; k < 32; ++k) {
        const int32_t q = nan ? 0 : static_cast<int32_t>(std::nearbyint(xb[k] * id));  // nearest even
        sq += q;
        out[m * K + b * 32 + k] = static_cast<uint8_t>(q + 128);
      }
      dx[m * nb + b] = nan || std::isinf(amax) ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
      ds[m * nb + b] = dx[m * nb + b] * static_cast<float>(sq);
    }
}

void panel_to_bf16(const uint8_t* panel, int64_t nb, bool has_min, uint16_t* out) {
  const int64_t qblk = has_min ? kBlkMin : kBlk;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * qblk;
    uint16_t* ob = out + b * kBfBlk;
    float dw[32], mw[32] = {};
    std::memcpy(dw, pb + 1152, 128);
    if (has_min) std::memcpy(mw, pb + 1280, 128);
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 8; ++c)      // quad c: k = 4c .. 4c + 3
        for (int nn = 0; nn < 16; ++nn)
          for (int i = 0; i < 4; ++i) {
            const int n = 16 * h + nn;
            const float v = static_cast<float>(static_cast<int8_t>(pb[h * 512 + c * 64 + nn * 4 + i]));
            ob[h * 512 + (2 * c + i / 2) * 32 + nn * 2 + (i & 1)] = ikj::f32_to_bf16(std::fma(v, dw[n], mw[n]));
          }
  }
}

void x_to_bf16(const float* x, int64_t M, int64_t K, uint16_t* out) {
  const int64_t ld = bf_ld(K);
  for (int64_t m = 0; m < bf_rows(M); ++m)
    for (int64_t k = 0; k < ld; ++k) out[m * ld + k] = m < M && k < K ? ikj::f32_to_bf16(x[m * K + k]) : 0;
}

#if defined(IKJ_HAVE_AMX_BF16)
void panel_to_bf16_hw(const uint8_t* panel, int64_t nb, bool has_min, uint16_t* out) {
  const int64_t qblk = has_min ? kBlkMin : kBlk;
  // even / odd dwords of two vectors (16 + j: element j of the second); lane i of quarter j: column 4j + i / 4
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
  const __m512i q0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512i is[4];
  for (int j = 0; j < 4; ++j) is[j] = _mm512_add_epi32(q0, _mm512_set1_epi32(4 * j));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * qblk;
    uint16_t* ob = out + b * kBfBlk;
    for (int h = 0; h < 2; ++h) {
      const __m512 dw = _mm512_loadu_ps(pb + 1152 + 64 * h);
      const __m512 mw = has_min ? _mm512_loadu_ps(pb + 1280 + 64 * h) : _mm512_setzero_ps();
      __m512 dx[4], mx[4];
      for (int j = 0; j < 4; ++j) dx[j] = _mm512_permutexvar_ps(is[j], dw), mx[j] = _mm512_permutexvar_ps(is[j], mw);
      for (int c = 0; c < 8; ++c) {
        const uint8_t* q = pb + h * 512 + c * 64;
        __m512 f[4];
        for (int j = 0; j < 4; ++j)
          f[j] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j)))),
              dx[j], mx[j]);
        // dword i of lo: elements 2i, 2i + 1 of [f0, f1] (columns 0-7, k pairs (4c, 4c+1), (4c+2, 4c+3) in turn)
        const __m512i lo = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[1], f[0]));
        const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f[3], f[2]));
        _mm512_storeu_si512(ob + h * 512 + (2 * c) * 32, _mm512_permutex2var_epi32(lo, ie, hi));
        _mm512_storeu_si512(ob + h * 512 + (2 * c + 1) * 32, _mm512_permutex2var_epi32(lo, io, hi));
      }
    }
  }
}

void panel_gemm_bf16_hw(const uint16_t* xb, int64_t ldx, int64_t M, const uint16_t* bp, int64_t nb, float* y,
                        int64_t ldy, int64_t nr, bool prefetch) {
  if (prefetch) panel_gemm_bf16<AmxHw, true>(xb, ldx, M, bp, nb, y, ldy, nr);
  else panel_gemm_bf16<AmxHw, false>(xb, ldx, M, bp, nb, y, ldy, nr);
}
#endif

#if defined(IKJ_HAVE_AMX_TILES)
void panel_gemm_hw(const uint8_t* xu, int64_t M, int64_t K, const float* dx, const float* ds, const uint8_t* panel,
                   int64_t nb, bool has_min, float* y, int64_t ldy, int64_t nr) {
  panel_gemm<AmxHw>(xu, M, K, dx, ds, panel, nb, has_min, y, ldy, nr);
}
#endif

}  // namespace amx

std::string qgemm_amx_emulated(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int type,
                               int64_t N, float* y, bool bf16) {
  if (!amx::type_ok(type)) return "type " + std::to_string(type) + " is not an AMX engine type";
  if (M <= 0 || N <= 0 || K <= 0 || K % 32 || ((type == ikj::T_Q4_K || type == ikj::T_Q5_K || type == ikj::T_IQ4_XS) && K % 256))
    return "bad shape";
  const int64_t nb = K / 32;
  std::vector<uint8_t> xp(static_cast<size_t>(amx::x8_bytes(M, K)));
  amx::pack_x8(x, M, K, xp.data());
  const float* dx = reinterpret_cast<const float*>(xp.data() + amx::x8_dx_offset(M, K));
  const float* ds = reinterpret_cast<const float*>(xp.data() + amx::x8_ds_offset(M, K));
  const bool has_min = amx::type_has_min(type);
  std::vector<uint8_t> panel(static_cast<size_t>(nb * amx::kBlkMin));
  std::vector<uint16_t> xb, bp;
  if (bf16) {
    xb.resize(static_cast<size_t>(amx::bf_rows(M) * amx::bf_ld(K)));
    amx::x_to_bf16(x, M, K, xb.data());
    bp.resize(static_cast<size_t>(nb * amx::kBfBlk));
  }
  amx::AmxEmu::st().error.clear();
  for (int64_t p0 = 0; p0 < N; p0 += amx::kPanelRows) {
    const int64_t nr = std::min<int64_t>(amx::kPanelRows, N - p0);
    amx::build_panel(type, w, row_bytes, p0, nr, nb, panel.data());
    if (bf16) {
      amx::panel_to_bf16(panel.data(), nb, has_min, bp.data());
      amx::panel_gemm_bf16<amx::AmxEmu>(xb.data(), amx::bf_ld(K), M, bp.data(), nb, y + p0, N, nr);
    } else {
      amx::panel_gemm<amx::AmxEmu>(xp.data(), M, K, dx, ds, panel.data(), nb, has_min, y + p0, N, nr);
    }
    if (!amx::AmxEmu::st().error.empty()) return "emulated AMX: " + amx::AmxEmu::st().error;
    if (amx::AmxEmu::st().configured) return "emulated AMX: tiles not released";
  }
  return "";
}

}  // namespace IKJ_NS
