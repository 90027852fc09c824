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
  const float* xsum;   // [M, K/32] sum of x over the group (float, exact: Q4_1's min term)
  int M;
  long K;
};

struct QuantKernels {
  // y[m, 16b .. 16b+16) for row blocks b in [b0, b1); y is [M, N] float or bf16 (out_bf16).
  void (*q4)(const QuantActs& a, const uint8_t* w, const uint16_t* scales, void* y, bool out_bf16, long N,
             long b0, long b1);
  void (*q8)(const QuantActs& a, const int8_t* w, const uint16_t* scales, const int32_t* wsum128, void* y,
             bool out_bf16, long N, long b0, long b1);
};

QuantKernels quant_scalar();
QuantKernels quant_vnni();

}  // namespace kvl
