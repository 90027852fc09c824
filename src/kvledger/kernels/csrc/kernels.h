// Raw-pointer CPU kernels of kvledger, in two builds of the same interface: a portable one
// (scalar.cpp, any x86-64 or ARM compiler) and an AVX-512 one (avx512.cpp, compiled for that ISA
// whatever the build flags). ops.cpp picks one at run time from the CPU's flags and does the torch
// side (checks, threads, registration). T is float or bf16 (stored as uint16_t).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

namespace kvl {

using bf16 = uint16_t;

// A float8 e4m3fn value of the KV cache (torch.float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa
// bits, no infinities, 0x7f/0xff NaN, largest 448). A struct so that overloads tell it from an int8.
struct f8 {
  uint8_t bits;
};

// Every kernel works on a range of rows [r0, r1) so that ops.cpp can split the rows over threads.
// Rounding follows torch's eager ops in the same dtype: each op of the reference rounds its result to
// T, so the kernels round at the same places (a no-op in float32).
template <typename T>
struct Kernels {
  // out = w * T(x * rsqrt(mean(x^2) + eps)); with `res`: res = T(res + x) first, normalized instead of x.
  void (*rms_norm)(const T* x, long xs, T* res, long rs, const T* w, T* out, long os, int dim, float eps,
                   long r0, long r1);
  // out = T(T(silu(g)) * u) where row = [g (dim) | u (dim)].
  void (*silu_mul)(const T* gu, long gs, T* out, long os, int dim, long r0, long r1);
  // In place, per row and head: x = cat(x1*cos - x2*sin, x2*cos + x1*sin) (NeoX halves), cos/sin rows
  // of `half` values at each row's position.
  void (*rope)(T* x, long xs, int heads, int head_dim, const int64_t* pos, const T* cos, const T* sin,
               long r0, long r1);
  // Attention of G query rows (one KV head's group) over the tokens at locations locs[0..n): writes the
  // running max m[G], sum l[G] and unnormalized output acc[G*D] (flash-decoding partials).
  void (*attend)(const T* q, long qs, const T* k, const T* v, const int64_t* locs, long n, int G, int D,
                 float scale, float* m, float* l, float* acc);
  // attend over a float8 e4m3 cache: the same sums of the values widened to float.
  void (*attend_f8)(const T* q, long qs, const f8* k, const f8* v, const int64_t* locs, long n, int G, int D,
                    float scale, float* m, float* l, float* acc);
  // out[i] = x[i] rounded to float8 e4m3 (nearest even, saturating at +-448), as torch's cast of x clamped.
  void (*to_f8)(const T* x, f8* out, long n);
  // out[i] = x[i] widened to T (exact: every e4m3 value is a bfloat16).
  void (*from_f8)(const f8* x, T* out, long n);
  // Rows of x [.., K] to uint8 codes nearbyint(x * 127 / max|row|) + 128 and scale[r] = max|row| / 127.
  void (*quantize_rows)(const T* x, int K, uint8_t* q, float* scale, long r0, long r1);
  // out[r, i] = T(y[r, i] * scale[r]) (+ bias[i] after rounding, as torch adds a bias), y float [.., N].
  void (*scale_rows)(const float* y, const float* scale, const T* bias, T* out, int N, long r0, long r1);
  // A tile of ntok query tokens of one extend and KV head: token i's G query heads at q[i] (D apart) over
  // keys st[i] .. st[i] + n[i] of the extend's row, each written to out[i] (G * D): the same bits as
  // `attend`'s chunks folded in order (flash.h) per token, each key's K row shared by the tile's rows.
  // kf, vf: the keys' K and V rows widened to float, key x at (x - base) * D (ops.cpp packs them once
  // per extend and KV head, where the bf16 flash kernel does not run). nullptr: not in this build.
  void (*extend_tile)(const T* const* q, const long* st, const long* n, int ntok, const float* kf, const float* vf,
                      long base, int G, int D, float scale, T* const* out);
};

// y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), x, w, bias, y all float32 or all bf16, for outputs
// [n0, n1): each output's sum in one order whatever M (dense.cpp; both builds give the same bits).
void dense_scalar(const void* x, const void* w, const void* bias, void* y, bool bf16, long M, long K, long N, long n0,
                  long n1);
void dense_avx512(const void* x, const void* w, const void* bias, void* y, bool bf16, long M, long K, long N, long n0,
                  long n1);

Kernels<float> scalar_f32();
Kernels<bf16> scalar_bf16();
Kernels<float> avx512_f32();
Kernels<bf16> avx512_bf16();

inline float bf16_to_f(bf16 h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline bf16 f_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// float8 e4m3 bits to float, exactly (NaN for 0x7f/0xff).
inline float f8_to_f(uint8_t b) {
  const uint32_t em = b & 0x7fu;
  float f;
  if (em == 0x7fu) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else if (em < 8u) {
    f = static_cast<float>(em) * 0.001953125f;  // subnormal: em * 2^-9
  } else {
    const uint32_t u = (((em >> 3) + 120u) << 23) | ((em & 7u) << 20);
    __builtin_memcpy(&f, &u, 4);
  }
  return (b & 0x80u) ? -f : f;
}

// float to float8 e4m3: round to nearest even, saturating at +-448 (infinities too), NaN kept NaN: torch's
// cast of the value clamped to +-448 (which the Python side does before its cast).
inline uint8_t f_to_f8(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  const uint8_t s = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return s | 0x7fu;
  if (u >= 0x43e00000u) return s | 0x7eu;  // 448 and above
  if (u < 0x3c800000u) {                   // below 2^-6: subnormal steps of 2^-9
    float a;
    __builtin_memcpy(&a, &u, 4);
    return s | static_cast<uint8_t>(std::nearbyint(a * 512.f));  // 8 rounds up to the smallest normal
  }
  u += 0x7ffffu + ((u >> 20) & 1u);  // nearest even at 3 mantissa bits
  return s | static_cast<uint8_t>((u >> 20) - (120u << 3));
}

inline float to_f(float x) { return x; }
inline float to_f(f8 x) { return f8_to_f(x.bits); }
inline float to_f(bf16 x) { return bf16_to_f(x); }
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline bf16 from_f<bf16>(float x) { return f_to_bf16(x); }
// x rounded to T and back: where the reference rounds an intermediate result.
template <typename T> inline float round_t(float x) { return to_f(from_f<T>(x)); }

}  // namespace kvl
