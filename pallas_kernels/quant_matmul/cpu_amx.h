// The AMX int8 prompt engine (issue 26 item 2), internal to quant_matmul: declared in every level's
// namespace, implemented in cpu_kernel_amx.cc. Only the amx level (cpu/isa.h) runs tiles on the
// hardware; every level compiles the same engine over an exact scalar emulation of the tile
// operations, which is how the tiling and packing are tested on CPUs without AMX
// (qgemm_amx_emulated, tests/test_cpu_amx.py).
//
// Operands: the avx512 int8 prompt engine's (cpu_kernel.cc), unchanged:
// - x8 pack: [M][K] bytes q + 128 (unsigned, tdpbusd's first operand), then dx [M][K / 32] and
//   dx * sum(q) [M][K / 32] floats (x8_dx_offset / x8_ds_offset);
// - panel of 32 weight rows, per block of 32 (kBlk bytes, kBlkMin with a minimum): [0, 512) rows
//   0-15 and [512, 1024) rows 16-31 as 8 quads x 16 rows x 4 bytes (signed values): exactly AMX's
//   VNNI layout of a B tile of 8 rows x 64 bytes (K = 32 in groups of 4 bytes); [1024, 1152) the
//   int32 -128 * sum(w) per row (removes x's +128 exactly); [1152, 1280) dw per row; [1280, 1408)
//   mw per row (types with a minimum: + mw * dx * sum(q_x)).
#pragma once

#include <cstdint>
#include <string>

#ifndef IKJ_NS
#error "cpu_amx.h is included by the per-level kernel sources only"
#endif

namespace IKJ_NS {
namespace amx {

constexpr int64_t kBlk = 1280;     // panel bytes per block (as the avx512 engine's QBLK)
constexpr int64_t kBlkMin = 1408;  // with the minimum (QBLK_MIN)
constexpr int kPanelRows = 32;     // weight rows per panel (QNR)
// (Rows of x from which the amx level multiplies on tiles: ikj::amx_min_rows(), cpu/isa.h; at least
// one A tile, 16 rows.)

// Whether the engine takes `type`: the avx512 engine's six legacy types plus Q4_K / Q5_K / IQ4_XS
// (one scale per 32 weights, as the avx2 engine: a block of theirs is a Q4_1 / Q5_1 / IQ4_NL block
// with dw = d * scale, mw = -dmin * min).
bool type_ok(int type);
bool type_has_min(int type);  // the kBlkMin layout
// The portable panel builder (scalar, every type above): weight rows [p0, p0 + nr) (nr <= 32,
// missing rows zero) of nb blocks into the panel layout; false for a type it does not take. The
// emulated engine's; on the hardware the avx512 engine's vectorized build_panel_q8 builds the same
// bytes (its K-quant blocks, wvals / wscale, written to match this one).
bool build_panel(int type, const uint8_t* w, int64_t row_bytes, int64_t p0, int64_t nr, int64_t nb,
                 uint8_t* panel);
// The portable x8 pack (scalar; the avx512 pack_x8's arithmetic): rows [0, M) into out, which
// holds x8_bytes(M, K).
void pack_x8(const float* x, int64_t M, int64_t K, uint8_t* out);
int64_t x8_dx_offset(int64_t M, int64_t K);
int64_t x8_ds_offset(int64_t M, int64_t K);
int64_t x8_bytes(int64_t M, int64_t K);

// The bf16 form (the amx level's default where the CPU has amx_bf16; IKJAX_AMX=int8 keeps the int8
// form): each block of a panel converted to its weights' values dw * v + mw in bf16, laid out as two
// tdpbf16ps B tiles (16 pair rows x 16 columns x 2: element [k / 2][n][k % 2]), kBfBlk uint16 a
// block; x as bf16 rows [bf_rows(M)][bf_ld(K)] (the rows past M zero). C accumulates in f32 tiles
// over the whole K and is stored once. Why: the int8 form stores every block's int32 sums and
// scales them on the vector unit (dw * dx per block and row), ~4x the tiles' own time, which left
// the amx level 1.05x the avx512 level's vpdpbusd (RESULTS §26g); bf16 products need no per-block
// scale. Its arithmetic is the avx512 level's bf16 compute (x and w rounded to bf16, f32 sums).
constexpr int64_t kBfBlk = 1024;
inline int64_t bf_rows(int64_t M) { return (M + 31) / 32 * 32; }
inline int64_t bf_ld(int64_t K) { return K + 32; }  // + 64 bytes: 16 rows of a tile not 4 KiB apart
// The portable forms (scalar; the emulated engine's): a panel's nb blocks into bf16 blocks at out,
// x's M rows into bf16 rows (rows M .. bf_rows(M) zeroed).
void panel_to_bf16(const uint8_t* panel, int64_t nb, bool has_min, uint16_t* out);
void x_to_bf16(const float* x, int64_t M, int64_t K, uint16_t* out);

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define IKJ_HAVE_AMX_TILES 1
// y[m * ldy + j] = the product of x8 rows [0, M) (M >= 1) and panel columns j < nr, on the
// hardware's tiles (the calling thread configures them and releases them before returning).
void panel_gemm_hw(const uint8_t* xu, int64_t M, int64_t K, const float* dx, const float* ds, const uint8_t* panel,
                   int64_t nb, bool has_min, float* y, int64_t ldy, int64_t nr);
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define IKJ_HAVE_AMX_BF16 1
// The bf16 form on the hardware: the panel's blocks converted (AVX-512 BF16, the same bits as
// panel_to_bf16), then y rows [0, M) x columns [0, nr) from the bf16 x rows xb (row stride ldx);
// prefetch: x's rows two blocks ahead into L1 (amx_prefetch(); the same results either way).
void panel_to_bf16_hw(const uint8_t* panel, int64_t nb, bool has_min, uint16_t* out);
void panel_gemm_bf16_hw(const uint16_t* xb, int64_t ldx, int64_t M, const uint16_t* bp, int64_t nb, float* y,
                        int64_t ldy, int64_t nr, bool prefetch);
#endif
#endif

}  // namespace amx
}  // namespace IKJ_NS
