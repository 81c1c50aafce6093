// A decode input in fixed point, for the integer dots of block-quantized rows.
//
// Dequantizing each weight to float, as the reference-exact loops do, costs several instructions a
// weight and leaves a 4-bit row compute-bound at a fraction of what memory can deliver. As in
// llama.cpp's CPU kernels, the integer dots keep the weight levels integers: the input is put in
// fixed point once per call, the level-times-input products are summed in integer lanes, and each
// block's scales are applied once per sub-block in integers and once per block in float.
//
// Unlike llama.cpp, which rounds the input to 8 bits (Q8_K), the input keeps about 16 bits: each
// 256-element chunk of x is scaled so its largest magnitude is 32512 and split into two int8
// planes, x = 255 * hi + lo with both in [-127, 127] (base 255, not 256, so that negating a plane
// never overflows), and both planes are multiplied. The input's rounding error is then below 2^-15
// of the chunk's largest value, far under the bf16 rounding the input already has. The value itself
// (255 * hi + lo) is kept as int16 too, for kernels that take one int16 product per weight.
// What the dots compute is sum_i w_i * x_i with w_i the reference's float32 dequantized weight
// (scale * level - min), not rounded to bf16 first: within bf16 tolerance of the reference, not
// bit-equal to it (tests/test_quant_kernels.py holds every variant to that tolerance).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../arch/x86/fixed_convert.h"
#include "../base/scalar.h"
#include "../formats/blocks.h"
#include "../formats/types.h"

namespace moescope {

// Per 256-element chunk a float scale, per element hi/lo int8 planes, per 16 elements the integer
// sum of the fixed-point values (for the mins and level offsets). The planes are interleaved per 32
// elements (32 hi bytes, then their 32 lo bytes): one 64-byte load gives both planes of a group.
struct FixedInput {
  bool eight_bit = false;       // the lo plane is zero: x rounded to 8 bits (opt-in, lossy)
  std::vector<int8_t> planes;
  std::vector<float> scale;     // per chunk: x ~= scale * (255 * hi + lo)
  std::vector<int32_t> sum16;   // per 16 elements: sum of (255 * hi + lo)
  std::vector<float> sum32;     // per 32 elements, as float (Q4_K's mins)
  std::vector<int16_t> wide;    // per element 255 * hi + lo itself (|v| <= 32512), for int16 products
  std::vector<int32_t> mxfp4_offset;  // x86: per 32 elements, 8 lanes (arch/x86/fixed_convert.h)
  std::vector<bf16> source;    // the x these were made from

  const int8_t* hi_at(int64_t i) const { return planes.data() + 2 * i - i % 32; }  // hi of elements i...
  const int8_t* lo_at(int64_t i) const { return hi_at(i) + 32; }
  int32_t value(int64_t i) const { return 255 * hi_at(i)[0] + lo_at(i)[0]; }

  // value * inv to the nearest integer within +-bound: the fixed-point value, or an 8-bit level
  static int32_t fixed(float value, float inv, int32_t bound = 32512) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(value * inv));
    return std::max(-bound, std::min(bound, v));
  }

  // Fixed point of x, reused when this thread's last call had the same x (the gate/up input of
  // every expert of a layer): comparing 2 bytes an element costs far less than converting them.
  void prepare(const bf16* x, int64_t count, bool eight_bits = false) {
    if (eight_bits == eight_bit && static_cast<int64_t>(source.size()) == count &&
        std::memcmp(source.data(), x, count * sizeof(bf16)) == 0)
      return;
    source.assign(x, x + count);
    eight_bit = eight_bits;
    const int64_t chunks = (count + 255) / 256;
    planes.assign(2 * ((count + 31) / 32 * 32), 0);
    wide.assign((count + 31) / 32 * 32, 0);
    scale.resize(chunks);
    sum16.resize((count + 15) / 16);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * 256, end = std::min(count, begin + 256);
      float amax = 0.f;
      for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
      // 8 bits: x ~= scale * 255 * level, level = nearest(x * 127 / amax)
      const float s = amax > 0.f ? amax / (eight_bit ? 127.f * 255.f : 32512.f) : 1.f;
      scale[c] = s;
      const float inv = eight_bit ? (amax > 0.f ? 127.f / amax : 0.f) : 1.f / s;
      int64_t i = begin;
#if defined(MOESCOPE_HAS_FIXED_GROUP)
      for (; i + 32 <= end; i += 32)
        fixed_group(x + i, inv, eight_bit, planes.data() + 2 * i, wide.data() + i, sum16.data() + i / 16);
#endif
      for (; i < end; ++i) {
        const int32_t v = eight_bit ? 255 * fixed(to_float(x[i]), inv, 127) : fixed(to_float(x[i]), inv);
        const int32_t high = (v + (v >= 0 ? 127 : -127)) / 255;  // nearest: |v - 255 * high| <= 127
        planes[2 * i - i % 32] = static_cast<int8_t>(high);
        planes[2 * i - i % 32 + 32] = static_cast<int8_t>(v - 255 * high);
        wide[i] = static_cast<int16_t>(v);
        if (i % 16 == 0) sum16[i / 16] = 0;
        sum16[i / 16] += v;
      }
    }
    sum32.resize((count + 31) / 32);
    for (int64_t g = 0; g < static_cast<int64_t>(sum32.size()); ++g)
      sum32[g] = static_cast<float>(sum16[2 * g] + (2 * g + 1 < static_cast<int64_t>(sum16.size()) ? sum16[2 * g + 1] : 0));
#if defined(MOESCOPE_HAS_MXFP4_OFFSETS)
    mxfp4_offset.resize((count + 31) / 32 * 8);
    mxfp4_offsets(wide.data(), (count + 31) / 32, mxfp4_offset.data());
#endif
  }
};

// Portable integer dot: the reference's levels and scales of each block times the fixed-point
// input, summed in integers per 16 weights; the scales and mins applied in float.
inline float idot_row_generic(const Matrix& m, int64_t r, const FixedInput& in) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  BlockScales s;
  int32_t q[32];
  float sum = 0.f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    block_scales(m.type, b, s);
    const int64_t first = blk * be;
    float block = 0.f;
    for (int g = 0; g < groups; ++g) {
      group_levels(m.type, b, g, q);
      for (int half = 0; half < 2; ++half) {
        const int64_t at = first + 32 * g + 16 * half;
        int64_t t = 0;
        for (int l = 0; l < 16; ++l) t += static_cast<int64_t>(q[16 * half + l]) * in.value(at + l);
        const int sub = 2 * g + half;
        block += s.scale[sub] * static_cast<float>(t) - s.min[sub] * static_cast<float>(in.sum16[at / 16]);
      }
    }
    sum += block * in.scale[first / 256];
  }
  return sum;
}

}  // namespace moescope
