// Opt-in lossy prompt path: a prompt's rows rounded to 8 bits and multiplied by Q4_K experts in
// integers, as llama.cpp's CPU kernels do (its Q8_K activations).
//
// Used by moe_prompt and linear_rows when asked. Why: at
// prefill the bf16 tile path is bound by the bf16 dot-product rate, and an 8-bit dot product
// (4 byte products summed into an int32 lane per instruction) does more than twice the work per
// instruction on the CPUs that have it. What it costs: each 256 values of an input row share one
// scale, max|x| / 127, so an input is off by up to half a step of that (the weights are the
// reference's, unchanged); bench/lossy_cost.py measures what that does to answers.
//
// Layout: an expert's rows go in groups of 8 (the last padded with zero rows), and a group's
// bytes are interleaved 4 at a time (k-group u: 8 rows x 4 bytes = 32 bytes), so one 256-bit
// register holds 4 consecutive inputs of 8 rows. A weight row's 4 levels are broadcast to all 8
// lanes and one dpbusd gives 8 rows' partial sums. A sub-block's scale is one number for the whole
// register, so it is applied once per 32 inputs in float; the block's mins multiply the exact
// float sums of x (not the rounded ones), so only the scaled products carry the 8-bit rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../base/features.h"
#include "../base/scalar.h"
#include "../formats/blocks.h"
#include "../formats/types.h"
#include "tiles.h"

namespace moescope {

// Rows of W per int8_tile, 8 input rows at a time: 3 fit AVX2's registers (6 spill them, and the
// spills cost more than the wider tile saves) and split the prompt's 6-row tile evenly (4 wasted a
// quarter of the work).
constexpr int kInt8Rows = 3;

// x rounded to 8 bits, 8 rows at a time, for one matrix width k (a multiple of 256).
struct Int8Groups {
  int64_t k = 0;
  std::vector<int64_t> first;                      // each expert's first group, then the total
  std::vector<std::pair<int64_t, int64_t>> rows;   // each group's first row of x and row count (<= 8)
  std::vector<int8_t> q;                           // per group: [k / 4][8 rows][4]
  std::vector<float> scale;                        // per group: [k / 256][8]: x ~= scale * q
  std::vector<float> sums;                         // per group: [k / 32][8]: the float sums of x

  Int8Groups(const std::vector<int64_t>& start, const std::vector<int64_t>& count, int64_t width) : k(width) {
    for (size_t e = 0; e < count.size(); ++e) {
      first.push_back(static_cast<int64_t>(rows.size()));
      for (int64_t r = 0; r < count[e]; r += 8) rows.emplace_back(start[e] + r, std::min<int64_t>(8, count[e] - r));
    }
    first.push_back(static_cast<int64_t>(rows.size()));
    q.assign(rows.size() * 8 * k, 0);
    scale.assign(rows.size() * (k / 256) * 8, 0.f);
    sums.assign(rows.size() * (k / 32) * 8, 0.f);
  }

  int64_t groups() const { return static_cast<int64_t>(rows.size()); }
  const int8_t* q_of(int64_t g) const { return q.data() + g * 8 * k; }
  const float* scale_of(int64_t g) const { return scale.data() + g * (k / 256) * 8; }
  const float* sums_of(int64_t g) const { return sums.data() + g * (k / 32) * 8; }

  // 256 values of x as levels (x ~= scale * level, scale = max|x| / 127, rounded to nearest even) and
  // the float sums of its sub-blocks of 32 (into sums[8 * j]); returns the scale.
  static float round_block(const bf16* v, int8_t* levels, float* sums) {
#if defined(MOESCOPE_AVX2_INT)
    const float amax = round_chunk(v, 127.f, [&](int j, const __m256i* q, float sum) {
      const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(levels + 32 * j),
                          _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      sums[8 * j] = sum;
    });
    return amax / 127.f;
#else
    float amax = 0.f;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(to_float(v[i])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < 256; ++i)
      levels[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(to_float(v[i]) * inv))));
    for (int j = 0; j < 8; ++j) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += to_float(v[32 * j + i]);
      sums[8 * j] = s;
    }
    return amax / 127.f;
#endif
  }

  // Group g from x (rows of k values); a padded lane stays zero.
  void fill(int64_t g, const bf16* x) {
    const auto [row0, n] = rows[g];
    int8_t* gq = q.data() + g * 8 * k;
    float* gs = scale.data() + g * (k / 256) * 8;
    float* gsum = sums.data() + g * (k / 32) * 8;
    int8_t levels[256];
    for (int64_t lane = 0; lane < n; ++lane) {
      const bf16* row = x + (row0 + lane) * k;
      for (int64_t b = 0; b < k / 256; ++b) {
        const bf16* v = row + b * 256;
        float* block_sums = gsum + b * 64 + lane;  // sub-block j's at block_sums[8 * j]
        gs[b * 8 + lane] = round_block(v, levels, block_sums);
        for (int u = 0; u < 64; ++u) std::memcpy(gq + ((b * 64 + u) * 8 + lane) * 4, levels + 4 * u, 4);
      }
    }
  }
};

// Rows at[0..kInt8Rows-1] of a Q4_K matrix unpacked for int8_tile: levels one byte each in their order, and
// per sub-block of 32 the reference's float scale (d * sc) and min (dmin * m).
struct Q4KRows {
  std::vector<uint8_t> levels;  // [kInt8Rows][k]
  std::vector<float> scale, min;  // [kInt8Rows][k / 32]
  int64_t k = 0;

  void load(const Matrix& m, const int64_t* at) {
    k = m.cols;
    levels.resize(kInt8Rows * k);
    scale.resize(kInt8Rows * (k / 32));
    min.resize(kInt8Rows * (k / 32));
    for (int r = 0; r < kInt8Rows; ++r) {
      const uint8_t* row = m.row(at[r]);
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* block = row + b * 144;
        BlockScales s;
        block_scales(kQ4_K, block, s);
        for (int j = 0; j < 8; ++j) {
          scale[r * (k / 32) + b * 8 + j] = s.scale[2 * j];
          min[r * (k / 32) + b * 8 + j] = s.min[2 * j];
        }
        uint8_t* out = levels.data() + r * k + b * 256;
        const uint8_t* qs = block + 16;
        for (int c = 0; c < 4; ++c) {  // 32 bytes: elements 64c + i (low nibble) and 64c + 32 + i (high)
#if defined(MOESCOPE_AVX2_INT)
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
          const __m256i nibble = _mm256_set1_epi8(0x0F);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * c), _mm256_and_si256(v, nibble));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * c + 32),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
#else
          for (int i = 0; i < 32; ++i) {
            out[64 * c + i] = qs[32 * c + i] & 0xF;
            out[64 * c + 32 + i] = qs[32 * c + i] >> 4;
          }
#endif
        }
      }
    }
  }
};

#if defined(MOESCOPE_AVX2_INT)
// One weight row's sub-block (32 levels) times the 8 rows' 32 inputs x[0..7] (4 a register), summed per
// row in an int32 lane: with VNNI one dpbusd per 4 levels; else one maddubs per 4 levels, whose pair
// sums (at most 2 * 15 * 127 = 3810: levels are below 16, inputs within +-127) add up in int16 all 8
// without overflow, and a single madd widens them (a madd each, as before, took twice the multiplies).
inline __m256i sub_block_products(const uint8_t* levels, const __m256i* x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i sums = _mm256_setzero_si256();
  for (int u = 0; u < 8; ++u) {
    int32_t four;
    std::memcpy(&four, levels + 4 * u, 4);
    sums = _mm256_dpbusd_epi32(sums, _mm256_set1_epi32(four), x[u]);
  }
  return sums;
#else
  __m256i pairs = _mm256_setzero_si256();
  for (int u = 0; u < 8; ++u) {
    int32_t four;
    std::memcpy(&four, levels + 4 * u, 4);
    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_set1_epi32(four), x[u]));
  }
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
#endif

// out[lane * kInt8Rows + r] = w_r . x_lane for the kInt8Rows rows of w and the 8 rows of group g.
inline void int8_tile(const Q4KRows& w, const Int8Groups& x, int64_t g, float* out) {
  const int64_t k = w.k, blocks = k / 256, subs = k / 32;
  const int8_t* xq = x.q_of(g);
  const float* xs = x.scale_of(g);
  const float* xsum = x.sums_of(g);
#if defined(MOESCOPE_AVX2_INT)
  __m256 acc[kInt8Rows], mins[kInt8Rows];
  for (int r = 0; r < kInt8Rows; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 block[kInt8Rows];
    for (int r = 0; r < kInt8Rows; ++r) block[r] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const int64_t sub = b * 8 + j;
      __m256i xv[8];
      for (int u = 0; u < 8; ++u) xv[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (sub * 8 + u) * 32));
      const __m256 sums = _mm256_loadu_ps(xsum + sub * 8);
      for (int r = 0; r < kInt8Rows; ++r) {
        const __m256i products = sub_block_products(w.levels.data() + r * k + sub * 32, xv);
        block[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(w.scale[r * subs + sub]), block[r]);
        mins[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(w.min[r * subs + sub]), mins[r]);
      }
    }
    const __m256 scale = _mm256_loadu_ps(xs + b * 8);
    for (int r = 0; r < kInt8Rows; ++r) acc[r] = _mm256_fmadd_ps(block[r], scale, acc[r]);
  }
  alignas(32) float lanes[kInt8Rows][8];
  for (int r = 0; r < kInt8Rows; ++r) _mm256_store_ps(lanes[r], _mm256_sub_ps(acc[r], mins[r]));
  for (int lane = 0; lane < 8; ++lane)
    for (int r = 0; r < kInt8Rows; ++r) out[lane * kInt8Rows + r] = lanes[r][lane];
#else
  for (int lane = 0; lane < 8; ++lane)
    for (int r = 0; r < kInt8Rows; ++r) {
      float acc = 0.f, mins = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        float block = 0.f;
        for (int j = 0; j < 8; ++j) {
          const int64_t sub = b * 8 + j;
          int32_t products = 0;
          for (int i = 0; i < 32; ++i)
            products += w.levels[r * k + sub * 32 + i] * xq[((sub * 8 + i / 4) * 8 + lane) * 4 + i % 4];
          block += static_cast<float>(products) * w.scale[r * subs + sub];
          mins += xsum[sub * 8 + lane] * w.min[r * subs + sub];
        }
        acc += block * xs[b * 8 + lane];
      }
      out[lane * kInt8Rows + r] = acc - mins;
    }
#endif
}

}  // namespace moescope
