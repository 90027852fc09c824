// Causal prefill attention in bf16 with AVX512-BF16 (flash_bf16.cpp); ops.cpp packs each extend's
// keys and values once per KV head, then hands tiles of query rows to flash_rows over the threads.
//
// One reduction order per query row (kvl::kKeyChunk, fold_chunk): every attention kernel of the cpu
// backend splits a row's keys into chunks of 64 from position 0, computes each chunk's softmax partial
// alone (its max m, sum l and unnormalized output o), and folds the chunks in key order. The flash
// kernel (many rows over packed keys), the per-token kernel (short extends) and the decode kernel
// (split over threads at those same chunk boundaries, never by the thread count or the batch) then
// give a row the same bits whatever else is in the call: a prompt token computed in a cold prefill, as
// the uncached tail of a prefix-cache hit, in another chunk or beside other requests.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace kvl {

constexpr int kFlashRows = 4;  // query rows per call, sharing every K/V load
constexpr int kKeyChunk = 64;  // keys per softmax partial, at fixed positions 0, 64, 128, ...

// Keys are packed in chunks of 64 (zero padded).
inline long flash_padded(long S) { return (S + 63) / 64 * 64; }

// Folds one chunk's partial of a query row (max m, sum l, unnormalized output o[D]) into the row's state
// (M, L, O[D]); `first`: the row's first chunk. The chunks of a row are folded in key order by every
// kernel, with these operations (elementwise, so a vectorized copy gives the same bits).
inline void fold_chunk(float& M, float& L, float* O, float m, float l, const float* o, int D, bool first) {
  if (first) {
    M = m, L = l;
    std::memcpy(O, o, sizeof(float) * D);
    return;
  }
  const float mn = m > M ? m : M;
  const float a = std::exp(M - mn), b = std::exp(m - mn);
  M = mn;
  L = L * a + l * b;
  for (int d = 0; d < D; ++d) O[d] = O[d] * a + o[d] * b;
}

// A row's output from its folded state: O / L (0 for no key), + 0 so that a zero is +0 whichever kernel
// summed it (a kernel that adds a masked key's product 0 * v and one that skips it differ only there).
template <typename T> inline void fold_out(float L, const float* O, int D, T* out) {
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = 0; d < D; ++d) out[d] = from_f<T>(O[d] * inv + 0.f);
}

// One chunk of keys of up to kFlashRows query rows (q[i], head_dim D, a multiple of 64) that all see the
// keys at locs[c0 .. min(c0 + kKeyChunk, n)) of a paged pool (rows of D in k, v; bf16, or float8 e4m3
// widened to bf16 exactly): each row's partial (m[i], l[i], o[i * D ..]) with the same operations in the
// same order as flash_rows computes that chunk from packed keys, read in place (K transposed 16 keys at
// a time in registers). AVX512-BF16 (flash_bf16.cpp).
void flash_chunk(const bf16* const* q, int rows, const bf16* k, const bf16* v, const int64_t* locs, long c0, long n,
                 int D, float scale, float* m, float* l, float* o);
void flash_chunk(const bf16* const* q, int rows, const f8* k, const f8* v, const int64_t* locs, long c0, long n,
                 int D, float scale, float* m, float* l, float* o);

// Floats of scratch flash_rows needs (scores, bf16 probabilities, the folded outputs).
inline size_t flash_scratch_floats(int D) { return kFlashRows * (64 + 32 + D); }

// Up to kFlashRows query rows of one KV head: row i reads q[i] (head_dim bf16), sees keys 0..limit[i]
// and writes out[i]. Rows past n are not read or written.
struct FlashRows {
  const bf16* q[kFlashRows];
  bf16* out[kFlashRows];
  long limit[kFlashRows];
  int n;
};

// The same on AMX tiles (flash_amx.cpp), 16 rows a call: where amx_ready().
constexpr int kAmxFlashRows = 16;
struct AmxFlashRows {
  const bf16* q[kAmxFlashRows];
  bf16* out[kAmxFlashRows];
  long limit[kAmxFlashRows];
  int n;
};
inline size_t amx_flash_scratch_floats(int D) { return kAmxFlashRows * (D / 2 + 128 + 64 + D + 16); }
// Its layouts: kr [Sp][D] (the keys as they are), vt [D + 16][amx_v_stride(Sp)] (values transposed,
// then a row of ones and 15 of zeros), zeros past S; amx_flash_alloc values each. V^T's rows are 64
// bytes longer than Sp: tile loads read 16 of them, which at a power-of-two stride (Sp = 1,024: 2 KB)
// fall into two L1 sets and evict each other.
inline long amx_v_stride(long Sp) { return Sp + 32; }
inline long amx_flash_alloc(long Sp, int D) { return (D + 16) * amx_v_stride(Sp); }
void amx_pack(const bf16* k, const bf16* v, const int64_t* locs, long S, int D, bf16* kr, bf16* vt);
void flash_rows_amx(const AmxFlashRows& r, const bf16* kr, const bf16* vt, long Sp, int D, float scale,
                    float* scratch);

// The keys/values at locs[0..S) of one KV head (rows of D in k, v) into the layouts flash_rows reads:
// kt [Sp/16][D/2][16][2], vt [Sp/2][D][2] (Sp = flash_padded(S), zeros past S).
void flash_pack(const bf16* k, const bf16* v, const int64_t* locs, long S, int D, bf16* kt, bf16* vt);
// The same from a float8 e4m3 pool, each value widened to bf16 exactly (the products then run as for
// a bf16 pool: the float8 values are what a bf16 pool of them would hold).
void flash_pack(const f8* k, const f8* v, const int64_t* locs, long S, int D, bf16* kt, bf16* vt);

// Softmax(q k^T * scale) v per row over its causal range; D a multiple of 64. Chunks of kKeyChunk keys,
// each a partial on its own, folded in order (fold_chunk): a row's bits do not depend on the tile's other
// rows, the extend or the prefix length.
void flash_rows(const FlashRows& r, const bf16* kt, const bf16* vt, int D, float scale, float* scratch);

}  // namespace kvl
