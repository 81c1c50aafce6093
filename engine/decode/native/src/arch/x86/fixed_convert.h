// A decode input put in fixed point, 32 values at a time (AVX2): the integer dots' input
// (dots/fixed_input.h says what the planes and sums are).
#pragma once

#include <cstdint>

#include "../../base/features.h"
#include "../../base/scalar.h"

#if defined(MOESCOPE_AVX2_INT)
#define MOESCOPE_HAS_FIXED_GROUP 1
#define MOESCOPE_HAS_MXFP4_OFFSETS 1
namespace moescope {

// Values x[0..31] scaled by `inv`: both int8 planes (32 hi then 32 lo bytes at `planes`), the int16
// values (`wide`) and the two sums of 16 (`sum16`). cvtps rounds to nearest even as nearbyint does;
// v / 255 is never a half (255 is odd), so the float quotient rounds to the same `high` as the
// integer formula of the scalar path. `eight_bit`: x * inv rounded to a level in [-127, 127], the hi
// plane; the lo plane is zero and v = 255 * level.
inline void fixed_group(const bf16* x, float inv, bool eight_bit, int8_t* planes, int16_t* wide, int32_t* sum16) {
  __m256i high[4], low[4], v[4];
  const int32_t bound = eight_bit ? 127 : 32512;
  for (int part = 0; part < 4; ++part) {
    const __m256 values = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * part))), 16));
    const __m256i rounded = _mm256_min_epi32(_mm256_set1_epi32(bound), _mm256_max_epi32(_mm256_set1_epi32(-bound),
                                _mm256_cvtps_epi32(_mm256_mul_ps(values, _mm256_set1_ps(inv)))));
    if (eight_bit) {
      high[part] = rounded;
      low[part] = _mm256_setzero_si256();
      v[part] = _mm256_mullo_epi32(rounded, _mm256_set1_epi32(255));
      continue;
    }
    v[part] = rounded;
    high[part] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(v[part]), _mm256_set1_ps(1.f / 255.f)));
    low[part] = _mm256_sub_epi32(v[part], _mm256_mullo_epi32(high[part], _mm256_set1_epi32(255)));
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto pack = [&](const __m256i* w) {  // 32 int32 in [-127, 127] to 32 int8, in order
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
    return _mm256_permutevar8x32_epi32(words, order);
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(planes), pack(high));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(planes + 32), pack(low));
  for (int half = 0; half < 2; ++half)  // packs interleaves 128-bit lanes; the permute puts them in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + 16 * half),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(v[2 * half], v[2 * half + 1]), 0xD8));
  for (int half = 0; half < 2; ++half) {
    const __m256i pair = _mm256_add_epi32(v[2 * half], v[2 * half + 1]);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pair), _mm256_extracti128_si256(pair, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    sum16[half] = _mm_cvtsi128_si32(t);
  }
}

// idot_mxfp4 widens its codes to int16 levels with one table lookup, which leaves the table's first
// entry in each high byte: every level arrives as level + kMxfp4Offset (unsigned levels 0..24, as
// level + 12, plus 12 * 256), and the offset's products come off per block.
constexpr int16_t kMxfp4Offset = 12 * 257;

// Per 32 values of `wide`, 8 lanes: kMxfp4Offset times the sums of the lanes' 4 values (the lanes
// idot_mxfp4's products fall in).
inline void mxfp4_offsets(const int16_t* wide, int64_t groups, int32_t* out) {
  const __m256i offset = _mm256_set1_epi16(kMxfp4Offset);
  for (int64_t g = 0; g < groups; ++g)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * g),
                        _mm256_add_epi32(_mm256_madd_epi16(offset, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wide + 32 * g))),
                                         _mm256_madd_epi16(offset, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wide + 32 * g + 16)))));
}

}  // namespace moescope
#endif
