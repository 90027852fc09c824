// What the AMX kernels share (qlinear_amx.cpp, flash_amx.cpp): the tile configuration and the bf16
// pair interleave of the VNNI layouts. Each includer compiles them for its own target (its #pragma,
// with amx-tile and avx512bf16, precedes this include); internal linkage keeps the builds apart.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace kvl {
namespace {

// The tile configuration every call loads: eight tiles of 16 rows x 64 bytes (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
  }
};

// Word 2l of the result = a's lane l, word 2l+1 = b's lane l (bf16, round to nearest even): one VNNI
// tile row of a pair (of inputs for 16 outputs, or of keys for 16 query rows). cvtne2ps_pbh(b, a)
// gives a's 16 words, then b's; vpermw interleaves.
inline __m512i pair_bf16(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

}  // namespace
}  // namespace kvl
