// One token's query, key and value for a layer of Llama-style attention: the projections (optional
// biases), the optional q/k RMSNorms and the rotary embedding, head by head.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "../base/check.h"
#include "../base/parallel.h"
#include "../base/scalar.h"
#include "../formats/types.h"
#include "../kernels/gemv.h"
#include "norms.h"

namespace moescope {

// A bf16 vector and its length, as the entry points take one (data null: none).
struct Vector {
  const bf16* data = nullptr;
  int64_t len = 0;
};

// `v`'s data after checking it holds n values; null where v is none.
inline const bf16* checked(const Vector& v, int64_t n, const char* name) {
  MOESCOPE_CHECK(v.data == nullptr || v.len == n, name, ": ", n, " values are needed, not ", v.len);
  return v.data;
}

// The weights of one layer's Llama-style attention, checked once.
struct AttentionWeights {
  Matrix wq, wk, wv;
  const bf16* q_norm = nullptr;  // none where the model has none
  const bf16* k_norm = nullptr;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // the first rotary_dim values of a q/k head turn (GLM-4-MoE: part of it); the rest pass
  float eps = 0.f;
  const bf16* bias[3] = {nullptr, nullptr, nullptr};  // q/k/v projections' biases (Qwen2-MoE, GPT-OSS), or none
  bool full_norm = false;  // q/k norms over the whole projection (OLMoE), before the rotary embedding

  void set_biases(const Vector& q, const Vector& k, const Vector& v) {
    bias[0] = checked(q, wq.rows, "q bias");
    bias[1] = checked(k, wk.rows, "k bias");
    bias[2] = checked(v, wv.rows, "v bias");
  }
};

inline AttentionWeights attention_weights(const Matrix& wq, const Matrix& wk, const Matrix& wv, const Vector& q_norm,
                                          const Vector& k_norm, double eps, int64_t head_dim, int64_t hidden) {
  MOESCOPE_CHECK(wq.cols == hidden && wk.cols == hidden && wv.cols == hidden,
                 "qkv_rope: one bf16 row of the projections' width");
  MOESCOPE_CHECK(head_dim > 0 && head_dim % 2 == 0 && wq.rows % head_dim == 0 && wk.rows % head_dim == 0 &&
                     wv.rows == wk.rows && wk.rows > 0 && (wq.rows / head_dim) % (wk.rows / head_dim) == 0,
                 "qkv_rope: projections of whole heads, as many value heads as key heads, whole groups of query heads");
  AttentionWeights out;
  out.wq = wq, out.wk = wk, out.wv = wv;
  out.head_dim = out.rotary_dim = head_dim;
  out.eps = static_cast<float>(eps);
  // q/k norms over one head, or (OLMoE) over the whole projection: then both are
  out.full_norm = q_norm.data != nullptr && q_norm.len != head_dim;
  out.q_norm = checked(q_norm, out.full_norm ? wq.rows : head_dim, "q_norm");
  out.k_norm = checked(k_norm, out.full_norm ? wk.rows : head_dim, "k_norm");
  MOESCOPE_CHECK(!out.full_norm || k_norm.data != nullptr, "q/k norms over the whole projection: both are needed");
  return out;
}

// The projection of q (m = 0), k (1) or v (2) the head takes its rows from.
inline const Matrix& head_matrix(const AttentionWeights& a, int m) { return m == 0 ? a.wq : m == 1 ? a.wk : a.wv; }

// project_head after its rows' sums (`rows`, d floats): rounded, biased, normed and rotated.
inline void finish_head(const AttentionWeights& a, int m, int64_t h, const bf16* cos, const bf16* sin,
                        const float* rows, bf16* normed, bf16* out) {
  const int64_t d = a.head_dim;
  round_linear(rows, a.bias[m] != nullptr ? a.bias[m] + h * d : nullptr, d, out);
  if (m == 2 || a.full_norm) return;  // values are neither normed nor rotated; full-width norms come later
  const bf16* norm = m == 0 ? a.q_norm : a.k_norm;
  if (norm != nullptr) {
    rms_norm_row(out, norm, d, a.eps, normed);
    std::memcpy(out, normed, d * sizeof(bf16));
  }
  rope_head(out, cos, sin, a.rotary_dim);
}

// One head of a token's q (m = 0), k (1) or v (2) for Llama-style attention: its rows of the
// projection, rounded, then for q and k the optional per-head RMSNorm (Qwen3) and the rotary
// embedding. `rows`: d floats of scratch; `normed`: d bf16 of scratch.
inline void project_head(const AttentionWeights& a, int m, int64_t h, const bf16* x, const bf16* cos, const bf16* sin,
                         float* rows, bf16* normed, bf16* out) {
  const int64_t d = a.head_dim;
  gemv_rows(head_matrix(a, m), x, h * d, (h + 1) * d, rows);
  finish_head(a, m, h, cos, sin, rows, normed, out);
}

// One token's query (into q), key and value (into k, v) for a layer of Llama-style attention.
// `acc` holds q + k + v rows of float32.
inline void qkv_rope_into(const AttentionWeights& a, const bf16* x, const bf16* cos, const bf16* sin, float* acc,
                          bf16* q, bf16* k, bf16* v) {
  const int64_t d = a.head_dim, q_heads = a.wq.rows / d, kv_heads = a.wk.rows / d;
  bf16* out[3] = {q, k, v};
  const int64_t first_head[4] = {0, q_heads, q_heads + kv_heads, q_heads + 2 * kv_heads};
  // Whole heads of q, k and v as one range: each thread projects its heads, rounds them, and
  // applies the norm and rotary embedding itself (no serial pass over all heads afterwards).
  parallel_for(0, first_head[3], 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> normed(d);
    for (int64_t head = begin; head < end; ++head) {
      const int m = head < first_head[1] ? 0 : head < first_head[2] ? 1 : 2;
      const int64_t h = head - first_head[m];
      project_head(a, m, h, x, cos, sin, acc + head * d, normed.data(), out[m] + h * d);
    }
  });
}

}  // namespace moescope
