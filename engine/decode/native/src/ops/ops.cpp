// The one-call kernels (ops.h).
#include "ops.h"

#include <vector>

#include "../attention/attend.h"
#include "../attention/latent.h"
#include "../attention/norms.h"
#include "../base/check.h"
#include "../base/parallel.h"
#include "../kernels/gemv.h"
#include "../prompt/linear.h"

namespace moescope {

namespace {
constexpr int64_t kGrain = 64;  // rows per task: ~128 KB of weights, enough to hide a task's start
}  // namespace

void gemv(const Matrix& w, const bf16* x, const bf16* bias, bf16* y) {
  std::vector<float> acc(w.rows);
  parallel_for(0, w.rows, kGrain, [&](int64_t begin, int64_t end) { gemv_range(w, x, begin, end, acc.data()); });
  round_linear(acc.data(), bias, w.rows, y);
}

void dequantize(const Matrix& w, void* out, Dequantized kind) {
  // at least ~32K weights a thread: a small expert's matrix (the demo's) costs less than waking a team
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(w.cols, 1));
  parallel_for(0, w.rows, grain, [&](int64_t begin, int64_t end) {
    switch (kind) {
      case Dequantized::kBF16:
        return dequantize_rows(w, begin, end, static_cast<bf16*>(out));
      case Dequantized::kFloat32OfBF16:
        return dequantize_rows_f32(w, begin, end, static_cast<float*>(out));
      case Dequantized::kFloat32:
        return dequantize_rows_exact_f32(w, begin, end, static_cast<float*>(out));
    }
  });
}

void linear(const Matrix& w, const bf16* x, int64_t m, const bf16* bias, bool int8_inputs, bf16* y) {
  linear_rows(w, x, m, bias, int8_inputs, y);
}

void rms_norm(const bf16* x, int64_t rows, const bf16* weight, int64_t n, float eps, bool round_once, bf16* y) {
  for (int64_t row = 0; row < rows; ++row) rms_norm_row(x + row * n, weight, n, eps, y + row * n, round_once);
}

void qkv_rope(const bf16* x, const AttentionWeights& a, const bf16* cos, const bf16* sin, bf16* q, bf16* k, bf16* v) {
  std::vector<float> acc(a.wq.rows + 2 * a.wk.rows);
  qkv_rope_into(a, x, cos, sin, acc.data(), q, k, v);
}

void attend(const bf16* q, int64_t heads, int64_t d, int64_t kv_heads, CacheView keys, CacheView values, int64_t len,
            float scale, const AttendExtras& extras, bf16* out) {
  attend_into(q, heads, d, kv_heads, keys, values, len, scale, out, extras);
}

void latent_attend(const bf16* up, int64_t heads, int64_t nope, int64_t rope, int64_t rank, int64_t v_dim,
                   const bf16* q_nope, const bf16* q_rot, const bf16* latents, int64_t latent_stride,
                   const bf16* k_rot, int64_t rot_stride, int64_t len, float scale, bf16* out) {
  const LatentShape shape{heads, nope, rope, v_dim, rank};
  parallel_for(0, heads, 1, [&](int64_t first, int64_t last) {
    LatentScratch scratch;
    scratch.fit(shape, len);
    for (int64_t h = first; h < last; ++h)
      latent_head(up, shape, h, q_nope + h * nope, q_rot + h * rope, latents, latent_stride, k_rot, rot_stride, len,
                  scale, scratch, out + h * v_dim);
  });
}

void moe_decode(const bf16* x, int64_t hidden, const std::vector<ExpertWeights>& picked, const float* weights,
                bool bf16_weights, const GateRecipe& recipe, bf16* y) {
  moe_experts(recipe, x, hidden, picked[0].inter, picked, weights, bf16_weights, y);
}

void combine_rows(const bf16* rows, int64_t n, int64_t hidden, const float* w, bool bf16_weights,
                  const int64_t* place, int64_t top_k, bf16* o) {
  MOESCOPE_CHECK(top_k > 0 && n % top_k == 0, "combine_rows: whole tokens of top_k rows");
  std::vector<int64_t> row_of(n, -1);  // flat place -> sorted row
  for (int64_t r = 0; r < n; ++r) {
    MOESCOPE_CHECK(place[r] >= 0 && place[r] < n && row_of[place[r]] < 0, "combine_rows: order is not a permutation");
    row_of[place[r]] = r;
  }
  const int64_t tokens = n / top_k;
  parallel_for(0, tokens, 1, [&](int64_t first, int64_t last) {
    std::vector<float> sum(hidden);
    for (int64_t t = first; t < last; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t r = row_of[t * top_k + j];
        const bf16* row = rows + r * hidden;
        const float weight = w[r];
        if (bf16_weights)
          for (int64_t c = 0; c < hidden; ++c) sum[c] += round_bf16(to_float(row[c]) * weight);
        else
          for (int64_t c = 0; c < hidden; ++c) sum[c] += to_float(row[c]) * weight;
      }
      for (int64_t c = 0; c < hidden; ++c) o[t * hidden + c] = to_bf16(sum[c]);
    }
  });
}

}  // namespace moescope
