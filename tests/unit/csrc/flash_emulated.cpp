// The bf16 flash kernels (src/kvledger/kernels/csrc/flash_bf16.cpp) on a CPU without AVX512-BF16: the
// three bf16 intrinsics they use are replaced by lane-wise software versions (VDPBF16PS's two FMAs a
// lane, odd pair first; round-to-nearest-even conversions), the rest runs as it is. Checks the order of
// sums every attention kernel keeps (flash.h): the decode form (flash_chunk over the pool's rows in
// place, chunks folded with fold_chunk) gives the bits of flash_rows over the packed keys, for bf16 and
// float8 pools, head dims 64 and 128, 1..7 query rows and contexts that end inside and on a chunk.
// The lane arithmetic is the same on both sides, so a wrong shuffle, mask or layout shows as a
// difference whatever the emulation's rounding details. Exit status: the number of differing cases.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace emu {
inline float bf2f(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f2bf(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline __m512 dpbf16(__m512 acc, __m512bh a, __m512bh b) {
  alignas(64) float c[16];
  alignas(64) uint16_t x[32], y[32];
  _mm512_store_ps(c, acc);
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  for (int j = 0; j < 16; ++j) {
    c[j] = std::fma(bf2f(x[2 * j + 1]), bf2f(y[2 * j + 1]), c[j]);
    c[j] = std::fma(bf2f(x[2 * j]), bf2f(y[2 * j]), c[j]);
  }
  return _mm512_load_ps(c);
}
inline __m512bh cvtne2(__m512 hi, __m512 lo) {
  alignas(64) float a[16], b[16];
  alignas(64) uint16_t r[32];
  _mm512_store_ps(a, hi);
  _mm512_store_ps(b, lo);
  for (int j = 0; j < 16; ++j) r[j] = f2bf(b[j]), r[16 + j] = f2bf(a[j]);
  __m512bh out;
  std::memcpy(&out, r, 64);
  return out;
}
inline __m256bh cvtne(__m512 x) {
  alignas(64) float a[16];
  alignas(32) uint16_t r[16];
  _mm512_store_ps(a, x);
  for (int j = 0; j < 16; ++j) r[j] = f2bf(a[j]);
  __m256bh out;
  std::memcpy(&out, r, 32);
  return out;
}
}  // namespace emu

#define _mm512_dpbf16_ps emu::dpbf16
#define _mm512_cvtne2ps_pbh emu::cvtne2
#define _mm512_cvtneps_pbh emu::cvtne
#include "flash_bf16.cpp"

using namespace kvl;

template <typename C> int check(int D, int G, long n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  const long L = 600;
  std::vector<C> k(L * D), v(L * D);
  std::vector<bf16> q(static_cast<size_t>(G) * D);
  auto value = [&]() {
    C c;
    if constexpr (std::is_same_v<C, bf16>) {
      const uint16_t h = emu::f2bf(nd(rng));
      std::memcpy(&c, &h, 2);
    } else {
      c.bits = static_cast<uint8_t>(rng() & 0xffu);
      if ((c.bits & 0x7f) == 0x7f) c.bits = 0x10;  // e4m3fn's NaN codes
    }
    return c;
  };
  for (auto& x : k) x = value();
  for (auto& x : v) x = value();
  for (auto& x : q) {
    const uint16_t h = emu::f2bf(nd(rng));
    std::memcpy(&x, &h, 2);
  }
  std::vector<int64_t> locs(L);  // the context's rows scattered over the pool, as decoded tokens are
  for (long i = 0; i < L; ++i) locs[i] = i;
  std::shuffle(locs.begin(), locs.end(), rng);
  const float scale = 0.125f;
  const long Sp = flash_padded(n);
  std::vector<bf16> kt(Sp * D), vt(Sp * D), ref(q.size()), got(q.size());
  flash_pack(k.data(), v.data(), locs.data(), n, D, kt.data(), vt.data());
  std::vector<float> scratch(flash_scratch_floats(D));
  for (int g0 = 0; g0 < G; g0 += kFlashRows) {
    FlashRows r{};
    r.n = std::min(kFlashRows, G - g0);
    for (int i = 0; i < r.n; ++i) {
      r.q[i] = q.data() + (g0 + i) * D, r.out[i] = ref.data() + (g0 + i) * D, r.limit[i] = n - 1;
    }
    flash_rows(r, kt.data(), vt.data(), D, scale, scratch.data());
  }
  std::vector<float> M(G), Ls(G), O(q.size()), m(G), l(G), o(q.size());
  for (long c0 = 0; c0 < n; c0 += kKeyChunk) {
    for (int g0 = 0; g0 < G; g0 += kFlashRows) {
      const int nr = std::min(kFlashRows, G - g0);
      const bf16* qq[kFlashRows];
      for (int i = 0; i < nr; ++i) qq[i] = q.data() + (g0 + i) * D;
      flash_chunk(qq, nr, k.data(), v.data(), locs.data(), c0, n, D, scale, m.data() + g0, l.data() + g0,
                  o.data() + g0 * D);
    }
    for (int g = 0; g < G; ++g) fold_chunk(M[g], Ls[g], O.data() + g * D, m[g], l[g], o.data() + g * D, D, c0 == 0);
  }
  for (int g = 0; g < G; ++g) fold_out(Ls[g], O.data() + g * D, D, got.data() + g * D);
  const bool differ = std::memcmp(ref.data(), got.data(), ref.size() * sizeof(bf16)) != 0;
  if (differ) std::printf("DIFFER %s D=%d rows=%d keys=%ld\n", std::is_same_v<C, bf16> ? "bf16" : "f8", D, G, n);
  return differ ? 1 : 0;
}

int main() {
  int bad = 0, cases = 0;
  for (int D : {64, 128}) {
    for (int G : {1, 3, 4, 7}) {
      for (long n : {1L, 5L, 64L, 65L, 150L, 192L, 511L}) {
        bad += check<bf16>(D, G, n, static_cast<unsigned>(D + G + n));
        bad += check<f8>(D, G, n, static_cast<unsigned>(7 * n + G));
        cases += 2;
      }
    }
  }
  std::printf("%d of %d cases differ\n", bad, cases);
  return bad;
}
