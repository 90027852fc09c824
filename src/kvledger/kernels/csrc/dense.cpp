// y = x @ W.T (+ b) for float32 or bf16 weights as they are ([N, K] rows), with one order of sums per
// output whatever the call's row count (--enable-deterministic-inference's linear for unquantized
// layers: oneDNN's and MKL's GEMMs block the inner dimension by the shape, so a row's bits depend on
// the rows beside it). Output (m, n): 16 lanes, lane l the fused multiply-add chain of x[m, k] * W[n, k]
// over k = l, l + 16, ... (zeros past K), then the lanes summed in one fixed tree, then + b[n], rounded
// once to the output's dtype. The AVX-512 build runs tiles of 4 rows x 4 outputs (16 chains in
// registers, reduced together by a transpose-and-add whose tree is the same for each of them); the
// portable build runs the same chains and tree one output at a time: both give the same bits.
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace kvl {

namespace {

// The lanes' tree (the AVX-512 build's sum16x16): in each group of 4, (l0 + l2) + (l1 + l3), then the
// groups (g0 + g1) + (g2 + g3).
inline float tree16(const float* a) {
  float g[4];
  for (int q = 0; q < 4; ++q) g[q] = (a[4 * q] + a[4 * q + 2]) + (a[4 * q + 1] + a[4 * q + 3]);
  return (g[0] + g[1]) + (g[2] + g[3]);
}

template <typename T>
void dense_scalar_t(const T* x, const T* w, const T* bias, T* y, long M, long K, long N, long n0, long n1) {
  for (long n = n0; n < n1; ++n) {
    const T* wn = w + n * K;
    for (long m = 0; m < M; ++m) {
      const T* xm = x + m * K;
      float lane[16] = {};
      for (long k0 = 0; k0 < K; k0 += 16) {
        for (int l = 0; l < 16; ++l) {
          const long k = k0 + l;
          lane[l] = std::fma(k < K ? to_f(xm[k]) : 0.f, k < K ? to_f(wn[k]) : 0.f, lane[l]);
        }
      }
      float v = tree16(lane);
      if (bias) v += to_f(bias[n]);
      y[m * N + n] = from_f<T>(v);
    }
  }
}

}  // namespace

void dense_scalar(const void* x, const void* w, const void* bias, void* y, bool bf16, long M, long K, long N, long n0,
                  long n1) {
  if (bf16) {
    dense_scalar_t(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias),
                   static_cast<uint16_t*>(y), M, K, N, n0, n1);
  } else {
    dense_scalar_t(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(bias),
                   static_cast<float*>(y), M, K, N, n0, n1);
  }
}

}  // namespace kvl

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#include <immintrin.h>

#include "simd512.h"

namespace kvl {
namespace {

// 16 values from p (the first `mask` of them; the rest 0), widened to float.
inline __m512 load_part(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_part(const uint16_t* p, __mmask16 m) { return load16m(p, m); }

// a[i] for i in 0..16 reduced to lane i of the result (the tree of tree16, for each input alike).
inline __m512 sum16(const __m512* a) {
  __m512 c[4];
  for (int q = 0; q < 4; ++q) {
    const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a[4 * q], a[4 * q + 1]), _mm512_unpackhi_ps(a[4 * q], a[4 * q + 1]));
    const __m512 b1 =
        _mm512_add_ps(_mm512_unpacklo_ps(a[4 * q + 2], a[4 * q + 3]), _mm512_unpackhi_ps(a[4 * q + 2], a[4 * q + 3]));
    const __m512d u = _mm512_castps_pd(b0), v = _mm512_castps_pd(b1);
    c[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

template <typename T>
void dense_avx512_t(const T* x, const T* w, const T* bias, T* y, long M, long K, long N, long n0, long n1) {
  for (long nb = n0; nb < n1; nb += 4) {
    const int nn = static_cast<int>(n1 - nb < 4 ? n1 - nb : 4);
    const T* wr[4];
    for (int j = 0; j < 4; ++j) wr[j] = w + (nb + (j < nn ? j : nn - 1)) * K;  // past the end: computed, not stored
    for (long m0 = 0; m0 < M; m0 += 4) {
      const int mm = static_cast<int>(M - m0 < 4 ? M - m0 : 4);
      const T* xr[4];
      for (int i = 0; i < 4; ++i) xr[i] = x + (m0 + (i < mm ? i : mm - 1)) * K;
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (long k = 0; k < K; k += 16) {
        const __mmask16 mk = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
        __m512 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = load_part(wr[j] + k, mk);
        for (int i = 0; i < 4; ++i) {
          const __m512 xv = load_part(xr[i] + k, mk);
          for (int j = 0; j < 4; ++j) acc[4 * i + j] = _mm512_fmadd_ps(xv, wv[j], acc[4 * i + j]);
        }
      }
      alignas(64) float r[16];
      _mm512_store_ps(r, sum16(acc));
      for (int i = 0; i < mm; ++i) {
        for (int j = 0; j < nn; ++j) {
          float v = r[4 * i + j];
          if (bias) v += to_f(bias[nb + j]);
          y[(m0 + i) * N + nb + j] = from_f<T>(v);
        }
      }
    }
  }
}

}  // namespace

void dense_avx512(const void* x, const void* w, const void* bias, void* y, bool bf16, long M, long K, long N, long n0,
                  long n1) {
  if (bf16) {
    dense_avx512_t(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias),
                   static_cast<uint16_t*>(y), M, K, N, n0, n1);
  } else {
    dense_avx512_t(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(bias),
                   static_cast<float*>(y), M, K, N, n0, n1);
  }
}

}  // namespace kvl
#pragma GCC pop_options
#endif
