// Integer dots of block-quantized rows with a fixed-point input (arm64): SDOT where the CPU has it,
// widening int8 multiplies otherwise. dots/fixed_input.h says what they compute and to what
// reference. Levels are taken signed (NEON multiplies int8 by int8), so no offsets come off
// except Q4_K's mins; the two input planes are summed apart and joined (255 * hi + lo) in float
// wherever a scale per sub-block could carry 255 * hi past int32.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/tune.h"
#include "../../dots/fixed_input.h"
#include "../../formats/types.h"

namespace moescope {

#if defined(MOESCOPE_NEON)
#define MOESCOPE_HAS_IDOT_ROW 1

// acc + the products of 16 int8 pairs: four to an int32 lane (SDOT), or two to an int16 then
// pairs of those to an int32 lane. Two products of int8 values (at most 128 * 127 each) fit int16.
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(MOESCOPE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  return vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), a, b));
#endif
}

// 32 levels (two vectors) times the 32 values of one plane of x.
inline int32x4_t dot32(int8x16_t first, int8x16_t second, const int8_t* plane) {
  return dot16(dot16(vdupq_n_s32(0), first, vld1q_s8(plane)), second, vld1q_s8(plane + 16));
}

// 255 * hi + lo in float: per block of 32 bounded in int32 (callers say why), so joined there.
inline float32x4_t joined(int32x4_t hi, int32x4_t lo) { return vcvtq_f32_s32(vmlaq_n_s32(lo, hi, 255)); }

// Q8_0: int8 levels, one fp16 scale per 32. |255 * hi sum| <= 255 * 32 * 128 * 127 fits int32.
inline float idot_q8_0(const uint8_t* row, int64_t blocks, const FixedInput& in) {
  const int8_t* planes = in.planes.data();
  const float* chunk_scale = in.scale.data();
  float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = acc0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 34;
    prefetch_block<false>(b, 34);
    const int8x16_t first = vld1q_s8(reinterpret_cast<const int8_t*>(b + 2));
    const int8x16_t second = vld1q_s8(reinterpret_cast<const int8_t*>(b + 18));
    const int8_t* x = planes + 64 * blk;
    const float32x4_t total = joined(dot32(first, second, x), dot32(first, second, x + 32));
    const float d = half_to_float(b) * chunk_scale[blk / 8];
    if (blk & 1)
      acc1 = vfmaq_n_f32(acc1, total, d);
    else
      acc0 = vfmaq_n_f32(acc0, total, d);
  }
  return vaddvq_f32(vaddq_f32(acc0, acc1));
}

// MXFP4: 4-bit codes looked up as int8 levels (|level| <= 12), one e8m0 scale per 32 weights;
// the input chunk's scale is applied once per 8 blocks.
inline float idot_mxfp4(const uint8_t* row, int64_t blocks, const FixedInput& in) {
  const int8x16_t table = vld1q_s8(kMxfp4Values);
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  const int8_t* planes = in.planes.data();
  const float* chunk_scale = in.scale.data();
  float total = 0.f;
  for (int64_t start = 0; start < blocks; start += 8) {  // the blocks of one 256-element input chunk
    const int64_t end = std::min(blocks, start + 8);
    float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = acc0;
    for (int64_t blk = start; blk < end; ++blk) {
      const uint8_t* b = row + blk * 17;
      if ((blk & 1) == 0) prefetch_block<false>(b, 34);
      const uint8x16_t codes = vld1q_u8(b + 1);  // low nibbles: elements 0-15, high: 16-31
      const int8x16_t first = vqtbl1q_s8(table, vandq_u8(codes, low4));
      const int8x16_t second = vqtbl1q_s8(table, vshrq_n_u8(codes, 4));
      const int8_t* x = planes + 64 * blk;
      const float32x4_t sums = joined(dot32(first, second, x), dot32(first, second, x + 32));
      if (blk & 1)
        acc1 = vfmaq_n_f32(acc1, sums, e8m0_half(b[0]));
      else
        acc0 = vfmaq_n_f32(acc0, sums, e8m0_half(b[0]));
    }
    total += vaddvq_f32(vaddq_f32(acc0, acc1)) * chunk_scale[start / 8];
  }
  return total;
}

// 255 * hi + lo of the two planes' sums, as floats (a product and a sum, rounded apart): with no lo
// plane (an 8-bit input), the product alone, which is what the sum leaves when lo is zero.
template <bool kLo>
inline float32x4_t join_planes(int32x4_t acc_hi, int32x4_t acc_lo) {
  if constexpr (kLo)
    return vmlaq_n_f32(vcvtq_f32_s32(acc_lo), vcvtq_f32_s32(acc_hi), 255.f);
  else
    return vmulq_n_f32(vcvtq_f32_s32(acc_hi), 255.f);
}

// Q4_K: levels 0..15 with a 6-bit scale and a 6-bit min per 32 weights. Each plane's scaled sum
// over a block stays in int32 (256 * 15 * 127 * 63); 255 * hi would not, so they join in float.
// kLo: the input has a lo plane (without one, an 8-bit input, its products are skipped).
template <bool kLo>
inline float idot_q4_k(const uint8_t* row, int64_t blocks, const FixedInput& in) {
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  const int8_t* planes = in.planes.data();
  const float* sum32 = in.sum32.data();
  const float* chunk_scale = in.scale.data();
  float32x4_t acc = vdupq_n_f32(0.f);
  float mins_total = 0.f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 144;
    prefetch_block<false>(b, 144);
    const uint8_t* q = b + 4;
    int32_t sc[8];
    float mins = 0.f;
    for (int j = 0; j < 4; ++j) {  // k4_scale_min unrolled: groups j and j + 4
      sc[j] = q[j] & 63;
      sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
      mins += static_cast<float>(q[j + 4] & 63) * sum32[blk * 8 + j];
      mins += static_cast<float>((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4)) * sum32[blk * 8 + j + 4];
    }
    int32x4_t acc_hi = vdupq_n_s32(0), acc_lo = acc_hi;
    for (int c = 0; c < 4; ++c) {  // 64 weights: low nibbles are group 2c, high ones 2c + 1
      const uint8x16_t bytes0 = vld1q_u8(b + 16 + 32 * c), bytes1 = vld1q_u8(b + 32 + 32 * c);
      const int8_t* x = planes + 64 * (blk * 8 + 2 * c);
      const int8x16_t low0 = vreinterpretq_s8_u8(vandq_u8(bytes0, nibble));
      const int8x16_t low1 = vreinterpretq_s8_u8(vandq_u8(bytes1, nibble));
      const int8x16_t high0 = vreinterpretq_s8_u8(vshrq_n_u8(bytes0, 4));
      const int8x16_t high1 = vreinterpretq_s8_u8(vshrq_n_u8(bytes1, 4));
      acc_hi = vmlaq_n_s32(acc_hi, dot32(low0, low1, x), sc[2 * c]);
      if constexpr (kLo) acc_lo = vmlaq_n_s32(acc_lo, dot32(low0, low1, x + 32), sc[2 * c]);
      acc_hi = vmlaq_n_s32(acc_hi, dot32(high0, high1, x + 64), sc[2 * c + 1]);
      if constexpr (kLo) acc_lo = vmlaq_n_s32(acc_lo, dot32(high0, high1, x + 96), sc[2 * c + 1]);
    }
    const float s = chunk_scale[blk];
    acc = vfmaq_n_f32(acc, join_planes<kLo>(acc_hi, acc_lo), half_to_float(b) * s);
    mins_total += half_to_float(b + 2) * s * mins;
  }
  return vaddvq_f32(acc) - mins_total;
}

// Q6_K: levels 0..63 (4 low bits + 2 high bits) minus 32, a signed 8-bit scale per 16 weights.
// Each plane's scaled sum over a block stays in int32 (256 * 32 * 127 * 128). kLo as Q4_K's.
template <bool kLo>
inline float idot_q6_k(const uint8_t* row, int64_t blocks, const FixedInput& in) {
  const uint8x16_t nibble = vdupq_n_u8(0x0F), two = vdupq_n_u8(3);
  const int8x16_t offset = vdupq_n_s8(32);
  const int8_t* planes = in.planes.data();
  const float* chunk_scale = in.scale.data();
  float32x4_t acc = vdupq_n_f32(0.f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 210;
    prefetch_block<false>(b, 210);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    int32x4_t acc_hi = vdupq_n_s32(0), acc_lo = acc_hi;
    for (int g = 0; g < 8; ++g) {  // group_levels' layout: 32 weights, sub-blocks 2g and 2g + 1
      const int half = g / 4, j = g % 4;
      const uint8_t* ql = b + 64 * half + 32 * (j & 1);
      const uint8_t* qh = b + 128 + 32 * half;
      const int8_t* x = planes + 64 * (blk * 8 + g);
      for (int part = 0; part < 2; ++part) {
        uint8x16_t low = vld1q_u8(ql + 16 * part);
        low = j >> 1 ? vshrq_n_u8(low, 4) : vandq_u8(low, nibble);
        uint8x16_t high = vld1q_u8(qh + 16 * part);
        high = vandq_u8(vshlq_u8(high, vdupq_n_s8(static_cast<int8_t>(-2 * j))), two);
        const int8x16_t levels = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(low, vshlq_n_u8(high, 4))), offset);
        const int32_t scale = scales[2 * g + part];
        acc_hi = vmlaq_n_s32(acc_hi, dot16(vdupq_n_s32(0), levels, vld1q_s8(x + 16 * part)), scale);
        if constexpr (kLo) acc_lo = vmlaq_n_s32(acc_lo, dot16(vdupq_n_s32(0), levels, vld1q_s8(x + 32 + 16 * part)), scale);
      }
    }
    acc = vfmaq_n_f32(acc, join_planes<kLo>(acc_hi, acc_lo), half_to_float(b + 208) * chunk_scale[blk]);
  }
  return vaddvq_f32(acc);
}

// sum over the row of (dequantized weight) * x: NEON forms for the common types, the portable
// integer dot for the rest.
inline float idot_row(const Matrix& m, int64_t r, const FixedInput& in) {
  const uint8_t* row = m.row(r);
  const int64_t blocks = m.cols / block_elements(m.type);
  switch (m.type) {
    case kQ8_0: return idot_q8_0(row, blocks, in);
    case kQ4_K: return in.eight_bit ? idot_q4_k<false>(row, blocks, in) : idot_q4_k<true>(row, blocks, in);
    case kQ6_K: return in.eight_bit ? idot_q6_k<false>(row, blocks, in) : idot_q6_k<true>(row, blocks, in);
    case kMXFP4: return idot_mxfp4(row, blocks, in);
    default: return idot_row_generic(m, r, in);
  }
}
#endif

}  // namespace moescope
