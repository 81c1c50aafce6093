// The portable reference of every one-row kernel: plain loops the compiler vectorises for whatever
// it targets. An instruction set's folder (arch/x86, arch/arm) replaces what it has a faster form
// of; dots/dots.h maps the rest here. Tests hold every variant's kernels to these values.
#pragma once

#include <cstdint>

#include "../base/scalar.h"
#include "../formats/blocks.h"
#include "../formats/types.h"

namespace moescope {

// One bf16 weight row with x, length k, summed in float32.
inline float dot_row_generic(const bf16* w, const bf16* x, int64_t k) {
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
}

// A float32 weight row with a bf16 x widened to float32, length k (a router kept in float32).
inline float dot_f32_bf16_generic(const float* w, const bf16* x, int64_t k) {
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += w[i] * to_float(x[i]);
  return sum;
}

// Row r of a block-quantized matrix times x: the reference's bf16 weights times x, summed in float32.
inline float qdot_row_generic(const Matrix& m, int64_t r, const bf16* x) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  BlockScales s;
  bf16 w[32];
  float sum = 0.f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    block_scales(m.type, b, s);
    for (int g = 0; g < groups; ++g) {
      group_weights(m.type, b, s, g, w);
      const bf16* xs = x + blk * be + 32 * g;
      for (int l = 0; l < 32; ++l) sum += to_float(w[l]) * to_float(xs[l]);
    }
  }
  return sum;
}

// group_weights' values as float32 (exact: they are bf16 values).
inline void group_weights_f32_generic(int32_t type, const uint8_t* b, const BlockScales& s, int g, float* w) {
  bf16 rounded[32];
  group_weights(type, b, s, g, rounded);
  for (int l = 0; l < 32; ++l) w[l] = to_float(rounded[l]);
}

}  // namespace moescope
