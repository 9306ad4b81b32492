// Absorbed-MLA flash attention on the latent cache, CPU (see cpu_kernel.h for the contract).
// Compiled once per instruction-set level (namespace IKJ_NS); see pallas_kernels/CMakeLists.txt.
//
// Why this shape: every head (and every query token of a prompt tile) reads the same cache row, so
// the work per key is R·(D + v_dim) FMAs for R query rows against D values loaded once — at R = 16
// (V2-Lite) already ~30 flop per cache byte, far above what memory feeds: the op is compute-bound
// on a CPU and is written as two register-blocked micro-GEMMs per block of Bk keys:
//   scores  St[j, r] = Σ_d K[j, d] · Qt[d, r]       (K block converted to f32 once; Qt = tile's qᵀ)
//   values  acc[r, :] = acc[r, :] · corr[r] + Σ_j P[j, r] · K[j, :v_dim]
// with the online-softmax update between them vectorized over the query rows r. A work item is
// (batch, query tile, key range); key ranges are split when items are fewer than the work needs
// to keep every thread busy (decode), and the last finisher of a split group merges the partial
// (m, l, acc) into the output. Only keys below the tile's highest position + 1 are read, so the
// cost follows the real KV length, not the cache bucket S.
//
// With keys and values of their own (per head: the -mla 0/2/3 prompt steps' decompressed K/V) the
// same micro-GEMMs run per (batch, head, query tile): V comes from its own rows, and a tile holds
// only that head's tokens.
#include "mla_decode/cpu_kernel.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu/amx_tiles.h"
#include "cpu/common.h"
#include "cpu/isa.h"
#include "cpu/runtime.h"
#include "cpu/transpose.h"
#include "cpu/vmath.h"

namespace IKJ_NS {
namespace {

// ---- SIMD layer: L float lanes, and the register-block sizes that fit the register file ----------
#if defined(__AVX512F__)
constexpr int L = 16;
constexpr int RJ = 8, NV1 = 3;  // scores: 8 keys x 3 vectors of query rows (24 acc + 3 loads)
constexpr int RH = 4, NV2 = 4;  // values: 4 query rows x 4 vectors of v columns (16 acc)
constexpr int NV2H = NV2;       // the same for per-head values
using V = __m512;
inline V vld(const float* p) { return _mm512_loadu_ps(p); }
inline void vst(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V vbc(float x) { return _mm512_set1_ps(x); }
inline V vzero() { return _mm512_setzero_ps(); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
#elif defined(__AVX2__)
constexpr int L = 8;
constexpr int RJ = 4, NV1 = 3;  // 12 acc + 3 loads + 1 broadcast = 16 ymm
constexpr int RH = 4, NV2 = 2;
// per-head values (the prompt's 128-wide V): 12 acc + 3 loads + 1 broadcast, 8 % faster than 2 at
// V2-Lite's prompt; the latent cache's 512-wide values stay at 2 (3 measured slower in decode)
constexpr int NV2H = 3;
using V = __m256;
inline V vld(const float* p) { return _mm256_loadu_ps(p); }
inline void vst(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vbc(float x) { return _mm256_set1_ps(x); }
inline V vzero() { return _mm256_setzero_ps(); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
#else
// Portable level: GCC/Clang vector extensions (SSE2 on x86-64, NEON on Arm), libm exp.
constexpr int L = 4;
constexpr int RJ = 4, NV1 = 2;
constexpr int RH = 4, NV2 = 2;
constexpr int NV2H = NV2;
typedef float V __attribute__((vector_size(16)));
inline V vld(const float* p) { V x; std::memcpy(&x, p, sizeof(V)); return x; }
inline void vst(float* p, V x) { std::memcpy(p, &x, sizeof(V)); }
inline V vbc(float x) { return V{x, x, x, x}; }
inline V vzero() { return V{0.f, 0.f, 0.f, 0.f}; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline V vmul(V a, V b) { return a * b; }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmax(V a, V b) { V r; for (int i = 0; i < L; ++i) r[i] = a[i] > b[i] ? a[i] : b[i]; return r; }
inline V vexp(V x) { V r; for (int i = 0; i < L; ++i) r[i] = std::exp(x[i]); return r; }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
// exp: cpu/vmath.h (exact 0 below -87.3: masked keys, -inf; NaN stays NaN)
inline V vexp(V x) { return ikj_exp(x); }
#endif

constexpr int BK = 64;                    // keys per block (a multiple of RJ)
constexpr int ROW_TARGET = 96;            // query rows (tokens x heads) per prompt tile, at least H
// query rows (tokens) per prompt tile of one head (per-head K/V): a tile reads keys up to its last
// token, so the keys above the diagonal are work thrown away; 48 rows waste ~10 % of a 512-token
// causal prompt, 96 rows ~43 %; fewer rows re-read each key more often (a key is loaded once a
// tile). AVX2: 64 rows, 4 % faster than 48 at N_KV 512 and level at 0 (32: 9 % slower at 512,
// RESULTS §26r); AVX-512 keeps 48, three vectors of 16 rows
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int HEAD_ROW_TARGET = 64;
#else
constexpr int HEAD_ROW_TARGET = 48;
#endif
constexpr float M_INIT = -1e30f;          // finite: a row with no visible key yet keeps corr = 1
static_assert(BK % RJ == 0, "BK must be a multiple of RJ");
static_assert(16 % L == 0, "rows/columns are padded to 16");

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- cache rows -> f32 -------------------------------------------------------------------------

// Convert values [0, n) of row `row` of `base` (rows of `width` values of `kind`) into dst (n <=
// width; q8_0, the latent cache only, writes whole 32-blocks, so dst must have room for
// round_up(n, 32)).
void load_vals(const ikj::MlaArgs& a, int kind, const void* base, int64_t row, int64_t width, int64_t n, float* dst) {
  switch (kind) {
    case ikj::MLA_F32:
      std::memcpy(dst, static_cast<const float*>(base) + row * width, n * sizeof(float));
      return;
    case ikj::MLA_F16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + row * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__AVX2__)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
      for (; i < n; ++i) dst[i] = ikj::fp16_to_f32(src[i]);
      return;
    }
    case ikj::MLA_BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + row * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      }
#elif defined(__AVX2__)
      for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
#endif
      for (; i < n; ++i) dst[i] = ikj::bf16_to_f32(src[i]);
      return;
    }
    default: {  // q8_0
      const int64_t nb = width / 32, nblk = (n + 31) / 32;
      const int8_t* qs = static_cast<const int8_t*>(base) + row * width;
      for (int64_t k = 0; k < nblk; ++k) {
        float d = kind == ikj::MLA_Q8_0_F16D
                      ? ikj::fp16_to_f32(static_cast<const uint16_t*>(a.scales)[row * nb + k])
                      : static_cast<const float*>(a.scales)[row * nb + k];
        const int8_t* q = qs + k * 32;
        float* o = dst + k * 32;
#if defined(__AVX512F__)
        __m512 dv = _mm512_set1_ps(d);
        for (int i = 0; i < 32; i += 16)
          _mm512_storeu_ps(o + i, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))))));
#elif defined(__AVX2__)
        __m256 dv = _mm256_set1_ps(d);
        for (int i = 0; i < 32; i += 8)
          _mm256_storeu_ps(o + i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))))));
#else
        for (int i = 0; i < 32; ++i) o[i] = d * static_cast<float>(q[i]);
#endif
      }
      return;
    }
  }
}

using ikj::round_bf16;

// p[0, n) rounded to bf16 in place (kept as f32), as round_bf16 each, 8 or 16 at a time: the f32
// path with bf16 inputs rounds every key, value and p it loads (~25 % of a prompt tile's time
// when this ran one value at a time, AVX2 -t 1, RESULTS §26r).
inline void round_bf16_n(float* p, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), hi = _mm512_set1_epi32(-65536);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x400000);
    for (; i + 16 <= n; i += 16) {
      const __m512i u = _mm512_loadu_si512(p + i);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), hi);
      const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absm), inf);
      _mm512_storeu_si512(p + i, _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_and_si512(u, hi), quiet)));
    }
  }
#elif defined(__AVX2__)
  {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), hi = _mm256_set1_epi32(-65536);
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x400000);
    for (; i + 8 <= n; i += 8) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, bias), lsb), hi);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i),
                          _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_and_si256(u, hi), quiet), nan));
    }
  }
#endif
  for (; i < n; ++i) p[i] = round_bf16(p[i]);
}

// q, K and V at bf16 (bf16 queries): K and V rounded where stored wider, p before p·V.
inline bool bf16_inputs(const ikj::MlaArgs& a) { return a.q16 && a.v; }

// Key (b, s) of head h as f32 into dst: K's row, or its first D1 values and k2's rope part.
void load_key(const ikj::MlaArgs& a, int64_t b, int64_t s, int64_t h, float* dst) {
  const int64_t n1 = a.k2 ? a.D1 : a.D;
  load_vals(a, a.kind, a.cache, (b * a.S + s) * a.Hk + h, a.W, n1, dst);
  if (a.k2) load_vals(a, a.kind2, a.k2, b * a.S + s, a.W2, a.D - n1, dst + n1);
  if (!bf16_inputs(a)) return;  // rounded where stored wider (bf16 rows are exact already)
  if (a.kind != ikj::MLA_BF16) round_bf16_n(dst, n1);
  if (a.k2 && a.kind2 != ikj::MLA_BF16) round_bf16_n(dst + n1, a.D - n1);
}

// Value (b, s) of head h (its own rows, of K's kind) as f32 into dst.
void load_value(const ikj::MlaArgs& a, int64_t b, int64_t s, int64_t h, float* dst) {
  load_vals(a, a.kind, a.v, (b * a.S + s) * a.Hk + h, a.Wv, a.v_dim, dst);
  if (bf16_inputs(a) && a.kind != ikj::MLA_BF16) round_bf16_n(dst, a.v_dim);
}

// ---- micro-kernels -----------------------------------------------------------------------------

// St[j, r0 .. r0 + NV·L) (+)= Σ_{d0<=d<d1} Kb[j, d] · Qt[d, r0 ..] for the NJ keys j0 .. j0 + NJ;
// `add`: accumulate onto St (a later slice of d).
template <int NJ, int NV>
inline void scores_tile(const float* Kb, int64_t Dp, const float* Qt, int64_t Rp, int64_t d0, int64_t d1,
                        float* St, int64_t j0, int64_t r0, bool add) {
  V acc[NJ][NV];
  for (int j = 0; j < NJ; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = add ? vld(St + (j0 + j) * Rp + r0 + v * L) : vzero();
  const float* k = Kb + j0 * Dp;
  const float* qt = Qt + r0;
  for (int64_t d = d0; d < d1; ++d) {
    V qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = vld(qt + d * Rp + v * L);
    for (int j = 0; j < NJ; ++j) {
      V kv = vbc(k[j * Dp + d]);
      for (int v = 0; v < NV; ++v) acc[j][v] = vfma(kv, qv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NJ; ++j)
    for (int v = 0; v < NV; ++v) vst(St + (j0 + j) * Rp + r0 + v * L, acc[j][v]);
}

// Scores of keys [0, nj) (nj a multiple of RJ) against all Rp query rows. The query dimension is
// taken in slices of DC: a slice of Qt's row chunk (DC x NV1·L floats, 12 KiB) stays in L1 while
// every key block passes it; whole (D = 192..576) it is 36-108 KiB and each key group re-read it
// from L2 (measured: 56-85 GFLOP/s before the slicing, RESULTS §9h). A single vector of rows
// (decode at 16 heads) takes 2·RJ keys at a time where nj allows: enough independent FMA chains
// to cover the FMA latency.
constexpr int64_t DC = 64;
void scores(const float* Kb, int64_t Dp, const float* Qt, int64_t Rp, int64_t D, float* St, int64_t nj) {
  const int64_t nvec = Rp / L;
  for (int64_t d0 = 0; d0 < D; d0 += DC) {
    const int64_t d1 = std::min(D, d0 + DC);
    const bool add = d0 > 0;
    for (int64_t c = 0; c < nvec; c += NV1) {
      const int64_t nv = std::min<int64_t>(NV1, nvec - c);
      int64_t j0 = 0;
      if (nv == 1)
        for (; j0 + 2 * RJ <= nj; j0 += 2 * RJ) scores_tile<2 * RJ, 1>(Kb, Dp, Qt, Rp, d0, d1, St, j0, c * L, add);
      for (; j0 < nj; j0 += RJ) {
        switch (nv) {
          case 1: scores_tile<RJ, 1>(Kb, Dp, Qt, Rp, d0, d1, St, j0, c * L, add); break;
          case 2: scores_tile<RJ, 2>(Kb, Dp, Qt, Rp, d0, d1, St, j0, c * L, add); break;
          default: scores_tile<RJ, NV1>(Kb, Dp, Qt, Rp, d0, d1, St, j0, c * L, add); break;
        }
      }
    }
  }
}

// acc[r, c0 .. c0 + NV·L) = acc[r, ..] · corr[r] + Σ_{j<nj} P[j, r] · Kb[j, c0 ..] for RH rows from r0.
template <int NV>
inline void values_tile(const float* Kb, int64_t Dp, const float* P, int64_t Rp, const float* corr, float* acc,
                        int64_t Vp, int64_t nj, int64_t r0, int64_t c0) {
  V a[RH][NV];
  for (int h = 0; h < RH; ++h) {
    V cr = vbc(corr[r0 + h]);
    for (int v = 0; v < NV; ++v) a[h][v] = vmul(vld(acc + (r0 + h) * Vp + c0 + v * L), cr);
  }
  for (int64_t j = 0; j < nj; ++j) {
    V kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = vld(Kb + j * Dp + c0 + v * L);
    const float* p = P + j * Rp + r0;
    for (int h = 0; h < RH; ++h) {
      V pv = vbc(p[h]);
      for (int v = 0; v < NV; ++v) a[h][v] = vfma(pv, kv[v], a[h][v]);
    }
  }
  for (int h = 0; h < RH; ++h)
    for (int v = 0; v < NV; ++v) vst(acc + (r0 + h) * Vp + c0 + v * L, a[h][v]);
}

template <int NVM>  // vectors of v columns a tile, at most (NV2, or NV2H for per-head values)
void values(const float* Kb, int64_t Dp, const float* P, int64_t Rp, const float* corr, float* acc, int64_t Vp,
            int64_t nj) {
  const int64_t nvec = Vp / L;
  for (int64_t c = 0; c < nvec; c += NVM) {  // column chunk outside: its Kb slice stays in L1
    const int64_t nv = std::min<int64_t>(NVM, nvec - c);
    for (int64_t r0 = 0; r0 < Rp; r0 += RH) {
      switch (nv) {
        case 1: values_tile<1>(Kb, Dp, P, Rp, corr, acc, Vp, nj, r0, c * L); break;
        case 2: values_tile<2>(Kb, Dp, P, Rp, corr, acc, Vp, nj, r0, c * L); break;
        case 3: values_tile<(NVM >= 3 ? 3 : NVM)>(Kb, Dp, P, Rp, corr, acc, Vp, nj, r0, c * L); break;
        default: values_tile<NVM>(Kb, Dp, P, Rp, corr, acc, Vp, nj, r0, c * L); break;
      }
    }
  }
}

// scale·(q·k) for the nj keys of a block (before the causal mask: a masked score is -inf whatever
// the scale's sign, as in the reference, where -inf·0 would be NaN and -inf·(-x) +inf).
void scale_block(float* St, int64_t Rp, int64_t nj, float scale) {
  const V sc = vbc(scale);
  for (int64_t i = 0; i < nj * Rp; i += L) vst(St + i, vmul(vld(St + i), sc));
}

// Online softmax over the nj keys of a block, vectorized over the query rows: St (scaled scores,
// -inf where masked) becomes P = exp(s - m_new); m, l updated, corr = exp(m_old - m_new).
void softmax_block(float* St, int64_t Rp, int64_t nj, float* m, float* l, float* corr) {
  for (int64_t r = 0; r < Rp; r += L) {
    V mo = vld(m + r), mx = mo;
    for (int64_t j = 0; j < nj; ++j) mx = vmax(mx, vld(St + j * Rp + r));
    V sum = vzero();
    for (int64_t j = 0; j < nj; ++j) {
      V p = vexp(vsub(vld(St + j * Rp + r), mx));
      vst(St + j * Rp + r, p);
      sum = vadd(sum, p);
    }
    V cr = vexp(vsub(mo, mx));
    vst(corr + r, cr);
    vst(l + r, vfma(vld(l + r), cr, sum));
    vst(m + r, mx);
  }
}

// ---- work decomposition ------------------------------------------------------------------------

struct Item {
  int64_t b, h, t0, t1;  // batch, head (per-head K/V; 0 for a latent cache), query tokens [t0, t1)
  int64_t k0, k1;      // keys [k0, k1)
  int64_t group;       // index of the (b, tile) group; -1: the group is not split (write out directly)
  int64_t slot;        // partial-result slot when split
};

struct Group {
  int64_t b, h, t0, t1, n_split, slot0;
};

struct Scratch {
  std::vector<float> qt, kb, vb, st, m, l, corr, acc;
  std::vector<int32_t> pos;
  std::vector<uint16_t> kb16;           // bf16 products: the key block's rows
  std::vector<uint32_t> qp, vp, pp;     // bf16 pairs: q over d, V and p over keys
};

template <class T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

struct Plan {
  int64_t hq;  // query rows per token of a tile: H with a latent cache (every head reads its rows), 1 per head
  int64_t tq, Rp, Vp, Dp;
  // the amx level's per-head keys and values converted once a call (keys_to_tiles): K's bf16 rows
  // [B][H][spad][D] and V's pairs over keys [B][H][spad / 2][Vp], zero past each sequence's last
  // visible key; null where the items convert their own blocks
  const uint16_t* kpre = nullptr;
  const uint32_t* vpre = nullptr;
  int64_t spad = 0;
  // the f32 loop's (avx2, generic) per-head keys and values the same way (keys_to_rows): K's rows
  // [B][H][spad][Dp] and V's [B][H][spad][Vp] as load_key / load_value give them
  const float* kpre32 = nullptr;
  const float* vpre32 = nullptr;
};

// The query row r of the tile starting at token t0 (rows are token-major, then head): its token
// and its head.
inline int64_t row_token(const Plan& pl, int64_t t0, int64_t r) { return t0 + r / pl.hq; }
inline int64_t row_head(const Plan& pl, int64_t h, int64_t r) { return pl.hq == 1 ? h : r % pl.hq; }

// A work item's per-row state in the thread's scratch: scores of a key block, running max and
// sum, the rescale factors, the accumulator and the rows' positions.
struct TileState {
  float *st, *m, *l, *corr, *acc;
  int32_t* pos;
};
inline TileState tile_state(Scratch& s, const Plan& pl) {
  return {grow(s.st, BK * pl.Rp), grow(s.m, pl.Rp), grow(s.l, pl.Rp), grow(s.corr, pl.Rp),
          grow(s.acc, pl.Rp * pl.Vp), grow(s.pos, pl.Rp)};
}

// The tile's rows before its first key block: positions (INT32_MAX for the padding rows), the
// running max and sum, a zero accumulator; returns the lowest position.
int32_t start_rows(const ikj::MlaArgs& a, const Plan& pl, const Item& it, int64_t Rt, int32_t* pos, float* m,
                   float* l, float* acc) {
  int32_t min_pos = INT32_MAX;
  for (int64_t r = 0; r < pl.Rp; ++r) {
    pos[r] = r < Rt ? a.q_pos[it.b * a.T + row_token(pl, it.t0, r)] : INT32_MAX;
    min_pos = std::min(min_pos, pos[r]);
    m[r] = M_INIT;
    l[r] = 0.f;
  }
  std::fill(acc, acc + pl.Rp * pl.Vp, 0.f);
  return min_pos;
}

// -inf for the scores of keys j0 + j past a row's position, where the causal edge crosses the block.
void mask_block(float* st, int64_t Rp, int64_t Rt, int64_t j0, int64_t nv, const int32_t* pos, int32_t min_pos) {
  if (j0 + nv - 1 <= min_pos) return;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nv; ++j)
    for (int64_t r = 0; r < Rt; ++r)
      if (j0 + j > pos[r]) st[j * Rp + r] = ninf;
}


// f(b, h, j0, nv) for every block of BK keys of every (sequence b, head h) up to spad, on the
// pool's threads (nv: the block's keys below ends[b], possibly 0): the walk of the per-call key
// conversions (keys_to_tiles, keys_to_rows).
template <class F>
void for_key_blocks(int64_t B, int64_t H, int64_t spad, const std::vector<int64_t>& ends, int nth, F&& f) {
  const int64_t nblk = spad / BK, n_units = B * H * nblk;
  std::atomic<int64_t> next{0};
  ikj::parallel(static_cast<int>(std::min<int64_t>(nth, n_units)), [&](int, int) {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < n_units;) {
      const int64_t b = u / (H * nblk), h = (u / nblk) % H, j0 = (u % nblk) * BK;
      f(b, h, j0, std::max<int64_t>(0, std::min<int64_t>(BK, ends[b] - j0)));
    }
  });
}

#if defined(__AVX512BF16__)
// ---- bf16 products: pairs of bf16 through vdpbf16ps, twice the f32 FMA's multiply-adds ----------
// Scores: Qp holds q as pairs over d ([D/2][Rp] u32: q[r, 2p] | q[r, 2p+1] << 16), each key's pair
// is broadcast. Values: Vk holds V as pairs over keys ([nj/2][Vp]: V[2p, c] | V[2p+1, c] << 16),
// Pp p likewise ([nj/2][Rp]).
template <int NJ, int NV>
inline void scores_tile_bf16(const uint16_t* Kb, int64_t D, const uint32_t* Qp, int64_t Rp, int64_t p0, int64_t p1,
                             float* St, int64_t j0, int64_t r0, bool add) {
  __m512 acc[NJ][NV];
  for (int j = 0; j < NJ; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = add ? _mm512_loadu_ps(St + (j0 + j) * Rp + r0 + v * 16) : _mm512_setzero_ps();
  const uint16_t* k = Kb + j0 * D;
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(Qp + p * Rp + r0 + v * 16);
    for (int j = 0; j < NJ; ++j) {
      uint32_t kp;
      std::memcpy(&kp, k + j * D + 2 * p, 4);
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(kp));
      for (int v = 0; v < NV; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], kv, qv[v]);
    }
  }
  for (int j = 0; j < NJ; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(St + (j0 + j) * Rp + r0 + v * 16, acc[j][v]);
}

void scores_bf16(const uint16_t* Kb, int64_t D, const uint32_t* Qp, int64_t Rp, float* St, int64_t nj) {
  const int64_t nvec = Rp / 16, n_pairs = D / 2;
  for (int64_t p0 = 0; p0 < n_pairs; p0 += DC / 2) {  // a slice of Qp stays in L1, as in `scores`
    const int64_t p1 = std::min(n_pairs, p0 + DC / 2);
    for (int64_t c = 0; c < nvec; c += NV1) {
      const int64_t nv = std::min<int64_t>(NV1, nvec - c);
      for (int64_t j0 = 0; j0 < nj; j0 += RJ) {
        switch (nv) {
          case 1: scores_tile_bf16<RJ, 1>(Kb, D, Qp, Rp, p0, p1, St, j0, c * 16, p0 > 0); break;
          case 2: scores_tile_bf16<RJ, 2>(Kb, D, Qp, Rp, p0, p1, St, j0, c * 16, p0 > 0); break;
          default: scores_tile_bf16<RJ, NV1>(Kb, D, Qp, Rp, p0, p1, St, j0, c * 16, p0 > 0); break;
        }
      }
    }
  }
}

template <int NV>
inline void values_tile_bf16(const uint32_t* Vk, const uint32_t* Pp, int64_t Rp, const float* corr, float* acc,
                             int64_t Vp, int64_t n_pairs, int64_t r0, int64_t c0) {
  __m512 a[RH][NV];
  for (int h = 0; h < RH; ++h) {
    const __m512 cr = _mm512_set1_ps(corr[r0 + h]);
    for (int v = 0; v < NV; ++v) a[h][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + h) * Vp + c0 + v * 16), cr);
  }
  for (int64_t p = 0; p < n_pairs; ++p) {
    __m512bh vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(Vk + p * Vp + c0 + v * 16);
    for (int h = 0; h < RH; ++h) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(Pp[p * Rp + r0 + h]));
      for (int v = 0; v < NV; ++v) a[h][v] = _mm512_dpbf16_ps(a[h][v], pv, vv[v]);
    }
  }
  for (int h = 0; h < RH; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r0 + h) * Vp + c0 + v * 16, a[h][v]);
}

void values_bf16(const uint32_t* Vk, const uint32_t* Pp, int64_t Rp, const float* corr, float* acc, int64_t Vp,
                 int64_t n_pairs) {
  const int64_t nvec = Vp / 16;
  for (int64_t c = 0; c < nvec; c += NV2) {
    const int64_t nv = std::min<int64_t>(NV2, nvec - c);
    for (int64_t r0 = 0; r0 < Rp; r0 += RH) {
      switch (nv) {
        case 1: values_tile_bf16<1>(Vk, Pp, Rp, corr, acc, Vp, n_pairs, r0, c * 16); break;
        case 2: values_tile_bf16<2>(Vk, Pp, Rp, corr, acc, Vp, n_pairs, r0, c * 16); break;
        case 3: values_tile_bf16<3>(Vk, Pp, Rp, corr, acc, Vp, n_pairs, r0, c * 16); break;
        default: values_tile_bf16<NV2>(Vk, Pp, Rp, corr, acc, Vp, n_pairs, r0, c * 16); break;
      }
    }
  }
}

// Up to 16 values (n of them, the rest 0) of a float kind at p as bf16 bits (f32 / f16 rounded to
// nearest even, as XLA's convert).
inline __m256i bf16x16(int kind, const void* p, int64_t n) {
  const __mmask16 m = n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
  switch (kind) {
    case ikj::MLA_BF16: return _mm256_maskz_loadu_epi16(m, p);
    case ikj::MLA_F16: return (__m256i)_mm512_cvtneps_pbh(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)));
    default: return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p));
  }
}

inline const void* elem(int kind, const void* base, int64_t i) {
  return static_cast<const char*>(base) + i * (kind == ikj::MLA_F32 ? 4 : 2);
}

// n values of row `row` (width `width`) of a float kind as bf16 into dst.
inline void bf16_row(int kind, const void* base, int64_t row, int64_t width, int64_t n, uint16_t* dst) {
  for (int64_t c = 0; c < n; c += 16) {
    const int64_t k = std::min<int64_t>(16, n - c);
    _mm256_mask_storeu_epi16(dst + c, static_cast<__mmask16>((1u << k) - 1),
                             bf16x16(kind, elem(kind, base, row * width + c), k));
  }
}

// 16 values of two rows (n <= 16 of them valid, the rest 0; r1 < 0: none) interleaved into u32 pairs.
inline __m512i pair16(int kind, const void* base, int64_t r0, int64_t r1, int64_t width, int64_t c, int64_t n) {
  const __m512i lo = _mm512_cvtepu16_epi32(bf16x16(kind, elem(kind, base, r0 * width + c), n));
  const __m512i hi = r1 >= 0 ? _mm512_cvtepu16_epi32(bf16x16(kind, elem(kind, base, r1 * width + c), n))
                             : _mm512_setzero_si512();
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- the amx level: a block's scores and p·V on bf16 tiles (tdpbf16ps) ---------------------------
// Why: on vdpbf16ps the V2-Lite prompt's attention took 10 ms of a 147-162 ms 512-token step at
// N_KV 0 and 28 of 203 ms at N_KV 512 (16 threads, Sapphire Rapids; RESULTS §26ac); one tile
// product does 16 x 16 x 32 multiply-adds. The operands are the bf16 loop's own buffers: K's rows
// (kb, [key][D]) are A tiles as they are, q's pairs over d (qp, [D/2][Rp]) B tiles, so a C tile is
// St's [key][row] layout; for p·V, p's pairs over keys are transposed to rows ([row][key]: A) and
// V's pairs over keys (vk) are B tiles, C the accumulator's [row][Vp] layout.
// Whether this item's products run on tiles: the CPU's amx_bf16 (IKJAX_AMX not int8), D in whole
// tiles of 32, and IKJAX_AMX_ATTN not "0" (read per call).
inline bool attn_tiles(const ikj::MlaArgs& a) {
  return a.D % 32 == 0 && ikj::amx_bf16_on() && ikj::env_on("IKJAX_AMX_ATTN");
}

// St[j, r] = Σ_d Kb[j, d] · q[r, d] for keys [0, nj) (nj a multiple of 16; Kb's rows past the
// block's keys zero) and all Rp rows: C tiles 0-2 (three groups of 16 rows), A tile 3 (16 keys x
// 32 d), B tiles 4-6 (16 pairs of d x 16 rows of qp).
void scores_tiles(const uint16_t* Kb, int64_t D, const uint32_t* Qp, int64_t Rp, float* St, int64_t nj) {
  const int64_t nrt = Rp / 16;
  for (int64_t j0 = 0; j0 < nj; j0 += 16)
    for (int64_t rt = 0; rt < nrt; rt += 3) {
      const int64_t n = std::min<int64_t>(3, nrt - rt);
      _tile_zero(0);
      if (n > 1) _tile_zero(1);
      if (n > 2) _tile_zero(2);
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        _tile_loadd(3, Kb + j0 * D + d0, D * 2);
        const uint32_t* qb = Qp + (d0 / 2) * Rp + rt * 16;
        _tile_loadd(4, qb, Rp * 4);
        _tile_dpbf16ps(0, 3, 4);
        if (n > 1) {
          _tile_loadd(5, qb + 16, Rp * 4);
          _tile_dpbf16ps(1, 3, 5);
        }
        if (n > 2) {
          _tile_loadd(6, qb + 32, Rp * 4);
          _tile_dpbf16ps(2, 3, 6);
        }
      }
      float* c = St + j0 * Rp + rt * 16;
      _tile_stored(0, c, Rp * 4);
      if (n > 1) _tile_stored(1, c + 16, Rp * 4);
      if (n > 2) _tile_stored(2, c + 32, Rp * 4);
    }
}

// p (St [key][row], nv keys) as bf16 rows [row][key] of nj keys (nj a multiple of 32; keys from nv
// on zero): each 16 rows x 32 keys through the register transpose of their pairs.
void p_rows(const float* St, int64_t Rp, int64_t nv, int64_t nj, uint16_t* Pt) {
  for (int64_t r0 = 0; r0 < Rp; r0 += 16)
    for (int64_t k0 = 0; k0 < nj; k0 += 32) {
      __m512i v[16];
      for (int p = 0; p < 16; ++p) {
        const int64_t j = k0 + 2 * p;
        const __m512i lo = j < nv ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(St + j * Rp + r0)))
                                  : _mm512_setzero_si512();
        const __m512i hi = j + 1 < nv
                               ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(St + (j + 1) * Rp + r0)))
                               : _mm512_setzero_si512();
        v[p] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      transpose16x16(v);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(Pt + (r0 + i) * nj + k0, v[i]);
    }
}

// acc[r, :] = acc[r, :] · corr[r] + Σ_{j<nj} p[r, j] · V[j, :]: the rescale on vectors, then per
// 16 rows and 16 columns a C tile (0) from acc, the keys' A tiles (1, 2: 32 keys each, of Pt)
// against V's pairs (vk rows: B tile 3), stored back.
void values_tiles(const uint32_t* Vk, const uint16_t* Pt, int64_t Rp, const float* corr, float* acc, int64_t Vp,
                  int64_t nj) {
  for (int64_t r = 0; r < Rp; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int64_t c = 0; c < Vp; c += 16) _mm512_storeu_ps(acc + r * Vp + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * Vp + c), cr));
  }
  const int64_t nk = nj / 32;  // 1 or 2 key chunks (BK = 64)
  for (int64_t r0 = 0; r0 < Rp; r0 += 16) {
    _tile_loadd(1, Pt + r0 * nj, nj * 2);
    if (nk > 1) _tile_loadd(2, Pt + r0 * nj + 32, nj * 2);
    for (int64_t c0 = 0; c0 < Vp; c0 += 16) {
      float* c = acc + r0 * Vp + c0;
      _tile_loadd(0, c, Vp * 4);
      _tile_loadd(3, Vk + c0, Vp * 4);
      _tile_dpbf16ps(0, 1, 3);
      if (nk > 1) {
        _tile_loadd(3, Vk + 16 * Vp + c0, Vp * 4);
        _tile_dpbf16ps(0, 2, 3);
      }
      _tile_stored(0, c, Vp * 4);
    }
  }
}

// Every item of a head reads that head's keys from 0 up to its tile's last position, so converting
// them per item (f32 / f16 to bf16 rows, V to pairs over keys) did it once per token tile: ~11 times
// at a 512-token prompt. This converts each (sequence, head)'s visible keys once, in parallel, into
// the layout the tiles read (Plan::kpre / vpre); keys from `ends[b]` to spad are zero.
void keys_to_tiles(const ikj::MlaArgs& a, const Plan& pl, const std::vector<int64_t>& ends, int nth,
                   uint16_t* kpre, uint32_t* vpre) {
  const int64_t H = a.H, D = a.D, Vp = pl.Vp, vd = a.v_dim, spad = pl.spad;
  const int64_t n1 = a.k2 ? a.D1 : D;
  for_key_blocks(a.B, H, spad, ends, nth, [&](int64_t b, int64_t h, int64_t j0, int64_t nv) {
    uint16_t* kb = kpre + ((b * H + h) * spad + j0) * D;
    uint32_t* vk = vpre + ((b * H + h) * (spad / 2) + j0 / 2) * Vp;
    auto row = [&](int64_t j) { return (b * a.S + j) * a.Hk + h; };
    for (int64_t j = 0; j < nv; ++j) {
      bf16_row(a.kind, a.cache, row(j0 + j), a.W, n1, kb + j * D);
      if (a.k2) bf16_row(a.kind2, a.k2, b * a.S + j0 + j, a.W2, D - n1, kb + j * D + n1);
    }
    std::fill(kb + nv * D, kb + BK * D, uint16_t{0});
    const int64_t np = (nv + 1) / 2;
    for (int64_t p = 0; p < np; ++p) {
      const int64_t r0 = row(j0 + 2 * p), r1 = 2 * p + 1 < nv ? row(j0 + 2 * p + 1) : -1;
      for (int64_t c = 0; c < Vp; c += 16)
        _mm512_storeu_si512(vk + p * Vp + c, c < vd ? pair16(a.kind, a.v, r0, r1, a.Wv, c, std::min<int64_t>(16, vd - c))
                                                    : _mm512_setzero_si512());
    }
    std::fill(vk + np * Vp, vk + (BK / 2) * Vp, 0u);
  });
}
#endif

// One item with bf16 q, K, V (bf16_inputs, D even): run_item's loop on pairs.
void run_item_bf16(const ikj::MlaArgs& a, const Plan& pl, const Item& it, Scratch& s) {
  const int64_t H = a.H, D = a.D, Rp = pl.Rp, Vp = pl.Vp, n_pairs = D / 2, vd = a.v_dim;
  const int64_t Rt = (it.t1 - it.t0) * pl.hq;
  uint32_t* qp = grow(s.qp, n_pairs * Rp);
  uint16_t* kb = grow(s.kb16, BK * D);
  uint32_t* vk = grow(s.vp, (BK / 2) * Vp);
  uint32_t* pp = grow(s.pp, (BK / 2) * Rp);  // (the tiles: p's rows [Rp][BK] bf16, the same bytes)
  auto [st, m, l, corr, acc, pos] = tile_state(s, pl);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool tiles = attn_tiles(a);
  const TileCfg cfg = tiles_16x64();  // every tile 16 rows x 64 bytes
  if (tiles) load_tile_config(cfg);
#else
  constexpr bool tiles = false;
#endif

  std::fill(qp, qp + n_pairs * Rp, 0u);
  for (int64_t r = 0; r < Rt; ++r) {
    const uint16_t* q = a.q16 + ((it.b * a.T + row_token(pl, it.t0, r)) * H + row_head(pl, it.h, r)) * D;
    for (int64_t p = 0; p < n_pairs; ++p) qp[p * Rp + r] = q[2 * p] | static_cast<uint32_t>(q[2 * p + 1]) << 16;
  }
  const int32_t min_pos = start_rows(a, pl, it, Rt, pos, m, l, acc);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // one key block on the tiles: K's rows kbp and V's pairs vkp for keys [j0, j0 + nv) (nj: nv
  // rounded up to 32, the rows past nv zero)
  auto tile_block = [&](const uint16_t* kbp, const uint32_t* vkp, int64_t j0, int64_t nv, int64_t nj) {
    scores_tiles(kbp, D, qp, Rp, st, nj);
    scale_block(st, Rp, nv, a.scale);
    mask_block(st, Rp, Rt, j0, nv, pos, min_pos);
    softmax_block(st, Rp, nv, m, l, corr);
    uint16_t* pt = reinterpret_cast<uint16_t*>(pp);
    p_rows(st, Rp, nv, nj, pt);
    values_tiles(vkp, pt, Rp, corr, acc, Vp, nj);
  };
#endif

  const int64_t n1 = a.k2 ? a.D1 : D;
  auto row = [&](int64_t j) { return (it.b * a.S + j) * a.Hk + it.h; };  // K's and V's row of key j
  for (int64_t j0 = it.k0; j0 < it.k1; j0 += BK) {
    const int64_t nv = std::min<int64_t>(BK, it.k1 - j0), nj = round_up(nv, tiles ? 32 : RJ), np = (nv + 1) / 2;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles && pl.kpre) {  // the block's keys and values as keys_to_tiles left them
      const int64_t bh = it.b * H + it.h;
      tile_block(pl.kpre + (bh * pl.spad + j0) * D, pl.vpre + (bh * (pl.spad / 2) + j0 / 2) * Vp, j0, nv, nj);
      continue;
    }
#endif
    for (int64_t j = 0; j < nv; ++j) {
      if (a.kind == ikj::MLA_BF16 && !a.k2) {
        std::memcpy(kb + j * D, static_cast<const uint16_t*>(a.cache) + row(j0 + j) * a.W, D * sizeof(uint16_t));
        continue;
      }
      bf16_row(a.kind, a.cache, row(j0 + j), a.W, n1, kb + j * D);
      if (a.k2) bf16_row(a.kind2, a.k2, it.b * a.S + j0 + j, a.W2, D - n1, kb + j * D + n1);
    }
    std::fill(kb + nv * D, kb + nj * D, uint16_t{0});
    for (int64_t p = 0; p < np; ++p) {
      const int64_t r0 = row(j0 + 2 * p), r1 = 2 * p + 1 < nv ? row(j0 + 2 * p + 1) : -1;
      for (int64_t c = 0; c < Vp; c += 16)
        _mm512_storeu_si512(vk + p * Vp + c, c < vd ? pair16(a.kind, a.v, r0, r1, a.Wv, c, std::min<int64_t>(16, vd - c))
                                                    : _mm512_setzero_si512());
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) {  // the pairs past the block's keys zero too: the tiles read whole chunks of 32 keys
      std::fill(vk + np * Vp, vk + (nj / 2) * Vp, 0u);
      tile_block(kb, vk, j0, nv, nj);
      continue;
    }
#endif
    scores_bf16(kb, D, qp, Rp, st, nj);
    scale_block(st, Rp, nv, a.scale);
    mask_block(st, Rp, Rt, j0, nv, pos, min_pos);
    softmax_block(st, Rp, nv, m, l, corr);
    for (int64_t p = 0; p < np; ++p) {
      const float* p0 = st + 2 * p * Rp;
      const float* p1 = 2 * p + 1 < nv ? p0 + Rp : nullptr;
      for (int64_t r = 0; r < Rp; r += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p0 + r)));
        const __m512i hi = p1 ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p1 + r)))
                              : _mm512_setzero_si512();
        _mm512_storeu_si512(pp + p * Rp + r, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    values_bf16(vk, pp, Rp, corr, acc, Vp, np);
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles) _tile_release();
#endif
}
#endif

// The f32 loop's per-head keys and values converted once a call (load_key / load_value: the kv_b
// product's f32 rows rounded to bf16 where the queries are bf16), as keys_to_tiles does for the
// tiles: every item of a head read them again per token tile (~11 times at a 512-token prompt).
// Keys from `ends[b]` to spad are zero.
void keys_to_rows(const ikj::MlaArgs& a, const Plan& pl, const std::vector<int64_t>& ends, int nth, float* kpre,
                  float* vpre) {
  const int64_t H = a.H, Dp = pl.Dp, Vp = pl.Vp, spad = pl.spad;
  for_key_blocks(a.B, H, spad, ends, nth, [&](int64_t b, int64_t h, int64_t j0, int64_t nv) {
    float* kb = kpre + ((b * H + h) * spad + j0) * Dp;
    float* vb = vpre + ((b * H + h) * spad + j0) * Vp;
    for (int64_t j = 0; j < nv; ++j) {
      load_key(a, b, j0 + j, h, kb + j * Dp);
      load_value(a, b, j0 + j, h, vb + j * Vp);
    }
    std::fill(kb + nv * Dp, kb + BK * Dp, 0.f);
    std::fill(vb + nv * Vp, vb + BK * Vp, 0.f);
  });
}

// IKJAX_ATTN_KEYS_ONCE=0: the f32 loop's items convert their own key blocks, as before keys_to_rows (read per call)
inline bool keys_once() { return ikj::env_on("IKJAX_ATTN_KEYS_ONCE"); }

// Process one item: keys [k0, k1) for the query rows of tokens [t0, t1); leaves (m, l, acc) in s.
void run_item(const ikj::MlaArgs& a, const Plan& pl, const Item& it, Scratch& s) {
#if defined(__AVX512BF16__)
  if (bf16_inputs(a) && a.D % 2 == 0) return run_item_bf16(a, pl, it, s);
#endif
  const int64_t H = a.H, D = a.D, Rp = pl.Rp, Vp = pl.Vp, Dp = pl.Dp;
  const int64_t Rt = (it.t1 - it.t0) * pl.hq;
  float* qt = grow(s.qt, D * Rp);
  float* kb = grow(s.kb, BK * Dp);
  float* vb = a.v ? grow(s.vb, BK * Vp) : nullptr;
  auto [st, m, l, corr, acc, pos] = tile_state(s, pl);

  for (int64_t r = 0; r < Rt; ++r) {
    const int64_t off = ((it.b * a.T + row_token(pl, it.t0, r)) * H + row_head(pl, it.h, r)) * D;
    if (a.q16)
      for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = ikj::bf16_to_f32(a.q16[off + d]);
    else
      for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = a.q[off + d];
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = Rt; r < Rp; ++r) qt[d * Rp + r] = 0.f;
  const int32_t min_pos = start_rows(a, pl, it, Rt, pos, m, l, acc);

  for (int64_t j0 = it.k0; j0 < it.k1; j0 += BK) {
    const int64_t nv = std::min<int64_t>(BK, it.k1 - j0);
    if (pl.kpre32) {  // the block's rows as keys_to_rows left them
      kb = const_cast<float*>(pl.kpre32) + ((it.b * H + it.h) * pl.spad + j0) * Dp;
      vb = const_cast<float*>(pl.vpre32) + ((it.b * H + it.h) * pl.spad + j0) * Vp;
    } else {
      for (int64_t j = 0; j < nv; ++j) load_key(a, it.b, j0 + j, it.h, kb + j * Dp);
      if (vb)
        for (int64_t j = 0; j < nv; ++j) load_value(a, it.b, j0 + j, it.h, vb + j * Vp);
    }
    scores(kb, Dp, qt, Rp, D, st, round_up(nv, RJ));
    scale_block(st, Rp, nv, a.scale);
    mask_block(st, Rp, Rt, j0, nv, pos, min_pos);
    softmax_block(st, Rp, nv, m, l, corr);
    if (bf16_inputs(a))  // p as the bf16 products would see it (l keeps the unrounded sum, as XLA)
      round_bf16_n(st, nv * Rp);
    if (vb)
      values<NV2H>(vb, Vp, st, Rp, corr, acc, Vp, nv);
    else
      values<NV2>(kb, Dp, st, Rp, corr, acc, Vp, nv);
  }
}

void write_out(const ikj::MlaArgs& a, const Plan& pl, int64_t b, int64_t h, int64_t t0, int64_t t1,
               const float* acc, const float* l) {
  const int64_t Rt = (t1 - t0) * pl.hq, vd = a.v_dim;
  for (int64_t r = 0; r < Rt; ++r) {
    float* o = a.out + ((b * a.T + row_token(pl, t0, r)) * a.H + row_head(pl, h, r)) * vd;
    const float inv = 1.0f / l[r];  // l = 0 only for a row that sees no key: NaN, as the reference
    for (int64_t c = 0; c < vd; ++c) o[c] = acc[r * pl.Vp + c] * inv;
  }
}

}  // namespace

void mla_attention(const ikj::MlaArgs& a) {
  const int64_t B = a.B, T = a.T, H = a.H;
  if (B == 0 || T == 0 || H == 0) return;
  // A prompt-sized call's own buffers (the per-call key conversions, the split items' partials) are
  // one set per process, not per calling thread: XLA runs a custom call on whichever of its workers
  // picks it up, so per-thread buffers were grown and faulted in again each time a new worker
  // called (on the device host's 16 cores a prompt step faulted 20-30 thousand pages run after
  // run; RESULTS §26ai). Prompt-sized calls are serialized here (each runs on the whole pool
  // anyway); decode-sized ones (one token a sequence) keep their caller's buffers, as before.
  struct CallBuffers {
    std::vector<uint16_t> kpre;
    std::vector<uint32_t> vpre;
    std::vector<float> kpre32, vpre32, partial;
  };
  static std::mutex prompt_mu;
  static CallBuffers shared;
  thread_local CallBuffers own;
  const bool prompt = T > 1;
  std::unique_lock<std::mutex> prompt_lock(prompt_mu, std::defer_lock);
  if (prompt) prompt_lock.lock();
  CallBuffers& cb = prompt ? shared : own;
  std::vector<uint16_t>& kpre = cb.kpre;
  std::vector<uint32_t>& vpre = cb.vpre;
  std::vector<float>& kpre32 = cb.kpre32;
  std::vector<float>& vpre32 = cb.vpre32;
  std::vector<float>& partial = cb.partial;
  Plan pl;
  pl.hq = a.Hk == 1 ? H : 1;
  pl.tq = std::max<int64_t>(1, std::min<int64_t>(T, (a.Hk == 1 ? ROW_TARGET : HEAD_ROW_TARGET) / pl.hq));
  pl.Rp = round_up(pl.tq * pl.hq, 16);
  pl.Vp = round_up(a.v_dim, 16);
  pl.Dp = round_up(a.v ? a.D : std::max(a.D, pl.Vp), 32);

  int avail = ikj::available_cores();
  int nth = a.n_threads <= 0 ? avail : std::min(a.n_threads, avail);

  // groups (b, head, tile) with their key ranges [0, kv_end), kv_end = min(S, highest position + 1)
  std::vector<Group> groups;
  std::vector<int64_t> kv_end;
  const int64_t n_heads = a.Hk == 1 ? 1 : H;  // heads with keys of their own
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < T; t0 += pl.tq) {
      int64_t t1 = std::min(T, t0 + pl.tq);
      int64_t mx = -1;
      for (int64_t t = t0; t < t1; ++t) mx = std::max<int64_t>(mx, a.q_pos[b * T + t]);
      int64_t end = std::min<int64_t>(a.S, mx + 1);
      end = std::max<int64_t>(end, 0);
      for (int64_t h = 0; h < n_heads; ++h) {
        groups.push_back({b, h, t0, t1, 1, -1});
        kv_end.push_back(end);
      }
    }
  // split key ranges so that no item holds more than ~1/nth of its sequence's blocks (decode: one
  // chunk per thread; a long prompt: no split, its many tiles keep the threads busy). Per sequence,
  // not per batch: a sequence's splits, hence the order its partial sums are merged in, are then the
  // same alone or in any batch, so a batch's rows come out bit for bit as each alone (with the
  // batch's total, rows of a batch of 5+ drifted from `generate` after ~28 tokens)
  std::vector<int64_t> seq_blocks(static_cast<size_t>(B), 0);
  for (size_t g = 0; g < groups.size(); ++g) seq_blocks[groups[g].b] += (kv_end[g] + BK - 1) / BK;
  std::vector<Item> items;
  int64_t n_slots = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t nblk = (kv_end[g] + BK - 1) / BK;
    const int64_t target = std::max<int64_t>(1, (seq_blocks[groups[g].b] + nth - 1) / nth);
    const int64_t ns = nth > 1 ? std::max<int64_t>(1, std::min<int64_t>(nblk, (nblk + target - 1) / target)) : 1;
    Group& G = groups[g];
    G.n_split = ns;
    if (ns == 1) {
      items.push_back({G.b, G.h, G.t0, G.t1, 0, kv_end[g], -1, -1});
      continue;
    }
    G.slot0 = n_slots;
    for (int64_t i = 0; i < ns; ++i) {
      int64_t b0, b1;
      ikj::split_range(nblk, static_cast<int>(i), static_cast<int>(ns), &b0, &b1);
      items.push_back({G.b, G.h, G.t0, G.t1, b0 * BK, std::min(kv_end[g], b1 * BK), static_cast<int64_t>(g),
                       n_slots++});
    }
  }
  // longest first, so dynamic scheduling balances causal tiles of different lengths
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.k1 - x.k0 > y.k1 - y.k0; });

  // per sequence, the keys any of its tiles sees (ends), for the per-call conversions below
  std::vector<int64_t> ends(static_cast<size_t>(B), 0);
  for (size_t g = 0; g < groups.size(); ++g) ends[groups[g].b] = std::max(ends[groups[g].b], kv_end[g]);
  const int64_t spad = round_up(std::max<int64_t>(*std::max_element(ends.begin(), ends.end()), 1), BK);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // the per-head keys and values converted once for the tiles (keys_to_tiles), where they run
  if (a.v && pl.hq == 1 && bf16_inputs(a) && attn_tiles(a)) {
    pl.spad = spad;
    pl.kpre = grow(kpre, static_cast<size_t>(B * H * pl.spad * a.D));
    pl.vpre = grow(vpre, static_cast<size_t>(B * H * (pl.spad / 2) * pl.Vp));
    keys_to_tiles(a, pl, ends, nth, kpre.data(), vpre.data());
  }
#endif
  // the f32 loop's keys and values once a call (keys_to_rows), where the items take that loop, a
  // prompt of several token tiles reads them, and the copy stays under 256 MiB
#if defined(__AVX512BF16__)
  const bool f32_loop = !(bf16_inputs(a) && a.D % 2 == 0);
#else
  const bool f32_loop = true;
#endif
  if (!pl.kpre && f32_loop && a.v && pl.hq == 1 && T > pl.tq && keys_once()) {
    const int64_t nk = B * H * spad * pl.Dp, nv = B * H * spad * pl.Vp;
    if ((nk + nv) * 4 <= (int64_t{256} << 20)) {
      pl.spad = spad;
      pl.kpre32 = grow(kpre32, static_cast<size_t>(nk));
      pl.vpre32 = grow(vpre32, static_cast<size_t>(nv));
      keys_to_rows(a, pl, ends, nth, kpre32.data(), vpre32.data());
    }
  }
  const int64_t slot_size = pl.Rp * (pl.Vp + 2);
  float* part = grow(partial, static_cast<size_t>(std::max<int64_t>(1, n_slots * slot_size)));
  std::vector<std::atomic<int64_t>> remaining(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) remaining[g].store(groups[g].n_split, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());

  ikj::parallel(std::min<int64_t>(nth, n_items), [&](int, int) {
    thread_local Scratch s;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const Item& it = items[i];
      run_item(a, pl, it, s);
      if (it.group < 0) {
        write_out(a, pl, it.b, it.h, it.t0, it.t1, s.acc.data(), s.l.data());
        continue;
      }
      float* slot = part + it.slot * slot_size;  // [acc Rp x Vp | m Rp | l Rp]
      std::memcpy(slot, s.acc.data(), pl.Rp * pl.Vp * sizeof(float));
      std::memcpy(slot + pl.Rp * pl.Vp, s.m.data(), pl.Rp * sizeof(float));
      std::memcpy(slot + pl.Rp * (pl.Vp + 1), s.l.data(), pl.Rp * sizeof(float));
      if (remaining[it.group].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      // last split of its group: log-sum-exp merge of the partials into s.acc / s.l, then write
      const Group& G = groups[it.group];
      const int64_t Rt = (G.t1 - G.t0) * pl.hq;
      float* acc = s.acc.data();
      float* l = s.l.data();
      for (int64_t r = 0; r < Rt; ++r) {
        float M = M_INIT;
        for (int64_t k = 0; k < G.n_split; ++k)
          M = std::max(M, part[(G.slot0 + k) * slot_size + pl.Rp * pl.Vp + r]);
        float* ar = acc + r * pl.Vp;
        std::fill(ar, ar + pl.Vp, 0.f);
        float lsum = 0.f;
        for (int64_t k = 0; k < G.n_split; ++k) {
          const float* sl = part + (G.slot0 + k) * slot_size;
          const float w = std::exp(sl[pl.Rp * pl.Vp + r] - M);
          lsum += w * sl[pl.Rp * (pl.Vp + 1) + r];
          const float* pa = sl + r * pl.Vp;
          for (int64_t c = 0; c < pl.Vp; ++c) ar[c] += w * pa[c];
        }
        l[r] = lsum;
      }
      write_out(a, pl, G.b, G.h, G.t0, G.t1, acc, l);
    }
  });
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (kpre.size() + 2 * vpre.size() > (size_t{64} << 20)) {  // a long context's copy is not kept between calls
    std::vector<uint16_t>().swap(kpre);
    std::vector<uint32_t>().swap(vpre);
  }
#endif
  if ((kpre32.size() + vpre32.size()) * 4 > (size_t{64} << 20)) {
    std::vector<float>().swap(kpre32);
    std::vector<float>().swap(vpre32);
  }
}

}  // namespace IKJ_NS
