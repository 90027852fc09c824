// AVX-512 kernels (AVX512F/BW/VL/DQ + FMA): compiled for that ISA whatever the build's flags, called
// only where the CPU reports it (ops.cpp). Dims must be multiples of 16 (ops.cpp checks; the portable
// kernels take the rest).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash.h"
#include "kernels.h"
#include "simd512.h"

namespace kvl {
namespace {


template <typename T>
void rms_norm(const T* x, long xs, T* res, long rs, const T* w, T* out, long os, int dim, float eps,
              long r0, long r1) {
  std::vector<float> row(dim);
  for (long r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
      __m512 v = load16(xr + i);
      if (res) {
        T* rr = res + r * rs + i;
        v = rnd<T>(_mm512_add_ps(load16(rr), v));
        store16(rr, v);
      }
      _mm512_storeu_ps(row.data() + i, v);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / dim + eps));
    T* o = out + r * os;
    for (int i = 0; i < dim; i += 16) {
      __m512 n = rnd<T>(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), inv));
      store16(o + i, _mm512_mul_ps(load16(w + i), n));
    }
  }
}

template <typename T>
void silu_mul(const T* gu, long gs, T* out, long os, int dim, long r0, long r1) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (long r = r0; r < r1; ++r) {
    const T* g = gu + r * gs;
    const T* u = g + dim;
    T* o = out + r * os;
    for (int i = 0; i < dim; i += 16) {
      __m512 a = load16(g + i);
      __m512 s = rnd<T>(_mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
      store16(o + i, _mm512_mul_ps(s, load16(u + i)));
    }
  }
}

template <typename T>
void rope(T* x, long xs, int heads, int head_dim, const int64_t* pos, const T* cos, const T* sin, long r0,
          long r1) {
  int half = head_dim / 2;
  for (long r = r0; r < r1; ++r) {
    const T* c = cos + pos[r] * half;
    const T* s = sin + pos[r] * half;
    for (int h = 0; h < heads; ++h) {
      T* p = x + r * xs + static_cast<long>(h) * head_dim;
      for (int i = 0; i < half; i += 16) {
        __m512 x1 = load16(p + i), x2 = load16(p + i + half), ci = load16(c + i), si = load16(s + i);
        __m512 a = _mm512_sub_ps(rnd<T>(_mm512_mul_ps(x1, ci)), rnd<T>(_mm512_mul_ps(x2, si)));
        __m512 b = _mm512_add_ps(rnd<T>(_mm512_mul_ps(x2, ci)), rnd<T>(_mm512_mul_ps(x1, si)));
        store16(p + i, a);
        store16(p + i + half, b);
      }
    }
  }
}

// Sums of 16 vectors at once: lane i of the result is the sum of a[i]'s lanes (a transpose-and-add
// tree: 15 adds and 30 shuffles for 16 dot products, where 16 horizontal reductions take ~130 ops).
// In two stages, so that a caller can reduce 4 vectors as soon as they exist: sum4of16 turns a[0..4)
// into c (128-bit lane L, element m: lane L's part of the sum of a[m]); sum16of4 takes four such c.
inline __m512 sum4of16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d x = _mm512_castps_pd(b0), y = _mm512_castps_pd(b1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

inline __m512 sum16of4(const __m512* c) {
  __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

inline __m512 sum16x16(const __m512* a) {
  const __m512 c[4] = {sum4of16(a[0], a[1], a[2], a[3]), sum4of16(a[4], a[5], a[6], a[7]),
                       sum4of16(a[8], a[9], a[10], a[11]), sum4of16(a[12], a[13], a[14], a[15])};
  return sum16of4(c);
}

constexpr int kMaxG = 64;  // most query heads a KV head may serve on the grouped paths of attend_nd

// acc[g] = acc[g] * corr[g] + sum_j p[g][j] v[j] for GN heads (p at p + g * ps), D = 16 * ND.
template <typename C, int ND, int GN>
inline void pv_heads(float* acc, int D, const float* corr, const float* p, int ps, const C* const* vr, int nb) {
  __m512 o[GN][ND];
  for (int g = 0; g < GN; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int d = 0; d < ND; ++d) o[g][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d * 16), c);
  }
  for (int j = 0; j < nb; ++j) {
    __m512 vj[ND];
    load_row<ND>(vr[j], vj);
    for (int g = 0; g < GN; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * ps + j]);
      for (int d = 0; d < ND; ++d) o[g][d] = _mm512_fmadd_ps(pj, vj[d], o[g][d]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(acc + g * D + d * 16, o[g][d]);
}

// Tokens in blocks of 16: the block's scores of one query row are one register (their dot products
// summed by sum16x16), so the online softmax (max, exp, sum) runs vectorized; K and V rows are read
// where they lie in the pool. ND = D/16 as a constant for the common head dims (64, 128) lets the
// compiler keep a query row and an output row in registers; 0 = any multiple of 16. With ND set, each
// K row (head dim 64) and V row is widened to float once for all the query heads of its KV head: the
// widening took a third of the instructions when it was repeated per head. The sums are the same, in
// the same order, whichever path runs (tests/unit/test_cpu_kernels.py holds them to the reference).
// C is the cache's element type (T, or f8: widened to value / kF8Unit, the unit folded into the query's
// scale and, at the end, into the output).
template <typename T, typename C, int ND>
void attend_nd(const T* q, long qs, const C* k, const C* v, const int64_t* locs, long n, int G, int D,
               float scale, float* m, float* l, float* acc) {
  constexpr int B = 16;
  constexpr float unit = std::is_same_v<C, f8> ? kF8Unit : 1.f;
  const int nd = ND ? ND : D / 16;
  // The scaled queries and a block's scores, in buffers kept by the thread: the kernels call this once
  // per 64-key chunk (flash.h), and the two heap allocations a call were paid once a chunk.
  thread_local std::vector<float> qf, sc;
  if (qf.size() < static_cast<size_t>(G) * D) qf.resize(static_cast<size_t>(G) * D);
  if (sc.size() < static_cast<size_t>(G) * B) sc.resize(static_cast<size_t>(G) * B);
  const __m512 vs = _mm512_set1_ps(scale * unit);
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < nd; ++j) _mm512_storeu_ps(&qf[g * D + j * 16], _mm512_mul_ps(load16(q + g * qs + j * 16), vs));
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + g * D + d, _mm512_setzero_ps());
  }
  const C* kr[B];
  const C* vr[B];
  __m512 dots[B];
  __m512 quads[4 * kMaxG];  // per head, its four sum4of16 of a block
  float corr[kMaxG];         // per head, the block's rescale of its running output
  // The head-dim-specialized paths (K/V rows widened once for all heads) hold per-head state in the
  // two arrays above; past kMaxG heads, or for other head dims, one head at a time.
  const bool grouped = ND != 0 && G <= kMaxG;
  for (long t0 = 0; t0 < n; t0 += B) {
    const int nb = static_cast<int>(n - t0 < B ? n - t0 : B);
    // The next block's K/V rows, fetched while this one is computed. With one-token pages a request's
    // decoded tokens lie wherever the pool had a free slot (a step's tokens of all requests side by
    // side), so each row is its own cache miss that the hardware prefetcher cannot guess; a run of
    // consecutive slots (a prompt's, or a page) it streams, but late: 32 decodes over 30 layers' K/V
    // (bench/RESULTS.md) took 12.4 -> 9.9 ms a step at 256 tokens of consecutive context with this too.
    const long j1 = std::min(t0 + 2 * B, n);
    for (long j = t0 + B; j < j1; ++j) {
      const char* kp = reinterpret_cast<const char*>(k + locs[j] * D);
      const char* vp = reinterpret_cast<const char*>(v + locs[j] * D);
      for (long off = 0; off < static_cast<long>(D * sizeof(C)); off += 64) {
        _mm_prefetch(kp + off, _MM_HINT_T0);
        _mm_prefetch(vp + off, _MM_HINT_T0);
      }
    }
    for (int j = 0; j < B; ++j) {  // past the end: repeat the last row (its scores are masked off)
      const int64_t loc = locs[t0 + (j < nb ? j : nb - 1)];
      kr[j] = k + loc * D;
      vr[j] = v + loc * D;
    }
    if (ND == 4 && grouped) {
      // Head dim 64: four K rows widened once for every head (16 registers), each head's four dot
      // products reduced at once; the same sums in the same order as sum16x16 below.
      for (int j0 = 0; j0 < B; j0 += 4) {
        __m512 kk[4][4];
        for (int j = 0; j < 4; ++j)
          load_row<4>(kr[j0 + j], kk[j]);
        for (int g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          __m512 a[4];
          for (int j = 0; j < 4; ++j) {
            a[j] = _mm512_mul_ps(_mm512_loadu_ps(qg), kk[j][0]);
            for (int d = 1; d < 4; ++d) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d * 16), kk[j][d], a[j]);
          }
          quads[g * 4 + j0 / 4] = sum4of16(a[0], a[1], a[2], a[3]);
        }
      }
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(&sc[g * B], sum16of4(&quads[g * 4]));
    } else {
      for (int g = 0; g < G; ++g) {
        const float* qg = &qf[g * D];
        for (int j = 0; j < B; ++j) {
          __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(kr[j]));
          for (int d = 1; d < nd; ++d) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d * 16), load16(kr[j] + d * 16), a);
          dots[j] = a;
        }
        _mm512_storeu_ps(&sc[g * B], sum16x16(dots));
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1);
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, &sc[g * B]);
      const float mn = std::max(m[g], _mm512_reduce_max_ps(s));
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
      const float cg = std::exp(m[g] - mn);
      l[g] = l[g] * cg + _mm512_reduce_add_ps(p);
      m[g] = mn;
      _mm512_storeu_ps(&sc[g * B], p);
      if (grouped) {
        corr[g] = cg;
      } else {  // V rows read per head
        float* ag = acc + g * D;
        const __m512 c = _mm512_set1_ps(cg);
        for (int d = 0; d < D; d += 16) {
          __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ag + d), c);
          for (int j = 0; j < nb; ++j) o = _mm512_fmadd_ps(_mm512_set1_ps(sc[g * B + j]), load16(vr[j] + d), o);
          _mm512_storeu_ps(ag + d, o);
        }
      }
    }
    if constexpr (ND != 0) {  // (pv_heads needs a head dim known at compile time)
      if (grouped) {
        // The output rows of up to 16 / ND heads in registers over the block, each V row widened once
        // for all of them. Each lane sees the same operations in the same order as the loop above.
        constexpr int GB = 16 / ND;
        for (int g0 = 0; g0 < G; g0 += GB) {
          const float* c = corr + g0;
          const float* p = &sc[g0 * B];
          switch (G - g0 >= GB ? GB : G - g0) {
            case 1: pv_heads<C, ND, 1>(acc + g0 * D, D, c, p, B, vr, nb); break;
            case 2: pv_heads<C, ND, 2>(acc + g0 * D, D, c, p, B, vr, nb); break;
            case 3: pv_heads<C, ND, (GB >= 3 ? 3 : 1)>(acc + g0 * D, D, c, p, B, vr, nb); break;
            default: pv_heads<C, ND, (GB >= 4 ? 4 : 1)>(acc + g0 * D, D, c, p, B, vr, nb);  // GB is 4 or 2
          }
        }
      }
    }
  }
  if constexpr (unit != 1.f) {
    const __m512 u = _mm512_set1_ps(unit);
    for (int i = 0; i < G * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(_mm512_loadu_ps(acc + i), u));
  }
}

template <typename T, typename C>
void attend(const T* q, long qs, const C* k, const C* v, const int64_t* locs, long n, int G, int D,
            float scale, float* m, float* l, float* acc) {
  if (D == 64) return attend_nd<T, C, 4>(q, qs, k, v, locs, n, G, D, scale, m, l, acc);
  if (D == 128) return attend_nd<T, C, 8>(q, qs, k, v, locs, n, G, D, scale, m, l, acc);
  attend_nd<T, C, 0>(q, qs, k, v, locs, n, G, D, scale, m, l, acc);
}

// acc[g][dc*16 ..) = acc * corr[g] + sum_j p[g][j] v[j] for GN heads and DN chunks of 16 dims from dc
// (acc rows D apart, p rows 16 apart): pv_heads's operations per lane, for any head dim.
template <typename C, int GN, int DN>
inline void pv_part(float* acc, int D, int dc, const float* corr, const float* p, const C* const* vr, int nb) {
  __m512 o[GN][DN];
  for (int g = 0; g < GN; ++g) {
    const __m512 c = _mm512_set1_ps(corr[g]);
    for (int d = 0; d < DN; ++d) o[g][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + (dc + d) * 16), c);
  }
  for (int j = 0; j < nb; ++j) {
    __m512 vj[DN];
    for (int d = 0; d < DN; ++d) vj[d] = load16(vr[j] + (dc + d) * 16);
    for (int g = 0; g < GN; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * 16 + j]);
      for (int d = 0; d < DN; ++d) o[g][d] = _mm512_fmadd_ps(pj, vj[d], o[g][d]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int d = 0; d < DN; ++d) _mm512_storeu_ps(acc + g * D + (dc + d) * 16, o[g][d]);
}

template <typename C, int GN>
inline void pv_heads_any(float* acc, int D, const float* corr, const float* p, const C* const* vr, int nb) {
  const int nd = D / 16;
  int dc = 0;
  for (; dc + 4 <= nd; dc += 4) pv_part<C, GN, 4>(acc, D, dc, corr, p, vr, nb);
  for (; dc < nd; ++dc) pv_part<C, GN, 1>(acc, D, dc, corr, p, vr, nb);
}

// flash.h's fold_chunk and fold_out, the same operations, defined here: an inline function of a header
// compiled under this file's AVX-512 target could otherwise be the copy the linker keeps for the
// portable callers too.
inline void fold_chunk512(float& M, float& L, float* O, float m, float l, const float* o, int D, bool first) {
  if (first) {
    M = m, L = l;
    std::memcpy(O, o, sizeof(float) * D);
    return;
  }
  const float mn = m > M ? m : M;
  const float a = std::exp(M - mn), b = std::exp(m - mn);
  M = mn;
  L = L * a + l * b;
  for (int d = 0; d < D; ++d) O[d] = O[d] * a + o[d] * b;
}

template <typename T> inline void fold_out512(float L, const float* O, int D, T* out) {
  const float inv = L > 0.f ? 1.f / L : 0.f;
  const __m512 vi = _mm512_set1_ps(inv), zero = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16) store16(out + d, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(O + d), vi), zero));
}

// The tiled extend (Kernels::extend_tile): prompt attention on CPUs without AVX512-BF16, where every
// extend runs the float form. Each query row's bits are attend's over its chunks (so the decode
// kernel's, issue 56); only the work is shared. K and V come widened to float once per extend and KV
// head (ops.cpp), where attend widens each K and V row once per query token.
//  1. Scores: the tile's rows (token-major, a token's G heads adjacent) in octets against keys in
//     pairs over the union of the tokens' ranges, 16 keys at a time for every octet (the 16 rows stay
//     in L1): 16 accumulators (8 rows x 2 keys) over the head dim, the 16 dot vectors reduced by one
//     sum16x16. A lane's sum is attend's: the same products in the same order (q * scale first), and
//     sum16x16's tree has one shape for every lane, whichever 16 vectors it takes (a score does not
//     depend on how keys were grouped into blocks).
//  2. Per token, its own chunks of 64 from st[i] and blocks of 16 within them (a sliding window starts
//     each token's chunks one key later than its predecessor's), the tokens in step: block b of every
//     token, then b + 1, so the V rows of block b for all of them (16 + ntok - 1 rows at most) are
//     read from L1 after the first token. Per token and block attend's online softmax and V products
//     (pv_part: pv_heads's operations per lane), each chunk's partial folded in order (fold_chunk512).
template <typename T>
void extend_tile(const T* const* q, const long* st, const long* n, int ntok, const float* kf, const float* vf,
                 long base, int G, int D, float scale, T* const* out) {
  constexpr int B = 16;
  const int nd = D / 16, NR = ntok * G;
  long x0 = st[0], x1 = st[0] + n[0], nmax = n[0];
  for (int i = 1; i < ntok; ++i) {
    x0 = std::min(x0, st[i]), x1 = std::max(x1, st[i] + n[i]), nmax = std::max(nmax, n[i]);
  }
  const long span = x1 - x0, sp = (span + 1) / 2 * 2;  // a row's scores, padded to whole key pairs
  const size_t GD = static_cast<size_t>(G) * D;
  thread_local std::vector<float> qf_, sc_, acc_, fo_, st8_;
  // Scratch kept by the thread (a layer calls this once per tile); plain pointers from here on.
  if (qf_.size() < static_cast<size_t>(NR) * D) qf_.resize(static_cast<size_t>(NR) * D);
  if (sc_.size() < static_cast<size_t>(NR) * sp) sc_.resize(static_cast<size_t>(NR) * sp);
  if (acc_.size() < ntok * GD) acc_.resize(ntok * GD), fo_.resize(ntok * GD);
  if (st8_.size() < static_cast<size_t>(ntok) * G * 5 + static_cast<size_t>(G) * B) {
    st8_.resize(static_cast<size_t>(ntok) * G * 5 + static_cast<size_t>(G) * B);
  }
  float* const qf = qf_.data();
  float* const sc = sc_.data();
  float* const acc = acc_.data();
  float* const fo = fo_.data();
  const __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r) {
    const T* qr = q[r / G] + static_cast<long>(r % G) * D;
    for (int j = 0; j < nd; ++j) _mm512_storeu_ps(qf + static_cast<size_t>(r) * D + j * 16, _mm512_mul_ps(load16(qr + j * 16), vs));
  }
  // 1. Scores sc[r][x - x0] of every row against every key of the union, 16 keys at a time.
  alignas(64) float lanes[16];
  for (long xb = x0; xb < x1; xb += B) {
    const long kn = std::min<long>(B, x1 - xb);
    for (int r0 = 0; r0 < NR; r0 += 8) {
      const float* qr[8];
      for (int i = 0; i < 8; ++i) qr[i] = qf + static_cast<size_t>(std::min(r0 + i, NR - 1)) * D;
      const int rn = std::min(8, NR - r0);
      for (long xj = 0; xj < kn; xj += 2) {
        const float* k0 = kf + (xb + xj - base) * D;
        const float* k1 = xj + 1 < kn ? k0 + D : k0;  // an odd last key: its pair is itself (not stored)
        __m512 a[16];
        {
          const __m512 ka = _mm512_loadu_ps(k0), kb = _mm512_loadu_ps(k1);
          for (int i = 0; i < 8; ++i) {
            const __m512 qv = _mm512_loadu_ps(qr[i]);
            a[2 * i] = _mm512_mul_ps(qv, ka);
            a[2 * i + 1] = _mm512_mul_ps(qv, kb);
          }
        }
        for (int d = 1; d < nd; ++d) {
          const __m512 ka = _mm512_loadu_ps(k0 + d * 16), kb = _mm512_loadu_ps(k1 + d * 16);
          for (int i = 0; i < 8; ++i) {
            const __m512 qv = _mm512_loadu_ps(qr[i] + d * 16);
            a[2 * i] = _mm512_fmadd_ps(qv, ka, a[2 * i]);
            a[2 * i + 1] = _mm512_fmadd_ps(qv, kb, a[2 * i + 1]);
          }
        }
        _mm512_store_ps(lanes, sum16x16(a));
        for (int i = 0; i < rn; ++i) {
          float* s = sc + static_cast<size_t>(r0 + i) * sp + (xb - x0 + xj);
          s[0] = lanes[2 * i];
          s[1] = lanes[2 * i + 1];
        }
      }
    }
  }
  // 2. Block b of every token, then b + 1: attend's softmax and V products, chunks folded in order.
  float* m = st8_.data();  // [ntok][G] each: the chunk's m, l; the folded M, L; the block's corrections
  float* l = m + ntok * G;
  float* M = l + ntok * G;
  float* L = M + ntok * G;
  float* corr = L + ntok * G;
  float* p = corr + ntok * G;  // [G][16], one token's at a time
  const float* vr[B];
  for (long b0 = 0; b0 < nmax; b0 += B) {
    const bool chunk_start = b0 % kKeyChunk == 0;
    for (int i = 0; i < ntok; ++i) {
      if (b0 >= n[i]) continue;
      const long s0 = st[i];
      const int nb = static_cast<int>(std::min<long>(B, n[i] - b0));
      float* mi = m + i * G;
      float* li = l + i * G;
      float* ci = corr + i * G;
      float* ai = acc + i * GD;
      if (chunk_start) {
        for (int g = 0; g < G; ++g) mi[g] = -std::numeric_limits<float>::infinity(), li[g] = 0.f;
        std::fill(ai, ai + GD, 0.f);
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1);
      for (int g = 0; g < G; ++g) {
        const float* srow = sc + static_cast<size_t>(i * G + g) * sp + (s0 + b0 - x0);
        const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, srow);
        const float mn = std::max(mi[g], _mm512_reduce_max_ps(s));
        const __m512 pv = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
        const float cg = std::exp(mi[g] - mn);
        li[g] = li[g] * cg + _mm512_reduce_add_ps(pv);
        mi[g] = mn;
        ci[g] = cg;
        _mm512_storeu_ps(p + g * B, pv);
      }
      for (int j = 0; j < nb; ++j) vr[j] = vf + (s0 + b0 + j - base) * D;
      for (int g0 = 0; g0 < G; g0 += 4) {
        float* ag = ai + static_cast<long>(g0) * D;
        switch (std::min(4, G - g0)) {
          case 1: pv_heads_any<float, 1>(ag, D, ci + g0, p + g0 * B, vr, nb); break;
          case 2: pv_heads_any<float, 2>(ag, D, ci + g0, p + g0 * B, vr, nb); break;
          case 3: pv_heads_any<float, 3>(ag, D, ci + g0, p + g0 * B, vr, nb); break;
          default: pv_heads_any<float, 4>(ag, D, ci + g0, p + g0 * B, vr, nb);
        }
      }
      if ((b0 + B) % kKeyChunk == 0 || b0 + B >= n[i]) {  // the chunk's last block: fold its partial
        const bool first = b0 < kKeyChunk;
        for (int g = 0; g < G; ++g) {
          fold_chunk512(M[i * G + g], L[i * G + g], fo + i * GD + static_cast<size_t>(g) * D, mi[g], li[g],
                        ai + static_cast<size_t>(g) * D, D, first);
        }
      }
    }
  }
  for (int i = 0; i < ntok; ++i)
    for (int g = 0; g < G; ++g)
      fold_out512(L[i * G + g], fo + i * GD + static_cast<size_t>(g) * D, D, out[i] + static_cast<long>(g) * D);
}

template <typename T>
void from_f8s(const f8* x, T* out, long n) {
  long i = 0;
  const __m512 unit = _mm512_set1_ps(kF8Unit);
  const __m128i low7 = _mm_set1_epi8(0x7f);
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (; i + 16 <= n; i += 16) {
    // (load16 reads the NaN codes 0x7f/0xff as +-480: the pool never holds them, writes saturate)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __mmask16 is_nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, low7), low7);
    store16(out + i, _mm512_mask_mov_ps(_mm512_mul_ps(load16(x + i), unit), is_nan, nan));
  }
  for (; i < n; ++i) out[i] = from_f<T>(to_f(x[i]));
}

template <typename T>
void to_f8s(const T* x, f8* out, long n) {
  long i = 0;
  for (; i + 16 <= n; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), to_f8(load16(x + i)));
  for (; i < n; ++i) out[i].bits = f_to_f8(to_f(x[i]));
}


template <typename T>
void quantize_rows(const T* x, int K, uint8_t* q, float* scale, long r0, long r1) {
  for (long r = r0; r < r1; ++r) scale[r] = quantize_u8(x + r * K, K, q + r * K);
}

template <typename T>
void scale_rows(const float* y, const float* scale, const T* bias, T* out, int N, long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    for (int i = 0; i < N; i += 16) {
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(y + r * N + i), s);
      if (bias) v = _mm512_add_ps(rnd<T>(v), load16(bias + i));
      store16(out + r * N + i, v);
    }
  }
}

template <typename T>
Kernels<T> make() {
  return Kernels<T>{&rms_norm<T>, &silu_mul<T>, &rope<T>, &attend<T, T>, &attend<T, f8>, &to_f8s<T>, &from_f8s<T>,
                    &quantize_rows<T>, &scale_rows<T>, &extend_tile<T>};
}

}  // namespace

Kernels<float> avx512_f32() { return make<float>(); }
Kernels<bf16> avx512_bf16() { return make<bf16>(); }

}  // namespace kvl
