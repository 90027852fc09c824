// Causal prefill attention in bf16 on AMX tiles, 16 query rows a call, transposed: the tile unit
// computes S^T = K Q^T (16 keys x 16 rows a C tile) and O^T += V^T P^T (16 dims x 16 rows), so each
// softmax quantity of the 16 rows is one vector (a row per lane) and the online softmax needs no
// horizontal reduction: a chunk's max over keys is a vertical max over its key vectors, and two key
// vectors of probabilities interleave into one row of P^T's VNNI tile. The row sums come from the tile
// unit too: V^T carries a row of ones after the head's dims (amx_pack), so O^T's row D sums P exactly
// as P @ V uses it (rounded to bf16, as flash_bf16.cpp and torch's CPU flash attention use it).
// Scores go to base 2 in one multiply (scale * log2 e), the exponential is 2^x with a degree-5
// polynomial (relative error < 3e-6, far under bf16's 2^-9), and only the chunks that reach past a
// row's position (the diagonal ones) are masked.
// Layouts (per extend and KV head, amx_pack; flash.h): K rows as they are ([Sp][D]), V transposed with
// the ones row ([D + 16][amx_v_stride(Sp)]); the rows' queries go to Q^T's VNNI layout ([D/2][16][2])
// once a call.
// Compiled for AMX whatever the build flags; ops.cpp calls it only where amx_ready() says the CPU has
// AMX-BF16 and this process may use the tile registers.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,amx-tile,amx-bf16")
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "amx_tiles.h"
#include "flash.h"
#include "simd512.h"

namespace kvl {
namespace {

constexpr int kRows = kAmxFlashRows;  // 16: a tile's columns (one lane per query row)
constexpr int kChunk = 128;           // keys per online-softmax step (computed 32 at a time)

inline __m512i lane16() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// 2^x on 16 floats, x <= 0 (clamped at -126): 2^n * p(f), f = x - n in [-1/2, 1/2], p the Taylor
// polynomial of e^(f ln 2) of degree 5.
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

void amx_pack(const bf16* k, const bf16* v, const int64_t* locs, long S, int D, bf16* kr, bf16* vt) {
  const long Sp = flash_padded(S), Vs = amx_v_stride(Sp);
  for (long s = 0; s < Sp; ++s) {
    if (s < S) std::memcpy(kr + s * D, k + locs[s] * D, sizeof(bf16) * D);
    else std::memset(kr + s * D, 0, sizeof(bf16) * D);
  }
  for (int d = 0; d < D; ++d) std::memset(vt + d * Vs + S, 0, sizeof(bf16) * (Sp - S));
  for (long s = 0; s < S; ++s) {
    const bf16* src = v + locs[s] * D;
    for (int d = 0; d < D; ++d) vt[d * Vs + s] = src[d];
  }
  // The ones row (bf16 1.0 = 0x3f80) that makes O^T's row D the sum of P, then 15 rows of zeros.
  for (long s = 0; s < Sp; ++s) vt[D * Vs + s] = 0x3f80;
  for (int d = D + 1; d < D + 16; ++d) std::memset(vt + d * Vs, 0, sizeof(bf16) * Sp);
}

void flash_rows_amx(const AmxFlashRows& r, const bf16* kr, const bf16* vt, long Sp, int D, float scale,
                    float* scratch) {
  static const TileConfig cfg;
  _tile_loadconfig(&cfg);
  const int n = r.n;
  const int DS = D + 16;  // O^T's rows: the dims, then the sum of P (row D) and 15 unused
  const long Vs = amx_v_stride(Sp);
  // scratch: Q^T [D/2][16][2] bf16, S^T [kChunk][16] floats, P^T [kChunk/2][16][2] bf16, O^T [DS][16] floats
  bf16* qt = reinterpret_cast<bf16*>(scratch);
  float* st = scratch + kRows * D / 2;
  bf16* pt = reinterpret_cast<bf16*>(st + kChunk * kRows);
  float* ot = reinterpret_cast<float*>(pt + kChunk * kRows);
  alignas(64) int32_t lim32[kRows];
  long last = 0, min_lim = r.limit[0];  // the last key any row sees, and every row
  for (int i = 0; i < kRows; ++i) {
    const int ri = i < n ? i : n - 1;  // missing rows repeat the last one (computed, not written)
    const bf16* q = r.q[ri];
    min_lim = std::min(min_lim, r.limit[ri]);
    // Row i's dim pairs (one 32-bit word each) to column i of Q^T: word d2 goes to word d2 * 16 + i.
    const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(lane16(), _mm512_set1_epi32(kRows)), _mm512_set1_epi32(i));
    for (int d2 = 0; d2 < D / 2; d2 += 16)
      _mm512_i32scatter_epi32(qt + 2 * d2 * kRows, at, _mm512_loadu_si512(q + 2 * d2), 4);
    lim32[i] = static_cast<int32_t>(r.limit[ri]);
    if (r.limit[ri] > last) last = r.limit[ri];
  }
  std::memset(ot, 0, sizeof(float) * kRows * DS);
  const __m512 c2 = _mm512_set1_ps(scale * 1.44269504f);  // scores to base 2
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lim = _mm512_load_si512(lim32);
  __m512 m = ninf;  // running max per row, base 2
  for (long c0 = 0; c0 <= last; c0 += kChunk) {
    const int keys = static_cast<int>(std::min<long>(kChunk, last - c0 + 1));
    const int blocks = (keys + 31) / 32;  // 32-key blocks this chunk computes (Sp pads to 64)
    // S^T for 32 keys (two tiles of 16) x 16 rows at a time, over the head's dims 32 at a time.
    for (int b = 0; b < blocks; ++b) {
      const long k0 = c0 + 32 * b;
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(2, qt + c * 32 * kRows, 64);  // Q^T's 16 dim pairs of this part of the head
        _tile_loadd(3, kr + k0 * D + 32 * c, D * 2);
        _tile_loadd(4, kr + (k0 + 16) * D + 32 * c, D * 2);
        _tile_dpbf16ps(0, 3, 2);
        _tile_dpbf16ps(1, 4, 2);
      }
      _tile_stored(0, st + 32 * b * kRows, 64);
      _tile_stored(1, st + (32 * b + 16) * kRows, 64);
    }
    // The chunk's max per row (raw scores; the scale is positive). Only chunks that reach past some
    // row's position are masked (a key past a row's position: -inf, stored back for the next pass).
    const bool masked = c0 + keys - 1 > min_lim;
    __m512 cmax = ninf;
    if (masked) {
      for (int j = 0; j < keys; ++j) {
        const __mmask16 ok = _mm512_cmpge_epi32_mask(lim, _mm512_set1_epi32(static_cast<int>(c0 + j)));
        const __m512 sj = _mm512_mask_mov_ps(ninf, ok, _mm512_loadu_ps(st + j * kRows));
        _mm512_storeu_ps(st + j * kRows, sj);
        cmax = _mm512_max_ps(cmax, sj);
      }
    } else {
      for (int j = 0; j < keys; ++j) cmax = _mm512_max_ps(cmax, _mm512_loadu_ps(st + j * kRows));
    }
    const __m512 mnew = _mm512_max_ps(m, _mm512_mul_ps(cmax, c2));
    // alpha = 2^(m - mnew): 0 where m was -inf (no key yet), 1 where the max did not move.
    const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ), exp2_16(_mm512_sub_ps(m, mnew)));
    m = mnew;
    // Probabilities 2^(s * c2 - m), two keys to a VNNI row; masked keys exactly 0.
    for (int j = 0; j < 32 * blocks; j += 2) {
      __m512 p[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int h = 0; h < 2 && j + h < keys; ++h) {
        const __m512 s = _mm512_loadu_ps(st + (j + h) * kRows);
        p[h] = exp2_16(_mm512_fmsub_ps(s, c2, mnew));
        if (masked) p[h] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, ninf, _CMP_NEQ_OQ), p[h]);
      }
      _mm512_storeu_si512(pt + j * kRows, pair_bf16(p[0], p[1]));
    }
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_OQ)) {
      for (int d = 0; d <= D; ++d) _mm512_storeu_ps(ot + d * kRows, _mm512_mul_ps(_mm512_loadu_ps(ot + d * kRows), alpha));
    }
    // O^T += V^T P^T: 64 rows' accumulators in four tiles at once, the chunk's 32-key blocks in turn;
    // then the sum row's tile.
    for (int d0 = 0; d0 < DS; d0 += 64) {
      const int t = std::min(4, (DS - d0) / 16);  // accumulator tiles 0, 1, 6, 7 (tile ids are immediates)
      _tile_loadd(0, ot + d0 * kRows, 64);
      if (t > 1) _tile_loadd(1, ot + (d0 + 16) * kRows, 64);
      if (t > 2) _tile_loadd(6, ot + (d0 + 32) * kRows, 64);
      if (t > 3) _tile_loadd(7, ot + (d0 + 48) * kRows, 64);
      for (int b = 0; b < blocks; ++b) {
        const bf16* vb = vt + d0 * Vs + c0 + 32 * b;
        _tile_loadd(2, pt + 32 * b * kRows, 64);
        _tile_loadd(3, vb, Vs * 2);
        _tile_dpbf16ps(0, 3, 2);
        if (t > 1) {
          _tile_loadd(4, vb + 16 * Vs, Vs * 2);
          _tile_dpbf16ps(1, 4, 2);
        }
        if (t > 2) {
          _tile_loadd(3, vb + 32 * Vs, Vs * 2);
          _tile_dpbf16ps(6, 3, 2);
        }
        if (t > 3) {
          _tile_loadd(4, vb + 48 * Vs, Vs * 2);
          _tile_dpbf16ps(7, 4, 2);
        }
      }
      _tile_stored(0, ot + d0 * kRows, 64);
      if (t > 1) _tile_stored(1, ot + (d0 + 16) * kRows, 64);
      if (t > 2) _tile_stored(6, ot + (d0 + 32) * kRows, 64);
      if (t > 3) _tile_stored(7, ot + (d0 + 48) * kRows, 64);
    }
  }
  _tile_release();
  const __m512i cols = _mm512_mullo_epi32(lane16(), _mm512_set1_epi32(kRows));
  for (int i = 0; i < n; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / ot[D * kRows + i]);  // >= 1 key: the row's own
    // Row i of O: column i of O^T, 16 dims a gather.
    for (int d = 0; d < D; d += 16)
      store16(r.out[i] + d, _mm512_mul_ps(_mm512_i32gather_ps(cols, ot + d * kRows + i, 4), inv));
  }
}

}  // namespace kvl

#else  // no AMX off x86-64: flash_bf16.cpp's rows serve every call

#include "flash.h"

namespace kvl {
void amx_pack(const bf16*, const bf16*, const int64_t*, long, int, bf16*, bf16*) {}
void flash_rows_amx(const AmxFlashRows&, const bf16*, const bf16*, long, int, float, float*) {}
}  // namespace kvl

#endif
