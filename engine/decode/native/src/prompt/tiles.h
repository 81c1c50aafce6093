// A prompt's rows times tiles of a weight matrix: each tile of kTile rows of W is dequantized once
// into a buffer that stays in L1 and multiplied by every row of x that goes through it, so a
// quantized expert is never expanded in memory (the exact path expands it into a scratch, then
// oneDNN reads that back and re-packs it on every call). With bf16 dot products the tile stays bf16;
// elsewhere it is multiplied in float32 against input rows widened in blocks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../base/features.h"
#include "../base/scalar.h"
#include "../base/simd.h"
#include "../formats/types.h"
#include "../kernels/gemv.h"

namespace moescope {

// Rows of W per tile: 4 with bf16 dot products (4 x 4 accumulators); 6 in float32 (6 x 2
// accumulators of 16 input rows: AVX2's 16 registers).
#if defined(MOESCOPE_AVX512BF16)
constexpr int64_t kTile = 4;
#else
constexpr int64_t kTile = 6;
#endif
constexpr int64_t kPairs = kTile / 2;  // a gate/up tile's intermediate rows: kPairs gate rows, then their up rows

#if defined(MOESCOPE_AVX512BF16)
// sums[i * ld + r] = x_i . w_r for N (<= 4) rows of x and 4 of W: 4N accumulators, each weight
// and input vector loaded once per 4 (N) products. N is a template parameter so that an expert's
// last rows of x (a prompt's count per expert is rarely a multiple of 4) cost only their own products.
template <int N>
inline void dot_tile_n(const bf16* const* w, const bf16* const* x, int64_t k, float* sums, int64_t ld) {
  static_assert(kTile * kTile == 16 && N <= kTile, "one lane sum per accumulator");
  __m512 acc[kTile][kTile];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 32 <= k; p += 32) {
    __m512bh wv[kTile];
    for (int r = 0; r < kTile; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + p);
    for (int i = 0; i < N; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[i] + p);
      for (int r = 0; r < kTile; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv, wv[r]);
    }
  }
  alignas(64) float lane_sums[kTile * kTile];
  _mm512_store_ps(lane_sums, sum_lanes_16(&acc[0][0]));
  for (int i = 0; i < N; ++i)
    for (int r = 0; r < kTile; ++r) {
      float sum = lane_sums[i * kTile + r];
      for (int64_t t = p; t < k; ++t) sum += to_float(w[r][t]) * to_float(x[i][t]);
      sums[i * ld + r] = sum;
    }
}
#endif

#if !defined(MOESCOPE_AVX512BF16)
// Without bf16 dot products a tile is multiplied in float32: its kTile rows of W dequantized (or
// widened: exact, a bf16 is the top half of a float32) once per tile, the input rows widened once
// per call into blocks of 16 rows laid [k][16], so that each step over k broadcasts one weight of
// each W row against two vectors of 8 rows: 12 independent accumulators, enough to keep the
// fused multiply-adds busy (one-row dot products with 8 accumulators, tried first, were the slower;
// torch's own bf16 matmul is slower still on such CPUs: docs/performance-history.md, "Results on
// an AVX2 CPU without AVX-512").
constexpr int64_t kBlock = 16;
#if defined(MOESCOPE_AVX2_INT)
#define MOESCOPE_FIXED_PROMPT 1  // Q4_K, Q6_K and Q8_0 tiles multiplied in integers (arch/x86/prompt_fixed.h)
// Within each 32 inputs the fixed-point tiles keep the even ones, then the odd ones: a Q4_K (or
// Q6_K) block's 16-bit words hold its levels so (the low nibbles of a word's two bytes are an even
// level and the odd one after it), and so a tile row is expanded with 16-bit shifts and masks
// (FixedTile in arch/x86/prompt_fixed.h), where putting the levels back in order took a shuffle-port
// instruction for every 16. The inputs are packed in the same order (PromptInput::pack_fixed).
constexpr int fixed_order(int s) { return s < 16 ? 2 * s : 2 * (s - 16) + 1; }  // the input at place s of 32
#endif

// out[r * kBlock + i] = w_r . x_i for the tile's rows of W (float32) and one block of input rows: its
// first 8 rows (kVectors 1: a block holding no more, the last of an expert's, need not pay for 16)
// or all 16.
// The loops over the accumulators are unrolled by pragma: unrolled only later, as GCC does where this
// is not inlined, the accumulator array stays in memory and every step stores all 12 of them.
template <int kVectors>
inline void block_product(const float* const* w, const float* block, int64_t k, float* out) {
#if defined(MOESCOPE_AVX2_INT)
  __m256 acc[kTile][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < kTile; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 x[kVectors];
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) x[v] = _mm256_loadu_ps(block + kBlock * p + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < kTile; ++r) {
      const __m256 weight = _mm256_broadcast_ss(w[r] + p);
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_fmadd_ps(weight, x[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kTile; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + r * kBlock + 8 * v, acc[r][v]);
#else
  float acc[kTile][kBlock] = {};
  for (int64_t p = 0; p < k; ++p)
    for (int r = 0; r < kTile; ++r)
      for (int i = 0; i < 8 * kVectors; ++i) acc[r][i] += w[r][p] * block[kBlock * p + i];
  std::memcpy(out, acc, sizeof(acc));
#endif
}
#endif

#if defined(MOESCOPE_AVX2_INT)
// 256 bf16 values on a grid of `steps` levels either side of zero, x ~= amax / steps * level
// (rounded to nearest even, as nearbyint): each sub-block of 32 handed to use(j, level, sum) as four
// vectors of 8 int32 levels and the float sum of its values. Returns amax. The 8-bit prompt inputs
// (prompt/int8.h) and the fixed-point ones (PromptInput::pack_fixed) both put their rows so.
template <class Use>
inline float round_chunk(const bf16* v, float steps, Use&& use) {
  auto widen = [&](int at) {  // 8 values from v + at as float
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + at))), 16));
  };
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int at = 0; at < 256; at += 8) top = _mm256_max_ps(top, _mm256_and_ps(widen(at), no_sign));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float amax = std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? steps / amax : 0.f);
  for (int j = 0; j < 8; ++j) {
    __m256i level[4];
    __m256 sum = _mm256_setzero_ps();
    for (int part = 0; part < 4; ++part) {
      const __m256 x = widen(32 * j + 8 * part);
      sum = _mm256_add_ps(sum, x);
      level[part] = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));  // |x * inv| <= steps already
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    use(j, level, _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1))));
  }
  return amax;
}
#endif

// A prompt's input rows as the tile products read them: bf16, and, in variants without bf16 dot
// products, in blocks of kBlock rows of one expert (the last padded with zeros): widened to float32,
// each laid [k][kBlock], or, where `fixed` (every matrix reading them has integer tiles, arch/x86/prompt_fixed.h),
// in fixed point. The threads fill the blocks in parts (`pack`).
struct PromptInput {
  const bf16* x;
  int64_t k;
  bool fixed = false;
#if !defined(MOESCOPE_AVX512BF16)
  std::vector<int64_t> first_block;  // each expert's first block, then the total
  std::vector<int64_t> block_row;    // each block's first row of x
  std::vector<float> blocks;
  std::vector<int16_t> fixed_values;  // per block [k / 2][kBlock][2]
  std::vector<float> fixed_scale;     // per block [k / 256][kBlock]: x ~= scale * value
  std::vector<float> fixed_sums;      // per block [k / 32][kBlock]: the float sums of x
#endif

  // `start`/`count`: each expert's rows of x (one expert: all of them); `fixed_point`: the blocks in
  // fixed point, where the build has that path
  PromptInput(const bf16* x_, int64_t k_, const std::vector<int64_t>& start, const std::vector<int64_t>& count,
              bool fixed_point = false)
      : x(x_), k(k_) {
#if !defined(MOESCOPE_AVX512BF16)
    for (size_t e = 0; e < count.size(); ++e) {
      first_block.push_back(static_cast<int64_t>(block_row.size()));
      for (int64_t r = 0; r < count[e]; r += kBlock) block_row.push_back(start[e] + r);
    }
    first_block.push_back(static_cast<int64_t>(block_row.size()));
    row_end.assign(block_row.size(), 0);
    for (size_t e = 0; e < count.size(); ++e)
      for (int64_t b = first_block[e]; b < first_block[e + 1]; ++b) row_end[b] = start[e] + count[e];
#if defined(MOESCOPE_FIXED_PROMPT)
    fixed = fixed_point && k % 256 == 0;
#endif
    if (fixed) {
      fixed_values.resize(block_row.size() * kBlock * k);
      fixed_scale.resize(block_row.size() * kBlock * (k / 256));
      fixed_sums.resize(block_row.size() * kBlock * (k / 32));
    } else {
      blocks.resize(block_row.size() * kBlock * k);
    }
#else
    (void)start, (void)count, (void)fixed_point;
#endif
  }

  int64_t block_count() const {
#if !defined(MOESCOPE_AVX512BF16)
    return static_cast<int64_t>(block_row.size());
#else
    return 0;
#endif
  }

#if !defined(MOESCOPE_AVX512BF16)
  std::vector<int64_t> row_end;  // each block's expert's end row (a block holds rows up to it)

  const float* block(int64_t b) const { return blocks.data() + b * kBlock * k; }

  // blocks [first, last) filled from x
  void pack(int64_t first, int64_t last) {
    std::vector<float> row(k);
    for (int64_t b = first; b < last; ++b) {
      const int64_t n = std::min(kBlock, row_end[b] - block_row[b]);
#if defined(MOESCOPE_FIXED_PROMPT)
      if (fixed) {
        pack_fixed(b, n);
        continue;
      }
#endif
      float* out = blocks.data() + b * kBlock * k;
      for (int64_t i = 0; i < kBlock; ++i) {
        if (i < n) {
          const bf16* src = x + (block_row[b] + i) * k;
          for (int64_t p = 0; p < k; ++p) row[p] = to_float(src[p]);
        } else {
          std::fill(row.begin(), row.end(), 0.f);
        }
        for (int64_t p = 0; p < k; ++p) out[kBlock * p + i] = row[p];
      }
    }
  }

#if defined(MOESCOPE_FIXED_PROMPT)
  // Block b's n rows in fixed point: per 256 values a scale (max |x| / 32512) and each value rounded
  // to the nearest multiple of it, as FixedInput puts a decode input (dots/fixed_input.h), in fixed_order;
  // padded rows stay 0.
  void pack_fixed(int64_t b, int64_t n) {
    int16_t* values = fixed_values.data() + b * kBlock * k;
    float* scale = fixed_scale.data() + b * kBlock * (k / 256);
    float* sums = fixed_sums.data() + b * kBlock * (k / 32);
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    alignas(32) int16_t chunk[256];
    for (int64_t i = 0; i < n; ++i) {
      const bf16* src = x + (block_row[b] + i) * k;
      for (int64_t c = 0; c < k / 256; ++c) {
        const float amax = round_chunk(src + 256 * c, 32512.f, [&](int j, const __m256i* level, float sum) {
          sums[(8 * c + j) * kBlock + i] = sum;
          // the 32 levels as int16 in order, then the even ones and the odd ones (fixed_order)
          const __m256i first = _mm256_permute4x64_epi64(_mm256_packs_epi32(level[0], level[1]), 0xD8);
          const __m256i second = _mm256_permute4x64_epi64(_mm256_packs_epi32(level[2], level[3]), 0xD8);
          const __m256i even = _mm256_packus_epi32(_mm256_and_si256(first, low16), _mm256_and_si256(second, low16));
          const __m256i odd = _mm256_packus_epi32(_mm256_srli_epi32(first, 16), _mm256_srli_epi32(second, 16));
          _mm256_store_si256(reinterpret_cast<__m256i*>(chunk + 32 * j), _mm256_permute4x64_epi64(even, 0xD8));
          _mm256_store_si256(reinterpret_cast<__m256i*>(chunk + 32 * j + 16), _mm256_permute4x64_epi64(odd, 0xD8));
        });
        scale[c * kBlock + i] = amax / 32512.f;
        for (int q = 0; q < 128; ++q)
          std::memcpy(values + ((128 * c + q) * kBlock + i) * 2, chunk + 2 * q, 4);
      }
    }
  }

  const int16_t* fixed_block(int64_t b) const { return fixed_values.data() + b * kBlock * k; }
  const float* fixed_scale_of(int64_t b) const { return fixed_scale.data() + b * kBlock * (k / 256); }
  const float* fixed_sums_of(int64_t b) const { return fixed_sums.data() + b * kBlock * (k / 32); }
#endif
#else
  void pack(int64_t, int64_t) {}
#endif
};

// A tile's kTile rows of W as its products read them: bf16 with bf16 dot products, else float32.
struct TileRows {
  const bf16* bf[kTile];
  const float* wide[kTile];
};

// Rows at[] of W into `rows`: a bf16 matrix's own rows, or rows expanded into the caller's scratch
// (kTile rows: bf16 `expanded`, or float32 `wide` in variants without bf16 dot products).
inline void tile_rows(const Matrix& m, const int64_t* at, TileRows& rows, bf16* expanded, float* wide) {
  for (int j = 0; j < kTile; ++j) {
#if defined(MOESCOPE_AVX512BF16)
    (void)wide;
    if (m.type == kBF16) {
      rows.bf[j] = reinterpret_cast<const bf16*>(m.row(at[j]));
    } else {
      dequantize_rows(m, at[j], at[j] + 1, expanded + j * m.cols, at[j]);
      rows.bf[j] = expanded + j * m.cols;
    }
#else
    (void)expanded;
    dequantize_rows_f32(m, at[j], at[j] + 1, wide + j * m.cols, at[j]);
    rows.wide[j] = wide + j * m.cols;
#endif
  }
}

// The tile's rows of W times expert e's rows of `in` (rows first .. first + m - 1 of x; `e` indexes
// `in`'s experts): emit(i, sums) with sums[r] = x_(first + i) . w_r.
template <class Emit>
inline void tile_times_rows(const TileRows& w, const PromptInput& in, int64_t e, int64_t first, int64_t m,
                            Emit&& emit) {
  const int64_t k = in.k;
#if defined(MOESCOPE_AVX512BF16)
  (void)e;
  float sums[kTile * kTile];
  for (int64_t i0 = 0; i0 < m; i0 += kTile) {
    const int64_t n = std::min(kTile, m - i0);
    const bf16* x[kTile];
    for (int64_t i = 0; i < kTile; ++i) x[i] = in.x + (first + i0 + std::min(i, n - 1)) * k;
    switch (n) {
      case 1: dot_tile_n<1>(w.bf, x, k, sums, kTile); break;
      case 2: dot_tile_n<2>(w.bf, x, k, sums, kTile); break;
      case 3: dot_tile_n<3>(w.bf, x, k, sums, kTile); break;
      default: dot_tile_n<4>(w.bf, x, k, sums, kTile);
    }
    for (int64_t i = 0; i < n; ++i) emit(i0 + i, sums + i * kTile);
  }
#else
  alignas(32) float out[kTile * kBlock];
  float sums[kTile];
  for (int64_t b = in.first_block[e]; b < in.first_block[e + 1]; ++b) {
    const int64_t row0 = in.block_row[b] - first, n = std::min(kBlock, m - row0);
    if (n <= 8)
      block_product<1>(w.wide, in.block(b), k, out);
    else
      block_product<2>(w.wide, in.block(b), k, out);
    for (int64_t i = 0; i < n; ++i) {
      for (int r = 0; r < kTile; ++r) sums[r] = out[r * kBlock + i];
      emit(row0 + i, sums);
    }
  }
#endif
}

}  // namespace moescope
