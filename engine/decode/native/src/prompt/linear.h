// A prompt's rows through one weight matrix, as F.linear: y = x W^T (+ bias).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "../base/check.h"
#include "../base/parallel.h"
#include "../base/scalar.h"
#include "../formats/types.h"
#include "int8.h"
#include "scratch.h"
#include "tiles.h"

namespace moescope {

// y = x W^T (+ bias) for bf16 rows x [m, cols] and a bf16 or block-quantized W [rows, cols]: what
// F.linear gives on the dequantized W (float32 sums of bf16 products, the bias added, one rounding),
// within float32 summation order. With `int8_inputs` (opt-in, lossy) a Q4_K W takes x rounded to 8
// bits (prompt/int8.h), as the prompt's experts do.
inline void linear_rows(const Matrix& w, const bf16* x, int64_t m, const bf16* b, bool int8_inputs, bf16* out) {
  MOESCOPE_CHECK(w.cols % 32 == 0, "linear_rows: a multiple of 32 columns is needed");
  const int64_t n = w.rows, k = w.cols;
  const bool int8 = int8_inputs && w.type == kQ4_K && k % 256 == 0;
  std::unique_ptr<Int8Groups> groups = int8 ? std::make_unique<Int8Groups>(std::vector<int64_t>{0},
                                                                            std::vector<int64_t>{m}, k) : nullptr;
  PromptInput in(x, k, {0}, {int8 ? 0 : m}, has_fixed_tiles(w.type));  // the 8-bit path reads no blocks
  if (int8)
    parallel_for(0, groups->groups(), 1, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) groups->fill(g, x);
    });
  else
    parallel_for(0, in.block_count(), 1, [&](int64_t first, int64_t last) { in.pack(first, last); });
#if defined(MOESCOPE_AMX)
  std::unique_ptr<AmxInput> operands;
  if (!int8 && amx_on()) {
    operands = std::make_unique<AmxInput>(x, k, std::vector<int64_t>{0}, std::vector<int64_t>{m});
    parallel_for(0, operands->blocks(), 1, [&](int64_t first, int64_t last) { operands->pack(first, last); });
  }
  const int64_t height = operands ? kAmxRows : kTile;
#else
  const int64_t height = kTile;
#endif
  const int64_t tiles = (n + height - 1) / height;
  parallel_for(0, tiles, 1, [&](int64_t first_tile, int64_t last_tile) {
    TileScratch scratch;
    scratch.expanded.resize(int8 ? 0 : height * k);
    scratch.wide.resize(in.block_count() && !in.fixed ? kTile * k : 0);
#if defined(MOESCOPE_AMX)
    if (operands) amx_configure();
#endif
    for (int64_t t = first_tile; t < last_tile; ++t) {
      const int64_t r0 = t * height, r1 = std::min(n, r0 + height);
      int64_t at[kMaxTile];
      for (int64_t r = 0; r < height; ++r) at[r] = std::min(r0 + r, r1 - 1);  // past the last row: the last again, its sums unused
      auto emit = [&](int64_t i, const float* sums) {
        for (int64_t r = r0; r < r1; ++r)
          out[i * n + r] = to_bf16(b == nullptr ? sums[r - r0] : sums[r - r0] + to_float(b[r]));
      };
      if (int8) {
        int8_tile_times_rows(w, at, *groups, 0, 0, scratch, emit);
        continue;
      }
#if defined(MOESCOPE_AMX)
      if (operands) {
        const __mmask16 keep = static_cast<__mmask16>((1u << (r1 - r0)) - 1);
        const __m512 bias = b != nullptr ? widen_bf16_masked(b + r0, keep) : _mm512_setzero_ps();
        amx_tile_times_rows(amx_rows(w, at, scratch.expanded.data()), *operands, 0, 0,
                            [&](int64_t i0, int64_t rows, const float* c) {
                              for (int64_t i = i0; i < i0 + rows; ++i) {
                                const __m512 sums = amx_column(c, i - i0);
                                _mm256_mask_storeu_epi16(out + i * n + r0, keep, (__m256i)_mm512_cvtneps_pbh(
                                    b != nullptr ? _mm512_add_ps(sums, bias) : sums));
                              }
                            });
        continue;
      }
#endif
#if defined(MOESCOPE_FIXED_PROMPT)
      if (in.fixed) {
        fixed_tile_times_rows(w, at, in, 0, 0, m, scratch.fixed, emit);
        continue;
      }
#endif
      TileRows rows;
      tile_rows(w, at, rows, scratch.expanded.data(), scratch.wide.data());
      tile_times_rows(rows, in, 0, 0, m, emit);
    }
#if defined(MOESCOPE_AMX)
    if (operands) _tile_release();
#endif
  });
}

}  // namespace moescope
