// Block-quantized rows on x86 in float: the reference's weights, expanded in registers, times a
// bf16 x (qdot_row, the reference-exact one-row products), and expanded into memory for the prompt
// tiles and the exact path's scratch (group_weights_f32, group_weights_bf16). The integer dots the
// decode path takes by default are in quant_int.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/simd.h"
#include "../../base/tune.h"
#include "../../formats/blocks.h"
#include "../../formats/types.h"
#include "unpack.h"

namespace moescope {

#if defined(MOESCOPE_AVX512BF16)
#define MOESCOPE_HAS_QDOT_ROW 1
#define MOESCOPE_HAS_DEQUANTIZE_ROW_Q4_K 1
// 32 levels of group g as two vectors of 16 int32 (elements 0-15, 16-31); MXFP4 has its own
// bf16 table (mxfp4_block_bf16).
inline void group_levels_avx512(int32_t type, const uint8_t* b, int g, __m512i& lo, __m512i& hi) {
  switch (type) {
    case kQ8_0: {
      lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
      hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
      return;
    }
    case kQ4_0: {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m512i eight = _mm512_set1_epi32(8);
      lo = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)), eight);
      hi = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)), eight);
      return;
    }
    case kQ4_K: {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (g / 2)));
      const __m256i nib = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
      lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(nib));
      hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(nib, 1));
      return;
    }
    case kQ6_K:
    case kQ3_K:
    case kQ2_K: {
      const __m256i levels = type == kQ6_K ? q6_k_group_levels(b, g) : q2_q3_k_group_levels(b, g, type == kQ3_K);
      const __m512i offset = _mm512_set1_epi32(type == kQ6_K ? 32 : type == kQ3_K ? 4 : 0);
      lo = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(levels)), offset);
      hi = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(levels, 1)), offset);
      return;
    }
    default: {  // the other types through the portable unpacking
      alignas(64) int32_t q[32];
      group_levels(type, b, g, q);
      lo = _mm512_load_si512(q);
      hi = _mm512_load_si512(q + 16);
    }
  }
}

// The bf16 values (scale * level - min) of levels 0..n-1 (n <= 16), each rounded as the reference
// rounds its weights: a lookup table for _mm512_permutexvar_epi16 (entries 16..31 unused).
inline __m512i level_table(float scale, float min) {
  static const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_sub_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scale)), _mm512_set1_ps(min));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
}

// The same for 32 levels, from two runs of 16 (levels 0..15 then 16..31) of one scale and min.
inline __m512i level_table_32(float scale, float min) {
  static const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  static const __m512 high = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(min);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(_mm512_mul_ps(high, s), o), _mm512_sub_ps(_mm512_mul_ps(low, s), o));
}

inline __m512bh x32(const bf16* x) { return (__m512bh)_mm512_loadu_si512(x); }

// MXFP4's 32 weights of one block as the reference's bf16 values (elements 0-15 in lo, 16-31 in hi).
// The scale is a power of two, so for a normal result it is an addition to the bf16 exponent field:
// e2m1 value * 2^(e - 127) is exact in bf16 for e in [2, 252], and a 16-entry table (the scale added
// to every nonzero code) looked up with vpermw gives the weights with no float work. Other exponents
// (subnormal or overflowing weights, absent from real checkpoints) take the portable loop.
inline __m256i mxfp4_e2m1_bf16() {
  return _mm256_setr_epi16(0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                           0x0000,  // -0 is +0, as level * scale gives
                           static_cast<int16_t>(0xBF00), static_cast<int16_t>(0xBF80), static_cast<int16_t>(0xBFC0),
                           static_cast<int16_t>(0xC000), static_cast<int16_t>(0xC040), static_cast<int16_t>(0xC080),
                           static_cast<int16_t>(0xC0C0));
}

// The portable rounding, for the rare exponents: the vector conversion would flush subnormals.
[[gnu::noinline, gnu::cold]] inline void mxfp4_block_bf16_portable(const uint8_t* b, __m256i& lo, __m256i& hi) {
  BlockScales s;
  block_scales(kMXFP4, b, s);
  alignas(32) bf16 w[32];
  group_weights(kMXFP4, b, s, 0, w);
  lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
  hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 16));
}

inline void mxfp4_block_bf16(const uint8_t* b, __m256i e2m1, __m256i& lo, __m256i& hi) {
  const uint32_t e = b[0];
  if (__builtin_expect(e - 2u > 250u, 0)) return mxfp4_block_bf16_portable(b, lo, hi);
  const __m256i table = _mm256_mask_add_epi16(e2m1, 0xFEFE, e2m1, _mm256_set1_epi16(static_cast<int16_t>((static_cast<int32_t>(e) - 127) * 128)));
  const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)));
  lo = _mm256_permutexvar_epi16(codes, table);  // vpermw reads the low 4 bits: the low nibble
  hi = _mm256_permutexvar_epi16(_mm256_srli_epi16(codes, 4), table);
}

// MXFP4 row times x: the reference's bf16 weights (above) in bf16 dot products, two blocks a step
// into four accumulators (one accumulator chain would wait on the dot product's latency).
template <bool kIntel>
inline float qdot_row_mxfp4(const uint8_t* row, int64_t blocks, const bf16* x) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256i e2m1 = mxfp4_e2m1_bf16();
  auto step = [&](int64_t blk, int slot) {
    __m256i lo, hi;
    mxfp4_block_bf16(row + blk * 17, e2m1, lo, hi);
    const bf16* xb = x + 32 * blk;
    acc[slot] = _mm256_dpbf16_ps(acc[slot], (__m256bh)lo, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
    acc[slot + 1] = _mm256_dpbf16_ps(acc[slot + 1], (__m256bh)hi, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
  };
  int64_t blk = 0;
  for (; blk + 2 <= blocks; blk += 2) {
    prefetch_block<kIntel>(row + blk * 17, 34);
    step(blk, 0);
    step(blk + 1, 2);
  }
  if (blk < blocks) step(blk, 0);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  return _mm512_reduce_add_ps(_mm512_zextps256_ps512(sum));
}

// group_weights, 32 at a time: the same products and differences, rounded to nearest even.
inline void group_weights_avx512(int32_t type, const uint8_t* b, const BlockScales& s, int g, bf16* w) {
  if (type == kMXFP4) {
    __m256i lo, hi;
    mxfp4_block_bf16(b, mxfp4_e2m1_bf16(), lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16), hi);
    return;
  }
  __m512i lo, hi;
  group_levels_avx512(type, b, g, lo, hi);
  const __m512 w_lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s.scale[2 * g])),
                                    _mm512_set1_ps(s.min[2 * g]));
  const __m512 w_hi = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s.scale[2 * g + 1])),
                                    _mm512_set1_ps(s.min[2 * g + 1]));
  _mm512_storeu_si512(w, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
}

// Q4_K: per 64 weights, one 32-byte load gives two sub-blocks' nibbles; each sub-block's 16
// possible weights are computed once (a table) and looked up, so no level is converted to float.
// Chunk c (elements 64c..64c+63) of block b as bf16 weights: sub-block 2c in lo, 2c + 1 in hi.
inline void q4_k_chunk_bf16(const uint8_t* b, const BlockScales& s, int c, __m512i& lo, __m512i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
  lo = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(bytes, nibble)),
                                level_table(s.scale[4 * c], s.min[4 * c]));
  hi = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)),
                                level_table(s.scale[4 * c + 2], s.min[4 * c + 2]));
}

template <bool kIntel>
inline float qdot_row_q4_k(const uint8_t* row, int64_t blocks, const bf16* x) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  BlockScales s;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 144;
    prefetch_block<kIntel>(b, 144);
    block_scales(kQ4_K, b, s);
    const bf16* xb = x + blk * 256;
    for (int c = 0; c < 4; ++c) {
      __m512i w_lo, w_hi;
      q4_k_chunk_bf16(b, s, c, w_lo, w_hi);
      acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)w_lo, x32(xb + 64 * c));
      acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)w_hi, x32(xb + 64 * c + 32));
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Q4_0 (levels - 8 times d) and Q5_0 (levels - 16 times d): one table per 32-weight block.
inline float qdot_row_q4_q5_0(const uint8_t* row, int64_t blocks, const bf16* x, bool five) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const int64_t stride = five ? 22 : 18;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * stride;
    const float d = half_to_float(b);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (five ? 6 : 2)));
    // elements 0-15 are the low nibbles, 16-31 the high ones
    __m256i idx8 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble), _mm_and_si128(qs, nibble));
    __m512i table;
    if (five) {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      idx8 = _mm256_or_si256(idx8, _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(16)));  // the fifth bit
      table = level_table_32(d, 16.f * d);
    } else {
      table = level_table(d, 8.f * d);
    }
    const __m512i w = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx8), table);
    if (blk & 1)
      acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)w, x32(x + 32 * blk));
    else
      acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)w, x32(x + 32 * blk));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// sum over the row of bf16(dequantized weight) * x, float32.

template <bool kIntel>
inline float qdot_row_tuned(const Matrix& m, int64_t r, const bf16* x) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  if (m.type == kQ4_K) return qdot_row_q4_k<kIntel>(row, blocks, x);
  if (m.type == kQ4_0 || m.type == kQ5_0) return qdot_row_q4_q5_0(row, blocks, x, m.type == kQ5_0);
  if (m.type == kMXFP4) return qdot_row_mxfp4<kIntel>(row, blocks, x);
  const int groups = static_cast<int>(be / 32);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  BlockScales s;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    prefetch_block<kIntel>(b, bb);
    block_scales(m.type, b, s);
    for (int g = 0; g < groups; ++g) {
      __m512i lo, hi;
      group_levels_avx512(m.type, b, g, lo, hi);
      const __m512 w_lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s.scale[2 * g])),
                                        _mm512_set1_ps(s.min[2 * g]));
      const __m512 w_hi = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s.scale[2 * g + 1])),
                                        _mm512_set1_ps(s.min[2 * g + 1]));
      const __m512bh w = _mm512_cvtne2ps_pbh(w_hi, w_lo);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + blk * be + 32 * g);
      if (g & 1)
        acc1 = _mm512_dpbf16_ps(acc1, w, xv);
      else
        acc0 = _mm512_dpbf16_ps(acc0, w, xv);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// One Q4_K row as bf16 weights, through qdot_row_q4_k's tables (the values group_weights_avx512 computes).
template <bool kIntel>
inline void dequantize_row_q4_k(const uint8_t* row, int64_t blocks, bf16* w) {
  BlockScales s;
  for (int64_t blk = 0; blk < blocks; ++blk, w += 256) {
    const uint8_t* b = row + blk * 144;
    prefetch_block<kIntel>(b, 144);
    block_scales(kQ4_K, b, s);
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      q4_k_chunk_bf16(b, s, c, lo, hi);
      _mm512_storeu_si512(w + 64 * c, lo);
      _mm512_storeu_si512(w + 64 * c + 32, hi);
    }
  }
}
#elif defined(MOESCOPE_AVX2) || defined(MOESCOPE_AVX512F)
#define MOESCOPE_HAS_QDOT_ROW 1
template <bool kIntel>
inline float qdot_row_tuned(const Matrix& m, int64_t r, const bf16* x) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  BlockScales s;
  alignas(32) int32_t q[32];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    prefetch_block<kIntel>(b, bb);
    block_scales(m.type, b, s);
    for (int g = 0; g < groups; ++g) {
      group_levels(m.type, b, g, q);
      for (int part = 0; part < 4; ++part) {
        const int sub = 2 * g + part / 2;
        const __m256 level = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q + 8 * part)));
        const __m256 w = round_bf16_avx2(
            _mm256_sub_ps(_mm256_mul_ps(level, _mm256_set1_ps(s.scale[sub])), _mm256_set1_ps(s.min[sub])));
        acc[part] = _mm256_fmadd_ps(w, widen_bf16_8(x + blk * be + 32 * g + 8 * part), acc[part]);
      }
    }
  }
  const __m256 total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}
#endif

#if defined(MOESCOPE_HAS_QDOT_ROW)
// sum over the row of bf16(dequantized weight) * x, float32.
inline float qdot_row(const Matrix& m, int64_t r, const bf16* x) {
  return tuned([&](auto intel) { return qdot_row_tuned<intel>(m, r, x); });
}
#endif

#if defined(MOESCOPE_AVX2_INT)
#define MOESCOPE_HAS_GROUP_WEIGHTS 1
// The 4-bit codes of group g of a Q4_0, MXFP4 or Q4_K block, one byte each in element order: Q4_0's
// and MXFP4's elements 0-15 are the low nibbles of 16 bytes and 16-31 their high nibbles, Q4_K's
// groups take the low (even g) or high (odd g) nibbles of 32 bytes.
inline __m256i group_codes_avx2(int32_t type, const uint8_t* b, int g) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if (type == kQ4_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (g / 2)));
    return _mm256_and_si256(g % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
  }
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (type == kQ4_0 ? 2 : 1)));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
}

// The 16 levels the codes of a Q4_0, MXFP4 or Q4_K group stand for, as float32 (codes 0-7 in `low`,
// 8-15 in `high`); false for the other types.
inline bool code_levels_avx2(int32_t type, __m256& low, __m256& high) {
  switch (type) {
    case kQ4_K:
      low = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
      high = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
      return true;
    case kQ4_0:
      low = _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1);
      high = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
      return true;
    case kMXFP4: {
      const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
      low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
      high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8)));
      return true;
    }
    default:
      return false;
  }
}

// w[0..31] = the float32 weights of a group's 32 codes (a byte each, 0..15, element order) whose 16 levels
// share one scale and min: each level's weight is computed and rounded once, as group_weights_f32
// computes it, and the 32 are looked up with byte shuffles (a bf16's low and high bytes apart), in
// about two thirds of the instructions of computing every weight.
inline void lookup_group_f32(__m256i codes, __m256 low, __m256 high, float scale, float min, float* w) {
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(min);
  auto top_half = [&](__m256 levels) {  // the bf16 values of 8 levels, in the low half of each lane
    return _mm256_srli_epi32(_mm256_castps_si256(round_bf16_avx2(_mm256_sub_ps(_mm256_mul_ps(levels, s), o))), 16);
  };
  // the 16 values in order, then in each 128-bit lane 8 values' low bytes followed by their high bytes
  const __m256i values = _mm256_permute4x64_epi64(_mm256_packus_epi32(top_half(low), top_half(high)), 0xD8);
  const __m256i split = _mm256_shuffle_epi8(values, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                                     0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m256i low_bytes = _mm256_permute4x64_epi64(split, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256i high_bytes = _mm256_permute4x64_epi64(split, _MM_SHUFFLE(3, 1, 3, 1));
  // codes 0-3, 8-11, 16-19, 24-27 in the low lane and the others in the high one, so that the
  // unpacks below (which work within lanes) give elements 0-7, 8-15, 16-23, 24-31
  const __m256i order = _mm256_permutevar8x32_epi32(codes, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  const __m256i l = _mm256_shuffle_epi8(low_bytes, order), h = _mm256_shuffle_epi8(high_bytes, order);
  const __m256i first = _mm256_unpacklo_epi8(l, h), second = _mm256_unpackhi_epi8(l, h), zero = _mm256_setzero_si256();
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), _mm256_unpacklo_epi16(zero, first));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 8), _mm256_unpackhi_epi16(zero, first));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16), _mm256_unpacklo_epi16(zero, second));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 24), _mm256_unpackhi_epi16(zero, second));
}

// Group g's 32 levels as signed bytes, for the K-quants whose sub-blocks of 16 have their own
// scales (false: the others; the 4-bit types and Q8_0 take group_weights_f32's own paths).
inline bool group_levels_avx2(int32_t type, const uint8_t* b, int g, __m256i& bytes) {
  switch (type) {
    case kQ6_K:
      bytes = _mm256_sub_epi8(q6_k_group_levels(b, g), _mm256_set1_epi8(32));
      return true;
    case kQ3_K:
    case kQ2_K:
      bytes = q2_q3_k_group_levels(b, g, type == kQ3_K);
      if (type == kQ3_K) bytes = _mm256_sub_epi8(bytes, _mm256_set1_epi8(4));
      return true;
    default:
      return false;
  }
}


// group_weights' values (scale * level - min, two roundings, then rounded to bf16 as torch rounds)
// as float32: 8 at a time for the types AVX2 unpacks in vectors.
inline void group_weights_f32(int32_t type, const uint8_t* b, const BlockScales& s, int g, float* w) {
  __m256 low, high;
  if (code_levels_avx2(type, low, high))
    return lookup_group_f32(group_codes_avx2(type, b, g), low, high, s.scale[2 * g], s.min[2 * g], w);
  if (type == kQ8_0) {  // the levels are the block's bytes and there is no min (x - 0 is x, -0 included)
    const __m256 scale = _mm256_set1_ps(s.scale[0]);
    for (int part = 0; part < 4; ++part) {
      const __m256i level = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * part)));
      _mm256_storeu_ps(w + 8 * part, round_bf16_avx2(_mm256_mul_ps(_mm256_cvtepi32_ps(level), scale)));
    }
    return;
  }
  __m256i bytes;
  if (group_levels_avx2(type, b, g, bytes)) {
    const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
    for (int part = 0; part < 4; ++part) {
      const __m128i eight = part % 2 ? _mm_srli_si128(halves[part / 2], 8) : halves[part / 2];
      const int sub = (32 * g + 8 * part) / 16;
      const __m256 value = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)),
                                                       _mm256_set1_ps(s.scale[sub])), _mm256_set1_ps(s.min[sub]));
      _mm256_storeu_ps(w + 8 * part, round_bf16_avx2(value));
    }
    return;
  }
  alignas(32) bf16 rounded[32];
  group_weights(type, b, s, g, rounded);
  for (int l = 0; l < 32; ++l) w[l] = to_float(rounded[l]);
}

// group_weights, 32 at a time, into bf16.
inline void group_weights_bf16(int32_t type, const uint8_t* b, const BlockScales& s, int g, bf16* w) {
#if defined(MOESCOPE_AVX512BF16)
  group_weights_avx512(type, b, s, g, w);
#else
  alignas(32) float wide[32];
  group_weights_f32(type, b, s, g, wide);
  for (int half = 0; half < 2; ++half) {  // the top halves (exact: they are bf16 values), in order
    const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(_mm256_load_ps(wide + 16 * half)), 16);
    const __m256i c = _mm256_srli_epi32(_mm256_castps_si256(_mm256_load_ps(wide + 16 * half + 8)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16 * half),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(a, c), 0xD8));
  }
#endif
}
#endif

}  // namespace moescope
