// The query heads that share a kv head attended together (x86: AVX-512 BF16 or AVX2).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../../attention/single.h"
#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/simd.h"
#include "../../base/tune.h"
#include "../../dots/dots.h"

namespace moescope {

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX2)
#define MOESCOPE_HAS_GROUP_ATTENTION 1
// The query heads that share a kv head, attended together: each key and value row is read and
// widened once for the whole group instead of once per head, and the products of several heads
// are independent sums, so they no longer wait on each other. The same arithmetic as attend_head,
// in the same order per head, except that the few positions past its last full key step that fall
// in a group's smaller steps take the dot products' order instead of one sum. Where it applies:
// head sizes of whole value steps (4 vectors), groups that divide a reduction's lanes (lanes /
// group positions of the group's heads per reduction). With AVX-512 BF16 the keys stay bf16 (dot
// products of pairs); with AVX2 they are widened to float32 once per group.
#if defined(MOESCOPE_AVX512BF16)
constexpr int kGroupLanes = 16;
using GroupSums = __m512;
inline GroupSums group_sums_of(GroupSums* acc) { return sum_lanes_16(acc); }
#else
constexpr int kGroupLanes = 8;
using GroupSums = __m256;
inline GroupSums group_sums_of(GroupSums* acc) { return sum_lanes_8(acc); }
constexpr int64_t kGroupMaxHead = 512;  // q widened on the stack
#endif
constexpr int64_t kKeysAhead = 16;  // cached positions a group's loops ask for ahead of the one they read
constexpr int64_t kValueColumns = 4 * FloatVector::lanes;  // value columns per pass: 4 sums per head

inline bool group_attention_applies(int64_t group, int64_t d) {
#if defined(MOESCOPE_AVX2)
  if (d > kGroupMaxHead) return false;
#endif
  return d % kValueColumns == 0 && group <= kGroupLanes && kGroupLanes % group == 0;
}

// scores[j * len + t] = (key row t . q_j) * scale for the group's heads j, positions [0, len);
// top[j] = head j's largest.
template <int G>
inline void group_key_scores(const bf16* q, int64_t d, const bf16* keys, int64_t stride, int64_t len, float scale,
                             float* scores, float* top) {
  constexpr int P = kGroupLanes / G;  // positions per reduction
#if defined(MOESCOPE_AVX2)
  alignas(32) float qf[G * kGroupMaxHead];  // q widened once, not once per key
  for (int64_t i = 0; i < G * d; i += 8) _mm256_store_ps(qf + i, widen_bf16_8(q + i));
#endif
  alignas(64) float lanes[kGroupLanes];
#if defined(MOESCOPE_AVX512BF16)
  __m512 running = _mm512_set1_ps(-INFINITY);
#else
  __m256 running = _mm256_set1_ps(-INFINITY);
#endif
  int64_t t = 0;
  for (; t + P <= len; t += P) {
    for (int p = 0; p < P; ++p)  // a long context's keys come from memory: ask for them ahead
      for (int64_t b = 0; b < 2 * d; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(keys + (t + p + kKeysAhead) * stride) + b, _MM_HINT_T0);
    GroupSums acc[kGroupLanes];  // lane order j * P + p: head j's P positions side by side
#if defined(MOESCOPE_AVX512BF16)
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {  // independent sums, each key vector loaded once
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const __m512bh key = (__m512bh)_mm512_loadu_si512(keys + (t + p) * stride + i);
#pragma GCC unroll 16
        for (int j = 0; j < G; ++j)
          acc[j * P + p] = _mm512_dpbf16_ps(acc[j * P + p], key, (__m512bh)_mm512_loadu_si512(q + j * d + i));
      }
    }
    const __m512 block = _mm512_mul_ps(group_sums_of(acc), _mm512_set1_ps(scale));
    for (int j = 0; j < G; ++j)  // lanes j * P .. j * P + P - 1 to head j's positions t ..
      _mm512_mask_storeu_ps(scores + j * len + t - j * P, static_cast<__mmask16>(((1u << P) - 1) << (j * P)), block);
    running = _mm512_max_ps(running, block);
#else
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {  // independent sums, each key vector widened once
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256 key = widen_bf16_8(keys + (t + p) * stride + i);
#pragma GCC unroll 8
        for (int j = 0; j < G; ++j) acc[j * P + p] = _mm256_fmadd_ps(key, _mm256_load_ps(qf + j * d + i), acc[j * P + p]);
      }
    }
    const __m256 block = _mm256_mul_ps(group_sums_of(acc), _mm256_set1_ps(scale));
    _mm256_store_ps(lanes, block);
    for (int j = 0; j < G; ++j)
      for (int p = 0; p < P; ++p) scores[j * len + t + p] = lanes[j * P + p];
    running = _mm256_max_ps(running, block);
#endif
  }
#if defined(MOESCOPE_AVX512BF16)
  _mm512_store_ps(lanes, running);
#else
  _mm256_store_ps(lanes, running);
#endif
  for (int j = 0; j < G; ++j) {
    top[j] = -INFINITY;
    for (int p = 0; p < P; ++p) top[j] = std::max(top[j], lanes[j * P + p]);
  }
  for (; t < len; ++t)
    for (int j = 0; j < G; ++j) {
      scores[j * len + t] = dot_row(keys + t * stride, q + j * d, d) * scale;
      top[j] = std::max(top[j], scores[j * len + t]);
    }
}

// out[j * d + c] = sum over t of p[j * len + t] * rows[t][c] for H heads j, kValueColumns columns
// at a time: 4H sums in registers, each value row widened once per step for all of them. Positions
// [first, last) only, added to the sums already in `out` unless `first` is 0 (a float32 sum stored
// and loaded again is the same sum, so blocks of positions give the one pass's result).
template <int H>
inline void group_weighted_rows(const float* p, int64_t len, const bf16* rows, int64_t stride, int64_t d,
                                int64_t first, int64_t last, float* out) {
  constexpr int64_t lanes = FloatVector::lanes;
  for (int64_t c = 0; c < d; c += kValueColumns) {
    FloatVector acc[H][4];
    for (int j = 0; j < H; ++j)
      for (int k = 0; k < 4; ++k)
        acc[j][k] = first == 0 ? FloatVector::all(0.f) : FloatVector::load(out + j * d + c + lanes * k);
    for (int64_t t = first; t < last; ++t) {
      const bf16* row = rows + t * stride + c;
      for (int64_t b = 0; b < 2 * kValueColumns; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kKeysAhead * stride) + b, _MM_HINT_T0);
      const FloatVector v[4] = {FloatVector::widen(row), FloatVector::widen(row + lanes),
                                FloatVector::widen(row + 2 * lanes), FloatVector::widen(row + 3 * lanes)};
      for (int j = 0; j < H; ++j) {
        const FloatVector w = FloatVector::all(p[j * len + t]);
        for (int k = 0; k < 4; ++k) acc[j][k] = acc[j][k].fma(w, v[k]);
      }
    }
    for (int j = 0; j < H; ++j)
      for (int k = 0; k < 4; ++k) acc[j][k].store(out + j * d + c + lanes * k);
  }
}

// Positions per block of the values' passes: where a group needs several passes (more heads than
// one pass holds, or wider heads than one pass's columns), each block is read from memory once and
// again from the first-level cache, instead of the whole cache once per pass.
constexpr int64_t kValueBlock = 64;

template <int G>
inline void attend_group_of(const bf16* q, int64_t d, int64_t g, CacheView keys, CacheView values, int64_t len,
                            float scale, float* scores, float* acc, bf16* out, const AttendExtras& extras, int64_t h0) {
  float top[G];
  group_key_scores<G>(q, d, keys.data + g * keys.head_stride, keys.position_stride, len,
                      extras.eager_rounding ? 1.f : scale, scores, top);
  for (int j = 0; j < G; ++j) softmax_scores(scores + j * len, len, top[j], scale, extras, h0 + j);
  // heads per pass over the values: 4H sums and 4 value vectors in the 32 (AVX-512) or 16 registers
  constexpr int H = std::min(G, FloatVector::lanes == 16 ? 4 : 2);
  for (int64_t first = 0; first < len; first += kValueBlock)
    for (int j = 0; j < G; j += H)
      group_weighted_rows<H>(scores + j * len, len, values.data + g * values.head_stride, values.position_stride, d,
                             first, std::min(len, first + kValueBlock), acc + j * d);
  for (int64_t i = 0; i < G * d; ++i) out[i] = to_bf16(acc[i]);
}
#endif

}  // namespace moescope
