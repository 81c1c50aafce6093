// Each block type's fields as numbers: the per-sub-block scales and mins, and the integer levels of
// each 32-weight group. This is the reference every kernel is held to: a weight is
// (scale * level) - min in float32 with two roundings (the library is compiled with
// -ffp-contract=off), then rounded to bf16 as torch rounds the model's dequantized weights; the
// values of engine/formats/dequantize.py, itself checked against the gguf package.
#pragma once

#include <cstdint>
#include <cstring>

#include "../arch/x86/unpack.h"
#include "../base/features.h"
#include "../base/scalar.h"
#include "types.h"

namespace moescope {

// Q3_K's 16 scales (6 bits, stored + 32) as signed integers.
inline void q3_k_scales(const uint8_t* sc, int32_t* out) {
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
    const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    out[j] = (low | (high << 4)) - 32;
  }
}

// The per-sub-block scales (and mins) of one block, as float32 products the way the reference
// forms them (d * sc, dmin * m), for 16 sub-blocks of 16 (or 8 of 32, each given twice).
struct BlockScales {
  float scale[16];
  float min[16];  // subtracted after the product; 0 for the symmetric types
};

inline void block_scales(int32_t type, const uint8_t* b, BlockScales& s) {
  switch (type) {
    case kQ4_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      const uint8_t* q = b + 4;
#if defined(MOESCOPE_AVX2_INT)
      // The same values from q4_k_scales_mins' bytes, widened and multiplied 8 at a time (the
      // unpacking byte by byte took as long as expanding the block's weights), each stored twice
      // (scale[2j] and scale[2j + 1]).
      const __m128i bytes = q4_k_scales_mins(q);
      const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
      auto widen = [&](__m128i eight, float factor, float* out) {
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), _mm256_set1_ps(factor));
        _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(v, first));
        _mm256_storeu_ps(out + 8, _mm256_permutevar8x32_ps(v, second));
      };
      widen(bytes, d, s.scale);
      widen(_mm_srli_si128(bytes, 8), dmin, s.min);
      return;
#else
      for (int j = 0; j < 4; ++j) {  // k4_scale_min unrolled: sub-blocks j and j + 4
        s.scale[2 * j] = s.scale[2 * j + 1] = d * static_cast<float>(q[j] & 63);
        s.min[2 * j] = s.min[2 * j + 1] = dmin * static_cast<float>(q[j + 4] & 63);
        s.scale[2 * j + 8] = s.scale[2 * j + 9] = d * static_cast<float>((q[j + 8] & 0xF) | ((q[j] >> 6) << 4));
        s.min[2 * j + 8] = s.min[2 * j + 9] = dmin * static_cast<float>((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
      }
      return;
#endif
    }
    case kQ6_K: {
      const float d = half_to_float(b + 208);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
        s.min[j] = 0.f;
      }
      return;
    }
    case kQ3_K: {
      const float d = half_to_float(b + 108);
      int32_t scales[16];
      q3_k_scales(b + 96, scales);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d * static_cast<float>(scales[j]);
        s.min[j] = 0.f;
      }
      return;
    }
    case kQ2_K: {
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d * static_cast<float>(b[j] & 0xF);
        s.min[j] = dmin * static_cast<float>(b[j] >> 4);
      }
      return;
    }
    case kMXFP4:
    case kFP8: {  // one scale, no min: 2^(e - 128), or the tile's float32 scale over 2^9 (exact)
      float d;
      if (type == kMXFP4) {
        d = e8m0_half(b[0]);
      } else {
        std::memcpy(&d, b, 4);
        d *= 1.f / 512.f;
      }
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d;
        s.min[j] = 0.f;
      }
      return;
    }
    default: {  // the 32-element types: one scale, no min, for the block's one group (sub-blocks 0 and 1)
      const float d = half_to_float(b);
      s.scale[0] = s.scale[1] = d;
      s.min[0] = s.min[1] = 0.f;
    }
  }
}

// The 32 levels (integers, as float32 would hold them) of group g of a block: elements 32g..32g+31.
inline void group_levels(int32_t type, const uint8_t* b, int g, int32_t* q) {
  switch (type) {
    case kQ8_0:
      for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(b[2 + l]);
      return;
    case kQ4_0:
      for (int l = 0; l < 16; ++l) {
        q[l] = (b[2 + l] & 0xF) - 8;
        q[l + 16] = (b[2 + l] >> 4) - 8;
      }
      return;
    case kQ5_0: {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      // two loops of 16 with one shift pattern each: the compiler turns each into a few vector ops
      for (int l = 0; l < 16; ++l) q[l] = ((b[6 + l] & 0xF) | (((qh >> l) & 1) << 4)) - 16;
      for (int l = 0; l < 16; ++l) q[l + 16] = ((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16;
      return;
    }
    case kQ4_K: {
      const uint8_t* qs = b + 16 + 32 * (g / 2);
      const int shift = 4 * (g % 2);
      for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> shift) & 0xF;
      return;
    }
    case kMXFP4:
      for (int l = 0; l < 16; ++l) {
        q[l] = kMxfp4Values[b[1 + l] & 0xF];
        q[l + 16] = kMxfp4Values[b[1 + l] >> 4];
      }
      return;
    case kFP8:
      for (int l = 0; l < 32; ++l) q[l] = e4m3_level(b[4 + 32 * g + l]);
      return;
    case kQ6_K: {
      const int half = g / 4, j = g % 4;
      const uint8_t* ql = b + 64 * half + 32 * (j & 1);
      const uint8_t* qh = b + 128 + 32 * half;
      const int low_shift = 4 * (j >> 1), high_shift = 2 * j;
      for (int l = 0; l < 32; ++l) q[l] = (((ql[l] >> low_shift) & 0xF) | (((qh[l] >> high_shift) & 3) << 4)) - 32;
      return;
    }
    case kQ3_K: {
      const uint8_t* qs = b + 32 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      for (int l = 0; l < 32; ++l) q[l] = ((qs[l] >> shift) & 3) - (((b[l] >> g) & 1) ? 0 : 4);
      return;
    }
    case kQ2_K: {
      const uint8_t* qs = b + 16 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> shift) & 3;
      return;
    }
    default:
      return;
  }
}

// Weight values of group g as the reference computes them in float32, before any rounding: a
// float32 model's dequantized weights.
inline void group_values_f32(int32_t type, const uint8_t* b, const BlockScales& s, int g, float* w) {
  int32_t q[32];
  group_levels(type, b, g, q);
  for (int half = 0; half < 2; ++half) {  // a sub-block of 16 each: one scale and min, a loop that vectorises
    const float scale = s.scale[2 * g + half], min = s.min[2 * g + half];
    for (int l = 16 * half; l < 16 * half + 16; ++l) w[l] = scale * static_cast<float>(q[l]) - min;
  }
}

// Weight values of group g as the reference computes them, rounded to bf16.
inline void group_weights(int32_t type, const uint8_t* b, const BlockScales& s, int g, bf16* w) {
  float values[32];
  group_values_f32(type, b, s, g, values);
  for (int l = 0; l < 32; ++l) w[l] = to_bf16(values[l]);
}

// fn(at, block, s, g) for each 32-value group g of each block of rows [begin, end) of a block-quantized W,
// in order; `at` is the group's first element in a row-major [rows, cols] layout, `s` its block's scales.
template <typename Fn>
inline void for_each_group(const Matrix& m, int64_t begin, int64_t end, Fn fn) {
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  BlockScales s;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = m.row(n);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      block_scales(m.type, row + blk * bb, s);
      for (int g = 0; g < groups; ++g) fn(n * m.cols + blk * be + 32 * g, row + blk * bb, s, g);
    }
  }
}

}  // namespace moescope
