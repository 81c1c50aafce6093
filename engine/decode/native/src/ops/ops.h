// The library's one-call kernels, on checked matrices and plain pointers (abi.cpp checks and
// converts the C ABI's arguments into these). Each says what torch op it stands for.
#pragma once

#include <cstdint>
#include <vector>

#include "../attention/qkv.h"
#include "../attention/single.h"
#include "../base/scalar.h"
#include "../formats/types.h"
#include "../kernels/experts.h"

namespace moescope {

// y = W x (+ bias) for one row x, as F.linear: the bias added to the float32 sums before the one
// rounding to bf16, as torch's addmm does.
void gemv(const Matrix& w, const bf16* x, const bf16* bias, bf16* y);

// How dequantize writes W: the reference's values as bf16, as float32 holding those bf16 values (as
// the prompt tiles of variants without bf16 dot products expand it), or as float32 never rounded (a
// float32 model's weights). The numbers are the ABI's (moescope_dequantize's out_kind).
enum class Dequantized : int { kBF16 = 0, kFloat32OfBF16 = 1, kFloat32 = 2 };

// W dequantized into out [rows, cols] (the reference's values), written as `kind` says.
void dequantize(const Matrix& w, void* out, Dequantized kind);

// y = x W^T (+ bias) for bf16 rows x [m, cols] (prompt/linear.h).
void linear(const Matrix& w, const bf16* x, int64_t m, const bf16* bias, bool int8_inputs, bf16* y);

// RMSNorm over the last dimension of a few rows (a decode step's hidden state, or its heads for
// q/k norms). One call instead of transformers' eight small ops.
void rms_norm(const bf16* x, int64_t rows, const bf16* weight, int64_t n, float eps, bool round_once, bf16* y);

// One token's q [heads, d], k and v [kv_heads, d], as the attention module hands them to the KV cache.
void qkv_rope(const bf16* x, const AttentionWeights& a, const bf16* cos, const bf16* sin, bf16* q, bf16* k, bf16* v);

// One query [heads, d] over cached keys and values; out [heads * d] (what o_proj takes).
void attend(const bf16* q, int64_t heads, int64_t d, int64_t kv_heads, CacheView keys, CacheView values, int64_t len,
            float scale, const AttendExtras& extras, bf16* out);

// One query of multi-head latent attention over `latents` [len, rank] and `k_rot` [len, rope],
// every head; `up` is kv_b_proj's weight [heads * (nope + v), rank].
void latent_attend(const bf16* up, int64_t heads, int64_t nope, int64_t rope, int64_t rank, int64_t v_dim,
                   const bf16* q_nope, const bf16* q_rot, const bf16* latents, int64_t latent_stride,
                   const bf16* k_rot, int64_t rot_stride, int64_t len, float scale, bf16* out);

// One token through k gated experts, weighted and summed (kernels/experts.h).
void moe_decode(const bf16* x, int64_t hidden, const std::vector<ExpertWeights>& picked, const float* weights,
                bool bf16_weights, const GateRecipe& recipe, bf16* y);

// A prompt's expert outputs weighted and summed per token, as the expert cache's torch ops compute
// them (engine/offload/expert_cache.py): `y` [n, hidden] bf16 rows sorted by expert, `weights` [n]
// their routing weights (float32 values; `bf16_weights`: bf16 ones, as some routers leave them),
// `order` [n] each sorted row's flat place (token * top_k + pick). Token t's row is the sum over its
// picks j, in pick order, of y * weight: each product rounded to float32 (to bf16 too where the
// weights are bf16, as torch's bf16 product is), added to a float32 sum started at 0 (no fused
// multiply-add: -ffp-contract=off), then rounded to bf16 once. One pass instead of a product, a
// scatter, a sum and a cast.
void combine_rows(const bf16* y, int64_t n, int64_t hidden, const float* weights, bool bf16_weights,
                  const int64_t* order, int64_t top_k, bf16* out);

}  // namespace moescope
