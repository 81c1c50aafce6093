// bf16 weight rows times a bf16 x (arm64): BFDOT where the CPU has it, else widened to float32.
#pragma once

#include <cstdint>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/tune.h"

namespace moescope {

#if defined(MOESCOPE_NEON)
#define MOESCOPE_HAS_DOT_ROW 1
#define MOESCOPE_HAS_DOT_F32_BF16 1

// 8 bf16 values (a bf16 is the top half of a float32): the low and high 4 as float32.
inline float32x4_t widen_bf16_low(uint16x8_t v) { return vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)); }
inline float32x4_t widen_bf16_high(uint16x8_t v) { return vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)); }

// One weight row with x, length k: four independent sums so that each multiply-add waits on its
// own accumulator only, one 64-byte line of weights (32 values) per pass.
inline float dot_row(const bf16* w, const bf16* x, int64_t k) {
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
#if defined(MOESCOPE_NEON_BF16)
  // BFDOT: lane j takes the products of values 2j and 2j + 1 (one instruction per 8 values).
  auto dot = [](float32x4_t acc, const bf16* a, const bf16* b) {
    return vbfdotq_f32(acc, vreinterpretq_bf16_u16(vld1q_u16(a)), vreinterpretq_bf16_u16(vld1q_u16(b)));
  };
  for (; i + 32 <= k; i += 32) {
    prefetch_far<false>(w + i + kPrefetchAhead);
    a0 = dot(a0, w + i, x + i);
    a1 = dot(a1, w + i + 8, x + i + 8);
    a2 = dot(a2, w + i + 16, x + i + 16);
    a3 = dot(a3, w + i + 24, x + i + 24);
  }
  for (; i + 8 <= k; i += 8) a0 = dot(a0, w + i, x + i);
#else
  auto fma8 = [](float32x4_t& lo, float32x4_t& hi, const bf16* a, const bf16* b) {
    const uint16x8_t va = vld1q_u16(a), vb = vld1q_u16(b);
    lo = vfmaq_f32(lo, widen_bf16_low(va), widen_bf16_low(vb));
    hi = vfmaq_f32(hi, widen_bf16_high(va), widen_bf16_high(vb));
  };
  for (; i + 32 <= k; i += 32) {
    prefetch_far<false>(w + i + kPrefetchAhead);
    fma8(a0, a1, w + i, x + i);
    fma8(a2, a3, w + i + 8, x + i + 8);
    fma8(a0, a1, w + i + 16, x + i + 16);
    fma8(a2, a3, w + i + 24, x + i + 24);
  }
  for (; i + 8 <= k; i += 8) fma8(a0, a1, w + i, x + i);
#endif
  float sum = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
  for (; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
}

// A float32 weight row with a bf16 x widened to float32, length k (a router kept in float32).
inline float dot_f32_bf16(const float* w, const bf16* x, int64_t k) {
  float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const uint16x8_t x0 = vld1q_u16(x + i), x1 = vld1q_u16(x + i + 8);
    a0 = vfmaq_f32(a0, vld1q_f32(w + i), widen_bf16_low(x0));
    a1 = vfmaq_f32(a1, vld1q_f32(w + i + 4), widen_bf16_high(x0));
    a2 = vfmaq_f32(a2, vld1q_f32(w + i + 8), widen_bf16_low(x1));
    a3 = vfmaq_f32(a3, vld1q_f32(w + i + 12), widen_bf16_high(x1));
  }
  float sum = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
  for (; i < k; ++i) sum += w[i] * to_float(x[i]);
  return sum;
}
#endif

}  // namespace moescope
