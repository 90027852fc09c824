"""How close kvledger's two heaviest CPU kernels run to what the cores can issue: one thread each.

    python bench/kernel_peak.py [--rows 512] [--seq 1024]

Builds a small C++ program (g++, the kernels' own sources, no torch) and prints:
  - the instruction peaks: independent ``vpdpbusd`` (int8 dot products), ``vdpbf16ps`` (bf16) and
    ``vfmadd`` on 512-bit registers, per second on one core;
  - the int4 GEMM (``qlinear_vnni.cpp``'s q4, Q4_1 groups of 32) at ``--rows`` activation rows for
    SmolLM2's projection shapes, as vpdpbusd per second and as a share of that peak;
  - causal prefill attention (``flash_bf16.cpp``'s flash_rows; 3 query heads on one KV head, head
    dim 64) over ``--seq`` tokens, in GFLOP/s and as a share of the vdpbf16ps peak.
Needs an x86-64 CPU with AVX512-VNNI and AVX512-BF16 (where the kernels take these paths). Prefill and
batched decode spend ~90% of their time in these two kernels (bench/RESULTS.md has the profile);
what the shares mean and what was tried against them is there too. A script, not a test: the
figures move with the machine's load.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "src" / "kvledger" / "kernels" / "csrc"

PEAK = r"""
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx512bf16,fma")
#include <immintrin.h>
#include <chrono>
#include <cstdio>
// 12 independent accumulators: enough chains to hide each instruction's latency.
template <typename F> double rate(F step) {
  const long n = 50000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) step();
  return n * 12 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main() {
  __m512i a[12]; __m512 f[12];
  for (int i = 0; i < 12; ++i) { a[i] = _mm512_set1_epi32(i); f[i] = _mm512_set1_ps(i); }
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  __m512 u = _mm512_set1_ps(1.0001f), v = _mm512_set1_ps(0.999f);
  double r1 = rate([&] {
    for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbusd_epi32(a[j], w, x);
    asm volatile("" : "+v"(w), "+v"(x));
  });
  double r2 = rate([&] {
    for (int j = 0; j < 12; ++j) f[j] = _mm512_dpbf16_ps(f[j], (__m512bh)u, (__m512bh)v);
    asm volatile("" : "+v"(u), "+v"(v));
  });
  double r3 = rate([&] {
    for (int j = 0; j < 12; ++j) f[j] = _mm512_fmadd_ps(f[j], u, v);
    asm volatile("" : "+v"(u), "+v"(v));
  });
  long s = 0; float t = 0;
  for (int i = 0; i < 12; ++i) { s += _mm512_reduce_add_epi32(a[i]); t += _mm512_reduce_add_ps(f[i]); }
  std::printf("%.4g %.4g %.4g %ld %g\n", r1, r2, r3, s & 1, t > 0 ? 0.0 : 1.0);
}
"""

GEMM = r"""
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "qlinear.h"
using namespace kvl;
int main(int argc, char** argv) {
  const long M = std::atol(argv[1]), K = std::atol(argv[2]), N = std::atol(argv[3]), G = K / 32, NB = N / 16;
  std::mt19937 rng(0);
  std::vector<int8_t> xq(M * K);
  for (auto& c : xq) c = static_cast<int8_t>(rng() % 255 - 127);
  std::vector<float> sx(M * G, 0.01f), xsum(M * G, 0.5f), y(M * N);
  std::vector<uint8_t> w(NB * G * 256);
  for (auto& c : w) c = static_cast<uint8_t>(rng());
  std::vector<uint16_t> scales(NB * G * 32, 0x3c00);  // fp16 1.0
  const QuantKernels qk = quant_vnni();
  const QuantActs a{xq.data(), nullptr, sx.data(), xsum.data(), static_cast<int>(M), K};
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    qk.q4(a, w.data(), scales.data(), y.data(), false, N, 0, NB);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("%.6g\n", best);
}
"""

FLASH = r"""
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include "flash.h"
using namespace kvl;
int main(int argc, char** argv) {
  const long S = std::atol(argv[1]);
  const int D = 64, G = 3;
  std::mt19937 rng(0);
  auto rnd = [&] {
    float f = (rng() % 2000) / 1000.0f - 1.0f;
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return static_cast<bf16>(b >> 16);
  };
  std::vector<bf16> k(S * D), v(S * D), q(S * G * D), out(S * G * D);
  for (auto& e : k) e = rnd();
  for (auto& e : v) e = rnd();
  for (auto& e : q) e = rnd();
  std::vector<int64_t> locs(S);
  for (long i = 0; i < S; ++i) locs[i] = i;
  std::vector<bf16> kt(flash_padded(S) * D), vt(flash_padded(S) * D);
  std::vector<float> scratch(flash_scratch_floats(D));
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    flash_pack(k.data(), v.data(), locs.data(), S, D, kt.data(), vt.data());
    for (long r0 = 0; r0 < S * G; r0 += kFlashRows) {  // token-major rows, the group's heads adjacent
      FlashRows fr{};
      fr.n = static_cast<int>(std::min<long>(kFlashRows, S * G - r0));
      for (int j = 0; j < fr.n; ++j) {
        const long row = r0 + j;
        fr.q[j] = q.data() + row * D;
        fr.out[j] = out.data() + row * D;
        fr.limit[j] = row / G;
      }
      flash_rows(fr, kt.data(), vt.data(), D, 0.125f, scratch.data());
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("%.6g\n", best);
}
"""

# SmolLM2-135M's projections: qkv, o, gate_up, down ([N, K]).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def build(tmp: Path, name: str, src: str, extra: list[str]) -> Path:
    (tmp / f"{name}.cpp").write_text(src)
    exe = tmp / name
    cmd = ["g++", "-O3", "-std=c++17", f"-I{CSRC}", "-o", str(exe), str(tmp / f"{name}.cpp"), *extra]
    subprocess.run(cmd, check=True)
    return exe


def run(exe: Path, *args) -> list[float]:
    out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True).stdout
    return [float(t) for t in out.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512, help="activation rows of the GEMM (a prefill chunk)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens of the causal attention")
    args = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not all(f in flags for f in ("avx512_vnni", "avx512_bf16")):
        print("this CPU lacks AVX512-VNNI or AVX512-BF16: the kernels take other paths here", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        peak = build(tmp, "peak", PEAK, [])
        gemm = build(tmp, "gemm", GEMM, [str(CSRC / "qlinear_vnni.cpp")])
        flash = build(tmp, "flash", FLASH, [str(CSRC / "flash_bf16.cpp")])
        vnni, bf16dot, fma = run(peak)[:3]
        print(
            f"one core: vpdpbusd {vnni / 1e9:.2f} G/s, vdpbf16ps {bf16dot / 1e9:.2f} G/s, vfmadd {fma / 1e9:.2f} G/s"
        )
        for n, k in SHAPES:
            t = run(gemm, args.rows, k, n)[0]
            r = args.rows * n * k / 64 / t  # vpdpbusd: 64 int8 products each
            print(
                f"int4 GEMM {args.rows}x{k} -> {n}: {t * 1e6:.0f} us, {2 * args.rows * n * k / t / 1e9:.0f} GOPS, "
                f"{r / 1e9:.2f} G vpdpbusd/s = {r / vnni:.0%} of the peak"
            )
        t = run(flash, args.seq)[0]
        flops = 4.0 * 64 * 3 * args.seq * (args.seq + 1) / 2  # QK^T and PV over the causal pairs
        print(
            f"flash attention, {args.seq} tokens, 3 heads on 1 KV head: {t * 1e3:.2f} ms, "
            f"{flops / t / 1e9:.0f} GFLOP/s = {flops / t / (bf16dot * 64):.0%} of the vdpbf16ps peak"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
