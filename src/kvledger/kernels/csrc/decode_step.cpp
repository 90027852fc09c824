// kvledger_cpu::decode_layers: every layer of a batch of decodes in one call, each layer run as its
// description says (decode_step.h: norm kind and places, q/k norms, activation, rotary table, window).
// The Python loop spent ~1 ms a token on calls around the kernels; here nothing runs between them but
// C++. A Llama-shape description runs exactly the ops of the Llama family's fused eager forward in its
// order (the same logits bit for bit); the parts only other families use (Gemma's norms, GeGLU, q/k
// norms) are the loops below, in the float32 order of their torch reference (model/layers/norm.py).
#include "decode_step.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gguf_blocks.h"
#include "kernels.h"
#include "pool.h"

namespace kvl {
namespace {

// One row's inverse RMS: rsqrt(mean(x^2) + eps), the sum in float32 in index order.
template <typename T> float inv_rms(const T* x, int dim, float eps) {
  float ss = 0.f;
  for (int i = 0; i < dim; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  return 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
}

// out = norm(x) of `kind` over rows of dim values (x and out may be the same rows: in place).
// kNormRms: w (of T) * T(x * r), as transformers' Llama; kNormGemma: T(x * r * w) in float32, w float32.
template <typename T>
void norm_rows(const T* x, long xs, T* out, long os, const at::Tensor& w, int64_t kind, int dim, float eps, long rows) {
  for (long r = 0; r < rows; ++r) {
    const T* xr = x + r * xs;
    T* o = out + r * os;
    const float inv = inv_rms(xr, dim, eps);
    if (kind == kNormGemma) {
      const float* wp = w.data_ptr<float>();
      for (int i = 0; i < dim; ++i) o[i] = from_f<T>(to_f(xr[i]) * inv * wp[i]);
    } else {
      const T* wp = reinterpret_cast<const T*>(w.data_ptr());
      for (int i = 0; i < dim; ++i) o[i] = from_f<T>(to_f(wp[i]) * round_t<T>(to_f(xr[i]) * inv));
    }
  }
}

template <typename F> void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) f(bf16{});
  else f(float{});
}

void check_norm(const at::Tensor& w, int64_t kind, int64_t dim, const at::Tensor& like, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == dim, what, " norm must be [", dim, "] contiguous");
  TORCH_CHECK(kind == kNormGemma ? w.scalar_type() == at::kFloat : w.scalar_type() == like.scalar_type(), what,
              " norm: Gemma's weights (1 + w) are float32, RMS norms' of the model's dtype");
}

// Rows a chunk of the pool's work in the norms below (each row alone: the same bits on any thread).
constexpr int64_t kNormGrain = 32;

// A new [rows, dim] tensor: the norm of x's rows.
at::Tensor norm_of(const at::Tensor& x, const at::Tensor& w, int64_t kind, double eps) {
  if (kind == kNormRms) return op_rms_norm(x, w, eps);
  auto out = at::empty_like(x);
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    const long xs = x.stride(0), os = out.stride(0);
    kvl::parallel_for(0, x.size(0), kNormGrain, [&](int64_t r0, int64_t r1) {
      norm_rows<T>(xp + r0 * xs, xs, op + r0 * os, os, w, kind, static_cast<int>(x.size(1)), static_cast<float>(eps),
                   r1 - r0);
    });
  });
  return out;
}

// h += delta (rounded to the model's dtype, as the eager forward's addition), then the norm of h: one pass
// over the pool's threads (each row's sum, rounding and norm alone: the bits of h.add_ then norm_of).
at::Tensor add_norm(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, int64_t kind, double eps) {
  if (kind == kNormRms) return op_add_rms_norm(h, delta, w, eps);
  if (!h.is_contiguous() || !delta.is_contiguous() || delta.scalar_type() != h.scalar_type()) {
    h.add_(delta);
    return norm_of(h, w, kind, eps);
  }
  auto out = at::empty_like(h);
  const int64_t dim = h.size(1);
  by_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    T* hp = reinterpret_cast<T*>(h.data_ptr());
    const T* dp = reinterpret_cast<const T*>(delta.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    kvl::parallel_for(0, h.size(0), kNormGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * dim; i < r1 * dim; ++i) hp[i] = from_f<T>(to_f(hp[i]) + to_f(dp[i]));
      norm_rows<T>(hp + r0 * dim, dim, op + r0 * dim, dim, w, kind, static_cast<int>(dim), static_cast<float>(eps),
                   r1 - r0);
    });
  });
  return out;
}

// In place on each of `heads` heads of hd values at column `col` of every row of the fused QKV rows.
void head_norm_(at::Tensor& qkv, int64_t col, int64_t heads, int64_t hd, const at::Tensor& w, int64_t kind,
                double eps) {
  by_dtype(qkv, [&](auto tag) {
    using T = decltype(tag);
    T* base = reinterpret_cast<T*>(qkv.data_ptr()) + col;
    kvl::parallel_for(0, qkv.size(0), kNormGrain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        T* row = base + b * qkv.stride(0);
        norm_rows<T>(row, hd, row, hd, w, kind, static_cast<int>(hd), static_cast<float>(eps), heads);
      }
    });
  });
}

// act(g) * u of rows [g (dim) | u (dim)]: SiLU in the kernel, GELU (tanh form) in ATen's own op, the
// product rounded to the model's dtype as the eager forward's.
// Blocks of rows go over the pool, each of fewer than ATen's grain (32,768 elements) so that ATen's ops
// run inline on the pool's thread (no OpenMP region): the same elementwise bits as one call.
at::Tensor gated(const at::Tensor& gu, int64_t act) {
  if (act == kActSilu) return op_silu_mul(gu);
  const int64_t dim = gu.size(1) / 2;
  const int64_t rows = gu.size(0), block = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  if (rows <= block) return at::gelu(gu.narrow(1, 0, dim), "tanh").mul_(gu.narrow(1, dim, dim)).contiguous();
  auto out = at::empty({rows, dim}, gu.options());
  kvl::parallel_for(0, (rows + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    c10::InferenceMode guard;  // the pool's threads: writes into the caller's inference tensors
    const int64_t r0 = b0 * block, r1 = std::min(rows, b1 * block);
    const at::Tensor g = gu.narrow(0, r0, r1 - r0);
    at::Tensor o = out.narrow(0, r0, r1 - r0);
    at::gelu_out(o, g.narrow(1, 0, dim), "tanh");
    o.mul_(g.narrow(1, dim, dim));
  });
  return out;
}

}  // namespace

// The step's norms and gated activation as ops of their own, for the families' eager prefill (Gemma's
// float32 (1 + w) norms: the same functions, so a prompt's rows take the decode step's bits).
at::Tensor kind_norm(const at::Tensor& x, const at::Tensor& w, int64_t kind, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with unit stride");
  check_norm(w, kind, x.size(1), x, "the");
  return norm_of(x, w, kind, eps);
}

at::Tensor add_kind_norm(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, int64_t kind, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && delta.sizes() == h.sizes(), "h must be [rows, dim] contiguous, delta its shape");
  check_norm(w, kind, h.size(1), h, "the");
  return add_norm(h, delta, w, kind, eps);
}

void kind_head_norm_(at::Tensor& qkv, int64_t col, int64_t heads, int64_t hd, const at::Tensor& w, int64_t kind,
                     double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && col >= 0 && col + heads * hd <= qkv.size(1),
              "qkv must be [rows, features] with unit stride, the heads inside its rows");
  check_norm(w, kind, hd, qkv, "the head");
  head_norm_(qkv, col, heads, hd, w, kind, eps);
}

at::Tensor gated_act(const at::Tensor& gu, int64_t act) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gu must be [rows, 2 * dim]");
  return gated(gu, act);
}

void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& out_loc) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.stride(2) == 1 &&
                  k_cache.stride(1) == k_cache.size(2) && v_cache.stride(2) == 1 && v_cache.stride(1) == v_cache.size(2),
              "k_cache/v_cache must be [kv_heads, locations, head_dim], rows contiguous");
  const int64_t KVH = k_cache.size(0), L = k_cache.size(1), D = k_cache.size(2), T = out_loc.numel();
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == KVH && t->size(2) == D && t->stride(2) == 1 &&
                    t->stride(1) == D && t->scalar_type() == k_cache.scalar_type() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "k/v must be [tokens, kv_heads, head_dim] (heads contiguous) of the cache's dtype");
  }
  TORCH_CHECK(out_loc.scalar_type() == at::kLong && out_loc.is_contiguous(), "out_loc must be int64 [tokens]");
  const int64_t* lp = out_loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(lp[t] >= 0 && lp[t] < L, "out_loc ", lp[t], " outside the pool");
  const int64_t bytes = D * static_cast<int64_t>(k.element_size());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  const int64_t kcs = k_cache.stride(0) * k.element_size(), vcs = v_cache.stride(0) * k.element_size();
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * k.element_size();
  kvl::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < KVH; ++h) {
        std::memcpy(kc + h * kcs + lp[t] * bytes, kp + t * ks + h * bytes, bytes);
        std::memcpy(vc + h * vcs + lp[t] * bytes, vp + t * vs + h * bytes, bytes);
      }
    }
  });
}

void decode_layers(at::Tensor& h, at::TensorList w, at::TensorList scales,
                   const c10::List<std::optional<at::Tensor>>& wsum, at::IntArrayRef bits, at::IntArrayRef n,
                   at::TensorList dense, const c10::List<std::optional<at::Tensor>>& norms, at::IntArrayRef desc,
                   at::Tensor& k_all, at::Tensor& v_all, const at::Tensor& positions, at::TensorList cos,
                   at::TensorList sin, const at::Tensor& table, const at::Tensor& rows, const at::Tensor& lens,
                   const at::Tensor& out_loc, int64_t heads, double scale, double eps, int64_t amx_rows,
                   at::TensorList w8, at::TensorList w8_scale, at::TensorList w8_off, int64_t int8_rows,
                   const c10::optional<at::Tensor>& sp_host_k, const c10::optional<at::Tensor>& sp_host_v,
                   const c10::optional<at::Tensor>& sp_summary, const c10::optional<at::Tensor>& sp_idx,
                   const c10::optional<at::Tensor>& sp_host_table, const c10::optional<at::Tensor>& sp_lens,
                   at::IntArrayRef sp_params) {
  const int64_t layers = static_cast<int64_t>(desc.size()) / LayerDesc::kFields;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(desc.size()) == layers * LayerDesc::kFields,
              "desc: ", LayerDesc::kFields, " values a layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == kNorms * layers, "norms: ", kNorms, " entries a layer");
  // The projections: packed (w, scales, wsum, bits, n), or dense weights of the model's dtype (`dense`,
  // deterministic inference's float32/bf16 layers, on the dense kernel).
  const int64_t nproj = static_cast<int64_t>(dense.empty() ? w.size() : dense.size());
  TORCH_CHECK(nproj == 4 * layers, "four projections a layer: qkv, o, gate_up, down");
  TORCH_CHECK(!dense.empty() || (scales.size() == w.size() && wsum.size() == w.size() && bits.size() == w.size() &&
                                 n.size() == w.size()),
              "packed projections need their scales, sums, bits and widths");
  TORCH_CHECK(k_all.dim() == 4 && k_all.size(0) == layers && v_all.sizes() == k_all.sizes(),
              "k/v pools must be [layers, kv_heads, locations, head_dim]");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be [batch, hidden] contiguous");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "one sin table per cos table");
  const int64_t B = h.size(0), kvh = k_all.size(1), hd = k_all.size(3);
  const int64_t qs = heads * hd, kvs = kvh * hd;
  std::vector<LayerDesc> L;
  for (int64_t l = 0; l < layers; ++l) {
    const LayerDesc d = LayerDesc::from(desc.data() + l * LayerDesc::kFields);
    TORCH_CHECK((d.norm == kNormRms || d.norm == kNormGemma) && (d.act == kActSilu || d.act == kActGeluTanh) &&
                    d.qk_norm >= kQkNone && d.qk_norm <= kQkFull && d.rope >= 0 &&
                    d.rope < static_cast<int64_t>(cos.size()) && d.window >= 0,
                "layer ", l, ": a description out of range");
    auto has = [&](int64_t slot) { return norms.get(kNorms * l + slot).has_value(); };
    const bool qk = d.qk_norm != kQkNone;
    TORCH_CHECK(has(kInNorm) == d.pre_norms && has(kPreFfnNorm) == d.pre_norms && has(kPostAttnNorm) == d.post_norms &&
                    has(kPostFfnNorm) == d.post_norms && has(kQNorm) == qk && has(kKNorm) == qk,
                "layer ", l, ": its norms do not match its description");
    for (int64_t slot : {kInNorm, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm}) {
      if (has(slot)) check_norm(*norms.get(kNorms * l + slot), d.norm, h.size(1), h, "layer");
    }
    if (qk) {
      const bool full = d.qk_norm == kQkFull;
      check_norm(*norms.get(kNorms * l + kQNorm), d.norm, full ? qs : hd, h, "q");
      check_norm(*norms.get(kNorms * l + kKNorm), d.norm, full ? kvs : hd, h, "k");
    }
    L.push_back(d);
  }
  auto norm_w = [&](int64_t l, int64_t slot) { return *norms.get(kNorms * l + slot); };
  // From int8_rows decodes (> 0) every projection takes its int8 copy (--enable-int8-batch's, VNNI layout):
  // at 32 rows the 120 projections take ~10% less time than on the int4 groups (bench/RESULTS.md).
  const bool int8 = int8_rows > 0 && B >= int8_rows;
  TORCH_CHECK(int8_rows <= 0 || (w8.size() == w.size() && w8_scale.size() == w.size() && w8_off.size() == w.size()),
              "int8_rows needs an int8 copy of every projection");
  // Every projection of the step goes through here: projection j of layer l is 4l + {0: qkv, 1: o,
  // 2: gate_up, 3: down}.
  auto proj = [&](const at::Tensor& x, int64_t j) {
    if (!dense.empty()) return op_dense_linear(x, dense[j]);
    // bits < 0: a GGUF file's blocks of GGML type -bits read as stored (scales[j]: its segments)
    if (bits[j] < 0) return op_gguf_linear(x, w[j], -bits[j], n[j], scales[j]);
    if (int8) return op_int8_linear(x, w8[j], w8_scale[j], w8_off[j]);
    return op_quant_linear(x, w[j], scales[j], wsum.get(j), bits[j], n[j], amx_rows);
  };
  // h += delta, then the next block's input: its pre norm of h, or h itself (OLMo 2: no pre norms; the
  // projections read it before the next add).
  auto add_next = [&](const at::Tensor& delta, const LayerDesc& next, int64_t l_next, int64_t slot) -> at::Tensor {
    if (next.pre_norms) return add_norm(h, delta, norm_w(l_next, slot), next.norm, eps);
    h.add_(delta);
    return h;
  };
  // HiSparse rows (sp_idx: their batch rows; sp_params: sink, recent, top_k, dense layers): each layer's
  // attention reads their pages in place in the host pool (hisparse.cpp); the other rows as always.
  const bool sparse = sp_idx.has_value();
  at::Tensor dn_idx, dn_rows, dn_lens, dn_loc;
  bool all_sparse = false;
  if (sparse) {
    TORCH_CHECK(sp_host_k && sp_host_v && sp_summary && sp_host_table && sp_lens && sp_params.size() == 4,
                "HiSparse rows need the host pool, its summaries, their host pages, lengths and 4 parameters");
    TORCH_CHECK(sp_idx->scalar_type() == at::kLong && sp_idx->dim() == 1 && sp_idx->numel() <= B,
                "sp_idx must be int64 [sparse rows]");
    all_sparse = sp_idx->numel() == B;
    if (!all_sparse) {
      auto keep = at::ones({B}, at::kBool);
      keep.index_fill_(0, *sp_idx, false);
      dn_idx = keep.nonzero().view({-1});
      dn_rows = rows.index_select(0, dn_idx);
      dn_lens = lens.index_select(0, dn_idx);
      dn_loc = out_loc.index_select(0, dn_idx);
    }
  }
  auto attend = [&](int64_t l, const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& kc,
                    at::Tensor& vc, int64_t window) -> at::Tensor {
    if (!sparse) return op_decode_attention(q, kc, vc, table, rows, lens, scale, k_new, v_new, out_loc, window);
    at::Tensor& hk = const_cast<at::Tensor&>(*sp_host_k);
    at::Tensor& hv = const_cast<at::Tensor&>(*sp_host_v);
    at::Tensor& sm = const_cast<at::Tensor&>(*sp_summary);
    const int64_t top_k = l < sp_params[3] ? -1 : sp_params[2];
    auto sp_out = [&](const at::Tensor& qs, const at::Tensor& ks, const at::Tensor& vs) {
      return hisparse_attention(qs.contiguous(), ks, vs, hk, hv, sm, l, *sp_host_table, *sp_lens, sp_params[0],
                                sp_params[1], top_k, scale);
    };
    if (all_sparse) return sp_out(q, k_new, v_new);
    at::Tensor o = at::empty({B, q.size(1) * q.size(2)}, q.options());
    o.index_copy_(0, *sp_idx, sp_out(q.index_select(0, *sp_idx), k_new.index_select(0, *sp_idx),
                                      v_new.index_select(0, *sp_idx)));
    o.index_copy_(0, dn_idx, op_decode_attention(q.index_select(0, dn_idx), kc, vc, table, dn_rows, dn_lens, scale,
                                                 k_new.index_select(0, dn_idx), v_new.index_select(0, dn_idx),
                                                 dn_loc, window));
    return o;
  };
  at::Tensor x = L[0].pre_norms ? norm_of(h, norm_w(0, kInNorm), L[0].norm, eps) : h;
  for (int64_t l = 0; l < layers; ++l) {
    const LayerDesc& d = L[l];
    at::Tensor qkv = proj(x, 4 * l);
    TORCH_CHECK(qkv.size(1) == qs + 2 * kvs, "layer ", l, ": qkv projection of ", qkv.size(1), " features, not ",
                qs + 2 * kvs);
    if (d.qk_norm == kQkHead) {  // each head of q, then of k, before the rotary (Qwen3, Gemma 3)
      head_norm_(qkv, 0, heads, hd, norm_w(l, kQNorm), d.norm, eps);
      head_norm_(qkv, qs, kvh, hd, norm_w(l, kKNorm), d.norm, eps);
    } else if (d.qk_norm == kQkFull) {  // the whole q, then the whole k (OLMo 2)
      head_norm_(qkv, 0, 1, qs, norm_w(l, kQNorm), d.norm, eps);
      head_norm_(qkv, qs, 1, kvs, norm_w(l, kKNorm), d.norm, eps);
    }
    at::Tensor qk = qkv.narrow(1, 0, qs + kvs).view({B, heads + kvh, hd});
    op_rope(qk, positions, cos[d.rope], sin[d.rope]);
    at::Tensor q = qkv.narrow(1, 0, qs).view({B, heads, hd});
    at::Tensor k_new = qkv.narrow(1, qs, kvs).view({B, kvh, hd});
    at::Tensor v_new = qkv.narrow(1, qs + kvs, kvs).view({B, kvh, hd});
    at::Tensor kc = k_all.select(0, l), vc = v_all.select(0, l);
    at::Tensor o = attend(l, q, k_new, v_new, kc, vc, d.window);
    at::Tensor a = proj(o, 4 * l + 1);
    if (d.post_norms) a = norm_of(a, norm_w(l, kPostAttnNorm), d.norm, eps);
    x = add_next(a, d, l, kPreFfnNorm);
    at::Tensor dn = proj(gated(proj(x, 4 * l + 2), d.act), 4 * l + 3);
    if (d.post_norms) dn = norm_of(dn, norm_w(l, kPostFfnNorm), d.norm, eps);
    if (l + 1 < layers) {
      x = add_next(dn, L[l + 1], l + 1, kInNorm);
    } else {
      h.add_(dn);
    }
  }
}

// The LM head's greedy choice: argmax over j < valid of (x @ W.T)[m, j] for a packed head (quant_linear's
// layout: output rows in blocks of 16, each block's codes, scales and sums contiguous), computed over
// kHeadChunk outputs at a time so that a 262,144-token vocabulary's logits are never all held. Each
// chunk is quant_linear over that block range (the same activations' codes, each output's sum as in the
// whole call): the same values as the head's logits, and the first of equal maxima, as the sampler's
// ``max(dim).indices``.
at::Tensor head_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& wsum128, int64_t bits, int64_t n, int64_t valid) {
  constexpr int64_t kHeadChunk = 4096;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [rows, in_features] contiguous");
  // bits 4 / 8: kernels/quant.py's packed layout; bits < 0: a GGUF file's blocks of GGML type -bits
  // as stored, one kind (a head the file keeps in Q6_K, as Q4_K_M files do)
  const bool gguf = bits < 0;
  TORCH_CHECK(bits == 4 || bits == 8 || (gguf && scales.numel() == 0), "bits must be 4, 8, or a GGUF kind's -type");
  TORCH_CHECK(valid > 0 && valid <= n && (gguf || n % 16 == 0), "valid outputs must be in (0, n], n a multiple of 16");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  GgufFormat f{};
  const int kind = static_cast<int>(-bits), fkind = gguf_is_packed(kind) ? kind - kGgufPacked : kind;
  TORCH_CHECK(!gguf || (gguf_format(fkind, &f) && K % f.block == 0), "GGML type ", -bits,
              " is not read here, or ", K, " inputs are not whole blocks");
  TORCH_CHECK(gguf || (K % 32 == 0 && w.is_contiguous() && scales.is_contiguous() &&
                       w.numel() * (bits == 4 ? 2 : 1) == n * K),
              "packed weights do not match [", n, ", ", K, "]");
  TORCH_CHECK(!gguf || (w.is_contiguous() && w.numel() == gguf_rows_bytes(kind, n, K)), "GGUF blocks do not match [",
              n, ", ", K, "]");
  // bytes a row (a repacked kind's per row of its groups of 16: kHeadChunk is whole groups)
  const int64_t w_row = gguf ? gguf_rows_bytes(kind, kGgufGroup, K) / kGgufGroup : (bits == 4 ? K / 2 : K),
                s_row = G * (bits == 4 ? 2 : 1);
  const at::Tensor wf = w.view({-1}), sf = scales.view({-1});
  c10::optional<at::Tensor> zf;
  if (wsum128) zf = wsum128->view({-1});
  // outputs [c0, c0 + c) for every row: the head's own kernel on that slice of its rows
  auto logits = [&](int64_t c0, int64_t c) {
    const int64_t cb = gguf ? gguf_rows_bytes(kind, c, K) : c * w_row;  // the last chunk's group padded
    const at::Tensor wc = wf.narrow(0, c0 * w_row, cb);
    if (gguf) return op_gguf_linear(x, wc, -bits, c, scales);
    c10::optional<at::Tensor> z;
    if (zf) z = zf->narrow(0, c0 * G, c * G);
    return op_quant_linear(x, wc, sf.narrow(0, c0 * s_row, c * s_row), z, bits, c, 0);
  };
  std::vector<float> best(static_cast<size_t>(M), -std::numeric_limits<float>::infinity());
  auto idx = at::zeros({M}, at::kLong);
  int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t c0 = 0; c0 < valid; c0 += kHeadChunk) {
    const int64_t c = std::min(kHeadChunk, n - c0), use = std::min(c, valid - c0);
    const at::Tensor y = logits(c0, c);
    by_dtype(y, [&](auto tag) {
      using T = decltype(tag);
      const T* yp = reinterpret_cast<const T*>(y.data_ptr());
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < use; ++j) {
          const float v = to_f(yp[m * c + j]);
          if (v > best[m]) best[m] = v, ip[m] = c0 + j;
        }
      }
    });
  }
  return idx;
}

}  // namespace kvl
