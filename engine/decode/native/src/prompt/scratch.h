// What every prompt tile path shares: the rows of W a tile holds on any path, and one thread's
// buffers for its tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../base/features.h"
#include "../formats/types.h"
#include "int8.h"
#include "tiles.h"

#if defined(MOESCOPE_X86)
#include "../arch/x86/prompt_amx.h"    // AMX tiles where the CPU has them
#include "../arch/x86/prompt_fixed.h"  // Q4_K, Q6_K and Q8_0 tiles in integers without bf16 dot products
#endif

namespace moescope {

#if !defined(MOESCOPE_X86)
constexpr int64_t kAmxRows = 0;
struct AmxInput {};  // no tiles: never made
inline bool amx_on() { return false; }
inline bool has_fixed_tiles(int32_t) { return false; }
#endif

constexpr int64_t kMaxTile = std::max(kTile, kAmxRows);  // rows of W per prompt tile, either path

// One thread's buffers for prompt tiles: bf16 rows expanded from blocks, or Q4_K rows unpacked.
struct TileScratch {
  std::vector<bf16> expanded;
  std::vector<float> wide;  // the tile's rows in float32 (variants without bf16 dot products)
  Q4KRows q4k;
  std::vector<float> sums;  // a tile's 8-bit products, [input row][kTile]
#if defined(MOESCOPE_FIXED_PROMPT)
  FixedTile fixed;  // a tile in integers for fixed-point inputs
#endif
};

// The tile's kTile rows at[] of a Q4_K matrix times expert e's 8-bit input groups (its rows from
// `first`), kInt8Rows rows of W at a time, then emitted together: emit(i, sums), sums[r] = x_i . w_r.
template <class Emit>
inline void int8_tile_times_rows(const Matrix& m, const int64_t* at, const Int8Groups& groups, int64_t e,
                                 int64_t first, TileScratch& scratch, Emit&& emit) {
  const int64_t g0 = groups.first[e], g1 = groups.first[e + 1];
  scratch.sums.resize((g1 - g0) * 8 * kTile);
  for (int64_t r0 = 0; r0 < kTile; r0 += kInt8Rows) {
    int64_t part[kInt8Rows];
    for (int j = 0; j < kInt8Rows; ++j) part[j] = at[std::min<int64_t>(r0 + j, kTile - 1)];
    scratch.q4k.load(m, part);
    for (int64_t g = g0; g < g1; ++g) {
      float sums[8 * kInt8Rows];
      int8_tile(scratch.q4k, groups, g, sums);
      for (int64_t lane = 0; lane < 8; ++lane)
        for (int64_t j = 0; j < kInt8Rows && r0 + j < kTile; ++j)
          scratch.sums[((g - g0) * 8 + lane) * kTile + r0 + j] = sums[lane * kInt8Rows + j];
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    const auto [row0, n] = groups.rows[g];
    for (int64_t lane = 0; lane < n; ++lane) emit(row0 - first + lane, &scratch.sums[((g - g0) * 8 + lane) * kTile]);
  }
}

}  // namespace moescope
