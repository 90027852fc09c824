// Causal prefill attention in bf16 with AVX512-BF16 (flash_bf16.cpp); ops.cpp packs each extend's
// keys and values once per KV head, then hands tiles of query rows to flash_rows over the threads.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace kvl {

constexpr int kFlashRows = 4;  // query rows per call, sharing every K/V load

// Keys are packed in chunks of 64 (zero padded).
inline long flash_padded(long S) { return (S + 63) / 64 * 64; }

// Floats of scratch flash_rows needs (scores, bf16 probabilities, output accumulators).
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

// Softmax(q k^T * scale) v per row over its causal range; D a multiple of 64.
void flash_rows(const FlashRows& r, const bf16* kt, const bf16* vt, int D, float scale, float* scratch);

}  // namespace kvl
