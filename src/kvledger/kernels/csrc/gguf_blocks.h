// GGUF's quantized blocks read as the file stores them (llama.cpp's ggml-common.h layouts), for
// y [M, N] = x [M, K] @ W^T with W [N, K] in one of these kinds:
//
//   kind    id  block bytes  element                      codes kept
//   Q4_0     2    32    18   d * (q - 8),  q 4 bits       q - 8   (signed)
//   Q4_1     3    32    20   d * q + m                    q       (unsigned)
//   Q5_0     6    32    22   d * (q - 16), q 5 bits       q - 16  (signed)
//   Q5_1     7    32    24   d * q + m                    q       (unsigned)
//   Q8_0     8    32    34   d * q,        q int8         q       (signed)
//   Q4_K    12   256   144   d*sc_j * q - dmin*m_j        q       (unsigned; 8 sub-blocks of 32, 6-bit sc/m)
//   Q5_K    13   256   176   d*sc_j * q - dmin*m_j        q       (unsigned; as Q4_K, fifth bit in qh)
//   Q6_K    14   256   210   d*sc_j * (q - 32)            q - 32  (signed; 16 sub-blocks of 16, int8 sc)
//   IQ4_NL  20    32    18   d * table[q]                 table[q] (signed)
//
// How a row is computed (both builds, the same sums in the same order, so equal bit for bit):
//  1. The activations are quantized per group of 32 (qlinear.h's QuantKernels::quantize: sx = max|x| /
//     127, xq = round-to-even(x / sx)), rows padded with zeros to Kp = K rounded up to 64.
//  2. Each weight row is decoded once into codes (one byte an element), one float scale per lane of 4
//     elements (wl: d, or d*sc of the element's sub-block) and, for the unsigned kinds, one float min
//     per group of 32 (mn: m, or -dmin*m_j). Every activation row of the call then reads that decode.
//  3. Per 64 elements, lane l (elements 4l..4l+3) takes the exact integer dot of its 4 codes with the 4
//     xq, and acc[l] = fma(float(dot), wl[l] * sxl[l], acc[l]) (sxl: the lane's group scale sx).
//  4. Unsigned kinds add the mins: per 16 groups g, acc[g % 16] = fma(mn[g], xsum[g], acc[g % 16]),
//     xsum = sx * the integer sum of the group's xq (the min term sees the same quantized x).
//  5. y = the 16 lanes summed as a tree: a[i] + a[i+8], then + [i+4], + [i+2], + [i+1].
// The error against dequantize-then-matmul is the activations' rounding (|x - sx*xq| <= sx/2 per
// element) weighted by |w|, plus float32 rounding of the sums; tests/unit/test_gguf_linear.py.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvl {

enum GgufKind : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20,
};

struct GgufFormat {
  int block;    // elements a block
  int bytes;    // bytes a block
  bool signed_codes;  // w = wl * code (no min term); else w = wl * code + mn, codes unsigned
};

// False for a kind these kernels do not read.
inline bool gguf_format(int kind, GgufFormat* f) {
  switch (kind) {
    case kQ4_0: *f = {32, 18, true}; return true;
    case kQ4_1: *f = {32, 20, false}; return true;
    case kQ5_0: *f = {32, 22, true}; return true;
    case kQ5_1: *f = {32, 24, false}; return true;
    case kQ8_0: *f = {32, 34, true}; return true;
    case kQ4_K: *f = {256, 144, false}; return true;
    case kQ5_K: *f = {256, 176, false}; return true;
    case kQ6_K: *f = {256, 210, true}; return true;
    case kIQ4_NL: *f = {32, 18, true}; return true;
    default: return false;
  }
}

// The load-time repack (gguf_repack.cpp): kind + kGgufPacked is that kind's blocks, the same bits in
// another order, 16 output rows interleaved per block so that the kernel advances 16 outputs (one a SIMD
// lane) per 4 inputs with the nibbles unpacked in registers. Per group of 16 rows (a part's last group
// padded with zero rows), rows j = 0..15 side by side; the K-quants per super-block of 256 inputs:
//   Q4_K (112), 2368 bytes (16 x 148: the file's 144 with the 6-bit scales and mins a byte each):
//     [0, 32) d fp16[16] | [32, 64) dmin fp16[16] | [64, 192) sc[8 sub-blocks][16] | [192, 320) m[8][16]
//     | [320, 2368) codes: per 8 inputs e.. 64 bytes, row j's bytes 4j..4j+3 = q[e+i] | q[e+4+i] << 4
//   Q6_K (114), 3360 bytes (16 x 210, the file's size):
//     [0, 32) d fp16[16] | [32, 288) sc int8[16 sub-blocks][16] | [288, 2336) the codes' low 4 bits as
//     Q4_K's | [2336, 3360) their high 2 bits: per 16 inputs e.. 64 bytes, row j's byte 4j+i =
//     h[e+i] | h[e+4+i] << 2 | h[e+8+i] << 4 | h[e+12+i] << 6   (q = low | h << 4, w = d*sc*(q - 32))
// and the 32-element kinds (K / 32 = nb blocks) as two planes a group: first every block's scales, d
// fp16[nb][16] (so that the codes' 64-byte loads stay aligned), then the codes block after block:
//   Q8_0 (108), 16 x 34 bytes a block (the file's size): codes 512 bytes a block, per 4 inputs e.. 64
//     bytes, row j's byte 4j+i = q[e+i] ^ 0x80 (q + 128: unsigned against the signed activations, each
//     block's dot started at -128 * the activations' integer sum)
//   Q5_0 (106), 16 x 22 bytes a block (the file's size): codes 320 bytes a block, [0, 256) the low 4
//     bits as Q4_K's (per 8 inputs 64 bytes), [256, 320) the fifth bits: row j's byte 4j+i bit c =
//     h[4c+i] (the 4-input step c's bit: q = low | h << 4 unsigned, w = d * (q - 16), the dot started
//     at -16 * the activations' integer sum)
// The kernel (gguf_packed_*) computes the tiles' sums (below) in the tiles' order at every batch: equal
// bit for bit to gguf_tiles_* on the file's blocks, and one order of sums a row whatever the batch.
constexpr int kGgufPacked = 100;
constexpr int kQ4_Kx16 = kQ4_K + kGgufPacked, kQ6_Kx16 = kQ6_K + kGgufPacked;
constexpr int kQ8_0x16 = kQ8_0 + kGgufPacked, kQ5_0x16 = kQ5_0 + kGgufPacked;
constexpr int kGgufGroup = 16;  // rows interleaved
inline bool gguf_is_packed(int kind) {
  return kind == kQ4_Kx16 || kind == kQ6_Kx16 || kind == kQ8_0x16 || kind == kQ5_0x16;
}
inline bool gguf_repackable(int kind) { return kind == kQ4_K || kind == kQ6_K || kind == kQ8_0 || kind == kQ5_0; }
// Inputs a packed kind's block, and a group's bytes a block (16 rows).
inline long gguf_packed_block(int kind) { return kind == kQ8_0x16 || kind == kQ5_0x16 ? 32 : 256; }
inline long gguf_group_bytes(int kind) {
  switch (kind) {
    case kQ4_Kx16: return 2368;
    case kQ6_Kx16: return 3360;
    case kQ8_0x16: return 544;
    default: return 352;  // Q5_0
  }
}
// Bytes of `rows` rows of `kind` with K inputs (a packed kind: whole groups of 16).
inline long gguf_rows_bytes(int kind, long rows, long K) {
  if (gguf_is_packed(kind)) {
    return (rows + kGgufGroup - 1) / kGgufGroup * (K / gguf_packed_block(kind)) * gguf_group_bytes(kind);
  }
  GgufFormat f;
  return gguf_format(kind, &f) ? rows * (K / f.block) * f.bytes : 0;
}
// kind -> kind + kGgufPacked of rows [0, rows) of src (src: the part's rows as stored), groups [g0, g1);
// inverse: back (the file's bytes exactly; the padding rows dropped).
// heads > 0: src's rows are in llama.cpp's q/k order for that many heads (its Llama converter interleaves
// each head's rotary halves); row r of the result is read from where that order put it, so the weight
// comes out in HF's row order without a permuted copy of the file's bytes first.
void gguf_repack_groups(int kind, const uint8_t* src, long rows, long K, uint8_t* dst, long g0, long g1,
                        long heads = 0);
void gguf_unpack_groups(int kind, const uint8_t* src, long rows, long K, uint8_t* dst, long g0, long g1);

inline long gguf_padded(long K) { return (K + 63) / 64 * 64; }

// One call's activations, rows of Kp = gguf_padded(K) (the padding zero).
struct GgufActs {
  const int8_t* xq;    // [M, Kp]
  const uint8_t* xu;   // [M, Kp] xq + 128 (signed kinds: vpdpbusd takes the activations unsigned)
  const float* sxl;    // [M, Kp/4] the scale of each lane's group
  const float* xsum;   // [M, Kp/32] sx * the integer sum of the group's xq
  const float* sx;     // [M, Kp/32] the group scales (the tiles' path reads them once a group)
  int M;
  long Kp;
  const int32_t* xs16 = nullptr;  // [M, Kp/16] the integer sums of xq a 16 (a call with a repacked signed part)
};

// Rows [n0, n1) of y [M, N] (float, or bf16 when out_bf16); w points at row row0's K/block blocks, rows
// contiguous (a part of a stack of kinds starts at its first row).
using GgufRowsFn = void (*)(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                            long n0, long n1);
void gguf_rows_scalar(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                      long n0, long n1);
void gguf_rows_vnni(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                    long n0, long n1);

// Calls of kGgufTileRows activation rows and more (unless the caller asks for one order of sums per
// row whatever the batch) take the tiles' path: weight rows in tiles of kGgufTile, each decoded from
// its blocks into the packed kernel's interleaved layout (qlinear.h: per 4 inputs, 64 bytes = 16 rows x
// 4 codes) in a per-thread buffer, then every activation row passes over the tile with one output a
// lane: per scale unit u (S = 32 inputs; Q6_K's sub-blocks of 16) the exact integer dot D of the unit
// (vpdpbusd over broadcast activations; signed kinds start at -128 * the codes' sum, as xu = xq + 128),
// then acc = fma(float(D), scale_u * sx_g, acc), and for the unsigned kinds acc = fma(mn_g, xsum_g, acc)
// after each group; y = acc (no horizontal sums). Both builds the same sums in the same order: equal
// bit for bit, as the rows' path; the two paths differ from each other in float rounding only.
constexpr int kGgufTileRows = 8;  // at 5-7 rows the two paths are within noise of each other (bench/RESULTS.md)
constexpr int kGgufTile = 32;  // weight rows a tile: two blocks of 16 outputs share each broadcast
void gguf_tiles_scalar(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16,
                       long N, long n0, long n1);
void gguf_tiles_vnni(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16, long N,
                     long n0, long n1);
inline int gguf_unit(int kind) { return kind == kQ6_K ? 16 : 32; }  // inputs a scale unit
// Rows [n0, n1) of y of a packed part (w: its first group, row0: its first row; n0 - row0 a multiple of
// 16), any M: the tiles' sums. The scalar one unpacks each group and runs gguf_tiles_scalar.
void gguf_packed_scalar(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16,
                        long N, long n0, long n1);
void gguf_packed_vnni(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16,
                      long N, long n0, long n1);

// --- the portable decode of one row (the reference for the vectorized ones) -------------------------
namespace gguf_ref {

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K/Q5_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void fill(float* p, int n, float v) {
  for (int i = 0; i < n; ++i) p[i] = v;
}

// Block `b` of a 32-element kind at element e = 32 b.
inline void block32(int kind, const uint8_t* blk, uint8_t* codes, float* wl, float* mn) {
  const float d = fp16(blk);
  fill(wl, 8, d);
  switch (kind) {
    case kQ4_0:
    case kIQ4_NL:
    case kQ4_1: {
      const uint8_t* qs = blk + (kind == kQ4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = qs[j] & 15, hi = qs[j] >> 4;
        if (kind == kQ4_0) {
          codes[j] = static_cast<uint8_t>(lo - 8);
          codes[j + 16] = static_cast<uint8_t>(hi - 8);
        } else if (kind == kIQ4_NL) {
          codes[j] = static_cast<uint8_t>(kIQ4NL[lo]);
          codes[j + 16] = static_cast<uint8_t>(kIQ4NL[hi]);
        } else {
          codes[j] = static_cast<uint8_t>(lo);
          codes[j + 16] = static_cast<uint8_t>(hi);
        }
      }
      if (kind == kQ4_1) *mn = fp16(blk + 2);
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const int off = kind == kQ5_1 ? 4 : 2;
      uint32_t qh;
      std::memcpy(&qh, blk + off, 4);
      const uint8_t* qs = blk + off + 4;
      const int bias = kind == kQ5_0 ? 16 : 0;
      for (int j = 0; j < 16; ++j) {
        codes[j] = static_cast<uint8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
        codes[j + 16] = static_cast<uint8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
      }
      if (kind == kQ5_1) *mn = fp16(blk + 2);
      return;
    }
    default:  // Q8_0
      std::memcpy(codes, blk + 2, 32);
  }
}

// Super-block of 256 at element e: codes[256], wl[64], mn[8].
inline void block256(int kind, const uint8_t* blk, uint8_t* codes, float* wl, float* mn) {
  if (kind == kQ6_K) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16(blk + 208);
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], q = qh[32 * h + l];
        uint8_t* o = codes + 128 * h + l;
        o[0] = static_cast<uint8_t>(((a & 15) | ((q & 3) << 4)) - 32);
        o[32] = static_cast<uint8_t>(((c & 15) | (((q >> 2) & 3) << 4)) - 32);
        o[64] = static_cast<uint8_t>(((a >> 4) | (((q >> 4) & 3) << 4)) - 32);
        o[96] = static_cast<uint8_t>(((c >> 4) | (((q >> 6) & 3) << 4)) - 32);
      }
    }
    for (int i = 0; i < 16; ++i) fill(wl + 4 * i, 4, d * static_cast<float>(sc[i]));
    return;
  }
  // Q4_K / Q5_K
  const float d = fp16(blk), dmin = fp16(blk + 2);
  const uint8_t* scales = blk + 4;
  const uint8_t* qh = kind == kQ5_K ? blk + 16 : nullptr;
  const uint8_t* qs = blk + (kind == kQ5_K ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(j, scales, &sc, &m);
    fill(wl + 8 * j, 8, d * static_cast<float>(sc));
    mn[j] = -(dmin * static_cast<float>(m));
    const uint8_t* q = qs + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      int v = (j & 1) ? (q[l] >> 4) : (q[l] & 15);
      if (qh) v |= ((qh[l] >> j) & 1) << 4;
      codes[32 * j + l] = static_cast<uint8_t>(v);
    }
  }
}

// Row `row` (K / block blocks) into codes [Kp], wl [Kp/4], mn [Kp/32]; the padding zero.
inline void decode_row(int kind, const GgufFormat& f, const uint8_t* row, long K, long Kp, uint8_t* codes,
                       float* wl, float* mn) {
  const long nb = K / f.block;
  for (long b = 0; b < nb; ++b) {
    const long e = b * f.block;
    if (f.block == 32) block32(kind, row + b * f.bytes, codes + e, wl + e / 4, mn + e / 32);
    else block256(kind, row + b * f.bytes, codes + e, wl + e / 4, mn + e / 32);
  }
  for (long e = K; e < Kp; ++e) codes[e] = 0;
  for (long e = K / 4; e < Kp / 4; ++e) wl[e] = 0.f;
  for (long e = K / 32; e < Kp / 32; ++e) mn[e] = 0.f;
  if (f.signed_codes) {
    for (long e = 0; e < Kp / 32; ++e) mn[e] = 0.f;
  }
}

}  // namespace gguf_ref
}  // namespace kvl
