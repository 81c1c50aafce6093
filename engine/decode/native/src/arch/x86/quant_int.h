// Integer dots of block-quantized rows with a fixed-point input (x86, AVX2 lanes on every AVX2 and
// AVX-512 variant): dots/fixed_input.h says what they compute and to what reference.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/simd.h"
#include "../../base/tune.h"
#include "../../dots/fixed_input.h"
#include "../../formats/types.h"
#include "fixed_convert.h"
#include "unpack.h"

namespace moescope {

#if defined(MOESCOPE_AVX2_INT)
#define MOESCOPE_HAS_IDOT_ROW 1
#define MOESCOPE_HAS_FLOAT_DOT_PREFERENCE 1

// MXFP4 with bf16 dot products keeps its reference-exact loop (quant_dot.h: qdot_row_mxfp4) on AMD
// cores, where it is the faster one, and takes the integer dot on Intel cores, where that is
// (docs/performance-history.md, "MXFP4 on the integer dots").
inline bool prefers_float_dot([[maybe_unused]] int32_t type) {
#if defined(MOESCOPE_AVX512BF16)
  return type == kMXFP4 && !kTune.intel;
#else
  return false;
#endif
}


// acc + the int16 products of a and b summed in pairs (vpmaddwd then vpaddd): one VNNI instruction
// (vpdpwssd) where the CPU has it. On a cache-resident matrix the K-quant dots are bound by their
// vector instructions, so one fused instruction in place of two pays there
// (docs/performance-history.md, "K-quant kernels: fused multiply-adds").
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// A 32-weight group's levels, already widened to int16 (elements 0-15, then 16-31), times the
// input's int16 values from `x` on: the products summed in pairs into 8 int32 lanes (vpmaddwd).
inline __m256i madd_wide(__m256i first, __m256i second, const int16_t* x) {
  return madd_acc(_mm256_madd_epi16(first, load32(x)), second, load32(x + 16));
}

// levels (u8) times both planes of x (s8), pairs summed to int16 then weighted by `scale` (int16)
// into the int32 accumulators of each plane; without kLo (an 8-bit input, whose lo plane is zero)
// the hi plane's alone.
template <bool kLo = true>
inline void madd_planes(__m256i levels, const int8_t* xh, const int8_t* xl, __m256i scale, __m256i& acc_hi,
                        __m256i& acc_lo) {
  acc_hi = madd_acc(acc_hi, _mm256_maddubs_epi16(levels, load32(xh)), scale);
  if constexpr (kLo) acc_lo = madd_acc(acc_lo, _mm256_maddubs_epi16(levels, load32(xl)), scale);
}

// 255 * hi + lo of the two planes' sums, as floats: with no lo plane, 255 * hi rounded once, the
// value the two-plane form gives when lo is zero.
template <bool kLo>
inline __m256 join_planes(__m256i acc_hi, __m256i acc_lo) {
  if constexpr (kLo)
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc_hi), _mm256_set1_ps(255.f), _mm256_cvtepi32_ps(acc_lo));
  else
    return _mm256_mul_ps(_mm256_cvtepi32_ps(acc_hi), _mm256_set1_ps(255.f));
}

// Shuffles that put int16 word 2p of a 128-bit lane in the low lane and word 2p + 1 in the high one:
// with a block's 16 int16 scales split by lane (scales 0-7 in both lanes, then 8-15), one shuffle
// gives the scale vector of 32 weights whose halves are sub-blocks 2p and 2p + 1.
struct PairPicks {
  __m256i pick[4];
  PairPicks() {
    for (int p = 0; p < 4; ++p)
      pick[p] = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((4 * p + 2) | ((4 * p + 3) << 8))),
                                 _mm_set1_epi16(static_cast<int16_t>((4 * p) | ((4 * p + 1) << 8))));
  }
  // the scales of sub-blocks (2p, 2p + 1) + 8 * half
  __m256i of(const __m256i* by_lane, int half, int p) const { return _mm256_shuffle_epi8(by_lane[half], pick[p]); }
};

inline void split_by_lane(__m256i scales16, __m256i* by_lane) {
  by_lane[0] = _mm256_permute2x128_si256(scales16, scales16, 0x00);
  by_lane[1] = _mm256_permute2x128_si256(scales16, scales16, 0x11);
}

// sum over a block's 16 sub-blocks of weight (int16) * sum of x (int32); the callers' bounds keep it in int32
inline int32_t weighted_sums16(__m256i weights16, const int32_t* sums) {
  const __m256i products = _mm256_add_epi32(
      _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(weights16)), load32(sums)),
      _mm256_mullo_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(weights16, 1)), load32(sums + 8)));
  __m128i folded = _mm_add_epi32(_mm256_castsi256_si128(products), _mm256_extracti128_si256(products, 1));
  folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, 0x4E));
  folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, 0xB1));
  return _mm_cvtsi128_si32(folded);
}

// Q4_K in 256-bit lanes on every x86 build: an AVX-512 version (the levels broadcast to both halves
// of a 512-bit register to meet both planes in one load) ran slower on a double-pumped AVX-512 CPU
// (bench.quant_gemv), its cross-lane broadcasts and 512-bit shuffles costing more than they saved.
//
// N inputs at once (replies decoding together, kernels/gemv.h; one input is N = 1, idot_q4_q6_k):
// a block's scales, mins and nibbles are unpacked once for all of them, then each input's products
// summed in the same order as alone (integer sums, then the same float operations), so each result
// is its one-input dot's to the bit. Each input costs its products alone. kLo: the inputs have a lo
// plane (they are not 8-bit).
template <bool kIntel, int N, bool kLo>
inline void idot_q4_k_many(const uint8_t* row, int64_t blocks, const FixedInput* const* in, float* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i pick[8];
  for (int j = 0; j < 8; ++j) pick[j] = _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8)));
  const int8_t* planes[N];
  const float *chunk_scale[N], *sum32[N];
  __m256 acc[N], acc_min[N];
  for (int i = 0; i < N; ++i) {
    planes[i] = in[i]->planes.data();
    chunk_scale[i] = in[i]->scale.data();
    sum32[i] = in[i]->sum32.data();
    acc[i] = acc_min[i] = _mm256_setzero_ps();
  }
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 144;
    prefetch_block<kIntel>(b, 144);
    const __m256i scales_mins = _mm256_cvtepu8_epi16(q4_k_scales_mins(b + 4));  // 8 scales, then 8 mins
    const __m256i scales = _mm256_permute2x128_si256(scales_mins, scales_mins, 0x00);
    __m256i acc_hi[N], acc_lo[N];
    for (int i = 0; i < N; ++i) acc_hi[i] = acc_lo[i] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 64 weights: low nibbles are sub-block 2c, high ones 2c + 1
      const __m256i bytes = load32(b + 16 + 32 * c);
      const __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      const __m256i low_scale = _mm256_shuffle_epi8(scales, pick[2 * c]);
      const __m256i high_scale = _mm256_shuffle_epi8(scales, pick[2 * c + 1]);
      const int64_t at = 2 * (blk * 256 + 64 * c);  // FixedInput::hi_at of the group's first element
      for (int i = 0; i < N; ++i) {
        const int8_t* x = planes[i] + at;
        madd_planes<kLo>(low, x, x + 32, low_scale, acc_hi[i], acc_lo[i]);
        madd_planes<kLo>(high, x + 64, x + 96, high_scale, acc_hi[i], acc_lo[i]);
      }
    }
    int32_t halves;
    std::memcpy(&halves, b, 4);
    const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(scales_mins, 1)));
    for (int i = 0; i < N; ++i) {
      const __m128 d = _mm_mul_ps(d_dmin, _mm_set1_ps(chunk_scale[i][blk]));
      acc[i] = _mm256_fmadd_ps(join_planes<kLo>(acc_hi[i], acc_lo[i]), _mm256_broadcastss_ps(d), acc[i]);
      acc_min[i] = _mm256_fmadd_ps(_mm256_mul_ps(mins, _mm256_loadu_ps(sum32[i] + blk * 8)),
                                   _mm256_broadcastss_ps(_mm_movehdup_ps(d)), acc_min[i]);
    }
  }
  for (int i = 0; i < N; ++i) out[i] = hsum_ps(_mm256_sub_ps(acc[i], acc_min[i]));
}

// Q8_0: the int8 levels widened to int16 and multiplied with the input's int16 values (vpmaddwd),
// one product per weight; a pair of products (127 * 32512 each) stays inside int32.
template <bool kIntel>
inline float idot_q8_0(const uint8_t* row, int64_t blocks, const FixedInput& in) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  const int16_t* x = in.wide.data();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 34;
    prefetch_block<kIntel>(b, 34);
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    const __m256i sums = madd_wide(_mm256_cvtepi8_epi16(first), _mm256_cvtepi8_epi16(second), x + 32 * blk);
    const __m256 d = _mm256_set1_ps(half_to_float(b) * in.scale[blk / 8]);
    if (blk & 1)
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc1);
    else
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc0);
  }
  return hsum_ps(_mm256_add_ps(acc0, acc1));
}

// MXFP4: the 4-bit codes looked up as int8 levels (a pshufb table, as llama.cpp does), widened to
// int16 and multiplied with the input's int16 fixed-point values (vpmaddwd): one product per weight,
// where the two int8 planes of the other kernels take two plus the sign moves maddubs needs. Levels
// are at most 12 in magnitude, so a pair of products stays far inside int32. The scale is 2^(e - 128),
// read from a table (one load a block instead of rebuilding the float in scalar code, which took
// most of this loop's instructions); the input chunk's scale is applied once per 8 blocks.
inline const std::array<float, 256> kE8m0Half = [] {
  std::array<float, 256> values{};
  for (int e = 0; e < 256; ++e) values[e] = e8m0_half(static_cast<uint8_t>(e));
  return values;
}();

template <bool kIntel>
inline float idot_mxfp4(const uint8_t* row, int64_t blocks, const FixedInput& in) {
  __m128i unsigned_levels;  // level + 12, in [0, 24]
  for (int k = 0; k < 16; ++k) reinterpret_cast<uint8_t*>(&unsigned_levels)[k] = static_cast<uint8_t>(kMxfp4Values[k] + 12);
  const __m256i table = _mm256_broadcastsi128_si256(unsigned_levels);
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  // pointers taken once: `in` is the caller's thread_local, and read through it inside the loop
  // the compiler fetched the thread's storage address again (a call) every block
  const int16_t* x = in.wide.data();
  const int32_t* offsets = in.mxfp4_offset.data();
  const float* chunk_scale = in.scale.data();
  auto add_block = [&](int64_t blk, __m256 acc) {
    const uint8_t* b = row + blk * 17;
    // 16 code bytes as words: low nibbles are elements 0-15, high nibbles 16-31
    const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)));
    const __m256i first = _mm256_shuffle_epi8(table, _mm256_and_si256(codes, low4));
    const __m256i second = _mm256_shuffle_epi8(table, _mm256_srli_epi16(codes, 4));
    const __m256i sums = _mm256_sub_epi32(madd_wide(first, second, x + 32 * blk),
                                          load32(offsets + 8 * blk));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(&kE8m0Half[b[0]]), acc);
  };
  __m256 total = _mm256_setzero_ps();
  for (int64_t start = 0; start < blocks; start += 8) {  // the 8 blocks of one 256-element input chunk
    const int64_t end = std::min(blocks, start + 8);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    int64_t blk = start;
    for (; blk + 2 <= end; blk += 2) {
      prefetch_block<kIntel>(row + blk * 17, 34);
      acc0 = add_block(blk, acc0);
      acc1 = add_block(blk + 1, acc1);
    }
    if (blk < end) acc0 = add_block(blk, acc0);
    total = _mm256_fmadd_ps(_mm256_add_ps(acc0, acc1), _mm256_set1_ps(chunk_scale[start / 8]), total);
  }
  return hsum_ps(total);
}

// Q6_K: levels 0..63 (stored as 4 low bits + 2 high bits), minus 32, times a signed 8-bit scale
// per 16 weights. The products use the unsigned levels; 32 * scale * sum(x) comes off per sub-block.
//
// Q6_K for N inputs at once (one input is N = 1), as idot_q4_k_many is for Q4_K: a block's levels
// and scales are unpacked once, each input's sums made in the same order as alone.
template <bool kIntel, int N, bool kLo>
inline void idot_q6_k_many(const uint8_t* row, int64_t blocks, const FixedInput* const* in, float* out) {
  const PairPicks picks;
  __m256 acc[N];
  float offsets[N];
  for (int i = 0; i < N; ++i) {
    acc[i] = _mm256_setzero_ps();
    offsets[i] = 0.f;
  }
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 210;
    prefetch_block<kIntel>(b, 210);
    const __m256i all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    __m256i by_lane[2];
    split_by_lane(all, by_lane);
    __m256i acc_hi[N], acc_lo[N];
    for (int i = 0; i < N; ++i) acc_hi[i] = acc_lo[i] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {  // 32 weights, sub-blocks 2g and 2g + 1
      const __m256i levels = q6_k_group_levels(b, g);
      const __m256i scale = picks.of(by_lane, g / 4, g % 4);
      const int64_t at = blk * 256 + 32 * g;
      for (int i = 0; i < N; ++i) madd_planes<kLo>(levels, in[i]->hi_at(at), in[i]->lo_at(at), scale, acc_hi[i], acc_lo[i]);
    }
    const float block_d = half_to_float(b + 208);
    for (int i = 0; i < N; ++i) {
      const int32_t offset = weighted_sums16(all, in[i]->sum16.data() + blk * 16);
      const float d = block_d * in[i]->scale[blk];
      // 255 * hi + lo rounded twice (a product, then a sum), as this kernel always has: with lo zero,
      // the sum leaves the product as it is
      const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(acc_hi[i]), _mm256_set1_ps(255.f));
      const __m256 total = kLo ? _mm256_add_ps(hi, _mm256_cvtepi32_ps(acc_lo[i])) : hi;
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(total, _mm256_set1_ps(d)));
      offsets[i] += d * 32.f * static_cast<float>(offset);
    }
  }
  for (int i = 0; i < N; ++i) out[i] = hsum_ps(acc[i]) - offsets[i];
}

// Q4_K or Q6_K (`type`) for N inputs at once, one 8-bit setting for them all; N = 1 is the one-input dot.
template <bool kIntel, int N>
inline void idot_many(int32_t type, const uint8_t* row, int64_t blocks, const FixedInput* const* in, float* out) {
  const bool lo = !in[0]->eight_bit;  // one setting for every input of a call
  if (type == kQ4_K)
    lo ? idot_q4_k_many<kIntel, N, true>(row, blocks, in, out) : idot_q4_k_many<kIntel, N, false>(row, blocks, in, out);
  else
    lo ? idot_q6_k_many<kIntel, N, true>(row, blocks, in, out) : idot_q6_k_many<kIntel, N, false>(row, blocks, in, out);
}

template <bool kIntel>
inline float idot_q4_q6_k(int32_t type, const uint8_t* row, int64_t blocks, const FixedInput& in) {
  const FixedInput* one = &in;
  float out;
  idot_many<kIntel, 1>(type, row, blocks, &one, &out);
  return out;
}

// Q4_0 (levels 0..15, minus 8) and Q5_0 (a fifth bit from the block's 32-bit mask, minus 16),
// one float scale per 32 weights: unsigned levels times x, the offset times sum(x) taken off.
template <bool kIntel>
inline float idot_q4_q5_0(const uint8_t* row, int64_t blocks, const FixedInput& in, bool five) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const int64_t stride = five ? 22 : 18;
  const float offset = five ? 16.f : 8.f;
  __m256 acc = _mm256_setzero_ps();
  float offsets = 0.f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * stride;
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (five ? 6 : 2)));
    __m128i first = _mm_and_si128(qs, low4), second = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    if (five) {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      const __m256i spread_bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread_bits, bit), bit);  // byte i: bit i of qh
      const __m256i fifth = _mm256_and_si256(set, _mm256_set1_epi8(0x10));
      first = _mm_or_si128(first, _mm256_castsi256_si128(fifth));
      second = _mm_or_si128(second, _mm256_extracti128_si256(fifth, 1));
    }
    // the unsigned levels widened to int16 times the input's int16 values: one product per weight
    const __m256 total = _mm256_cvtepi32_ps(
        madd_wide(_mm256_cvtepu8_epi16(first), _mm256_cvtepu8_epi16(second), in.wide.data() + 32 * blk));
    const float d = half_to_float(b) * in.scale[blk / 8];
    acc = _mm256_fmadd_ps(total, _mm256_set1_ps(d), acc);
    offsets += d * offset * static_cast<float>(in.sum16[2 * blk] + in.sum16[2 * blk + 1]);
  }
  return hsum_ps(acc) - offsets;
}

// Q2_K and Q3_K: group g (32 weights) has 2-bit levels at bit 2 * (g % 4) of 32 bytes, Q3_K a
// third bit from its high-bit mask (level - 4 when that bit is clear); a scale per 16 weights,
// with Q2_K a min per 16 too. Unsigned levels times x; the mins or the 4s come off per sub-block.
template <bool kIntel, bool kLo>
inline float idot_q2_q3_k(const uint8_t* row, int64_t blocks, const FixedInput& in, bool three) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const PairPicks picks;
  __m256 acc = _mm256_setzero_ps();
  float offsets = 0.f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * (three ? 110 : 84);
    prefetch_block<kIntel>(b, three ? 110 : 84);
    // the 16 scales as int16, and what multiplies each sub-block's sum(x) to come off: the mins
    // (Q2_K) or 4 * scale (Q3_K); |offset| <= 16 * 15 * 16 * 32512 or 16 * 128 * 16 * 32512
    __m256i scales, offset_weights;
    if (three) {  // q3_k_scales: low 4 bits from 8 bytes' nibbles, high 2 bits from 4 bytes
      uint64_t nibbles;
      uint32_t highs;
      std::memcpy(&nibbles, b + 96, 8);
      std::memcpy(&highs, b + 104, 4);
      const __m128i packed = _mm_cvtsi64_si128(static_cast<long long>(nibbles));
      const __m128i low = _mm_and_si128(_mm_unpacklo_epi64(packed, _mm_srli_epi16(packed, 4)), low4);
      const uint32_t two = 0x03030303u;
      const __m128i high = _mm_set_epi32(static_cast<int>((highs >> 6) & two), static_cast<int>((highs >> 4) & two),
                                         static_cast<int>((highs >> 2) & two), static_cast<int>(highs & two));
      scales = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_or_si128(low, _mm_slli_epi16(high, 4))),
                                _mm256_set1_epi16(32));
      offset_weights = _mm256_slli_epi16(scales, 2);
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      scales = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4));
      offset_weights = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    }
    const int32_t offset = weighted_sums16(offset_weights, in.sum16.data() + blk * 16);
    __m256i by_lane[2];
    split_by_lane(scales, by_lane);
    __m256i acc_hi = _mm256_setzero_si256(), acc_lo = acc_hi;
    for (int g = 0; g < 8; ++g) {
      madd_planes<kLo>(q2_q3_k_group_levels(b, g, three), in.hi_at(blk * 256 + 32 * g), in.lo_at(blk * 256 + 32 * g), picks.of(by_lane, g / 4, g % 4),
                  acc_hi, acc_lo);
    }
    const float s = in.scale[blk];
    const float d = half_to_float(b + (three ? 108 : 80)) * s;
    acc = _mm256_fmadd_ps(join_planes<kLo>(acc_hi, acc_lo), _mm256_set1_ps(d), acc);
    offsets += (three ? d : half_to_float(b + 82) * s) * static_cast<float>(offset);
  }
  return hsum_ps(acc) - offsets;
}


// sum over the row of (dequantized weight) * x for the types with an integer dot.
template <bool kIntel>
inline float idot_row_tuned(const Matrix& m, int64_t r, const FixedInput& in) {
  const uint8_t* row = m.row(r);
  const int64_t blocks = m.cols / block_elements(m.type);
  switch (m.type) {
    case kQ4_K:
    case kQ6_K: return idot_q4_q6_k<kIntel>(m.type, row, blocks, in);
    case kQ4_0: return idot_q4_q5_0<kIntel>(row, blocks, in, false);
    case kQ5_0: return idot_q4_q5_0<kIntel>(row, blocks, in, true);
    case kQ3_K:
    case kQ2_K: return in.eight_bit ? idot_q2_q3_k<kIntel, false>(row, blocks, in, m.type == kQ3_K)
                                    : idot_q2_q3_k<kIntel, true>(row, blocks, in, m.type == kQ3_K);
    case kMXFP4: return idot_mxfp4<kIntel>(row, blocks, in);
    case kQ8_0: return idot_q8_0<kIntel>(row, blocks, in);
    default: return idot_row_generic(m, r, in);
  }
}

inline float idot_row(const Matrix& m, int64_t r, const FixedInput& in) {
  return tuned([&](auto intel) { return idot_row_tuned<intel>(m, r, in); });
}

// Row r's dot with each of n inputs: Q4_K's and Q6_K's blocks unpacked once for up to four of them
// (idot_q4_k_many, idot_q6_k_many), eight where the inputs are 8-bit (with half the accumulators each,
// eight fit AVX2's registers: a block's unpacking shared by twice the inputs), the other types one
// input at a time; each result idot_row's.
#define MOESCOPE_HAS_IDOT_ROWS 1

inline void idot_rows(const Matrix& m, int64_t r, const FixedInput* const* in, int64_t n, float* out) {
  if ((m.type != kQ4_K && m.type != kQ6_K) || n == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = idot_row(m, r, *in[i]);
    return;
  }
  const uint8_t* row = m.row(r);
  const int64_t blocks = m.cols / 256;
  tuned([&](auto intel) {
    constexpr bool kIntel = decltype(intel)::value;
    int64_t i = 0;
    if (in[0]->eight_bit)
      for (; i + 8 <= n; i += 8) idot_many<kIntel, 8>(m.type, row, blocks, in + i, out + i);
    for (; i + 4 <= n; i += 4) idot_many<kIntel, 4>(m.type, row, blocks, in + i, out + i);
    if (n - i == 3) idot_many<kIntel, 3>(m.type, row, blocks, in + i, out + i);
    if (n - i == 2) idot_many<kIntel, 2>(m.type, row, blocks, in + i, out + i);
    if (n - i == 1) out[i] = idot_row(m, r, *in[i]);
  });
}
#endif

}  // namespace moescope
