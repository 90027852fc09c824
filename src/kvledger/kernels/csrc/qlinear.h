// Weight-only quantized linear layers for small batches (decode): int4 and int8 weights in groups of
// 32 along the input dimension (GGUF's Q4_1 and Q8_0 blocks), activations quantized to int8 per
// group of 32 at each call, integer dot products (VNNI where the CPU has it), one float scale per group.
//
// Packed layout (kernels/quant.py writes it): output rows in blocks of 16, one int32 lane per row.
//   int4: per (row block, group) 4 chunks of 64 bytes; chunk c covers inputs k0 = 32g + 8c .. +8:
//         byte 4l+j holds W[16b+l][k0+j] in its low nibble and W[16b+l][k0+4+j] in its high one (codes
//         0..15); scales: per (row block, group) 16 fp16 d then 16 fp16 m, w = d*q + m.
//   int8: per (row block, group) 8 chunks of 64 bytes; chunk c: byte 4l+j = W[16b+l][32g+4c+j] (int8);
//         scales: 16 fp16 d per (row block, group), w = d*q; wsum128: 16 int32 = 128 * sum of the codes
//         (activations enter as unsigned bytes x+128; this takes the offset back out exactly).
// Both ISA builds sum in the same order with the same fused multiply-adds: their results are equal bit
// for bit.
#pragma once
#include <cstdint>

namespace kvl {

struct QuantActs {  // one call's activations, M rows of K, quantized per group of 32 by ops.cpp
  const int8_t* xq;    // [M, K] int8 (int4 weights)
  const uint8_t* xu;   // [M, K] xq + 128 (int8 weights)
  const float* sx;     // [M, K/32] scale: x ~= sx * xq
  const float* xsum;   // [M, K/32] sx * sum of xq over the group (Q4_1's min term; see quantize)
  int M;
  long K;
};

struct QuantKernels {
  // Groups [i0, i1) of 32 activations (group i = row i / (K/32), inputs 32 * (i % (K/32)) ..; rows
  // contiguous, so group i starts at x + 32 i), x float or bf16 (x_bf16): sx = max|x| / 127, xq =
  // nearbyint(x * 127 / max|x|) (round to nearest even), xu = xq + 128 when not null, xsum = sx * the
  // integer sum of xq: the min term m * sum(x) then sees the same quantized x as the d term, so the
  // activations' rounding errors are weighted by w = d*q + m (centred) rather than by d*q (GGUF's Q8_1
  // does the same; with the exact float sum SmolLM2's layers came out ~2.5x further from the float
  // product). Both builds compute the same bits.
  void (*quantize)(const void* x, bool x_bf16, int8_t* xq, uint8_t* xu, float* sx, float* xsum, long i0,
                   long i1);
  // y[m, 16b .. 16b+16) for row blocks b in [b0, b1); y is [M, N] float or bf16 (out_bf16).
  void (*q4)(const QuantActs& a, const uint8_t* w, const uint16_t* scales, void* y, bool out_bf16, long N,
             long b0, long b1);
  void (*q8)(const QuantActs& a, const int8_t* w, const uint16_t* scales, const int32_t* wsum128, void* y,
             bool out_bf16, long N, long b0, long b1);
};

QuantKernels quant_scalar();
QuantKernels quant_vnni();

// --enable-int8-batch's linear on AVX512-VNNI: y [M, N] = ws[n] * sum_s sx[m, s] * (sum_{k in s} xu[m, k] *
// W[n, k] + woff[s, n]) (+ bias[n]), W int8 per output channel in the int8 layout above without groups
// (per row block of 16: K/4 chunks of 64 bytes, byte 4l+j = W[16b+l][4c+j]), the activations int8 per
// row and per segment s of kS8Seg inputs (the last one shorter where K is not a multiple: scale sx[m, s],
// codes + 128 in xu), woff[s, n] = -128 * the sum of W[n, k] over segment s (takes the +128 back out
// exactly). Each segment's integer sum is exact; the segments' sums are scaled and added in float, in
// order. One scale a segment rather than a row: activations with a few large channels keep their
// other channels' precision (SmolLM2's projections: ~2x closer to the float product than per row).
constexpr long kS8Seg = 64;
struct S8Gemm {
  const uint8_t* xu;  // [M, K]
  const float* sx;    // [M, segs]
  long M, K, N, segs;
  const int8_t* w;       // [N/16][K/4][16][4]
  const float* ws;       // [N]
  const int32_t* woff;   // [segs, N]
  const void* bias;      // [N] of y's dtype, or null
  void* y;               // [M, N] float or bf16
  bool bf16;
};
constexpr long kS8Rows = 4;    // activation rows a tile
constexpr long kS8Blocks = 3;  // blocks of 16 outputs a tile: 12 int32 and 12 float accumulators
// Rows [r0, r1) of x [M, K] (float or bf16) quantized per segment: xu [M, K] codes + 128, sx [M, segs].
void s8_quantize(const void* x, bool x_bf16, long K, uint8_t* xu, float* sx, long r0, long r1);
// Rows [r0, r1) x row blocks of 16 outputs [b0, b1), AVX512-VNNI (callers check the CPU has it).
void s8_gemm_vnni(const S8Gemm& g, long r0, long r1, long b0, long b1);

// AMX tiles (qlinear_amx.cpp): true once this process may use them on a CPU with AMX-BF16.
bool amx_ready();
// y [M, N] bf16 = x [Mpad, K] bf16 (rows M.. zero) times the packed weights (int4 or int8, qlinear.h's
// layout, wsum128 unused), for the pairs of 16-row weight blocks [p0, p1).
void q_amx(const uint16_t* x, long M, long Mpad, long K, int bits, const void* w, const uint16_t* scales, uint16_t* y,
           long N, long p0, long p1);

}  // namespace kvl
