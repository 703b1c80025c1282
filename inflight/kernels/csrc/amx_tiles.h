// AMX tile helpers for the kernels that use tiles (amx_linear.cpp, prompt_attention.cpp).
// INFLIGHT_AMX is defined where the build targets a CPU with AMX tiles and bfloat16 tile
// products (the extension is built with -march=native).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define INFLIGHT_AMX 1

namespace inflight_amx {

// Linux lets a process use AMX tile data only after asking (arch_prctl); asked once per
// process, whichever kernel asks first.
inline bool tile_permission() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The 64-byte tile configuration (palette 1): rows and bytes per row of each tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes (16 x 16 float32 or 16 x 32 bfloat16 each), the shape
// the linear kernels use for every tile.
inline void load_full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // GCC's ldtilecfg builtin is not known to read its operand: a variant of this function
  // with row counts from an argument had the stores above dropped as dead and loaded stack
  // garbage (a #GP, SIGSEGV). The compiler barrier keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace inflight_amx
#endif
