// Weight matrices in bf16 or in GGUF's block formats, and their one-row products.
//
// Included by moe_decode.cpp inside its namespace, after bf16 helpers and dot_row.
//
// A quantized row is dequantized 32 weights at a time in registers, to the very values of the
// reference dequantizer (engine/formats/dequantize.py, itself checked against the gguf package):
// each weight is (scale * level) - min in float32 with two roundings (this file is compiled with
// -ffp-contract=off, and the vector paths use separate multiply and subtract), then rounded to
// bf16 as torch rounds the model's dequantized weights. The products with the bf16 input are then
// summed in float32 exactly as for a bf16 matrix, so a quantized matrix gives what its dequantized
// bf16 matrix gives, up to the order of the sums.

// GGML type ids (gguf.GGMLQuantizationType); 0 here means plain bf16, and kFP8 is MoEScope's own
// row blocks of block-wise FP8 checkpoints (engine/formats/blocks.py: a float32 scale, 128 e4m3).
enum WeightType : int32_t {
  kBF16 = 0, kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ6_K = 14, kMXFP4 = 39, kFP8 = 200
};

// How far ahead (bytes) a quantized row asks for weight lines (hint: moe_decode.cpp). On Zen 4, in an
// A/B over a model's worth of Q4_K and Q6_K experts (one process, interleaved), 128-384 bytes ahead
// beat 1024 and 2048 by about a tenth; MXFP4 and Q8_0 did not care. On an Intel core (then with the
// T0 hint) 4096 bytes ran the Qwen shape's Q4_K decode 2.2x and its Q8_0 1.8x faster than 256, and
// gpt-oss's MXFP4 1.7x (docs/performance.md); 8192 and 2048 bytes ran Q4_K at 1.02x and 0.88x of 4096.
#if defined(MOESCOPE_TUNE_INTEL)
constexpr int64_t kBlockPrefetchAhead = 4096;
#else
constexpr int64_t kBlockPrefetchAhead = 256;
#endif

// Asks for the block `kBlockPrefetchAhead` bytes past `block` (`bytes` long). On an Intel core every
// line of it (into the second-level cache there, moe_decode.cpp): the first line alone left the rest
// of a K-quant block (144-210 bytes) to the hardware prefetchers and streamed Q4_K rows 7 % slower
// (one process, interleaved, a Sapphire Rapids VM); the lines kNearPrefetchBytes ahead are also
// moved on into the first-level cache there (moe_decode.cpp). Elsewhere the first line, as measured
// on Zen 4.
inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(block + kBlockPrefetchAhead);
#if defined(MOESCOPE_TUNE_INTEL)
  const char* near = reinterpret_cast<const char*>(block + kNearPrefetchBytes);
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(ahead + line, MOESCOPE_PREFETCH_HINT);
    _mm_prefetch(near + line, _MM_HINT_T0);
  }
#else
  (void)bytes;
  _mm_prefetch(ahead, MOESCOPE_PREFETCH_HINT);
#endif
}

// Elements and bytes per block of each type.
inline int64_t block_elements(int32_t type) {
  if (type == kFP8) return 128;
  return type == kQ4_0 || type == kQ5_0 || type == kQ8_0 || type == kMXFP4 ? 32 : 256;
}

inline int64_t block_bytes(int32_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    case kMXFP4: return 17;
    case kFP8: return 132;
    default: return 0;
  }
}

// A weight matrix [rows, cols] as the kernels read it: bf16 rows, or rows of quantized blocks.
struct Matrix {
  const uint8_t* data = nullptr;
  int32_t type = kBF16;
  int64_t rows = 0, cols = 0, row_bytes = 0;

  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction where the CPU has it (every AVX2 and AVX-512 one)
#endif
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

// Q3_K's 16 scales (6 bits, stored + 32) as signed integers.
inline void q3_k_scales(const uint8_t* sc, int32_t* out) {
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
    const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    out[j] = (low | (high << 4)) - 32;
  }
}

// The per-sub-block scales (and mins) of one block, as float32 products the way the reference
// forms them (d * sc, dmin * m), for 16 sub-blocks of 16 (or 8 of 32, each given twice).
struct BlockScales {
  float scale[16];
  float min[16];  // subtracted after the product; 0 for the symmetric types
};

#if defined(__AVX2__)
// Q4_K's 8 scales then 8 mins (6 bits each, packed in the 12 bytes from q on; 16 bytes are read,
// the block goes on past them) as 16 bytes, in vector registers: scales 0-3 and mins 0-3 are the
// low 6 bits of bytes 0-3 and 4-7; scales and mins 4-7 take 4 bits from bytes 8-11 (low and high
// nibble) and their top 2 from the top bits of bytes 0-3 and 4-7.
inline __m128i q4_k_scales_mins(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i six = _mm_and_si128(low, _mm_set1_epi8(0x3F));
  const __m128i nibbles = _mm_and_si128(_mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0x8), _mm_set1_epi8(0x0F));
  const __m128i high = _mm_or_si128(nibbles, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
  return _mm_blend_epi32(six, high, 0xA);
}
#endif

inline void block_scales(int32_t type, const uint8_t* b, BlockScales& s) {
  switch (type) {
    case kQ4_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      const uint8_t* q = b + 4;
#if defined(__AVX2__)
      // The same values from q4_k_scales_mins' bytes, widened and multiplied 8 at a time (the
      // unpacking byte by byte took as long as expanding the block's weights), each stored twice
      // (scale[2j] and scale[2j + 1]).
      const __m128i bytes = q4_k_scales_mins(q);
      const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
      auto widen = [&](__m128i eight, float factor, float* out) {
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)), _mm256_set1_ps(factor));
        _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(v, first));
        _mm256_storeu_ps(out + 8, _mm256_permutevar8x32_ps(v, second));
      };
      widen(bytes, d, s.scale);
      widen(_mm_srli_si128(bytes, 8), dmin, s.min);
      return;
#endif
      for (int j = 0; j < 4; ++j) {  // k4_scale_min unrolled: sub-blocks j and j + 4
        s.scale[2 * j] = s.scale[2 * j + 1] = d * static_cast<float>(q[j] & 63);
        s.min[2 * j] = s.min[2 * j + 1] = dmin * static_cast<float>(q[j + 4] & 63);
        s.scale[2 * j + 8] = s.scale[2 * j + 9] = d * static_cast<float>((q[j + 8] & 0xF) | ((q[j] >> 6) << 4));
        s.min[2 * j + 8] = s.min[2 * j + 9] = dmin * static_cast<float>((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
      }
      return;
    }
    case kQ6_K: {
      const float d = half_to_float(b + 208);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
        s.min[j] = 0.f;
      }
      return;
    }
    case kQ3_K: {
      const float d = half_to_float(b + 108);
      int32_t scales[16];
      q3_k_scales(b + 96, scales);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d * static_cast<float>(scales[j]);
        s.min[j] = 0.f;
      }
      return;
    }
    case kQ2_K: {
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d * static_cast<float>(b[j] & 0xF);
        s.min[j] = dmin * static_cast<float>(b[j] >> 4);
      }
      return;
    }
    case kMXFP4:
    case kFP8: {  // one scale, no min: 2^(e - 128), or the tile's float32 scale over 2^9 (exact)
      float d;
      if (type == kMXFP4) {
        d = e8m0_half(b[0]);
      } else {
        std::memcpy(&d, b, 4);
        d *= 1.f / 512.f;
      }
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d;
        s.min[j] = 0.f;
      }
      return;
    }
    default: {  // the 32-element types: one scale, no min
      const float d = half_to_float(b);
      for (int j = 0; j < 16; ++j) {
        s.scale[j] = d;
        s.min[j] = 0.f;
      }
    }
  }
}

// The 32 levels (integers, as float32 would hold them) of group g of a block: elements 32g..32g+31.
inline void group_levels(int32_t type, const uint8_t* b, int g, int32_t* q) {
  switch (type) {
    case kQ8_0:
      for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>(b[2 + l]);
      return;
    case kQ4_0:
      for (int l = 0; l < 16; ++l) {
        q[l] = (b[2 + l] & 0xF) - 8;
        q[l + 16] = (b[2 + l] >> 4) - 8;
      }
      return;
    case kQ5_0: {
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int l = 0; l < 16; ++l) {
        q[l] = ((b[6 + l] & 0xF) | (((qh >> l) & 1) << 4)) - 16;
        q[l + 16] = ((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16;
      }
      return;
    }
    case kQ4_K: {
      const uint8_t* qs = b + 16 + 32 * (g / 2);
      const int shift = 4 * (g % 2);
      for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> shift) & 0xF;
      return;
    }
    case kMXFP4:
      for (int l = 0; l < 16; ++l) {
        q[l] = kMxfp4Values[b[1 + l] & 0xF];
        q[l + 16] = kMxfp4Values[b[1 + l] >> 4];
      }
      return;
    case kFP8:
      for (int l = 0; l < 32; ++l) q[l] = e4m3_level(b[4 + 32 * g + l]);
      return;
    case kQ6_K: {
      const int half = g / 4, j = g % 4;
      const uint8_t* ql = b + 64 * half + 32 * (j & 1);
      const uint8_t* qh = b + 128 + 32 * half;
      const int low_shift = 4 * (j >> 1), high_shift = 2 * j;
      for (int l = 0; l < 32; ++l) q[l] = (((ql[l] >> low_shift) & 0xF) | (((qh[l] >> high_shift) & 3) << 4)) - 32;
      return;
    }
    case kQ3_K: {
      const uint8_t* qs = b + 32 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      for (int l = 0; l < 32; ++l) q[l] = ((qs[l] >> shift) & 3) - (((b[l] >> g) & 1) ? 0 : 4);
      return;
    }
    case kQ2_K: {
      const uint8_t* qs = b + 16 + 32 * (g / 4);
      const int shift = 2 * (g % 4);
      for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> shift) & 3;
      return;
    }
    default:
      return;
  }
}

// Weight values of group g as the reference computes them, rounded to bf16 (portable path).
inline void group_weights(int32_t type, const uint8_t* b, const BlockScales& s, int g, bf16* w) {
  int32_t q[32];
  group_levels(type, b, g, q);
  for (int l = 0; l < 32; ++l) {
    const int sub = (32 * g + l) / 16;
    const float product = s.scale[sub] * static_cast<float>(q[l]);
    w[l] = to_bf16(product - s.min[sub]);
  }
}

#if defined(__AVX2__)
// 8 float32 rounded to bf16 (nearest even) and back, as torch rounds float32 weights to bf16.
inline __m256 round_bf16_avx2(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The unsigned levels of group g (32 weights) of a block, 32 bytes at a time, as group_levels reads
// them: Q6_K's 0..63 (32 above the signed level), Q2_K's 0..3, Q3_K's 0..7 with the mask bit on top
// (4 above). Shared by the dequantizer and the integer dots (quant_int.h).
inline __m256i q6_k_group_levels(const uint8_t* b, int g) {
  const int half = g / 4, j = g % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (j & 1)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (j >> 1)), _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), _mm256_set1_epi8(3));
  return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

inline __m256i q2_q3_k_group_levels(const uint8_t* b, int g, bool three) {
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (three ? 32 : 16) + 32 * (g / 4)));
  const __m256i levels = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (g % 4)), _mm256_set1_epi8(3));
  if (!three) return levels;
  const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm256_or_si256(levels, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(mask, g), _mm256_set1_epi8(1)), 2));
}
#endif

#if defined(MOESCOPE_AVX512BF16)
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
    prefetch_block(row + blk * 17, 34);
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

inline float qdot_row_q4_k(const uint8_t* row, int64_t blocks, const bf16* x) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  BlockScales s;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * 144;
    prefetch_block(b, 144);
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
inline float qdot_row(const Matrix& m, int64_t r, const bf16* x) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  if (m.type == kQ4_K) return qdot_row_q4_k(row, blocks, x);
  if (m.type == kQ4_0 || m.type == kQ5_0) return qdot_row_q4_q5_0(row, blocks, x, m.type == kQ5_0);
  if (m.type == kMXFP4) return qdot_row_mxfp4(row, blocks, x);
  const int groups = static_cast<int>(be / 32);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  BlockScales s;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    prefetch_block(b, bb);
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
#elif defined(MOESCOPE_AVX2)
inline __m256 widen_bf16_avx2(const bf16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float qdot_row(const Matrix& m, int64_t r, const bf16* x) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  BlockScales s;
  alignas(32) int32_t q[32];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    prefetch_block(b, bb);
    block_scales(m.type, b, s);
    for (int g = 0; g < groups; ++g) {
      group_levels(m.type, b, g, q);
      for (int part = 0; part < 4; ++part) {
        const int sub = 2 * g + part / 2;
        const __m256 level = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(q + 8 * part)));
        const __m256 w = round_bf16_avx2(
            _mm256_sub_ps(_mm256_mul_ps(level, _mm256_set1_ps(s.scale[sub])), _mm256_set1_ps(s.min[sub])));
        acc[part] = _mm256_fmadd_ps(w, widen_bf16_avx2(x + blk * be + 32 * g + 8 * part), acc[part]);
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
#else
inline float qdot_row(const Matrix& m, int64_t r, const bf16* x) {
  const uint8_t* row = m.row(r);
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  BlockScales s;
  bf16 w[32];
  float sum = 0.f;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* b = row + blk * bb;
    block_scales(m.type, b, s);
    for (int g = 0; g < groups; ++g) {
      group_weights(m.type, b, s, g, w);
      const bf16* xs = x + blk * be + 32 * g;
      for (int l = 0; l < 32; ++l) sum += to_float(w[l]) * to_float(xs[l]);
    }
  }
  return sum;
}
#endif

#include "quant_int.h"  // integer dots for the common types

// Whether one-row products take the integer kernels (quant_int.h) or the reference-exact float
// loops above; switched per module for tests and A/B measurements.
inline bool& integer_dots_enabled() {
  static bool enabled = true;
  return enabled;
}

// out[n - first] = W[n, :] . x for rows [begin, end).
inline void gemv_into_rows(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out, int64_t first) {
  if (m.type == kBF16) {
    const bf16* w = reinterpret_cast<const bf16*>(m.data);
    const int64_t ld = m.row_bytes / 2;
    for (int64_t n = begin; n < end; ++n) out[n - first] = dot_row(w + n * ld, x, m.cols);
    return;
  }
  if (has_integer_dot(m.type) && integer_dots_enabled()) {
    thread_local FixedInput fixed;
    fixed.prepare(x, m.cols);
    for (int64_t n = begin; n < end; ++n) out[n - first] = idot_row(m, n, fixed);
    return;
  }
  for (int64_t n = begin; n < end; ++n) out[n - first] = qdot_row(m, n, x);
}

// out[n] = W[n, :] . x for rows [begin, end).
inline void gemv_range(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out) {
  gemv_into_rows(m, x, begin, end, out, 0);
}

// The same for rows [begin, end), written from out[0] on (one head's rows of a projection).
inline void gemv_rows(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out) {
  gemv_into_rows(m, x, begin, end, out, begin);
}

#if defined(MOESCOPE_AVX512BF16)
// One Q4_K row as bf16 weights, through qdot_row_q4_k's tables (the values group_weights_avx512 computes).
inline void dequantize_row_q4_k(const uint8_t* row, int64_t blocks, bf16* w) {
  BlockScales s;
  for (int64_t blk = 0; blk < blocks; ++blk, w += 256) {
    const uint8_t* b = row + blk * 144;
    prefetch_block(b, 144);
    block_scales(kQ4_K, b, s);
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      q4_k_chunk_bf16(b, s, c, lo, hi);
      _mm512_storeu_si512(w + 64 * c, lo);
      _mm512_storeu_si512(w + 64 * c + 32, hi);
    }
  }
}
#endif

#if defined(__AVX2__)
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

#endif

// group_weights' values (scale * level - min, two roundings, then rounded to bf16 as torch rounds)
// as float32: 8 at a time for the types AVX2 unpacks in vectors.
inline void group_weights_f32(int32_t type, const uint8_t* b, const BlockScales& s, int g, float* w) {
#if defined(__AVX2__)
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
#endif
  alignas(32) bf16 rounded[32];
  group_weights(type, b, s, g, rounded);
  for (int l = 0; l < 32; ++l) w[l] = to_float(rounded[l]);
}

// fn(at, block, s, g) for each 32-value group g of each block of rows [begin, end) of a block-quantized W,
// in order; `at` is the group's first element in a row-major [rows, cols] layout, `s` its block's scales.
template <typename Fn>
inline void for_each_group(const Matrix& m, int64_t begin, int64_t end, Fn fn) {
  const int64_t be = block_elements(m.type), bb = block_bytes(m.type), blocks = m.cols / be;
  const int groups = static_cast<int>(be / 32);
  BlockScales s;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = m.row(n);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      block_scales(m.type, row + blk * bb, s);
      for (int g = 0; g < groups; ++g) fn(n * m.cols + blk * be + 32 * g, row + blk * bb, s, g);
    }
  }
}

// Rows [begin, end) of W as float32 into out (row n at out's row n - first): the reference's values
// (bf16 ones), for products in float32 where the build has no bf16 dot products.
inline void dequantize_rows_f32(const Matrix& m, int64_t begin, int64_t end, float* out, int64_t first = 0) {
  out -= first * m.cols;
  if (m.type == kBF16) {
    for (int64_t n = begin; n < end; ++n) {
      const bf16* row = reinterpret_cast<const bf16*>(m.row(n));
      for (int64_t c = 0; c < m.cols; ++c) out[n * m.cols + c] = to_float(row[c]);
    }
    return;
  }
  for_each_group(m, begin, end, [&](int64_t at, const uint8_t* block, const BlockScales& s, int g) {
    group_weights_f32(m.type, block, s, g, out + at);
  });
}

// Rows [begin, end) of W dequantized to bf16 into out (row-major, cols per row; row n at out's row
// n - first): the reference's values.
inline void dequantize_rows(const Matrix& m, int64_t begin, int64_t end, bf16* out, int64_t first = 0) {
  out -= first * m.cols;
  if (m.type == kBF16) {
    for (int64_t n = begin; n < end; ++n) std::memcpy(out + n * m.cols, m.row(n), m.cols * sizeof(bf16));
    return;
  }
#if defined(MOESCOPE_AVX512BF16)
  if (m.type == kQ4_K) {
    for (int64_t n = begin; n < end; ++n) dequantize_row_q4_k(m.row(n), m.cols / 256, out + n * m.cols);
    return;
  }
#endif
  for_each_group(m, begin, end, [&](int64_t at, const uint8_t* block, const BlockScales& s, int g) {
    bf16* w = out + at;
#if defined(MOESCOPE_AVX512BF16)
    group_weights_avx512(m.type, block, s, g, w);
#elif defined(__AVX2__)
    alignas(32) float wide[32];
    group_weights_f32(m.type, block, s, g, wide);
    for (int half = 0; half < 2; ++half) {  // the top halves (exact: they are bf16 values), in order
      const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(_mm256_load_ps(wide + 16 * half)), 16);
      const __m256i c = _mm256_srli_epi32(_mm256_castps_si256(_mm256_load_ps(wide + 16 * half + 8)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16 * half),
                          _mm256_permute4x64_epi64(_mm256_packus_epi32(a, c), 0xD8));
    }
#else
    group_weights(m.type, block, s, g, w);
#endif
  });
}
