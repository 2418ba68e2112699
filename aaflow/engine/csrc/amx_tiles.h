// AMX set-up shared by the engine's AMX kernels: the tile configuration (every tile 16 rows x 64
// bytes) and Linux's per-process grant of AMX state. Include only from sources built with
// -mamx-tile -mamx-bf16.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace aaflow_amx {

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {  // every tile 16 rows x 64 bytes; per thread
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = 16;
  }
  _tile_loadconfig(&config);
}

inline bool request_amx() {  // Linux hands out AMX state only on request (once per process)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

}  // namespace aaflow_amx
