// Kernel-level A/B of the avx2 quantized matmul (bench/cpu_qmm_ab/README.md): two builds of the kernel
// sources (namespaces ikj_A, ikj_B; e.g. before / after a change), or A against ik_llama.cpp's
// ggml_mul_mat (IKB=1; B's output is then ik's), alternated in one process on the same weight bytes
// and x. Prints the best (min) time of each over the rounds: on a shared machine the minimum is the
// statistic that other processes' load disturbs least.
//   harness TYPE M N K threads rounds   (weights: $QMM_W/w_TYPE_N_K.bin, see gen_weights.py)
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <string>
#include <algorithm>
#include <random>
#include <time.h>
#include "ggml.h"
struct IkMM { ggml_context* ctx; ggml_cgraph* gf; ggml_tensor* x; ggml_tensor* y; };
static IkMM ik_setup(int ty, const std::vector<uint8_t>& wb, int64_t M, int64_t N, int64_t K) {
  ggml_type t = ty == 8 ? GGML_TYPE_Q8_0 : ty == 2 ? GGML_TYPE_Q4_0 : ty == 12 ? GGML_TYPE_Q4_K : ty == 23 ? GGML_TYPE_IQ4_XS : ty == 13 ? GGML_TYPE_Q5_K : GGML_TYPE_IQ4_NL;
  ggml_init_params ip = { wb.size() + (size_t)M * K * 4 + (size_t)M * N * 4 + 64 * 1024 * 1024, nullptr, false };
  IkMM r; r.ctx = ggml_init(ip);
  ggml_tensor* w = ggml_new_tensor_2d(r.ctx, t, K, N); memcpy(w->data, wb.data(), wb.size());
  r.x = ggml_new_tensor_2d(r.ctx, GGML_TYPE_F32, K, M);
  r.y = ggml_mul_mat(r.ctx, w, r.x);
  r.gf = ggml_new_graph(r.ctx); ggml_build_forward_expand(r.gf, r.y);
  return r;
}
namespace ikj_A { void quant_matmul_ex(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int, int, int); }
namespace ikj_B { void quant_matmul_ex(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int, int, int); }
static double now(bool cpu) { timespec ts; clock_gettime(cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
int type_id(const std::string& n) {
  if (n == "Q8_0") return 8; if (n == "Q4_0") return 2; if (n == "Q4_1") return 3; if (n == "Q5_0") return 6; if (n == "Q5_1") return 7;
  if (n == "Q4_K") return 12; if (n == "Q5_K") return 13; if (n == "IQ4_XS") return 23; if (n == "IQ4_NL") return 20; return -1;
}
int main(int argc, char** argv) {
  // harness TYPE M N K threads reps
  std::string t = argv[1];
  int64_t M = atol(argv[2]), N = atol(argv[3]), K = atol(argv[4]);
  int nt = atoi(argv[5]), reps = atoi(argv[6]);
  bool cpu = nt == 1;
  const char* wd = getenv("QMM_W") ? getenv("QMM_W") : "/tmp/qmm_w";
  char fn[512]; snprintf(fn, sizeof fn, "%s/w_%s_%ld_%ld.bin", wd, t.c_str(), (long)N, (long)K);
  FILE* f = fopen(fn, "rb"); if (!f) { perror(fn); return 1; }
  fseek(f, 0, SEEK_END); long sz = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<uint8_t> w(sz); fread(w.data(), 1, sz, f); fclose(f);
  int64_t rb = sz / N;
  std::vector<float> x(M * K), ya(M * N), yb(M * N);
  std::mt19937 g(1); std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(g);
  int ty = type_id(t);
  std::vector<double> ta, tb;
  const bool ikb = getenv("IKB") != nullptr;
  IkMM ik{};
  if (ikb) { ik = ik_setup(ty, w, M, N, K); memcpy(ik.x->data, x.data(), M * K * 4); }
  for (int r = 0; r < reps + 1; ++r) {
    double t0 = now(cpu); ikj_A::quant_matmul_ex(x.data(), w.data(), ya.data(), M, N, K, rb, ty, nt, 1); double t1 = now(cpu);
    if (ikb) ggml_graph_compute_with_ctx(ik.ctx, ik.gf, nt); else ikj_B::quant_matmul_ex(x.data(), w.data(), yb.data(), M, N, K, rb, ty, nt, 1);
    double t2 = now(cpu);
    if (r) ta.push_back(t1 - t0), tb.push_back(t2 - t1);
  }
  if (ikb) memcpy(yb.data(), ik.y->data, M * N * 4);
  double md = 0, mx = 0;
  for (int64_t i = 0; i < M * N; ++i) { md = std::max(md, (double)std::fabs(ya[i] - yb[i])); mx = std::max(mx, (double)std::fabs(ya[i])); }
  std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
  double fl = 2.0 * M * N * K / 1e9;
  printf("%-6s M=%4ld N=%5ld K=%5ld t=%d  A %7.3f ms (%5.1f GF/s)  B %7.3f ms (%5.1f GF/s)  B/A speed %.3f  maxdiff/max %.2e\n", t.c_str(), (long)M, (long)N, (long)K, nt,
         ta[0] * 1e3, fl / ta[0], tb[0] * 1e3, fl / tb[0], ta[0] / tb[0], md / mx);
}
