// The torch side of kvledger's CPU kernels: argument checks, the split over threads
// (kvl::parallel_for on the engine's own pool, pool.h: chunks claimed dynamically, no fork/join
// barrier that waits for a descheduled thread), the ISA choice at run time, and the registration as
// torch ops (namespace kvledger_cpu; their fake implementations are in kernels/__init__.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "decode_step.h"
#include "flash.h"
#include "gguf_blocks.h"
#include "kernels.h"
#include "pool.h"
#include "qlinear.h"

namespace kvl {
namespace {

bool cpu_has_avx512() {
  const char* force = std::getenv("KVLEDGER_CPU_ISA");
  if (force && std::strcmp(force, "scalar") == 0) return false;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const bool kAvx512 = cpu_has_avx512();
const bool kVnni = kAvx512 && __builtin_cpu_supports("avx512vnni");
const bool kBf16Dot = kAvx512 && __builtin_cpu_supports("avx512bf16");
const bool kAmx = kBf16Dot && amx_ready();  // AMX-BF16 tiles granted to this process
// flash_attention_ on AMX tiles where kAmx (set_flash_amx turns it off: tests compare both kernels).
bool flash_amx_enabled = true;
// extend_attention_ in tiles (run_extend_tiles) where it applies (set_tiled_extend turns it off: tests
// compare both forms bit for bit).
bool tiled_extend_enabled = true;

template <typename T> const Kernels<T>& portable();
template <> const Kernels<float>& portable<float>() { static const auto k = scalar_f32(); return k; }
template <> const Kernels<bf16>& portable<bf16>() { static const auto k = scalar_bf16(); return k; }
template <typename T> const Kernels<T>& wide();
#if defined(__x86_64__) || defined(_M_X64)
template <> const Kernels<float>& wide<float>() { static const auto k = avx512_f32(); return k; }
template <> const Kernels<bf16>& wide<bf16>() { static const auto k = avx512_bf16(); return k; }
#else
template <> const Kernels<float>& wide<float>() { return portable<float>(); }
template <> const Kernels<bf16>& wide<bf16>() { return portable<bf16>(); }
#endif

// The AVX-512 kernels take dims that are whole registers of 16 floats.
template <typename T> const Kernels<T>& pick(int dim) {
  return (kAvx512 && dim % 16 == 0) ? wide<T>() : portable<T>();
}

template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

template <typename F> void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) f(bf16{});
  else f(float{});
}

// n elements left uninitialized: scratch every element of which a kernel writes before any is read.
// (std::vector<T>(n) zeroes them first: on a 32-decode step a memset per call of up to ~80 KB, on the
// calling thread while the others wait.)
template <typename T> std::unique_ptr<T[]> scratch_of(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
}

// Rows per task: about 16K elements, so that one-row (decode) calls stay on the calling thread.
int64_t grain(int64_t dim) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)); }

at::Tensor norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& res, const at::Tensor& w, double eps) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "w must be [dim] contiguous, of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int dim = static_cast<int>(x.size(1));
  if (res) {
    TORCH_CHECK(res->sizes() == x.sizes() && res->stride(1) == 1 && res->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const auto& k = pick<T>(dim);
    T* rp = res ? ptr<T>(*res) : nullptr;
    long rs = res ? res->stride(0) : 0;
    kvl::parallel_for(0, x.size(0), grain(dim), [&](int64_t r0, int64_t r1) {
      k.rms_norm(ptr<T>(x), x.stride(0), rp, rs, ptr<T>(w), ptr<T>(out), out.stride(0), dim, static_cast<float>(eps), r0, r1);
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return norm_impl(x, c10::nullopt, w, eps); }

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps) {
  return norm_impl(x, residual, w, eps);
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_float(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "gu must be [rows, 2*dim], rows contiguous");
  const int dim = static_cast<int>(gu.size(1) / 2);
  auto out = at::empty({gu.size(0), dim}, gu.options());
  by_dtype(gu, [&](auto tag) {
    using T = decltype(tag);
    const auto& k = pick<T>(dim);
    kvl::parallel_for(0, gu.size(0), grain(dim), [&](int64_t r0, int64_t r1) {
      k.silu_mul(ptr<T>(gu), gu.stride(0), ptr<T>(out), out.stride(0), dim, r0, r1);
    });
  });
  return out;
}

void rope_(at::Tensor& x, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x must be [tokens, heads, head_dim] with contiguous heads");
  const int hd = static_cast<int>(x.size(2));
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd / 2 &&
                  cos.sizes() == sin.sizes() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin must be [positions, head_dim/2] contiguous, of x's dtype");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.numel() == x.size(0),
              "positions must be int64 [tokens]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cos.size(0), "position ", pp[i], " outside the rotary table");
  }
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const auto& k = pick<T>(hd / 2);
    kvl::parallel_for(0, x.size(0), grain(x.size(1) * hd), [&](int64_t r0, int64_t r1) {
      k.rope(ptr<T>(x), x.stride(0), static_cast<int>(x.size(1)), hd, pp, ptr<T>(cos), ptr<T>(sin), r0, r1);
    });
  });
}

// The attention kernels' one order of sums per query row (flash.h): a row's keys in chunks of kKeyChunk
// from position 0, each chunk's softmax partial computed alone, the chunks folded in key order. The
// partial of a chunk is the bf16 flash form's (flash_chunk: vdpbf16ps, probabilities rounded to bf16)
// where flash_attention_ runs (bf16, AVX512-BF16, head_dim a multiple of 64), the float form's
// (Kernels::attend over the chunk's keys) elsewhere: each machine and model has one.
bool flash_form(const at::Tensor& q, int64_t D) {
  return kBf16Dot && q.scalar_type() == at::kBFloat16 && D % 64 == 0;
}

// Chunk c's partial (m[G], l[G], o[G * D]) of the G query rows at qp (rows D apart: one KV head's
// query heads of one token) over the first n keys at locs of cache rows kc, vc (element type C).
template <typename T, typename C, typename A>
inline void chunk_partial(bool flash, A attend, const T* qp, const C* kc, const C* vc, const int64_t* locs, int64_t n,
                          int64_t c, int G, int D, float scale, float* pm) {
  const int64_t c0 = c * kKeyChunk;
  float *m = pm, *l = pm + G, *o = pm + 2 * G;
  if constexpr (std::is_same_v<T, bf16>) {
    if (flash) {
      for (int g0 = 0; g0 < G; g0 += kFlashRows) {
        const int nr = std::min(kFlashRows, G - g0);
        const bf16* q[kFlashRows];
        for (int i = 0; i < nr; ++i) q[i] = qp + static_cast<int64_t>(g0 + i) * D;
        flash_chunk(q, nr, kc, vc, locs, c0, n, D, scale, m + g0, l + g0, o + static_cast<int64_t>(g0) * D);
      }
      return;
    }
  }
  attend(qp, D, kc, vc, locs + c0, std::min<int64_t>(kKeyChunk, n - c0), G, D, scale, m, l, o);
}

// Work items [0, items) over `threads` contiguous ranges of about equal cost: cut[t] .. cut[t + 1].
template <typename F> std::vector<int64_t> balanced_cuts(int64_t items, int64_t threads, F cost) {
  std::vector<int64_t> cut(static_cast<size_t>(threads) + 1, items);
  int64_t total = 0;
  for (int64_t i = 0; i < items; ++i) total += cost(i);
  int64_t acc = 0, t = 1;
  cut[0] = 0;
  for (int64_t i = 0; i < items && t < threads; ++i) {
    acc += cost(i);
    while (t < threads && acc * threads >= total * t) cut[static_cast<size_t>(t++)] = i + 1;
  }
  return cut;
}

// The folded state of G query rows (one KV head's heads of one token): their chunks' partials added in
// key order (fold_chunk), then their outputs (fold_out; zeros for an empty range of keys).
struct FoldRows {
  int G, D;
  std::vector<float> M, L, O;
  FoldRows(int g, int d) : G(g), D(d), M(g), L(g), O(static_cast<size_t>(g) * d) {}
  void add(const float* pm, bool first) {
    for (int g = 0; g < G; ++g) {
      fold_chunk(M[g], L[g], O.data() + static_cast<size_t>(g) * D, pm[g], pm[G + g],
                 pm + 2 * G + static_cast<int64_t>(g) * D, D, first);
    }
  }
  template <typename T> void out(bool empty, T* o) const {
    for (int g = 0; g < G; ++g) {
      T* og = o + static_cast<int64_t>(g) * D;
      if (empty) {
        for (int d = 0; d < D; ++d) og[d] = from_f<T>(0.f);
      } else {
        fold_out(L[g], O.data() + static_cast<size_t>(g) * D, D, og);
      }
    }
  }
};

// Decode attention over the paged pool, in place: request b's query heads [B, H, D] attend over the
// tokens at req_to_token[rows[b], :lens[b]] of k_cache/v_cache [KVH, locations, D]. With k_new/v_new
// [B, KVH, D] and out_loc [B], the new tokens' K/V are first written into their pages.
// The H/KVH query heads of one KV head share each K/V read. A row's keys go in chunks of kKeyChunk
// folded in order (flash.h): the same bits as the extend kernels give that query over those keys,
// whatever the batch or the thread count. Work items are whole (request, KV head)s, folded in place,
// where there are enough of them to keep every thread busy; otherwise (a few long contexts) single
// chunks, their partials folded afterwards in the same order.
// head_stride > 0: each KV head reads its own run of the row, h's tokens from h * head_stride (HiSparse:
// the pages each KV head selected).
at::Tensor decode_attention(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& table,
                            const at::Tensor& rows, const at::Tensor& lens, double scale,
                            const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new,
                            const c10::optional<at::Tensor>& out_loc, int64_t head_stride, int64_t window) {
  check_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [batch, heads, head_dim]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const bool f8cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == D &&
                  k_cache.stride(2) == 1 && k_cache.stride(1) == D && v_cache.stride(2) == 1 && v_cache.stride(1) == D &&
                  (f8cache || k_cache.scalar_type() == q.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache/v_cache must be [kv_heads, locations, head_dim] of q's dtype or float8_e4m3fn");
  const int64_t KVH = k_cache.size(0), L = k_cache.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "heads (", H, ") must be a multiple of kv heads (", KVH, ")");
  const int G = static_cast<int>(H / KVH);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.stride(1) == 1, "req_to_token must be int64 [slots, context]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && rows.is_contiguous() &&
                  lens.is_contiguous() && rows.numel() == B && lens.numel() == B,
              "rows and lens must be int64 [batch]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lens_p = lens.data_ptr<int64_t>();
  TORCH_CHECK(head_stride >= 0 && (head_stride == 0 || head_stride * KVH <= table.size(1)),
              "head_stride ", head_stride, " does not fit ", KVH, " kv heads in a row of ", table.size(1));
  const int64_t row_len = head_stride > 0 ? head_stride : table.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rp[b] >= 0 && rp[b] < table.size(0), "row ", rp[b], " outside req_to_token");
    TORCH_CHECK(lens_p[b] >= 0 && lens_p[b] <= row_len, "length ", lens_p[b], " outside req_to_token");
  }
  // window > 0: each row attends its last `window` keys (a sliding-window layer; the query is the last
  // token), from key st[b] of its row, in chunks from there; lp: the keys each row attends.
  TORCH_CHECK(window >= 0, "window must be >= 0");
  std::vector<int64_t> st(static_cast<size_t>(B), 0), seen(lens_p, lens_p + B);
  if (window > 0) {
    for (int64_t b = 0; b < B; ++b) {
      st[b] = std::max<int64_t>(0, lens_p[b] - window);
      seen[b] = lens_p[b] - st[b];
    }
  }
  const int64_t* lp = seen.data();
  const bool write = k_new.has_value();
  if (write) {
    TORCH_CHECK(v_new && out_loc, "k_new, v_new and out_loc go together");
    for (const auto* t : {&*k_new, &*v_new}) {
      TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == KVH && t->size(2) == D && t->stride(2) == 1 &&
                      t->stride(1) == D && t->scalar_type() == q.scalar_type(),
                  "k_new/v_new must be [batch, kv_heads, head_dim] of q's dtype");
    }
    TORCH_CHECK(out_loc->scalar_type() == at::kLong && out_loc->is_contiguous() && out_loc->numel() == B,
                "out_loc must be int64 [batch]");
    const int64_t* op = out_loc->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(op[b] >= 0 && op[b] < L, "out_loc ", op[b], " outside the pool");
  }
  auto out = at::empty({B, H * D}, q.options());
  const int64_t threads = pool_threads();
  const bool flash = flash_form(q, D);
  const int64_t part = G * (D + 2);  // a chunk's partial: m[G], l[G], o[G*D]
  // Whole (request, KV head)s a thread where there are ~4 a thread: no partials kept, no second pass.
  const bool whole = B * KVH >= 4 * threads;
  std::vector<int64_t> first(static_cast<size_t>(B) + 1, 0);  // chunk items of the requests before b
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + KVH * ((lp[b] + kKeyChunk - 1) / kKeyChunk);
  const auto partial = scratch_of<float>(whole ? 0 : first[B] * part);  // each chunk item writes its own
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t ts = table.stride(0);
  by_dtype(q, [&](auto tag) {
    using T = decltype(tag);
    const auto& k = pick<T>(static_cast<int>(D));
    // C: the cache's element type (T, or float8 e4m3: written rounded, read widened).
    auto run = [&](auto ctag, auto attend) {
      using C = decltype(ctag);
      C* kc = ptr<C>(k_cache);
      C* vc = ptr<C>(v_cache);
      if (write) {
        const int64_t* op = out_loc->data_ptr<int64_t>();
        const T* kn = ptr<T>(*k_new);
        const T* vn = ptr<T>(*v_new);
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t h = 0; h < KVH; ++h) {
            C* kd = kc + h * k_cache.stride(0) + op[b] * D;
            C* vd = vc + h * v_cache.stride(0) + op[b] * D;
            if constexpr (std::is_same_v<C, f8>) {
              k.to_f8(kn + b * k_new->stride(0) + h * D, kd, D);
              k.to_f8(vn + b * v_new->stride(0) + h * D, vd, D);
            } else {
              std::memcpy(kd, kn + b * k_new->stride(0) + h * D, D * sizeof(T));
              std::memcpy(vd, vn + b * v_new->stride(0) + h * D, D * sizeof(T));
            }
          }
        }
      }
      const T* qp = ptr<T>(q);
      T* o = ptr<T>(out);
      const float sc = static_cast<float>(scale);
      // (b, h)'s query rows, keys and cache rows
      auto qrow = [&](int64_t b, int64_t h) { return qp + b * q.stride(0) + h * G * D; };
      auto locs = [&](int64_t b, int64_t h) { return tp + rp[b] * ts + h * head_stride + st[b]; };
      auto chunk = [&](int64_t b, int64_t h, int64_t c, float* pm) {
        chunk_partial(flash, attend, qrow(b, h), kc + h * k_cache.stride(0), vc + h * v_cache.stride(0), locs(b, h),
                      lp[b], c, G, static_cast<int>(D), sc, pm);
      };
      if (whole) {
        // Items to threads by their tokens, not their count: a batch's requests come oldest first, so
        // equal counts gave the first thread the longest contexts (32 decodes of 128-256 tokens: its
        // share ~17% over the mean, the other thread waiting at the barrier).
        const auto cut = balanced_cuts(B * KVH, threads, [&](int64_t i) { return lp[i / KVH] + 16; });
        kvl::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
          std::vector<float> pm(static_cast<size_t>(part));
          FoldRows rows_(G, static_cast<int>(D));
          for (int64_t i = cut[static_cast<size_t>(w0)]; i < cut[static_cast<size_t>(w1)]; ++i) {
            const int64_t b = i / KVH, h = i % KVH, chunks = (lp[b] + kKeyChunk - 1) / kKeyChunk;
            for (int64_t c = 0; c < chunks; ++c) {
              chunk(b, h, c, pm.data());
              rows_.add(pm.data(), c == 0);
            }
            rows_.out(chunks == 0, o + b * H * D + h * G * D);
          }
        });
        return;
      }
      // Chunk items (request, KV head, chunk), by their keys; then each (request, KV head) folds its own.
      const int64_t items = first[B];
      auto item = [&](int64_t i, int64_t& b, int64_t& h, int64_t& c) {
        b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
        const int64_t chunks = (first[b + 1] - first[b]) / KVH, j = i - first[b];
        h = j / chunks, c = j % chunks;
      };
      const auto cut = balanced_cuts(items, threads, [&](int64_t i) {
        int64_t b, h, c;
        item(i, b, h, c);
        return std::min<int64_t>(kKeyChunk, lp[b] - c * kKeyChunk) + 16;  // + a fixed part
      });
      kvl::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
        for (int64_t i = cut[static_cast<size_t>(w0)]; i < cut[static_cast<size_t>(w1)]; ++i) {
          int64_t b, h, c;
          item(i, b, h, c);
          chunk(b, h, c, partial.get() + i * part);
        }
      });
      kvl::parallel_for(0, B * KVH, 1, [&](int64_t j0, int64_t j1) {
        FoldRows rows_(G, static_cast<int>(D));
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t b = j / KVH, h = j % KVH, chunks = (first[b + 1] - first[b]) / KVH;
          const float* base = partial.get() + (first[b] + h * chunks) * part;
          for (int64_t c = 0; c < chunks; ++c) rows_.add(base + c * part, c == 0);
          rows_.out(chunks == 0, o + b * H * D + h * G * D);
        }
      });
    };
    if (f8cache) {
      run(f8{}, k.attend_f8);
    } else {
      run(T{}, k.attend);
    }
  });
  return out;
}

// A float8 e4m3 KV pool's values and the model's: x rounded into float8 (nearest even, saturating at
// +-448, as the decode kernel writes new tokens) and a float8 tensor widened to float32/bfloat16
// (exact). torch's own casts run ~2 ns an element here (one thread, scalar); these ~0.1.
// out = cast(x) over chunks of 64K elements on the threads (S, D: the element types).
template <typename S, typename D, typename Cast>
at::Tensor cast_elements(const at::Tensor& x, at::ScalarType to, Cast cast) {
  const at::Tensor xc = x.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(to));
  const S* xp = ptr<S>(xc);
  D* op = ptr<D>(out);
  kvl::parallel_for(0, x.numel(), 65536, [&](int64_t a, int64_t b) { cast(xp + a, op + a, b - a); });
  return out;
}

at::Tensor to_f8(const at::Tensor& x) {
  check_float(x, "x");
  at::Tensor out;
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    out = cast_elements<T, f8>(x, at::kFloat8_e4m3fn, pick<T>(16).to_f8);
  });
  return out;
}

at::Tensor from_f8(const at::Tensor& x, at::ScalarType dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat8_e4m3fn, "x must be a CPU float8_e4m3fn tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  if (dtype == at::kBFloat16) return cast_elements<f8, bf16>(x, dtype, pick<bf16>(16).from_f8);
  return cast_elements<f8, float>(x, dtype, pick<float>(16).from_f8);
}

// The arguments of extend_attention_ / flash_attention_, checked (shapes, dtypes, every extend inside
// q and req_to_token) and unpacked.
struct ExtendArgs {
  int64_t T, H, D, KVH, G, E;
  const int64_t *rows, *starts, *prefix, *lens, *table;
  int64_t table_stride;
};

// With `f8_ok`, the cache may also be float8 e4m3 (read widened: the per-token kernel).
ExtendArgs check_extend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& table, const at::Tensor& rows,
                        const at::Tensor& starts, const at::Tensor& prefix, const at::Tensor& lens,
                        bool f8_ok = false) {
  check_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [tokens, heads, head_dim]");
  ExtendArgs a{};
  a.T = q.size(0), a.H = q.size(1), a.D = q.size(2);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == a.T && out.size(1) == a.H * a.D && out.is_contiguous() &&
                  out.scalar_type() == q.scalar_type(),
              "out must be [tokens, heads * head_dim] contiguous, of q's dtype");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == a.D &&
                  k_cache.stride(2) == 1 && k_cache.stride(1) == a.D && v_cache.stride(2) == 1 &&
                  v_cache.stride(1) == a.D &&
                  (k_cache.scalar_type() == q.scalar_type() || (f8_ok && k_cache.scalar_type() == at::kFloat8_e4m3fn)) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              f8_ok ? "k_cache/v_cache must be [kv_heads, locations, head_dim] of q's dtype or float8_e4m3fn"
                    : "k_cache/v_cache must be [kv_heads, locations, head_dim] of q's dtype");
  a.KVH = k_cache.size(0);
  TORCH_CHECK(a.KVH > 0 && a.H % a.KVH == 0, "heads (", a.H, ") must be a multiple of kv heads (", a.KVH, ")");
  a.G = a.H / a.KVH;
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.stride(1) == 1, "req_to_token must be int64 [slots, context]");
  a.E = rows.numel();
  for (const auto* t : {&rows, &starts, &prefix, &lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == a.E, "rows, starts, prefix and lens must be int64 [extends]");
  }
  a.rows = rows.data_ptr<int64_t>(), a.starts = starts.data_ptr<int64_t>();
  a.prefix = prefix.data_ptr<int64_t>(), a.lens = lens.data_ptr<int64_t>();
  a.table = table.data_ptr<int64_t>(), a.table_stride = table.stride(0);
  for (int64_t e = 0; e < a.E; ++e) {
    TORCH_CHECK(a.rows[e] >= 0 && a.rows[e] < table.size(0), "row ", a.rows[e], " outside req_to_token");
    TORCH_CHECK(a.lens[e] >= 0 && a.prefix[e] >= 0 && a.prefix[e] + a.lens[e] <= table.size(1), "extend ", e, " outside req_to_token");
    TORCH_CHECK(a.starts[e] >= 0 && a.starts[e] + a.lens[e] <= a.T, "extend ", e, " outside q");
  }
  return a;
}

// extend_attention's work over the threads, the cache's element type C (T, or float8 read widened by
// `attend`, Kernels::attend_f8; flash_chunk widens it to bf16).
template <typename T, typename C, typename A>
void run_extend(A attend, const C* kc, const C* vc, const T* qp, T* o, const at::Tensor& q, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const ExtendArgs& a, const std::vector<int64_t>& first, double scale,
                int64_t window) {
  const int64_t H = a.H, D = a.D, KVH = a.KVH, E = a.E;
  const int G = static_cast<int>(a.G);
  const bool flash = flash_form(q, D);
  const int64_t part = G * (D + 2);
  const int64_t *rp = a.rows, *sp = a.starts, *pp = a.prefix, *tp = a.table, ts = a.table_stride;
  kvl::parallel_for(0, first[E], 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> pm(static_cast<size_t>(part));
    FoldRows rows_(G, static_cast<int>(D));
    int64_t e = std::upper_bound(first.begin(), first.end(), i0) - first.begin() - 1;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= first[e + 1]) ++e;
      const int64_t j = i - first[e], h = j % KVH, t = j / KVH;  // KV heads of one token adjacent
      const int64_t row = sp[e] + t, all = pp[e] + t + 1;  // >= 1 key: the query's own
      // A sliding window: the query sees its last `window` keys, from st, in chunks from there (as the
      // decode kernel's window: a row's bits are the decode kernel's for that query and those keys).
      const int64_t st = window > 0 ? std::max<int64_t>(0, all - window) : 0, n = all - st;
      const int64_t chunks = (n + kKeyChunk - 1) / kKeyChunk;
      const T* qr = qp + row * q.stride(0) + h * G * D;
      for (int64_t c = 0; c < chunks; ++c) {
        chunk_partial(flash, attend, qr, kc + h * k_cache.stride(0), vc + h * v_cache.stride(0), tp + rp[e] * ts + st, n, c,
                      G, static_cast<int>(D), static_cast<float>(scale), pm.data());
        rows_.add(pm.data(), c == 0);
      }
      rows_.out(false, o + row * H * D + h * G * D);
    }
  });
}

// Query tokens a tile of the tiled extend (Kernels::extend_tile): about 16 query rows, so that each K row
// read serves two octets of rows; calls with fewer new tokens in all than kTileMinNew keep the per-token
// items (a few verify tokens spread over the threads one token an item).
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileMinNew = 16;

// Most bytes of float K/V the tiled extend packs for one call; past it the per-token items run (a long
// cached prefix: 32K keys x 8 KV heads of 128 would be 256 MB).
constexpr int64_t kTilePackBytes = int64_t{64} << 20;

// The keys an extend's queries read: [key0, prefix + lens) (a window cuts the first ones).
inline int64_t first_key(int64_t prefix, int64_t window) { return window > 0 ? std::max<int64_t>(0, prefix + 1 - window) : 0; }

// Whether run_extend_tiles takes this call (its float copy of the keys within kTilePackBytes).
bool tiles_fit(const ExtendArgs& a, int64_t window) {
  int64_t keys = 0;
  for (int64_t e = 0; e < a.E; ++e) keys += a.prefix[e] + a.lens[e] - first_key(a.prefix[e], window);
  return keys * a.KVH * a.D * 8 <= kTilePackBytes;
}

// extend_attention in tiles of consecutive query tokens of one (extend, KV head), where the build has
// extend_tile (AVX-512) and the flash kernel does not run: the same bits per row as run_extend. First
// every (extend, KV head)'s keys are widened to float once ([keys, D] for K and for V, in parallel by
// runs of 64 keys): the tiles then read them where run_extend widened each K and V row once per query
// token. Tiles are dealt out light and heavy alternately by the keys they read (as flash_attention's),
// so the pool's contiguous ranges carry about equal work.
template <typename T>
void run_extend_tiles(const Kernels<T>& k, const T* kc, const T* vc, const T* qp, T* o, const at::Tensor& q,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const ExtendArgs& a, double scale,
                      int64_t window) {
  const int64_t H = a.H, D = a.D, KVH = a.KVH, G = a.G, E = a.E;
  const int64_t per = std::max<int64_t>(1, kTileRows / G);
  const int64_t *rp = a.rows, *sp = a.starts, *pp = a.prefix, *lp = a.lens, *tp = a.table, ts = a.table_stride;
  // Packed keys: (e, h)'s at pack_at[e * KVH + h], its key x at row x - first_key(pp[e], window).
  std::vector<int64_t> pack_at(static_cast<size_t>(E * KVH) + 1, 0);
  struct Run { int64_t e, h, x0, x1; };
  std::vector<Run> runs;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t k0 = first_key(pp[e], window), k1 = pp[e] + lp[e];
    for (int64_t h = 0; h < KVH; ++h) {
      pack_at[e * KVH + h + 1] = pack_at[e * KVH + h] + (k1 - k0) * D;
      for (int64_t x = k0; x < k1; x += kKeyChunk) runs.push_back({e, h, x, std::min(k1, x + kKeyChunk)});
    }
  }
  const auto kf = scratch_of<float>(pack_at[E * KVH]), vf = scratch_of<float>(pack_at[E * KVH]);
  kvl::parallel_for(0, static_cast<int64_t>(runs.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Run& r = runs[static_cast<size_t>(i)];
      const int64_t* locs = tp + rp[r.e] * ts;
      const T* kh = kc + r.h * k_cache.stride(0);
      const T* vh = vc + r.h * v_cache.stride(0);
      const int64_t off = pack_at[r.e * KVH + r.h] + (r.x0 - first_key(pp[r.e], window)) * D;
      for (int64_t x = r.x0; x < r.x1; ++x) {
        float* kd = kf.get() + off + (x - r.x0) * D;
        float* vd = vf.get() + off + (x - r.x0) * D;
        const T* ks = kh + locs[x] * D;
        const T* vs = vh + locs[x] * D;
        for (int64_t d = 0; d < D; ++d) kd[d] = to_f(ks[d]), vd[d] = to_f(vs[d]);
      }
    }
  });
  struct Tile { int64_t e, h, t0, n, cost; };
  std::vector<Tile> tiles;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t t0 = 0; t0 < lp[e]; t0 += per) {
      const int64_t n = std::min(per, lp[e] - t0), last = pp[e] + t0 + n;  // keys of the tile's last token
      const int64_t keys = window > 0 ? std::min(window, last) : last;
      for (int64_t h = 0; h < KVH; ++h) tiles.push_back({e, h, t0, n, keys * n});
    }
  }
  std::vector<int64_t> order(tiles.size());
  {
    std::vector<int64_t> by_cost(tiles.size());
    for (size_t i = 0; i < tiles.size(); ++i) by_cost[i] = static_cast<int64_t>(i);
    std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t x, int64_t y) { return tiles[x].cost < tiles[y].cost; });
    for (size_t i = 0, lo = 0, hi = tiles.size(); i < tiles.size(); ++i) order[i] = by_cost[i % 2 ? --hi : lo++];
  }
  kvl::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
    const T* qs[kTileRows];
    T* outs[kTileRows];
    long st[kTileRows], cnt[kTileRows];
    for (int64_t i = i0; i < i1; ++i) {
      const Tile& t = tiles[static_cast<size_t>(order[i])];
      for (int64_t j = 0; j < t.n; ++j) {
        const int64_t row = sp[t.e] + t.t0 + j, all = pp[t.e] + t.t0 + j + 1;
        const int64_t s0 = window > 0 ? std::max<int64_t>(0, all - window) : 0;
        qs[j] = qp + row * q.stride(0) + t.h * G * D;
        outs[j] = o + row * H * D + t.h * G * D;
        st[j] = static_cast<long>(s0), cnt[j] = static_cast<long>(all - s0);
      }
      const int64_t at_ = pack_at[t.e * KVH + t.h];
      k.extend_tile(qs, st, cnt, static_cast<int>(t.n), kf.get() + at_, vf.get() + at_,
                    static_cast<long>(first_key(pp[t.e], window)), static_cast<int>(G), static_cast<int>(D),
                    static_cast<float>(scale), outs);
    }
  });
}

// Attention of prefill chunks (extends) over the paged pool, in place: extend e's query rows
// q[starts[e] .. starts[e] + lens[e]) [T, H, D] attend causally over the tokens at
// req_to_token[rows[e], :prefix[e] + i + 1] (query i sees its prefix and the new tokens up to itself);
// their K/V are already in the pool. Writes those rows of out [T, H * D]; other rows are left alone.
// Work items are (extend, KV head, query token): each is the decode kernel's chunks over its causal
// range (flash.h's order: a row's bits equal the decode kernel's and the flash kernel's for that query
// and those keys), so the G query heads of one KV head share every K/V read, and the K/V of one
// request stay in cache across its query tokens.
// window > 0: each query attends only its last `window` keys (a sliding-window layer: Gemma 2/3's local
// layers, Mistral), so keys before a query's window are never read (their pages may be given back).
void extend_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& table, const at::Tensor& rows, const at::Tensor& starts,
                      const at::Tensor& prefix, const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const ExtendArgs a = check_extend(out, q, k_cache, v_cache, table, rows, starts, prefix, lens, true);
  const int64_t D = a.D, KVH = a.KVH, E = a.E;
  std::vector<int64_t> first(E + 1, 0);  // work items of extends before e
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + a.lens[e] * KVH;
  const bool f8cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  by_dtype(q, [&](auto tag) {
    using T_ = decltype(tag);
    const auto& k = pick<T_>(static_cast<int>(D));
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += a.lens[e];
    if (!f8cache && k.extend_tile && !flash_form(q, D) && total >= kTileMinNew && tiled_extend_enabled &&
        tiles_fit(a, window)) {
      run_extend_tiles(k, ptr<T_>(k_cache), ptr<T_>(v_cache), ptr<T_>(q), ptr<T_>(out), q, k_cache, v_cache, a, scale,
                       window);
    } else if (f8cache) {
      run_extend(k.attend_f8, ptr<f8>(k_cache), ptr<f8>(v_cache), ptr<T_>(q), ptr<T_>(out), q, k_cache, v_cache, a,
                 first, scale, window);
    } else {
      run_extend(k.attend, ptr<T_>(k_cache), ptr<T_>(v_cache), ptr<T_>(q), ptr<T_>(out), q, k_cache, v_cache, a,
                 first, scale, window);
    }
  });
}

// The same attention as extend_attention (same arguments and result, the same bits in the vdpbf16ps
// form), for bf16 where the CPU has AVX512-BF16 and head_dim is a multiple of 64: each (extend, KV head)
// packs its keys and values once
// (flash.h), then tiles of 4 query rows (token-major, the group's heads adjacent) run flash_rows over
// the threads. Tiles near the end of a prompt see more keys, so the tiles are dealt out light and
// heavy alternately: at::parallel_for's contiguous ranges then carry about equal work.
void flash_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& table, const at::Tensor& rows, const at::Tensor& starts,
                     const at::Tensor& prefix, const at::Tensor& lens, double scale, bool amx_ok) {
  TORCH_CHECK(kBf16Dot, "flash_attention_ needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "flash_attention_ takes bfloat16");
  const ExtendArgs a = check_extend(out, q, k_cache, v_cache, table, rows, starts, prefix, lens, true);
  const int64_t H = a.H, D = a.D, KVH = a.KVH, G = a.G, E = a.E;
  TORCH_CHECK(D % 64 == 0, "head_dim must be a multiple of 64, got ", D);
  // A float8 pool is widened to bf16 as it is packed (flash_pack's float8 form; not on AMX tiles yet).
  const bool f8cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t *rp = a.rows, *sp = a.starts, *pp = a.prefix, *lp = a.lens;
  const int64_t *tp = a.table, ts = a.table_stride;
  std::vector<int64_t> pack_at(E * KVH + 1, 0);  // offsets of each (extend, KV head)'s packed K (and V)
  // 16 rows a tile on AMX (flash_amx.cpp), else 4. The AMX form sums in its own order (its tile unit's,
  // chunks of 128): amx_ok false keeps a call on the vdpbf16ps form, whose rows are the decode kernel's.
  const bool amx = kAmx && flash_amx_enabled && amx_ok && !f8cache;
  const int64_t rows_per = amx ? kAmxFlashRows : kFlashRows;
  struct Tile { int64_t e, h, r0; };
  std::vector<Tile> tiles;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t Sp = flash_padded(pp[e] + lp[e]);
      pack_at[e * KVH + h + 1] = pack_at[e * KVH + h] + (amx ? amx_flash_alloc(Sp, static_cast<int>(D)) : Sp * D);
      for (int64_t r0 = 0; r0 < lp[e] * G; r0 += rows_per) tiles.push_back({e, h, r0});
    }
  }
  // Uninitialized: the packs write every value the kernels read (a zeroing vector cost a pass over
  // both buffers each layer).
  std::unique_ptr<bf16[]> kt_buf(new bf16[pack_at[E * KVH]]), vt_buf(new bf16[pack_at[E * KVH]]);
  bf16* const kt = kt_buf.get();
  bf16* const vt = vt_buf.get();
  kvl::parallel_for(0, E * KVH, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / KVH, h = i % KVH, S = pp[e] + lp[e];
      const int64_t* locs = tp + rp[e] * ts;
      if (f8cache) {
        flash_pack(ptr<f8>(k_cache) + h * k_cache.stride(0), ptr<f8>(v_cache) + h * v_cache.stride(0), locs, S,
                   static_cast<int>(D), kt + pack_at[i], vt + pack_at[i]);
        continue;
      }
      const bf16* kc = ptr<bf16>(k_cache) + h * k_cache.stride(0);
      const bf16* vc = ptr<bf16>(v_cache) + h * v_cache.stride(0);
      if (amx) {
        amx_pack(kc, vc, locs, S, static_cast<int>(D), kt + pack_at[i], vt + pack_at[i]);
      } else {
        flash_pack(kc, vc, locs, S, static_cast<int>(D), kt + pack_at[i], vt + pack_at[i]);
      }
    }
  });
  // Light and heavy alternately (by the keys a tile sees): ~equal work in each contiguous range.
  std::vector<int64_t> order(tiles.size());
  {
    std::vector<int64_t> by_cost(tiles.size());
    for (size_t i = 0; i < tiles.size(); ++i) by_cost[i] = static_cast<int64_t>(i);
    std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) {
      return pp[tiles[a].e] + tiles[a].r0 / G < pp[tiles[b].e] + tiles[b].r0 / G;
    });
    for (size_t i = 0, lo = 0, hi = tiles.size(); i < tiles.size(); ++i) order[i] = by_cost[i % 2 ? --hi : lo++];
  }
  const bf16* qp = ptr<bf16>(q);
  bf16* o = ptr<bf16>(out);
  kvl::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(std::max(flash_scratch_floats(static_cast<int>(D)),
                                        amx_flash_scratch_floats(static_cast<int>(D))));
    for (int64_t i = i0; i < i1; ++i) {
      const Tile& t = tiles[order[i]];
      const int64_t at_ = pack_at[t.e * KVH + t.h];
      // Tile t's query rows (token-major, the KV head's query heads adjacent), as many as the form takes.
      auto fill = [&](auto& fr, int64_t most) {
        fr.n = static_cast<int>(std::min<int64_t>(most, lp[t.e] * G - t.r0));
        for (int j = 0; j < fr.n; ++j) {
          const int64_t r = t.r0 + j, tok = r / G, head = t.h * G + r % G, row = sp[t.e] + tok;
          fr.q[j] = qp + row * q.stride(0) + head * D;
          fr.out[j] = o + row * H * D + head * D;
          fr.limit[j] = pp[t.e] + tok;
        }
      };
      if (amx) {
        AmxFlashRows fr{};
        fill(fr, kAmxFlashRows);
        flash_rows_amx(fr, kt + at_, vt + at_, flash_padded(pp[t.e] + lp[t.e]), static_cast<int>(D),
                       static_cast<float>(scale), scratch.data());
        continue;
      }
      FlashRows fr{};
      fill(fr, kFlashRows);
      flash_rows(fr, kt + at_, vt + at_, static_cast<int>(D), static_cast<float>(scale), scratch.data());
    }
  });
}

bool has_bf16_dot() { return kBf16Dot; }

// Whether flash_attention_ runs on AMX tiles (where the CPU has them); returns the previous setting.
bool set_flash_amx(bool on) {
  const bool was = flash_amx_enabled;
  flash_amx_enabled = on;
  return was;
}

// Whether extend_attention_ may run in tiles (run_extend_tiles); returns the previous setting.
bool set_tiled_extend(bool on) {
  const bool was = tiled_extend_enabled;
  tiled_extend_enabled = on;
  return was;
}

// Per-row (per-token) int8 quantization for oneDNN's u8 x s8 linear (model/linear.py): scale =
// max|row| / 127, xq = nearbyint(x / scale) + 128 (zero point 128). Returns (xq [M, K] uint8, scale [M]).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [rows, features] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = at::empty({M, K}, x.options().dtype(at::kByte));
  auto sc = at::empty({M}, x.options().dtype(at::kFloat));
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    const auto& k = pick<T>(static_cast<int>(K));
    kvl::parallel_for(0, M, grain(K), [&](int64_t r0, int64_t r1) {
      k.quantize_rows(ptr<T>(x), static_cast<int>(K), xq.data_ptr<uint8_t>(), sc.data_ptr<float>(), r0, r1);
    });
  });
  return {xq, sc};
}

// y [M, N] float32 (an int8 linear's output at activation scale 1) times each row's scale, plus an
// optional bias [N], rounded once to the dtype of `like`.
at::Tensor scale_rows(const at::Tensor& y, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                      const at::Tensor& like) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat, "y must be [rows, n] float32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == y.size(0),
              "scale must be float32 [rows]");
  check_float(like, "like");
  const int64_t M = y.size(0), N = y.size(1);
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == like.scalar_type(),
                "bias must be [n] of the output dtype");
  }
  auto out = at::empty({M, N}, y.options().dtype(like.scalar_type()));
  by_dtype(like, [&](auto tag) {
    using T = decltype(tag);
    const auto& k = pick<T>(static_cast<int>(N));
    const T* bp = bias ? ptr<T>(*bias) : nullptr;
    kvl::parallel_for(0, M, grain(N), [&](int64_t r0, int64_t r1) {
      k.scale_rows(y.data_ptr<float>(), scale.data_ptr<float>(), bp, ptr<T>(out), static_cast<int>(N), r0, r1);
    });
  });
  return out;
}

// --enable-int8-batch's linear on AVX512-VNNI (qlinear.h, S8Gemm): x [M, K] float32 or bf16 quantized per
// row and per segment of kS8Seg inputs, times int8 weights per output channel (w [N/16, K/4, 16, 4] int8,
// w_scale [N] float32, woff [segments, N] int32: -128 * each segment's weight sum), plus an optional bias
// [N] of x's dtype, in one call.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& woff,
                       const c10::optional<at::Tensor>& bias) {
  check_float(x, "x");
  TORCH_CHECK(kVnni, "int8_linear needs AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [rows, in_features] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.numel(), segs = (K + kS8Seg - 1) / kS8Seg;
  TORCH_CHECK(K % 4 == 0 && N % 16 == 0 && N > 0, "in_features must be a multiple of 4 and out_features of 16");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kChar && w.numel() == N * K,
              "packed weights do not match [", N, ", ", K, "]");
  TORCH_CHECK(w_scale.is_contiguous() && w_scale.scalar_type() == at::kFloat, "w_scale must be float32 [N]");
  TORCH_CHECK(woff.is_contiguous() && woff.scalar_type() == at::kInt && woff.numel() == segs * N,
              "woff must be int32 [", segs, ", ", N, "]");
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "bias must be [n] of x's dtype");
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto xu = scratch_of<uint8_t>(M * K);  // every row quantized below
  const auto sx = scratch_of<float>(M * segs);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  kvl::parallel_for(0, M, grain(K), [&](int64_t r0, int64_t r1) {
    s8_quantize(x.data_ptr(), bf16, K, xu.get(), sx.get(), r0, r1);
  });
  const S8Gemm g{xu.get(), sx.get(), M, K, N, segs, w.data_ptr<int8_t>(), w_scale.data_ptr<float>(),
                 woff.data_ptr<int32_t>(), bias ? bias->data_ptr() : nullptr, out.data_ptr(), bf16};
  // Tiles of kS8Rows rows x kS8Blocks blocks of 16 outputs, column tile major: each thread's contiguous
  // range of tiles reads few column tiles' weights.
  const int64_t NB = N / 16, CT = (NB + kS8Blocks - 1) / kS8Blocks, RT = (M + kS8Rows - 1) / kS8Rows;
  kvl::parallel_for(0, CT * RT, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t ct = i / RT, rt = i % RT;
      s8_gemm_vnni(g, rt * kS8Rows, std::min(M, (rt + 1) * kS8Rows), ct * kS8Blocks,
                   std::min(NB, (ct + 1) * kS8Blocks));
    }
  });
  return out;
}

// y = x @ W.T for weights packed by kernels/quant.py (layout in qlinear.h): x [M, K] float32 or bf16
// (rows contiguous), y [M, N] of x's dtype. The activations are quantized here, once per call, to int8
// per group of 32 (scale = max|x| / 127, round to nearest even); both ISA paths read the same codes.
// amx_rows > 0: calls of at least that many bf16 rows run on AMX tiles where the CPU has them
// (qlinear_amx.cpp: the weights dequantized to bf16 once per call, float sums), not the VNNI path.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& wsum128, int64_t bits, int64_t n, int64_t amx_rows) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [rows, in_features] contiguous");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0 && n > 0, "in_features must be a multiple of 32 and out_features of 16");
  const int64_t G = K / 32, NB = n / 16;
  TORCH_CHECK(w.is_contiguous() && w.numel() == n * K / (bits == 4 ? 2 : 1) &&
                  w.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "packed weights do not match [", n, ", ", K, "] at ", bits, " bits");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == NB * G * (bits == 4 ? 32 : 16),
              "scales do not match the packed weights");
  if (bits == 8) {
    TORCH_CHECK(wsum128 && wsum128->is_contiguous() && wsum128->scalar_type() == at::kInt &&
                    wsum128->numel() == NB * G * 16,
                "int8 weights need their wsum128 [", NB * G * 16, "] int32");
  }
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  if (amx_rows > 0 && M >= amx_rows && x.scalar_type() == at::kBFloat16 && kAmx) {
    // Whole tiles of 16 rows: the last one padded with zero rows (their outputs are not written).
    const int64_t Mpad = (M + 15) / 16 * 16;
    at::Tensor xp = x;
    if (Mpad != M) {
      xp = at::zeros({Mpad, K}, x.options());
      xp.narrow(0, 0, M).copy_(x);
    }
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr());
    uint16_t* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
    kvl::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      q_amx(xs, M, Mpad, K, static_cast<int>(bits), w.data_ptr(), sp, ys, n, p0, p1);
    });
    return out;
  }
  static const QuantKernels scalar = quant_scalar();
#if defined(__x86_64__) || defined(_M_X64)
  static const QuantKernels vnni = quant_vnni();
  const QuantKernels& qk = kVnni ? vnni : scalar;
#else
  const QuantKernels& qk = scalar;
#endif
  const auto xq = scratch_of<int8_t>(M * K);  // all M * G groups quantized below
  const auto xu = scratch_of<uint8_t>(bits == 8 ? M * K : 0);
  const auto sx = scratch_of<float>(M * G), xsum = scratch_of<float>(M * G);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  // Groups over the threads from 512 on (~16K activations): a decode row stays on this thread.
  kvl::parallel_for(0, M * G, 512, [&](int64_t i0, int64_t i1) {
    qk.quantize(x.data_ptr(), bf16, xq.get(), bits == 8 ? xu.get() : nullptr, sx.get(), xsum.get(), i0, i1);
  });
  const QuantActs acts{xq.get(), xu.get(), sx.get(), xsum.get(), static_cast<int>(M), K};
  void* y = out.data_ptr();
  // Row blocks of 16 over the threads; ~64K weights a task keeps one-row calls of small layers whole.
  const int64_t grain = std::max<int64_t>(1, 65536 / (16 * K));
  kvl::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    if (bits == 4) {
      qk.q4(acts, w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), y, bf16, n, b0, b1);
    } else {
      qk.q8(acts, w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()),
            wsum128->data_ptr<int32_t>(), y, bf16, n, b0, b1);
    }
  });
  return out;
}

// y = x @ W.T with W [n, k] as a GGUF file's blocks (gguf_blocks.h: kind is the GGML type id), read as
// stored: x [M, k] float32 or bf16 (rows contiguous), y [M, n] of x's dtype. segments (int64 [S, 2]:
// kind, rows), where given, say W is a stack of parts of different kinds (a fused q/k/v whose v is
// stored wider), their blocks one after another in w; kind is then ignored. The activations are
// quantized here, once per call, to int8 per group of 32 (qlinear.h's quantize, both ISA paths the
// same codes); output rows over the threads, each weight row decoded once for all M activation rows.
// tile_rows: calls of that many rows and more take the tiles' path (gguf_blocks.h: 32 weight rows at a
// time in the packed kernel's layout, one output a lane); -1: kGgufTileRows; 0: never (one order of sums
// a row whatever the batch: --enable-deterministic-inference).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n, int64_t k,
                       const c10::optional<at::Tensor>& segments, int64_t tile_rows) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == k, "x must be [rows, ", k, "] contiguous");
  struct Part {
    int kind;
    int64_t r0, r1, offset, row_bytes;
  };
  std::vector<Part> parts;
  int64_t rows_seen = 0, bytes_seen = 0;
  bool packed = false;  // a part repacked at load (gguf_blocks.h): every batch takes the packed kernel
  auto add = [&](int64_t kd, int64_t rows) {
    GgufFormat f;
    const int base = gguf_is_packed(static_cast<int>(kd)) ? static_cast<int>(kd) - kGgufPacked : static_cast<int>(kd);
    TORCH_CHECK(gguf_format(base, &f), "GGML type ", kd, " has no kernel here");
    TORCH_CHECK(k % f.block == 0 && rows > 0, "in_features ", k, " is not whole blocks of ", f.block);
    const int64_t rb = k / f.block * f.bytes;
    packed = packed || base != kd;
    parts.push_back({static_cast<int>(kd), rows_seen, rows_seen + rows, bytes_seen, rb});
    rows_seen += rows;
    bytes_seen += gguf_rows_bytes(static_cast<int>(kd), rows, k);
  };
  if (segments && segments->numel() > 0) {
    TORCH_CHECK(segments->dim() == 2 && segments->size(1) == 2 && segments->scalar_type() == at::kLong &&
                    segments->is_contiguous(),
                "segments must be [parts, 2] int64 (kind, rows)");
    const int64_t* sp = segments->data_ptr<int64_t>();
    for (int64_t s = 0; s < segments->size(0); ++s) add(sp[2 * s], sp[2 * s + 1]);
  } else {
    add(kind, n);
  }
  TORCH_CHECK(rows_seen == n && w.is_contiguous() && w.scalar_type() == at::kByte && w.numel() == bytes_seen,
              "blocks do not match [", n, ", ", k, "] of GGML type ", kind);
  const int64_t M = x.size(0), Kp = gguf_padded(k), G = k / 32, Gp = Kp / 32;
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  static const QuantKernels scalar = quant_scalar();
#if defined(__x86_64__) || defined(_M_X64)
  static const QuantKernels vnni = quant_vnni();
  const QuantKernels& qk = kVnni ? vnni : scalar;
  const GgufRowsFn rows = kVnni ? &gguf_rows_vnni : &gguf_rows_scalar;
  const GgufRowsFn tiles = kVnni ? &gguf_tiles_vnni : &gguf_tiles_scalar;
  const GgufRowsFn packs = kVnni ? &gguf_packed_vnni : &gguf_packed_scalar;
#else
  const QuantKernels& qk = scalar;
  const GgufRowsFn rows = &gguf_rows_scalar;
  const GgufRowsFn tiles = &gguf_tiles_scalar;
  const GgufRowsFn packs = &gguf_packed_scalar;
#endif
  const auto xq = scratch_of<int8_t>(M * Kp);
  const auto xu = scratch_of<uint8_t>(M * Kp);
  const auto sx = scratch_of<float>(M * Gp), xsum = scratch_of<float>(M * Gp);
  const auto sxl = scratch_of<float>(M * Kp / 4);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t esz = bf16 ? 2 : 4;
  kvl::parallel_for(0, M, std::max<int64_t>(1, 16384 / k), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const char* xm = static_cast<const char*>(x.data_ptr()) + m * k * esz;
      qk.quantize(xm, bf16, xq.get() + m * Kp, xu.get() + m * Kp, sx.get() + m * Gp, xsum.get() + m * Gp, 0, G);
      for (int64_t g = G; g < Gp; ++g) {  // the padding: zero codes, scales and sums
        std::memset(xq.get() + m * Kp + 32 * g, 0, 32);
        std::memset(xu.get() + m * Kp + 32 * g, 128, 32);
        sx[m * Gp + g] = 0.f;
        xsum[m * Gp + g] = 0.f;
      }
      for (int64_t l = 0; l < Kp / 4; ++l) sxl[m * Kp / 4 + l] = sx[m * Gp + l / 8];
    }
  });
  GgufActs acts{xq.get(), xu.get(), sxl.get(), xsum.get(), sx.get(), static_cast<int>(M), Kp};
  const bool q6x = std::any_of(parts.begin(), parts.end(), [](const Part& p) {
    return p.kind == kQ6_Kx16 || p.kind == kQ8_0x16 || p.kind == kQ5_0x16;
  });
  const auto xs16 = scratch_of<int32_t>(q6x ? M * Kp / 16 : 1);
  if (q6x) {  // the repacked signed kinds' unit starts (gguf_packed_vnni.cpp), once a call
    for (int64_t i = 0; i < M * Kp / 16; ++i) {
      int32_t t = 0;
      for (int e = 0; e < 16; ++e) t += xq[16 * i + e];
      xs16[i] = t;
    }
    acts.xs16 = xs16.get();
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  void* y = out.data_ptr();
  if (packed || (tile_rows != 0 && M >= (tile_rows < 0 ? kGgufTileRows : tile_rows))) {
    // Tiles of kGgufTile rows within each part (a tile is one kind), over the threads. Repacked parts
    // take their kernel at every batch (the tiles' sums: one order a row whatever M, tile_rows aside);
    // a stack mixes the two only where a part's kind has no repack, and that part then tiles too.
    std::vector<std::pair<size_t, int64_t>> work;  // (part, first row)
    for (size_t i = 0; i < parts.size(); ++i) {
      for (int64_t r = parts[i].r0; r < parts[i].r1; r += kGgufTile) work.emplace_back(i, r);
    }
    kvl::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const Part& p = parts[work[t].first];
        const int64_t a = work[t].second;
        const GgufRowsFn fn = gguf_is_packed(p.kind) ? packs : tiles;
        fn(acts, p.kind, wp + p.offset, p.r0, k, y, bf16, n, a, std::min<int64_t>(a + kGgufTile, p.r1));
      }
    });
    return out;
  }
  // Output rows over the threads; ~64K weights a task keeps one-row calls of small layers whole.
  kvl::parallel_for(0, n, std::max<int64_t>(1, 65536 / k), [&](int64_t n0, int64_t n1) {
    for (const Part& p : parts) {
      const int64_t a = std::max(n0, p.r0), b = std::min(n1, p.r1);
      if (a < b) rows(acts, p.kind, wp + p.offset, p.r0, k, y, bf16, n, a, b);
    }
  });
  return out;
}

// The load-time repack (gguf_blocks.h) of a weight's parts (segments as gguf_linear's: kind, rows),
// every part Q4_K, Q6_K, Q8_0 or Q5_0 -> kind + 100, groups of 16 rows over the threads; inverse: back to the
// file's bytes (parts then given in their packed kinds). ws: the parts' bytes, one tensor holding every
// part in order, or one tensor a part (a fused projection's q/k/v or gate/up straight from the file's
// map: no concatenated copy first). segments may carry a third column, a part's heads when its rows are in
// llama.cpp's q/k order (gguf_repack_groups reads them in HF's; 0: as stored; not with inverse). A new
// uint8 tensor; ws are only read.
at::Tensor gguf_repack(const at::TensorList ws, const at::Tensor& segments, int64_t k, bool inverse) {
  TORCH_CHECK(!ws.empty(), "no input");
  for (const at::Tensor& w : ws)
    TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte, "w must be contiguous uint8");
  TORCH_CHECK(segments.dim() == 2 && (segments.size(1) == 2 || segments.size(1) == 3) &&
                  segments.scalar_type() == at::kLong && segments.is_contiguous(),
              "segments must be [parts, 2 or 3] int64 (kind, rows[, heads])");
  struct Part {
    int kind;
    int64_t rows, src, dst, g0, heads;
    const uint8_t* in;
  };
  std::vector<Part> parts;
  int64_t src = 0, dst = 0, groups = 0;
  const int64_t* sp = segments.data_ptr<int64_t>();
  const int64_t cols = segments.size(1);
  for (int64_t i = 0; i < segments.size(0); ++i) {
    const int kd = static_cast<int>(sp[cols * i]);
    const int64_t rows = sp[cols * i + 1], heads = cols == 3 ? sp[cols * i + 2] : 0;
    TORCH_CHECK(rows > 0 && (inverse ? gguf_is_packed(kd) : gguf_repackable(kd)), "GGML type ", kd,
                inverse ? " is not a repacked kind" : " has no repack");
    TORCH_CHECK(heads == 0 || (!inverse && heads > 0 && rows % (2 * heads) == 0), "part ", i, ": ", rows,
                " rows are not ", heads, " heads of two rotary halves");
    const int pk = inverse ? kd : kd + kGgufPacked, fk = inverse ? kd - kGgufPacked : kd;
    TORCH_CHECK(k > 0 && k % gguf_packed_block(pk) == 0, "in_features ", k, " is not whole blocks of ",
                gguf_packed_block(pk));
    parts.push_back({kd, rows, src, dst, groups, heads});
    src += gguf_rows_bytes(inverse ? pk : fk, rows, k);
    dst += gguf_rows_bytes(inverse ? fk : pk, rows, k);
    groups += (rows + kGgufGroup - 1) / kGgufGroup;
  }
  if (ws.size() == 1) {
    TORCH_CHECK(ws[0].numel() == src, "w holds ", ws[0].numel(), " bytes, the parts ", src);
    for (Part& p : parts) p.in = ws[0].data_ptr<uint8_t>() + p.src;
  } else {
    TORCH_CHECK(ws.size() == parts.size(), ws.size(), " inputs for ", parts.size(), " parts");
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t want = (i + 1 < parts.size() ? parts[i + 1].src : src) - parts[i].src;
      TORCH_CHECK(ws[i].numel() == want, "part ", i, " holds ", ws[i].numel(), " bytes, its rows ", want);
      parts[i].in = ws[i].data_ptr<uint8_t>();
    }
  }
  auto out = at::empty({dst}, ws[0].options());
  uint8_t* op = out.data_ptr<uint8_t>();
  kvl::parallel_for(0, groups, 1, [&](int64_t a, int64_t b) {
    for (const Part& p : parts) {
      const int64_t pg = (p.rows + kGgufGroup - 1) / kGgufGroup;
      const int64_t g0 = std::max<int64_t>(a, p.g0) - p.g0, g1 = std::min<int64_t>(b, p.g0 + pg) - p.g0;
      if (g0 >= g1) continue;
      if (inverse) gguf_unpack_groups(p.kind, p.in, p.rows, k, op + p.dst, g0, g1);
      else gguf_repack_groups(p.kind, p.in, p.rows, k, op + p.dst, g0, g1, p.heads);
    }
  });
  return out;
}

// Drop w's whole pages from this process (madvise MADV_DONTNEED): for a read-only view of a file's
// memory map whose bytes were repacked elsewhere, so that the file's pages do not stay resident beside
// the repacked copy (a later read, if any, faults them in again from the file). Only for file-backed
// shared maps: on private or anonymous memory it would zero the bytes. Returns the bytes released.
int64_t release_pages(const at::Tensor& w) {
#if defined(__linux__)
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(w.data_ptr()), e = a + w.nbytes();
  const uintptr_t a0 = (a + page - 1) / page * page, e0 = e / page * page;
  if (e0 <= a0) return 0;
  if (madvise(reinterpret_cast<void*>(a0), e0 - a0, MADV_DONTNEED) != 0) return 0;
  return static_cast<int64_t>(e0 - a0);
#else
  return 0;
#endif
}

// y = x @ w.T (+ bias) for an unquantized layer under --enable-deterministic-inference: x [M, K] and w
// [N, K] (as loaded, rows contiguous) of one dtype, float32 or bf16; y [M, N] of that dtype. Each output
// is one order of sums whatever M (dense.cpp), split over the threads by outputs, never by rows or K.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [rows, in_features] contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "w must be [out_features, in_features] contiguous, of x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "bias must be [out_features] of x's dtype");
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* bp = bias ? bias->data_ptr() : nullptr;
  // Blocks of 4 outputs (a tile's); ~64K weights a task.
  const int64_t blocks = (N + 3) / 4, per = std::max<int64_t>(1, 65536 / (4 * std::max<int64_t>(K, 1)));
  kvl::parallel_for(0, blocks, per, [&](int64_t b0, int64_t b1) {
    const long n0 = 4 * b0, n1 = std::min<int64_t>(N, 4 * b1);
    if (kAvx512) {
      dense_avx512(x.data_ptr(), w.data_ptr(), bp, out.data_ptr(), bf16, M, K, N, n0, n1);
    } else {
      dense_scalar(x.data_ptr(), w.data_ptr(), bp, out.data_ptr(), bf16, M, K, N, n0, n1);
    }
  });
  return out;
}

std::string isa() { return kAvx512 ? "avx512" : "scalar"; }

std::string quant_isa() { return kVnni ? "avx512-vnni" : "scalar"; }

bool has_amx() { return kAmx; }

}  // namespace

// The ops decode_step.cpp's one-call decode runs (decode_step.h), called directly (no dispatcher).
at::Tensor op_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return rms_norm(x, w, eps); }
at::Tensor op_add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps) {
  return add_rms_norm(residual, x, w, eps);
}
at::Tensor op_silu_mul(const at::Tensor& gu) { return silu_mul(gu); }
void op_rope(at::Tensor& x, const at::Tensor& pos, const at::Tensor& cos, const at::Tensor& sin) {
  rope_(x, pos, cos, sin);
}
at::Tensor op_decode_attention(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& table,
                               const at::Tensor& rows, const at::Tensor& lens, double scale, const at::Tensor& k_new,
                               const at::Tensor& v_new, const at::Tensor& out_loc, int64_t window) {
  return decode_attention(q, k_cache, v_cache, table, rows, lens, scale, k_new, v_new, out_loc, 0, window);
}
at::Tensor op_decode_attention_heads(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& table, const at::Tensor& rows, const at::Tensor& lens,
                                     double scale, int64_t head_stride) {
  return decode_attention(q, k_cache, v_cache, table, rows, lens, scale, c10::nullopt, c10::nullopt, c10::nullopt,
                          head_stride, 0);
}
at::Tensor op_quant_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& wsum128, int64_t bits, int64_t n, int64_t amx_rows) {
  return quant_linear(x, w, scales, wsum128, bits, n, amx_rows);
}
at::Tensor op_gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n,
                          const at::Tensor& segments) {
  // an empty segments tensor: one kind for the whole weight (the one-call plan passes a tensor always)
  return gguf_linear(x, w, kind, n, x.size(1), segments.numel() ? c10::optional<at::Tensor>(segments) : c10::nullopt,
                     -1);
}
at::Tensor op_int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& woff) {
  return int8_linear(x, w, w_scale, woff, c10::nullopt);
}
at::Tensor op_dense_linear(const at::Tensor& x, const at::Tensor& w) { return dense_linear(x, w, c10::nullopt); }

}  // namespace kvl

TORCH_LIBRARY(kvledger_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor req_to_token, Tensor rows, "
      "Tensor lens, float scale, Tensor? k_new=None, Tensor? v_new=None, Tensor? out_loc=None, "
      "int head_stride=0, int window=0) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor w, int kind, int n, int k, Tensor? segments=None, int tile_rows=-1) -> Tensor");
  m.def("gguf_repack(Tensor[] ws, Tensor segments, int k, bool inverse=False) -> Tensor");
  m.def("release_pages(Tensor w) -> int");
  m.def(
      "quant_linear(Tensor x, Tensor w, Tensor scales, Tensor? wsum128, int bits, int n, int amx_rows=0) -> Tensor");
  m.def(
      "extend_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
      "Tensor rows, Tensor starts, Tensor prefix, Tensor lens, float scale, int window=0) -> ()");
  m.def(
      "flash_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
      "Tensor rows, Tensor starts, Tensor prefix, Tensor lens, float scale, bool amx=True) -> ()");
  m.def(
      "decode_layers(Tensor(a!) h, Tensor[] w, Tensor[] scales, Tensor?[] wsum, int[] bits, int[] n, "
      "Tensor[] dense, Tensor?[] norms, int[] desc, Tensor(b!) k_all, Tensor(c!) v_all, Tensor positions, "
      "Tensor[] cos, Tensor[] sin, Tensor req_to_token, Tensor rows, Tensor lens, Tensor out_loc, int heads, "
      "float scale, float eps, int amx_rows, Tensor[] w8, Tensor[] w8_scale, Tensor[] w8_off, int int8_rows, "
      "Tensor(d!)? sp_host_k=None, Tensor(e!)? sp_host_v=None, Tensor(f!)? sp_summary=None, Tensor? sp_idx=None, "
      "Tensor? sp_host_table=None, Tensor? sp_lens=None, int[] sp_params=[]) -> ()");
  m.def("head_argmax(Tensor x, Tensor w, Tensor scales, Tensor? wsum128, int bits, int n, int valid) -> Tensor");
  m.def("kind_norm(Tensor x, Tensor w, int kind, float eps) -> Tensor");
  m.def("add_kind_norm(Tensor(a!) h, Tensor delta, Tensor w, int kind, float eps) -> Tensor");
  m.def("kind_head_norm_(Tensor(a!) qkv, int col, int heads, int hd, Tensor w, int kind, float eps) -> ()");
  m.def("gated_act(Tensor gu, int act) -> Tensor");
  m.def("store_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor out_loc) -> ()");
  m.def("has_bf16_dot", &kvl::has_bf16_dot);
  m.def("has_amx", &kvl::has_amx);
  m.def("set_flash_amx", &kvl::set_flash_amx);
  m.def("set_tiled_extend", &kvl::set_tiled_extend);
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_rows(Tensor y, Tensor scale, Tensor? bias, Tensor like) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor w_scale, Tensor woff, Tensor? bias=None) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("to_f8(Tensor x) -> Tensor");
  m.def("from_f8(Tensor x, ScalarType dtype) -> Tensor");
  m.def("isa", &kvl::isa);
  m.def("quant_isa", &kvl::quant_isa);
}

TORCH_LIBRARY_IMPL(kvledger_cpu, CPU, m) {
  m.impl("rms_norm", &kvl::rms_norm);
  m.impl("add_rms_norm", &kvl::add_rms_norm);
  m.impl("silu_mul", &kvl::silu_mul);
  m.impl("rope_", &kvl::rope_);
  m.impl("decode_attention", &kvl::decode_attention);
  m.impl("quant_linear", &kvl::quant_linear);
  m.impl("gguf_linear", &kvl::gguf_linear);
  m.impl("gguf_repack", &kvl::gguf_repack);
  m.impl("release_pages", &kvl::release_pages);
  m.impl("extend_attention_", &kvl::extend_attention);
  m.impl("flash_attention_", &kvl::flash_attention);
  m.impl("decode_layers", &kvl::decode_layers);
  m.impl("head_argmax", &kvl::head_argmax);
  m.impl("kind_norm", &kvl::kind_norm);
  m.impl("add_kind_norm", &kvl::add_kind_norm);
  m.impl("kind_head_norm_", &kvl::kind_head_norm_);
  m.impl("gated_act", &kvl::gated_act);
  m.impl("store_kv_", &kvl::store_kv_);
  m.impl("quantize_rows", &kvl::quantize_rows);
  m.impl("scale_rows", &kvl::scale_rows);
  m.impl("int8_linear", &kvl::int8_linear);
  m.impl("dense_linear", &kvl::dense_linear);
  m.impl("to_f8", &kvl::to_f8);
  m.impl("from_f8", &kvl::from_f8);
}
