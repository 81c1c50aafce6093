// The row-wise steps around attention: RMSNorm, the rotary embedding, the residual add; each
// rounded as transformers' bf16 ops round.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "../base/check.h"
#include "../base/scalar.h"

namespace moescope {

// Llama's RMSNorm of one row of n: float32 statistics, the normalized row rounded to bf16, then
// times the bf16 weight (rounded again); `round_once`: GPT-OSS's, which multiplies the normalized
// row by the weight in float32 and rounds the product only.
inline void rms_norm_row(const bf16* in, const bf16* weight, int64_t n, float eps, bf16* out, bool round_once = false) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += to_float(in[i]) * to_float(in[i]);
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = to_float(in[i]) * scale;
    out[i] = to_bf16(to_float(weight[i]) * (round_once ? normed : round_bf16(normed)));
  }
}


// 1 / sqrt(mean(x^2) + eps) over `count` rows of d, `stride` apart, in order (as rms_norm_row sums).
inline float rms_scale(const bf16* rows, int64_t stride, int64_t count, int64_t d, float eps) {
  float squares = 0.f;
  for (int64_t r = 0; r < count; ++r)
    for (int64_t i = 0; i < d; ++i) squares += to_float(rows[r * stride + i]) * to_float(rows[r * stride + i]);
  return 1.f / std::sqrt(squares / static_cast<float>(count * d) + eps);
}


// Rotary embedding of one head, as transformers' apply_rotary_pos_emb in bf16:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16.
inline void rope_head(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  const int64_t half = d / 2;
  thread_local std::vector<float> in;
  in.resize(d);
  for (int64_t i = 0; i < d; ++i) in[i] = to_float(x[i]);
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -in[i + half] : in[i - half];
    x[i] = to_bf16(round_bf16(in[i] * to_float(cos[i])) + round_bf16(rotated * to_float(sin[i])));
  }
}

// DeepSeek's interleaved rotary embedding (apply_rotary_pos_emb_interleave): the pairs (x0, x1),
// (x2, x3), ... each turn by one angle, and the head comes out de-interleaved. The same roundings
// as rope_head on the de-interleaved head (transformers' comment says its version is
// bit-identical to that one).
inline void rope_head_interleaved(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  thread_local std::vector<bf16> pairs;
  pairs.assign(x, x + d);
  for (int64_t i = 0; i < d / 2; ++i) {
    x[i] = pairs[2 * i];
    x[d / 2 + i] = pairs[2 * i + 1];
  }
  rope_head(x, cos, sin, d);
}


// A token's cos and sin rows for heads of d, as rope_head reads them: rows of d values, or rows
// of half a head (GPT-OSS's rotary module), whose two halves rotate by the same angles (rotate_half's
// roundings are then the same), doubled here.
struct RotaryRows {
  std::vector<bf16> cos, sin;
  RotaryRows(const bf16* c, const bf16* s, int64_t n, int64_t d, const char* who) : cos(d), sin(d) {
    MOESCOPE_CHECK(n == d || 2 * n == d, who, ": one cos and sin row of the head size (or of half of it)");
    for (int64_t i = 0; i < d; ++i) {
      cos[i] = c[i % n];
      sin[i] = s[i % n];
    }
  }
};

// out = a + b in bf16, rounded as torch adds two bf16 tensors.
inline void add_rows(const bf16* a, const bf16* b, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(to_float(a[i]) + to_float(b[i]));
}


}  // namespace moescope
