// GGUF-block linear with AVX512-VNNI (compiled for that ISA whatever the build flags, called only where
// the CPU reports it: ops.cpp). Each weight row is decoded once (vectorized for the kinds a Q4_K_M file
// holds; the others through gguf_blocks.h's portable decode, the same bytes) into L1, then every run of
// up to 8 activation rows passes over it: per 64 elements one vpdpbusd, a conversion, a multiply and a
// fused multiply-add each row. Same sums in the same order as gguf_scalar.cpp: equal bit for bit.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gguf_blocks.h"
#include "kernels.h"
#include "simd512.h"

namespace kvl {
namespace {

inline float fp16(const uint8_t* p) {  // F16C: the same value as gguf_ref::fp16, one instruction
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline void fill8(float* p, float v) { _mm256_storeu_ps(p, _mm256_set1_ps(v)); }

// The decoders write whole 64-byte chunks (codes) and 16-float lanes (wl) with one store each: the dot
// loop reads them back at once with 512-bit loads, and a load that spans two smaller stores still in
// flight cannot be forwarded from them (it waits for both to retire; that stall was most of a
// one-row call).
inline void put64(uint8_t* p, __m256i lo, __m256i hi) {
  _mm512_storeu_si512(p, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}
inline void put_wl(float* p, float d0, float d1) {
  _mm512_storeu_ps(p, _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1));
}

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes: low nibbles then high nibbles, 32 codes
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

inline void put32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

// A 32-element kind, two blocks a chunk: blk32(block pointer) -> its 32 codes; the last odd block alone.
template <typename F>
void decode_pairs(const uint8_t* row, long nb, long bytes, uint8_t* codes, float* wl, const F& blk32) {
  long b = 0;
  for (; b + 1 < nb; b += 2) {
    const uint8_t* p = row + b * bytes;
    put64(codes + 32 * b, blk32(p), blk32(p + bytes));
    put_wl(wl + 8 * b, fp16(p), fp16(p + bytes));
  }
  if (b < nb) {
    const uint8_t* p = row + b * bytes;
    put32(codes + 32 * b, blk32(p));
    fill8(wl + 8 * b, fp16(p));
  }
}

void decode_q4_0(const uint8_t* row, long nb, uint8_t* codes, float* wl, bool iq4nl) {
  const __m256i eight = _mm256_set1_epi8(8);
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(gguf_ref::kIQ4NL)));
  decode_pairs(row, nb, 18, codes, wl, [&](const uint8_t* blk) {
    const __m256i q = nibbles32(blk + 2);
    return iq4nl ? _mm256_shuffle_epi8(table, q) : _mm256_sub_epi8(q, eight);
  });
}

void decode_q5_0(const uint8_t* row, long nb, uint8_t* codes, float* wl) {
  const __m256i sixteen = _mm256_set1_epi8(16);
  decode_pairs(row, nb, 22, codes, wl, [&](const uint8_t* blk) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    const __m256i hi = _mm256_and_si256(_mm256_movm_epi8(qh), sixteen);
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(blk + 6), hi), sixteen);
  });
}

void decode_q8_0(const uint8_t* row, long nb, uint8_t* codes, float* wl) {
  decode_pairs(row, nb, 34, codes, wl, [&](const uint8_t* blk) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  });
}

void decode_qk(int kind, const uint8_t* row, long nb, uint8_t* codes, float* wl, float* mn) {
  const bool q5 = kind == kQ5_K;
  const long bytes = q5 ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
  for (long b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = fp16(blk), dmin = fp16(blk + 2);
    const uint8_t* qs = blk + (q5 ? 48 : 16);
    const __m256i qh = q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
    uint8_t* o = codes + 256 * b;
    float sc[8];
    for (int j = 0; j < 8; ++j) {
      int s, m;
      gguf_ref::scale_min_k4(j, blk + 4, &s, &m);
      sc[j] = d * static_cast<float>(s);
      mn[8 * b + j] = -(dmin * static_cast<float>(m));
    }
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
      __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (q5) {
        const __mmask32 b0 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * i))));
        const __mmask32 b1 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(2 << (2 * i))));
        lo = _mm256_mask_add_epi8(lo, b0, lo, sixteen);  // bit 4 is clear: the add is an or
        hi = _mm256_mask_add_epi8(hi, b1, hi, sixteen);
      }
      put64(o + 64 * i, lo, hi);
      put_wl(wl + 64 * b + 16 * i, sc[2 * i], sc[2 * i + 1]);
    }
  }
}

void decode_q6_k(const uint8_t* row, long nb, uint8_t* codes, float* wl) {
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  // lane l of chunk c (elements 64c + 4l ..) takes scale 4c + l / 4
  const __m512i lane_quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (long b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 210;
    const float d = fp16(blk + 208);
    const __m512 sc = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))),
        _mm512_set1_ps(d));  // d * sc[i], exact as the portable product (one rounding each)
    uint8_t* o = codes + 256 * b;
    for (int h = 0; h < 2; ++h) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(q, 4), m30));
      const __m256i q1 = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(q, 2), m30));
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(q, m30));
      const __m256i q3 =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_and_si256(_mm256_srli_epi16(q, 2), m30));
      put64(o + 128 * h, _mm256_sub_epi8(q0, off), _mm256_sub_epi8(q1, off));
      put64(o + 128 * h + 64, _mm256_sub_epi8(q2, off), _mm256_sub_epi8(q3, off));
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i idx = _mm512_add_epi32(lane_quarter, _mm512_set1_epi32(4 * c));
      _mm512_storeu_ps(wl + 64 * b + 16 * c, _mm512_permutexvar_ps(idx, sc));
    }
  }
}

void decode_row(int kind, const GgufFormat& f, const uint8_t* row, long K, long Kp, uint8_t* codes, float* wl,
                float* mn) {
  const long nb = K / f.block;
  switch (kind) {
    case kQ4_0: decode_q4_0(row, nb, codes, wl, false); break;
    case kIQ4_NL: decode_q4_0(row, nb, codes, wl, true); break;
    case kQ5_0: decode_q5_0(row, nb, codes, wl); break;
    case kQ8_0: decode_q8_0(row, nb, codes, wl); break;
    case kQ4_K:
    case kQ5_K: decode_qk(kind, row, nb, codes, wl, mn); break;
    case kQ6_K: decode_q6_k(row, nb, codes, wl); break;
    default: gguf_ref::decode_row(kind, f, row, K, Kp, codes, wl, mn); return;  // Q4_1, Q5_1: pads itself
  }
  for (long e = K; e < Kp; e += 32) put32(codes + e, _mm256_setzero_si256());
  for (long e = K / 4; e < Kp / 4; e += 8) fill8(wl + e, 0.f);
  for (long e = K / 32; e < Kp / 32; ++e) mn[e] = 0.f;
}

inline float hsum16(__m512 v) {  // a[i] + a[i+8], then + [i+4], + [i+2], + [i+1] (gguf_scalar.cpp's order)
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// Activation rows [m0, m0 + MT) against one decoded weight row.
template <int MT, bool SIGNED>
void dot_rows(const GgufActs& a, int m0, const uint8_t* codes, const float* wl, const float* mn, void* y, bool bf16,
              long N, long n) {
  const long Kp = a.Kp, L = Kp / 4, G = Kp / 32;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i ones = _mm512_set1_epi8(1);
  for (long c = 0; c < Kp / 64; ++c) {
    const __m512i w = _mm512_loadu_si512(codes + 64 * c);
    const __m512 s = _mm512_loadu_ps(wl + 16 * c);
    __m512i corr = _mm512_setzero_si512();
    // Signed codes: the activations enter as xq + 128; start each lane at -128 * its codes' sum.
    if constexpr (SIGNED) corr = _mm512_sub_epi32(corr, _mm512_slli_epi32(_mm512_dpbusd_epi32(corr, ones, w), 7));
    for (int m = 0; m < MT; ++m) {
      const long r = m0 + m;
      __m512i dot;
      if constexpr (SIGNED) dot = _mm512_dpbusd_epi32(corr, _mm512_loadu_si512(a.xu + r * Kp + 64 * c), w);
      else dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(a.xq + r * Kp + 64 * c));
      const __m512 sc = _mm512_mul_ps(s, _mm512_loadu_ps(a.sxl + r * L + 16 * c));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[m]);
    }
  }
  if constexpr (!SIGNED) {
    for (long g = 0; g < G; g += 16) {
      const __mmask16 k = G - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (G - g)) - 1);
      const __m512 mv = _mm512_maskz_loadu_ps(k, mn + g);
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, a.xsum + (m0 + m) * G + g), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    const float v = hsum16(acc[m]);
    const long i = (m0 + m) * N + n;
    if (bf16) static_cast<uint16_t*>(y)[i] = f_to_bf16(v);
    else static_cast<float*>(y)[i] = v;
  }
}

template <bool SIGNED>
void dot_all(const GgufActs& a, const uint8_t* codes, const float* wl, const float* mn, void* y, bool bf16, long N,
             long n) {
  for (int m0 = 0; m0 < a.M; m0 += 8) {
    switch (a.M - m0 >= 8 ? 8 : a.M - m0) {
      case 8: dot_rows<8, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      case 7: dot_rows<7, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      case 6: dot_rows<6, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      case 5: dot_rows<5, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      case 4: dot_rows<4, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      case 3: dot_rows<3, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      case 2: dot_rows<2, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n); break;
      default: dot_rows<1, SIGNED>(a, m0, codes, wl, mn, y, bf16, N, n);
    }
  }
}


// --- the tiles' path (gguf_blocks.h): 16 weight rows a block in the packed kernel's layout -------------

// 16 registers of 16 dwords, rows to columns: r[i] lane j -> r[j] lane i (unpacks within 128-bit lanes,
// then a 4 x 4 transpose of the 128-bit lanes).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane q: column 4q + k of rows 4i .. 4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i u3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// One tile's decode: rows row-decoded (decode_row above, into L1), then per block of 16 rows the codes
// [Kp/4][16][4], the unit scales [U][16], the group mins [G][16] (unsigned kinds) and -128 * each
// unit's code sum [U][16] (signed kinds).
struct TileBuf {
  std::vector<uint8_t> rows;  // [16][Kp]
  std::vector<float> wl, mn;  // [16][Kp/4], [16][Kp/32]
  std::vector<uint8_t> codes;  // [2][Kp/4][64]
  std::vector<float> scale, mins;  // [2][Kp/16][16], [2][Kp/32][16]
  std::vector<int32_t> corr;  // [2][Kp/16][16]
  void size(long Kp) {
    rows.resize(16 * Kp);
    wl.resize(16 * Kp / 4);
    mn.resize(16 * Kp / 32);
    codes.resize(2 * Kp * 16);
    scale.resize(2 * Kp);
    mins.resize(2 * Kp / 2);
    corr.resize(2 * Kp);
  }
};

void decode_block(int kind, const GgufFormat& f, const uint8_t* w, long K, long Kp, long rows, TileBuf& t, int b) {
  const long L = Kp / 4, Gp = Kp / 32, S = gguf_unit(kind), U = K / S, row_bytes = K / f.block * f.bytes;
  for (long i = 0; i < 16; ++i) {
    if (i < rows) {
      decode_row(kind, f, w + i * row_bytes, K, Kp, t.rows.data() + i * Kp, t.wl.data() + i * L, t.mn.data() + i * Gp);
    } else {  // past the part's last row: zero codes, scales and mins (their lanes are not stored)
      std::memset(t.rows.data() + i * Kp, 0, Kp);
      std::memset(t.wl.data() + i * L, 0, L * sizeof(float));
      std::memset(t.mn.data() + i * Gp, 0, Gp * sizeof(float));
    }
  }
  uint8_t* codes = t.codes.data() + b * Kp * 16;
  for (long c = 0; c < Kp / 64; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(t.rows.data() + i * Kp + 64 * c);
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(codes + (16 * c + j) * 64, r[j]);
  }
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i wl_idx = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(L)));
  float* scale = t.scale.data() + b * Kp;
  for (long u = 0; u < U; ++u) {
    _mm512_storeu_ps(scale + 16 * u, _mm512_i32gather_ps(wl_idx, t.wl.data() + u * S / 4, 4));
  }
  if (f.signed_codes) {
    int32_t* corr = t.corr.data() + b * Kp;
    const __m512i ones = _mm512_set1_epi8(1);
    for (long u = 0; u < U; ++u) {
      __m512i sum = _mm512_setzero_si512();
      for (long k4 = u * S / 4; k4 < (u + 1) * S / 4; ++k4) {
        sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(codes + 64 * k4));
      }
      _mm512_storeu_si512(corr + 16 * u, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
    }
  } else {
    const __m512i mn_idx = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(Gp)));
    float* mins = t.mins.data() + b * Kp / 2;
    for (long g = 0; g < K / 32; ++g) _mm512_storeu_ps(mins + 16 * g, _mm512_i32gather_ps(mn_idx, t.mn.data() + g, 4));
  }
}

// Activation rows [m0, m0 + MR) x NB blocks of 16 weight rows (outputs n ..): MR * NB int32 and float
// accumulators; per 4 inputs NB weight loads and MR broadcasts.
template <int MR, int NB, bool SIGNED, int S>
void tile_dot(const GgufActs& a, long K, int m0, const TileBuf& t, void* y, bool bf16, long N, long n, long rows) {
  const long Kp = a.Kp, Gp = Kp / 32, U = K / S;
  const uint8_t* X = SIGNED ? a.xu : reinterpret_cast<const uint8_t*>(a.xq);
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < MR; ++r) acc[b][r] = _mm512_setzero_ps();
  for (long u = 0; u < U; ++u) {
    __m512i d[NB][MR];
    for (int b = 0; b < NB; ++b) {
      const __m512i init = SIGNED ? _mm512_loadu_si512(t.corr.data() + b * Kp + 16 * u) : _mm512_setzero_si512();
      for (int r = 0; r < MR; ++r) d[b][r] = init;
    }
#pragma GCC unroll 8
    for (int k4 = 0; k4 < S / 4; ++k4) {
      const long e = u * S + 4 * k4;
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(t.codes.data() + b * Kp * 16 + e * 16);
      for (int r = 0; r < MR; ++r) {
        const __m512i xb = bcast4(X + (m0 + r) * Kp + e);
        for (int b = 0; b < NB; ++b) {
          d[b][r] = SIGNED ? _mm512_dpbusd_epi32(d[b][r], xb, wv[b]) : _mm512_dpbusd_epi32(d[b][r], wv[b], xb);
        }
      }
    }
    const long g = u * S / 32;
    __m512 sc[NB];
    for (int b = 0; b < NB; ++b) sc[b] = _mm512_loadu_ps(t.scale.data() + b * Kp + 16 * u);
    for (int r = 0; r < MR; ++r) {
      const __m512 sxb = _mm512_set1_ps(a.sx[(m0 + r) * Gp + g]);
      for (int b = 0; b < NB; ++b) {
        acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[b][r]), _mm512_mul_ps(sc[b], sxb), acc[b][r]);
      }
    }
    if constexpr (!SIGNED) {
      __m512 mv[NB];
      for (int b = 0; b < NB; ++b) mv[b] = _mm512_loadu_ps(t.mins.data() + b * Kp / 2 + 16 * g);
      for (int r = 0; r < MR; ++r) {
        const __m512 xs = _mm512_set1_ps(a.xsum[(m0 + r) * Gp + g]);
        for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_fmadd_ps(mv[b], xs, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const long valid = std::min<long>(16, rows - 16 * b);
    const __mmask16 k = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < MR; ++r) store_lanes(y, bf16, (m0 + r) * N + n + 16 * b, acc[b][r], k);
  }
}

template <int NB, bool SIGNED, int S>
void tile_all(const GgufActs& a, long K, const TileBuf& t, void* y, bool bf16, long N, long n, long rows) {
  for (int m0 = 0; m0 < a.M; m0 += 4) {
    switch (a.M - m0 >= 4 ? 4 : a.M - m0) {
      case 4: tile_dot<4, NB, SIGNED, S>(a, K, m0, t, y, bf16, N, n, rows); break;
      case 3: tile_dot<3, NB, SIGNED, S>(a, K, m0, t, y, bf16, N, n, rows); break;
      case 2: tile_dot<2, NB, SIGNED, S>(a, K, m0, t, y, bf16, N, n, rows); break;
      default: tile_dot<1, NB, SIGNED, S>(a, K, m0, t, y, bf16, N, n, rows);
    }
  }
}

template <bool SIGNED, int S>
void tile_run(const GgufActs& a, long K, const TileBuf& t, void* y, bool bf16, long N, long n, long rows) {
  if (rows > 16) tile_all<2, SIGNED, S>(a, K, t, y, bf16, N, n, rows);
  else tile_all<1, SIGNED, S>(a, K, t, y, bf16, N, n, rows);
}

}  // namespace

void gguf_rows_vnni(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N, long n0,
                    long n1) {
  GgufFormat f;
  if (!gguf_format(kind, &f)) return;
  const long Kp = a.Kp;
  const long row_bytes = K / f.block * f.bytes;
  thread_local std::vector<uint8_t> codes_v;
  thread_local std::vector<float> wl_v, mn_v;
  codes_v.resize(Kp);
  wl_v.resize(Kp / 4);
  mn_v.resize(Kp / 32);
  for (long n = n0; n < n1; ++n) {
    decode_row(kind, f, w + (n - row0) * row_bytes, K, Kp, codes_v.data(), wl_v.data(), mn_v.data());
    if (f.signed_codes) dot_all<true>(a, codes_v.data(), wl_v.data(), mn_v.data(), y, out_bf16, N, n);
    else dot_all<false>(a, codes_v.data(), wl_v.data(), mn_v.data(), y, out_bf16, N, n);
  }
}

void gguf_tiles_vnni(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                     long n0, long n1) {
  GgufFormat f;
  if (!gguf_format(kind, &f)) return;
  const long row_bytes = K / f.block * f.bytes;
  thread_local TileBuf t;
  t.size(a.Kp);
  for (long n = n0; n < n1; n += kGgufTile) {
    const long rows = std::min<long>(kGgufTile, n1 - n);
    for (int b = 0; 16 * b < rows; ++b) {
      decode_block(kind, f, w + (n + 16 * b - row0) * row_bytes, K, a.Kp, std::min<long>(16, rows - 16 * b), t, b);
    }
    if (!f.signed_codes) tile_run<false, 32>(a, K, t, y, out_bf16, N, n, rows);
    else if (gguf_unit(kind) == 16) tile_run<true, 16>(a, K, t, y, out_bf16, N, n, rows);
    else tile_run<true, 32>(a, K, t, y, out_bf16, N, n, rows);
  }
}

}  // namespace kvl
