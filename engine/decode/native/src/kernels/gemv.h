// Matrix-vector products of one row: bf16 or block-quantized weights (their dots from dots/dots.h),
// row ranges for the threads to share, and the dequantized rows the prompt tiles and the exact
// path's scratch read.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../base/features.h"
#include "../base/scalar.h"
#include "../base/simd.h"
#include "../dots/dots.h"
#include "../formats/blocks.h"
#include "../formats/types.h"

namespace moescope {

// Whether one-row products take the integer dots or the reference-exact float loops; switched for
// tests and A/B measurements (moescope_set_integer_dots).
inline bool& integer_dots_enabled() {
  static bool enabled = true;
  return enabled;
}

// Whether the K-quants' integer dots take their input rounded to 8 bits (opt-in, lossy:
// --int8-inputs; the native paths set it from their live setting before they run,
// moescope_set_int8_inputs). The other types' dots take one 16-bit product per weight either way,
// so rounding their inputs would cost accuracy and save nothing.
inline bool& int8_inputs_enabled() {
  static bool enabled = false;
  return enabled;
}

inline bool int8_inputs_for(int32_t type) { return int8_inputs_enabled() && has_two_plane_dot(type); }

// out[n - first] = W[n, :] . x for rows [begin, end).
inline void gemv_into_rows(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out, int64_t first) {
  if (m.type == kBF16) {
    const bf16* w = reinterpret_cast<const bf16*>(m.data);
    const int64_t ld = m.row_bytes / 2;
    for (int64_t n = begin; n < end; ++n) out[n - first] = dot_row(w + n * ld, x, m.cols);
    return;
  }
  if (has_integer_dot(m.type) && integer_dots_enabled()) {
    thread_local FixedInput fixed;
    fixed.prepare(x, m.cols, int8_inputs_for(m.type));
    for (int64_t n = begin; n < end; ++n) out[n - first] = idot_row(m, n, fixed);
    return;
  }
  for (int64_t n = begin; n < end; ++n) out[n - first] = qdot_row(m, n, x);
}

// out_i[n - first] = W[n, :] . x_i for rows [begin, end) and `count` inputs (several replies' tokens
// at once), a weight row read from memory once however many inputs read it: the integer dots take
// each row with every input in one call (idot_rows, which may unpack a block once for several), the
// others a block of rows at a time for every input before the next. Each sum is the one-input
// loop's, to the bit (the same dot of the same row and input).
inline void gemv_many_into_rows(const Matrix& m, const bf16* const* xs, int64_t count, int64_t begin, int64_t end,
                                float* const* outs, int64_t first) {
  if (count == 1) return gemv_into_rows(m, xs[0], begin, end, outs[0], first);
  const bool integer = m.type != kBF16 && has_integer_dot(m.type) && integer_dots_enabled();
  thread_local std::vector<FixedInput> fixed;
  if (integer) {  // each row's products with every input in one call (idot_rows)
    if (static_cast<int64_t>(fixed.size()) < count) fixed.resize(count);
    std::array<const FixedInput*, 16> inputs{};
    std::array<float, 16> sums{};
    for (int64_t i = 0; i < count; ++i) fixed[i].prepare(xs[i], m.cols, int8_inputs_for(m.type));
    for (int64_t at = 0; at < count; at += 16) {
      const int64_t n = std::min<int64_t>(16, count - at);
      for (int64_t i = 0; i < n; ++i) inputs[i] = &fixed[at + i];
      for (int64_t r = begin; r < end; ++r) {
        idot_rows(m, r, inputs.data(), n, sums.data());
        for (int64_t i = 0; i < n; ++i) outs[at + i][r - first] = sums[i];
      }
    }
    return;
  }
  // about 16 KiB of weights a block, in the L1 cache across the inputs
  const int64_t block = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, m.row_bytes));
  const bf16* w = reinterpret_cast<const bf16*>(m.data);
  const int64_t ld = m.row_bytes / 2;
  for (int64_t b = begin; b < end; b += block) {
    const int64_t e = std::min(end, b + block);
    for (int64_t i = 0; i < count; ++i) {
      float* out = outs[i] - first;
      if (m.type == kBF16)
        for (int64_t n = b; n < e; ++n) out[n] = dot_row(w + n * ld, xs[i], m.cols);
      else
        for (int64_t n = b; n < e; ++n) out[n] = qdot_row(m, n, xs[i]);
    }
  }
}

// out[n] = W[n, :] . x for rows [begin, end).
inline void gemv_range(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out) {
  gemv_into_rows(m, x, begin, end, out, 0);
}

// The same for rows [begin, end), written from out[0] on (one head's rows of a projection).
inline void gemv_rows(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out) {
  gemv_into_rows(m, x, begin, end, out, begin);
}

// n outputs of a linear layer as F.linear gives them: the float32 sums plus the bias if any, rounded
// to bf16 once.
inline void round_linear(const float* acc, const bf16* bias, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(bias == nullptr ? acc[i] : acc[i] + to_float(bias[i]));
}

// Rows [begin, end) of W as float32 into out (row n at out's row n - first): the reference's values
// (bf16 ones), for products in float32 where the variant has no bf16 dot products.
inline void dequantize_rows_f32(const Matrix& m, int64_t begin, int64_t end, float* out, int64_t first = 0) {
  out -= first * m.cols;
  if (m.type == kBF16) {
    for (int64_t n = begin; n < end; ++n) {
      const bf16* row = reinterpret_cast<const bf16*>(m.row(n));
      for (int64_t c = 0; c < m.cols; ++c) out[n * m.cols + c] = to_float(row[c]);
    }
    return;
  }
  for_each_group(m, begin, end, [&](int64_t at, const uint8_t* block, const BlockScales& s, int g) {
    group_weights_f32(m.type, block, s, g, out + at);
  });
}

// Rows [begin, end) of W as the reference's float32 values, never rounded to bf16: what a float32
// model computes with (row n at out's row n - first).
inline void dequantize_rows_exact_f32(const Matrix& m, int64_t begin, int64_t end, float* out, int64_t first = 0) {
  if (m.type == kBF16) {
    dequantize_rows_f32(m, begin, end, out, first);
    return;
  }
  out -= first * m.cols;
  for_each_group(m, begin, end, [&](int64_t at, const uint8_t* block, const BlockScales& s, int g) {
    group_values_f32(m.type, block, s, g, out + at);
  });
}

// Rows [begin, end) of W dequantized to bf16 into out (row-major, cols per row; row n at out's row
// n - first): the reference's values.
inline void dequantize_rows(const Matrix& m, int64_t begin, int64_t end, bf16* out, int64_t first = 0) {
  out -= first * m.cols;
  if (m.type == kBF16) {
    for (int64_t n = begin; n < end; ++n) std::memcpy(out + n * m.cols, m.row(n), m.cols * sizeof(bf16));
    return;
  }
#if defined(MOESCOPE_HAS_DEQUANTIZE_ROW_Q4_K)
  if (m.type == kQ4_K) {
    tuned([&](auto intel) {
      for (int64_t n = begin; n < end; ++n) dequantize_row_q4_k<intel>(m.row(n), m.cols / 256, out + n * m.cols);
    });
    return;
  }
#endif
  for_each_group(m, begin, end, [&](int64_t at, const uint8_t* block, const BlockScales& s, int g) {
    group_weights_bf16(m.type, block, s, g, out + at);
  });
}

// out[begin, end) = columns [begin, end) of x W for a [rows = len(x), cols] bf16 matrix read as
// x @ W: row by row, each scaled by its x and added into the float32 sums (the rows stream in order).
// Four rows per pass over the sums: one load and one store of a sum per four weight vectors, not per
// one (the sums, not the weights, bounded the one-row loop). Each sum still takes its rows' products
// one at a time in row order, so the result is the one-row loop's to the bit.
inline void gemv_t_range(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out) {
  const bf16* base = reinterpret_cast<const bf16*>(m.data);
  const int64_t stride = m.row_bytes / 2;
  std::fill(out + begin, out + end, 0.f);
  int64_t i = 0;
#if defined(MOESCOPE_FLOAT_VECTOR)
  using V = FloatVector;
  for (; i + 4 <= m.rows; i += 4) {
    const bf16 *r0 = base + i * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;
    const V s0 = V::all(to_float(x[i])), s1 = V::all(to_float(x[i + 1])), s2 = V::all(to_float(x[i + 2])),
            s3 = V::all(to_float(x[i + 3]));
    int64_t j = begin;
    for (; j + V::lanes <= end; j += V::lanes)
      V::load(out + j).fma(s0, V::widen(r0 + j)).fma(s1, V::widen(r1 + j)).fma(s2, V::widen(r2 + j))
          .fma(s3, V::widen(r3 + j)).store(out + j);
    for (int64_t r = 0; r < 4; ++r) {
      const float xi = to_float(x[i + r]);
      const bf16* row = r0 + r * stride;
      for (int64_t t = j; t < end; ++t) out[t] += xi * to_float(row[t]);
    }
  }
#endif
  for (; i < m.rows; ++i) {
    const float xi = to_float(x[i]);
    const bf16* row = base + i * stride;
    int64_t j = begin;
#if defined(MOESCOPE_FLOAT_VECTOR)
    const FloatVector scale = FloatVector::all(xi);
    for (; j + FloatVector::lanes <= end; j += FloatVector::lanes)
      FloatVector::load(out + j).fma(scale, FloatVector::widen(row + j)).store(out + j);
#endif
    for (; j < end; ++j) out[j] += xi * to_float(row[j]);
  }
}

}  // namespace moescope
