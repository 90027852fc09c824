// Portable kernels: plain loops (the compiler vectorizes what it can for the build's baseline ISA).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace kvl {
namespace {

template <typename T>
void rms_norm(const T* x, long xs, T* res, long rs, const T* w, T* out, long os, int dim, float eps,
              long r0, long r1) {
  std::vector<float> row(dim);
  for (long r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    float ss = 0.f;
    for (int i = 0; i < dim; ++i) {
      float v = to_f(xr[i]);
      if (res) {
        T* rr = res + r * rs;
        v = round_t<T>(to_f(rr[i]) + v);
        rr[i] = from_f<T>(v);
      }
      row[i] = v;
      ss += v * v;
    }
    float inv = 1.f / std::sqrt(ss / dim + eps);
    T* o = out + r * os;
    for (int i = 0; i < dim; ++i) o[i] = from_f<T>(to_f(w[i]) * round_t<T>(row[i] * inv));
  }
}

template <typename T>
void silu_mul(const T* gu, long gs, T* out, long os, int dim, long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    const T* g = gu + r * gs;
    const T* u = g + dim;
    T* o = out + r * os;
    for (int i = 0; i < dim; ++i) {
      float a = to_f(g[i]);
      o[i] = from_f<T>(round_t<T>(a / (1.f + std::exp(-a))) * to_f(u[i]));
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
      for (int i = 0; i < half; ++i) {
        float x1 = to_f(p[i]), x2 = to_f(p[i + half]), ci = to_f(c[i]), si = to_f(s[i]);
        p[i] = from_f<T>(round_t<T>(x1 * ci) - round_t<T>(x2 * si));
        p[i + half] = from_f<T>(round_t<T>(x2 * ci) + round_t<T>(x1 * si));
      }
    }
  }
}

template <typename T, typename C>
void attend(const T* q, long qs, const C* k, const C* v, const int64_t* locs, long n, int G, int D,
            float scale, float* m, float* l, float* acc) {
  std::vector<float> qf(static_cast<size_t>(G) * D);
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < D; ++d) qf[g * D + d] = to_f(q[g * qs + d]) * scale;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  for (long t = 0; t < n; ++t) {
    const C* kt = k + locs[t] * D;
    const C* vt = v + locs[t] * D;
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += qf[g * D + d] * to_f(kt[d]);
      float mn = s > m[g] ? s : m[g];
      float corr = std::exp(m[g] - mn), p = std::exp(s - mn);
      l[g] = l[g] * corr + p;
      for (int d = 0; d < D; ++d) acc[g * D + d] = acc[g * D + d] * corr + p * to_f(vt[d]);
      m[g] = mn;
    }
  }
}


template <typename T>
void to_f8s(const T* x, f8* out, long n) {
  for (long i = 0; i < n; ++i) out[i].bits = f_to_f8(to_f(x[i]));
}

template <typename T>
void from_f8s(const f8* x, T* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = from_f<T>(to_f(x[i]));
}

template <typename T>
void quantize_rows(const T* x, int K, uint8_t* q, float* scale, long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    const T* row = x + r * K;
    float amax = 0.f;
    for (int i = 0; i < K; ++i) amax = std::max(amax, std::fabs(to_f(row[i])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    scale[r] = amax / 127.f;
    for (int i = 0; i < K; ++i) {
      const float v = std::max(-127.f, std::min(127.f, std::nearbyint(to_f(row[i]) * inv)));
      q[r * K + i] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
  }
}

template <typename T>
void scale_rows(const float* y, const float* scale, const T* bias, T* out, int N, long r0, long r1) {
  for (long r = r0; r < r1; ++r) {
    for (int i = 0; i < N; ++i) {
      const float v = y[r * N + i] * scale[r];
      out[r * N + i] = from_f<T>(bias ? round_t<T>(v) + to_f(bias[i]) : v);
    }
  }
}
template <typename T>
Kernels<T> make() {
  return Kernels<T>{&rms_norm<T>, &silu_mul<T>, &rope<T>, &attend<T, T>, &attend<T, f8>, &to_f8s<T>, &from_f8s<T>,
                    &quantize_rows<T>, &scale_rows<T>, nullptr};  // no tiled extend: the per-token path
}

}  // namespace

Kernels<float> scalar_f32() { return make<float>(); }
Kernels<bf16> scalar_bf16() { return make<bf16>(); }

}  // namespace kvl
