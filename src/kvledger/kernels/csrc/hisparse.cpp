// HiSparse's decode on the CPU (model/hisparse.py): one call a layer for every sparse row of a step.
//
// The host pool (host_k/host_v [host pages, layers, kv heads, page_size, head_dim]) is ordinary memory, so
// attention reads the selected pages where they lie: no copy into hot KV-pool pages. A token of host page
// hp at offset o is, for layer l and KV head h, at element ((hp * layers + l) * kvh + h) * ps * D + o * D.
// With a view of the pool whose KV-head stride is ps * D and whose base is layer l's first head
// (storage offset l * kvh * ps * D), that is location hp * layers * kvh * ps + o of KV head h: the decode
// kernel's own addressing (k_cache[h] + loc * D), so decode_attention reads the host pool in place through
// a per-(row, KV head) table of such locations (its head_stride form).
//
// The key summaries (Quest's element-wise min | max of a page's keys) are [layers, host pages, kv heads,
// 2, head_dim] in the pool's dtype: the min and max of bfloat16 keys are bfloat16 values, so half the
// bytes of float32 lose nothing, and one layer's summaries of a row's pages lie together (a row's host
// pages are mostly consecutive), all KV heads of a page in one run of 2 * kvh * D values. The scoring
// streams them once a layer: it is memory-bound, and the earlier [host pages, layers, ...] layout put
// each page's 512 bytes 46 KB from the next (a DRAM and TLB miss a page, ~185 ns).
//
// Per call, for each row r (its sequence length lens[r], the new token included; its host pages
// host_table[r, :]): the new token's K/V go into its host page and fold into that page's key summary,
// then per KV head the pages to read are chosen: the first `sink`, the last `recent` (the current one
// included) and the `top_k` others with the largest Quest bound sum_d max(q_d lo_d, q_d hi_d) (the
// largest of the KV head's query heads'), ascending; every page where the sequence has no more than
// sink + recent + top_k of them, or where top_k < 0 (a dense layer). Then attention over those pages,
// in the decode kernel's one order of sums: all pages selected gives the bits of the dense decode over
// the same K/V.
#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVL_HS_AVX512 1
#define KVL_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

#include "decode_step.h"
#include "kernels.h"
#include "pool.h"

namespace kvl {
namespace {

struct Shape {
  int64_t R, H, D, KVH, G, layers, ps, W, HP;
};

// Query heads scored together: a KV head's group padded to a multiple of this with copies of its last
// query head (a copy's bound equals its original's, so the group's largest is unchanged).
constexpr int64_t kQuad = 4;
// Pages a scoring work item takes (the threads split a long row's pages).
constexpr int64_t kScoreBlock = 128;
// Pages ahead whose summaries the scoring prefetches.
constexpr int64_t kPrefetchPages = 4;

bool use_avx512() {
#ifdef KVL_HS_AVX512
  static const bool ok = [] {
    const char* force = std::getenv("KVLEDGER_CPU_ISA");
    if (force && std::strcmp(force, "scalar") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
#else
  return false;
#endif
}

Shape check(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& host_k,
            const at::Tensor& host_v, const at::Tensor& summary, int64_t layer, const at::Tensor& host_table,
            const at::Tensor& lens, int64_t sink, int64_t recent) {
  TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q must be a CPU float32/bfloat16 tensor");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be [rows, heads, head_dim] contiguous");
  TORCH_CHECK(host_k.dim() == 5 && host_k.is_contiguous() && host_v.is_contiguous() &&
                  host_v.sizes() == host_k.sizes() && host_k.scalar_type() == q.scalar_type() &&
                  host_v.scalar_type() == q.scalar_type(),
              "host_k/host_v must be [host pages, layers, kv heads, page_size, head_dim] of q's dtype, contiguous");
  Shape s{q.size(0), q.size(1),   q.size(2),          host_k.size(2), 0,
          host_k.size(1), host_k.size(3), host_table.size(1), host_k.size(0)};
  TORCH_CHECK(host_k.size(4) == s.D && s.KVH > 0 && s.H % s.KVH == 0, "host pool and q disagree on heads/head_dim");
  s.G = s.H / s.KVH;
  TORCH_CHECK(layer >= 0 && layer < s.layers, "layer ", layer, " outside the host pool");
  for (const auto* t : {&k_new, &v_new}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == s.R && t->size(1) == s.KVH && t->size(2) == s.D && t->stride(2) == 1 &&
                    t->stride(1) == s.D && t->scalar_type() == q.scalar_type(),
                "k_new/v_new must be [rows, kv heads, head_dim] of q's dtype");
  }
  TORCH_CHECK(summary.scalar_type() == q.scalar_type() && summary.is_contiguous() && summary.dim() == 5 &&
                  summary.size(0) == s.layers && summary.size(1) == s.HP && summary.size(2) == s.KVH &&
                  summary.size(3) == 2 && summary.size(4) == s.D,
              "summary must be [layers, host pages, kv heads, 2, head_dim] of q's dtype, contiguous");
  TORCH_CHECK(host_table.scalar_type() == at::kLong && host_table.dim() == 2 && host_table.is_contiguous() &&
                  host_table.size(0) == s.R,
              "host_table must be int64 [rows, pages] contiguous");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == s.R, "lens must be int64 [rows]");
  TORCH_CHECK(sink >= 0 && recent >= 1, "sink must be >= 0 and recent >= 1");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = host_table.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.R; ++r) {
    TORCH_CHECK(lp[r] >= 1 && (lp[r] - 1) / s.ps < s.W, "row ", r, ": length ", lp[r], " past its host pages");
    for (int64_t p = 0; p <= (lp[r] - 1) / s.ps; ++p) {
      TORCH_CHECK(tp[r * s.W + p] >= 0 && tp[r * s.W + p] < s.HP, "row ", r, ": host page ", tp[r * s.W + p],
                  " outside the pool");
    }
  }
  return s;
}

// The pages row r reads before its current one, for a sequence of n_pages pages: how many.
int64_t chosen_count(int64_t n_pages, int64_t sink, int64_t recent, int64_t top_k) {
  const int64_t cur = n_pages - 1;
  if (top_k < 0 || n_pages <= sink + recent + top_k) return cur;
  return sink + top_k + recent - 1;
}

template <typename T>
void write_and_summarize(const Shape& s, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& host_k,
                         at::Tensor& host_v, at::Tensor& summary, int64_t layer, const int64_t* tp, const int64_t* lp) {
  const int64_t D = s.D, ps = s.ps;
  T* hk = reinterpret_cast<T*>(host_k.data_ptr());
  T* hv = reinterpret_cast<T*>(host_v.data_ptr());
  T* sm = reinterpret_cast<T*>(summary.data_ptr()) + layer * s.HP * s.KVH * 2 * D;
  const T* kn = reinterpret_cast<const T*>(k_new.data_ptr());
  const T* vn = reinterpret_cast<const T*>(v_new.data_ptr());
  for (int64_t r = 0; r < s.R; ++r) {
    const int64_t pos = lp[r] - 1, off = pos % ps, hp = tp[r * s.W + pos / ps];
    for (int64_t h = 0; h < s.KVH; ++h) {
      const int64_t at = (((hp * s.layers + layer) * s.KVH + h) * ps + off) * D;
      const T* kr = kn + r * k_new.stride(0) + h * D;
      std::memcpy(hk + at, kr, D * sizeof(T));
      std::memcpy(hv + at, vn + r * v_new.stride(0) + h * D, D * sizeof(T));
      T* lo = sm + (hp * s.KVH + h) * 2 * D;
      T* hi = lo + D;
      for (int64_t d = 0; d < D; ++d) {
        // The key's own value, never a rounding of it: min/max of T values are T values.
        const float x = to_f(kr[d]);
        if (off == 0 || x < to_f(lo[d])) lo[d] = kr[d];
        if (off == 0 || x > to_f(hi[d])) hi[d] = kr[d];
      }
    }
  }
}

// A row's query split for the bound: max(q lo, q hi) = min(q, 0) lo + max(q, 0) hi. qn, qp: float
// [KVH, Gp, D], Gp = G rounded up to kQuad, the padding heads copies of each group's last.
template <typename T>
void split_query(const Shape& s, const T* qr, int64_t Gp, float* qn, float* qp) {
  for (int64_t h = 0; h < s.KVH; ++h) {
    for (int64_t g = 0; g < Gp; ++g) {
      const T* src = qr + (h * s.G + std::min(g, s.G - 1)) * s.D;
      float* n = qn + (h * Gp + g) * s.D;
      float* p = qp + (h * Gp + g) * s.D;
      for (int64_t d = 0; d < s.D; ++d) {
        const float x = to_f(src[d]);
        n[d] = std::min(x, 0.f);
        p[d] = std::max(x, 0.f);
      }
    }
  }
}

// Scores of a row's pages [p0, p1) for every KV head: sc[h * stride + p] (the largest bound of h's query
// heads). sml: the layer's summaries; hpages: the row's host pages. Plain float loops (any CPU).
template <typename T>
void score_scalar(const Shape& s, const T* sml, const int64_t* hpages, int64_t p0, int64_t p1, int64_t Gp,
                  const float* qn, const float* qp, float* sc, int64_t stride) {
  const int64_t D = s.D;
  for (int64_t p = p0; p < p1; ++p) {
    const T* pg = sml + hpages[p] * s.KVH * 2 * D;
    for (int64_t h = 0; h < s.KVH; ++h) {
      const T* lo = pg + h * 2 * D;
      const T* hi = lo + D;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t g = 0; g < s.G; ++g) {
        const float* a = qn + (h * Gp + g) * D;
        const float* b = qp + (h * Gp + g) * D;
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += a[d] * to_f(lo[d]) + b[d] * to_f(hi[d]);
        best = std::max(best, acc);
      }
      sc[h * stride + p] = best;
    }
  }
}

#ifdef KVL_HS_AVX512
KVL_AVX512_FN inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KVL_AVX512_FN inline __m512 load16(const bf16* p) {  // bf16 -> float: the bits moved up 16, in registers
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 16 lanes of each of a, b, c, d summed: [sum a, sum b, sum c, sum d] (one tree for the four).
KVL_AVX512_FN inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128: a a b b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a0+a2 (+a1+a3), b.., c.., d..] after one more step
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// score_scalar's scores with AVX-512: per page, the KV heads' min/max (T, widened in registers) read
// once for all their query heads, four at a time (FMAs; the bound only ranks pages). D % 16 == 0.
template <typename T>
KVL_AVX512_FN void score_avx512(const Shape& s, const T* sml, const int64_t* hpages, int64_t p0, int64_t p1,
                                int64_t Gp, const float* qn, const float* qp, float* sc, int64_t stride) {
  const int64_t D = s.D, page = s.KVH * 2 * D;
  const int64_t lines = (page * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t p = p0; p < p1; ++p) {
    const T* pg = sml + hpages[p] * page;
    if (p + kPrefetchPages < p1) {
      const char* next = reinterpret_cast<const char*>(sml + hpages[p + kPrefetchPages] * page);
      for (int64_t i = 0; i < lines; ++i) _mm_prefetch(next + 64 * i, _MM_HINT_T0);
    }
    for (int64_t h = 0; h < s.KVH; ++h) {
      const T* lo = pg + h * 2 * D;
      const T* hi = lo + D;
      __m128 best = _mm_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t g = 0; g < Gp; g += kQuad) {
        const float* a = qn + (h * Gp + g) * D;
        const float* b = qp + (h * Gp + g) * D;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 l = load16(lo + d), u = load16(hi + d);
          acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), l, acc0);
          acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + D + d), l, acc1);
          acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + 2 * D + d), l, acc2);
          acc3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + 3 * D + d), l, acc3);
          acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(b + d), u, acc0);
          acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(b + D + d), u, acc1);
          acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(b + 2 * D + d), u, acc2);
          acc3 = _mm512_fmadd_ps(_mm512_loadu_ps(b + 3 * D + d), u, acc3);
        }
        best = _mm_max_ps(best, reduce4(acc0, acc1, acc2, acc3));
      }
      best = _mm_max_ps(best, _mm_movehl_ps(best, best));
      best = _mm_max_ss(best, _mm_shuffle_ps(best, best, 1));
      sc[h * stride + p] = _mm_cvtss_f32(best);
    }
  }
}
#endif

// A score and its page as one integer key, larger = better: the score's bits made monotone above, the
// page inverted below (ties: the lower page). nth_element over plain integers.
inline uint64_t rank_key(float score, int64_t p) {
  uint32_t u;
  std::memcpy(&u, &score, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(p));
}

// Row r, KV head h: the chosen pages (sequence page numbers, ascending) into `out` (count entries), from
// the scores of pages [sink, n_pages - recent) at sc[p] (selecting rows only).
void choose(const float* sc, int64_t n_pages, int64_t sink, int64_t recent, int64_t top_k, uint64_t* keys,
            int64_t* out) {
  const int64_t cur = n_pages - 1, lo = sink, hi = n_pages - recent;
  for (int64_t p = lo; p < hi; ++p) keys[p - lo] = rank_key(sc[p], p);
  std::nth_element(keys, keys + (top_k - 1), keys + (hi - lo), std::greater<uint64_t>());
  int64_t i = 0;
  for (int64_t p = 0; p < sink; ++p) out[i++] = p;
  for (int64_t j = 0; j < top_k; ++j) out[i + j] = 0xffffffffu - static_cast<uint32_t>(keys[j] & 0xffffffffu);
  std::sort(out + i, out + i + top_k);
  i += top_k;
  for (int64_t p = hi; p < cur; ++p) out[i++] = p;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> hisparse_select(const at::Tensor& q, const at::Tensor& k_new,
                                                   const at::Tensor& v_new, at::Tensor& host_k, at::Tensor& host_v,
                                                   at::Tensor& summary, int64_t layer, const at::Tensor& host_table,
                                                   const at::Tensor& lens, int64_t sink, int64_t recent,
                                                   int64_t top_k) {
  const Shape s = check(q, k_new, v_new, host_k, host_v, summary, layer, host_table, lens, sink, recent);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = host_table.data_ptr<int64_t>();
  const int64_t ps = s.ps, stride_page = s.layers * s.KVH * ps, D = s.D;
  const int64_t Gp = (s.G + kQuad - 1) / kQuad * kQuad;
  int64_t P = 1;
  // Per row: pages before the current one it reads; where it selects, its scores' offset (KVH * n_pages
  // floats each) and its first scoring block.
  std::vector<int64_t> count(static_cast<size_t>(s.R)), score_at(static_cast<size_t>(s.R) + 1, 0),
      block_at(static_cast<size_t>(s.R) + 1, 0);
  for (int64_t r = 0; r < s.R; ++r) {
    const int64_t n_pages = (lp[r] - 1) / ps + 1;
    count[r] = chosen_count(n_pages, sink, recent, top_k);
    P = std::max(P, count[r] + 1);
    const bool selects = count[r] != n_pages - 1;
    const int64_t mid = selects ? n_pages - recent - sink : 0;
    score_at[r + 1] = score_at[r] + (selects ? s.KVH * n_pages : 0);
    block_at[r + 1] = block_at[r] + (mid + kScoreBlock - 1) / kScoreBlock;
  }
  auto table = at::empty({s.R, s.KVH * P * ps}, at::kLong);
  auto counts = at::empty({s.R}, at::kLong);
  int64_t* out = table.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  const bool avx512 = use_avx512() && D % 16 == 0;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    write_and_summarize<T>(s, k_new, v_new, host_k, host_v, summary, layer, tp, lp);
    const T* sml = reinterpret_cast<const T*>(summary.data_ptr()) + layer * s.HP * s.KVH * 2 * D;
    const T* qt = reinterpret_cast<const T*>(q.data_ptr());
    const int64_t blocks = block_at[s.R];
    std::vector<float> qsplit, scores;
    if (blocks) {
      // The bound's query halves, then every selecting row's scores, in blocks of pages over the threads.
      const int64_t qn_size = s.KVH * Gp * D;
      qsplit.resize(static_cast<size_t>(s.R * 2 * qn_size));
      for (int64_t r = 0; r < s.R; ++r) {
        if (block_at[r + 1] > block_at[r]) {
          split_query<T>(s, qt + r * s.H * D, Gp, qsplit.data() + r * 2 * qn_size,
                         qsplit.data() + r * 2 * qn_size + qn_size);
        }
      }
      scores.resize(static_cast<size_t>(score_at[s.R]));
      kvl::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t r = std::upper_bound(block_at.begin(), block_at.end(), b) - block_at.begin() - 1;
          const int64_t n_pages = (lp[r] - 1) / ps + 1, hi = n_pages - recent;
          const int64_t p0 = sink + (b - block_at[r]) * kScoreBlock, p1 = std::min(hi, p0 + kScoreBlock);
          const float* qn = qsplit.data() + r * 2 * qn_size;
          float* sc = scores.data() + score_at[r];
#ifdef KVL_HS_AVX512
          if (avx512) {
            score_avx512<T>(s, sml, tp + r * s.W, p0, p1, Gp, qn, qn + qn_size, sc, n_pages);
            continue;
          }
#endif
          score_scalar<T>(s, sml, tp + r * s.W, p0, p1, Gp, qn, qn + qn_size, sc, n_pages);
        }
      });
    }
    kvl::parallel_for(0, s.R * s.KVH, 1, [&](int64_t i0, int64_t i1) {
      std::vector<int64_t> pages(static_cast<size_t>(P));
      std::vector<uint64_t> keys;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / s.KVH, h = i % s.KVH, n_pages = (lp[r] - 1) / ps + 1;
        const int64_t* hpages = tp + r * s.W;
        if (count[r] == n_pages - 1) {
          for (int64_t p = 0; p < count[r]; ++p) pages[p] = p;
        } else {
          keys.resize(static_cast<size_t>(n_pages));
          choose(scores.data() + score_at[r] + h * n_pages, n_pages, sink, recent, top_k, keys.data(), pages.data());
        }
        pages[count[r]] = n_pages - 1;  // the current page, last
        int64_t* row = out + r * s.KVH * P * ps + h * P * ps;
        for (int64_t j = 0; j <= count[r]; ++j) {
          const int64_t base = hpages[pages[j]] * stride_page;
          for (int64_t o = 0; o < ps; ++o) row[j * ps + o] = base + o;
        }
        for (int64_t j = (count[r] + 1) * ps; j < P * ps; ++j) row[j] = row[0];  // padding, never read
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16) {
    run(bf16{});
  } else {
    run(float{});
  }
  for (int64_t r = 0; r < s.R; ++r) cp[r] = count[r] * ps + (lp[r] - 1) % ps + 1;
  return {table, counts};
}

at::Tensor hisparse_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                              at::Tensor& host_k, at::Tensor& host_v, at::Tensor& summary, int64_t layer,
                              const at::Tensor& host_table, const at::Tensor& lens, int64_t sink, int64_t recent,
                              int64_t top_k, double scale) {
  auto [table, counts] =
      hisparse_select(q, k_new, v_new, host_k, host_v, summary, layer, host_table, lens, sink, recent, top_k);
  const int64_t KVH = host_k.size(2), ps = host_k.size(3), D = host_k.size(4);
  const int64_t base = layer * KVH * ps * D;
  // Location x of KV head h at base + h * ps * D + x * D: the largest x whose head KVH-1 element fits.
  const int64_t locs = (host_k.numel() - base - (KVH - 1) * ps * D) / D;
  at::Tensor kv = host_k.as_strided({KVH, locs, D}, {ps * D, D, 1}, host_k.storage_offset() + base);
  at::Tensor vv = host_v.as_strided({KVH, locs, D}, {ps * D, D, 1}, host_v.storage_offset() + base);
  const at::Tensor rows = at::arange(q.size(0), at::kLong);
  return op_decode_attention_heads(q, kv, vv, table, rows, counts, scale, table.size(1) / KVH);
}

}  // namespace kvl

TORCH_LIBRARY_FRAGMENT(kvledger_cpu, m) {
  m.def(
      "hisparse_select(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) host_k, Tensor(b!) host_v, "
      "Tensor(c!) summary, int layer, Tensor host_table, Tensor lens, int sink, int recent, int top_k) "
      "-> (Tensor, Tensor)");
  m.def(
      "hisparse_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) host_k, Tensor(b!) host_v, "
      "Tensor(c!) summary, int layer, Tensor host_table, Tensor lens, int sink, int recent, int top_k, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvledger_cpu, CPU, m) {
  m.impl("hisparse_select", &kvl::hisparse_select);
  m.impl("hisparse_attention", &kvl::hisparse_attention);
}
