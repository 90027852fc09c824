// Helpers for 16 floats in an AVX-512 register, shared by the AVX-512 kernels. Each includer compiles
// them for its own target (its #pragma precedes this include); internal linkage keeps the builds apart.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "kernels.h"

namespace kvl {
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float8 e4m3 values widened to float and divided by kF8Unit: the byte's sign moved to bit 15 and its
// exponent and mantissa to bits 7..13 make the fp16 of value / 256 (the biases differ by 8), which
// VCVTPH2PS widens exactly, subnormals included. Callers fold the 256 into a scale (attend_nd).
constexpr float kF8Unit = 256.f;
inline __m512 load16(const f8* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xbf80))));
}

// A row of 16 * N values widened to float (as load16 each), N even: float8 rows 32 bytes at a time
// (one sign extension and one mask for 32 values; 40% fewer conversion instructions).
template <int N, typename C> inline void load_row(const C* p, __m512* out) {
  for (int d = 0; d < N; ++d) out[d] = load16(p + d * 16);
}
template <int N> inline void load_row(const f8* p, __m512* out) {
  static_assert(N % 2 == 0, "pairs of 16");
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(0xbf80));
  for (int d = 0; d < N; d += 2) {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + d * 16)));
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), mask);
    out[d] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    out[d + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
}

// 16 floats to float8 e4m3, as f_to_f8 (kernels.h) does one.
inline __m128i to_f8(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i s = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff),
                                                         _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1))));
  __m512i c = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
  const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.f)));  // nearest even
  c = _mm512_mask_mov_epi32(c, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000)), sub);
  c = _mm512_mask_mov_epi32(c, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x43e00000)), _mm512_set1_epi32(0x7e));
  c = _mm512_mask_mov_epi32(c, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(c, s));
}

inline __m256i to_bf16(__m512 v) {  // round to nearest even; NaN stays a (quiet) NaN
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// v rounded to T and back (where the reference rounds an intermediate result).
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, bf16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}
template <typename T> inline __m512 rnd(__m512 v) { return round16(v, static_cast<T*>(nullptr)); }

// The first popcount(m) of 16 values (the rest zero): a run's short last register.
inline __m512 load16m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16m(const bf16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// n values of x as int8 codes + 128 in q (x * 127 / max|x|, nearest even, clamped to +-127); returns the
// scale max|x| / 127 (0 for all zeros: every code 128). The int8 linears' activations: a row (oneDNN's
// route, quantize_rows) or a segment of one (kvledger's VNNI kernel).
template <typename T> inline float quantize_u8(const T* x, long n, uint8_t* q) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  auto mask = [n](long i) { return n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1); };
  __m512 mx = _mm512_setzero_ps();
  for (long i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(load16m(x + i, mask(i)), sign));
  const float amax = _mm512_reduce_max_ps(mx);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (long i = 0; i < n; i += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load16m(x + i, mask(i)), inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    _mm512_mask_cvtepi32_storeu_epi8(q + i, mask(i), _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128)));
  }
  return amax / 127.f;
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }

// One 4-byte run broadcast to every int32 lane (the activations' operand of vpdpbusd: lane l is output
// row l, so one broadcast feeds 16 rows' dot products).
inline __m512i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 fp16 values (16 rows' side-by-side scales) widened to float.
inline __m512 half16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }

// The lanes of k of one output register, at element i of y: float, or bf16 rounded as to_bf16.
inline void store_lanes(void* y, bool bf16, long i, __m512 v, __mmask16 k) {
  if (bf16)
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, k, to_bf16(v));
  else
    _mm512_mask_storeu_ps(static_cast<float*>(y) + i, k, v);
}

// exp on 16 floats: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the Taylor polynomial of degree 7
// (relative error < 2e-7, about one float ulp); inputs clamped to exp's finite range.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace
}  // namespace kvl
