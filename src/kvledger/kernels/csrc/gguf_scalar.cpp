// Portable GGUF-block linear: the sums of gguf_blocks.h in the order gguf_vnni.cpp computes them
// (16 float lanes, one fused multiply-add a lane and 64 elements, the same tree at the end).
#include <cmath>
#include <vector>

#include "gguf_blocks.h"
#include "kernels.h"

namespace kvl {
namespace {

inline float hsum16(const float* a) {  // the VNNI build's reduction order
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  const float t20 = t4[0] + t4[2], t21 = t4[1] + t4[3];
  return t20 + t21;
}

}  // namespace

void gguf_rows_scalar(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                      long n0, long n1) {
  GgufFormat f;
  if (!gguf_format(kind, &f)) return;
  const long Kp = a.Kp, L = Kp / 4, G = Kp / 32;
  const long row_bytes = K / f.block * f.bytes;
  thread_local std::vector<uint8_t> codes_v;
  thread_local std::vector<float> wl_v, mn_v;
  codes_v.resize(Kp);
  wl_v.resize(L);
  mn_v.resize(G);
  uint8_t* codes = codes_v.data();
  float* wl = wl_v.data();
  float* mn = mn_v.data();
  for (long n = n0; n < n1; ++n) {
    gguf_ref::decode_row(kind, f, w + (n - row0) * row_bytes, K, Kp, codes, wl, mn);
    for (int m = 0; m < a.M; ++m) {
      const int8_t* xq = a.xq + m * Kp;
      const float* sxl = a.sxl + m * L;
      float acc[16] = {};
      for (long c = 0; c < Kp / 64; ++c) {
        for (int l = 0; l < 16; ++l) {
          const long e = 64 * c + 4 * l;
          int32_t dot = 0;
          for (int j = 0; j < 4; ++j) {
            const int wq = f.signed_codes ? static_cast<int8_t>(codes[e + j]) : codes[e + j];
            dot += wq * xq[e + j];
          }
          const long i = 16 * c + l;
          acc[l] = std::fma(static_cast<float>(dot), wl[i] * sxl[i], acc[l]);
        }
      }
      if (!f.signed_codes) {
        const float* xs = a.xsum + m * G;
        for (long g = 0; g < G; ++g) acc[g % 16] = std::fma(mn[g], xs[g], acc[g % 16]);
      }
      const float v = hsum16(acc);
      if (out_bf16) static_cast<uint16_t*>(y)[m * N + n] = f_to_bf16(v);
      else static_cast<float*>(y)[m * N + n] = v;
    }
  }
}

// The tiles' sums (gguf_blocks.h) one output at a time: per scale unit the exact integer dot, one fused
// multiply-add, and the group's min after it (unsigned kinds).
void gguf_tiles_scalar(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16,
                       long N, long n0, long n1) {
  GgufFormat f;
  if (!gguf_format(kind, &f)) return;
  const long Kp = a.Kp, Gp = Kp / 32, S = gguf_unit(kind);
  const long row_bytes = K / f.block * f.bytes;
  thread_local std::vector<uint8_t> codes_v;
  thread_local std::vector<float> wl_v, mn_v;
  codes_v.resize(Kp);
  wl_v.resize(Kp / 4);
  mn_v.resize(Gp);
  const uint8_t* codes = codes_v.data();
  for (long n = n0; n < n1; ++n) {
    gguf_ref::decode_row(kind, f, w + (n - row0) * row_bytes, K, Kp, codes_v.data(), wl_v.data(), mn_v.data());
    for (int m = 0; m < a.M; ++m) {
      const int8_t* xq = a.xq + m * Kp;
      float acc = 0.f;
      for (long u = 0; u < K / S; ++u) {
        int32_t dot = 0;
        for (long e = u * S; e < (u + 1) * S; ++e) {
          dot += (f.signed_codes ? static_cast<int8_t>(codes[e]) : codes[e]) * xq[e];
        }
        const long g = u * S / 32;
        acc = std::fma(static_cast<float>(dot), wl_v[u * S / 4] * a.sx[m * Gp + g], acc);
        if (!f.signed_codes) acc = std::fma(mn_v[g], a.xsum[m * Gp + g], acc);
      }
      if (out_bf16) static_cast<uint16_t*>(y)[m * N + n] = f_to_bf16(acc);
      else static_cast<float*>(y)[m * N + n] = acc;
    }
  }
}

}  // namespace kvl
