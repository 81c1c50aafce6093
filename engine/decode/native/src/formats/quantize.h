// Quantizing float32 values into the GGUF block types: the inverse of blocks.h, one block at a time.
//
// Each function is engine/formats/quantize.py's algorithm for one block, in its arithmetic: the
// 32-element types as the gguf package (llama.cpp's reference) quantizes them; the K-quants'
// searches as that module's numpy ports of llama.cpp's quantize_row_q*_K_ref, with every sum in
// numpy's order (NumpySum), its float32 or float64 dtype, and numpy's rounding and casts. The
// bytes then equal the Python reference's (tests/test_native_quantize.py holds them equal), so a
// conversion's files do not depend on whether the native library is loaded. Portable loops over
// fixed sizes the compiler vectorises; no intrinsics.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../base/scalar.h"
#include "types.h"

namespace moescope {
namespace quantize {

// ----------------------------------------------------------------------------- numbers as numpy forms them

// fp16 bits of a float32, rounded to nearest even (numpy's astype(float16), llama.cpp's FP32_TO_FP16).
inline uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to infinity
  if (magnitude < 0x38800000u) {                        // under 2^-14: a subnormal half (in units of 2^-24)
    float v;
    std::memcpy(&v, &magnitude, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f));
  }
  uint32_t h = magnitude - (112u << 23);  // exponent bias 127 -> 15
  h += 0xfffu + ((h >> 13) & 1u);         // round the 13 dropped bits to nearest even (a carry is right)
  return sign | static_cast<uint16_t>(h >> 13);
}

inline void store_half(uint8_t* p, float v) {
  const uint16_t h = float_to_half(v);
  std::memcpy(p, &h, 2);
}

// v as the dequantizer will read it back (fp16 and back to float32).
inline float half_round(float v) {
  uint8_t h[2];
  store_half(h, v);
  return half_to_float(h);
}

// numpy's sum of a contiguous row of N (a multiple of 8, at most 128) float32 or float64 values:
// eight running sums (lane j over j, j + 8, ...), paired, added to the reduction's initial 0. Any
// other order rounds differently and would change which candidate scale a search keeps.
template <int N, class T>
inline T numpy_sum(const T* v) {
  static_assert(N % 8 == 0 && N <= 128, "numpy sums longer rows pairwise in halves");
  T r[8];
  for (int j = 0; j < 8; ++j) r[j] = v[j];
  for (int i = 8; i < N; i += 8)
    for (int j = 0; j < 8; ++j) r[j] += v[i + j];
  return T(0) + (((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7])));
}

// rint (to nearest, ties to even) for |v| < 2^22 by adding and taking away 1.5 * 2^23, which the
// compiler vectorises (std::rint stays a call); further out the result is still as far from 0,
// which is all the clipped levels below need.
inline float round_near(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// numpy's clip(rint(v).astype(int32), lo, hi) as a float: a value out of int32's range (or NaN)
// casts to INT32_MIN on x86 and so clips to lo.
inline float level(float v, float lo, float hi) {
  float r = round_near(v);
  r = r < lo ? lo : r;
  r = r > hi ? hi : r;
  const bool fits = (v >= -2147483648.0f) & (v < 2147483648.0f);  // no branch: the loops stay vectorised
  return fits ? r : lo;
}

// numpy's rint(v).astype(int32) (out of range and NaN: INT32_MIN, as on x86).
inline int32_t rint_int(float v) {
  return v >= -2147483648.0f && v < 2147483648.0f ? static_cast<int32_t>(std::rint(v)) : INT32_MIN;
}

// numpy's max and argmax of |v| over a row: the max keeps the later of equal values (so the sign of
// a zero is numpy's); argmax the first.
template <int N>
inline float row_max(const float* v) {
  float m = v[0];
  for (int i = 1; i < N; ++i) m = m > v[i] ? m : v[i];
  return m;
}

template <int N>
inline float row_min(const float* v) {
  float m = v[0];
  for (int i = 1; i < N; ++i) m = m < v[i] ? m : v[i];
  return m;
}

template <int N>
inline int abs_argmax(const float* v) {
  int best = 0;
  float top = std::fabs(v[0]);
  for (int i = 1; i < N; ++i) {
    if (std::fabs(v[i]) > top) {
      top = std::fabs(v[i]);
      best = i;
    }
  }
  return best;
}

// ----------------------------------------------------------------------------- the 32-element types

// Q8_0: d = max|x| / 127, levels rounded half away from zero (the gguf package's np_roundf).
inline void q8_0(const float* x, uint8_t* out) {
  uint32_t top = 0;  // max |x| as bits: ordered as the values for non-negative floats, and vectorised
  for (int i = 0; i < 32; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    bits &= 0x7fffffffu;
    top = bits > top ? bits : top;
  }
  float amax;
  std::memcpy(&amax, &top, 4);
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  store_half(out, d);
  // np_roundf: floor(|v|) + floor(2 (|v| - floor(|v|))), signed. |v| <= 127 here, so each floor of a
  // non-negative value is a truncation to int32, which vectorises where std::floor stays scalar;
  // into int32 first and narrowed apart, in a buffer apart from `out` (which might alias x).
  int32_t wide[32];
  for (int i = 0; i < 32; ++i) {
    const float v = x[i] * id, a = std::fabs(v);
    const int32_t whole = static_cast<int32_t>(a);
    const int32_t rounded = whole + static_cast<int32_t>(2.0f * (a - static_cast<float>(whole)));
    wide[i] = v < 0.0f ? -rounded : rounded;
  }
  int8_t q[32];
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(wide[i]);
  std::memcpy(out + 2, q, 32);
}

// Q4_0 and Q5_0: d = (the value of largest magnitude) / -8 or -16, levels trunc(x / d + 8.5 or 16.5).
template <int Offset, int Top>
inline void offset_levels(const float* x, uint8_t* q, float& d) {
  const float peak = x[abs_argmax<32>(x)];
  d = peak / static_cast<float>(-Offset);
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  for (int i = 0; i < 32; ++i) {
    const int v = static_cast<int>(std::trunc(x[i] * id + (static_cast<float>(Offset) + 0.5f)));
    q[i] = static_cast<uint8_t>(v < Top ? v : Top);
  }
}

inline void q4_0(const float* x, uint8_t* out) {
  uint8_t q[32];
  float d;
  offset_levels<8, 15>(x, q, d);
  store_half(out, d);
  for (int i = 0; i < 16; ++i) out[2 + i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
}

inline void q5_0(const float* x, uint8_t* out) {
  uint8_t q[32];
  float d;
  offset_levels<16, 31>(x, q, d);
  store_half(out, d);
  uint32_t high = 0;
  for (int i = 0; i < 32; ++i) high |= static_cast<uint32_t>(q[i] >> 4) << i;
  for (int b = 0; b < 4; ++b) out[2 + b] = static_cast<uint8_t>(high >> (8 * b));
  for (int i = 0; i < 16; ++i) out[6 + i] = static_cast<uint8_t>((q[i] & 0xF) | (q[i + 16] << 4));
}

// ----------------------------------------------------------------------------- the K-quants' searches

// make_qkx2_quants over one sub-block of M: levels L in 0..nmax with x ~ scale * L - min, among
// nstep + 1 candidate scales around max - min (each grid starting from the best min so far), each
// refit by weighted least squares, the best by weighted squared (or absolute) error. All float32.
template <int M>
struct ScaleMinFit {
  float scale, min;  // min is subtracted: x ~ scale * L - min
  float L[M];
};

template <int M>
inline float fit_error(const float* x, const float* w, const float* L, float scale, float offset, bool mad) {
  float e[M];
  for (int i = 0; i < M; ++i) {
    const float diff = (scale * L[i] + offset) - x[i];
    e[i] = w[i] * (mad ? std::fabs(diff) : diff * diff);
  }
  return numpy_sum<M>(e);
}

template <int M>
inline void scale_min_levels(const float* x, float iscale, float offset, float nmax, float* L) {
  for (int i = 0; i < M; ++i) L[i] = level(iscale * (x[i] - offset), 0.0f, nmax);
}

template <int M>
inline void fit_scale_min(const float* x, const float* w, int nmax_int, double rmin, double rdelta, int nstep, bool mad,
                          ScaleMinFit<M>& fit) {
  const float nmax = static_cast<float>(nmax_int);
  const float xmin = row_min<M>(x), high = row_max<M>(x);
  const float low = xmin < 0.0f ? xmin : 0.0f;  // np.minimum(min, 0.0): the 0.0 where they are equal
  if (high == low) {  // flat: every level 0, the min where the values are
    fit.scale = 0.0f;
    fit.min = -low;
    for (int i = 0; i < M; ++i) fit.L[i] = 0.0f;
    return;
  }
  float wx[M];
  for (int i = 0; i < M; ++i) wx[i] = w[i] * x[i];
  const float sum_w = numpy_sum<M>(w), sum_x = numpy_sum<M>(wx);
  const float first = nmax / (high - low);
  scale_min_levels<M>(x, first, low, nmax, fit.L);
  float best_scale = 1.0f / first, best_min = low;
  float best_error = fit_error<M>(x, w, fit.L, best_scale, best_min, mad);
  float L[M], wl[M], wl2[M], wxl[M];
  for (int step = 0; step <= nstep; ++step) {
    const float numerator = static_cast<float>(rmin + rdelta * step + nmax_int);  // a Python float, then float32
    scale_min_levels<M>(x, numerator / (high - best_min), best_min, nmax, L);
    for (int i = 0; i < M; ++i) {
      wl[i] = w[i] * L[i];
      wl2[i] = wl[i] * L[i];
      wxl[i] = wl[i] * x[i];
    }
    const float sum_l = numpy_sum<M>(wl), sum_l2 = numpy_sum<M>(wl2), sum_xl = numpy_sum<M>(wxl);
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    float scale = (sum_w * sum_xl - sum_x * sum_l) / D;
    float offset = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (offset > 0.0f) {
      scale = sum_xl / sum_l2;
      offset = 0.0f;
    }
    const float current = fit_error<M>(x, w, L, scale, offset, mad);
    if (D > 0.0f && current < best_error) {
      std::memcpy(fit.L, L, sizeof(L));
      best_scale = scale;
      best_min = offset;
      best_error = current;
    }
  }
  fit.scale = best_scale;
  fit.min = -best_min;
}

// make_qx_quants (rmse_type 1) over one sub-block of M: levels in -nmax..nmax-1 with x ~ scale * L,
// among 19 candidate scales around -nmax / (the value of largest magnitude); numpy promotes the
// int32 levels' products to float64, so the sums and the comparison run in float64.
template <int M>
struct SymmetricFit {
  float scale;
  float L[M];  // shifted by +nmax
};

template <int M>
inline void symmetric_levels(const float* x, const float* w, float iscale, float nmax, float* L, double& sumlx,
                             double& suml2) {
  double lx[M], l2[M];
  for (int i = 0; i < M; ++i) L[i] = level(iscale * x[i], -nmax, nmax - 1.0f);
  for (int i = 0; i < M; ++i) {  // apart from the levels' loop: both vectorise
    lx[i] = static_cast<double>(w[i] * x[i]) * L[i];
    l2[i] = static_cast<double>(w[i]) * L[i] * L[i];
  }
  sumlx = numpy_sum<M>(lx);
  suml2 = numpy_sum<M>(l2);
}

template <int M>
inline void fit_symmetric(const float* x, int nmax_int, const float* w, SymmetricFit<M>& fit) {
  const float nmax = static_cast<float>(nmax_int);
  const float peak = x[abs_argmax<M>(x)];
  if (std::fabs(peak) < 1e-15f) {
    fit.scale = 0.0f;
    for (int i = 0; i < M; ++i) fit.L[i] = nmax;
    return;
  }
  double sumlx, suml2;
  symmetric_levels<M>(x, w, -nmax / peak, nmax, fit.L, sumlx, suml2);
  double scale = suml2 > 0 ? sumlx / suml2 : 0.0;
  double best = scale * sumlx;
  float L[M];
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    const float numerator = static_cast<float>(-(nmax_int + 0.1 * step));  // a Python float, then float32
    symmetric_levels<M>(x, w, numerator / peak, nmax, L, sumlx, suml2);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      std::memcpy(fit.L, L, sizeof(L));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  fit.scale = static_cast<float>(scale);
  for (int i = 0; i < M; ++i) fit.L[i] += nmax;
}

// make_q3_quants with its rmse refinement (weights x^2): from the levels of -nmax / peak, each level
// revisited in order, up to five passes while one changes, kept where the weighted fit improves.
template <int M>
inline void fit_q3(const float* x, int nmax_int, SymmetricFit<M>& fit) {
  const float nmax = static_cast<float>(nmax_int);
  const float peak = x[abs_argmax<M>(x)];
  const bool zero = std::fabs(peak) < 1e-15f;
  float w[M];
  for (int i = 0; i < M; ++i) w[i] = x[i] * x[i];
  double sumlx, suml2;
  symmetric_levels<M>(x, w, -nmax / (zero ? 1.0f : peak), nmax, fit.L, sumlx, suml2);
  float* L = fit.L;
  for (int pass = 0; pass < 5; ++pass) {
    bool changed = false;
    for (int i = 0; i < M; ++i) {  // in order: each change moves the sums the next one sees
      const double wx = static_cast<double>(w[i] * x[i]);
      const double slx = sumlx - wx * L[i];
      const double sl2 = suml2 - static_cast<double>(w[i]) * L[i] * L[i];
      if (!(slx > 0)) continue;
      const float wanted = static_cast<float>(static_cast<double>(x[i]) * sl2 / slx);
      const float now = level(wanted, -nmax, nmax - 1.0f);
      if (now == L[i]) continue;
      const double slx2 = slx + wx * now;
      const double sl22 = sl2 + static_cast<double>(w[i]) * now * now;
      if (sl22 > 0 && slx2 * slx2 * suml2 > sumlx * sumlx * sl22) {
        L[i] = now;
        sumlx = slx2;
        suml2 = sl22;
        changed = true;
      }
    }
    if (!changed) break;  // the next pass would find the same
  }
  fit.scale = zero ? 0.0f : static_cast<float>(suml2 > 0 ? sumlx / suml2 : 0.0);
  for (int i = 0; i < M; ++i) L[i] = (zero ? 0.0f : L[i]) + nmax;
}

// 256 levels 0..3 as 64 bytes: within each 128, byte l holds elements l, l + 32, l + 64, l + 96.
inline void pack_2bit(const uint8_t* L, uint8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t* q = L + 128 * h + l;
      out[32 * h + l] = static_cast<uint8_t>(q[0] | (q[32] << 2) | (q[64] << 4) | (q[96] << 6));
    }
}

// ----------------------------------------------------------------------------- the K-quants

// Q4_K: 8 sub-blocks of 32, each a scale and a min (make_qkx2_quants, weights rms + |x|), both
// quantized to 6 bits against fp16 d and dmin; the levels then refit to those rounded scales.
inline void q4_k(const float* x, uint8_t* out) {
  ScaleMinFit<32> fits[8];
  float scales[8], mins[8];
  for (int j = 0; j < 8; ++j) {
    const float* s = x + 32 * j;
    float sq[32], w[32];
    for (int i = 0; i < 32; ++i) sq[i] = s[i] * s[i];
    const float av_x = std::sqrt(numpy_sum<32>(sq) / 32.0f);
    for (int i = 0; i < 32; ++i) w[i] = av_x + std::fabs(s[i]);
    fit_scale_min<32>(s, w, 15, -1.0, 0.1, 20, false, fits[j]);
    scales[j] = fits[j].scale;
    mins[j] = fits[j].min;
  }
  const float max_scale = row_max<8>(scales), max_min = row_max<8>(mins);
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    const int32_t s = rint_int(inv_scale * scales[j]), m = rint_int(inv_min * mins[j]);
    ls[j] = static_cast<uint8_t>(s < 63 ? s : 63);
    lm[j] = static_cast<uint8_t>(m < 63 ? m : 63);
  }
  const float d = half_round(max_scale / 63.0f), dmin = half_round(max_min / 63.0f);
  uint8_t L[256];
  for (int j = 0; j < 8; ++j) {
    const float step = d * static_cast<float>(ls[j]), offset = dmin * static_cast<float>(lm[j]);
    for (int i = 0; i < 32; ++i)
      L[32 * j + i] = static_cast<uint8_t>(step != 0.0f ? level((x[32 * j + i] + offset) / step, 0.0f, 15.0f)
                                                        : fits[j].L[i]);
  }
  store_half(out, max_scale / 63.0f);
  store_half(out + 2, max_min / 63.0f);
  uint8_t* packed = out + 4;
  for (int j = 0; j < 4; ++j) {
    packed[j] = static_cast<uint8_t>(ls[j] | ((ls[j + 4] >> 4) << 6));
    packed[4 + j] = static_cast<uint8_t>(lm[j] | ((lm[j + 4] >> 4) << 6));
    packed[8 + j] = static_cast<uint8_t>((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
  }
  uint8_t* qs = out + 16;
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 32; ++l) qs[32 * j + l] = static_cast<uint8_t>(L[64 * j + l] | (L[64 * j + 32 + l] << 4));
}

// Q3_K: 16 sub-blocks of 16 (make_q3_quants), their scales to 6 bits (signed) against one fp16 d.
inline void q3_k(const float* x, uint8_t* out) {
  SymmetricFit<16> fits[16];
  float scales[16];
  for (int j = 0; j < 16; ++j) {
    fit_q3<16>(x + 16 * j, 4, fits[j]);
    scales[j] = fits[j].scale;
  }
  const float max_scale = scales[abs_argmax<16>(scales)];
  const float iscale = max_scale != 0.0f ? -32.0f / max_scale : 0.0f;
  const float d_value = max_scale != 0.0f ? 1.0f / iscale : 0.0f;
  const float d = half_round(d_value);
  uint8_t ls[16], L[256];
  for (int j = 0; j < 16; ++j) {
    ls[j] = max_scale != 0.0f ? static_cast<uint8_t>(level(iscale * scales[j], -32.0f, 31.0f) + 32.0f) : 0;
    const float step = d * static_cast<float>(static_cast<int>(ls[j]) - 32);
    for (int i = 0; i < 16; ++i)
      L[16 * j + i] = static_cast<uint8_t>(step != 0.0f ? level(x[16 * j + i] / step, -4.0f, 3.0f) + 4.0f
                                                        : fits[j].L[i]);
  }
  uint8_t* hmask = out;
  for (int m = 0; m < 32; ++m) {
    uint8_t bits = 0;
    for (int b = 0; b < 8; ++b) bits |= static_cast<uint8_t>((L[32 * b + m] > 3) << b);
    hmask[m] = bits;
  }
  uint8_t low[256];
  for (int i = 0; i < 256; ++i) low[i] = L[i] > 3 ? L[i] - 4 : L[i];
  pack_2bit(low, out + 32);
  uint8_t* packed = out + 96;
  for (int j = 0; j < 8; ++j) packed[j] = static_cast<uint8_t>((ls[j] & 0xF) | ((ls[j + 8] & 0xF) << 4));
  for (int j = 0; j < 4; ++j) packed[8 + j] = 0;
  for (int j = 0; j < 16; ++j) packed[8 + j % 4] |= static_cast<uint8_t>((ls[j] >> 4) << (2 * (j / 4)));
  store_half(out + 108, d_value);
}

// Q2_K: 16 sub-blocks of 16, each a scale and a min (make_qkx2_quants, weights |x|, absolute
// error), both to 4 bits against fp16 d and dmin.
inline void q2_k(const float* x, uint8_t* out) {
  ScaleMinFit<16> fits[16];
  float scales[16], mins[16];
  for (int j = 0; j < 16; ++j) {
    float w[16];
    for (int i = 0; i < 16; ++i) w[i] = std::fabs(x[16 * j + i]);
    fit_scale_min<16>(x + 16 * j, w, 3, -0.5, 0.1, 15, true, fits[j]);
    scales[j] = fits[j].scale;
    mins[j] = fits[j].min;
  }
  const float max_scale = row_max<16>(scales), max_min = row_max<16>(mins);
  const float inv_scale = max_scale > 0.0f ? 15.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 15.0f / max_min : 0.0f;
  const float d_value = max_scale > 0.0f ? max_scale / 15.0f : 0.0f;
  const float dmin_value = max_min > 0.0f ? max_min / 15.0f : 0.0f;
  const float d = half_round(d_value), dmin = half_round(dmin_value);
  uint8_t L[256];
  for (int j = 0; j < 16; ++j) {
    const uint8_t ls = static_cast<uint8_t>(rint_int(inv_scale * scales[j])) & 0xF;
    const uint8_t lm = static_cast<uint8_t>(rint_int(inv_min * mins[j])) & 0xF;
    out[j] = static_cast<uint8_t>(ls | (lm << 4));
    const float step = d * static_cast<float>(ls), offset = dmin * static_cast<float>(lm);
    for (int i = 0; i < 16; ++i)
      L[16 * j + i] = static_cast<uint8_t>(step != 0.0f ? level((x[16 * j + i] + offset) / step, 0.0f, 3.0f)
                                                        : fits[j].L[i]);
  }
  pack_2bit(L, out + 16);
  store_half(out + 80, d_value);
  store_half(out + 82, dmin_value);
}

// Q6_K: 16 sub-blocks of 16 (make_qx_quants, weights x^2), their scales to signed 8 bits against
// one fp16 d.
inline void q6_k(const float* x, uint8_t* out) {
  SymmetricFit<16> fits[16];
  float scales[16];
  for (int j = 0; j < 16; ++j) {
    const float* s = x + 16 * j;
    float w[16];
    for (int i = 0; i < 16; ++i) w[i] = s[i] * s[i];
    fit_symmetric<16>(s, 32, w, fits[j]);
    scales[j] = fits[j].scale;
  }
  const float max_scale = scales[abs_argmax<16>(scales)];
  const bool empty = std::fabs(max_scale) < 1e-15f;
  const float iscale = empty ? 0.0f : -128.0f / max_scale;
  const float d_value = empty ? 0.0f : iscale == 0.0f ? 1.0f : 1.0f / iscale;  // numpy's where(iscale == 0, 1, ...)
  const float d = half_round(d_value);
  int8_t ls[16];
  uint8_t L[256];
  for (int j = 0; j < 16; ++j) {
    const int32_t s = rint_int(iscale * scales[j]);
    ls[j] = empty ? 0 : static_cast<int8_t>(s < 127 ? s : 127);
    const float step = d * static_cast<float>(static_cast<int8_t>(s < 127 ? s : 127));
    for (int i = 0; i < 16; ++i) {
      const float v = step != 0.0f ? level(x[16 * j + i] / step, -32.0f, 31.0f) + 32.0f : fits[j].L[i];
      L[16 * j + i] = empty ? 0 : static_cast<uint8_t>(v);
    }
  }
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = L + 128 * h;
    for (int l = 0; l < 32; ++l) {
      ql[64 * h + l] = static_cast<uint8_t>((q[l] & 0xF) | ((q[l + 64] & 0xF) << 4));
      ql[64 * h + 32 + l] = static_cast<uint8_t>((q[l + 32] & 0xF) | ((q[l + 96] & 0xF) << 4));
      qh[32 * h + l] = static_cast<uint8_t>((q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) |
                                            ((q[l + 96] >> 4) << 6));
    }
  }
  std::memcpy(out + 192, ls, 16);
  store_half(out + 208, d_value);
}

}  // namespace quantize

// Whether quantize_row() writes `type` (MXFP4 and FP8 stay with the Python side).
constexpr bool can_quantize(int32_t type) {
  return type == kQ8_0 || type == kQ4_0 || type == kQ5_0 || type == kQ2_K || type == kQ3_K || type == kQ4_K ||
         type == kQ6_K;
}

// One row of `cols` float32 values (a whole number of blocks) as blocks of `type`.
inline void quantize_row(int32_t type, const float* x, int64_t cols, uint8_t* out) {
  const int64_t elements = block_elements(type), bytes = block_bytes(type);
  void (*block)(const float*, uint8_t*) = nullptr;
  switch (type) {
    case kQ8_0: block = quantize::q8_0; break;
    case kQ4_0: block = quantize::q4_0; break;
    case kQ5_0: block = quantize::q5_0; break;
    case kQ2_K: block = quantize::q2_k; break;
    case kQ3_K: block = quantize::q3_k; break;
    case kQ4_K: block = quantize::q4_k; break;
    case kQ6_K: block = quantize::q6_k; break;
    default: return;
  }
  for (int64_t b = 0; b < cols / elements; ++b) block(x + b * elements, out + b * bytes);
}

}  // namespace moescope
