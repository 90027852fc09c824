// Raw-pointer CPU kernels of kvledger, in two builds of the same interface: a portable one
// (scalar.cpp, any x86-64 or ARM compiler) and an AVX-512 one (avx512.cpp, compiled for that ISA
// whatever the build flags). ops.cpp picks one at run time from the CPU's flags and does the torch
// side (checks, threads, registration). T is float or bf16 (stored as uint16_t).
#pragma once
#include <cstdint>

namespace kvl {

using bf16 = uint16_t;

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
  // Rows of x [.., K] to uint8 codes nearbyint(x * 127 / max|row|) + 128 and scale[r] = max|row| / 127.
  void (*quantize_rows)(const T* x, int K, uint8_t* q, float* scale, long r0, long r1);
  // out[r, i] = T(y[r, i] * scale[r]) (+ bias[i] after rounding, as torch adds a bias), y float [.., N].
  void (*scale_rows)(const float* y, const float* scale, const T* bias, T* out, int N, long r0, long r1);
};

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

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return bf16_to_f(x); }
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline bf16 from_f<bf16>(float x) { return f_to_bf16(x); }
// x rounded to T and back: where the reference rounds an intermediate result.
template <typename T> inline float round_t(float x) { return to_f(from_f<T>(x)); }

}  // namespace kvl
