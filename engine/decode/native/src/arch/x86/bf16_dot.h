// bf16 weight rows times a bf16 x (x86): AVX-512 BF16 dot products, or widened to float32 and
// multiplied with FMAs (AVX-512F, AVX2).
#pragma once

#include <cstdint>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/simd.h"
#include "../../base/tune.h"

namespace moescope {

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F) || defined(MOESCOPE_AVX2)
#define MOESCOPE_HAS_DOT_ROW 1
#define MOESCOPE_HAS_DOT_F32_BF16 1

// One weight row with x, length k: independent sums so the loads stream back to back. (Summing
// 4 rows at once, to share the loads of x, streamed well below a plain read's speed, where one row
// at a time reaches it.)
template <bool kIntel>
inline float dot_row_tuned(const bf16* w, const bf16* x, int64_t k) {
#if defined(MOESCOPE_AVX512BF16)
  auto dot = [](__m512 acc, const bf16* a, const bf16* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
    for (int line = 0; line < 4; ++line) {
      prefetch_far<kIntel>(w + i + kPrefetchAhead + line * 32);
      if constexpr (kIntel) prefetch_near(reinterpret_cast<const char*>(w + i + line * 32) + kNearPrefetchBytes);
    }
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
    prefetch_far<kIntel>(w + i + kPrefetchAhead);
    a0 = _mm512_fmadd_ps(widen_bf16(w + i), widen_bf16(x + i), a0);
    a1 = _mm512_fmadd_ps(widen_bf16(w + i + 16), widen_bf16(x + i + 16), a1);
  }
  float tail = 0.f;
  for (; i < k; ++i) tail += to_float(w[i]) * to_float(x[i]);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail;
#else
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    prefetch_far<kIntel>(w + i + kPrefetchAhead);
    a0 = _mm256_fmadd_ps(widen_bf16_8(w + i), widen_bf16_8(x + i), a0);
    a1 = _mm256_fmadd_ps(widen_bf16_8(w + i + 8), widen_bf16_8(x + i + 8), a1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a0, a1));
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  for (; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
#endif
}

inline float dot_row(const bf16* w, const bf16* x, int64_t k) {
  return tuned([&](auto intel) { return dot_row_tuned<intel>(w, x, k); });
}

// A float32 weight row with a bf16 x widened to float32, length k (a router kept in float32).
inline float dot_f32_bf16(const float* w, const bf16* x, int64_t k) {
  using V = FloatVector;
  V a0 = V::all(0.f), a1 = a0;
  int64_t i = 0;
  for (; i + 2 * V::lanes <= k; i += 2 * V::lanes) {
    a0 = a0.fma(V::load(w + i), V::widen(x + i));
    a1 = a1.fma(V::load(w + i + V::lanes), V::widen(x + i + V::lanes));
  }
  float sum = (a0 + a1).sum();
  for (; i < k; ++i) sum += w[i] * to_float(x[i]);
  return sum;
}
#endif

}  // namespace moescope
