// Quantized linear kernels with AVX512-VNNI (vpdpbusd: 64 unsigned x signed byte products summed into
// 16 int32 lanes per instruction), compiled for that ISA whatever the build flags and called only where
// the CPU reports it (ops.cpp). Lane l of every register is output row 16b+l, so a row block needs no
// horizontal sums; the activations' 4-byte runs are broadcast to all lanes. Up to 4 activation rows share
// each weight load (speculative verifies and small batches).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels.h"
#include "qlinear.h"
#include "simd512.h"

namespace kvl {
namespace {

inline void store16(void* y, bool bf16, long i, __m512 v) {
  if (!bf16) {
    _mm512_storeu_ps(static_cast<float*>(y) + i, v);
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(y) + i;  // round to nearest even, as f_to_bf16
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

template <int M>
void q4_rows(const QuantActs& a, int m0, const uint8_t* w, const uint16_t* scales, void* y, bool bf16,
             long N, long b0, long b1) {
  const long G = a.K / 32;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  for (long b = b0; b < b1; ++b) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (long g = 0; g < G; ++g) {
      const uint8_t* wg = w + (b * G + g) * 256;
      __m512i dot[M];
      for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wg + c * 64);
        const __m512i lo = _mm512_and_si512(v, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a.xq + (m0 + m) * a.K + g * 32 + c * 8;
          dot[m] = _mm512_dpbusd_epi32(dot[m], lo, bcast4(x));
          dot[m] = _mm512_dpbusd_epi32(dot[m], hi, bcast4(x + 4));
        }
      }
      const uint16_t* s = scales + (b * G + g) * 32;
      const __m512 d = half16(s), mn = half16(s + 16);
      for (int m = 0; m < M; ++m) {
        const long i = (m0 + m) * G + g;
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(a.sx[i])), acc[m]);
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[i]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) store16(y, bf16, (m0 + m) * N + b * 16, acc[m]);
  }
}

// Two row blocks at once: each activation broadcast serves 32 output rows (the kernel is bound by its
// instruction count, and the broadcasts are a third of it). Same sums in the same order as q4_rows.
template <int M>
void q4_rows2(const QuantActs& a, int m0, const uint8_t* w, const uint16_t* scales, void* y, bool bf16,
              long N, long b) {
  const long G = a.K / 32;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  for (long g = 0; g < G; ++g) {
    const uint8_t* w0 = w + (b * G + g) * 256;
    const uint8_t* w1 = w + ((b + 1) * G + g) * 256;
    __m512i dot0[M], dot1[M];
    for (int m = 0; m < M; ++m) dot0[m] = dot1[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v0 = _mm512_loadu_si512(w0 + c * 64), v1 = _mm512_loadu_si512(w1 + c * 64);
      const __m512i lo0 = _mm512_and_si512(v0, nib), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib);
      const __m512i lo1 = _mm512_and_si512(v1, nib), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.xq + (m0 + m) * a.K + g * 32 + c * 8;
        const __m512i xa = bcast4(x), xb = bcast4(x + 4);
        dot0[m] = _mm512_dpbusd_epi32(dot0[m], lo0, xa);
        dot0[m] = _mm512_dpbusd_epi32(dot0[m], hi0, xb);
        dot1[m] = _mm512_dpbusd_epi32(dot1[m], lo1, xa);
        dot1[m] = _mm512_dpbusd_epi32(dot1[m], hi1, xb);
      }
    }
    const uint16_t* s0 = scales + (b * G + g) * 32;
    const uint16_t* s1 = scales + ((b + 1) * G + g) * 32;
    const __m512 d0 = half16(s0), mn0 = half16(s0 + 16), d1 = half16(s1), mn1 = half16(s1 + 16);
    for (int m = 0; m < M; ++m) {
      const long i = (m0 + m) * G + g;
      const __m512 sx = _mm512_set1_ps(a.sx[i]), xs = _mm512_set1_ps(a.xsum[i]);
      acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0[m]), _mm512_mul_ps(d0, sx), acc0[m]);
      acc0[m] = _mm512_fmadd_ps(mn0, xs, acc0[m]);
      acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1[m]), _mm512_mul_ps(d1, sx), acc1[m]);
      acc1[m] = _mm512_fmadd_ps(mn1, xs, acc1[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    store16(y, bf16, (m0 + m) * N + b * 16, acc0[m]);
    store16(y, bf16, (m0 + m) * N + (b + 1) * 16, acc1[m]);
  }
}

template <int M>
void q8_rows(const QuantActs& a, int m0, const int8_t* w, const uint16_t* scales, const int32_t* wsum128,
             void* y, bool bf16, long N, long b0, long b1) {
  const long G = a.K / 32;
  for (long b = b0; b < b1; ++b) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (long g = 0; g < G; ++g) {
      const int8_t* wg = w + (b * G + g) * 512;
      __m512i dot[M];
      for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(wg + c * 64);
        for (int m = 0; m < M; ++m) {
          dot[m] = _mm512_dpbusd_epi32(dot[m], bcast4(a.xu + (m0 + m) * a.K + g * 32 + c * 4), v);
        }
      }
      const long i = (b * G + g) * 16;
      const __m512 d = half16(scales + i);
      const __m512i off = _mm512_loadu_si512(wsum128 + i);
      for (int m = 0; m < M; ++m) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m], off));
        acc[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(a.sx[(m0 + m) * G + g])), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) store16(y, bf16, (m0 + m) * N + b * 16, acc[m]);
  }
}

// Activation rows in runs of up to 4, each run over one row block at a time: a block's weights
// (16 rows x K) stay in L1 while every run of activation rows passes over them.
void q4(const QuantActs& a, const uint8_t* w, const uint16_t* s, void* y, bool bf16, long N, long b0, long b1) {
  long b = b0;
  for (; a.M > 1 && b + 1 < b1; b += 2) {  // pairs of row blocks (one row: bandwidth-bound, no gain)
    for (int m0 = 0; m0 < a.M; m0 += 4) {
      switch (a.M - m0 >= 4 ? 4 : a.M - m0) {
        case 4: q4_rows2<4>(a, m0, w, s, y, bf16, N, b); break;
        case 3: q4_rows2<3>(a, m0, w, s, y, bf16, N, b); break;
        case 2: q4_rows2<2>(a, m0, w, s, y, bf16, N, b); break;
        default: q4_rows2<1>(a, m0, w, s, y, bf16, N, b);
      }
    }
  }
  for (; b < b1; ++b) {
    for (int m0 = 0; m0 < a.M; m0 += 4) {
      switch (a.M - m0 >= 4 ? 4 : a.M - m0) {
        case 4: q4_rows<4>(a, m0, w, s, y, bf16, N, b, b + 1); break;
        case 3: q4_rows<3>(a, m0, w, s, y, bf16, N, b, b + 1); break;
        case 2: q4_rows<2>(a, m0, w, s, y, bf16, N, b, b + 1); break;
        default: q4_rows<1>(a, m0, w, s, y, bf16, N, b, b + 1);
      }
    }
  }
}

void q8(const QuantActs& a, const int8_t* w, const uint16_t* s, const int32_t* ws, void* y, bool bf16, long N,
        long b0, long b1) {
  for (long b = b0; b < b1; ++b) {
    for (int m0 = 0; m0 < a.M; m0 += 4) {
      switch (a.M - m0 >= 4 ? 4 : a.M - m0) {
        case 4: q8_rows<4>(a, m0, w, s, ws, y, bf16, N, b, b + 1); break;
        case 3: q8_rows<3>(a, m0, w, s, ws, y, bf16, N, b, b + 1); break;
        case 2: q8_rows<2>(a, m0, w, s, ws, y, bf16, N, b, b + 1); break;
        default: q8_rows<1>(a, m0, w, s, ws, y, bf16, N, b, b + 1);
      }
    }
  }
}

// Groups of 32: max|x|, the codes and their integer sum 16 lanes at a time (all exact, so equal to
// the portable build's).
template <typename T>
void quantize_t(const T* x, int8_t* xq, uint8_t* xu, float* sx, float* xsum, long i0, long i1) {
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  for (long i = i0; i < i1; ++i) {
    const T* xi = x + i * 32;
    const __m512 v0 = load16(xi), v1 = load16(xi + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    sx[i] = amax / 127.f;
    const __m512 vi = _mm512_set1_ps(inv);
    __m512i qsum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(h ? v1 : v0, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, nlim), lim);
      const __m512i qi = _mm512_cvtps_epi32(q);
      qsum = _mm512_add_epi32(qsum, qi);
      const __m128i b = _mm512_cvtsepi32_epi8(qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * 32 + 16 * h), b);
      if (xu) _mm_storeu_si128(reinterpret_cast<__m128i*>(xu + i * 32 + 16 * h), _mm_xor_si128(b, _mm_set1_epi8(-128)));
    }
    xsum[i] = sx[i] * static_cast<float>(_mm512_reduce_add_epi32(qsum));  // integers: exact, any order
  }
}

void quantize(const void* x, bool x_bf16, int8_t* xq, uint8_t* xu, float* sx, float* xsum, long i0, long i1) {
  if (x_bf16) quantize_t(static_cast<const bf16*>(x), xq, xu, sx, xsum, i0, i1);
  else quantize_t(static_cast<const float*>(x), xq, xu, sx, xsum, i0, i1);
}


// --- int8 weights per output channel x int8 activations per segment (--enable-int8-batch) ------------
// No per-group weight scale: a tile's integer sums run over a segment of 64 inputs, then take the
// segment's offset and activation scale (an add, a conversion and an FMA per 16 vpdpbusd; the per-group
// kernels above spend a multiply and two FMAs per 8 on their scales). MR activation rows x NB blocks of
// 16 output channels: MR * NB int32 and as many float accumulators, NB weight loads and MR broadcasts
// per 4 inputs.

template <typename T>
void s8_quant_t(const T* x, long K, uint8_t* xu, float* sx, long r0, long r1) {
  const long segs = (K + kS8Seg - 1) / kS8Seg;
  for (long r = r0; r < r1; ++r) {
    for (long s = 0; s < segs; ++s) {
      const long k0 = s * kS8Seg;
      sx[r * segs + s] = quantize_u8(x + r * K + k0, std::min(kS8Seg, K - k0), xu + r * K + k0);
    }
  }
}

template <typename T>
inline void s8_store(const S8Gemm& g, long m, long n0, __m512 f) {
  // The channel's scale, then a bias added to the value rounded to T; one rounding to T at the store.
  __m512 v = _mm512_mul_ps(f, _mm512_loadu_ps(g.ws + n0));
  if (g.bias) v = _mm512_add_ps(rnd<T>(v), load16(static_cast<const T*>(g.bias) + n0));
  store16(static_cast<T*>(g.y) + m * g.N + n0, v);
}

// One accumulator array per block of 16 outputs (GCC 12 kept a 2-D array on the stack, storing each
// every iteration: 40% of the vpdpbusd peak). 4 x 3 blocks: 12 int32 and 12 float accumulators; against
// 4 x 4 with the float sums in an L1 array, 5-12% faster at 32-512 rows (same bits; bench/RESULTS.md).
template <typename T, int MR, int NB>
void s8_tile(const S8Gemm& g, long m0, long b) {
  static_assert(NB >= 1 && NB <= 3, "1 to 3 blocks");
  __m512i a0[MR], a1[MR], a2[MR];
  __m512 f0[MR], f1[MR], f2[MR];
  for (int r = 0; r < MR; ++r) f0[r] = f1[r] = f2[r] = _mm512_setzero_ps();
  const long bs = g.K * 16;  // bytes a block of 16 outputs: [K/4][16][4]
  const int8_t* wb = g.w + b * bs;
  const uint8_t* x = g.xu + m0 * g.K;
  for (long s = 0; s < g.segs; ++s) {
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = a2[r] = _mm512_setzero_si512();
    auto step = [&](long k) __attribute__((always_inline)) {
      const int8_t* wk = wb + k * 16;
      const __m512i w0 = _mm512_loadu_si512(wk);
      const __m512i w1 = NB > 1 ? _mm512_loadu_si512(wk + bs) : w0;
      const __m512i w2 = NB > 2 ? _mm512_loadu_si512(wk + 2 * bs) : w0;
      for (int r = 0; r < MR; ++r) {
        const __m512i xa = bcast4(x + r * g.K + k);
        a0[r] = _mm512_dpbusd_epi32(a0[r], xa, w0);
        if constexpr (NB > 1) a1[r] = _mm512_dpbusd_epi32(a1[r], xa, w1);
        if constexpr (NB > 2) a2[r] = _mm512_dpbusd_epi32(a2[r], xa, w2);
      }
    };
    const long k0 = s * kS8Seg;
    if (k0 + kS8Seg <= g.K) {
      // A whole segment: a loop of known length, unrolled (with a variable one inside the segment loop
      // GCC copied every accumulator twice an iteration).
#pragma GCC unroll 16
      for (long k = 0; k < kS8Seg; k += 4) step(k0 + k);
    } else {
      for (long k = k0; k < g.K; k += 4) step(k);
    }
    // Each sum plus the segment's offset (-128 * its weights' sum: exact), scaled into the float sums.
    const int32_t* off = g.woff + s * g.N + b * 16;
    for (int r = 0; r < MR; ++r) {
      const __m512 sc = _mm512_set1_ps(g.sx[(m0 + r) * g.segs + s]);
      auto fold = [&](int j, __m512i a, __m512 f) {
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, _mm512_loadu_si512(off + j * 16))), sc, f);
      };
      f0[r] = fold(0, a0[r], f0[r]);
      if constexpr (NB > 1) f1[r] = fold(1, a1[r], f1[r]);
      if constexpr (NB > 2) f2[r] = fold(2, a2[r], f2[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    s8_store<T>(g, m0 + r, b * 16, f0[r]);
    if constexpr (NB > 1) s8_store<T>(g, m0 + r, (b + 1) * 16, f1[r]);
    if constexpr (NB > 2) s8_store<T>(g, m0 + r, (b + 2) * 16, f2[r]);
  }
}

template <typename T, int NB>
void s8_rows(const S8Gemm& g, long m0, long mr, long b) {
  static_assert(kS8Rows == 4, "the cases below");
  switch (mr) {
    case 4: s8_tile<T, 4, NB>(g, m0, b); break;
    case 3: s8_tile<T, 3, NB>(g, m0, b); break;
    case 2: s8_tile<T, 2, NB>(g, m0, b); break;
    default: s8_tile<T, 1, NB>(g, m0, b);
  }
}

template <typename T>
void s8_range(const S8Gemm& g, long r0, long r1, long b0, long b1) {
  // Column tiles of kS8Blocks blocks outer (their weights, 48 x K bytes, stay in L2 while every row
  // tile passes over them), row tiles of kS8Rows inner.
  static_assert(kS8Blocks == 3, "the cases below");
  for (long b = b0; b < b1; b += kS8Blocks) {
    const long nb = std::min<long>(kS8Blocks, b1 - b);
    for (long m0 = r0; m0 < r1; m0 += kS8Rows) {
      const long mr = std::min<long>(kS8Rows, r1 - m0);
      switch (nb) {
        case 3: s8_rows<T, 3>(g, m0, mr, b); break;
        case 2: s8_rows<T, 2>(g, m0, mr, b); break;
        default: s8_rows<T, 1>(g, m0, mr, b);
      }
    }
  }
}

}  // namespace

QuantKernels quant_vnni() { return QuantKernels{&quantize, &q4, &q8}; }

void s8_quantize(const void* x, bool x_bf16, long K, uint8_t* xu, float* sx, long r0, long r1) {
  if (x_bf16) s8_quant_t(static_cast<const bf16*>(x), K, xu, sx, r0, r1);
  else s8_quant_t(static_cast<const float*>(x), K, xu, sx, r0, r1);
}

void s8_gemm_vnni(const S8Gemm& g, long r0, long r1, long b0, long b1) {
  if (g.bf16) s8_range<bf16>(g, r0, r1, b0, b1);
  else s8_range<float>(g, r0, r1, b0, b1);
}

}  // namespace kvl
