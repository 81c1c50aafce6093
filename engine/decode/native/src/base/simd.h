// The float vector of each width, for loops written once for all of them (FloatVector), and the
// few wide-register helpers the x86 kernels share: bf16 widening, lane sums, exp.
#pragma once

#include <cstdint>

#include "features.h"
#include "scalar.h"

namespace moescope {

// exp's constants (exp16 and exp_shifted): the clamps (below the first exp underflows, past the
// second it overflows), log2(e), ln 2 in two parts, and the polynomial's coefficients from the
// highest power down (Cephes' single-precision polynomial, within ~2 ulp of std::exp).
constexpr float kExpFloor = -87.3f, kExpCeil = 88.8f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
// exp(x) in 16 lanes: clamped below (2^k stays a normal float) and above (past it exp overflows).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpFloor)), _mm512_set1_ps(kExpCeil));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[c]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, k);
}

// 16 bf16 values widened to float32 (a bf16 is the top half of a float32).
inline __m512 widen_bf16(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The lane sums of 16 vectors as one vector (out[j] = sum of v[j]'s lanes): a transposing add tree,
// ~3 instructions a vector where a reduction each takes ~8 and waits on itself.
inline __m512 sum_lanes_16(__m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // x[i]'s 128-bit lane L holds lane L's sums of v[4i .. 4i+3]; add the four lanes up
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(MOESCOPE_AVX2_INT)
// 8 bf16 values widened to float32.
inline __m256 widen_bf16_8(const bf16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The lane sums of 8 vectors as one vector (out[j] = sum of v[j]'s lanes), by a transposing add tree.
inline __m256 sum_lanes_8(const __m256* v) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per 128-bit lane
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// The sum of a vector's 8 lanes.
inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 float32 rounded to bf16 (nearest even) and back, as torch rounds float32 weights to bf16.
inline __m256 round_bf16_avx2(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

#if defined(MOESCOPE_NEON)
// 4 bf16 values widened to float32.
inline float32x4_t widen_bf16_4(const bf16* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
#endif

// The float32 vector of the variant: kernels written once over it run in 16, 8 or 4 lanes.
#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
struct FloatVector {
  static constexpr int64_t lanes = 16;
  __m512 v;
  static FloatVector all(float f) { return {_mm512_set1_ps(f)}; }
  static FloatVector load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static FloatVector widen(const bf16* p) { return {widen_bf16(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  FloatVector fma(FloatVector a, FloatVector b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }  // a * b + this
  FloatVector operator+(FloatVector b) const { return {_mm512_add_ps(v, b.v)}; }
  FloatVector operator-(FloatVector b) const { return {_mm512_sub_ps(v, b.v)}; }
  float sum() const { return _mm512_reduce_add_ps(v); }
  FloatVector exp() const { return {exp16(v)}; }
};
#define MOESCOPE_FLOAT_VECTOR 1
#elif defined(MOESCOPE_AVX2)
struct FloatVector {
  static constexpr int64_t lanes = 8;
  __m256 v;
  static FloatVector all(float f) { return {_mm256_set1_ps(f)}; }
  static FloatVector load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static FloatVector widen(const bf16* p) { return {widen_bf16_8(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  FloatVector fma(FloatVector a, FloatVector b) const { return {_mm256_fmadd_ps(a.v, b.v, v)}; }
  FloatVector operator+(FloatVector b) const { return {_mm256_add_ps(v, b.v)}; }
  FloatVector operator-(FloatVector b) const { return {_mm256_sub_ps(v, b.v)}; }
  float sum() const { return hsum_ps(v); }
  // exp of a shifted softmax score (x <= 0): clamped below only (k >= -126, so 2^k is a normal
  // float, built from its bits)
  FloatVector exp() const {
    const __m256 x = _mm256_max_ps(v, _mm256_set1_ps(kExpFloor));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x));
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[c]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(y, _mm256_castsi256_ps(exponent))};
  }
};
#define MOESCOPE_FLOAT_VECTOR 1
#elif defined(MOESCOPE_NEON)
struct FloatVector {
  static constexpr int64_t lanes = 4;
  float32x4_t v;
  static FloatVector all(float f) { return {vdupq_n_f32(f)}; }
  static FloatVector load(const float* p) { return {vld1q_f32(p)}; }
  static FloatVector widen(const bf16* p) { return {widen_bf16_4(p)}; }
  void store(float* p) const { vst1q_f32(p, v); }
  FloatVector fma(FloatVector a, FloatVector b) const { return {vfmaq_f32(v, a.v, b.v)}; }
  FloatVector operator+(FloatVector b) const { return {vaddq_f32(v, b.v)}; }
  FloatVector operator-(FloatVector b) const { return {vsubq_f32(v, b.v)}; }
  float sum() const { return vaddvq_f32(v); }
  // the same polynomial as the x86 widths (x <= 0, clamped below: 2^k is a normal float)
  FloatVector exp() const {
    const float32x4_t x = vmaxq_f32(v, vdupq_n_f32(kExpFloor));
    const float32x4_t k = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
    const float32x4_t r = vfmsq_f32(vfmsq_f32(x, k, vdupq_n_f32(kLn2Hi)), k, vdupq_n_f32(kLn2Lo));
    float32x4_t p = vdupq_n_f32(kExpPoly[0]);
    for (int c = 1; c < 6; ++c) p = vfmaq_f32(vdupq_n_f32(kExpPoly[c]), p, r);
    const float32x4_t y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.f));
    const int32x4_t exponent = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(k), vdupq_n_s32(127)), 23);
    return {vmulq_f32(y, vreinterpretq_f32_s32(exponent))};
  }
};
#define MOESCOPE_FLOAT_VECTOR 1
#endif

}  // namespace moescope
