// The kernel on the repacked Q4_K / Q6_K / Q8_0 / Q5_0 layouts (gguf_blocks.h) with AVX512-VNNI (compiled for that ISA
// whatever the build flags, called only where the CPU reports it: ops.cpp). One output row a lane: per 8
// inputs one 64-byte load of 16 rows' codes, the nibbles split in registers (and, shift: nothing written
// back to memory), and per activation row two vpdpbusd with the row's broadcast 4-byte activations (Q6_K:
// the high 2 bits or-ed in from a second load a 16 inputs). The integer dot of each scale unit is then
// scaled once (d * sc from the side-by-side scales, times the activations' group scale) into a float
// lane: the tiles' sums in the tiles' order (gguf_vnni.cpp's tile_dot), for every batch size.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gguf_blocks.h"
#include "kernels.h"
#include "simd512.h"

namespace kvl {
namespace {

// Activation rows [m0, m0 + MR) x NB groups of 16 rows (g: the first group's bytes, gstride a group's).
// The codes of up to two groups unpacked to one byte each, once a call where several blocks of 4
// activation rows pass over them (ub: [NB][K / 4][64], the tiles' layout): the nibbles' and/shift (and
// Q6_K's or of its high bits) then cost once per weight instead of once per 4 activation rows.
// With them the unit scales as floats (sf: [NB][K / 16][16], d * sc, the same products as the dot's) and
// Q4_K's mins (mf: [NB][K / 32][16], -(dmin * m)), which every block of rows would otherwise convert again.
void unpack_codes(int kind, const uint8_t* g, long gstride, long K, int nb_groups, uint8_t* ub, float* sf, float* mf) {
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  const __m512 sign = _mm512_set1_ps(-0.f);
  const long nb = K / 256;
  for (int b = 0; b < nb_groups; ++b) {
    uint8_t* o = ub + b * K * 16;
    for (long s = 0; s < nb; ++s) {
      if (kind == kQ4_Kx16) {
        const uint8_t* base = g + b * gstride + s * 2368;
        const __m512 dv = half16(base), dminv = half16(base + 32);
        for (int j = 0; j < 8; ++j) {
          const __m128i scb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 64 + 16 * j));
          const __m128i mb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 192 + 16 * j));
          _mm512_storeu_ps(sf + (b * K / 16 + 8 * s + j) * 16,
                           _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scb))));
          _mm512_storeu_ps(mf + (b * K / 32 + 8 * s + j) * 16,
                           _mm512_xor_ps(_mm512_mul_ps(dminv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb))), sign));
        }
        const uint8_t* q = base + 320;
        for (int c = 0; c < 32; ++c) {  // 8 inputs: low nibbles 4, high 4
          const __m512i wv = _mm512_loadu_si512(q + 64 * c);
          _mm512_storeu_si512(o + (64 * s + 2 * c) * 64, _mm512_and_si512(wv, m4));
          _mm512_storeu_si512(o + (64 * s + 2 * c + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4));
        }
      } else {
        const uint8_t* base = g + b * gstride + s * 3360;
        const __m512 dv = half16(base);
        for (int t = 0; t < 16; ++t) {
          const __m128i scb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 + 16 * t));
          _mm512_storeu_ps(sf + (b * K / 16 + 16 * s + t) * 16,
                           _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scb)), dv));
        }
        for (int t = 0; t < 16; ++t) {
          const __m512i l0 = _mm512_loadu_si512(base + 288 + 128 * t);
          const __m512i l1 = _mm512_loadu_si512(base + 288 + 128 * t + 64);
          const __m512i h = _mm512_loadu_si512(base + 2336 + 64 * t);
          uint8_t* p = o + (64 * s + 4 * t) * 64;
          _mm512_storeu_si512(p, _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30)));
          _mm512_storeu_si512(p + 64, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                                                      _mm512_and_si512(_mm512_slli_epi16(h, 2), m30)));
          _mm512_storeu_si512(p + 128, _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(h, m30)));
          _mm512_storeu_si512(p + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                                       _mm512_and_si512(_mm512_srli_epi16(h, 2), m30)));
        }
      }
    }
  }
}

template <int MR, int NB, bool PRE>
void q4k_dot(const GgufActs& a, long K, int m0, const uint8_t* g, long gstride, const uint8_t* ub, const float* sf,
             const float* mf, void* y, bool bf16, long N, long n, long rows) {
  constexpr long GB = 2368;
  const long Kp = a.Kp, Gp = Kp / 32, nb = K / 256;
  const uint8_t* X = reinterpret_cast<const uint8_t*>(a.xq);
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < MR; ++r) acc[b][r] = _mm512_setzero_ps();
  for (long s = 0; s < nb; ++s) {
    const uint8_t* base[NB];
    __m512 dv[NB], dminv[NB];
    for (int b = 0; b < NB; ++b) {
      base[b] = g + b * gstride + s * GB;
      dv[b] = half16(base[b]);
      dminv[b] = half16(base[b] + 32);
    }
    for (int j = 0; j < 8; ++j) {
      const long e0 = 256 * s + 32 * j, u = 8 * s + j;  // unit = group of 32: u
      __m512i d[NB][MR], d2[NB][MR];
      for (int b = 0; b < NB; ++b)
        for (int r = 0; r < MR; ++r) d[b][r] = d2[b][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i lo[NB], hi[NB];
        for (int b = 0; b < NB; ++b) {
          if constexpr (PRE) {
            const uint8_t* p = ub + b * K * 16 + (64 * s + 2 * (4 * j + c)) * 64;
            lo[b] = _mm512_loadu_si512(p);
            hi[b] = _mm512_loadu_si512(p + 64);
          } else {
            const __m512i wv = _mm512_loadu_si512(base[b] + 320 + (4 * j + c) * 64);
            lo[b] = _mm512_and_si512(wv, m4);
            hi[b] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
          }
        }
        for (int r = 0; r < MR; ++r) {
          const uint8_t* xr = X + (m0 + r) * Kp + e0 + 8 * c;
          const __m512i x0 = bcast4(xr), x1 = bcast4(xr + 4);
          for (int b = 0; b < NB; ++b) {
            d[b][r] = _mm512_dpbusd_epi32(d[b][r], lo[b], x0);
            // two chains a lane where few rows leave the dot's latency exposed (exact: integers)
            if constexpr (MR <= 2) d2[b][r] = _mm512_dpbusd_epi32(d2[b][r], hi[b], x1);
            else d[b][r] = _mm512_dpbusd_epi32(d[b][r], hi[b], x1);
          }
        }
      }
      __m512 sc[NB], mv[NB];
      for (int b = 0; b < NB; ++b) {
        if constexpr (PRE) {
          sc[b] = _mm512_loadu_ps(sf + (b * K / 16 + u) * 16);
          mv[b] = _mm512_loadu_ps(mf + (b * K / 32 + u) * 16);
          continue;
        }
        const __m128i scb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base[b] + 64 + 16 * j));
        const __m128i mb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base[b] + 192 + 16 * j));
        sc[b] = _mm512_mul_ps(dv[b], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scb)));  // d * sc: one rounding
        mv[b] = _mm512_xor_ps(_mm512_mul_ps(dminv[b], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mb))), sign);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512 sxb = _mm512_set1_ps(a.sx[(m0 + r) * Gp + u]);
        const __m512 xs = _mm512_set1_ps(a.xsum[(m0 + r) * Gp + u]);
        for (int b = 0; b < NB; ++b) {
          __m512i dd = d[b][r];
          if constexpr (MR <= 2) dd = _mm512_add_epi32(dd, d2[b][r]);
          acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), _mm512_mul_ps(sc[b], sxb), acc[b][r]);
          acc[b][r] = _mm512_fmadd_ps(mv[b], xs, acc[b][r]);
        }
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const long valid = std::min<long>(16, rows - 16 * b);
    const __mmask16 k = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < MR; ++r) store_lanes(y, bf16, (m0 + r) * N + n + 16 * b, acc[b][r], k);
  }
}

// Q6_K: codes q = 0..63 unsigned against the signed activations, so each unit of 16 starts at -32 * the
// integer sum of its activations (xs16): the same integer as the tiles' sum of (q - 32) * xq.
template <int MR, int NB, bool PRE>
void q6k_dot(const GgufActs& a, long K, int m0, const uint8_t* g, long gstride, const uint8_t* ub, const float* sf,
             const int32_t* xs16, void* y, bool bf16, long N, long n, long rows) {
  constexpr long GB = 3360;
  const long Kp = a.Kp, Gp = Kp / 32, nb = K / 256, U16 = Kp / 16;
  const uint8_t* X = reinterpret_cast<const uint8_t*>(a.xq);
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < MR; ++r) acc[b][r] = _mm512_setzero_ps();
  for (long s = 0; s < nb; ++s) {
    const uint8_t* base[NB];
    __m512 dv[NB];
    for (int b = 0; b < NB; ++b) {
      base[b] = g + b * gstride + s * GB;
      dv[b] = half16(base[b]);
    }
    for (int t = 0; t < 16; ++t) {
      const long e0 = 256 * s + 16 * t, u = 16 * s + t;
      __m512i d[NB][MR], d2[NB][MR];
      for (int r = 0; r < MR; ++r) {
        const __m512i init = _mm512_set1_epi32(-32 * xs16[(m0 + r) * U16 + u]);
        for (int b = 0; b < NB; ++b) {
          d[b][r] = init;
          d2[b][r] = _mm512_setzero_si512();
        }
      }
      __m512i w[NB][4];
      for (int b = 0; b < NB; ++b) {
        if constexpr (PRE) {
          const uint8_t* p = ub + b * K * 16 + (64 * s + 4 * t) * 64;
          for (int i = 0; i < 4; ++i) w[b][i] = _mm512_loadu_si512(p + 64 * i);
          continue;
        }
        const __m512i l0 = _mm512_loadu_si512(base[b] + 288 + 128 * t);
        const __m512i l1 = _mm512_loadu_si512(base[b] + 288 + 128 * t + 64);
        const __m512i h = _mm512_loadu_si512(base[b] + 2336 + 64 * t);
        w[b][0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
        w[b][1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4),
                                  _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
        w[b][2] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(h, m30));
        w[b][3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                  _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
      }
      for (int r = 0; r < MR; ++r) {
        const uint8_t* xr = X + (m0 + r) * Kp + e0;
        const __m512i x0 = bcast4(xr), x1 = bcast4(xr + 4), x2 = bcast4(xr + 8), x3 = bcast4(xr + 12);
        for (int b = 0; b < NB; ++b) {  // two chains a lane only for few rows (registers: 32)
          __m512i& e = MR <= 2 ? d2[b][r] : d[b][r];
          d[b][r] = _mm512_dpbusd_epi32(d[b][r], w[b][0], x0);
          e = _mm512_dpbusd_epi32(e, w[b][1], x1);
          d[b][r] = _mm512_dpbusd_epi32(d[b][r], w[b][2], x2);
          e = _mm512_dpbusd_epi32(e, w[b][3], x3);
        }
      }
      __m512 sc[NB];
      for (int b = 0; b < NB; ++b) {
        if constexpr (PRE) {
          sc[b] = _mm512_loadu_ps(sf + (b * K / 16 + u) * 16);
          continue;
        }
        const __m128i scb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base[b] + 32 + 16 * t));
        sc[b] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scb)), dv[b]);  // sc * d: one rounding
      }
      for (int r = 0; r < MR; ++r) {
        const __m512 sxb = _mm512_set1_ps(a.sx[(m0 + r) * Gp + u / 2]);
        for (int b = 0; b < NB; ++b) {
          const __m512i dd = MR <= 2 ? _mm512_add_epi32(d[b][r], d2[b][r]) : d[b][r];
          acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), _mm512_mul_ps(sc[b], sxb), acc[b][r]);
        }
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const long valid = std::min<long>(16, rows - 16 * b);
    const __mmask16 k = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < MR; ++r) store_lanes(y, bf16, (m0 + r) * N + n + 16 * b, acc[b][r], k);
  }
}

// Q8_0 / Q5_0 (gguf_blocks.h: the scale plane, then the codes block after block): per block of 32 inputs
// (the unit) the codes unsigned (Q8_0: q + 128, Q5_0: q) against the signed activations, the dot started
// at -bias * the activations' integer sum (bias 128 / 16): the tiles' integer; then acc = fma(float(D),
// d * sx, acc), the tiles' order. Q5_0's fifth bits: byte i of a lane holds bit c for the 4-input step c,
// moved to bit 4 and or-ed into the step's nibbles. PRE (Q5_0 from 5 rows): the codes unpacked once a
// call into ub ([NB][K / 4][64]) and the block scales as floats into sf ([NB][K / 32][16]).
template <bool Q5>
inline __m512i q32_codes(const uint8_t* cb, int c) {
  if constexpr (!Q5) {
    return _mm512_loadu_si512(cb + 64 * c);
  } else {
    const __m512i m4 = _mm512_set1_epi8(15), m10 = _mm512_set1_epi8(0x10);
    const __m512i l = _mm512_loadu_si512(cb + 64 * (c / 2));
    const __m512i nib = (c & 1) ? _mm512_and_si512(_mm512_srli_epi16(l, 4), m4) : _mm512_and_si512(l, m4);
    const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512(cb + 256), c);  // bit c of each byte to bit 0
    return _mm512_or_si512(nib, _mm512_and_si512(_mm512_slli_epi16(h, 4), m10));
  }
}

void unpack_q50(const uint8_t* g, long gstride, long K, int nb_groups, uint8_t* ub, float* sf) {
  const long nb = K / 32;
  for (int b = 0; b < nb_groups; ++b) {
    const uint8_t* gp = g + b * gstride;
    for (long s = 0; s < nb; ++s) {
      _mm512_storeu_ps(sf + (b * nb + s) * 16, half16(gp + 32 * s));
      const uint8_t* cb = gp + 32 * nb + 320 * s;
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) _mm512_storeu_si512(ub + b * K * 16 + (32 * s + 4 * c) * 16, q32_codes<true>(cb, c));
    }
  }
}

template <int MR, int NB, bool PRE, bool Q5>
void q32_dot(const GgufActs& a, long K, int m0, const uint8_t* g, long gstride, const uint8_t* ub, const float* sf,
             const int32_t* xs16, void* y, bool bf16, long N, long n, long rows) {
  constexpr long CB = Q5 ? 320 : 512;
  constexpr int bias = Q5 ? 16 : 128;
  const long Kp = a.Kp, Gp = Kp / 32, nb = K / 32, U16 = Kp / 16;
  const int8_t* X = a.xq;
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < MR; ++r) acc[b][r] = _mm512_setzero_ps();
  for (long s = 0; s < nb; ++s) {
    __m512i d[NB][MR], d2[NB][MR];
    for (int r = 0; r < MR; ++r) {
      const int32_t* xs = xs16 + (m0 + r) * U16 + 2 * s;
      const __m512i init = _mm512_set1_epi32(-bias * (xs[0] + xs[1]));
      for (int b = 0; b < NB; ++b) {
        d[b][r] = init;
        d2[b][r] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i w[NB];
      for (int b = 0; b < NB; ++b) {
        if constexpr (PRE) w[b] = _mm512_loadu_si512(ub + b * K * 16 + (32 * s + 4 * c) * 16);
        else w[b] = q32_codes<Q5>(g + b * gstride + 32 * nb + CB * s, c);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i x = bcast4(X + (m0 + r) * Kp + 32 * s + 4 * c);
        for (int b = 0; b < NB; ++b) {  // two chains a lane where few rows leave the latency exposed
          if (MR <= 2 && (c & 1)) d2[b][r] = _mm512_dpbusd_epi32(d2[b][r], w[b], x);
          else d[b][r] = _mm512_dpbusd_epi32(d[b][r], w[b], x);
        }
      }
    }
    __m512 sc[NB];
    for (int b = 0; b < NB; ++b) sc[b] = PRE ? _mm512_loadu_ps(sf + (b * nb + s) * 16) : half16(g + b * gstride + 32 * s);
    for (int r = 0; r < MR; ++r) {
      const __m512 sxb = _mm512_set1_ps(a.sx[(m0 + r) * Gp + s]);
      for (int b = 0; b < NB; ++b) {
        const __m512i dd = MR <= 2 ? _mm512_add_epi32(d[b][r], d2[b][r]) : d[b][r];
        acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), _mm512_mul_ps(sc[b], sxb), acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const long valid = std::min<long>(16, rows - 16 * b);
    const __mmask16 k = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < MR; ++r) store_lanes(y, bf16, (m0 + r) * N + n + 16 * b, acc[b][r], k);
  }
}

template <int NB, bool PRE, bool Q5>
void run32(const GgufActs& a, long K, const uint8_t* g, long gstride, const uint8_t* ub, const float* sf,
           const int32_t* xs16, void* y, bool bf16, long N, long n, long rows) {
  for (int m0 = 0; m0 < a.M; m0 += 4) {
    switch (a.M - m0 >= 4 ? 4 : a.M - m0) {
      case 4: q32_dot<4, NB, PRE, Q5>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows); break;
      case 3: q32_dot<3, NB, PRE, Q5>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows); break;
      case 2: q32_dot<2, NB, PRE, Q5>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows); break;
      default: q32_dot<1, NB, PRE, Q5>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows);
    }
  }
}

template <int NB, bool PRE>
void run(const GgufActs& a, int kind, long K, const uint8_t* g, long gstride, const uint8_t* ub, const float* sf,
         const float* mf, const int32_t* xs16, void* y, bool bf16, long N, long n, long rows) {
  for (int m0 = 0; m0 < a.M; m0 += 4) {
    const int mr = a.M - m0 >= 4 ? 4 : a.M - m0;
    if (kind == kQ4_Kx16) {
      switch (mr) {
        case 4: q4k_dot<4, NB, PRE>(a, K, m0, g, gstride, ub, sf, mf, y, bf16, N, n, rows); break;
        case 3: q4k_dot<3, NB, PRE>(a, K, m0, g, gstride, ub, sf, mf, y, bf16, N, n, rows); break;
        case 2: q4k_dot<2, NB, PRE>(a, K, m0, g, gstride, ub, sf, mf, y, bf16, N, n, rows); break;
        default: q4k_dot<1, NB, PRE>(a, K, m0, g, gstride, ub, sf, mf, y, bf16, N, n, rows);
      }
    } else {
      switch (mr) {
        case 4: q6k_dot<4, NB, PRE>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows); break;
        case 3: q6k_dot<3, NB, PRE>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows); break;
        case 2: q6k_dot<2, NB, PRE>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows); break;
        default: q6k_dot<1, NB, PRE>(a, K, m0, g, gstride, ub, sf, xs16, y, bf16, N, n, rows);
      }
    }
  }
}

}  // namespace

void gguf_packed_vnni(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                      long n0, long n1) {
  if (!gguf_is_packed(kind)) return;
  const long gstride = gguf_rows_bytes(kind, kGgufGroup, K), Kp = a.Kp, U16 = Kp / 16;
  const bool small = gguf_packed_block(kind) == 32;
  thread_local std::vector<int32_t> xs16_v;
  if (kind != kQ4_Kx16 && a.xs16 == nullptr) {  // the activations' integer sums a unit of 16 (gguf_linear's)
    xs16_v.resize(static_cast<size_t>(a.M) * U16);
    for (int m = 0; m < a.M; ++m) {
      const int8_t* xq = a.xq + m * Kp;
      for (long u = 0; u < U16; ++u) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16 * u));
        xs16_v[m * U16 + u] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(v));
      }
    }
  }
  const int32_t* xs16 = a.xs16 ? a.xs16 : xs16_v.data();
  // More than one block of 4 activation rows: the tile's codes unpacked once (same integers, same sums);
  // Q8_0's codes are bytes already
  const bool pre = a.M > 4 && kind != kQ8_0x16;
  thread_local std::vector<uint8_t> ub_v;
  thread_local std::vector<float> sf_v, mf_v;
  if (pre) {
    ub_v.resize(2 * K * 16);
    sf_v.resize(2 * K);
    mf_v.resize(K);
  }
  for (long n = n0; n < n1; n += 2 * kGgufGroup) {
    const long rows = std::min<long>(2 * kGgufGroup, n1 - n);
    const uint8_t* g = w + (n - row0) / kGgufGroup * gstride;
    const int ng = rows > kGgufGroup ? 2 : 1;
    const uint8_t* ub = ub_v.data();
    const float *sf = sf_v.data(), *mf = mf_v.data();
    if (small) {
      if (pre) unpack_q50(g, gstride, K, ng, ub_v.data(), sf_v.data());
      if (kind == kQ8_0x16) {
        if (ng == 2) run32<2, false, false>(a, K, g, gstride, ub, sf, xs16, y, out_bf16, N, n, rows);
        else run32<1, false, false>(a, K, g, gstride, ub, sf, xs16, y, out_bf16, N, n, rows);
      } else if (pre) {
        if (ng == 2) run32<2, true, true>(a, K, g, gstride, ub, sf, xs16, y, out_bf16, N, n, rows);
        else run32<1, true, true>(a, K, g, gstride, ub, sf, xs16, y, out_bf16, N, n, rows);
      } else {
        if (ng == 2) run32<2, false, true>(a, K, g, gstride, ub, sf, xs16, y, out_bf16, N, n, rows);
        else run32<1, false, true>(a, K, g, gstride, ub, sf, xs16, y, out_bf16, N, n, rows);
      }
      continue;
    }
    if (pre) unpack_codes(kind, g, gstride, K, ng, ub_v.data(), sf_v.data(), mf_v.data());
    if (ng == 2) {
      if (pre) run<2, true>(a, kind, K, g, gstride, ub, sf, mf, xs16, y, out_bf16, N, n, rows);
      else run<2, false>(a, kind, K, g, gstride, ub, sf, mf, xs16, y, out_bf16, N, n, rows);
    } else {
      if (pre) run<1, true>(a, kind, K, g, gstride, ub, sf, mf, xs16, y, out_bf16, N, n, rows);
      else run<1, false>(a, kind, K, g, gstride, ub, sf, mf, xs16, y, out_bf16, N, n, rows);
    }
  }
}

}  // namespace kvl
