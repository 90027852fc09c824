// Causal attention of prefill chunks in bf16 with AVX512-BF16 (vdpbf16ps: 32 bf16 products summed in
// pairs into 16 float lanes per instruction), compiled for that ISA whatever the build flags and called
// only where the CPU reports it (ops.cpp). Flash attention's loop, laid out for the instruction:
//  - one KV head's keys are packed once per extend in blocks of 16 keys x (head_dim/2) pairs, so a
//    register holds one pair of dims of 16 keys and a broadcast query pair makes 16 scores at once;
//  - values are packed in key pairs x head_dim, so a broadcast pair of probabilities adds two keys'
//    values to 16 output dims at once;
//  - a tile of 4 query rows shares every K and V register load; keys go by in chunks of 64, each chunk's
//    softmax partial computed alone and folded into the row's state in order (flash.h: the order every
//    attention kernel of the cpu backend keeps), probabilities rounded to bf16 as torch's CPU flash
//    attention rounds them for its P @ V.
// flash_chunk computes one such chunk for the query heads of one token from the pool's rows in place
// (the decode and per-token kernels' form): the same operations on the same values in the same order.
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
constexpr int kChunk = kKeyChunk;  // keys per softmax partial (4 blocks of 16)

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

namespace {

// The softmax partial of one query row over a chunk: s[j] its scores of keys 16j .. 16j + 16 (masked
// ones -inf, mask ok[j]), at least one key unmasked. The chunk's max m, the probabilities exp(s - m)
// rounded to bf16 into p[0..64) (masked ones 0), and their sum l as P @ V will use them.
inline void chunk_softmax(const __m512* s, const __mmask16* ok, bf16* p, float& m, float& l) {
  __m512 mx = s[0];
  for (int j = 1; j < 4; ++j) mx = _mm512_max_ps(mx, s[j]);
  m = _mm512_reduce_max_ps(mx);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < 4; j += 2) {
    // masked keys: exactly 0 (exp16 clamps its input, so exp(-inf) would be 1e-38)
    const __m512 p0 = _mm512_maskz_mov_ps(ok[j], exp16(_mm512_sub_ps(s[j], vm)));
    const __m512 p1 = _mm512_maskz_mov_ps(ok[j + 1], exp16(_mm512_sub_ps(s[j + 1], vm)));
    const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(p + 16 * j, reinterpret_cast<const __m512i&>(pb));
    sum = _mm512_add_ps(sum, _mm512_add_ps(load16(p + 16 * j), load16(p + 16 * j + 16)));
  }
  l = _mm512_reduce_add_ps(sum);
}

// fold_chunk's rescale factors for a row (its state M, L updated here); false for the first chunk, whose
// partial is the state as it is.
inline bool fold_factors(bool first, float& M, float& L, float m, float l, float& a, float& b) {
  if (first) {
    M = m, L = l;
    return false;
  }
  const float mn = m > M ? m : M;
  a = std::exp(M - mn), b = std::exp(m - mn);
  M = mn;
  L = L * a + l * b;
  return true;
}

// O = O * a + o * b on 16 values (fold_chunk's operations), or O = o for a first chunk.
inline void fold16(float* O, __m512 o, bool rescale, float a, float b) {
  if (!rescale) {
    _mm512_storeu_ps(O, o);
    return;
  }
  _mm512_storeu_ps(O, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(O), _mm512_set1_ps(a)),
                                    _mm512_mul_ps(o, _mm512_set1_ps(b))));
}

// fold_out on 16 values.
inline void out16(bf16* out, const float* O, float inv) {
  store16(out, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(O), _mm512_set1_ps(inv)), _mm512_setzero_ps()));
}

}  // namespace

void flash_rows(const FlashRows& r, const bf16* kt, const bf16* vt, int D, float scale, float* scratch) {
  const int D2 = D / 2;
  const int n = r.n;
  // scratch: scores [kRows][kChunk] floats, probabilities [kRows][kChunk] bf16, folded outputs [kRows][D]
  float* s_buf = scratch;
  bf16* p_buf = reinterpret_cast<bf16*>(s_buf + kRows * kChunk);
  float* o_buf = reinterpret_cast<float*>(p_buf + kRows * kChunk);
  float M[kRows], L[kRows], fa[kRows], fb[kRows];
  bool live[kRows], rescale[kRows];
  const bf16* q[kRows];
  long last = 0;  // the last key any row sees
  for (int i = 0; i < kRows; ++i) {
    const int ri = i < n ? i : n - 1;  // missing rows repeat the last one (computed, not written)
    q[i] = r.q[ri];
    M[i] = L[i] = 0.f;
    if (r.limit[ri] > last) last = r.limit[ri];
  }
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
    // Each row's partial of this chunk (keys past a row's own position masked out), folded below.
    for (int i = 0; i < kRows; ++i) {
      const long lim = r.limit[i < n ? i : n - 1];
      live[i] = lim >= c0;
      if (!live[i]) {  // no key of this chunk for this row: nothing to fold
        std::memset(p_buf + i * kChunk, 0, sizeof(bf16) * kChunk);
        continue;
      }
      __m512 s[4];
      __mmask16 ok[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0 + 16 * j)));
        ok[j] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lim)));
        s[j] = _mm512_mask_mov_ps(ninf, ok[j], _mm512_mul_ps(acc[i][j], vscale));
      }
      float m, l;
      chunk_softmax(s, ok, p_buf + i * kChunk, m, l);
      rescale[i] = fold_factors(c0 == 0, M[i], L[i], m, l, fa[i], fb[i]);
    }
    // P @ V: each V register (16 dims of a key pair) serves every row; 64 dims of output at a time, each
    // chunk's from zero, then folded into the rows' outputs.
    const long pairs = (last - c0 + 1 < kChunk ? last - c0 + 2 : kChunk) / 2;  // pairs that any row sees
    for (int d0 = 0; d0 < D; d0 += 64) {
      __m512 o[kRows][4];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < 4; ++c) o[i][c] = _mm512_setzero_ps();
      const bf16* vc = vt + (c0 / 2) * D * 2 + d0 * 2;
      for (long kp = 0; kp < pairs; ++kp) {
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(vc + kp * D * 2 + c * 32));
        for (int i = 0; i < kRows; ++i) {
          const __m512 pb = bcast_pair(p_buf + i * kChunk + 2 * kp);
          for (int c = 0; c < 4; ++c) o[i][c] = dot(o[i][c], vv[c], pb);
        }
      }
      for (int i = 0; i < kRows; ++i) {
        if (!live[i]) continue;
        for (int c = 0; c < 4; ++c) fold16(o_buf + i * D + d0 + 16 * c, o[i][c], rescale[i], fa[i], fb[i]);
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    const float inv = 1.f / L[i];  // >= 1 key: the row's own
    for (int d = 0; d < D; d += 16) out16(r.out[i] + d, o_buf + i * D + d, inv);
  }
}

namespace {

// 16 rows of 16 dwords transposed in place: r[t] lane j = the t-th dword of row j.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4g + c]: rows 4g .. 4g + 4, dword c of each 128-bit lane (dwords c, 4 + c, ...)
  for (int g = 0; g < 4; ++g) {
    const __m512i* tg = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(tg[0], tg[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(tg[0], tg[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(tg[1], tg[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(tg[1], tg[3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// 32 values of a pool row from p, as bf16 (a float8 row widened exactly).
inline __m512i load32(const bf16* p) { return _mm512_loadu_si512(p); }
inline __m512i load32(const f8* p) {
  const __m512 unit = _mm512_set1_ps(kF8Unit);
  const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_mul_ps(load16(p + 16), unit), _mm512_mul_ps(load16(p), unit));
  return reinterpret_cast<const __m512i&>(h);
}

// Prefetches the rows of K (or V) at locs[0..cnt) into L1: a request's decoded tokens lie wherever the
// pool had a free slot (a step's tokens of all requests side by side), so each row is its own cache
// miss that the hardware prefetcher cannot guess. Asked one block of 16 keys ahead.
template <typename C> inline void prefetch_rows(const C* base, const int64_t* locs, int cnt, int D) {
  const long bytes = static_cast<long>(D) * static_cast<long>(sizeof(C));
  for (int j = 0; j < cnt; ++j) {
    const char* r = reinterpret_cast<const char*>(base + locs[j] * D);
    for (long off = 0; off < bytes; off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
  }
}

template <typename C>
void chunk_t(const bf16* const* q, int nr, const C* k, const C* v, const int64_t* locs, long c0, long n, int D,
             float scale, float* m, float* l, float* o) {
  const int nk = static_cast<int>((c0 + kChunk < n ? c0 + kChunk : n) - c0);  // keys of this chunk: 1 .. 64
  const int64_t* lc = locs + c0;
  alignas(64) bf16 p_buf[kRows * kChunk];
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 s[kRows][4];
  __mmask16 ok[4];
  if (c0 == 0) prefetch_rows(k, lc, nk < 16 ? nk : 16, D);  // (a later chunk's first block: its predecessor)
  for (int jb = 0; jb < 4; ++jb) {
    const int base = 16 * jb, here = nk - base;
    ok[jb] = here <= 0 ? __mmask16(0) : here >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << here) - 1);
    for (int i = 0; i < nr; ++i) s[i][jb] = ninf;
    if (here <= 0) continue;
    // While this block's scores are summed: the next block's K rows (this chunk's, or the next chunk's
    // first) and this block's V rows (P @ V below) on their way.
    const long next = c0 + base + 16;
    if (next < n) prefetch_rows(k, locs + next, n - next < 16 ? static_cast<int>(n - next) : 16, D);
    prefetch_rows(v, lc + base, here < 16 ? here : 16, D);
    // The 16 keys' rows (past the chunk's end the last one again: masked); 32 dims at a time, transposed
    // so that a register holds one dim pair of the 16 keys, as flash_pack lays them out.
    const C* kr[16];
    for (int j = 0; j < 16; ++j) kr[j] = k + lc[base + (j < here ? j : here - 1)] * D;
    __m512 acc[kRows];
    for (int i = 0; i < nr; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < D / 32; ++g) {
      __m512i t[16];
      for (int j = 0; j < 16; ++j) t[j] = load32(kr[j] + 32 * g);
      transpose16(t);
      for (int u = 0; u < 16; ++u) {
        const __m512 kv = _mm512_castsi512_ps(t[u]);
        for (int i = 0; i < nr; ++i) acc[i] = dot(acc[i], kv, bcast_pair(q[i] + 2 * (16 * g + u)));
      }
    }
    for (int i = 0; i < nr; ++i) s[i][jb] = _mm512_mask_mov_ps(ninf, ok[jb], _mm512_mul_ps(acc[i], vscale));
  }
  for (int i = 0; i < nr; ++i) chunk_softmax(s[i], ok, p_buf + i * kChunk, m[i], l[i]);
  // P @ V over the key pairs (the second key of a last odd pair: the last row again, its probability 0).
  // The two rows' values are interleaved into pairs within 128-bit lanes (vpunpck{l,h}wd, one cheap
  // shuffle each; a cross-lane vpermt2w per register cost three times as much): register 2h then holds
  // the pairs of dims {0-3, 8-11, 16-19, 24-27} of the 32 dims at 32h, register 2h + 1 dims {4-7, ...}.
  // Every output dim still takes the same products in the same order as flash_rows (only its lane
  // differs), and the accumulators are put back in dim order once per chunk.
  const int pairs = (nk + 1) / 2;
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[kRows][4];
    for (int i = 0; i < nr; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int kp = 0; kp < pairs; ++kp) {
      const C* va = v + lc[2 * kp] * D + d0;
      const C* vb = v + lc[2 * kp + 1 < nk ? 2 * kp + 1 : nk - 1] * D + d0;
      __m512 vv[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i a = load32(va + 32 * h), b = load32(vb + 32 * h);
        vv[2 * h] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(a, b));
        vv[2 * h + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(a, b));
      }
      for (int i = 0; i < nr; ++i) {
        const __m512 pb = bcast_pair(p_buf + i * kChunk + 2 * kp);
        for (int c = 0; c < 4; ++c) acc[i][c] = dot(acc[i][c], vv[c], pb);
      }
    }
    for (int i = 0; i < nr; ++i) {
      for (int h = 0; h < 2; ++h) {  // lanes back to dims: 32h + 0..15, then 32h + 16..31
        float* dst = o + i * D + d0 + 32 * h;
        _mm512_storeu_ps(dst, _mm512_permutex2var_ps(acc[i][2 * h], lo_idx, acc[i][2 * h + 1]));
        _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(acc[i][2 * h], hi_idx, acc[i][2 * h + 1]));
      }
    }
  }
}

}  // namespace

void flash_chunk(const bf16* const* q, int rows, const bf16* k, const bf16* v, const int64_t* locs, long c0, long n,
                 int D, float scale, float* m, float* l, float* o) {
  chunk_t(q, rows, k, v, locs, c0, n, D, scale, m, l, o);
}

void flash_chunk(const bf16* const* q, int rows, const f8* k, const f8* v, const int64_t* locs, long c0, long n,
                 int D, float scale, float* m, float* l, float* o) {
  chunk_t(q, rows, k, v, locs, c0, n, D, scale, m, l, o);
}

}  // namespace kvl
