// Causal attention of prefill chunks in bf16 with AVX512-BF16 (vdpbf16ps: 32 bf16 products summed in
// pairs into 16 float lanes per instruction), compiled for that ISA whatever the build flags and called
// only where the CPU reports it (ops.cpp). Flash attention's loop, laid out for the instruction:
//  - one KV head's keys are packed once per extend in blocks of 16 keys x (head_dim/2) pairs, so a
//    register holds one pair of dims of 16 keys and a broadcast query pair makes 16 scores at once;
//  - values are packed in key pairs x head_dim, so a broadcast pair of probabilities adds two keys'
//    values to 16 output dims at once;
//  - a tile of 4 query rows shares every K and V register load; keys go by in chunks of 64 with an
//    online softmax (running max and sum per row), probabilities rounded to bf16 as torch's CPU flash
//    attention rounds them for its P @ V.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash.h"
#include "simd512.h"

namespace kvl {
namespace {

constexpr int kRows = kFlashRows;
constexpr int kChunk = 64;  // keys per online-softmax step (4 blocks of 16)

inline __m512 bcast_pair(const bf16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(v)));
}

inline __m512 dot(__m512 acc, __m512 a, __m512 b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

}  // namespace

namespace {

// A row of D float8 e4m3 values widened to bf16, exactly (3 mantissa bits and e4m3's range fit bf16):
// load16 gives value / kF8Unit as float, the product by kF8Unit is exact, so is the rounding to bf16.
inline void widen_row(const f8* src, int D, bf16* dst) {
  const __m512 unit = _mm512_set1_ps(kF8Unit);
  for (int d = 0; d < D; d += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(load16(src + d), unit));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), reinterpret_cast<const __m256i&>(h));
  }
}

// Rows of the pool as bf16: a bf16 row as it lies, a float8 row widened into buf.
inline const bf16* row_bf16(const bf16* src, int, bf16*) { return src; }
inline const bf16* row_bf16(const f8* src, int D, bf16* buf) {
  widen_row(src, D, buf);
  return buf;
}

template <typename C>
void pack_t(const C* k, const C* v, const int64_t* locs, long S, int D, bf16* kt, bf16* vt) {
  const long Sp = flash_padded(S);
  const int D2 = D / 2;
  std::vector<bf16> wide(std::is_same_v<C, f8> ? 2 * D : 0);  // two widened rows (V's pairs)
  bf16* buf[2] = {wide.data(), wide.data() + (wide.empty() ? 0 : D)};
  uint32_t* k32 = reinterpret_cast<uint32_t*>(kt);
  for (long s = 0; s < Sp; ++s) {
    uint32_t* dst = k32 + (s / 16) * D2 * 16 + (s % 16);
    if (s < S) {
      const bf16* row = row_bf16(k + locs[s] * D, D, buf[0]);
      for (int d2 = 0; d2 < D2; ++d2) std::memcpy(dst + d2 * 16, row + 2 * d2, 4);
    } else {
      for (int d2 = 0; d2 < D2; ++d2) dst[d2 * 16] = 0;
    }
  }
  for (long s = 0; s < Sp; s += 2) {
    bf16* dst = vt + (s / 2) * D * 2;
    for (int j = 0; j < 2; ++j) {
      const bf16* src = s + j < S ? row_bf16(v + locs[s + j] * D, D, buf[j]) : nullptr;
      for (int d = 0; d < D; ++d) dst[d * 2 + j] = src ? src[d] : bf16{0};
    }
  }
}

}  // namespace

void flash_pack(const bf16* k, const bf16* v, const int64_t* locs, long S, int D, bf16* kt, bf16* vt) {
  pack_t(k, v, locs, S, D, kt, vt);
}

void flash_pack(const f8* k, const f8* v, const int64_t* locs, long S, int D, bf16* kt, bf16* vt) {
  pack_t(k, v, locs, S, D, kt, vt);
}

void flash_rows(const FlashRows& r, const bf16* kt, const bf16* vt, int D, float scale, float* scratch) {
  const int D2 = D / 2;
  const int n = r.n;
  // scratch: scores [kRows][kChunk] floats, probabilities [kRows][kChunk] bf16, out [kRows][D] floats
  float* s_buf = scratch;
  bf16* p_buf = reinterpret_cast<bf16*>(s_buf + kRows * kChunk);
  float* o_buf = reinterpret_cast<float*>(p_buf + kRows * kChunk);
  float m[kRows], l[kRows], alpha[kRows];
  const bf16* q[kRows];
  long last = 0;  // the last key any row sees
  for (int i = 0; i < kRows; ++i) {
    const int ri = i < n ? i : n - 1;  // missing rows repeat the last one (computed, not written)
    q[i] = r.q[ri];
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.f;
    if (r.limit[ri] > last) last = r.limit[ri];
  }
  std::memset(o_buf, 0, sizeof(float) * kRows * D);
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (long c0 = 0; c0 <= last; c0 += kChunk) {
    // Scores of the 4 rows x 64 keys: each K register (one dim pair of 16 keys) serves every row.
    __m512 acc[kRows][4];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    const bf16* kc = kt + (c0 / 16) * D2 * 32;
    for (int d2 = 0; d2 < D2; ++d2) {
      __m512 kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(kc + (j * D2 + d2) * 32));
      for (int i = 0; i < kRows; ++i) {
        const __m512 qb = bcast_pair(q[i] + 2 * d2);
        for (int j = 0; j < 4; ++j) acc[i][j] = dot(acc[i][j], kv[j], qb);
      }
    }
    // Online softmax per row; keys past a row's own position are masked out.
    for (int i = 0; i < kRows; ++i) {
      const long lim = r.limit[i < n ? i : n - 1];
      __m512 s[4];
      __mmask16 ok[4];
      __m512 mx = ninf;
      for (int j = 0; j < 4; ++j) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0 + 16 * j)));
        ok[j] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lim)));
        s[j] = _mm512_mask_mov_ps(ninf, ok[j], _mm512_mul_ps(acc[i][j], vscale));
        mx = _mm512_max_ps(mx, s[j]);
      }
      const float cmax = _mm512_reduce_max_ps(mx);
      const float mnew = cmax > m[i] ? cmax : m[i];
      if (mnew == -std::numeric_limits<float>::infinity()) {  // no key of this chunk for this row
        alpha[i] = 1.f;
        std::memset(p_buf + i * kChunk, 0, sizeof(bf16) * kChunk);
        continue;
      }
      alpha[i] = m[i] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[i] - mnew);
      m[i] = mnew;
      const __m512 vm = _mm512_set1_ps(mnew);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < 4; j += 2) {
        // masked keys: exactly 0 (exp16 clamps its input, so exp(-inf) would be 1e-38)
        const __m512 p0 = _mm512_maskz_mov_ps(ok[j], exp16(_mm512_sub_ps(s[j], vm)));
        const __m512 p1 = _mm512_maskz_mov_ps(ok[j + 1], exp16(_mm512_sub_ps(s[j + 1], vm)));
        // The sum is of the probabilities as P @ V will use them (rounded to bf16).
        const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(p_buf + i * kChunk + 16 * j, reinterpret_cast<const __m512i&>(pb));
        sum = _mm512_add_ps(sum, _mm512_add_ps(load16(p_buf + i * kChunk + 16 * j),
                                               load16(p_buf + i * kChunk + 16 * j + 16)));
      }
      l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    }
    // P @ V: each V register (16 dims of a key pair) serves every row; 64 dims of output at a time.
    const long pairs = (last - c0 + 1 < kChunk ? last - c0 + 2 : kChunk) / 2;  // pairs that any row sees
    for (int d0 = 0; d0 < D; d0 += 64) {
      __m512 o[kRows][4];
      for (int i = 0; i < kRows; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        for (int c = 0; c < 4; ++c) o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o_buf + i * D + d0 + 16 * c), a);
      }
      const bf16* vc = vt + (c0 / 2) * D * 2 + d0 * 2;
      for (long kp = 0; kp < pairs; ++kp) {
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(vc + kp * D * 2 + c * 32));
        for (int i = 0; i < kRows; ++i) {
          const __m512 pb = bcast_pair(p_buf + i * kChunk + 2 * kp);
          for (int c = 0; c < 4; ++c) o[i][c] = dot(o[i][c], vv[c], pb);
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o_buf + i * D + d0 + 16 * c, o[i][c]);
    }
  }
  for (int i = 0; i < n; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / l[i]);  // >= 1 key: the row's own
    for (int d = 0; d < D; d += 16) store16(r.out[i] + d, _mm512_mul_ps(_mm512_loadu_ps(o_buf + i * D + d), inv));
  }
}

}  // namespace kvl
