// The one-call decode of every layer (decode_step.cpp) and the layer description it interprets. A
// family opts in by describing its layers (kvledger/model/decode_desc.py builds the description),
// not by a kernel of its own.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace kvl {

// Norm kinds. kNormRms: w * T(x * rsqrt(mean(x^2) + eps)), w in the model's dtype (Llama, Qwen, Mistral).
// kNormGemma: T(x * rsqrt(mean(x^2) + eps) * w) in float32, w = 1 + the checkpoint's weight held in float32
// (Gemma 2/3; kvledger's RMSNorm(gemma=True) keeps that form).
enum NormKind : int64_t { kNormRms = 0, kNormGemma = 1 };
// The gated MLP's activation: silu(g) * u (SwiGLU) or gelu_tanh(g) * u (GeGLU, Gemma).
enum ActKind : int64_t { kActSilu = 0, kActGeluTanh = 1 };

// q/k norms: none, per head (Qwen3, Gemma 3), or over the whole q and the whole k projection (OLMo 2).
enum QkNorm : int64_t { kQkNone = 0, kQkHead = 1, kQkFull = 2 };

// One layer, as data. Per layer l the step runs
//   x = norm_in(h) where pre_norms, else h             (fused with the previous layer's residual add)
//   q, k, v = W_qkv x; q, k = qk_norm(q), qk_norm(k)  (per head or whole, where qk_norm)
//   q, k = rotary(q, k) with table `rope`; o = attention over the last `window` keys (0: all)
//   a = W_o o; a = norm_post_attn(a) where post_norms; h += a; x = norm_pre_ffn(h) where pre_norms, else h
//   d = W_down act(W_gate_up x); d = norm_post_ffn(d) where post_norms; h += d
// Every norm of a layer is of kind `norm`. Llama: pre norms only; Gemma 2/3: both ("sandwich");
// OLMo 2: post norms only. Serialized as kFields int64 a layer, in this order.
struct LayerDesc {
  int64_t norm = kNormRms;
  bool post_norms = false;
  int64_t qk_norm = kQkNone;
  int64_t act = kActSilu;
  int64_t rope = 0;    // index into the step's cos/sin tables (Gemma 3: local and global layers differ)
  int64_t window = 0;  // sliding window in keys; 0: every key of the sequence
  bool pre_norms = true;
  static constexpr int kFields = 7;
  static LayerDesc from(const int64_t* p) {
    return LayerDesc{p[0], p[1] != 0, p[2], p[3], p[4], p[5], p[6] != 0};
  }
};
// The norm weights of a layer: kNorms entries a layer in the step's `norms` list, in this order
// (None where the layer has no such norm).
enum NormSlot : int64_t { kInNorm = 0, kPostAttnNorm, kPreFfnNorm, kPostFfnNorm, kQNorm, kKNorm, kNorms };

// ops.cpp's ops, called directly by the step (the same functions as their torch ops).
at::Tensor op_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor op_add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor op_silu_mul(const at::Tensor& gu);
void op_rope(at::Tensor& x, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor op_decode_attention(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& table,
                               const at::Tensor& rows, const at::Tensor& lens, double scale, const at::Tensor& k_new,
                               const at::Tensor& v_new, const at::Tensor& out_loc, int64_t window);
// Each KV head reads its own run of a table row (h's tokens from h * head_stride): HiSparse (hisparse.cpp).
at::Tensor op_decode_attention_heads(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& table, const at::Tensor& rows, const at::Tensor& lens,
                                     double scale, int64_t head_stride);
at::Tensor op_quant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& wsum128, int64_t bits, int64_t n, int64_t amx_rows);
// A GGUF file's blocks of GGML type `kind` read as stored; `segments` (may be empty) lists the parts'
// kinds and rows where a fused projection stacks several kinds (kernels/quant.py's GgufWeight).
at::Tensor op_gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n,
                          const at::Tensor& segments);
at::Tensor op_int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& woff);
at::Tensor op_dense_linear(const at::Tensor& x, const at::Tensor& w);

// kvledger_cpu::decode_layers (schema in ops.cpp).
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
                   at::IntArrayRef sp_params);

// kvledger_cpu::hisparse_attention (hisparse.cpp): every HiSparse row of one layer, its pages chosen and
// read in place in the host pool; top_k < 0: every page (a dense layer).
at::Tensor hisparse_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                              at::Tensor& host_k, at::Tensor& host_v, at::Tensor& summary, int64_t layer,
                              const at::Tensor& host_table, const at::Tensor& lens, int64_t sink, int64_t recent,
                              int64_t top_k, double scale);

// kvledger_cpu::kind_norm / add_kind_norm / kind_head_norm_ / gated_act (decode_step.cpp): the step's norms
// of a NormKind (add_kind_norm: h += delta first, in place) and its gated activation, for eager forwards.
at::Tensor kind_norm(const at::Tensor& x, const at::Tensor& w, int64_t kind, double eps);
at::Tensor add_kind_norm(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, int64_t kind, double eps);
void kind_head_norm_(at::Tensor& qkv, int64_t col, int64_t heads, int64_t hd, const at::Tensor& w, int64_t kind,
                     double eps);
at::Tensor gated_act(const at::Tensor& gu, int64_t act);
// kvledger_cpu::store_kv_: new tokens' K/V [tokens, kv_heads, head_dim] into the pool at out_loc (the
// pool's dtype; a copy over the pool's threads, in place of an ATen index write).
void store_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& out_loc);

// kvledger_cpu::head_argmax (decode_step.cpp): a packed LM head's greedy token per row, in chunks.
at::Tensor head_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& wsum128, int64_t bits, int64_t n, int64_t valid);

}  // namespace kvl
