// What the AMX kernels share: the build guard, Linux's permission for the tile state, one tile layout.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define ENGINE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// Linux hands out the AMX tile state on request, once per process (oneDNN asks too; asking twice is fine).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Every tile register as 16 rows of 64 bytes: 16 x 16 float32, or 16 x 32 bf16.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
  }
};
#endif
