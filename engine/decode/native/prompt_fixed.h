// Prompt tiles of Q4_K matrices in integers, in builds without bf16 dot products (AVX2, AVX-512
// without BF16).
//
// Included by moe_decode.cpp (inside its namespace). Other types' tiles there are dequantized to
// float32 and multiplied with fused multiply-adds: 8 products an instruction, on the two ports that
// have them. Here a Q4_K tile's weights stay integers, each level times its sub-block's 6-bit scale (at most
// 15 * 63, an int16), the input rows are put in fixed point as a decode input is (quant_int.h: per
// 256 values a float scale, each value an int16 of at most 32512), and one vpmaddwd multiplies 16
// pairs; its sums add up in int32 lanes for 64 inputs (32 pair sums of at most 2 * 945 * 32512 stay
// below 2^31), then once in float with the block's d and the input chunk's scale. The mins multiply
// the float sums of x, as in the decode kernels. The reference is the same as theirs: the products
// with the float32 dequantized weights, to within the input's fixed-point rounding (below 2^-15 of
// a chunk's largest value), not rounded to bf16 first; tests/test_quant_kernels.py holds the
// prompt paths of every build flavour to it.

#if defined(MOESCOPE_FIXED_PROMPT)
constexpr int64_t kFixedSpan = 64;  // inputs summed in int32 before the float step

// A tile's kTile rows of a Q4_K matrix for fixed_block_product: per row its weights as int16
// (level * scale, in fixed_order), per 256 its d and per 32 its min (dmin * m, the reference's
// float product).
struct FixedTile {
  std::vector<int16_t> weights;  // [kTile][k]
  std::vector<float> d;          // [kTile][k / 256]
  std::vector<float> min;        // [kTile][k / 32]
  int64_t k = 0;

  void load(const Matrix& m, const int64_t* at) {
    k = m.cols;
    weights.resize(kTile * k);
    d.resize(kTile * (k / 256));
    min.resize(kTile * (k / 32));
    const __m256i low4 = _mm256_set1_epi16(0x000F);
    __m256i pick[8];  // int16 scale j (bytes 2j, 2j + 1) in every lane
    for (int j = 0; j < 8; ++j) pick[j] = _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8)));
    for (int r = 0; r < kTile; ++r) {
      const uint8_t* row = m.row(at[r]);
      for (int64_t blk = 0; blk < k / 256; ++blk) {
        const uint8_t* b = row + blk * 144;
        const __m128i scales_mins = q4_k_scales_mins(b + 4);  // 8 scales, then 8 mins
        const __m256i wide = _mm256_cvtepu8_epi16(scales_mins);
        const __m256i scales = _mm256_permute2x128_si256(wide, wide, 0x00);
        d[r * (k / 256) + blk] = half_to_float(b);
        _mm256_storeu_ps(min.data() + r * (k / 32) + blk * 8,
                         _mm256_mul_ps(_mm256_set1_ps(half_to_float(b + 2)),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8)))));
        int16_t* out = weights.data() + r * k + blk * 256;
        for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
          const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
          const __m256i low = _mm256_shuffle_epi8(scales, pick[2 * c]), high = _mm256_shuffle_epi8(scales, pick[2 * c + 1]);
          const __m256i levels[4] = {_mm256_and_si256(words, low4), _mm256_and_si256(_mm256_srli_epi16(words, 8), low4),
                                     _mm256_and_si256(_mm256_srli_epi16(words, 4), low4), _mm256_srli_epi16(words, 12)};
          for (int part = 0; part < 4; ++part)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * c + 16 * part),
                                _mm256_mullo_epi16(levels[part], part < 2 ? low : high));
        }
      }
    }
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
    for (int64_t span = 0; span < k; span += kFixedSpan) {
      __m256i sums[kTile];
#pragma GCC unroll 8
      for (int r = 0; r < kTile; ++r) sums[r] = _mm256_setzero_si256();
      const int16_t* weights = w.weights.data() + span;
      const int16_t* xs = x + span * kBlock + 16 * v;
#pragma GCC unroll 4
      for (int64_t p = 0; p < kFixedSpan; p += 2) {
        const __m256i xv = load32(xs + p * kBlock);
#pragma GCC unroll 8
        for (int r = 0; r < kTile; ++r) {
          int32_t pair;
          std::memcpy(&pair, weights + r * k + p, 4);
          sums[r] = madd_acc(sums[r], _mm256_set1_epi32(pair), xv);
        }
      }
      const int64_t chunk = span / 256;
      const __m256 scale = _mm256_loadu_ps(x_scale + chunk * kBlock + 8 * v);
#pragma GCC unroll 8
      for (int r = 0; r < kTile; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(_mm256_set1_ps(w.d[r * (k / 256) + chunk]), scale),
                                 acc[r]);
    }
    // the mins times the float sums of x, per sub-block of 32
    for (int64_t sub = 0; sub < k / 32; ++sub) {
      const __m256 sums = _mm256_loadu_ps(x_sums + sub * kBlock + 8 * v);
#pragma GCC unroll 8
      for (int r = 0; r < kTile; ++r) mins[r] = _mm256_fmadd_ps(_mm256_set1_ps(w.min[r * (k / 32) + sub]), sums, mins[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kTile; ++r) _mm256_storeu_ps(out + r * kBlock + 8 * v, _mm256_sub_ps(acc[r], mins[r]));
  }
}

// The tile's kTile rows at[] of a Q4_K matrix times expert e's rows of `in` (fixed point; rows first ..
// first + m - 1 of x): emit(i, sums) with sums[r] = x_(first + i) . w_r.
template <class Emit>
inline void fixed_tile_times_rows(const Matrix& w, const int64_t* at, const PromptInput& in, int64_t e,
                                  int64_t first, int64_t m, FixedTile& tile, Emit&& emit) {
  TORCH_CHECK(w.type == kQ4_K && w.cols == in.k, "fixed-point prompt tiles: a Q4_K matrix of the input's width");
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
