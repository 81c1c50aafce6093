// Prompt tiles of Q4_K, Q6_K and Q8_0 matrices in integers, in variants without bf16 dot products
// (AVX2, AVX-512 without BF16).
//
// Other types' tiles there are dequantized to
// float32 and multiplied with fused multiply-adds: 8 products an instruction, on the two ports that
// have them. Here a tile's weights stay integers, each level times its sub-block's scale (Q4_K: at
// most 15 * 63; Q6_K: 32 * 128 in magnitude; Q8_0: the level itself; an int16 each way), the input
// rows are put in fixed point as a decode input is (dots/fixed_input.h: per 256 values a float scale, each
// value an int16 of at most 32512), and one vpmaddwd multiplies 16 pairs; its sums add up in int32
// lanes over a span of inputs short enough to stay below 2^31 (Q4_K 64: 64 * 945 * 32512; Q6_K 16:
// 16 * 4096 * 32512; Q8_0 its block of 32), then once in float with the span's d and the input
// chunk's scale. Q4_K's mins multiply the float
// sums of x, as in the decode kernels. The reference is the same as theirs: the products
// with the float32 dequantized weights, to within the input's fixed-point rounding (below 2^-15 of
// a chunk's largest value), not rounded to bf16 first; tests/test_quant_kernels.py holds the
// prompt paths of every variant to it.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../formats/types.h"
#include "../../prompt/tiles.h"
#include "quant_int.h"
#include "unpack.h"

namespace moescope {

// Whether this variant multiplies a prompt's tiles of this type in integers.
inline bool has_fixed_tiles([[maybe_unused]] int32_t type) {
#if defined(MOESCOPE_FIXED_PROMPT)
  return type == kQ4_K || type == kQ6_K || type == kQ8_0;
#else
  return false;
#endif
}

#if defined(MOESCOPE_FIXED_PROMPT)

// Inputs summed in int32 before the float step (the bounds above), and the d each span has.
inline int64_t fixed_span(int32_t type) { return type == kQ4_K ? 64 : type == kQ6_K ? 16 : 32; }

// A tile's kTile rows of a Q4_K, Q6_K or Q8_0 matrix for fixed_block_product: per row its weights as
// int16 (level * scale, in fixed_order), each span's d, and Q4_K's mins per 32 (dmin * m, the
// reference's float product).
struct FixedTile {
  std::vector<int16_t> weights;  // [kTile][k]
  std::vector<float> d;          // [kTile][k / span]: each span's d
  std::vector<float> min;        // [kTile][k / 32]; none for the symmetric types
  int64_t k = 0, span = 64;

  void load(const Matrix& m, const int64_t* at) {
    k = m.cols;
    span = fixed_span(m.type);
    weights.resize(kTile * k);
    d.resize(kTile * (k / span));
    min.resize(m.type == kQ4_K ? kTile * (k / 32) : 0);
    const int64_t elements = block_elements(m.type), bytes = block_bytes(m.type), spans_per_block = elements / span;
    for (int r = 0; r < kTile; ++r) {
      const uint8_t* row = m.row(at[r]);
      float* spans = d.data() + r * (k / span);
      for (int64_t blk = 0; blk < k / elements; ++blk) {
        const uint8_t* b = row + blk * bytes;
        int16_t* out = weights.data() + r * k + blk * elements;
        const float block_d = m.type == kQ4_K   ? q4_k_block(b, out, &min[r * (k / 32) + blk * 8])
                              : m.type == kQ6_K ? q6_k_block(b, out)
                                                : q8_0_block(b, out);
        std::fill(spans + blk * spans_per_block, spans + (blk + 1) * spans_per_block, block_d);
      }
    }
  }

  // A Q4_K block's 16-bit words hold an even level and the odd one after it in their two low
  // nibbles (and the next sub-block's pair in the high ones): fixed_order, with shifts and masks.
  static float q4_k_block(const uint8_t* b, int16_t* out, float* mins) {
    const __m256i low4 = _mm256_set1_epi16(0x000F);
    const __m128i scales_mins = q4_k_scales_mins(b + 4);  // 8 scales, then 8 mins
    const __m256i wide = _mm256_cvtepu8_epi16(scales_mins);
    const __m256i scales = _mm256_permute2x128_si256(wide, wide, 0x00);
    _mm256_storeu_ps(mins, _mm256_mul_ps(_mm256_set1_ps(half_to_float(b + 2)),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8)))));
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      // int16 scale j (bytes 2j, 2j + 1) in every lane
      const __m256i low = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((4 * c) | ((4 * c + 1) << 8))));
      const __m256i high = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((4 * c + 2) | ((4 * c + 3) << 8))));
      const __m256i levels[4] = {_mm256_and_si256(words, low4), _mm256_and_si256(_mm256_srli_epi16(words, 8), low4),
                                 _mm256_and_si256(_mm256_srli_epi16(words, 4), low4), _mm256_srli_epi16(words, 12)};
      for (int part = 0; part < 4; ++part)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * c + 16 * part),
                            _mm256_mullo_epi16(levels[part], part < 2 ? low : high));
    }
    return half_to_float(b);
  }

  // A Q6_K block: per 128 levels, 64 bytes of low nibbles and 32 of high bit pairs, read as 16-bit
  // words the same way (formats/blocks.h's group_levels says which bits are whose). Each 16 levels has its
  // own int8 scale: in fixed_order the even (or odd) levels 0-14 of a sub-block are the low 128-bit
  // lane and 16-30 the high one.
  static float q6_k_block(const uint8_t* b, int16_t* out) {
    const __m256i low4 = _mm256_set1_epi16(0x000F), low2 = _mm256_set1_epi16(0x0003), offset = _mm256_set1_epi16(32);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = b + 64 * half;
      const __m256i high_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
      for (int j = 0; j < 4; ++j) {  // sub-block j of this half: ql bytes 32 * (j & 1) on, nibble j >> 1, bits 2j
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (j & 1)));
        const int nibble = 4 * (j >> 1), bits = 2 * j;
        const int sub = 4 * half + j;
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * sub + 1]), _mm_set1_epi16(sc[2 * sub]));
        for (int odd = 0; odd < 2; ++odd) {
          const __m256i level = _mm256_or_si256(
              _mm256_and_si256(_mm256_srl_epi16(words, _mm_cvtsi32_si128(nibble + 8 * odd)), low4),
              _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high_bits, _mm_cvtsi32_si128(bits + 8 * odd)), low2), 4));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 128 * half + 32 * j + 16 * odd),
                              _mm256_mullo_epi16(_mm256_sub_epi16(level, offset), scale));
        }
      }
    }
    return half_to_float(b + 208);
  }

  // A Q8_0 block: its 32 int8 levels, the even ones then the odd ones (one shuffle per 128-bit
  // lane gathers each lane's 8 of either); returns its d.
  static float q8_0_block(const uint8_t* b, int16_t* out) {
    const __m256i split = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);  // evens, then odds
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(halves)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(halves, 1)));
    return half_to_float(b);
  }
};

// out[r * kBlock + i] = w_r . x_i for the tile's rows and block b of `in` (fixed point): its first 8
// rows (kVectors 1) or all 16, 8 at a time. Per 2 inputs one weight pair of each row is broadcast
// against 8 rows' pairs: 6 int32 accumulators and their products' registers. (Both halves of the
// block at once, as block_product does, needs 12 accumulators beside the products' registers:
// AVX2's 16 did not hold them, and the spilled loop ran no faster than the float tiles.)
template <int kVectors>
inline void fixed_block_product(const FixedTile& w, const PromptInput& in, int64_t b, float* out) {
  const int64_t k = w.k;
  const int16_t* x = in.fixed_block(b);
  const float* x_scale = in.fixed_scale_of(b);
  const float* x_sums = in.fixed_sums_of(b);
  for (int v = 0; v < kVectors; ++v) {
    __m256 acc[kTile], mins[kTile];
#pragma GCC unroll 8
    for (int r = 0; r < kTile; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
    for (int64_t span = 0; span < k; span += w.span) {
      __m256i sums[kTile];
#pragma GCC unroll 8
      for (int r = 0; r < kTile; ++r) sums[r] = _mm256_setzero_si256();
      const int16_t* weights = w.weights.data() + span;
      const int16_t* xs = x + span * kBlock + 16 * v;
#pragma GCC unroll 4
      for (int64_t p = 0; p < w.span; p += 2) {
        const __m256i xv = load32(xs + p * kBlock);
#pragma GCC unroll 8
        for (int r = 0; r < kTile; ++r) {
          int32_t pair;
          std::memcpy(&pair, weights + r * k + p, 4);
          sums[r] = madd_acc(sums[r], _mm256_set1_epi32(pair), xv);
        }
      }
      const __m256 scale = _mm256_loadu_ps(x_scale + (span / 256) * kBlock + 8 * v);
      const float* d = w.d.data() + span / w.span;
#pragma GCC unroll 8
      for (int r = 0; r < kTile; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(_mm256_set1_ps(d[r * (k / w.span)]), scale), acc[r]);
    }
    // Q4_K's mins times the float sums of x, per sub-block of 32
    for (int64_t sub = 0; sub < static_cast<int64_t>(w.min.size()) / kTile; ++sub) {
      const __m256 sums = _mm256_loadu_ps(x_sums + sub * kBlock + 8 * v);
#pragma GCC unroll 8
      for (int r = 0; r < kTile; ++r) mins[r] = _mm256_fmadd_ps(_mm256_set1_ps(w.min[r * (k / 32) + sub]), sums, mins[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kTile; ++r) _mm256_storeu_ps(out + r * kBlock + 8 * v, _mm256_sub_ps(acc[r], mins[r]));
  }
}

// The tile's kTile rows at[] of a matrix with integer tiles times expert e's rows of `in` (fixed
// point; rows first .. first + m - 1 of x): emit(i, sums) with sums[r] = x_(first + i) . w_r.
template <class Emit>
inline void fixed_tile_times_rows(const Matrix& w, const int64_t* at, const PromptInput& in, int64_t e,
                                  int64_t first, int64_t m, FixedTile& tile, Emit&& emit) {
  tile.load(w, at);
  alignas(32) float out[kTile * kBlock];
  float sums[kTile];
  for (int64_t b = in.first_block[e]; b < in.first_block[e + 1]; ++b) {
    const int64_t row0 = in.block_row[b] - first, n = std::min(kBlock, m - row0);
    if (n <= 8)
      fixed_block_product<1>(tile, in, b, out);
    else
      fixed_block_product<2>(tile, in, b, out);
    for (int64_t i = 0; i < n; ++i) {
      for (int r = 0; r < kTile; ++r) sums[r] = out[r * kBlock + i];
      emit(row0 + i, sums);
    }
  }
}
#endif

}  // namespace moescope
