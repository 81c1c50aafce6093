// A block's packed fields into 256-bit byte vectors (AVX2): Q4_K's scales and mins, and the levels
// of the K-quants whose sub-blocks of 16 have their own scales. Shared by the dequantizer, the
// integer dots and the prompt tiles.
#pragma once

#include <cstdint>

#include "../../base/features.h"

#if defined(MOESCOPE_AVX2_INT)
namespace moescope {

// Q4_K's 8 scales then 8 mins (6 bits each, packed in the 12 bytes from q on; 16 bytes are read,
// the block goes on past them) as 16 bytes: scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3
// and 4-7; scales and mins 4-7 take 4 bits from bytes 8-11 (low and high nibble) and their top 2
// from the top bits of bytes 0-3 and 4-7.
inline __m128i q4_k_scales_mins(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i six = _mm_and_si128(low, _mm_set1_epi8(0x3F));
  const __m128i nibbles = _mm_and_si128(_mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0x8), _mm_set1_epi8(0x0F));
  const __m128i high = _mm_or_si128(nibbles, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
  return _mm_blend_epi32(six, high, 0xA);
}

// The unsigned levels of group g (32 weights) of a block, 32 bytes at a time, as group_levels reads
// them: Q6_K's 0..63 (32 above the signed level), Q2_K's 0..3, Q3_K's 0..7 with the mask bit on top
// (4 above).
inline __m256i q6_k_group_levels(const uint8_t* b, int g) {
  const int half = g / 4, j = g % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (j & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (j >> 1)), _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), _mm256_set1_epi8(3));
  return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

inline __m256i q2_q3_k_group_levels(const uint8_t* b, int g, bool three) {
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (three ? 32 : 16) + 32 * (g / 4)));
  const __m256i levels = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (g % 4)), _mm256_set1_epi8(3));
  if (!three) return levels;
  const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm256_or_si256(levels, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(mask, g), _mm256_set1_epi8(1)), 2));
}

}  // namespace moescope
#endif
