// Portable quantized linear kernels: the same sums in the same order as qlinear_vnni.cpp.
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "qlinear.h"

namespace kvl {
namespace {

inline float h2f(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline void store(void* y, bool bf16, long i, float v) {
  if (bf16) static_cast<uint16_t*>(y)[i] = f_to_bf16(v);
  else static_cast<float*>(y)[i] = v;
}

void q4(const QuantActs& a, const uint8_t* w, const uint16_t* scales, void* y, bool out_bf16, long N, long b0,
        long b1) {
  const long G = a.K / 32;
  for (long b = b0; b < b1; ++b) {
    for (int m = 0; m < a.M; ++m) {
      const int8_t* x = a.xq + m * a.K;
      for (int l = 0; l < 16; ++l) {
        float acc = 0.f;
        for (long g = 0; g < G; ++g) {
          const uint8_t* wg = w + (b * G + g) * 256;
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = wg[c * 64 + 4 * l + j];
              dot += (byte & 15) * x[g * 32 + c * 8 + j] + (byte >> 4) * x[g * 32 + c * 8 + 4 + j];
            }
          }
          const uint16_t* s = scales + (b * G + g) * 32;
          acc = std::fma(static_cast<float>(dot), h2f(s[l]) * a.sx[m * G + g], acc);
          acc = std::fma(h2f(s[16 + l]), a.xsum[m * G + g], acc);
        }
        store(y, out_bf16, m * N + b * 16 + l, acc);
      }
    }
  }
}

void q8(const QuantActs& a, const int8_t* w, const uint16_t* scales, const int32_t* wsum128, void* y,
        bool out_bf16, long N, long b0, long b1) {
  const long G = a.K / 32;
  for (long b = b0; b < b1; ++b) {
    for (int m = 0; m < a.M; ++m) {
      const uint8_t* x = a.xu + m * a.K;
      for (int l = 0; l < 16; ++l) {
        float acc = 0.f;
        for (long g = 0; g < G; ++g) {
          const int8_t* wg = w + (b * G + g) * 512;
          int32_t dot = 0;
          for (int c = 0; c < 8; ++c) {
            for (int j = 0; j < 4; ++j) dot += x[g * 32 + c * 4 + j] * wg[c * 64 + 4 * l + j];
          }
          const long i = (b * G + g) * 16 + l;
          acc = std::fma(static_cast<float>(dot - wsum128[i]), h2f(scales[i]) * a.sx[m * G + g], acc);
        }
        store(y, out_bf16, m * N + b * 16 + l, acc);
      }
    }
  }
}

template <typename T>
void quantize_t(const T* x, int8_t* xq, uint8_t* xu, float* sx, float* xsum, long i0, long i1) {
  for (long i = i0; i < i1; ++i) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(x[i * 32 + j])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    sx[i] = amax / 127.f;
    int32_t qsum = 0;
    for (int j = 0; j < 32; ++j) {
      const float q = std::nearbyint(to_f(x[i * 32 + j]) * inv);
      xq[i * 32 + j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, q)));
      qsum += xq[i * 32 + j];
      if (xu) xu[i * 32 + j] = static_cast<uint8_t>(xq[i * 32 + j] + 128);
    }
    xsum[i] = sx[i] * static_cast<float>(qsum);
  }
}

void quantize(const void* x, bool x_bf16, int8_t* xq, uint8_t* xu, float* sx, float* xsum, long i0, long i1) {
  if (x_bf16) quantize_t(static_cast<const bf16*>(x), xq, xu, sx, xsum, i0, i1);
  else quantize_t(static_cast<const float*>(x), xq, xu, sx, xsum, i0, i1);
}

}  // namespace

QuantKernels quant_scalar() { return QuantKernels{&quantize, &q4, &q8}; }

}  // namespace kvl
