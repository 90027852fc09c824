// The packed quantized linear (qlinear.h's layouts) on AMX tiles, for bf16 activations of batched
// decodes and prefill chunks: each 16-row block of the weights is dequantized once per call, group by
// group, into the bf16 tile layout (w = d*q + m for int4, d*q for int8, computed in float and rounded
// to bf16: the values the AMX copy of model/linear.py holds), and TDPBF16PS multiplies it with the
// activations' rows 16 at a time, accumulating in float over the whole input dimension. The weights
// stay int4/int8 in memory (a quarter/half of bf16's bytes) and the per-group scaling of the VNNI path
// (a float multiply-add per activation row, group and 16 outputs, which bounds it from ~8 rows up) is
// gone: the scaling is in the dequantization, done once per call whatever the row count.
// Compiled for AMX whatever the build flags; ops.cpp calls it only where amx_ready() says the CPU has
// AMX-BF16 and the kernel let this process use the tile registers.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma,amx-tile,amx-bf16")
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "qlinear.h"

namespace kvl {
namespace {

constexpr int kTileRows = 16;  // activation rows per A tile, 16 output rows per weight block
constexpr int kGroupBytes = 1024;  // one group's B tile: 16 rows (pairs of inputs) x 16 outputs x 2 bf16

bool request_tiles() {
  // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); the
  // grant is per process, so once is enough (oneDNN asks the same way).
#if defined(__linux__) && defined(SYS_arch_prctl)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane l's byte j (unsigned) as a float.
template <int J> inline __m512 ubyte(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * J), _mm512_set1_epi32(0xff)));
}
// Lane l's byte j (signed) as a float.
template <int J> inline __m512 sbyte(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * J), 24));
}

// int4 block b, group g -> its B tile: chunk c holds inputs 8c..8c+3 in the low nibbles (one input per
// byte of each output's lane) and 8c+4..8c+7 in the high ones, so each nibble half gives two tile rows.
void dequant_q4(const uint8_t* wg, const uint16_t* s, uint8_t* tile) {
  const __m512 d = half16(s), m = half16(s + 16);
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512i* out = reinterpret_cast<__m512i*>(tile);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(wg + c * 64);
    const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    const __m512i* halves[2] = {&lo, &hi};
    for (int h = 0; h < 2; ++h) {
      const __m512i x = *halves[h];
      const __m512 w0 = _mm512_fmadd_ps(ubyte<0>(x), d, m), w1 = _mm512_fmadd_ps(ubyte<1>(x), d, m);
      const __m512 w2 = _mm512_fmadd_ps(ubyte<2>(x), d, m), w3 = _mm512_fmadd_ps(ubyte<3>(x), d, m);
      _mm512_store_si512(out + 4 * c + 2 * h, pair_bf16(w0, w1));
      _mm512_store_si512(out + 4 * c + 2 * h + 1, pair_bf16(w2, w3));
    }
  }
}

// int8 block b, group g -> its B tile: chunk c holds inputs 4c..4c+3 (one per byte of each lane).
void dequant_q8(const int8_t* wg, const uint16_t* s, uint8_t* tile) {
  const __m512 d = half16(s);
  __m512i* out = reinterpret_cast<__m512i*>(tile);
  for (int c = 0; c < 8; ++c) {
    const __m512i v = _mm512_loadu_si512(wg + c * 64);
    const __m512 w0 = _mm512_mul_ps(sbyte<0>(v), d), w1 = _mm512_mul_ps(sbyte<1>(v), d);
    const __m512 w2 = _mm512_mul_ps(sbyte<2>(v), d), w3 = _mm512_mul_ps(sbyte<3>(v), d);
    _mm512_store_si512(out + 2 * c, pair_bf16(w0, w1));
    _mm512_store_si512(out + 2 * c + 1, pair_bf16(w2, w3));
  }
}

// y rows [r0, r0 + rows) at outputs 16b.. from a C tile's floats (round to nearest even, NaN kept).
void write_rows(const float* c, uint16_t* y, long N, long r0, long rows, long b) {
  for (long r = 0; r < rows; ++r) {
    const __m512 v = _mm512_loadu_ps(c + r * 16);
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rr = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rr = _mm512_mask_mov_epi32(rr, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * N + b * 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rr, 16)));
  }
}

// Rows [r0, r0 + 16 * (1 + TWO_A)) of the (padded) activations times blocks b (and b + 1 with TWO_B),
// whose dequantized tiles are at bt[0] (and bt[1]), over all G groups.
// side(g) runs after group g's products are issued: the next block pair's dequantization, on the
// vector units while the tile unit multiplies (their work overlaps instead of adding up).
template <bool TWO_A, bool TWO_B, typename F>
void tiles(const uint16_t* x, long K, long G, long r0, const uint8_t* bt0, const uint8_t* bt1, float* c, F&& side) {
  _tile_zero(4);
  if (TWO_B) _tile_zero(5);
  if (TWO_A) _tile_zero(6);
  if (TWO_A && TWO_B) _tile_zero(7);
  const uint16_t* xa = x + r0 * K;
  for (long g = 0; g < G; ++g) {
    _tile_loadd(0, xa + g * 32, K * 2);
    if (TWO_A) _tile_loadd(1, xa + kTileRows * K + g * 32, K * 2);
    _tile_loadd(2, bt0 + g * kGroupBytes, 64);
    if (TWO_B) _tile_loadd(3, bt1 + g * kGroupBytes, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (TWO_B) _tile_dpbf16ps(5, 0, 3);
    if (TWO_A) _tile_dpbf16ps(6, 1, 2);
    if (TWO_A && TWO_B) _tile_dpbf16ps(7, 1, 3);
    side(g);
  }
  _tile_stored(4, c, 64);
  if (TWO_B) _tile_stored(5, c + 256, 64);
  if (TWO_A) _tile_stored(6, c + 512, 64);
  if (TWO_A && TWO_B) _tile_stored(7, c + 768, 64);
}

}  // namespace

bool amx_ready() {
  static const bool ok = request_tiles();
  return ok;
}

void q_amx(const uint16_t* x, long M, long Mpad, long K, int bits, const void* w, const uint16_t* scales, uint16_t* y,
           long N, long p0, long p1) {
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
  const long G = K / 32, NB = N / 16;
  // This task's dequantized block pairs, every group: the current one and the next (filled while the
  // current one's products run).
  // (Per thread and kept: a call per projection, 120 a decode step, need not allocate.)
  thread_local std::vector<uint8_t> buf;
  buf.resize(std::max(buf.size(), static_cast<size_t>(4 * G * kGroupBytes + 64)));
  uint8_t* cur = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  uint8_t* nxt = cur + 2 * G * kGroupBytes;
  auto dequant = [&](long p, long g, uint8_t* dst) {
    for (long j = 0; j < (2 * p + 1 < NB ? 2 : 1); ++j) {
      const long i = (2 * p + j) * G + g;
      uint8_t* tile = dst + (j * G + g) * kGroupBytes;
      if (bits == 4) dequant_q4(static_cast<const uint8_t*>(w) + i * 256, scales + i * 32, tile);
      else dequant_q8(static_cast<const int8_t*>(w) + i * 512, scales + i * 16, tile);
    }
  };
  for (long g = 0; g < G; ++g) dequant(p0, g, cur);
  alignas(64) float c[4 * 256];
  for (long p = p0; p < p1; ++p) {
    const long b = 2 * p;
    const bool two_b = b + 1 < NB;
    const uint8_t* bt1 = cur + G * kGroupBytes;
    for (long r0 = 0; r0 < Mpad; r0 += 2 * kTileRows) {
      const bool two_a = r0 + kTileRows < Mpad;
      const bool ahead = r0 == 0 && p + 1 < p1;
      auto side = [&](long g) {
        if (ahead) dequant(p + 1, g, nxt);
      };
      if (two_a && two_b) tiles<true, true>(x, K, G, r0, cur, bt1, c, side);
      else if (two_a) tiles<true, false>(x, K, G, r0, cur, bt1, c, side);
      else if (two_b) tiles<false, true>(x, K, G, r0, cur, bt1, c, side);
      else tiles<false, false>(x, K, G, r0, cur, bt1, c, side);
      for (int a = 0; a < (two_a ? 2 : 1); ++a) {
        const long ra = r0 + a * kTileRows;
        const long rows = std::min<long>(kTileRows, M - ra);
        if (rows <= 0) continue;
        write_rows(c + a * 512, y, N, ra, rows, b);
        if (two_b) write_rows(c + a * 512 + 256, y, N, ra, rows, b + 1);
      }
    }
    std::swap(cur, nxt);
  }
  _tile_release();
}

}  // namespace kvl

#else  // no AMX off x86-64: the VNNI/portable paths serve every call

#include "qlinear.h"

namespace kvl {
bool amx_ready() { return false; }
void q_amx(const uint16_t*, long, long, long, int, const void*, const uint16_t*, uint16_t*, long, long, long) {}
}  // namespace kvl

#endif
