// Fused routed experts on the CPU (see cpu_kernel.h for the contract). Compiled once per
// instruction-set level (namespace IKJ_NS); the matrix work is the quant core's single-threaded
// qgemm_tile(_ex) of the same level, so every type and SIMD path it gains is used here unchanged.
//
// Plan of one call:
//   1. counting sort of the (token, slot) assignments with a non-zero weight by expert id;
//   2. phase 1, threads split F: for every active expert, its tokens' x rows are gathered into a
//      thread-local tile and gate and up are computed for the thread's F columns from that same
//      tile, block by block, followed by SiLU(g)·u into h [assignments, F]; a prompt-sized
//      expert's x is gathered and packed once before (threads split the experts), into a buffer
//      all threads read, and so is its h before phase 2;
//   3. phase 2, threads split d: each thread zeroes its columns of out, then for every active expert
//      computes down(h) for its d columns and adds weight·y into out. A thread owns its columns of
//      every output row, so there are no races and no [N*k, d] staging buffer or reduction.
// Splitting columns (not experts) keeps every thread busy whether one token picks 6 experts
// (decode) or 512 tokens spread over 64 (prompt), and each expert row is still read exactly once.
#include "moe_matmul/cpu_kernel.h"

#include <algorithm>
#include <atomic>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu/runtime.h"
#include "cpu/vmath.h"
#include "quant_matmul/cpu_kernel.h"

namespace IKJ_NS {

namespace {

// Column splits between threads fall on multiples of kAlign rows (a row-interleaved _R4/_R8/_R16 group
// never straddles two threads, and the prompt engine's 32-row panels are never cut); inside a thread's range
// qgemm_tile is called kBlock columns at a time so the up/down results stay in L1/L2 until used.
constexpr int64_t kAlign = 32;
constexpr int64_t kBlock = 128;

// Columns per qgemm_tile call: kBlock for prompt-sized M; the thread's whole range for decode-sized
// M (its results are a few KB at most, and one call per matrix keeps each thread's reads of gate,
// up and down in long sequential runs: Q4_0 expert rows are 1.1 KB, so 128-column blocks made the
// reads jump every ~70 KB).
inline int64_t col_block(int64_t M, int64_t range) {
  return M < qgemm_packed_min_rows() ? std::max<int64_t>(range, 1) : kBlock;
}

// A decode-sized call as one pool job (gate / up, then down, with a wait between), not two: one
// wake-up of the pool a layer. IKJAX_MOE_ONE_JOB=0 gives the two jobs back (read once).
inline bool decode_one_job() {
  static const bool on = [] {
    const char* e = std::getenv("IKJAX_MOE_ONE_JOB");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

void split_cols(int64_t n, int ith, int nth, int64_t* begin, int64_t* end) {
  int64_t units = (n + kAlign - 1) / kAlign, u0, u1;
  ikj::split_range(units, ith, nth, &u0, &u1);
  *begin = std::min(n, u0 * kAlign);
  *end = std::min(n, u1 * kAlign);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }


// h[j] = silu(h[j]) * u[j], j < n. Vectorized at the avx512 and avx2 levels: a prompt step's 512 x 6
// rows of 1408 took ~6 % of the fused call in scalar expf (avx2: ~3 % of a Q8_0 prompt step on the
// 2-core EPYC). A NaN in h stays NaN (h / (1 + e^-h)).
inline void silu_mul(float* h, const float* u, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(h + j);
    const __m512 e = ikj_exp(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(h + j, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(u + j)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(h + j);
    const __m256 e = ikj_exp(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(h + j, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(u + j)));
  }
#endif
  for (; j < n; ++j) h[j] = silu(h[j]) * u[j];
}

// Per-call buffers, grown to the largest step seen and reused (a decode step allocates nothing).
// One set per process behind a mutex: calls are serialized by the thread pool anyway, and a set per
// XLA thread would multiply the prompt-sized h buffer by the number of threads.
struct Scratch {
  std::vector<int64_t> start;   // [E + 1] bucket offsets
  std::vector<int64_t> cursor;  // [E]
  std::vector<int32_t> active;  // experts with at least one assignment
  std::vector<int64_t> tok;     // [A] token of each assignment, grouped by expert
  std::vector<float> wt;        // [A] its routing weight
  std::vector<float> h;         // [A, F] silu(gate x) * up x
  std::vector<int64_t> poff;    // [3 E] byte offsets of each expert's packs: x for gate, x for up, h
  std::vector<uint8_t> pk;      // the packs (prompt-sized experts), made once and read by every thread
};
std::mutex scratch_mu;
Scratch& scratch() {
  static Scratch* s = new Scratch();
  return *s;
}

}  // namespace

void moe_experts(const MoeExpertsArgs& a) {
  const int64_t N = a.N, k = a.k, d = a.d, F = a.F, E = a.E;
  if (N <= 0 || d <= 0) return;
  std::lock_guard<std::mutex> lock(scratch_mu);
  Scratch& s = scratch();

  // 1. bucket the assignments by expert (stable: tokens in order within an expert)
  s.start.assign(E + 1, 0);
  for (int64_t i = 0; i < N * k; ++i)
    if (a.weights[i] != 0.f) ++s.start[a.ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  const int64_t A = s.start[E];
  s.cursor.assign(s.start.begin(), s.start.end() - 1);
  s.tok.resize(A);
  s.wt.resize(A);
  for (int64_t i = 0; i < N * k; ++i) {
    if (a.weights[i] == 0.f) continue;
    int64_t p = s.cursor[a.ids[i]]++;
    s.tok[p] = i / k;
    s.wt[p] = a.weights[i];
  }
  s.active.clear();
  for (int64_t e = 0; e < E; ++e)
    if (s.start[e + 1] > s.start[e]) s.active.push_back(static_cast<int32_t>(e));
  if (static_cast<int64_t>(s.h.size()) < A * F) s.h.resize(A * F);

  const int64_t* start = s.start.data();
  const int64_t* tok = s.tok.data();
  const float* wt = s.wt.data();
  float* h = s.h.data();
  const std::vector<int32_t>& active = s.active;

  // Each prompt-sized expert's x (gathered) and h packed once, into one buffer every thread reads: a
  // pack per thread repeated the quantization (and x's gather) n_threads times, a few % of the
  // layer at -t 16 (phase 2 splits F and phase 3 splits d, so every thread reads every expert's x / h)
  const int cg = qgemm_packed_compute(a.gate_type, a.compute), cu = qgemm_packed_compute(a.up_type, a.compute);
  const int cd = qgemm_packed_compute(a.down_type, a.compute);
  const int64_t min_rows = qgemm_packed_min_rows();
  s.poff.assign(3 * E, -1);
  int64_t pbytes = 0;
  for (int32_t e : active) {
    const int64_t M = start[e + 1] - start[e];
    if (M < min_rows) continue;
    s.poff[3 * e] = pbytes;
    pbytes += (qgemm_pack_x(nullptr, M, d, cg, nullptr) + 63) / 64 * 64;
    if (cu != cg) {
      s.poff[3 * e + 1] = pbytes;
      pbytes += (qgemm_pack_x(nullptr, M, d, cu, nullptr) + 63) / 64 * 64;
    }
    s.poff[3 * e + 2] = pbytes;
    pbytes += (qgemm_pack_x(nullptr, M, F, cd, nullptr) + 63) / 64 * 64;
  }
  if (static_cast<int64_t>(s.pk.size()) < pbytes) s.pk.resize(pbytes);
  const int64_t* poff = s.poff.data();
  uint8_t* pk = s.pk.data();
  if (pbytes > 0 && A > 0) {
    std::atomic<size_t> next{0};
    ikj::parallel(a.n_threads, [&](int, int) {
      thread_local std::vector<float> xg;
      for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < active.size();) {
        const int32_t e = active[i];
        if (poff[3 * e] < 0) continue;
        const int64_t off = start[e], M = start[e + 1] - off;
        if (static_cast<int64_t>(xg.size()) < M * d) xg.resize(M * d);
        for (int64_t m = 0; m < M; ++m) std::memcpy(xg.data() + m * d, a.x + tok[off + m] * d, d * sizeof(float));
        qgemm_pack_x(xg.data(), M, d, cg, pk + poff[3 * e]);
        if (cu != cg) qgemm_pack_x(xg.data(), M, d, cu, pk + poff[3 * e + 1]);
      }
    });
  }

  // 2. gate and up from one gathered x tile per expert, SiLU·mul into h: columns [c, c + w) of expert
  // e (prompt-sized experts: the shared packs above, the pack each matrix takes: bf16 pairs, or 8-bit
  // blocks for the int8 prompt engine's types; up's own only when its type needs another pack)
  auto gate_up = [&](int32_t e, int64_t c, int64_t w, std::vector<float>& xt, std::vector<float>& ut) {
    const int64_t off = start[e], M = start[e + 1] - off;
    const bool packed = M >= min_rows;
    const float* xe = nullptr;
    if (M == 1) {
      xe = a.x + tok[off] * d;
    } else if (!packed) {
      if (static_cast<int64_t>(xt.size()) < M * d) xt.resize(M * d);
      for (int64_t m = 0; m < M; ++m) std::memcpy(xt.data() + m * d, a.x + tok[off + m] * d, d * sizeof(float));
      xe = xt.data();
    }
    if (static_cast<int64_t>(ut.size()) < M * w) ut.resize(M * w);
    const uint8_t* ge = a.gate + e * F * a.gate_row_bytes;
    const uint8_t* ue = a.up + e * F * a.up_row_bytes;
    float* he = h + off * F;
    if (packed) {
      qgemm_tile_packed(pk + poff[3 * e], M, d, ge, a.gate_row_bytes, a.gate_type, c, c + w, he, F, cg);
      qgemm_tile_packed(pk + poff[3 * e + (cu != cg ? 1 : 0)], M, d, ue + c * a.up_row_bytes, a.up_row_bytes,
                        a.up_type, 0, w, ut.data(), w, cu);
    } else {
      qgemm_tile_ex(xe, M, d, ge, a.gate_row_bytes, a.gate_type, c, c + w, he, F, a.compute);
      qgemm_tile_ex(xe, M, d, ue + c * a.up_row_bytes, a.up_row_bytes, a.up_type, 0, w, ut.data(), w, a.compute);
    }
    for (int64_t m = 0; m < M; ++m) silu_mul(he + m * F + c, ut.data() + m * w, w);
  };
  // decode-sized: gate / up of every active expert for h's columns [f0, f1), one call a matrix
  // (long sequential reads)
  auto gate_up_cols = [&](int64_t f0, int64_t f1, std::vector<float>& xt, std::vector<float>& ut) {
    for (int32_t e : active) {
      const int64_t blk = col_block(start[e + 1] - start[e], f1 - f0);
      for (int64_t c = f0; c < f1; c += blk) gate_up(e, c, std::min(blk, f1 - c), xt, ut);
    }
  };
  // down(h) of every active expert for output columns [c0, c1), weighted into out (zeroed first)
  auto down_cols = [&](int64_t c0, int64_t c1, std::vector<float>& yt) {
    if (c0 >= c1) return;
    for (int64_t n = 0; n < N; ++n) std::memset(a.out + n * d + c0, 0, (c1 - c0) * sizeof(float));
    for (int32_t e : active) {
      const int64_t off = start[e], M = start[e + 1] - off;
      const int64_t blk = col_block(M, c1 - c0);
      if (static_cast<int64_t>(yt.size()) < M * blk) yt.resize(M * blk);
      const uint8_t* de = a.down + e * d * a.down_row_bytes;
      const float* he = h + off * F;
      const bool packed = M >= min_rows;  // h packed once above
      const uint8_t* hpk = packed ? pk + poff[3 * e + 2] : nullptr;
      for (int64_t c = c0; c < c1; c += blk) {
        const int64_t w = std::min(blk, c1 - c);
        if (packed)
          qgemm_tile_packed(hpk, M, F, de + c * a.down_row_bytes, a.down_row_bytes, a.down_type, 0, w,
                            yt.data(), w, cd);
        else
          qgemm_tile_ex(he, M, F, de + c * a.down_row_bytes, a.down_row_bytes, a.down_type, 0, w, yt.data(),
                        w, a.compute);
        for (int64_t m = 0; m < M; ++m) {
          float* o = a.out + tok[off + m] * d + c;
          const float* yr = yt.data() + m * w;
          const float g = wt[off + m];
          for (int64_t j = 0; j < w; ++j) o[j] += g * yr[j];
        }
      }
    }
  };

  if (A > 0 && pbytes > 0) {
    // a prompt: (expert, column block) items handed out one at a time, expert by expert. A static
    // split of F gave threads unequal shares (V2-Lite's F = 1408 is 44 units of 32: 3 or 2 a thread
    // at -t 16, 9 % of the phase lost waiting), and each item writes its own part of h
    // Items of kBlock columns, narrower (down to kAlign) while there would be fewer than 8 a thread:
    // one expert (a shared expert, a dense FFN through this call) has few (2816 columns: 22 of 128)
    const int64_t nth = std::min<int64_t>(a.n_threads > 0 ? a.n_threads : ikj::available_cores(),
                                          ikj::available_cores());
    const int64_t n_act = static_cast<int64_t>(active.size());
    int64_t bw = kBlock;
    while (bw > kAlign && n_act * ((F + bw - 1) / bw) < 8 * nth) bw /= 2;
    const int64_t nblk = (F + bw - 1) / bw;
    const int64_t items = n_act * nblk;
    std::atomic<int64_t> next{0};
    ikj::parallel(a.n_threads, [&](int, int) {
      thread_local std::vector<float> xt, ut;
      for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t c = (it % nblk) * bw;
        gate_up(active[it / nblk], c, std::min(bw, F - c), xt, ut);
      }
    });
  } else if (A > 0 && decode_one_job()) {
    // decode-sized, as one pool job: part i computes the gate / up columns of range i, waits until
    // every range is done, then takes a range of down. The two phases as two jobs woke the pool
    // twice a layer; next to a GPU (workers sleep between calls) each wake-up of 32 threads cost
    // tens of us a layer. Ranges are taken from counters, not by part index, so a part the pool
    // never hands out (a worker not scheduled) leaves nothing undone: whoever runs takes its range,
    // and the wait only ever waits for ranges a running part has taken.
    std::atomic<int> next1{0}, done1{0}, next2{0};
    ikj::parallel(a.n_threads, [&](int, int nth) {
      thread_local std::vector<float> xt, ut, yt;
      for (int i; (i = next1.fetch_add(1, std::memory_order_relaxed)) < nth;) {
        int64_t f0, f1;
        split_cols(F, i, nth, &f0, &f1);
        gate_up_cols(f0, f1, xt, ut);
        done1.fetch_add(1, std::memory_order_release);
      }
      ikj::wait_at_least(done1, nth);
      for (int i; (i = next2.fetch_add(1, std::memory_order_relaxed)) < nth;) {
        int64_t c0, c1;
        split_cols(d, i, nth, &c0, &c1);
        down_cols(c0, c1, yt);
      }
    });
    return;
  } else if (A > 0) {
    // decode-sized as two jobs (IKJAX_MOE_ONE_JOB=0): each thread its columns of every expert
    ikj::parallel(a.n_threads, [&](int ith, int nth) {
      int64_t f0, f1;
      split_cols(F, ith, nth, &f0, &f1);
      thread_local std::vector<float> xt, ut;
      gate_up_cols(f0, f1, xt, ut);
    });
  }

  // h of each prompt-sized expert packed once (see the x packs above)
  if (pbytes > 0 && A > 0) {
    std::atomic<size_t> next{0};
    ikj::parallel(a.n_threads, [&](int, int) {
      for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < active.size();) {
        const int32_t e = active[i];
        if (poff[3 * e + 2] < 0) continue;
        const int64_t off = start[e], M = start[e + 1] - off;
        qgemm_pack_x(h + off * F, M, F, cd, pk + poff[3 * e + 2]);
      }
    });
  }

  // 3. down and the weighted sum; each thread owns columns [c0, c1) of every output row
  ikj::parallel(a.n_threads, [&](int ith, int nth) {
    int64_t c0, c1;
    split_cols(d, ith, nth, &c0, &c1);
    thread_local std::vector<float> yt;
    down_cols(c0, c1, yt);
  });
}

}  // namespace IKJ_NS
