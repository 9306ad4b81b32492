// ldtilecfg's operand and its load, for the kernels that run on AMX tiles (quant_matmul's panel
// engine, mla_decode's prompt attention). The struct is plain data (the engine's emulation reads it
// at every level); the load only where the compiler has the tile intrinsics.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

namespace IKJ_NS {

// ldtilecfg's 64-byte operand (palette 1: 8 tiles of at most 16 rows x 64 bytes).
struct alignas(64) TileCfg {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of tile t
  uint8_t rows[16];    // rows of tile t
};
static_assert(sizeof(TileCfg) == 64, "ldtilecfg takes 64 bytes");

// Palette 1 with every tile 16 rows x 64 bytes (the bf16 forms' C, A and B tiles alike).
inline TileCfg tiles_16x64() {
  TileCfg c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  return c;
}

#if defined(__AMX_TILE__)
inline void load_tile_config(const TileCfg& c) {
  // GCC does not see ldtilecfg read its operand: without this barrier it dropped the rows / colsb
  // stores of a config built just before it in a function of its own (every tile op then raised
  // SIGILL; RESULTS §26aa)
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}
#endif

}  // namespace IKJ_NS
