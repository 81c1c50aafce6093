// One query's multi-head latent attention (DeepSeek-V2/V3's MLA) over cached latents, with the
// up-projection absorbed.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "../base/scalar.h"
#include "../dots/dots.h"
#include "single.h"

namespace moescope {

// The sizes of one layer's multi-head latent attention (DeepSeek-V2/V3's MLA).
struct LatentShape {
  int64_t heads = 0, nope = 0, rope = 0, v_dim = 0, rank = 0;
};

// One thread's scratch for latent_head, for up to `len` positions.
struct LatentScratch {
  std::vector<float> q, acc, scores, rot;
  std::vector<bf16> absorbed, context;
  void fit(const LatentShape& s, int64_t len) {
    q.resize(s.nope);
    acc.resize(s.rank);
    scores.resize(len);
    rot.resize(len);
    absorbed.resize(s.rank);
    context.resize(s.rank);
  }
};

// Head h of one query of MLA over cached latents, with the up-projection absorbed
// (engine/decode/paths/latent_attention.py says why and writes it in torch). `up` is kv_b_proj's
// weight [heads * (nope + v), rank]: per head, W_uk [nope, rank] then W_uv [v, rank], read in place.
// Rounded where the torch version rounds:
//   a = q_nope W_uk (bf16)   s_t = (a . c_t + q_rot . k_rot_t) * scale   p = softmax(s)
//   ctx = sum_t p_t c_t (bf16)   out = W_uv ctx (bf16, v values)
inline void latent_head(const bf16* up, const LatentShape& s, int64_t h, const bf16* q_nope, const bf16* q_rot,
                        const bf16* latents, int64_t lat_stride, const bf16* k_rot, int64_t rot_stride, int64_t len,
                        float scale, LatentScratch& w, bf16* out) {
  const bf16* w_uk = up + h * (s.nope + s.v_dim) * s.rank;
  for (int64_t i = 0; i < s.nope; ++i) w.q[i] = to_float(q_nope[i]);
  weighted_rows(w.q.data(), w_uk, s.rank, s.nope, s.rank, w.acc.data());
  for (int64_t c = 0; c < s.rank; ++c) w.absorbed[c] = to_bf16(w.acc[c]);
  key_scores(w.absorbed.data(), s.rank, latents, lat_stride, len, 1.f, w.scores.data());
  key_scores(q_rot, s.rope, k_rot, rot_stride, len, 1.f, w.rot.data());
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) top = std::max(top, w.scores[t] = (w.scores[t] + w.rot[t]) * scale);
  const float total = exp_shifted(w.scores.data(), len, top);
  for (int64_t t = 0; t < len; ++t) w.scores[t] /= total;
  weighted_rows(w.scores.data(), latents, lat_stride, len, s.rank, w.acc.data());
  for (int64_t c = 0; c < s.rank; ++c) w.context[c] = to_bf16(w.acc[c]);
  const bf16* w_uv = w_uk + s.nope * s.rank;
  for (int64_t r = 0; r < s.v_dim; ++r) out[r] = to_bf16(dot_row(w_uv + r * s.rank, w.context.data(), s.rank));
}


}  // namespace moescope
