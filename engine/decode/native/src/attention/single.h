// One query's softmax attention over cached keys and values, head by head: the scores, their
// softmax (with what some families add: sinks, an eager function's roundings), the weighted values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../base/features.h"
#include "../base/scalar.h"
#include "../base/simd.h"
#include "../dots/dots.h"

namespace moescope {

// v[i] = exp(v[i] - shift) for n values (v[i] <= shift); returns their sum. In the variant's float
// vectors (Cephes' single-precision polynomial, within ~2 ulp of std::exp): the softmax's
// exponentials were a large part of one-token attention's time (docs/performance-history.md).
inline float exp_shifted(float* v, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if defined(MOESCOPE_FLOAT_VECTOR)
  using V = FloatVector;
  const V by = V::all(shift);
  V sum = V::all(0.f);
  for (; i + V::lanes <= n; i += V::lanes) {
    const V e = (V::load(v + i) - by).exp();
    e.store(v + i);
    sum = sum + e;
  }
  total = sum.sum();
#endif
  for (; i < n; ++i) total += (v[i] = std::exp(v[i] - shift));
  return total;
}

// out[0, d) = sum over t of p[t] * rows[t], for `len` bf16 rows `stride` apart. The sums stay in
// registers across the rows, four vectors of columns at a time (accumulating in memory made every
// row wait for the previous row's store: most of one-query attention's time); narrower heads take
// two positions a step, so two sums are in flight.
inline void weighted_rows(const float* p, const bf16* rows, int64_t stride, int64_t len, int64_t d, float* out) {
  int64_t c = 0;
#if defined(MOESCOPE_FLOAT_VECTOR)
  using V = FloatVector;
  constexpr int64_t L = V::lanes;
  for (; c + 4 * L <= d; c += 4 * L) {
    V a0 = V::all(0.f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < len; ++t) {
      const V w = V::all(p[t]);
      const bf16* row = rows + t * stride + c;
      a0 = a0.fma(w, V::widen(row));
      a1 = a1.fma(w, V::widen(row + L));
      a2 = a2.fma(w, V::widen(row + 2 * L));
      a3 = a3.fma(w, V::widen(row + 3 * L));
    }
    a0.store(out + c);
    a1.store(out + c + L);
    a2.store(out + c + 2 * L);
    a3.store(out + c + 3 * L);
  }
  for (; c + L <= d;) {  // two vectors (Mixtral's 32-column heads in 16 lanes) or one, two positions a step
    const int64_t width = c + 2 * L <= d ? 2 : 1;
    V a0 = V::all(0.f), a1 = a0, b0 = a0, b1 = a0;
    int64_t t = 0;
    for (; t + 2 <= len; t += 2) {
      const bf16 *row = rows + t * stride + c, *next = row + stride;
      const V w = V::all(p[t]), u = V::all(p[t + 1]);
      a0 = a0.fma(w, V::widen(row));
      b0 = b0.fma(u, V::widen(next));
      if (width == 2) {
        a1 = a1.fma(w, V::widen(row + L));
        b1 = b1.fma(u, V::widen(next + L));
      }
    }
    if (t < len) {
      const V w = V::all(p[t]);
      a0 = a0.fma(w, V::widen(rows + t * stride + c));
      if (width == 2) a1 = a1.fma(w, V::widen(rows + t * stride + c + L));
    }
    (a0 + b0).store(out + c);
    if (width == 2) (a1 + b1).store(out + c + L);
    c += width * L;
  }
#endif
  for (; c < d; ++c) {
    float a = 0.f;
    for (int64_t t = 0; t < len; ++t) a += p[t] * to_float(rows[t * stride + c]);
    out[c] = a;
  }
}

// A layer's cached keys or values: [kv_heads, len] rows of d, contiguous within a row.
struct CacheView {
  const bf16* data;
  int64_t head_stride, position_stride;
};

// softmax(q k^T * scale) v for one query over `len` cached positions, groups of query heads
// sharing a kv head; float32 throughout, the output rounded to bf16 as [heads * d].
// Query head h (of a group sharing kv head g) over `len` cached positions into out[0, d).
// `scores`: len floats and `acc`: d floats of scratch.

// scores[t] = (key row t . q) * scale for positions [0, len); returns the largest. Keys 16 (AVX-512)
// or 8 (AVX2) at a time where the head size is whole vector steps (one query's attention spent most
// of its time in the per-position reductions).
inline float key_scores(const bf16* q, int64_t d, const bf16* keys, int64_t stride, int64_t len, float scale,
                        float* scores) {
  float top = -INFINITY;
  int64_t t = 0;
#if defined(MOESCOPE_AVX512BF16)
  if (d % 32 == 0) {
    const __m512 scaled = _mm512_set1_ps(scale);
    __m512 running = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= len; t += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const bf16* row = keys + (t + j) * stride;
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(q + i));
        acc[j] = a;
      }
      const __m512 block = _mm512_mul_ps(sum_lanes_16(acc), scaled);
      _mm512_storeu_ps(scores + t, block);
      running = _mm512_max_ps(running, block);
    }
    top = _mm512_reduce_max_ps(running);
  }
#elif defined(MOESCOPE_AVX2)
  constexpr int64_t kMaxHead = 512;
  if (d % 8 == 0 && d <= kMaxHead) {
    alignas(32) float qf[kMaxHead];  // q widened once, not once per key
    for (int64_t i = 0; i < d; i += 8) _mm256_store_ps(qf + i, widen_bf16_8(q + i));
    const __m256 scaled = _mm256_set1_ps(scale);
    __m256 running = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= len; t += 8) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const bf16* row = keys + (t + j) * stride;
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(widen_bf16_8(row + i), _mm256_load_ps(qf + i), a);
        acc[j] = a;
      }
      const __m256 block = _mm256_mul_ps(sum_lanes_8(acc), scaled);
      _mm256_storeu_ps(scores + t, block);
      running = _mm256_max_ps(running, block);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, running);
    for (float lane : lanes) top = std::max(top, lane);
  }
#endif
  for (; t < len; ++t) {  // bf16 products are exact in float32: q need not be widened first
    scores[t] = dot_row(keys + t * stride, q, d) * scale;
    top = std::max(top, scores[t]);
  }
  return top;
}

// What some families add to plain softmax attention: an attention sink per query head (GPT-OSS: a
// logit that joins the softmax's denominator only), and the roundings of an eager attention
// function, whose ops run in bf16 (the scores, their scaling, the shift by the maximum, the
// probabilities), so near-ties fall as they fall in the model's own code.
struct AttendExtras {
  const bf16* sinks = nullptr;  // [heads] or none
  bool eager_rounding = false;
};

// Head h's scores (its keys' products, times `scale` unless eager: then 1, and scaled here) into
// softmax probabilities in place; `top` is their largest.
inline void softmax_scores(float* scores, int64_t len, float top, float scale, const AttendExtras& extras, int64_t h) {
  const bool eager = extras.eager_rounding;
  if (eager) {
    top = -INFINITY;
    for (int64_t t = 0; t < len; ++t) top = std::max(top, scores[t] = round_bf16(round_bf16(scores[t]) * scale));
  }
  float sink = extras.sinks != nullptr ? to_float(extras.sinks[h]) : -INFINITY;
  top = std::max(top, sink);
  if (eager) {  // the shift rounded too; the exponentials then start from the shifted values
    for (int64_t t = 0; t < len; ++t) scores[t] = round_bf16(scores[t] - top);
    sink = round_bf16(sink - top);
    top = 0.f;
  }
  const float total = exp_shifted(scores, len, top) + (extras.sinks != nullptr ? std::exp(sink - top) : 0.f);
  if (eager)
    for (int64_t t = 0; t < len; ++t) scores[t] = round_bf16(scores[t] / total);
  else
    for (int64_t t = 0; t < len; ++t) scores[t] /= total;
}

inline void attend_head(const bf16* q, int64_t d, int64_t g, CacheView keys, CacheView values, int64_t len, float scale,
                 float* scores, float* acc, bf16* out, const AttendExtras& extras = {}, int64_t h = 0) {
  const float top = key_scores(q, d, keys.data + g * keys.head_stride, keys.position_stride, len,
                               extras.eager_rounding ? 1.f : scale, scores);
  softmax_scores(scores, len, top, scale, extras, h);
  weighted_rows(scores, values.data + g * values.head_stride, values.position_stride, len, d, acc);
  for (int64_t i = 0; i < d; ++i) out[i] = to_bf16(acc[i]);
}


}  // namespace moescope
