// One-token (decode) kernels for bf16 weights on the CPU: matrix-vector products that stream the
// weights once at close to memory bandwidth, and a whole MoE layer's experts in two passes.
//
// Why hand-written: for one row, oneDNN re-arranges a plain bf16 weight on every call and torch's
// native kernel pays a thread-pool round trip per matrix (8 experts x 2 matrices x every layer),
// so both stream expert weights at well under the memory bandwidth on a 2-core machine.
// Arithmetic: bf16 products summed in float32 (AVX-512 BF16 dot products where the CPU has them),
// rounded to bf16 where transformers rounds (each projection's output, the activation, the
// product), so results are close to, not bit-identical with, transformers' kernels.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MOESCOPE_AVX512BF16 1
#elif defined(__AVX512F__)
#include <immintrin.h>
#define MOESCOPE_AVX512F 1
#endif

namespace {

using bf16 = uint16_t;

inline float to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline bf16 to_bf16(float v) {  // round to nearest even, as torch does (NaN kept quiet)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

inline float round_bf16(float v) { return to_float(to_bf16(v)); }

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
// 16 bf16 values widened to float32 (a bf16 is the top half of a float32).
inline __m512 widen_bf16(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// One weight row with x, length k: four independent sums so the loads stream back to back.
// (Summing 4 rows at once, to share the loads of x, streamed at ~40 GB/s where one row at a time
// reaches the ~70 GB/s a plain read gets on the same machine.)
inline float dot_row(const bf16* w, const bf16* x, int64_t k) {
#if defined(MOESCOPE_AVX512BF16)
  auto dot = [](__m512 acc, const bf16* a, const bf16* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
    a0 = dot(a0, w + i, x + i);
    a1 = dot(a1, w + i + 32, x + i + 32);
    a2 = dot(a2, w + i + 64, x + i + 64);
    a3 = dot(a3, w + i + 96, x + i + 96);
  }
  for (; i + 32 <= k; i += 32) a0 = dot(a0, w + i, x + i);
  if (i < k) {
    const __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i),
                          (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(MOESCOPE_AVX512F)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(widen_bf16(w + i), widen_bf16(x + i), a0);
    a1 = _mm512_fmadd_ps(widen_bf16(w + i + 16), widen_bf16(x + i + 16), a1);
  }
  float tail = 0.f;
  for (; i < k; ++i) tail += to_float(w[i]) * to_float(x[i]);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail;
#else
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
#endif
}

// out[n] = W[n, :] . x for rows [begin, end) of a row-major matrix with row stride `ld`.
inline void gemv_range(const bf16* weight, int64_t ld, const bf16* x, int64_t k, int64_t begin, int64_t end,
                       float* out) {
  for (int64_t n = begin; n < end; ++n) out[n] = dot_row(weight + n * ld, x, k);
}

// acc[i] += p * v[i] for a bf16 row v of length n.
inline void axpy_row(float p, const bf16* v, float* acc, int64_t n) {
  int64_t i = 0;
#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
  const __m512 scale = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(scale, widen_bf16(v + i), _mm512_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * to_float(v[i]);
}

void check_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16, name, ": a bf16 CPU tensor is needed");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a 2-D matrix with contiguous rows is needed");
}

constexpr int64_t kGrain = 64;  // rows per task: ~128 KB of weights, enough to hide a task's start

// y = W x for one row x (any leading shape of size 1), as F.linear without bias.
torch::Tensor gemv(const torch::Tensor& weight, const torch::Tensor& x) {
  check_matrix(weight, "weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.numel() == k && x.scalar_type() == torch::kBFloat16, "x: one bf16 row of the weight's width needed");
  const torch::Tensor xc = x.contiguous();
  std::vector<float> acc(n);
  const bf16* w = reinterpret_cast<const bf16*>(weight.data_ptr());
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    gemv_range(w, weight.stride(0), xv, k, begin, end, acc.data());
  });
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  torch::Tensor y = torch::empty(sizes, x.options());
  bf16* yv = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t i = 0; i < n; ++i) yv[i] = to_bf16(acc[i]);
  return y;
}

// One token through `k` experts (gate_up [2I, H] and down [H, I] each, SiLU gate) weighted by
// `weights` (float32, [k]) and summed: what a decode step's MoE block computes.
torch::Tensor moe_decode(const torch::Tensor& x, const std::vector<torch::Tensor>& gate_up,
                         const std::vector<torch::Tensor>& down, const torch::Tensor& weights) {
  const int64_t experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(down.size()) == experts, "one gate_up and one down per expert");
  TORCH_CHECK(weights.numel() == experts, "one routing weight per expert");
  const int64_t hidden = x.numel(), inter = down[0].size(1);
  for (int64_t e = 0; e < experts; ++e) {
    check_matrix(gate_up[e], "gate_up");
    check_matrix(down[e], "down");
    TORCH_CHECK(gate_up[e].size(0) == 2 * inter && gate_up[e].size(1) == hidden, "gate_up: [2 * intermediate, hidden]");
    TORCH_CHECK(down[e].size(0) == hidden && down[e].size(1) == inter, "down: [hidden, intermediate]");
  }
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor wf = weights.to(torch::kFloat32).contiguous();
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  const float* route = wf.data_ptr<float>();

  std::vector<float> projected(experts * 2 * inter);
  std::vector<bf16> activation(experts * inter);
  auto activate = [&](int64_t e, int64_t begin, int64_t end) {  // rounded as transformers does
    const float* gate = projected.data() + e * 2 * inter;
    for (int64_t i = begin; i < end; ++i) {
      const float g = round_bf16(gate[i]), u = round_bf16(gate[inter + i]);
      const float silu = round_bf16(g / (1.f + std::exp(-g)));
      activation[e * inter + i] = to_bf16(silu * u);
    }
  };
  std::vector<float> outputs(experts * hidden);  // each expert's down projection, summed in pick order below
  if (experts % at::get_num_threads() == 0) {
    // Whole experts per thread: each thread streams its matrices end to end, which the hardware
    // prefetchers like best (5-10 % faster than splitting every matrix by rows).
    at::parallel_for(0, experts, 1, [&](int64_t first, int64_t last) {
      for (int64_t e = first; e < last; ++e) {
        gemv_range(reinterpret_cast<const bf16*>(gate_up[e].data_ptr()), gate_up[e].stride(0), xv, hidden, 0,
                   2 * inter, projected.data() + e * 2 * inter);
        activate(e, 0, inter);
      }
    });
    at::parallel_for(0, experts, 1, [&](int64_t first, int64_t last) {
      for (int64_t e = first; e < last; ++e)
        gemv_range(reinterpret_cast<const bf16*>(down[e].data_ptr()), down[e].stride(0),
                   activation.data() + e * inter, inter, 0, hidden, outputs.data() + e * hidden);
    });
  } else {
    // Pass 1: gate and up rows of every expert, split by rows; then pass 2: down rows.
    at::parallel_for(0, inter, kGrain / 2, [&](int64_t begin, int64_t end) {
      for (int64_t e = 0; e < experts; ++e) {
        const bf16* w = reinterpret_cast<const bf16*>(gate_up[e].data_ptr());
        float* gate = projected.data() + e * 2 * inter;
        gemv_range(w, gate_up[e].stride(0), xv, hidden, begin, end, gate);
        gemv_range(w, gate_up[e].stride(0), xv, hidden, inter + begin, inter + end, gate);
        activate(e, begin, end);
      }
    });
    at::parallel_for(0, hidden, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t e = 0; e < experts; ++e)
        gemv_range(reinterpret_cast<const bf16*>(down[e].data_ptr()), down[e].stride(0),
                   activation.data() + e * inter, inter, begin, end, outputs.data() + e * hidden);
    });
  }
  std::vector<float> summed(hidden, 0.f);  // each output rounded, weighted and summed over experts
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t j = 0; j < hidden; ++j) summed[j] += round_bf16(outputs[e * hidden + j]) * route[e];
  torch::Tensor y = torch::empty_like(xc);
  bf16* yv = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t j = 0; j < hidden; ++j) yv[j] = to_bf16(summed[j]);
  return y;
}

// Llama's RMSNorm of one row of n: float32 statistics, the normalized row rounded to bf16, then
// times the bf16 weight (rounded again).
inline void rms_norm_row(const bf16* in, const bf16* weight, int64_t n, float eps, bf16* out) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += to_float(in[i]) * to_float(in[i]);
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(to_float(weight[i]) * round_bf16(to_float(in[i]) * scale));
}

// RMSNorm over the last dimension of a few rows (a decode step's hidden state, or its heads for
// q/k norms). One call instead of transformers' eight small ops.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t n = weight.numel();
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 && n > 0 &&
                  x.size(-1) == n,
              "rms_norm: bf16 rows and a bf16 weight of their width");
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  const bf16* wv = reinterpret_cast<const bf16*>(wc.data_ptr());
  torch::Tensor y = torch::empty_like(xc);
  bf16* yv = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t row = 0; row < xc.numel() / n; ++row)
    rms_norm_row(xv + row * n, wv, n, static_cast<float>(eps), yv + row * n);
  return y;
}

// Rotary embedding of one head, as transformers' apply_rotary_pos_emb in bf16:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16.
inline void rope_head(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  const int64_t half = d / 2;
  std::vector<float> in(d);
  for (int64_t i = 0; i < d; ++i) in[i] = to_float(x[i]);
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -in[i + half] : in[i - half];
    x[i] = to_bf16(round_bf16(in[i] * to_float(cos[i])) + round_bf16(rotated * to_float(sin[i])));
  }
}

// One token's query, key and value for a layer of Llama-style attention: the three projections
// (no bias) in one pass over their rows, optional per-head RMSNorms of q and k (Qwen3), then the
// rotary embedding. Returns q [1, heads, 1, d], k and v [1, kv_heads, 1, d], as the attention
// module hands them to the KV cache.
std::vector<torch::Tensor> qkv_rope(const torch::Tensor& x, const torch::Tensor& wq, const torch::Tensor& wk,
                                    const torch::Tensor& wv, const c10::optional<torch::Tensor>& q_norm,
                                    const c10::optional<torch::Tensor>& k_norm, double eps, const torch::Tensor& cos,
                                    const torch::Tensor& sin, int64_t head_dim) {
  check_matrix(wq, "q_proj");
  check_matrix(wk, "k_proj");
  check_matrix(wv, "v_proj");
  const int64_t hidden = x.numel(), nq = wq.size(0), nk = wk.size(0), nv = wv.size(0);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && wq.size(1) == hidden && wk.size(1) == hidden &&
                  wv.size(1) == hidden,
              "qkv_rope: one bf16 row of the projections' width");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && nq % head_dim == 0 && nk % head_dim == 0 && nv == nk,
              "qkv_rope: projections of whole heads, as many value heads as key heads");
  TORCH_CHECK(cos.numel() == head_dim && sin.numel() == head_dim && cos.scalar_type() == torch::kBFloat16 &&
                  sin.scalar_type() == torch::kBFloat16,
              "qkv_rope: one bf16 cos and sin row of the head size");
  for (const auto* norm : {&q_norm, &k_norm})
    TORCH_CHECK(!norm->has_value() || ((*norm)->numel() == head_dim && (*norm)->scalar_type() == torch::kBFloat16),
                "qkv_rope: q/k norm weights of the head size");
  const torch::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  std::vector<float> acc(nq + nk + nv);
  const torch::Tensor* mats[3] = {&wq, &wk, &wv};
  const int64_t starts[4] = {0, nq, nq + nk, nq + nk + nv};
  // The rows of q, k and v as one range: each thread takes a contiguous stretch of it.
  at::parallel_for(0, starts[3], kGrain, [&](int64_t begin, int64_t end) {
    for (int m = 0; m < 3; ++m) {
      const int64_t lo = std::max(begin, starts[m]), hi = std::min(end, starts[m + 1]);
      if (lo >= hi) continue;
      const torch::Tensor& w = *mats[m];
      gemv_range(reinterpret_cast<const bf16*>(w.data_ptr()), w.stride(0), xv, hidden, lo - starts[m],
                 hi - starts[m], acc.data() + starts[m]);
    }
  });
  auto opts = x.options();
  torch::Tensor q = torch::empty({1, nq / head_dim, 1, head_dim}, opts);
  torch::Tensor k = torch::empty({1, nk / head_dim, 1, head_dim}, opts);
  torch::Tensor v = torch::empty({1, nv / head_dim, 1, head_dim}, opts);
  bf16* out[3] = {reinterpret_cast<bf16*>(q.data_ptr()), reinterpret_cast<bf16*>(k.data_ptr()),
                  reinterpret_cast<bf16*>(v.data_ptr())};
  for (int m = 0; m < 3; ++m)
    for (int64_t i = 0; i < starts[m + 1] - starts[m]; ++i) out[m][i] = to_bf16(acc[starts[m] + i]);
  const bf16* cv = reinterpret_cast<const bf16*>(cc.data_ptr());
  const bf16* sv = reinterpret_cast<const bf16*>(sc.data_ptr());
  const c10::optional<torch::Tensor>* norms[2] = {&q_norm, &k_norm};
  for (int m = 0; m < 2; ++m) {
    torch::Tensor weight = norms[m]->has_value() ? (*norms[m])->contiguous() : torch::Tensor();
    for (int64_t h = 0; h < (starts[m + 1] - starts[m]) / head_dim; ++h) {
      bf16* head = out[m] + h * head_dim;
      if (weight.defined()) {
        std::vector<bf16> normed(head_dim);
        rms_norm_row(head, reinterpret_cast<const bf16*>(weight.data_ptr()), head_dim, static_cast<float>(eps),
                     normed.data());
        std::memcpy(head, normed.data(), head_dim * sizeof(bf16));
      }
      rope_head(head, cv, sv, head_dim);
    }
  }
  return {q, k, v};
}

// softmax(q k^T * scale) v for one query over the cached keys and values ([1, kv_heads, T, d], any
// strides with contiguous rows), groups of query heads sharing a kv head; float32 throughout,
// the output rounded to bf16 as [1, 1, heads * d] (what o_proj takes).
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && q.size(0) == 1 && q.size(2) == 1,
              "attend: one query [1, heads, 1, d] and keys/values [1, kv_heads, T, d]");
  const int64_t heads = q.size(1), d = q.size(3), kv_heads = keys.size(1), len = keys.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && keys.size(3) == d && values.sizes() == keys.sizes() &&
                  len > 0 && keys.stride(3) == 1 && values.stride(3) == 1,
              "attend: keys and values of the query's head size, whole groups of heads");
  for (const auto* t : {&q, &keys, &values})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->device().is_cpu(), "attend: bf16 CPU tensors");
  const torch::Tensor qc = q.contiguous();
  const bf16* qv = reinterpret_cast<const bf16*>(qc.data_ptr());
  const bf16* kv = reinterpret_cast<const bf16*>(keys.data_ptr());
  const bf16* vv = reinterpret_cast<const bf16*>(values.data_ptr());
  const int64_t group = heads / kv_heads;
  torch::Tensor out = torch::empty({1, 1, heads * d}, q.options());
  bf16* ov = reinterpret_cast<bf16*>(out.data_ptr());
  // splitting heads across threads costs a wake-up: worth it only for long contexts
  const int64_t grain = heads * len * d >= (1 << 18) ? 1 : heads;
  at::parallel_for(0, heads, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scores(len), acc(d);
    for (int64_t h = first; h < last; ++h) {
      const int64_t g = h / group;
      float top = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {  // bf16 products are exact in float32: q need not be widened first
        scores[t] = dot_row(kv + g * keys.stride(1) + t * keys.stride(2), qv + h * d, d) * static_cast<float>(scale);
        top = std::max(top, scores[t]);
      }
      float total = 0.f;
      for (int64_t t = 0; t < len; ++t) total += (scores[t] = std::exp(scores[t] - top));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t)
        axpy_row(scores[t] / total, vv + g * values.stride(1) + t * values.stride(2), acc.data(), d);
      for (int64_t i = 0; i < d; ++i) ov[h * d + i] = to_bf16(acc[i]);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "bf16 matrix times one row, float32 sums");
  m.def("rms_norm", &rms_norm, "RMSNorm of a few bf16 rows");
  m.def("qkv_rope", &qkv_rope, "one token's q, k, v: projections, optional q/k norms, rotary embedding");
  m.def("attend", &attend, "one query's attention over cached keys and values");
  m.def("moe_decode", &moe_decode, "one token through k SiLU-gated experts, weighted and summed");
}
