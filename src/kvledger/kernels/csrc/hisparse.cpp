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
// Per call, for each row r (its sequence length lens[r], the new token included; its host pages
// host_table[r, :]): the new token's K/V go into its host page and fold into that page's key summary
// (element-wise min | max, Quest), then per KV head the pages to read are chosen: the first `sink`, the
// last `recent` (the current one included) and the `top_k` others with the largest Quest bound
// sum_d max(q_d lo_d, q_d hi_d) (the largest of the KV head's query heads'), ascending; every page where
// the sequence has no more than sink + recent + top_k of them, or where top_k < 0 (a dense layer). Then
// attention over those pages, in the decode kernel's one order of sums: all pages selected gives the
// bits of the dense decode over the same K/V.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "decode_step.h"
#include "kernels.h"
#include "pool.h"

namespace kvl {
namespace {

struct Shape {
  int64_t R, H, D, KVH, G, layers, ps, W;
};

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
  Shape s{q.size(0), q.size(1), q.size(2), host_k.size(2), 0, host_k.size(1), host_k.size(3), host_table.size(1)};
  TORCH_CHECK(host_k.size(4) == s.D && s.KVH > 0 && s.H % s.KVH == 0, "host pool and q disagree on heads/head_dim");
  s.G = s.H / s.KVH;
  TORCH_CHECK(layer >= 0 && layer < s.layers, "layer ", layer, " outside the host pool");
  for (const auto* t : {&k_new, &v_new}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == s.R && t->size(1) == s.KVH && t->size(2) == s.D && t->stride(2) == 1 &&
                    t->stride(1) == s.D && t->scalar_type() == q.scalar_type(),
                "k_new/v_new must be [rows, kv heads, head_dim] of q's dtype");
  }
  TORCH_CHECK(summary.scalar_type() == at::kFloat && summary.is_contiguous() && summary.dim() == 5 &&
                  summary.size(0) == host_k.size(0) && summary.size(1) == s.layers && summary.size(2) == s.KVH &&
                  summary.size(3) == 2 && summary.size(4) == s.D,
              "summary must be float32 [host pages, layers, kv heads, 2, head_dim] contiguous");
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
      TORCH_CHECK(tp[r * s.W + p] >= 0 && tp[r * s.W + p] < host_k.size(0), "row ", r, ": host page ",
                  tp[r * s.W + p], " outside the pool");
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
  float* sm = summary.data_ptr<float>();
  const T* kn = reinterpret_cast<const T*>(k_new.data_ptr());
  const T* vn = reinterpret_cast<const T*>(v_new.data_ptr());
  for (int64_t r = 0; r < s.R; ++r) {
    const int64_t pos = lp[r] - 1, off = pos % ps, hp = tp[r * s.W + pos / ps];
    for (int64_t h = 0; h < s.KVH; ++h) {
      const int64_t at = (((hp * s.layers + layer) * s.KVH + h) * ps + off) * D;
      const T* kr = kn + r * k_new.stride(0) + h * D;
      std::memcpy(hk + at, kr, D * sizeof(T));
      std::memcpy(hv + at, vn + r * v_new.stride(0) + h * D, D * sizeof(T));
      float* lo = sm + ((hp * s.layers + layer) * s.KVH + h) * 2 * D;
      float* hi = lo + D;
      for (int64_t d = 0; d < D; ++d) {
        const float x = to_f(kr[d]);
        lo[d] = off == 0 ? x : std::min(lo[d], x);
        hi[d] = off == 0 ? x : std::max(hi[d], x);
      }
    }
  }
}

// A page's Quest bound for one KV head: the largest over its G query heads of sum_d (qn_d lo_d + qp_d hi_d)
// (qn = min(q, 0), qp = max(q, 0)). kLanes independent sums, added at the end: the loop vectorizes
// without reassociating a float sum (the build has -ffp-contract=off and no -ffast-math), on AVX-512
// where the CPU has it (a clone chosen at load).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "default")))
#endif
float quest_bound(const float* qn, const float* qp, const float* lo, const float* hi, int64_t G, int64_t D) {
  constexpr int kLanes = 16;
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    const float* a = qn + g * D;
    const float* b = qp + g * D;
    float lane[kLanes] = {};
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      for (int j = 0; j < kLanes; ++j) lane[j] += a[d + j] * lo[d + j] + b[d + j] * hi[d + j];
    }
    for (; d < D; ++d) lane[0] += a[d] * lo[d] + b[d] * hi[d];
    float acc = 0.f;
    for (int j = 0; j < kLanes; ++j) acc += lane[j];
    best = std::max(best, acc);
  }
  return best;
}

// Row r, KV head h: the chosen pages (sequence page numbers, ascending) into `out` (count entries).
template <typename T>
void choose(const Shape& s, const T* qr, const float* sm, int64_t layer, const int64_t* pages, int64_t n_pages,
            int64_t sink, int64_t recent, int64_t top_k, int64_t h, int64_t* out) {
  const int64_t cur = n_pages - 1, count = chosen_count(n_pages, sink, recent, top_k);
  if (count == cur) {
    for (int64_t p = 0; p < cur; ++p) out[p] = p;
    return;
  }
  const int64_t D = s.D, G = s.G, lo = sink, hi = n_pages - recent;
  // max(q lo, q hi) = min(q, 0) lo + max(q, 0) hi: each query head's bound as two dot products.
  std::vector<float> qn(static_cast<size_t>(G * D)), qp(static_cast<size_t>(G * D));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) {
      const float x = to_f(qr[(h * G + g) * D + d]);
      qn[g * D + d] = std::min(x, 0.f);
      qp[g * D + d] = std::max(x, 0.f);
    }
  }
  std::vector<std::pair<float, int64_t>> sc(static_cast<size_t>(hi - lo));
  for (int64_t p = lo; p < hi; ++p) {
    const float* mn = sm + ((pages[p] * s.layers + layer) * s.KVH + h) * 2 * D;
    const float* mx = mn + D;
    const float best = quest_bound(qn.data(), qp.data(), mn, mx, G, D);
    sc[p - lo] = {best, p};
  }
  // The top_k largest (ties: the lower page), then ascending by page.
  auto better = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  };
  std::nth_element(sc.begin(), sc.begin() + (top_k - 1), sc.end(), better);
  int64_t i = 0;
  for (int64_t p = 0; p < sink; ++p) out[i++] = p;
  std::vector<int64_t> top(static_cast<size_t>(top_k));
  for (int64_t j = 0; j < top_k; ++j) top[j] = sc[j].second;
  std::sort(top.begin(), top.end());
  for (int64_t j = 0; j < top_k; ++j) out[i++] = top[j];
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
  const int64_t ps = s.ps, stride_page = s.layers * s.KVH * ps;
  int64_t P = 1;
  std::vector<int64_t> count(static_cast<size_t>(s.R));
  for (int64_t r = 0; r < s.R; ++r) {
    count[r] = chosen_count((lp[r] - 1) / ps + 1, sink, recent, top_k);
    P = std::max(P, count[r] + 1);
  }
  auto table = at::empty({s.R, s.KVH * P * ps}, at::kLong);
  auto counts = at::empty({s.R}, at::kLong);
  int64_t* out = table.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  const float* sm = summary.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    write_and_summarize<T>(s, k_new, v_new, host_k, host_v, summary, layer, tp, lp);
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    kvl::parallel_for(0, s.R * s.KVH, 1, [&](int64_t i0, int64_t i1) {
      std::vector<int64_t> pages(static_cast<size_t>(P));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / s.KVH, h = i % s.KVH, n_pages = (lp[r] - 1) / ps + 1;
        const int64_t* hpages = tp + r * s.W;
        choose<T>(s, qp + r * s.H * s.D, sm, layer, hpages, n_pages, sink, recent, top_k, h, pages.data());
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
