// Scalar number formats the weights and activations come in: bf16, fp16, and the scale and level
// codes of MXFP4 (e8m0, e2m1) and FP8 (e4m3), with the roundings torch applies.
#pragma once

#include <cstdint>
#include <cstring>

#include "features.h"

namespace moescope {

using bf16 = uint16_t;

inline float to_float(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline bf16 to_bf16(float v) {  // round to nearest even, as torch does (NaN kept quiet)
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

inline float round_bf16(float v) { return to_float(to_bf16(v)); }

// An IEEE half (two bytes at p, little-endian) as float32.
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction where the CPU has it (every AVX2 and AVX-512 one)
#elif defined(MOESCOPE_NEON)
  __fp16 half;
  std::memcpy(&half, &h, 2);
  return static_cast<float>(half);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = mant;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// MXFP4's e2m1 codes, doubled as GGUF tables them (the block scale is then 2^(e - 128)).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) for an e8m0 exponent byte (gguf's e8m0_to_fp32_half: e = 0 and 1 are subnormal).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// An e4m3 byte's value times 2^9: an integer (the smallest subnormal is 2^-9), so FP8 weights
// take the same integer-level path as the GGUF types, with the block scale divided by 2^9.
inline int32_t e4m3_level(uint8_t byte) {
  const int32_t exponent = (byte >> 3) & 0xF, mantissa = byte & 7;
  const int32_t magnitude = exponent == 0 ? mantissa : (8 + mantissa) << (exponent - 1);
  return byte & 0x80 ? -magnitude : magnitude;
}

}  // namespace moescope
