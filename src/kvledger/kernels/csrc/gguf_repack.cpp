// The load-time repack of Q4_K / Q6_K / Q8_0 / Q5_0 blocks into 16 interleaved rows (gguf_blocks.h: the layouts),
// its inverse (the file's bytes exactly: the embedding's row look-ups, the float copies, the tests), and
// the portable kernel on the packed layout (each group unpacked to the file's blocks, then the tiles'
// scalar sums: equal bit for bit to gguf_tiles_scalar on those blocks, as the VNNI kernel is).
// Plain C++ (u64 nibble arithmetic): the repack runs once a load over the threads (ops.cpp), at memory
// speed on the file's ~0.7 GB of a 1.2B Q4_K_M.
#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"

namespace kvl {
namespace {

constexpr uint64_t kLo4 = 0x0F0F0F0F0F0F0F0FULL, kLo2 = 0x0303030303030303ULL;

inline uint64_t load8(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t load4(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store4(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline void store8(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// 8 codes (< 16, a byte each) -> 4 bytes: code i | code 4+i << 4
inline uint32_t pack_nib(uint64_t c) { return static_cast<uint32_t>(c) | (static_cast<uint32_t>(c >> 32) << 4); }
inline uint64_t unpack_nib(uint32_t w) {
  return (static_cast<uint64_t>(w) & 0x0F0F0F0FULL) | ((static_cast<uint64_t>(w >> 4) & 0x0F0F0F0FULL) << 32);
}

// --- Q4_K: one row's super-block -> lane j of a group's super-block, and back ----------------------------
void q4k_in(const uint8_t* blk, int j, uint8_t* o) {
  std::memcpy(o + 2 * j, blk, 2);
  std::memcpy(o + 32 + 2 * j, blk + 2, 2);
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    gguf_ref::scale_min_k4(s, blk + 4, &sc, &m);
    o[64 + 16 * s + j] = static_cast<uint8_t>(sc);
    o[192 + 16 * s + j] = static_cast<uint8_t>(m);
  }
  const uint8_t* qs = blk + 16;
  for (int s = 0; s < 8; ++s) {
    for (int c = 0; c < 4; ++c) {
      const uint64_t v = load8(qs + 32 * (s / 2) + 8 * c);
      store4(o + 320 + (4 * s + c) * 64 + 4 * j, pack_nib((s & 1) ? (v >> 4) & kLo4 : v & kLo4));
    }
  }
}

void q4k_out(const uint8_t* o, int j, uint8_t* blk) {
  std::memcpy(blk, o + 2 * j, 2);
  std::memcpy(blk + 2, o + 32 + 2 * j, 2);
  uint8_t* q = blk + 4;  // get_scale_min_k4's inverse: 6-bit sc/m of sub-blocks 0-3 whole, 4-7 split
  for (int s = 0; s < 4; ++s) {
    const int sc = o[64 + 16 * s + j], m = o[192 + 16 * s + j];
    const int sc4 = o[64 + 16 * (s + 4) + j], m4 = o[192 + 16 * (s + 4) + j];
    q[s] = static_cast<uint8_t>(sc | ((sc4 >> 4) << 6));
    q[s + 4] = static_cast<uint8_t>(m | ((m4 >> 4) << 6));
    q[s + 8] = static_cast<uint8_t>((sc4 & 15) | ((m4 & 15) << 4));
  }
  uint8_t* qs = blk + 16;
  for (int s = 0; s < 8; ++s) {
    for (int c = 0; c < 4; ++c) {
      const uint64_t n = unpack_nib(load4(o + 320 + (4 * s + c) * 64 + 4 * j));
      uint8_t* p = qs + 32 * (s / 2) + 8 * c;
      store8(p, (s & 1) ? load8(p) | (n << 4) : n);  // even sub-blocks first: the low nibbles
    }
  }
}

// --- Q6_K ------------------------------------------------------------------------------------------------
void q6k_in(const uint8_t* blk, int j, uint8_t* o) {
  alignas(64) uint8_t c[256];  // the codes 0..63 (gguf_ref::block256's, before the -32)
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], q = qh[32 * h + l];
      uint8_t* p = c + 128 * h + l;
      p[0] = static_cast<uint8_t>((a & 15) | ((q & 3) << 4));
      p[32] = static_cast<uint8_t>((b & 15) | (((q >> 2) & 3) << 4));
      p[64] = static_cast<uint8_t>((a >> 4) | (((q >> 4) & 3) << 4));
      p[96] = static_cast<uint8_t>((b >> 4) | (((q >> 6) & 3) << 4));
    }
  }
  std::memcpy(o + 2 * j, blk + 208, 2);
  for (int i = 0; i < 16; ++i) o[32 + 16 * i + j] = blk[192 + i];
  for (int k = 0; k < 32; ++k) store4(o + 288 + 64 * k + 4 * j, pack_nib(load8(c + 8 * k) & kLo4));
  for (int k = 0; k < 16; ++k) {
    const uint64_t a = (load8(c + 16 * k) >> 4) & kLo2, b = (load8(c + 16 * k + 8) >> 4) & kLo2;
    const uint32_t v = static_cast<uint32_t>(a) | (static_cast<uint32_t>(a >> 32) << 2) |
                       (static_cast<uint32_t>(b) << 4) | (static_cast<uint32_t>(b >> 32) << 6);
    store4(o + 2336 + 64 * k + 4 * j, v);
  }
}

void q6k_out(const uint8_t* o, int j, uint8_t* blk) {
  alignas(64) uint8_t c[256];
  for (int k = 0; k < 32; ++k) store8(c + 8 * k, unpack_nib(load4(o + 288 + 64 * k + 4 * j)));
  for (int k = 0; k < 16; ++k) {
    const uint32_t v = load4(o + 2336 + 64 * k + 4 * j);
    for (int i = 0; i < 4; ++i) {
      const uint32_t b = v >> (8 * i);
      c[16 * k + i] |= static_cast<uint8_t>((b & 3) << 4);
      c[16 * k + 4 + i] |= static_cast<uint8_t>(((b >> 2) & 3) << 4);
      c[16 * k + 8 + i] |= static_cast<uint8_t>(((b >> 4) & 3) << 4);
      c[16 * k + 12 + i] |= static_cast<uint8_t>(((b >> 6) & 3) << 4);
    }
  }
  uint8_t* ql = blk;
  uint8_t* qh = blk + 128;
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t* p = c + 128 * h + l;
      ql[64 * h + l] = static_cast<uint8_t>((p[0] & 15) | ((p[64] & 15) << 4));
      ql[64 * h + 32 + l] = static_cast<uint8_t>((p[32] & 15) | ((p[96] & 15) << 4));
      qh[32 * h + l] = static_cast<uint8_t>((p[0] >> 4) | ((p[32] >> 4) << 2) | ((p[64] >> 4) << 4) | ((p[96] >> 4) << 6));
    }
  }
  for (int i = 0; i < 16; ++i) blk[192 + i] = o[32 + 16 * i + j];
  std::memcpy(blk + 208, o + 2 * j, 2);
}

// --- Q8_0 / Q5_0: one row's block b -> lane j of a group (sc: the group's scale plane, cb: block b's codes)
void q80_in(const uint8_t* blk, int j, uint8_t* sc, uint8_t* cb) {
  std::memcpy(sc + 2 * j, blk, 2);
  for (int c = 0; c < 8; ++c) store4(cb + 64 * c + 4 * j, load4(blk + 2 + 4 * c) ^ 0x80808080u);
}

void q80_out(const uint8_t* sc, const uint8_t* cb, int j, uint8_t* blk) {
  std::memcpy(blk, sc + 2 * j, 2);
  for (int c = 0; c < 8; ++c) store4(blk + 2 + 4 * c, load4(cb + 64 * c + 4 * j) ^ 0x80808080u);
}

void q50_in(const uint8_t* blk, int j, uint8_t* sc, uint8_t* cb) {
  std::memcpy(sc + 2 * j, blk, 2);
  const uint32_t qh = load4(blk + 2);
  const uint8_t* qs = blk + 6;
  alignas(8) uint8_t lo[32];  // element e's low 4 bits: qs[e] & 15 for e < 16, qs[e - 16] >> 4 after
  for (int e = 0; e < 16; ++e) {
    lo[e] = qs[e] & 15;
    lo[e + 16] = qs[e] >> 4;
  }
  for (int c = 0; c < 4; ++c) store4(cb + 64 * c + 4 * j, pack_nib(load8(lo + 8 * c)));
  for (int i = 0; i < 4; ++i) {
    uint8_t h = 0;
    for (int c = 0; c < 8; ++c) h |= static_cast<uint8_t>(((qh >> (4 * c + i)) & 1) << c);
    cb[256 + 4 * j + i] = h;
  }
}

void q50_out(const uint8_t* sc, const uint8_t* cb, int j, uint8_t* blk) {
  std::memcpy(blk, sc + 2 * j, 2);
  alignas(8) uint8_t lo[32];
  for (int c = 0; c < 4; ++c) store8(lo + 8 * c, unpack_nib(load4(cb + 64 * c + 4 * j)));
  uint32_t qh = 0;
  for (int i = 0; i < 4; ++i) {
    const uint8_t h = cb[256 + 4 * j + i];
    for (int c = 0; c < 8; ++c) qh |= static_cast<uint32_t>((h >> c) & 1) << (4 * c + i);
  }
  store4(blk + 2, qh);
  for (int e = 0; e < 16; ++e) blk[6 + e] = static_cast<uint8_t>(lo[e] | (lo[e + 16] << 4));
}

// The file's bytes of a block of `kind` (not packed) and its packed group's.
long file_block_bytes(int kind) {
  switch (kind) {
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    case kQ8_0: return 34;
    default: return 22;  // Q5_0
  }
}

}  // namespace

void gguf_repack_groups(int kind, const uint8_t* src, long rows, long K, uint8_t* dst, long g0, long g1,
                        long heads) {
  const int pk = kind + kGgufPacked;
  const long nb = K / gguf_packed_block(pk), fb = file_block_bytes(kind), gb = gguf_group_bytes(pk),
             row_bytes = nb * fb;
  const bool small = gguf_packed_block(pk) == 32;  // the scale plane, then the codes (gguf_blocks.h)
  const long cbytes = kind == kQ8_0 ? 512 : 320;
  // HF's row r inside a head (rph rows: two rotary halves of half rows each) is the file's row 2 j + i
  // where r = i * half + j (llama.cpp's permute: the halves' elements interleaved pairwise).
  const long rph = heads > 0 ? rows / heads : rows, half = rph / 2;
  auto file_row = [&](long r) {
    if (heads <= 0) return r;
    const long h = r / rph, rem = r % rph;
    return h * rph + 2 * (rem % half) + rem / half;
  };
  for (long g = g0; g < g1; ++g) {
    uint8_t* og = dst + g * nb * gb;
    const int valid = static_cast<int>(std::min<long>(kGgufGroup, rows - g * kGgufGroup));
    if (valid < kGgufGroup) {  // padding rows: zero scales, zero outputs (Q8_0's zero code is 0x80)
      std::memset(og, 0, nb * gb);
      if (kind == kQ8_0) std::memset(og + 32 * nb, 0x80, 512 * nb);
    }
    for (long b = 0; b < nb; ++b) {
      for (int j = 0; j < valid; ++j) {
        const uint8_t* blk = src + file_row(g * kGgufGroup + j) * row_bytes + b * fb;
        if (small) {
          if (kind == kQ8_0) q80_in(blk, j, og + 32 * b, og + 32 * nb + cbytes * b);
          else q50_in(blk, j, og + 32 * b, og + 32 * nb + cbytes * b);
        } else if (kind == kQ4_K) {
          q4k_in(blk, j, og + b * gb);
        } else {
          q6k_in(blk, j, og + b * gb);
        }
      }
    }
  }
}

void gguf_unpack_groups(int kind, const uint8_t* src, long rows, long K, uint8_t* dst, long g0, long g1) {
  const int base = kind - kGgufPacked;
  const long nb = K / gguf_packed_block(kind), fb = file_block_bytes(base), gb = gguf_group_bytes(kind),
             row_bytes = nb * fb;
  const bool small = gguf_packed_block(kind) == 32;
  const long cbytes = base == kQ8_0 ? 512 : 320;
  for (long g = g0; g < g1; ++g) {
    const uint8_t* og = src + g * nb * gb;
    const int valid = static_cast<int>(std::min<long>(kGgufGroup, rows - g * kGgufGroup));
    for (long b = 0; b < nb; ++b) {
      for (int j = 0; j < valid; ++j) {
        uint8_t* blk = dst + (g * kGgufGroup + j) * row_bytes + b * fb;
        if (small) {
          if (base == kQ8_0) q80_out(og + 32 * b, og + 32 * nb + cbytes * b, j, blk);
          else q50_out(og + 32 * b, og + 32 * nb + cbytes * b, j, blk);
        } else if (kind == kQ4_Kx16) {
          q4k_out(og + b * gb, j, blk);
        } else {
          q6k_out(og + b * gb, j, blk);
        }
      }
    }
  }
}

void gguf_packed_scalar(const GgufActs& a, int kind, const uint8_t* w, long row0, long K, void* y, bool out_bf16,
                        long N, long n0, long n1) {
  const int base = kind - kGgufPacked;
  const long gbytes = gguf_rows_bytes(kind, kGgufGroup, K), row_bytes = gguf_rows_bytes(base, 1, K);
  thread_local std::vector<uint8_t> blocks;
  blocks.resize(kGgufGroup * row_bytes);
  for (long n = n0; n < n1; n += kGgufGroup) {
    const long g = (n - row0) / kGgufGroup, valid = std::min<long>(kGgufGroup, n1 - n);
    // the group alone, as rows [0, valid) of the file's blocks
    gguf_unpack_groups(kind, w + g * gbytes, valid, K, blocks.data(), 0, 1);
    gguf_tiles_scalar(a, base, blocks.data(), n, K, y, out_bf16, N, n, n + valid);
  }
}

}  // namespace kvl
