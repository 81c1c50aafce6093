// One-token (decode) kernels on the CPU for weights in bf16 or in GGUF's block formats (quant.h):
// matrix-vector products that stream the weights once at close to memory bandwidth, and a whole
// MoE layer's experts in two passes.
//
// Why hand-written: for one row, oneDNN re-arranges a plain bf16 weight on every call and torch's
// native kernel pays a thread-pool round trip per matrix (8 experts x 2 matrices x every layer),
// so both stream expert weights at well under the memory bandwidth on a 2-core machine.
// Arithmetic: bf16 products summed in float32 (AVX-512 BF16 dot products where the CPU has them),
// rounded to bf16 where transformers rounds (each projection's output, the activation, the
// product), so results are close to, not bit-identical with, transformers' kernels.
// The parts of torch these kernels use, not <torch/extension.h>: parsing that header alone took most
// of a build's time (minutes of first-run wait on a small CPU), and only ATen's tensors, a few
// of its ops and pybind11's tensor caster are needed here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/topk.h>
#include <omp.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// Build flavours: AVX-512 with BF16 dot products, AVX-512 without them, AVX2 with FMA, or portable
// C++ the compiler vectorises for whatever it targets (ARM, older x86).
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MOESCOPE_AVX512BF16 1
#elif defined(__AVX512F__)
#include <immintrin.h>
#define MOESCOPE_AVX512F 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOESCOPE_AVX2 1
#endif
// AMX tiles for a prompt's bf16 products (prompt_amx.h), beside the bf16 dot products that stay the
// path of the one-row products and of CPUs or kernels without AMX.
#if defined(MOESCOPE_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MOESCOPE_AMX 1
#endif

// MOESCOPE_TUNE_INTEL (kernels.py defines it where /proc/cpuinfo says GenuineIntel) picks what
// measured faster on Intel cores (a Sapphire Rapids VM, docs/performance.md) than on AMD's:
// - the hint weight rows are fetched ahead with. On AMD cores non-temporal: the weights, read once a
//   token, then no longer evict the KV cache, the activations and the interpreter's data (steps
//   2-5 % faster). On an Intel core a non-temporal line goes to the first-level cache alone, and
//   bf16, Q8_0 and MXFP4 streams ran at 0.4-0.6x of T0's; T1 (the second-level cache, whose queue
//   holds more lines in flight than the first level's fill buffers) streamed bf16 rows 1.35x, Q8_0
//   1.27x and MXFP4 1.2x faster than T0 from memory (one process, interleaved, two threads);
// - how far ahead quantized rows are fetched (quant.h: kBlockPrefetchAhead);
// - MXFP4 rows on the integer dots where the CPU has bf16 dot products too (quant_int.h).
#if defined(MOESCOPE_TUNE_INTEL)
#define MOESCOPE_PREFETCH_HINT _MM_HINT_T1
#else
#define MOESCOPE_PREFETCH_HINT _MM_HINT_NTA
#endif

namespace {

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

// exp16's and exp_shifted's constants: the clamps (below the first exp underflows, past the second
// it overflows), log2(e), ln 2 in two parts, and the polynomial's coefficients from the highest power down
constexpr float kExpFloor = -87.3f, kExpCeil = 88.8f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
// exp(x) in 16 lanes (Cephes' single-precision polynomial, within ~2 ulp of std::exp): clamped
// below (2^k stays a normal float) and above (past it exp overflows, and 2^128 gives infinity)
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
#elif defined(MOESCOPE_AVX2)
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
#endif

#if defined(__AVX2__)
// The sum of a vector's 8 lanes.
inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// How far ahead (elements) dot_row asks for weight lines, with MOESCOPE_PREFETCH_HINT. A line past the
// end of a matrix is only a hint: prefetches never fault. (2K-16K elements ahead were tried the same
// way: 4K was best or tied.)
constexpr int64_t kPrefetchAhead = 4096;
// On an Intel core the weight lines this many bytes ahead, already asked into the second-level
// cache, are moved on into the first (T0), which the loop's loads would otherwise wait for: from
// memory, Q4_K rows 1.08x, Q8_0 1.05x, Q6_K, MXFP4 and bf16 1.03x (256 and 1024 bytes measured the
// same as 512 on Q4_K). dot_row here and quant.h's prefetch_block.
constexpr int64_t kNearPrefetchBytes = 512;

// One weight row with x, length k: four independent sums so the loads stream back to back.
// (Summing 4 rows at once, to share the loads of x, streamed well below a plain read's speed,
// where one row at a time reaches it.)
inline float dot_row(const bf16* w, const bf16* x, int64_t k) {
#if defined(MOESCOPE_AVX512BF16)
  auto dot = [](__m512 acc, const bf16* a, const bf16* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
    for (int line = 0; line < 4; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchAhead + line * 32), MOESCOPE_PREFETCH_HINT);
#if defined(MOESCOPE_TUNE_INTEL)
      _mm_prefetch(reinterpret_cast<const char*>(w + i + line * 32) + kNearPrefetchBytes, _MM_HINT_T0);
#endif
    }
    a0 = dot(a0, w + i, x + i);
    a1 = dot(a1, w + i + 32, x + i + 32);
    a2 = dot(a2, w + i + 64, x + i + 64);
    a3 = dot(a3, w + i + 96, x + i + 96);
  }
  for (; i + 32 <= k; i += 32) a0 = dot(a0, w + i, x + i);
  if (i < k) {
    const __mmask32 mask = (__mmask32)((1ull << (k - i)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i),
                          (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(MOESCOPE_AVX512F)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchAhead), MOESCOPE_PREFETCH_HINT);
    a0 = _mm512_fmadd_ps(widen_bf16(w + i), widen_bf16(x + i), a0);
    a1 = _mm512_fmadd_ps(widen_bf16(w + i + 16), widen_bf16(x + i + 16), a1);
  }
  float tail = 0.f;
  for (; i < k; ++i) tail += to_float(w[i]) * to_float(x[i]);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail;
#elif defined(MOESCOPE_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchAhead), MOESCOPE_PREFETCH_HINT);
    a0 = _mm256_fmadd_ps(widen_bf16_8(w + i), widen_bf16_8(x + i), a0);
    a1 = _mm256_fmadd_ps(widen_bf16_8(w + i + 8), widen_bf16_8(x + i + 8), a1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a0, a1));
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  for (; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
#else
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
#endif
}

#include "quant.h"  // Matrix: bf16 or block-quantized weights, and gemv_range over it

// A float32 weight row with a bf16 x widened to float32, length k (a router kept in float32).
inline float dot_f32_bf16(const float* w, const bf16* x, int64_t k) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), widen_bf16(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), widen_bf16(x + i + 16), a1);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(MOESCOPE_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (; i + 16 <= k; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), widen_bf16_8(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), widen_bf16_8(x + i + 8), a1);
  }
  sum = hsum_ps(_mm256_add_ps(a0, a1));
#endif
  for (; i < k; ++i) sum += w[i] * to_float(x[i]);
  return sum;
}

inline const bf16* bf16_data(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
inline bf16* bf16_data(at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

void check_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, ": a bf16 CPU tensor is needed");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a 2-D matrix with contiguous rows is needed");
}

void check_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == n,
              name, ": a contiguous bf16 CPU vector of ", n, " values is needed");
}

constexpr int64_t kGrain = 64;  // rows per task: ~128 KB of weights, enough to hide a task's start

// A weight matrix as Python hands it over: a bf16 [rows, cols] tensor (type 0), or a uint8
// [rows, row bytes] tensor of blocks of a GGML type with `cols` logical columns.
struct Weight {
  at::Tensor tensor;
  int32_t type = kBF16;
  int64_t cols = 0;
};

Matrix matrix_of(const Weight& w, const char* name) {
  const at::Tensor& t = w.tensor;
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              ": a 2-D CPU matrix with contiguous rows is needed");
  Matrix m;
  m.data = reinterpret_cast<const uint8_t*>(t.data_ptr());
  m.type = w.type;
  m.rows = t.size(0);
  if (w.type == kBF16) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": a bf16 CPU tensor is needed");
    m.cols = t.size(1);
    m.row_bytes = t.stride(0) * 2;
  } else {
    const int64_t be = block_elements(w.type), bb = block_bytes(w.type);
    TORCH_CHECK(bb > 0 && t.scalar_type() == at::kByte, name, ": uint8 blocks of a supported GGML type needed");
    TORCH_CHECK(w.cols > 0 && w.cols % be == 0 && t.size(1) == w.cols / be * bb, name, ": ", w.cols,
                " columns do not match ", t.size(1), " bytes a row of type ", w.type);
    m.cols = w.cols;
    m.row_bytes = t.stride(0);
  }
  return m;
}

Weight plain(const at::Tensor& t) { return {t, kBF16, t.dim() == 2 ? t.size(1) : 0}; }

// n outputs of a linear layer as F.linear gives them: the float32 sums plus the bias if any, rounded
// to bf16 once.
inline void round_linear(const float* acc, const bf16* bias, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(bias == nullptr ? acc[i] : acc[i] + to_float(bias[i]));
}

// acc = W x over all rows of W, split across threads; then, plus the bias, rounded into `out`.
void gemv_into(const Matrix& w, const bf16* x, float* acc, bf16* out, const bf16* bias = nullptr) {
  at::parallel_for(0, w.rows, kGrain, [&](int64_t begin, int64_t end) { gemv_range(w, x, begin, end, acc); });
  round_linear(acc, bias, w.rows, out);
}

// y = W x (+ bias) for one row x (any leading shape of size 1), as F.linear: the bias is added to
// the float32 sums before the one rounding to bf16, as torch's addmm does.
at::Tensor gemv(const Weight& weight, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  const Matrix w = matrix_of(weight, "weight");
  TORCH_CHECK(x.numel() == w.cols && x.scalar_type() == at::kBFloat16, "x: one bf16 row of the weight's width needed");
  const at::Tensor xc = x.contiguous();
  std::vector<float> acc(w.rows);
  auto sizes = x.sizes().vec();
  sizes.back() = w.rows;
  at::Tensor y = at::empty(sizes, x.options());
  if (bias.has_value()) check_vector(*bias, w.rows, "bias");
  gemv_into(w, bf16_data(xc), acc.data(), bf16_data(y), bias.has_value() ? bf16_data(*bias) : nullptr);
  return y;
}

// The weight dequantized into `out` [rows, cols] (the reference's values), rows split across threads:
// bf16, or float32 as the prompt tiles of builds without bf16 dot products expand it.
void dequantize(const Weight& weight, at::Tensor out) {
  const Matrix w = matrix_of(weight, "weight");
  const bool wide = out.scalar_type() == at::kFloat;
  TORCH_CHECK((wide || out.scalar_type() == at::kBFloat16) && out.is_contiguous() && out.numel() == w.rows * w.cols,
              "dequantize: a contiguous bf16 or float32 tensor of rows x cols is needed");
  at::parallel_for(0, w.rows, 16, [&](int64_t begin, int64_t end) {
    if (wide)
      dequantize_rows_f32(w, begin, end, out.data_ptr<float>());
    else
      dequantize_rows(w, begin, end, bf16_data(out));
  });
}

// A prompt's rows through one weight matrix (x W^T for x [m, cols]). Each tile of kTile rows of W is
// dequantized once into a buffer that stays in L1 and multiplied by every row of x, so a quantized
// expert is never expanded in memory (the exact path expands it into a scratch, then oneDNN reads
// that back and re-packs it on every call). 4 rows with bf16 dot products (4 x 4 accumulators);
// 6 in float32 (6 x 2 accumulators of 16 input rows: AVX2's 16 registers).
#if defined(MOESCOPE_AVX512BF16)
constexpr int64_t kTile = 4;
#else
constexpr int64_t kTile = 6;
#endif
constexpr int64_t kPairs = kTile / 2;  // a gate/up tile's intermediate rows: kPairs gate rows, then their up rows

#if defined(MOESCOPE_AVX512BF16)
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
// fused multiply-adds busy (one-row dot products with 8 accumulators, tried first, ran at about
// half that rate; torch's own bf16 matmul is slower still on such CPUs).
constexpr int64_t kBlock = 16;
#if defined(__AVX2__) && defined(__FMA__)
#define MOESCOPE_FIXED_PROMPT 1  // Q4_K, Q6_K and Q8_0 tiles multiplied in integers (prompt_fixed.h)
// Within each 32 inputs the fixed-point tiles keep the even ones, then the odd ones: a Q4_K (or
// Q6_K) block's 16-bit words hold its levels so (the low nibbles of a word's two bytes are an even
// level and the odd one after it), and so a tile row is expanded with 16-bit shifts and masks
// (FixedTile in prompt_fixed.h), where putting the levels back in order took a shuffle-port
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
#if defined(__AVX2__) && defined(__FMA__)
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

#if defined(__AVX2__)
// 256 bf16 values on a grid of `steps` levels either side of zero, x ~= amax / steps * level
// (rounded to nearest even, as nearbyint): each sub-block of 32 handed to use(j, level, sum) as four
// vectors of 8 int32 levels and the float sum of its values. Returns amax. The 8-bit prompt inputs
// (prompt_int8.h) and the fixed-point ones (PromptInput::pack_fixed) both put their rows so.
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

// A prompt's input rows as the tile products read them: bf16, and, in builds without bf16 dot
// products, in blocks of kBlock rows of one expert (the last padded with zeros): widened to float32,
// each laid [k][kBlock], or, where `fixed` (every matrix reading them has integer tiles, prompt_fixed.h),
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
  // to the nearest multiple of it, as FixedInput puts a decode input (quant_int.h), in fixed_order;
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
// (kTile rows: bf16 `expanded`, or float32 `wide` in builds without bf16 dot products).
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

#include "prompt_int8.h"  // opt-in: a prompt's rows rounded to 8 bits for Q4_K matrices
#include "prompt_fixed.h"  // Q4_K, Q6_K and Q8_0 tiles in integers without bf16 dot products
#include "prompt_amx.h"   // AMX tiles where the CPU has them

constexpr int64_t kMaxTile = std::max(kTile, kAmxRows);  // rows of W per prompt tile, either path

// One thread's buffers for prompt tiles: bf16 rows expanded from blocks, or Q4_K rows unpacked.
struct TileScratch {
  std::vector<bf16> expanded;
  std::vector<float> wide;  // the tile's rows in float32 (builds without bf16 dot products)
  Q4KRows q4k;
  std::vector<float> sums;  // a tile's 8-bit products, [input row][kTile]
#if defined(MOESCOPE_FIXED_PROMPT)
  FixedTile fixed;  // a tile in integers for fixed-point inputs
#endif
};

// The tile's kTile rows at[] of a Q4_K matrix times expert e's 8-bit input groups (its rows from
// `first`), kInt8Rows rows of W at a time, then emitted together: emit(i, sums), sums[r] = x_i . w_r.
template <class Emit>
inline void int8_tile_times_rows(const Matrix& m, const int64_t* at, const Int8Groups& groups, int64_t e,
                                 int64_t first, TileScratch& scratch, Emit&& emit) {
  const int64_t g0 = groups.first[e], g1 = groups.first[e + 1];
  scratch.sums.resize((g1 - g0) * 8 * kTile);
  for (int64_t r0 = 0; r0 < kTile; r0 += kInt8Rows) {
    int64_t part[kInt8Rows];
    for (int j = 0; j < kInt8Rows; ++j) part[j] = at[std::min<int64_t>(r0 + j, kTile - 1)];
    scratch.q4k.load(m, part);
    for (int64_t g = g0; g < g1; ++g) {
      float sums[8 * kInt8Rows];
      int8_tile(scratch.q4k, groups, g, sums);
      for (int64_t lane = 0; lane < 8; ++lane)
        for (int64_t j = 0; j < kInt8Rows && r0 + j < kTile; ++j)
          scratch.sums[((g - g0) * 8 + lane) * kTile + r0 + j] = sums[lane * kInt8Rows + j];
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    const auto [row0, n] = groups.rows[g];
    for (int64_t lane = 0; lane < n; ++lane) emit(row0 - first + lane, &scratch.sums[((g - g0) * 8 + lane) * kTile]);
  }
}

// y = x W^T (+ bias) for bf16 rows x [m, cols] and a bf16 or block-quantized W [rows, cols]: what
// F.linear gives on the dequantized W (float32 sums of bf16 products, the bias added, one rounding),
// within float32 summation order. With `int8_inputs` (opt-in, lossy) a Q4_K W takes x rounded to 8
// bits (prompt_int8.h), as the prompt's experts do.
at::Tensor linear_rows(const Weight& weight, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       bool int8_inputs) {
  const Matrix w = matrix_of(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.cols && x.scalar_type() == at::kBFloat16,
              "x: bf16 rows of the weight's width needed");
  TORCH_CHECK(w.cols % 32 == 0, "linear_rows: a multiple of 32 columns is needed");
  if (bias.has_value()) check_vector(*bias, w.rows, "bias");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = w.rows, k = w.cols;
  at::Tensor y = at::empty({m, n}, x.options());
  const bool int8 = int8_inputs && w.type == kQ4_K && k % 256 == 0;
  std::unique_ptr<Int8Groups> groups = int8 ? std::make_unique<Int8Groups>(std::vector<int64_t>{0},
                                                                            std::vector<int64_t>{m}, k) : nullptr;
  PromptInput in(bf16_data(xc), k, {0}, {int8 ? 0 : m}, has_fixed_tiles(w.type));  // the 8-bit path reads no blocks
  if (int8)
    at::parallel_for(0, groups->groups(), 1, [&](int64_t first, int64_t last) {
      for (int64_t g = first; g < last; ++g) groups->fill(g, bf16_data(xc));
    });
  else
    at::parallel_for(0, in.block_count(), 1, [&](int64_t first, int64_t last) { in.pack(first, last); });
  const bf16* b = bias.has_value() ? bf16_data(*bias) : nullptr;
  bf16* out = bf16_data(y);
#if defined(MOESCOPE_AMX)
  std::unique_ptr<AmxInput> operands;
  if (!int8 && amx_on()) {
    operands = std::make_unique<AmxInput>(bf16_data(xc), k, std::vector<int64_t>{0}, std::vector<int64_t>{m});
    at::parallel_for(0, operands->blocks(), 1, [&](int64_t first, int64_t last) { operands->pack(first, last); });
  }
  const int64_t height = operands ? kAmxRows : kTile;
#else
  const int64_t height = kTile;
#endif
  const int64_t tiles = (n + height - 1) / height;
  at::parallel_for(0, tiles, 1, [&](int64_t first_tile, int64_t last_tile) {
    TileScratch scratch;
    scratch.expanded.resize(int8 ? 0 : height * k);
    scratch.wide.resize(in.block_count() && !in.fixed ? kTile * k : 0);
#if defined(MOESCOPE_AMX)
    if (operands) amx_configure();
#endif
    for (int64_t t = first_tile; t < last_tile; ++t) {
      const int64_t r0 = t * height, r1 = std::min(n, r0 + height);
      int64_t at[kMaxTile];
      for (int64_t r = 0; r < height; ++r) at[r] = std::min(r0 + r, r1 - 1);  // past the last row: the last again, its sums unused
      auto emit = [&](int64_t i, const float* sums) {
        for (int64_t r = r0; r < r1; ++r)
          out[i * n + r] = to_bf16(b == nullptr ? sums[r - r0] : sums[r - r0] + to_float(b[r]));
      };
      if (int8) {
        int8_tile_times_rows(w, at, *groups, 0, 0, scratch, emit);
        continue;
      }
#if defined(MOESCOPE_AMX)
      if (operands) {
        const __mmask16 keep = static_cast<__mmask16>((1u << (r1 - r0)) - 1);
        const __m512 bias = b != nullptr ? widen_bf16_masked(b + r0, keep) : _mm512_setzero_ps();
        amx_tile_times_rows(amx_rows(w, at, scratch.expanded.data()), *operands, 0, 0,
                            [&](int64_t i0, int64_t rows, const float* c) {
                              for (int64_t i = i0; i < i0 + rows; ++i) {
                                const __m512 sums = amx_column(c, i - i0);
                                _mm256_mask_storeu_epi16(out + i * n + r0, keep, (__m256i)_mm512_cvtneps_pbh(
                                    b != nullptr ? _mm512_add_ps(sums, bias) : sums));
                              }
                            });
        continue;
      }
#endif
#if defined(MOESCOPE_FIXED_PROMPT)
      if (in.fixed) {
        fixed_tile_times_rows(w, at, in, 0, 0, m, scratch.fixed, emit);
        continue;
      }
#endif
      TileRows rows;
      tile_rows(w, at, rows, scratch.expanded.data(), scratch.wide.data());
      tile_times_rows(rows, in, 0, 0, m, emit);
    }
#if defined(MOESCOPE_AMX)
    if (operands) _tile_release();
#endif
  });
  return y;
}

// How an expert's gate/up projection becomes its activation, as the experts module computes it
// (engine/decode/paths/expert_recipe.py recognises which): gate and up as two halves (gate first)
// or interleaved (gate at even rows, GPT-OSS), and SiLU(gate) * up or GPT-OSS's clamped SwiGLU,
// (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
struct GateRecipe {
  bool interleaved = false;
  bool clamped_swiglu = false;
  double alpha = 1.0, limit = 0.0;
};

// One expert's matrices: gate_up [2I, H] and down [H, I], or, `transposed`, [H, 2I] and [I, H]
// (read as x @ W, GPT-OSS); optional biases [2I] and [H].
struct ExpertWeights {
  Matrix gate_up, down;
  const bf16* gate_up_bias = nullptr;
  const bf16* down_bias = nullptr;
  bool transposed = false;
  int64_t inter = 0;
};

ExpertWeights expert_weights(const Weight& gate_up, const Weight& down, int64_t hidden, bool transposed = false,
                             const at::Tensor* gate_up_bias = nullptr, const at::Tensor* down_bias = nullptr) {
  const Matrix g = matrix_of(gate_up, "gate_up"), d = matrix_of(down, "down");
  ExpertWeights out{g, d};
  out.transposed = transposed;
  if (transposed) {
    TORCH_CHECK(g.type == kBF16 && d.type == kBF16, "transposed experts: bf16 matrices only");
    out.inter = d.rows;
    TORCH_CHECK(g.cols == 2 * out.inter && g.rows == hidden, "gate_up: [hidden, 2 * intermediate] (transposed)");
    TORCH_CHECK(d.cols == hidden, "down: [intermediate, hidden] (transposed)");
  } else {
    out.inter = d.cols;
    TORCH_CHECK(g.rows == 2 * out.inter && g.cols == hidden, "gate_up: [2 * intermediate, hidden]");
    TORCH_CHECK(d.rows == hidden, "down: [hidden, intermediate]");
  }
  if (gate_up_bias != nullptr) {
    check_vector(*gate_up_bias, 2 * out.inter, "gate_up bias");
    out.gate_up_bias = bf16_data(*gate_up_bias);
  }
  if (down_bias != nullptr) {
    check_vector(*down_bias, hidden, "down bias");
    out.down_bias = bf16_data(*down_bias);
  }
  return out;
}

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
// The float32 vector of the build, for loops written once for both widths.
struct FloatVector {
  static constexpr int64_t lanes = 16;
  __m512 v;
  static FloatVector all(float f) { return {_mm512_set1_ps(f)}; }
  static FloatVector load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static FloatVector widen(const bf16* p) { return {widen_bf16(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  FloatVector fma(FloatVector a, FloatVector b) const { return {_mm512_fmadd_ps(a.v, b.v, v)}; }  // a * b + this
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
};
#define MOESCOPE_FLOAT_VECTOR 1
#endif

// out[begin, end) = columns [begin, end) of x W for a [rows = len(x), cols] bf16 matrix read as
// x @ W: row by row, each scaled by its x and added into the float32 sums (the rows stream in order).
// Four rows per pass over the sums: one load and one store of a sum per four weight vectors, not per
// one (the sums, not the weights, bounded the one-row loop). Each sum still takes its rows' products
// one at a time in row order, so the result is the one-row loop's to the bit.
inline void gemv_t_range(const Matrix& m, const bf16* x, int64_t begin, int64_t end, float* out) {
  const bf16* base = reinterpret_cast<const bf16*>(m.data);
  const int64_t stride = m.row_bytes / 2;
  std::fill(out + begin, out + end, 0.f);
  int64_t i = 0;
#if defined(MOESCOPE_FLOAT_VECTOR)
  using V = FloatVector;
  for (; i + 4 <= m.rows; i += 4) {
    const bf16 *r0 = base + i * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;
    const V s0 = V::all(to_float(x[i])), s1 = V::all(to_float(x[i + 1])), s2 = V::all(to_float(x[i + 2])),
            s3 = V::all(to_float(x[i + 3]));
    int64_t j = begin;
    for (; j + V::lanes <= end; j += V::lanes)
      V::load(out + j).fma(s0, V::widen(r0 + j)).fma(s1, V::widen(r1 + j)).fma(s2, V::widen(r2 + j))
          .fma(s3, V::widen(r3 + j)).store(out + j);
    for (int64_t r = 0; r < 4; ++r) {
      const float xi = to_float(x[i + r]);
      const bf16* row = r0 + r * stride;
      for (int64_t t = j; t < end; ++t) out[t] += xi * to_float(row[t]);
    }
  }
#endif
  for (; i < m.rows; ++i) {
    const float xi = to_float(x[i]);
    const bf16* row = base + i * stride;
    int64_t j = begin;
#if defined(MOESCOPE_FLOAT_VECTOR)
    const FloatVector scale = FloatVector::all(xi);
    for (; j + FloatVector::lanes <= end; j += FloatVector::lanes)
      FloatVector::load(out + j).fma(scale, FloatVector::widen(row + j)).store(out + j);
#endif
    for (; j < end; ++j) out[j] += xi * to_float(row[j]);
  }
}

// Rows [begin, end) of an expert's gate/up projection (which = 0) or down projection (1) of x.
inline void expert_rows(const ExpertWeights& w, int which, const bf16* x, int64_t begin, int64_t end, float* out) {
  const Matrix& m = which == 0 ? w.gate_up : w.down;
  if (w.transposed)
    gemv_t_range(m, x, begin, end, out);
  else
    gemv_range(m, x, begin, end, out);
}

// A projection's output row as transformers has it: rounded to bf16, plus the bias (rounded again).
inline float biased(float acc, const bf16* bias, int64_t i) {
  return bias == nullptr ? round_bf16(acc) : round_bf16(round_bf16(acc) + to_float(bias[i]));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A barrier for the threads of one parallel region: they spin (as OpenMP's own threads do between
// regions), so a wait costs a cache line's round trip rather than a wake-up.
struct SpinBarrier {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> generation{0};
  std::atomic<int> count{1};

  // Every thread of the region calls this first, with the team's size (the same value from each,
  // so no thread waits on another's store; an `omp single` here cost ~2.5 % of a layer's experts).
  void join(int team) { count.store(team, std::memory_order_relaxed); }

  void wait() {
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == count.load(std::memory_order_relaxed) - 1) {
      arrived.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
    } else {
      while (generation.load(std::memory_order_acquire) == gen) cpu_relax();
    }
  }
};

// One value of an expert's activation from its gate and up sums (float32; gi and ui their rows,
// for the bias), each op rounded to bf16 where transformers rounds.
inline bf16 activate(const GateRecipe& r, float gate_sum, float up_sum, const bf16* bias, int64_t gi, int64_t ui) {
  float g = biased(gate_sum, bias, gi), u = biased(up_sum, bias, ui);
  if (!r.clamped_swiglu) {
    const float silu = round_bf16(g / (1.f + std::exp(-g)));
    return to_bf16(silu * u);
  }
  const float limit = static_cast<float>(r.limit);
  g = std::min(g, limit);
  u = std::max(-limit, std::min(u, limit));
  const float scaled = round_bf16(g * static_cast<float>(r.alpha));
  const float glu = round_bf16(g * round_bf16(1.f / (1.f + std::exp(-scaled))));
  return to_bf16(round_bf16(u + 1.f) * glu);
}

#if defined(MOESCOPE_AMX)
// activate() in 16 lanes, with each lane's gate and up bias (or none): the same ops and roundings
// (exp16 for std::exp; min and max ordered as std::min and std::max, so a NaN goes where theirs does).
inline __m256i activate16(const GateRecipe& r, __m512 g, __m512 u, const float* gate_bias, const float* up_bias) {
  g = round16(g), u = round16(u);
  if (gate_bias != nullptr) {
    g = round16(_mm512_add_ps(g, _mm512_load_ps(gate_bias)));
    u = round16(_mm512_add_ps(u, _mm512_load_ps(up_bias)));
  }
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  if (!r.clamped_swiglu) {
    const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, g)))));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u));
  }
  const __m512 limit = _mm512_set1_ps(static_cast<float>(r.limit));
  g = _mm512_min_ps(limit, g);
  u = _mm512_max_ps(_mm512_min_ps(limit, u), _mm512_sub_ps(zero, limit));
  const __m512 scaled = round16(_mm512_mul_ps(g, _mm512_set1_ps(static_cast<float>(r.alpha))));
  const __m512 sigmoid = round16(_mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, scaled)))));
  const __m512 glu = round16(_mm512_mul_ps(g, sigmoid));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round16(_mm512_add_ps(u, one)), glu));
}
#endif

// The rows of an expert's gate/up projection that intermediate row i reads: gate and up halves
// (gate first) or interleaved (gate at even rows).
inline int64_t gate_row(const GateRecipe& r, int64_t i) { return r.interleaved ? 2 * i : i; }
inline int64_t up_row(const GateRecipe& r, int64_t inter, int64_t i) { return r.interleaved ? 2 * i + 1 : inter + i; }

// An expert's activation for intermediate rows [begin, end) from its gate/up projection (float32 sums).
inline void gate_rows(const GateRecipe& r, const float* gate_up, const bf16* bias, int64_t inter, int64_t begin,
                      int64_t end, bf16* out) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t gi = gate_row(r, i), ui = up_row(r, inter, i);
    out[i] = activate(r, gate_up[gi], gate_up[ui], bias, gi, ui);
  }
}

// The rows [begin, end) of an expert's gate/up projection that intermediate rows [begin, end) need.
inline void gate_up_part(const GateRecipe& r, const ExpertWeights& w, const bf16* x, int64_t inter, int64_t begin,
                         int64_t end, float* projected) {
  if (r.interleaved) {
    expert_rows(w, 0, x, 2 * begin, 2 * end, projected);
  } else {
    expert_rows(w, 0, x, begin, end, projected);
    expert_rows(w, 0, x, inter + begin, inter + end, projected);
  }
}

// The down projection's rows [begin, end) plus its bias, kept in float32 (already bf16 values).
inline void down_part(const ExpertWeights& w, const bf16* activation, int64_t begin, int64_t end, float* out) {
  expert_rows(w, 1, activation, begin, end, out);
  if (w.down_bias != nullptr)
    for (int64_t j = begin; j < end; ++j) out[j] = biased(out[j], w.down_bias, j);
}

// This thread's [begin, end) of n items, split evenly over a team.
inline std::pair<int64_t, int64_t> thread_share(int64_t n, int tid, int team) {
  const int64_t chunk = (n + team - 1) / team;
  return {std::min<int64_t>(n, tid * chunk), std::min<int64_t>(n, (tid + 1) * chunk)};
}

// This thread's part of one token through k SiLU-gated experts, into `outputs` [k, hidden] (each
// expert's down projection, float32 sums). Whole experts per thread where they divide evenly:
// each thread streams its matrices end to end, which the hardware prefetchers like best (faster
// than splitting every matrix by rows), and an expert's down projection needs only its own
// activation, so there is no barrier between the passes. Otherwise every expert's gate/up rows are
// split, then (after the barrier) its down rows. Scratch: projected [k, 2I], activation [k, I].
void experts_part(const GateRecipe& r, const bf16* x, int64_t hidden, int64_t inter,
                  const ExpertWeights* const* picked, int64_t k, float* projected, bf16* activation, float* outputs,
                  SpinBarrier& barrier, int tid, int team) {
  if (k % team == 0) {
    const auto [first, last] = thread_share(k, tid, team);
    for (int64_t e = first; e < last; ++e) {
      gate_up_part(r, *picked[e], x, inter, 0, inter, projected + e * 2 * inter);
      gate_rows(r, projected + e * 2 * inter, picked[e]->gate_up_bias, inter, 0, inter, activation + e * inter);
    }
    for (int64_t e = first; e < last; ++e) down_part(*picked[e], activation + e * inter, 0, hidden, outputs + e * hidden);
    return;
  }
  const auto [begin, end] = thread_share(inter, tid, team);
  for (int64_t e = 0; e < k; ++e) {
    float* gate = projected + e * 2 * inter;
    gate_up_part(r, *picked[e], x, inter, begin, end, gate);
    gate_rows(r, gate, picked[e]->gate_up_bias, inter, begin, end, activation + e * inter);
  }
  barrier.wait();
  const auto [h_begin, h_end] = thread_share(hidden, tid, team);
  for (int64_t e = 0; e < k; ++e) down_part(*picked[e], activation + e * inter, h_begin, h_end, outputs + e * hidden);
}

// out[begin, end) = the experts' outputs rounded, weighted by `route` and summed in pick order.
// `round_products`: the routing weights are bf16, so transformers multiplies in bf16 (each product
// rounded) before its float32 sum; float32 weights give float32 products.
inline void weighted_sum_rows(const float* outputs, const float* route, int64_t k, int64_t hidden, int64_t begin,
                              int64_t end, bool round_products, bf16* out) {
  for (int64_t j = begin; j < end; ++j) {
    float total = 0.f;
    for (int64_t e = 0; e < k; ++e) {
      const float product = round_bf16(outputs[e * hidden + j]) * route[e];
      total += round_products ? round_bf16(product) : product;
    }
    out[j] = to_bf16(total);
  }
}

// One token through `picked` gated experts weighted by `route` (float32) and summed in pick
// order into `out` (bf16): what a decode step's MoE block computes.
void moe_experts(const GateRecipe& r, const bf16* x, int64_t hidden, int64_t inter,
                 const std::vector<ExpertWeights>& picked, const float* route, bool round_products, bf16* out) {
  const int64_t k = static_cast<int64_t>(picked.size());
  std::vector<float> projected(k * 2 * inter), outputs(k * hidden);
  std::vector<bf16> activation(k * inter);
  std::vector<const ExpertWeights*> experts;
  for (const ExpertWeights& w : picked) experts.push_back(&w);
  SpinBarrier barrier;
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    barrier.join(omp_get_num_threads());  // the team may be smaller than asked for
    experts_part(r, x, hidden, inter, experts.data(), k, projected.data(), activation.data(), outputs.data(), barrier,
                 omp_get_thread_num(), omp_get_num_threads());
  }
  weighted_sum_rows(outputs.data(), route, k, hidden, 0, hidden, round_products, out);
}

// Experts of one intermediate size from their matrices and optional biases (one each, or none);
// `transposed`: the matrices are [in, out]. The tensors stay the caller's to keep alive.
std::vector<ExpertWeights> expert_list(const std::vector<Weight>& gate_up, const std::vector<Weight>& down,
                                       const std::vector<at::Tensor>& gate_up_bias,
                                       const std::vector<at::Tensor>& down_bias, int64_t hidden, bool transposed) {
  const size_t experts = gate_up.size();
  TORCH_CHECK(experts > 0 && down.size() == experts, "one gate_up and one down per expert");
  TORCH_CHECK((gate_up_bias.empty() || gate_up_bias.size() == experts) &&
                  (down_bias.empty() || down_bias.size() == experts),
              "one gate_up and one down bias per expert, or none");
  std::vector<ExpertWeights> out;
  for (size_t e = 0; e < experts; ++e) {
    out.push_back(expert_weights(gate_up[e], down[e], hidden, transposed,
                                 gate_up_bias.empty() ? nullptr : &gate_up_bias[e],
                                 down_bias.empty() ? nullptr : &down_bias[e]));
    TORCH_CHECK(out.back().inter == out[0].inter, "every expert of one intermediate size");
  }
  return out;
}

// A prompt's rows through a layer's resident gated experts, in one call: the rows are sorted by
// expert (as the expert cache gathers them), rows [start[e], start[e] + count[e]) going through
// expert e, and each expert's output (its down projection, rounded where expert_mlp's torch ops
// round; the routing weights stay the caller's) lands in the same rows of the result.
//
// Work comes in 4-row tiles of a matrix: 2 gate rows with their 2 up rows (the activation is made
// from the tile's sums at once), then, after a barrier, 4 down rows. A quantized tile is expanded
// once into L1 and multiplied by all of its expert's rows (dot_tile). The tiles of all experts are
// split between the threads by the rows they multiply, so a popular expert is shared rather than
// holding one thread while the others wait; and one call replaces the dozen small torch ops per
// expert the per-expert loop makes. With `int8_inputs` (opt-in, lossy) Q4_K matrices take their
// inputs rounded to 8 bits and multiply them in integers (prompt_int8.h).
struct PromptExperts {
  const GateRecipe& recipe;
  const std::vector<ExpertWeights>& experts;
  const std::vector<int64_t>& start;
  const std::vector<int64_t>& count;
  const PromptInput& x;
  int64_t hidden, inter;
  const PromptInput& activation;  // [rows, inter]: gate_up_tile writes its rows at activation_rows
  bf16* activation_rows;
  bf16* out;  // [rows, hidden]
  const Int8Groups* x8 = nullptr;    // opt-in: x rounded to 8 bits, for Q4_K gate/up matrices
  const Int8Groups* act8 = nullptr;  // and the activation, for Q4_K down matrices
  const AmxInput* x_amx = nullptr;  // x and the activation as AMX operands, where the tiles are on
  const AmxInput* act_amx = nullptr;
  int64_t height = kTile;  // rows of W per tile: kTile, or kAmxRows on the tiles

  // The tile's `height` rows at[] of matrix m times each of expert e's rows of `input` (or their 8-bit
  // groups where given and m is Q4_K, or AMX operands where given): emit(i, sums) with sums[r] = x_i . w_r.
  // On AMX tiles emit_block(i0, n, c) gets a block of rows instead (amx_tile_times_rows).
  template <class Emit, class EmitBlock>
  void tile(const Matrix& m, const int64_t* at, int64_t e, const PromptInput& input, const Int8Groups* groups,
            [[maybe_unused]] const AmxInput* amx_input, TileScratch& scratch, Emit&& emit,
            [[maybe_unused]] EmitBlock&& emit_block) const {
    if (groups != nullptr && m.type == kQ4_K) {
      int8_tile_times_rows(m, at, *groups, e, start[e], scratch, emit);
      return;
    }
#if defined(MOESCOPE_FIXED_PROMPT)
    if (input.fixed) {
      fixed_tile_times_rows(m, at, input, e, start[e], count[e], scratch.fixed, emit);
      return;
    }
#endif
#if defined(MOESCOPE_AMX)
    if (amx_input != nullptr) {
      amx_tile_times_rows(amx_rows(m, at, scratch.expanded.data()), *amx_input, e, start[e], emit_block);
      return;
    }
#endif
    TileRows rows;
    tile_rows(m, at, rows, scratch.expanded.data(), scratch.wide.data());
    tile_times_rows(rows, input, e, start[e], count[e], emit);
  }

  // Intermediate rows p .. p + height / 2 - 1 of expert e for all its rows of x.
  void gate_up_tile(int64_t e, int64_t p, TileScratch& scratch) const {
    const ExpertWeights& w = experts[e];
    const int64_t half = height / 2, pairs = std::min<int64_t>(half, inter - p);
    int64_t at[kMaxTile];
    for (int64_t j = 0; j < half; ++j) {
      const int64_t i = p + std::min<int64_t>(j, pairs - 1);  // past the last row: the last again, its sums unused
      at[j] = gate_row(recipe, i);
      at[half + j] = up_row(recipe, inter, i);
    }
    tile(w.gate_up, at, e, x, x8, x_amx, scratch, [&](int64_t i, const float* sums) {
      for (int64_t j = 0; j < pairs; ++j)
        activation_rows[(start[e] + i) * inter + p + j] =
            activate(recipe, sums[j], sums[half + j], w.gate_up_bias, at[j], at[half + j]);
    }, [&]([[maybe_unused]] int64_t i0, [[maybe_unused]] int64_t n, [[maybe_unused]] const float* c) {
#if defined(MOESCOPE_AMX)
      gate_up_block(w, at, p, pairs, start[e] + i0, n, c);
#endif
    });
  }

#if defined(MOESCOPE_AMX)
  // A gate/up tile's block of AMX sums (rows 0-7 gate, 8-15 up) as activation rows from `row` on,
  // two rows at a time in the lanes of activate16.
  void gate_up_block(const ExpertWeights& w, const int64_t* at, int64_t p, int64_t pairs, int64_t row, int64_t n,
                     const float* c) const {
    alignas(64) float gate_bias[16], up_bias[16];
    const bool biased = w.gate_up_bias != nullptr;
    for (int j = 0; j < 16 && biased; ++j) {
      gate_bias[j] = to_float(w.gate_up_bias[at[j % 8]]);
      up_bias[j] = to_float(w.gate_up_bias[at[8 + j % 8]]);
    }
    const __mmask8 keep = static_cast<__mmask8>((1u << pairs) - 1);
    for (int64_t i = 0; i < n; i += 2) {
      const int64_t i1 = std::min(i + 1, n - 1);
      const __m256i act = activate16(recipe, amx_half_columns(c, i, i1, 0), amx_half_columns(c, i, i1, 128),
                                     biased ? gate_bias : nullptr, biased ? up_bias : nullptr);
      bf16* out_row = activation_rows + (row + i) * inter + p;
      _mm_mask_storeu_epi16(out_row, keep, _mm256_castsi256_si128(act));
      if (i1 != i) _mm_mask_storeu_epi16(out_row + inter, keep, _mm256_extracti128_si256(act, 1));
    }
  }

  // A down tile's block of AMX sums (output columns h .. h + width - 1) into the output from `row` on.
  void down_block(const ExpertWeights& w, int64_t h, int64_t width, int64_t row, int64_t n, const float* c) const {
    const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1);
    const __m512 bias = w.down_bias != nullptr ? widen_bf16_masked(w.down_bias + h, keep) : _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      __m512 v = round16(amx_column(c, i));
      if (w.down_bias != nullptr) v = round16(_mm512_add_ps(v, bias));
      _mm256_mask_storeu_epi16(out + (row + i) * hidden + h, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
#endif

  // Output columns h .. h + height - 1 of expert e for all its rows.
  void down_tile(int64_t e, int64_t h, TileScratch& scratch) const {
    const ExpertWeights& w = experts[e];
    const int64_t n = std::min<int64_t>(height, hidden - h);
    int64_t at[kMaxTile];
    for (int64_t j = 0; j < height; ++j) at[j] = h + std::min<int64_t>(j, n - 1);
    tile(w.down, at, e, activation, act8, act_amx, scratch, [&](int64_t i, const float* sums) {
      for (int64_t j = 0; j < n; ++j) out[(start[e] + i) * hidden + h + j] = to_bf16(biased(sums[j], w.down_bias, h + j));
    }, [&]([[maybe_unused]] int64_t i0, [[maybe_unused]] int64_t rows, [[maybe_unused]] const float* c) {
#if defined(MOESCOPE_AMX)
      down_block(w, h, n, start[e] + i0, rows, c);
#endif
    });
  }
};

// Tiles of every expert (expert, first row) with the running sum of their costs (the expert's row
// count), `step` rows of a matrix `height` high per tile.
struct TileList {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  std::vector<int64_t> cost_before{0};

  TileList(const std::vector<int64_t>& count, int64_t height, int64_t step) {
    for (size_t e = 0; e < count.size(); ++e)
      for (int64_t r = 0; count[e] > 0 && r < height; r += step) {
        tiles.emplace_back(static_cast<int64_t>(e), r);
        cost_before.push_back(cost_before.back() + count[e]);
      }
  }

  // This thread's tiles: those whose cost starts in its even share of the total.
  std::pair<int64_t, int64_t> share(int tid, int team) const {
    const int64_t total = cost_before.back();
    auto first_at = [&](int64_t part) {
      const int64_t cost = total * part / team;
      return static_cast<int64_t>(std::lower_bound(cost_before.begin(), cost_before.end() - 1, cost) -
                                  cost_before.begin());
    };
    return {first_at(tid), first_at(tid + 1)};
  }
};

// The 8-bit groups of a matrix's inputs when asked for and some expert's matrix is Q4_K; else none.
std::unique_ptr<Int8Groups> int8_groups(bool asked, const std::vector<ExpertWeights>& experts, bool down,
                                        const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                                        int64_t k) {
  const bool q4k = std::any_of(experts.begin(), experts.end(),
                               [&](const ExpertWeights& w) { return (down ? w.down : w.gate_up).type == kQ4_K; });
  return asked && q4k && k % 256 == 0 ? std::make_unique<Int8Groups>(start, count, k) : nullptr;
}

at::Tensor moe_prompt(const at::Tensor& x, const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                         const std::vector<Weight>& gate_up, const std::vector<Weight>& down,
                         const std::vector<at::Tensor>& gate_up_bias, const std::vector<at::Tensor>& down_bias,
                         const GateRecipe& recipe, bool int8_inputs) {
  check_matrix(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const std::vector<ExpertWeights> experts = expert_list(gate_up, down, gate_up_bias, down_bias, hidden, false);
  TORCH_CHECK(start.size() == experts.size() && count.size() == experts.size(), "one row range per expert");
  for (size_t e = 0; e < experts.size(); ++e)
    TORCH_CHECK(start[e] >= 0 && count[e] >= 0 && start[e] + count[e] <= rows, "expert ", e, "'s rows are not in x");
  const int64_t inter = experts[0].inter;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  std::vector<bf16> activation(rows * inter);
  const std::unique_ptr<Int8Groups> x8 = int8_groups(int8_inputs, experts, false, start, count, hidden);
  const std::unique_ptr<Int8Groups> act8 = int8_groups(int8_inputs, experts, true, start, count, inter);
  // The 8-bit path is asked for Q4_K matrices only; with it the others keep the dot products' tiles.
  const bool amx = amx_on() && !int8_inputs && hidden % 32 == 0 && inter % 32 == 0;
  // every expert's matrix a type with integer tiles, and the inputs not rounded to 8 bits for them
  // (those go to Q4_K matrices alone): the inputs in fixed point for prompt_fixed.h
  auto all_fixed = [&](bool down, const Int8Groups* groups) {
    return groups == nullptr && std::all_of(experts.begin(), experts.end(), [&](const ExpertWeights& w) {
      return has_fixed_tiles((down ? w.down : w.gate_up).type);
    });
  };
  PromptInput in(bf16_data(xc), hidden, start, count, all_fixed(false, x8.get())),
      act(activation.data(), inter, start, count, all_fixed(true, act8.get()));
  PromptExperts work{recipe, experts, start, count, in, hidden, inter, act, activation.data(), bf16_data(y),
                     x8.get(), act8.get()};
#if defined(MOESCOPE_AMX)
  std::unique_ptr<AmxInput> x_amx, act_amx;
  if (amx) {
    x_amx = std::make_unique<AmxInput>(bf16_data(xc), hidden, start, count);
    act_amx = std::make_unique<AmxInput>(activation.data(), inter, start, count);
    work.x_amx = x_amx.get(), work.act_amx = act_amx.get(), work.height = kAmxRows;
  }
#endif
  const TileList gate_tiles(count, inter, work.height / 2), down_tiles(count, hidden, work.height);
  SpinBarrier barrier;
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    barrier.join(team);
    TileScratch scratch;
    scratch.expanded.resize(work.height * std::max(hidden, inter));
    if (in.block_count() && !(in.fixed && act.fixed)) scratch.wide.resize(kTile * std::max(hidden, inter));
    // this thread's part of a matrix's inputs in the layout its products read, then all are done
    auto fill_share = [&](Int8Groups* groups, PromptInput& input, [[maybe_unused]] bool down) {
      bool filled = false;
      if (input.block_count()) {
        const auto [first, last] = thread_share(input.block_count(), tid, team);
        input.pack(first, last);
        filled = true;
      }
      if (groups != nullptr) {
        const auto [first, last] = thread_share(groups->groups(), tid, team);
        for (int64_t g = first; g < last; ++g) groups->fill(g, input.x);
        filled = true;
      }
#if defined(MOESCOPE_AMX)
      if (AmxInput* operands = down ? act_amx.get() : x_amx.get()) {
        const auto [first, last] = thread_share(operands->blocks(), tid, team);
        operands->pack(first, last);
        filled = true;
      }
#endif
      if (filled) barrier.wait();
    };
#if defined(MOESCOPE_AMX)
    if (amx) amx_configure();
#endif
    fill_share(x8.get(), in, false);
    const auto [g_first, g_last] = gate_tiles.share(tid, team);
    for (int64_t t = g_first; t < g_last; ++t)
      work.gate_up_tile(gate_tiles.tiles[t].first, gate_tiles.tiles[t].second, scratch);
    barrier.wait();  // every expert's activation rows are complete
    fill_share(act8.get(), act, true);
    const auto [d_first, d_last] = down_tiles.share(tid, team);
    for (int64_t t = d_first; t < d_last; ++t)
      work.down_tile(down_tiles.tiles[t].first, down_tiles.tiles[t].second, scratch);
#if defined(MOESCOPE_AMX)
    if (amx) _tile_release();  // a thread holding tile state costs every context switch 8 KB more
#endif
  }
  return y;
}

// A prompt's expert outputs weighted and summed per token, as the expert cache's torch ops compute
// them (engine/offload/expert_cache.py): `y` [n, hidden] bf16 rows sorted by expert, `weights` [n]
// their routing weights (float32, or bf16 as some routers leave them), `order` [n] each sorted row's
// flat place (token * top_k + pick). Token t's row is the sum over its picks j, in pick order, of
// y * weight: each product rounded to float32 (to bf16 too where the weights are bf16, as torch's
// bf16 product is), added to a float32 sum started at 0 (no fused multiply-add: -ffp-contract=off),
// then rounded to bf16 once. One pass instead of a product, a scatter, a sum and a cast.
at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& order, int64_t top_k) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kBFloat16, "combine_rows: bf16 rows");
  const int64_t n = y.size(0), hidden = y.size(1);
  TORCH_CHECK(top_k > 0 && n % top_k == 0, "combine_rows: whole tokens of top_k rows");
  const bool bf16_weights = weights.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_weights || weights.scalar_type() == at::kFloat) && weights.numel() == n,
              "combine_rows: a float32 or bf16 weight per row");
  TORCH_CHECK(order.scalar_type() == at::kLong && order.numel() == n, "combine_rows: an int64 place per row");
  const at::Tensor yc = y.contiguous(), wc = weights.to(at::kFloat).contiguous(), oc = order.contiguous();
  const int64_t* place = oc.data_ptr<int64_t>();
  std::vector<int64_t> row_of(n, -1);  // flat place -> sorted row
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(place[r] >= 0 && place[r] < n && row_of[place[r]] < 0, "combine_rows: order is not a permutation");
    row_of[place[r]] = r;
  }
  const int64_t tokens = n / top_k;
  at::Tensor out = at::empty({tokens, hidden}, y.options());
  const bf16* rows = bf16_data(yc);
  const float* w = wc.data_ptr<float>();
  bf16* o = bf16_data(out);
  at::parallel_for(0, tokens, 1, [&](int64_t first, int64_t last) {
    std::vector<float> sum(hidden);
    for (int64_t t = first; t < last; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t r = row_of[t * top_k + j];
        const bf16* row = rows + r * hidden;
        const float weight = w[r];
        if (bf16_weights)
          for (int64_t c = 0; c < hidden; ++c) sum[c] += round_bf16(to_float(row[c]) * weight);
        else
          for (int64_t c = 0; c < hidden; ++c) sum[c] += to_float(row[c]) * weight;
      }
      for (int64_t c = 0; c < hidden; ++c) o[t * hidden + c] = to_bf16(sum[c]);
    }
  });
  return out;
}

at::Tensor moe_decode(const at::Tensor& x, const std::vector<Weight>& gate_up, const std::vector<Weight>& down,
                         const at::Tensor& weights, const std::vector<at::Tensor>& gate_up_bias,
                         const std::vector<at::Tensor>& down_bias, bool transposed, const GateRecipe& recipe) {
  TORCH_CHECK(weights.numel() == static_cast<int64_t>(gate_up.size()), "one routing weight per expert");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x: a bf16 row");
  const int64_t hidden = x.numel();
  const std::vector<ExpertWeights> picked = expert_list(gate_up, down, gate_up_bias, down_bias, hidden, transposed);
  const int64_t inter = picked[0].inter;
  const at::Tensor xc = x.contiguous();
  const at::Tensor wf = weights.to(at::kFloat).contiguous();
  at::Tensor y = at::empty_like(xc);
  moe_experts(recipe, bf16_data(xc), hidden, inter, picked, wf.data_ptr<float>(),
              weights.scalar_type() == at::kBFloat16, bf16_data(y));
  return y;
}

// Llama's RMSNorm of one row of n: float32 statistics, the normalized row rounded to bf16, then
// times the bf16 weight (rounded again); `round_once`: GPT-OSS's, which multiplies the normalized
// row by the weight in float32 and rounds the product only.
inline void rms_norm_row(const bf16* in, const bf16* weight, int64_t n, float eps, bf16* out, bool round_once = false) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += to_float(in[i]) * to_float(in[i]);
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = to_float(in[i]) * scale;
    out[i] = to_bf16(to_float(weight[i]) * (round_once ? normed : round_bf16(normed)));
  }
}

// RMSNorm over the last dimension of a few rows (a decode step's hidden state, or its heads for
// q/k norms). One call instead of transformers' eight small ops.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool round_once) {
  const int64_t n = weight.numel();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && n > 0 &&
                  x.size(-1) == n,
              "rms_norm: bf16 rows and a bf16 weight of their width");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  for (int64_t row = 0; row < xc.numel() / n; ++row)
    rms_norm_row(bf16_data(xc) + row * n, bf16_data(wc), n, static_cast<float>(eps), bf16_data(y) + row * n,
                 round_once);
  return y;
}

// 1 / sqrt(mean(x^2) + eps) over `count` rows of d, `stride` apart, in order (as rms_norm_row sums).
inline float rms_scale(const bf16* rows, int64_t stride, int64_t count, int64_t d, float eps) {
  float squares = 0.f;
  for (int64_t r = 0; r < count; ++r)
    for (int64_t i = 0; i < d; ++i) squares += to_float(rows[r * stride + i]) * to_float(rows[r * stride + i]);
  return 1.f / std::sqrt(squares / static_cast<float>(count * d) + eps);
}

// Rotary embedding of one head, as transformers' apply_rotary_pos_emb in bf16:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16.
inline void rope_head(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  const int64_t half = d / 2;
  thread_local std::vector<float> in;
  in.resize(d);
  for (int64_t i = 0; i < d; ++i) in[i] = to_float(x[i]);
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -in[i + half] : in[i - half];
    x[i] = to_bf16(round_bf16(in[i] * to_float(cos[i])) + round_bf16(rotated * to_float(sin[i])));
  }
}

// DeepSeek's interleaved rotary embedding (apply_rotary_pos_emb_interleave): the pairs (x0, x1),
// (x2, x3), ... each turn by one angle, and the head comes out de-interleaved. The same roundings
// as rope_head on the de-interleaved head (transformers' comment says its version is
// bit-identical to that one).
inline void rope_head_interleaved(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  thread_local std::vector<bf16> pairs;
  pairs.assign(x, x + d);
  for (int64_t i = 0; i < d / 2; ++i) {
    x[i] = pairs[2 * i];
    x[d / 2 + i] = pairs[2 * i + 1];
  }
  rope_head(x, cos, sin, d);
}

// A token's cos and sin rows for heads of d, as rope_head reads them: rows of d values, or rows
// of half a head (GPT-OSS's rotary module), whose two halves rotate by the same angles (rotate_half's
// roundings are then the same), doubled here.
struct RotaryRows {
  std::vector<bf16> cos, sin;
  RotaryRows(const at::Tensor& c, const at::Tensor& s, int64_t d, const char* who) : cos(d), sin(d) {
    const int64_t n = c.numel();
    TORCH_CHECK((n == d || 2 * n == d) && s.numel() == n && c.scalar_type() == at::kBFloat16 &&
                    s.scalar_type() == at::kBFloat16,
                who, ": one bf16 cos and sin row of the head size (or of half of it)");
    const at::Tensor cc = c.contiguous(), sc = s.contiguous();
    for (int64_t i = 0; i < d; ++i) {
      cos[i] = bf16_data(cc)[i % n];
      sin[i] = bf16_data(sc)[i % n];
    }
  }
};

// The weights of one layer's Llama-style attention, checked once.
struct AttentionWeights {
  Matrix wq, wk, wv;
  at::Tensor q_norm, k_norm;  // undefined where the model has none
  std::vector<at::Tensor> keep;  // the projections' tensors, alive while referenced
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // the first rotary_dim values of a q/k head turn (GLM-4-MoE: part of it); the rest pass
  float eps = 0.f;
  at::Tensor bias[3];  // q/k/v projections' biases (Qwen2-MoE, GPT-OSS); undefined where the model has none
  bool full_norm = false;  // q/k norms over the whole projection (OLMoE), before the rotary embedding

  void set_biases(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const at::Tensor* in[3] = {&q, &k, &v};
    const int64_t rows[3] = {wq.rows, wk.rows, wv.rows};
    for (int m = 0; m < 3; ++m) check_vector(bias[m] = in[m]->contiguous(), rows[m], "q/k/v bias");
  }
};

AttentionWeights attention_weights(const Weight& q_proj, const Weight& k_proj, const Weight& v_proj,
                                   const c10::optional<at::Tensor>& q_norm,
                                   const c10::optional<at::Tensor>& k_norm, double eps, int64_t head_dim,
                                   int64_t hidden) {
  const Matrix wq = matrix_of(q_proj, "q_proj"), wk = matrix_of(k_proj, "k_proj"), wv = matrix_of(v_proj, "v_proj");
  TORCH_CHECK(wq.cols == hidden && wk.cols == hidden && wv.cols == hidden,
              "qkv_rope: one bf16 row of the projections' width");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && wq.rows % head_dim == 0 && wk.rows % head_dim == 0 &&
                  wv.rows == wk.rows && wk.rows > 0 && (wq.rows / head_dim) % (wk.rows / head_dim) == 0,
              "qkv_rope: projections of whole heads, as many value heads as key heads, whole groups of query heads");
  AttentionWeights out{wq, wk, wv, at::Tensor(), at::Tensor(),
                       {q_proj.tensor, k_proj.tensor, v_proj.tensor}, head_dim, head_dim, static_cast<float>(eps)};
  // q/k norms over one head, or (OLMoE) over the whole projection: then both are
  out.full_norm = q_norm.has_value() && q_norm->numel() != head_dim;
  if (q_norm.has_value())
    check_vector(out.q_norm = q_norm->contiguous(), out.full_norm ? wq.rows : head_dim, "q_norm");
  if (k_norm.has_value())
    check_vector(out.k_norm = k_norm->contiguous(), out.full_norm ? wk.rows : head_dim, "k_norm");
  TORCH_CHECK(!out.full_norm || k_norm.has_value(), "q/k norms over the whole projection: both are needed");
  return out;
}

// One head of a token's q (m = 0), k (1) or v (2) for Llama-style attention: its rows of the
// projection, rounded, then for q and k the optional per-head RMSNorm (Qwen3) and the rotary
// embedding. `rows`: d floats of scratch; `normed`: d bf16 of scratch.
void project_head(const AttentionWeights& a, int m, int64_t h, const bf16* x, const bf16* cos, const bf16* sin,
                  float* rows, bf16* normed, bf16* out) {
  const int64_t d = a.head_dim;
  const Matrix& w = m == 0 ? a.wq : m == 1 ? a.wk : a.wv;
  gemv_rows(w, x, h * d, (h + 1) * d, rows);
  round_linear(rows, a.bias[m].defined() ? bf16_data(a.bias[m]) + h * d : nullptr, d, out);
  if (m == 2 || a.full_norm) return;  // values are neither normed nor rotated; full-width norms come later
  const at::Tensor& norm = m == 0 ? a.q_norm : a.k_norm;
  if (norm.defined()) {
    rms_norm_row(out, bf16_data(norm), d, a.eps, normed);
    std::memcpy(out, normed, d * sizeof(bf16));
  }
  rope_head(out, cos, sin, a.rotary_dim);
}

// One token's query (into q), key and value (into k, v) for a layer of Llama-style attention.
// `acc` holds q + k + v rows of float32.
void qkv_rope_into(const AttentionWeights& a, const bf16* x, const bf16* cos, const bf16* sin, float* acc, bf16* q,
                   bf16* k, bf16* v) {
  const int64_t d = a.head_dim, q_heads = a.wq.rows / d, kv_heads = a.wk.rows / d;
  bf16* out[3] = {q, k, v};
  const int64_t first_head[4] = {0, q_heads, q_heads + kv_heads, q_heads + 2 * kv_heads};
  // Whole heads of q, k and v as one range: each thread projects its heads, rounds them, and
  // applies the norm and rotary embedding itself (no serial pass over all heads afterwards).
  at::parallel_for(0, first_head[3], 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> normed(d);
    for (int64_t head = begin; head < end; ++head) {
      const int m = head < first_head[1] ? 0 : head < first_head[2] ? 1 : 2;
      const int64_t h = head - first_head[m];
      project_head(a, m, h, x, cos, sin, acc + head * d, normed.data(), out[m] + h * d);
    }
  });
}

// Returns q [1, heads, 1, d], k and v [1, kv_heads, 1, d], as the attention module hands them to
// the KV cache.
// `biases`: none, or the q, k and v projections' (bf16, added before the rounding as F.linear does).
std::vector<at::Tensor> qkv_rope(const at::Tensor& x, const Weight& wq, const Weight& wk,
                                    const Weight& wv, const c10::optional<at::Tensor>& q_norm,
                                    const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& cos,
                                    const at::Tensor& sin, int64_t head_dim,
                                    const std::vector<at::Tensor>& biases) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "qkv_rope: one bf16 row of the projections' width");
  AttentionWeights a = attention_weights(wq, wk, wv, q_norm, k_norm, eps, head_dim, x.numel());
  TORCH_CHECK(!a.full_norm, "qkv_rope: q/k norms over one head only");
  TORCH_CHECK(biases.empty() || biases.size() == 3, "qkv_rope: no biases, or one each for q, k and v");
  if (!biases.empty()) a.set_biases(biases[0], biases[1], biases[2]);
  const RotaryRows rows(cos, sin, head_dim, "qkv_rope");
  const at::Tensor xc = x.contiguous();
  const int64_t nq = a.wq.rows, nk = a.wk.rows;
  std::vector<float> acc(nq + 2 * nk);
  auto opts = x.options();
  at::Tensor q = at::empty({1, nq / head_dim, 1, head_dim}, opts);
  at::Tensor k = at::empty({1, nk / head_dim, 1, head_dim}, opts);
  at::Tensor v = at::empty({1, nk / head_dim, 1, head_dim}, opts);
  qkv_rope_into(a, bf16_data(xc), rows.cos.data(), rows.sin.data(), acc.data(), bf16_data(q), bf16_data(k),
                bf16_data(v));
  return {q, k, v};
}

// v[i] = exp(v[i] - shift) for n values; returns their sum. Vectorized with AVX-512 or AVX2
// (Cephes' single-precision polynomial, within ~2 ulp of std::exp): the softmax's exponentials
// were a third of one-token attention's time.
inline float exp_shifted(float* v, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(v + i), _mm512_set1_ps(shift)));
    _mm512_storeu_ps(v + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#elif defined(MOESCOPE_AVX2)
  // the same polynomial in 8 lanes (k >= -126 after the clamp: 2^k is a normal float, built from its bits)
  __m256 sum = _mm256_setzero_ps();
  const __m256 lo = _mm256_set1_ps(kExpFloor), log2e = _mm256_set1_ps(kLog2e);
  const __m256 ln2_hi = _mm256_set1_ps(kLn2Hi), ln2_lo = _mm256_set1_ps(kLn2Lo);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(shift)), lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[c]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
    _mm256_storeu_ps(v + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = hsum_ps(sum);
#endif
  for (; i < n; ++i) total += (v[i] = std::exp(v[i] - shift));
  return total;
}

// out[0, d) = sum over t of p[t] * rows[t], for `len` bf16 rows `stride` apart. The sums stay in
// registers across the rows, 64 columns at a time (accumulating in memory made every row wait for
// the previous row's store: most of one-query attention's time).
inline void weighted_rows(const float* p, const bf16* rows, int64_t stride, int64_t len, int64_t d, float* out) {
  int64_t c = 0;
#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX512F)
  for (; c + 64 <= d; c += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < len; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const bf16* row = rows + t * stride + c;
      a0 = _mm512_fmadd_ps(w, widen_bf16(row), a0);
      a1 = _mm512_fmadd_ps(w, widen_bf16(row + 16), a1);
      a2 = _mm512_fmadd_ps(w, widen_bf16(row + 32), a2);
      a3 = _mm512_fmadd_ps(w, widen_bf16(row + 48), a3);
    }
    _mm512_storeu_ps(out + c, a0);
    _mm512_storeu_ps(out + c + 16, a1);
    _mm512_storeu_ps(out + c + 32, a2);
    _mm512_storeu_ps(out + c + 48, a3);
  }
  if (c + 32 == d) {  // 32 columns left (Mixtral's head size): two positions a step, four sums in flight
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t t = 0;
    for (; t + 2 <= len; t += 2) {
      const bf16 *row = rows + t * stride + c, *next = row + stride;
      const __m512 w = _mm512_set1_ps(p[t]), v = _mm512_set1_ps(p[t + 1]);
      a0 = _mm512_fmadd_ps(w, widen_bf16(row), a0);
      a1 = _mm512_fmadd_ps(w, widen_bf16(row + 16), a1);
      b0 = _mm512_fmadd_ps(v, widen_bf16(next), b0);
      b1 = _mm512_fmadd_ps(v, widen_bf16(next + 16), b1);
    }
    if (t < len) {
      const __m512 w = _mm512_set1_ps(p[t]);
      a0 = _mm512_fmadd_ps(w, widen_bf16(rows + t * stride + c), a0);
      a1 = _mm512_fmadd_ps(w, widen_bf16(rows + t * stride + c + 16), a1);
    }
    _mm512_storeu_ps(out + c, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(out + c + 16, _mm512_add_ps(a1, b1));
    c += 32;
  }
  for (; c + 16 <= d; c += 16) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), widen_bf16(rows + t * stride + c), a);
    _mm512_storeu_ps(out + c, a);
  }
#elif defined(MOESCOPE_AVX2)
  for (; c + 32 <= d; c += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t t = 0; t < len; ++t) {
      const __m256 w = _mm256_set1_ps(p[t]);
      const bf16* row = rows + t * stride + c;
      a0 = _mm256_fmadd_ps(w, widen_bf16_8(row), a0);
      a1 = _mm256_fmadd_ps(w, widen_bf16_8(row + 8), a1);
      a2 = _mm256_fmadd_ps(w, widen_bf16_8(row + 16), a2);
      a3 = _mm256_fmadd_ps(w, widen_bf16_8(row + 24), a3);
    }
    _mm256_storeu_ps(out + c, a0);
    _mm256_storeu_ps(out + c + 8, a1);
    _mm256_storeu_ps(out + c + 16, a2);
    _mm256_storeu_ps(out + c + 24, a3);
  }
  for (; c + 8 <= d; c += 8) {  // two positions a step: two sums in flight
    __m256 a = _mm256_setzero_ps(), b = a;
    int64_t t = 0;
    for (; t + 2 <= len; t += 2) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), widen_bf16_8(rows + t * stride + c), a);
      b = _mm256_fmadd_ps(_mm256_set1_ps(p[t + 1]), widen_bf16_8(rows + (t + 1) * stride + c), b);
    }
    if (t < len) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), widen_bf16_8(rows + t * stride + c), a);
    _mm256_storeu_ps(out + c, _mm256_add_ps(a, b));
  }
#endif
  for (; c < d; ++c) {
    float a = 0.f;
    for (int64_t t = 0; t < len; ++t) a += p[t] * to_float(rows[t * stride + c]);
    out[c] = a;
  }
}

// A layer's cached keys or values: [kv_heads, len] rows of d, contiguous within a row.
struct CacheView {
  const bf16* data;
  int64_t head_stride, position_stride;
};

// softmax(q k^T * scale) v for one query over `len` cached positions, groups of query heads
// sharing a kv head; float32 throughout, the output rounded to bf16 as [heads * d].
// Query head h (of a group sharing kv head g) over `len` cached positions into out[0, d).
// `scores`: len floats and `acc`: d floats of scratch.

// scores[t] = (key row t . q) * scale for positions [0, len); returns the largest. Keys 16 (AVX-512)
// or 8 (AVX2) at a time where the head size is whole vector steps (one query's attention spent most
// of its time in the per-position reductions).
inline float key_scores(const bf16* q, int64_t d, const bf16* keys, int64_t stride, int64_t len, float scale,
                        float* scores) {
  float top = -INFINITY;
  int64_t t = 0;
#if defined(MOESCOPE_AVX512BF16)
  if (d % 32 == 0) {
    const __m512 scaled = _mm512_set1_ps(scale);
    __m512 running = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= len; t += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const bf16* row = keys + (t + j) * stride;
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32)
          a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(row + i), (__m512bh)_mm512_loadu_si512(q + i));
        acc[j] = a;
      }
      const __m512 block = _mm512_mul_ps(sum_lanes_16(acc), scaled);
      _mm512_storeu_ps(scores + t, block);
      running = _mm512_max_ps(running, block);
    }
    top = _mm512_reduce_max_ps(running);
  }
#elif defined(MOESCOPE_AVX2)
  constexpr int64_t kMaxHead = 512;
  if (d % 8 == 0 && d <= kMaxHead) {
    alignas(32) float qf[kMaxHead];  // q widened once, not once per key
    for (int64_t i = 0; i < d; i += 8) _mm256_store_ps(qf + i, widen_bf16_8(q + i));
    const __m256 scaled = _mm256_set1_ps(scale);
    __m256 running = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= len; t += 8) {
      __m256 acc[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const bf16* row = keys + (t + j) * stride;
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(widen_bf16_8(row + i), _mm256_load_ps(qf + i), a);
        acc[j] = a;
      }
      const __m256 block = _mm256_mul_ps(sum_lanes_8(acc), scaled);
      _mm256_storeu_ps(scores + t, block);
      running = _mm256_max_ps(running, block);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, running);
    for (float lane : lanes) top = std::max(top, lane);
  }
#endif
  for (; t < len; ++t) {  // bf16 products are exact in float32: q need not be widened first
    scores[t] = dot_row(keys + t * stride, q, d) * scale;
    top = std::max(top, scores[t]);
  }
  return top;
}

// What some families add to plain softmax attention: an attention sink per query head (GPT-OSS: a
// logit that joins the softmax's denominator only), and the roundings of an eager attention
// function, whose ops run in bf16 (the scores, their scaling, the shift by the maximum, the
// probabilities), so near-ties fall as they fall in the model's own code.
struct AttendExtras {
  const bf16* sinks = nullptr;  // [heads] or none
  bool eager_rounding = false;
};

// Head h's scores (its keys' products, times `scale` unless eager: then 1, and scaled here) into
// softmax probabilities in place; `top` is their largest.
inline void softmax_scores(float* scores, int64_t len, float top, float scale, const AttendExtras& extras, int64_t h) {
  const bool eager = extras.eager_rounding;
  if (eager) {
    top = -INFINITY;
    for (int64_t t = 0; t < len; ++t) top = std::max(top, scores[t] = round_bf16(round_bf16(scores[t]) * scale));
  }
  float sink = extras.sinks != nullptr ? to_float(extras.sinks[h]) : -INFINITY;
  top = std::max(top, sink);
  if (eager) {  // the shift rounded too; the exponentials then start from the shifted values
    for (int64_t t = 0; t < len; ++t) scores[t] = round_bf16(scores[t] - top);
    sink = round_bf16(sink - top);
    top = 0.f;
  }
  const float total = exp_shifted(scores, len, top) + (extras.sinks != nullptr ? std::exp(sink - top) : 0.f);
  if (eager)
    for (int64_t t = 0; t < len; ++t) scores[t] = round_bf16(scores[t] / total);
  else
    for (int64_t t = 0; t < len; ++t) scores[t] /= total;
}

void attend_head(const bf16* q, int64_t d, int64_t g, CacheView keys, CacheView values, int64_t len, float scale,
                 float* scores, float* acc, bf16* out, const AttendExtras& extras = {}, int64_t h = 0) {
  const float top = key_scores(q, d, keys.data + g * keys.head_stride, keys.position_stride, len,
                               extras.eager_rounding ? 1.f : scale, scores);
  softmax_scores(scores, len, top, scale, extras, h);
  weighted_rows(scores, values.data + g * values.head_stride, values.position_stride, len, d, acc);
  for (int64_t i = 0; i < d; ++i) out[i] = to_bf16(acc[i]);
}

#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX2)
// The query heads that share a kv head, attended together: each key and value row is read and
// widened once for the whole group instead of once per head, and the products of several heads
// are independent sums, so they no longer wait on each other. The same arithmetic as attend_head,
// in the same order per head, except that the few positions past its last full key step that fall
// in a group's smaller steps take the dot products' order instead of one sum. Where it applies:
// head sizes of whole value steps (4 vectors), groups that divide a reduction's lanes (lanes /
// group positions of the group's heads per reduction). With AVX-512 BF16 the keys stay bf16 (dot
// products of pairs); with AVX2 they are widened to float32 once per group.
#if defined(MOESCOPE_AVX512BF16)
constexpr int kGroupLanes = 16;
using GroupSums = __m512;
inline GroupSums group_sums_of(GroupSums* acc) { return sum_lanes_16(acc); }
#else
constexpr int kGroupLanes = 8;
using GroupSums = __m256;
inline GroupSums group_sums_of(GroupSums* acc) { return sum_lanes_8(acc); }
constexpr int64_t kGroupMaxHead = 512;  // q widened on the stack
#endif
constexpr int64_t kKeysAhead = 16;  // cached positions a group's loops ask for ahead of the one they read
constexpr int64_t kValueColumns = 4 * FloatVector::lanes;  // value columns per pass: 4 sums per head

inline bool group_attention_applies(int64_t group, int64_t d) {
#if defined(MOESCOPE_AVX2)
  if (d > kGroupMaxHead) return false;
#endif
  return d % kValueColumns == 0 && group <= kGroupLanes && kGroupLanes % group == 0;
}

// scores[j * len + t] = (key row t . q_j) * scale for the group's heads j, positions [0, len);
// top[j] = head j's largest.
template <int G>
inline void group_key_scores(const bf16* q, int64_t d, const bf16* keys, int64_t stride, int64_t len, float scale,
                             float* scores, float* top) {
  constexpr int P = kGroupLanes / G;  // positions per reduction
#if defined(MOESCOPE_AVX2)
  alignas(32) float qf[G * kGroupMaxHead];  // q widened once, not once per key
  for (int64_t i = 0; i < G * d; i += 8) _mm256_store_ps(qf + i, widen_bf16_8(q + i));
#endif
  alignas(64) float lanes[kGroupLanes];
#if defined(MOESCOPE_AVX512BF16)
  __m512 running = _mm512_set1_ps(-INFINITY);
#else
  __m256 running = _mm256_set1_ps(-INFINITY);
#endif
  int64_t t = 0;
  for (; t + P <= len; t += P) {
    for (int p = 0; p < P; ++p)  // a long context's keys come from memory: ask for them ahead
      for (int64_t b = 0; b < 2 * d; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(keys + (t + p + kKeysAhead) * stride) + b, _MM_HINT_T0);
    GroupSums acc[kGroupLanes];  // lane order j * P + p: head j's P positions side by side
#if defined(MOESCOPE_AVX512BF16)
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {  // independent sums, each key vector loaded once
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const __m512bh key = (__m512bh)_mm512_loadu_si512(keys + (t + p) * stride + i);
#pragma GCC unroll 16
        for (int j = 0; j < G; ++j)
          acc[j * P + p] = _mm512_dpbf16_ps(acc[j * P + p], key, (__m512bh)_mm512_loadu_si512(q + j * d + i));
      }
    }
    const __m512 block = _mm512_mul_ps(group_sums_of(acc), _mm512_set1_ps(scale));
    for (int j = 0; j < G; ++j)  // lanes j * P .. j * P + P - 1 to head j's positions t ..
      _mm512_mask_storeu_ps(scores + j * len + t - j * P, static_cast<__mmask16>(((1u << P) - 1) << (j * P)), block);
    running = _mm512_max_ps(running, block);
#else
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {  // independent sums, each key vector widened once
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256 key = widen_bf16_8(keys + (t + p) * stride + i);
#pragma GCC unroll 8
        for (int j = 0; j < G; ++j) acc[j * P + p] = _mm256_fmadd_ps(key, _mm256_load_ps(qf + j * d + i), acc[j * P + p]);
      }
    }
    const __m256 block = _mm256_mul_ps(group_sums_of(acc), _mm256_set1_ps(scale));
    _mm256_store_ps(lanes, block);
    for (int j = 0; j < G; ++j)
      for (int p = 0; p < P; ++p) scores[j * len + t + p] = lanes[j * P + p];
    running = _mm256_max_ps(running, block);
#endif
  }
#if defined(MOESCOPE_AVX512BF16)
  _mm512_store_ps(lanes, running);
#else
  _mm256_store_ps(lanes, running);
#endif
  for (int j = 0; j < G; ++j) {
    top[j] = -INFINITY;
    for (int p = 0; p < P; ++p) top[j] = std::max(top[j], lanes[j * P + p]);
  }
  for (; t < len; ++t)
    for (int j = 0; j < G; ++j) {
      scores[j * len + t] = dot_row(keys + t * stride, q + j * d, d) * scale;
      top[j] = std::max(top[j], scores[j * len + t]);
    }
}

// out[j * d + c] = sum over t of p[j * len + t] * rows[t][c] for H heads j, kValueColumns columns
// at a time: 4H sums in registers, each value row widened once per step for all of them. Positions
// [first, last) only, added to the sums already in `out` unless `first` is 0 (a float32 sum stored
// and loaded again is the same sum, so blocks of positions give the one pass's result).
template <int H>
inline void group_weighted_rows(const float* p, int64_t len, const bf16* rows, int64_t stride, int64_t d,
                                int64_t first, int64_t last, float* out) {
  constexpr int64_t lanes = FloatVector::lanes;
  for (int64_t c = 0; c < d; c += kValueColumns) {
    FloatVector acc[H][4];
    for (int j = 0; j < H; ++j)
      for (int k = 0; k < 4; ++k)
        acc[j][k] = first == 0 ? FloatVector::all(0.f) : FloatVector::load(out + j * d + c + lanes * k);
    for (int64_t t = first; t < last; ++t) {
      const bf16* row = rows + t * stride + c;
      for (int64_t b = 0; b < 2 * kValueColumns; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + kKeysAhead * stride) + b, _MM_HINT_T0);
      const FloatVector v[4] = {FloatVector::widen(row), FloatVector::widen(row + lanes),
                                FloatVector::widen(row + 2 * lanes), FloatVector::widen(row + 3 * lanes)};
      for (int j = 0; j < H; ++j) {
        const FloatVector w = FloatVector::all(p[j * len + t]);
        for (int k = 0; k < 4; ++k) acc[j][k] = acc[j][k].fma(w, v[k]);
      }
    }
    for (int j = 0; j < H; ++j)
      for (int k = 0; k < 4; ++k) acc[j][k].store(out + j * d + c + lanes * k);
  }
}

// Positions per block of the values' passes: where a group needs several passes (more heads than
// one pass holds, or wider heads than one pass's columns), each block is read from memory once and
// again from the first-level cache, instead of the whole cache once per pass.
constexpr int64_t kValueBlock = 64;

template <int G>
inline void attend_group_of(const bf16* q, int64_t d, int64_t g, CacheView keys, CacheView values, int64_t len,
                            float scale, float* scores, float* acc, bf16* out, const AttendExtras& extras, int64_t h0) {
  float top[G];
  group_key_scores<G>(q, d, keys.data + g * keys.head_stride, keys.position_stride, len,
                      extras.eager_rounding ? 1.f : scale, scores, top);
  for (int j = 0; j < G; ++j) softmax_scores(scores + j * len, len, top[j], scale, extras, h0 + j);
  // heads per pass over the values: 4H sums and 4 value vectors in the 32 (AVX-512) or 16 registers
  constexpr int H = std::min(G, FloatVector::lanes == 16 ? 4 : 2);
  for (int64_t first = 0; first < len; first += kValueBlock)
    for (int j = 0; j < G; j += H)
      group_weighted_rows<H>(scores + j * len, len, values.data + g * values.head_stride, values.position_stride, d,
                             first, std::min(len, first + kValueBlock), acc + j * d);
  for (int64_t i = 0; i < G * d; ++i) out[i] = to_bf16(acc[i]);
}
#else
inline bool group_attention_applies(int64_t, int64_t) { return false; }
#endif

// The `group` query heads h0 .. of kv head g into out[0, group * d): together where
// group_attention_applies, else head by head. `scores`: group * len floats; `acc`: group * d floats.
void attend_group(const bf16* q, int64_t group, int64_t d, int64_t g, CacheView keys, CacheView values, int64_t len,
                  float scale, float* scores, float* acc, bf16* out, const AttendExtras& extras, int64_t h0) {
#if defined(MOESCOPE_AVX512BF16) || defined(MOESCOPE_AVX2)
  if (group_attention_applies(group, d)) {
    switch (group) {
      case 1: return attend_group_of<1>(q, d, g, keys, values, len, scale, scores, acc, out, extras, h0);
      case 2: return attend_group_of<2>(q, d, g, keys, values, len, scale, scores, acc, out, extras, h0);
      case 4: return attend_group_of<4>(q, d, g, keys, values, len, scale, scores, acc, out, extras, h0);
      case 8: return attend_group_of<8>(q, d, g, keys, values, len, scale, scores, acc, out, extras, h0);
#if defined(MOESCOPE_AVX512BF16)
      case 16: return attend_group_of<16>(q, d, g, keys, values, len, scale, scores, acc, out, extras, h0);
#endif
    }
  }
#endif
  for (int64_t j = 0; j < group; ++j)
    attend_head(q + j * d, d, g, keys, values, len, scale, scores, acc, out + j * d, extras, h0 + j);
}

void attend_into(const bf16* q, int64_t heads, int64_t d, int64_t kv_heads, CacheView keys, CacheView values,
                 int64_t len, float scale, bf16* out, const AttendExtras& extras) {
  const int64_t group = heads / kv_heads;
  // splitting heads across threads costs a wake-up: not worth it for the first few positions
  const bool split = heads * len * d >= (1 << 15);
  if (group_attention_applies(group, d) && (!split || kv_heads % at::get_num_threads() == 0)) {
    at::parallel_for(0, kv_heads, split ? 1 : kv_heads, [&](int64_t first, int64_t last) {
      std::vector<float> scores(group * len), acc(group * d);
      for (int64_t g = first; g < last; ++g)
        attend_group(q + g * group * d, group, d, g, keys, values, len, scale, scores.data(), acc.data(),
                     out + g * group * d, extras, g * group);
    });
    return;
  }
  at::parallel_for(0, heads, split ? 1 : heads, [&](int64_t first, int64_t last) {
    std::vector<float> scores(len), acc(d);
    for (int64_t h = first; h < last; ++h)
      attend_head(q + h * d, d, h / group, keys, values, len, scale, scores.data(), acc.data(), out + h * d, extras, h);
  });
}

// One query [1, heads, 1, d] over cached keys and values ([1, kv_heads, T, d], any strides with
// contiguous rows); returns [1, 1, heads * d] (what o_proj takes).
// `sinks`: one bf16 logit per query head (GPT-OSS), or none; `eager_rounding`: see AttendExtras.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale,
                     const c10::optional<at::Tensor>& sinks, bool eager_rounding) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && q.size(0) == 1 && q.size(2) == 1,
              "attend: one query [1, heads, 1, d] and keys/values [1, kv_heads, T, d]");
  const int64_t heads = q.size(1), d = q.size(3), kv_heads = keys.size(1), len = keys.size(2);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && keys.size(3) == d && values.sizes() == keys.sizes() &&
                  len > 0 && keys.stride(3) == 1 && values.stride(3) == 1,
              "attend: keys and values of the query's head size, whole groups of heads");
  for (const auto* t : {&q, &keys, &values})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu(), "attend: bf16 CPU tensors");
  const at::Tensor qc = q.contiguous();
  AttendExtras extras;
  extras.eager_rounding = eager_rounding;
  at::Tensor sink_row;
  if (sinks.has_value()) {
    check_vector(sink_row = sinks->contiguous(), heads, "sinks");
    extras.sinks = bf16_data(sink_row);
  }
  at::Tensor out = at::empty({1, 1, heads * d}, q.options());
  attend_into(bf16_data(qc), heads, d, kv_heads, {bf16_data(keys), keys.stride(1), keys.stride(2)},
              {bf16_data(values), values.stride(1), values.stride(2)}, len, static_cast<float>(scale),
              bf16_data(out), extras);
  return out;
}

// The sizes of one layer's multi-head latent attention (DeepSeek-V2/V3's MLA).
struct LatentShape {
  int64_t heads = 0, nope = 0, rope = 0, v_dim = 0, rank = 0;
};

// One thread's scratch for latent_head, for up to `len` positions.
struct LatentScratch {
  std::vector<float> q, acc, scores, rot;
  std::vector<bf16> absorbed, context;
  void fit(const LatentShape& s, int64_t len) {
    q.resize(s.nope);
    acc.resize(s.rank);
    scores.resize(len);
    rot.resize(len);
    absorbed.resize(s.rank);
    context.resize(s.rank);
  }
};

// Head h of one query of MLA over cached latents, with the up-projection absorbed
// (engine/decode/paths/latent_attention.py says why and writes it in torch). `up` is kv_b_proj's
// weight [heads * (nope + v), rank]: per head, W_uk [nope, rank] then W_uv [v, rank], read in place.
// Rounded where the torch version rounds:
//   a = q_nope W_uk (bf16)   s_t = (a . c_t + q_rot . k_rot_t) * scale   p = softmax(s)
//   ctx = sum_t p_t c_t (bf16)   out = W_uv ctx (bf16, v values)
inline void latent_head(const bf16* up, const LatentShape& s, int64_t h, const bf16* q_nope, const bf16* q_rot,
                        const bf16* latents, int64_t lat_stride, const bf16* k_rot, int64_t rot_stride, int64_t len,
                        float scale, LatentScratch& w, bf16* out) {
  const bf16* w_uk = up + h * (s.nope + s.v_dim) * s.rank;
  for (int64_t i = 0; i < s.nope; ++i) w.q[i] = to_float(q_nope[i]);
  weighted_rows(w.q.data(), w_uk, s.rank, s.nope, s.rank, w.acc.data());
  for (int64_t c = 0; c < s.rank; ++c) w.absorbed[c] = to_bf16(w.acc[c]);
  key_scores(w.absorbed.data(), s.rank, latents, lat_stride, len, 1.f, w.scores.data());
  key_scores(q_rot, s.rope, k_rot, rot_stride, len, 1.f, w.rot.data());
  float top = -INFINITY;
  for (int64_t t = 0; t < len; ++t) top = std::max(top, w.scores[t] = (w.scores[t] + w.rot[t]) * scale);
  const float total = exp_shifted(w.scores.data(), len, top);
  for (int64_t t = 0; t < len; ++t) w.scores[t] /= total;
  weighted_rows(w.scores.data(), latents, lat_stride, len, s.rank, w.acc.data());
  for (int64_t c = 0; c < s.rank; ++c) w.context[c] = to_bf16(w.acc[c]);
  const bf16* w_uv = w_uk + s.nope * s.rank;
  for (int64_t r = 0; r < s.v_dim; ++r) out[r] = to_bf16(dot_row(w_uv + r * s.rank, w.context.data(), s.rank));
}

// One query of MLA over `latents` [positions, rank] and `k_rot` [positions, rope], every head.
at::Tensor latent_attend(const at::Tensor& up, const at::Tensor& q_nope, const at::Tensor& q_rot,
                            const at::Tensor& latents, const at::Tensor& k_rot, int64_t v_dim, double scale) {
  for (const auto* t : {&up, &q_nope, &q_rot, &latents, &k_rot})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu(), "latent_attend: bf16 CPU tensors");
  TORCH_CHECK(up.dim() == 2 && up.is_contiguous() && q_nope.dim() == 2 && q_rot.dim() == 2 &&
                  q_rot.size(0) == q_nope.size(0), "latent_attend: up [heads * (nope + v), rank], q [heads, ...]");
  const LatentShape shape{q_nope.size(0), q_nope.size(1), q_rot.size(1), v_dim, up.size(1)};
  TORCH_CHECK(up.size(0) == shape.heads * (shape.nope + v_dim), "latent_attend: up's rows are heads * (nope + v)");
  TORCH_CHECK(latents.dim() == 2 && k_rot.dim() == 2 && latents.size(1) == shape.rank && k_rot.size(1) == shape.rope &&
                  latents.size(0) == k_rot.size(0) && latents.size(0) > 0 && latents.stride(1) == 1 &&
                  k_rot.stride(1) == 1, "latent_attend: latents [positions, rank], k_rot [positions, rope]");
  const at::Tensor qn = q_nope.contiguous(), qr = q_rot.contiguous();
  const int64_t len = latents.size(0);
  at::Tensor out = at::empty({1, 1, shape.heads * v_dim}, up.options());
  at::parallel_for(0, shape.heads, 1, [&](int64_t first, int64_t last) {
    LatentScratch scratch;
    scratch.fit(shape, len);
    for (int64_t h = first; h < last; ++h)
      latent_head(bf16_data(up), shape, h, bf16_data(qn) + h * shape.nope, bf16_data(qr) + h * shape.rope,
                  bf16_data(latents), latents.stride(0), bf16_data(k_rot), k_rot.stride(0), len,
                  static_cast<float>(scale), scratch, bf16_data(out) + h * v_dim);
  });
  return out;
}

// out = a + b in bf16, rounded as torch adds two bf16 tensors.
inline void add_rows(const bf16* a, const bf16* b, int64_t n, bf16* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(to_float(a[i]) + to_float(b[i]));
}

// A whole decode step of a Llama-style MoE decoder (Qwen3-MoE, Mixtral) in one call, for when
// every expert is resident: per layer RMSNorm, attention (q/k/v + rotary, the KV cache, o_proj),
// residual, RMSNorm, top-k router, the picked experts, residual; then the final norm and lm_head.
// The same kernels, in the same order, as the per-module fast path; what it saves is the ~250 us
// per layer of Python and small torch ops between them, and (one parallel region for the whole
// token, spin barriers inside) the start of a region per kernel. The caller does the cache's
// bookkeeping afterwards from the picks it returns.
class DecodeStep {
 public:
  // `softmax_of_top`: the routers take the top k of their (biased) logits, then a softmax over those
  // k in bf16 (GPT-OSS), instead of a float32 softmax over all experts, then the top k.
  // `norms_round_once`: the RMSNorms multiply by their weight in float32 and round once (GPT-OSS).
  DecodeStep(at::Tensor embed, at::Tensor final_norm, double final_eps, const Weight& lm_head, int64_t top_k,
             bool normalize, bool cast_back, bool softmax_of_top, bool norms_round_once)
      : embed_(std::move(embed)), final_norm_(std::move(final_norm)), lm_head_tensor_(lm_head.tensor),
        lm_head_(matrix_of(lm_head, "lm_head")), final_eps_(static_cast<float>(final_eps)), top_k_(top_k),
        normalize_(normalize), cast_back_(cast_back), softmax_of_top_(softmax_of_top),
        norms_round_once_(norms_round_once) {
    check_matrix(embed_, "embed_tokens");
    hidden_ = embed_.size(1);
    check_vector(final_norm_, hidden_, "norm");
    TORCH_CHECK(lm_head_.cols == hidden_ && top_k_ > 0, "lm_head: [vocab, hidden]; top_k > 0");
  }

  // A decoder layer: its norms and o_proj; its attention comes with set_attention or
  // set_latent_attention, its router with set_router or set_grouped_router (none: a dense MLP,
  // given as a shared expert alone), its experts with set_experts.
  void add_layer(const at::Tensor& input_norm, double input_eps, const Weight& wo, const at::Tensor& post_norm,
                 double post_eps) {
    Layer layer;
    check_vector(layer.input_norm = input_norm.contiguous(), hidden_, "input_layernorm");
    check_vector(layer.post_norm = post_norm.contiguous(), hidden_, "post_attention_layernorm");
    layer.wo = matrix_of(wo, "o_proj");
    layer.wo_tensor = wo.tensor;
    TORCH_CHECK(layer.wo.rows == hidden_, "o_proj: [hidden, heads * head_dim]");
    layer.input_eps = static_cast<float>(input_eps);
    layer.post_eps = static_cast<float>(post_eps);
    layers_.push_back(std::move(layer));
  }

  // `layer`'s Llama-style attention: q/k/v projections, optional per-head (or whole) q/k norms, the
  // rotary embedding over the first `rotary_dim` values of each head (all of it but in GLM-4-MoE).
  void set_attention(int64_t layer, const Weight& wq, const Weight& wk, const Weight& wv,
                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                     double qk_eps, int64_t head_dim, double scale, int64_t rotary_dim) {
    Layer& l = at_layer(layer, "set_attention");
    l.attention = attention_weights(wq, wk, wv, q_norm, k_norm, qk_eps, head_dim, hidden_);
    TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
                "set_attention: an even rotary size of at most the head size");
    l.attention.rotary_dim = rotary_dim;
    TORCH_CHECK(l.wo.cols == l.attention.wq.rows, "o_proj: [hidden, heads * head_dim]");
    l.scale = static_cast<float>(scale);
    l.latent = false;
  }

  // `layer`'s multi-head latent attention (DeepSeek-V3): q from q_b(RMSNorm(q_a x)) (or q_b x alone
  // where the model has no q LoRA: its q_proj), the latent and rotary key from kv_a x, the cache
  // holding latents [rank] as keys and rotary keys [rope] as values; kv_b_proj (`up`, bf16) absorbed.
  void set_latent_attention(int64_t layer, const c10::optional<Weight>& q_a, const c10::optional<at::Tensor>& q_a_norm,
                            double q_a_eps, const Weight& q_b, const Weight& kv_a, const at::Tensor& kv_a_norm,
                            double kv_a_eps, const at::Tensor& up, int64_t heads, int64_t nope, int64_t rope,
                            int64_t v_dim, double scale, bool interleaved) {
    Layer& l = at_layer(layer, "set_latent_attention");
    LatentAttention& m = l.mla;
    m.shape = LatentShape{heads, nope, rope, v_dim, kv_a_norm.numel()};
    TORCH_CHECK(q_a.has_value() == q_a_norm.has_value(), "set_latent_attention: q_a_proj and its norm, or neither");
    m.keep = {q_b.tensor, kv_a.tensor, up};
    m.q_a = Matrix();
    if (q_a.has_value()) {
      m.q_a = matrix_of(*q_a, "q_a_proj");
      check_vector(m.q_a_norm = q_a_norm->contiguous(), m.q_a.rows, "q_a_layernorm");
      TORCH_CHECK(m.q_a.cols == hidden_, "q_a_proj: [q_lora_rank, hidden]");
      m.keep.push_back(q_a->tensor);
    }
    m.q_b = matrix_of(q_b, "q_b_proj");
    m.kv_a = matrix_of(kv_a, "kv_a_proj_with_mqa");
    check_vector(m.kv_a_norm = kv_a_norm.contiguous(), m.shape.rank, "kv_a_layernorm");
    check_matrix(up, "kv_b_proj");
    TORCH_CHECK(heads > 0 && rope > 0 && rope % 2 == 0 && m.q_b.rows == heads * (nope + rope) &&
                    m.q_b.cols == (q_a.has_value() ? m.q_a.rows : hidden_),
                "q_b_proj: [heads * (nope + rope), q_lora_rank or hidden]");
    TORCH_CHECK(m.kv_a.rows == m.shape.rank + rope && m.kv_a.cols == hidden_, "kv_a_proj_with_mqa: [rank + rope, hidden]");
    TORCH_CHECK(up.is_contiguous() && up.size(0) == heads * (nope + v_dim) && up.size(1) == m.shape.rank,
                "kv_b_proj: a contiguous [heads * (nope + v), rank] matrix");
    TORCH_CHECK(l.wo.cols == heads * v_dim, "o_proj: [hidden, heads * v_head_dim]");
    m.up = up;
    m.q_a_eps = static_cast<float>(q_a_eps);
    m.kv_a_eps = static_cast<float>(kv_a_eps);
    m.interleaved = interleaved;
    l.scale = static_cast<float>(scale);
    l.latent = true;
  }

  // `layer`'s top-k router [experts, hidden] in bf16, scored as the constructor's recipe says.
  void set_router(int64_t layer, const at::Tensor& router) {
    Layer& l = at_layer(layer, "set_router");
    check_matrix(router, "router");
    TORCH_CHECK(router.size(1) == hidden_ && router.size(0) >= top_k_, "router: [experts >= top_k, hidden]");
    l.router_tensor = router;
    l.router = matrix_of(plain(router), "router");
    l.grouped = false;
  }

  // `layer`'s DeepSeek-V3-style router: float32 logits, sigmoid scores, plus `correction` to choose
  // with; the best `top_groups` of `groups` equal groups of experts (a group scored by its two best),
  // the top k within them, weighted by their scores (renormalised where the constructor says),
  // times `routed_scale`.
  void set_grouped_router(int64_t layer, const at::Tensor& weight, const at::Tensor& correction, int64_t groups,
                          int64_t top_groups, double routed_scale) {
    Layer& l = at_layer(layer, "set_grouped_router");
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                    weight.size(1) == hidden_ && weight.size(0) >= top_k_,
                "grouped router: a contiguous float32 [experts >= top_k, hidden] weight");
    const int64_t experts = weight.size(0);
    TORCH_CHECK(correction.scalar_type() == at::kFloat && correction.is_contiguous() &&
                    correction.numel() == experts, "grouped router: a float32 correction bias per expert");
    TORCH_CHECK(groups > 0 && experts % groups == 0 && experts / groups >= 2 && top_groups > 0 &&
                    top_groups <= groups && top_groups * (experts / groups) >= top_k_,
                "grouped router: groups of at least two experts, enough of them for the top k");
    l.router_tensor = weight;
    l.correction = correction;
    l.router = Matrix();
    l.router.rows = experts;
    l.router.cols = hidden_;
    l.groups = groups;
    l.top_groups = top_groups;
    l.routed_scale = static_cast<float>(routed_scale);
    l.grouped = true;
  }

  // Every expert of `layer`, by expert id (they move when the cache re-plans its slots); optionally
  // their biases (one each or none), read as x @ W (`transposed`), and gated by `recipe`.
  void set_experts(int64_t layer, const std::vector<Weight>& gate_up, const std::vector<Weight>& down,
                   const std::vector<at::Tensor>& gate_up_bias, const std::vector<at::Tensor>& down_bias,
                   bool transposed, const GateRecipe& recipe) {
    Layer& l = at_layer(layer, "set_experts");
    TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == l.router.rows,
                "set_experts: one gate_up and one down for every expert the router scores");
    l.experts = expert_list(gate_up, down, gate_up_bias, down_bias, hidden_, transposed);
    l.gate = recipe;
    // keeps the slot memory alive while referenced
    l.expert_tensors.assign(gate_up_bias.begin(), gate_up_bias.end());
    l.expert_tensors.insert(l.expert_tensors.end(), down_bias.begin(), down_bias.end());
    for (size_t e = 0; e < gate_up.size(); ++e) {
      l.expert_tensors.push_back(gate_up[e].tensor);
      l.expert_tensors.push_back(down[e].tensor);
    }
    l.inter = l.experts[0].inter;
  }

  // The q/k/v projections' biases of `layer` (each [rows of its projection]).
  void set_attention_biases(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    at_layer(layer, "set_attention_biases").attention.set_biases(q, k, v);
  }

  // What `layer`'s attention adds to Llama's (GPT-OSS): a sink logit per query head, an eager
  // attention function's roundings (AttendExtras), and o_proj's bias.
  void set_attention_extras(int64_t layer, const c10::optional<at::Tensor>& sinks, bool eager_rounding,
                            const c10::optional<at::Tensor>& o_bias) {
    Layer& l = at_layer(layer, "set_attention_extras");
    l.extras.eager_rounding = eager_rounding;
    l.extras.sinks = nullptr;
    if (sinks.has_value()) {
      check_vector(l.sinks = sinks->contiguous(), l.attention.wq.rows / l.attention.head_dim, "sinks");
      l.extras.sinks = bf16_data(l.sinks);
    }
    l.o_bias = at::Tensor();
    if (o_bias.has_value()) check_vector(l.o_bias = o_bias->contiguous(), hidden_, "o_proj bias");
  }

  // `layer`'s router bias [experts], added to its logits before their rounding (GPT-OSS).
  void set_router_bias(int64_t layer, const at::Tensor& bias) {
    Layer& l = at_layer(layer, "set_router_bias");
    check_vector(l.router_bias = bias.contiguous(), l.router.rows, "router bias");
  }

  // A shared expert beside `layer`'s routed experts, optionally gated by sigmoid(gate . x).
  void set_shared_expert(int64_t layer, const Weight& gate_proj, const Weight& up_proj, const Weight& down_proj,
                         const c10::optional<at::Tensor>& gate) {
    Layer& l = at_layer(layer, "set_shared_expert");
    l.shared_gate_proj = matrix_of(gate_proj, "shared gate_proj");
    l.shared_up_proj = matrix_of(up_proj, "shared up_proj");
    l.shared_down_proj = matrix_of(down_proj, "shared down_proj");
    const int64_t inter = l.shared_gate_proj.rows;
    TORCH_CHECK(l.shared_gate_proj.cols == hidden_ && l.shared_up_proj.cols == hidden_ &&
                    l.shared_up_proj.rows == inter && l.shared_down_proj.rows == hidden_ &&
                    l.shared_down_proj.cols == inter,
                "shared expert: gate/up [I, hidden] and down [hidden, I]");
    l.shared_tensors = {gate_proj.tensor, up_proj.tensor, down_proj.tensor};
    l.shared_gated = gate.has_value();
    if (l.shared_gated) {
      check_vector(*gate, hidden_, "shared_expert_gate");
      l.shared_tensors.push_back(gate->contiguous());
      l.shared_gate = matrix_of(plain(l.shared_tensors.back().view({1, hidden_})), "shared_expert_gate");
    }
    l.shared = true;
  }

  // One token. keys/values: each layer's cache buffer [1, kv_heads, capacity, d] (for latent
  // attention: latents [1, 1, capacity, rank] and rotary keys [1, 1, capacity, rope]), whose
  // positions [starts[i], starts[i] + lengths[i]) are the ones this token attends to besides itself
  // (all cached positions, or a sliding window's); its key and value are written right behind them.
  // cos/sin: the rotary rows for the token's position. picks: int64 [MoE layers, top_k], filled
  // with each MoE layer's experts in router order. Returns the logits [1, 1, vocab] in bf16.
  at::Tensor run(int64_t token, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                    const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths, at::Tensor picks) {
    const int64_t layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(token >= 0 && token < embed_.size(0), "run: token id outside the vocabulary");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers &&
                    static_cast<int64_t>(starts.size()) == layers && static_cast<int64_t>(lengths.size()) == layers,
                "run: one key and one value buffer, start and length per layer");
    // Every check before the parallel region: nothing may throw inside it.
    std::vector<CacheView> key_views, value_views;
    int64_t widest = 0, widest_inter = 0, longest = 0, routed = 0, latent_in = 0;
    TORCH_CHECK(layers > 0, "run: add_layer was not called");
    const int64_t rotary_dim = layers_[0].rotary_dim();
    const RotaryRows rotary(cos, sin, rotary_dim, "run");
    for (int64_t i = 0; i < layers; ++i) {
      Layer& l = layers_[i];
      TORCH_CHECK(l.rotary_dim() > 0, "run: layer ", i, " has no attention (set_attention or set_latent_attention)");
      TORCH_CHECK(l.rotary_dim() == rotary_dim, "run: every layer of one rotary size");
      TORCH_CHECK(starts[i] >= 0 && lengths[i] >= 0, "run: starts and lengths are positions");
      // Llama-style: keys and values [1, kv_heads, capacity, d]; latent: latents [1, 1, capacity,
      // rank] as keys and rotary keys [1, 1, capacity, rope] as values
      const AttentionWeights& a = l.attention;
      const int64_t kv_heads = l.latent ? 1 : a.wk.rows / a.head_dim;
      const int64_t widths[2] = {l.latent ? l.mla.shape.rank : a.head_dim, l.latent ? l.mla.shape.rope : a.head_dim};
      for (int m = 0; m < 2; ++m) {
        const at::Tensor& t = m == 0 ? keys[i] : values[i];
        TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.size(1) == kv_heads && t.size(2) > starts[i] + lengths[i] &&
                        t.size(3) == widths[m] && t.stride(3) == 1 && t.scalar_type() == at::kBFloat16,
                    "run: layer ", i, "'s key/value buffers [1, kv_heads, capacity > start + length, width] in bf16");
      }
      // the views begin at the first position attended to
      key_views.push_back({bf16_data(keys[i]) + starts[i] * keys[i].stride(2), keys[i].stride(1), keys[i].stride(2)});
      value_views.push_back(
          {bf16_data(values[i]) + starts[i] * values[i].stride(2), values[i].stride(1), values[i].stride(2)});
      longest = std::max(longest, lengths[i]);
      if (l.latent) {
        const LatentShape& m = l.mla.shape;
        latent_in = std::max<int64_t>(latent_in, l.mla.q_a.rows + l.mla.kv_a.rows);
        widest = std::max<int64_t>({widest, m.heads * (m.nope + m.rope), m.heads * m.v_dim, latent_in});
      } else {
        widest = std::max<int64_t>(widest, a.wq.rows + 2 * a.wk.rows);
      }
      l.moe_row = l.router.rows > 0 ? routed++ : -1;
      TORCH_CHECK(l.router.rows == 0 || !l.experts.empty(), "run: set_experts was not called for layer ", i);
      TORCH_CHECK(l.router.rows > 0 || l.shared, "run: layer ", i, " has neither a router nor an MLP");
      widest_inter = std::max<int64_t>(widest_inter, l.inter);
    }
    TORCH_CHECK(picks.scalar_type() == at::kLong && picks.is_contiguous() && picks.numel() == routed * top_k_,
                "run: picks must be a contiguous int64 [MoE layers, top_k] tensor");
    latent_in_.resize(latent_in);
    scratch_.resize(std::max<int64_t>({widest, hidden_, lm_head_.rows}));
    query_.resize(widest);
    attended_.resize(widest);
    delta_.resize(hidden_);
    int64_t widest_shared = 0;
    for (const Layer& l : layers_) widest_shared = std::max<int64_t>(widest_shared, l.shared ? l.shared_gate_proj.rows : 0);
    shared_acc_.resize(2 * widest_shared + hidden_);
    shared_act_.resize(widest_shared);
    projected_.resize(top_k_ * 2 * widest_inter);
    activation_.resize(top_k_ * widest_inter);
    expert_out_.resize(top_k_ * hidden_);
    route_.resize(top_k_);
    chosen_.resize(top_k_);
    int64_t router_width = 0;
    for (const Layer& l : layers_) router_width = std::max<int64_t>(router_width, l.router.rows);
    router_acc_.resize(router_width);
    router_probs_.resize(router_width);
    if (router_logits_.numel() != router_width) router_logits_ = at::empty({router_width}, at::kBFloat16);
    at::Tensor logits = at::empty({1, 1, lm_head_.rows}, embed_.options());
    Shared shared{token, longest, lengths.data(), picks.data_ptr<int64_t>(), rotary.cos.data(), rotary.sin.data(),
                  key_views.data(), value_views.data(), bf16_data(logits)};
    const int threads = std::max(1, at::get_num_threads());
    SpinBarrier barrier;
#pragma omp parallel num_threads(threads)
    {
      barrier.join(omp_get_num_threads());  // the team may be smaller than asked for
      step_thread(shared, barrier, omp_get_thread_num(), omp_get_num_threads());
    }
    return logits;
  }

  // Seconds spent in each part of the steps run so far (the profile of a native token, which
  // torch's profiler cannot see into), by name.
  std::map<std::string, double> phase_seconds() const {
    std::map<std::string, double> out;
    for (int p = 0; p < kPhases; ++p) out[kPhaseNames[p]] = phase_seconds_[p];
    return out;
  }

 private:
  enum Phase { kNorms, kAttention, kOutProj, kRouter, kExperts, kLmHead, kPhases };
  // attention: q/k/v projections with norms and rotary, the KV write, attention over the cache
  static constexpr const char* kPhaseNames[kPhases] = {"norms", "attention", "o_proj", "router", "experts",
                                                       "lm_head"};

  // Adds the time since the previous lap to a phase (a steady_clock read is ~20 ns).
  // Only one thread of a step keeps it (its laps include its waits at the barriers).
  struct Clock {
    Clock(std::array<double, kPhases>& totals, bool enabled)
        : totals(totals), enabled(enabled), last(std::chrono::steady_clock::now()) {}
    void lap(Phase phase) {
      if (!enabled) return;
      const auto now = std::chrono::steady_clock::now();
      totals[phase] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
    std::array<double, kPhases>& totals;
    bool enabled;
    std::chrono::steady_clock::time_point last;
  };

  // A layer's multi-head latent attention (set_latent_attention).
  struct LatentAttention {
    LatentShape shape;
    Matrix q_a, q_b, kv_a;  // q_a has no rows where q comes from q_b alone
    at::Tensor q_a_norm, kv_a_norm, up;
    float q_a_eps = 0.f, kv_a_eps = 0.f;
    bool interleaved = false;  // DeepSeek's interleaved rotary pairs
    std::vector<at::Tensor> keep;  // the projections' tensors, alive while referenced
  };

  struct Layer {
    AttentionWeights attention;
    bool latent = false;  // the attention is `mla`, not `attention`
    LatentAttention mla;
    at::Tensor input_norm, post_norm, router_tensor, wo_tensor;
    // router: no rows in a dense layer; a grouped router's only counts its experts (the weight is router_tensor)
    Matrix wo, router;
    float input_eps = 0.f, post_eps = 0.f, scale = 1.f;
    // a DeepSeek-V3-style router (set_grouped_router): router_tensor is its float32 weight
    bool grouped = false;
    at::Tensor correction;
    int64_t groups = 1, top_groups = 1;
    float routed_scale = 1.f;
    AttendExtras extras;
    at::Tensor sinks, o_bias, router_bias;  // undefined where the model has none
    GateRecipe gate;
    std::vector<ExpertWeights> experts;
    std::vector<at::Tensor> expert_tensors;
    int64_t inter = 0;
    // A shared expert beside the routed ones (Qwen2-MoE, DeepSeek), or a dense layer's MLP alone:
    // SiLU-gated gate/up [Is, H], down [H, Is], its output scaled by sigmoid(shared_gate . x) where
    // the model has that gate.
    bool shared = false;
    Matrix shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate;
    bool shared_gated = false;
    std::vector<at::Tensor> shared_tensors;
    int64_t moe_row = -1;  // its row of `picks` (-1: a dense layer), numbered by run

    int64_t rotary_dim() const { return latent ? mla.shape.rope : attention.rotary_dim; }
  };

  Layer& at_layer(int64_t layer, const char* who) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), who, ": no such layer");
    return layers_[layer];
  }

  // The router's top-k experts (into `picked`, best first) and their weights from its float32 sums
  // in router_acc_, as transformers' Qwen3 / Mixtral routers compute them: bf16 logits (the bias
  // added first), softmax in float32, top-k, optionally renormalized, optionally cast to bf16.
  // The softmax is exp_shifted's (within ~2 ulp of torch's): ATen's own kernel, called once a
  // layer between streams of weights that evict its code and tables, took microseconds on
  // every call while the other threads waited. The picks do not depend on it: distinct bf16
  // logits stay distinct after any exp this close, and equal ones stay equal.
  void route(const Layer& l, int64_t* picked, float* weights) {
    const int64_t experts = l.router.rows;
    std::vector<bf16> logits(experts);
    round_linear(router_acc_.data(), l.router_bias.defined() ? bf16_data(l.router_bias) : nullptr, experts, logits.data());
    if (softmax_of_top_) return route_softmax_of_top(logits.data(), experts, picked, weights);
    float* p = router_probs_.data();
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, p[e] = to_float(logits[e]));
    const float inverse = 1.f / exp_shifted(p, experts, top);  // times the reciprocal, as ATen's softmax
    for (int64_t e = 0; e < experts; ++e) p[e] *= inverse;
    std::vector<int64_t> order(experts);
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    // best first; ties to the lower expert id
    std::partial_sort(order.begin(), order.begin() + top_k_, order.end(),
                      [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float total = 0.f;
    for (int64_t j = 0; j < top_k_; ++j) total += (weights[j] = p[picked[j] = order[j]]);
    for (int64_t j = 0; j < top_k_; ++j) {
      if (normalize_) weights[j] /= total;
      if (cast_back_) weights[j] = round_bf16(weights[j]);
    }
  }

  // GPT-OSS's routing: torch's own top-k of the bf16 logits (its order among ties), then torch's
  // bf16 softmax over those k, as the router module calls them.
  void route_softmax_of_top(const bf16* logits, int64_t experts, int64_t* picked, float* weights) {
    at::Tensor row = router_logits_.size(0) == experts ? router_logits_ : router_logits_.narrow(0, 0, experts);
    std::memcpy(bf16_data(row), logits, experts * sizeof(bf16));
    const auto [top, index] = at::topk(row.view({1, experts}), top_k_, -1);
    const at::Tensor probs = at::_softmax(top, 1, false);
    const bf16* p = bf16_data(probs);
    const int64_t* ids = index.data_ptr<int64_t>();
    for (int64_t j = 0; j < top_k_; ++j) {
      picked[j] = ids[j];
      weights[j] = to_float(p[j]);
    }
  }

  // What one step's threads share: inputs, and where they write.
  struct Shared {
    int64_t token, longest;  // the longest of `lengths`
    const int64_t* lengths;  // per layer, the cached positions attended to besides the token's own
    int64_t* picked;
    const bf16 *cos, *sin;
    const CacheView *keys, *values;
    bf16* logits;
  };

  // One thread's part of a step. The whole token is one parallel region: every thread walks all
  // layers, takes its share of each matrix, and meets the others at spin barriers where a result
  // it needs comes from them: starting a parallel region per kernel, three per layer, cost a
  // visible share of a token. Each thread keeps its own copy of the hidden state
  // and computes the norms and residual adds itself, identically, rather than wait for one copy.
  void step_thread(const Shared& in, SpinBarrier& barrier, int tid, int team) {
    Clock clock(phase_seconds_, tid == 0);
    std::vector<bf16> x(bf16_data(embed_) + in.token * embed_.stride(0),
                        bf16_data(embed_) + in.token * embed_.stride(0) + hidden_);
    std::vector<bf16> normed(hidden_), head_scratch(hidden_);
    int64_t group = 1, group_width = hidden_;  // the most query heads sharing a kv head, and their rows
    for (const Layer& l : layers_)
      if (!l.latent) {
        const AttentionWeights& a = l.attention;
        group = std::max(group, a.wq.rows / a.wk.rows);
        group_width = std::max(group_width, a.wq.rows / (a.wk.rows / a.head_dim));
      }
    std::vector<float> scores(group * (in.longest + 1)), sums(group_width);
    std::vector<bf16> q_in(latent_in_.size());  // a latent layer's normed q_a rows
    LatentScratch latent_scratch;
    auto share = [&](int64_t n) { return thread_share(n, tid, team); };
    const bool round_once = norms_round_once_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      rms_norm_row(x.data(), bf16_data(l.input_norm), hidden_, l.input_eps, normed.data(), round_once);
      clock.lap(kNorms);
      if (l.latent)
        latent_attention_part(l, normed.data(), in, i, barrier, tid, team, q_in.data(), latent_scratch);
      else
        attention_part(l, normed.data(), in, i, barrier, tid, team, head_scratch.data(), scores.data(), sums.data());
      barrier.wait();
      clock.lap(kAttention);
      rows_of(l.wo, attended_.data(), share(hidden_), delta_.data(),
              l.o_bias.defined() ? bf16_data(l.o_bias) : nullptr);
      barrier.wait();
      add_rows(x.data(), delta_.data(), hidden_, x.data());
      clock.lap(kOutProj);
      rms_norm_row(x.data(), bf16_data(l.post_norm), hidden_, l.post_eps, normed.data(), round_once);
      clock.lap(kNorms);
      const bool routed = l.moe_row >= 0;
      int64_t* picked = in.picked + std::max<int64_t>(l.moe_row, 0) * top_k_;
      if (routed) {  // the router's rows shared out; then one thread picks from its logits
        const auto [first, last] = share(l.router.rows);
        if (l.grouped)
          grouped_logits(l, normed.data(), first, last);
        else if (first < last)
          gemv_range(l.router, normed.data(), first, last, router_acc_.data());
      }
      if (l.shared) shared_activation(l, normed.data(), share(l.shared_gate_proj.rows), tid);
      if (routed) barrier.wait();  // every logit is in
      if (routed && tid == 0) {
        if (l.grouped)
          route_grouped(l, picked, route_.data());
        else
          route(l, picked, route_.data());
        for (int64_t e = 0; e < top_k_; ++e) chosen_[e] = &l.experts[picked[e]];
      }
      barrier.wait();
      clock.lap(kRouter);
      const auto [j_first, j_last] = share(hidden_);  // the weighted sum by slices of the row
      if (routed) {
        experts_part(l.gate, normed.data(), hidden_, l.inter, chosen_.data(), top_k_, projected_.data(),
                     activation_.data(), expert_out_.data(), barrier, tid, team);
        barrier.wait();
        weighted_sum_rows(expert_out_.data(), route_.data(), top_k_, hidden_, j_first, j_last, cast_back_,
                          delta_.data());
      }
      if (l.shared) add_shared_rows(l, j_first, j_last, routed);
      barrier.wait();
      add_rows(x.data(), delta_.data(), hidden_, x.data());
      clock.lap(kExperts);
    }
    rms_norm_row(x.data(), bf16_data(final_norm_), hidden_, final_eps_, normed.data(), round_once);
    clock.lap(kNorms);
    rows_of(lm_head_, normed.data(), share(lm_head_.rows), in.logits);
    barrier.wait();
    clock.lap(kLmHead);
  }

  // This thread's part of layer i's Llama-style attention: q/k/v, the KV write, attention by heads
  // (into attended_). `head_scratch`: hidden bf16; `scores`: group x (longest + 1) floats; `sums`: hidden
  // floats or a group's rows, whichever is more.
  void attention_part(const Layer& l, const bf16* normed, const Shared& in, size_t i, SpinBarrier& barrier, int tid,
                      int team, bf16* head_scratch, float* scores, float* sums) {
    auto share = [&](int64_t n) { return thread_share(n, tid, team); };
    const AttentionWeights& a = l.attention;
    const int64_t d = a.head_dim, heads = a.wq.rows / d, kv_heads = a.wk.rows / d, group = heads / kv_heads;
    const CacheView keys = in.keys[i], values = in.values[i];
    const int64_t len = in.lengths[i] + 1;
    bf16* key_rows = const_cast<bf16*>(keys.data) + in.lengths[i] * keys.position_stride;
    bf16* value_rows = const_cast<bf16*>(values.data) + in.lengths[i] * values.position_stride;
    if (kv_heads % team == 0 && !a.full_norm) {
      // Each thread its own kv heads and the query heads sharing them: projections (one stream
      // of rows per kv head), the KV write, then attention; nothing comes from another thread.
      const auto [first, last] = share(kv_heads);
      for (int64_t g = first; g < last; ++g) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          project_head(a, 0, h, normed, in.cos, in.sin, scratch_.data() + h * d, head_scratch,
                       query_.data() + h * d);
        float* rows = scratch_.data() + (heads + g) * d;
        project_head(a, 1, g, normed, in.cos, in.sin, rows, head_scratch, key_rows + g * keys.head_stride);
        project_head(a, 2, g, normed, in.cos, in.sin, rows, head_scratch,
                     value_rows + g * values.head_stride);
      }
      for (int64_t g = first; g < last; ++g)
        attend_group(query_.data() + g * group * d, group, d, g, keys, values, len, l.scale, scores, sums,
                     attended_.data() + g * group * d, l.extras, g * group);
    } else {
      // Too few kv heads to share out: projections by heads, then attention by query heads.
      const auto [first, last] = share(heads + 2 * kv_heads);
      for (int64_t head = first; head < last; ++head) {
        const int m = head < heads ? 0 : head < heads + kv_heads ? 1 : 2;
        const int64_t h = m == 0 ? head : m == 1 ? head - heads : head - heads - kv_heads;
        bf16* out = m == 0 ? query_.data() + h * d
                    : m == 1 ? key_rows + h * keys.head_stride
                             : value_rows + h * values.head_stride;
        project_head(a, m, h, normed, in.cos, in.sin, scratch_.data() + head * d, head_scratch, out);
      }
      barrier.wait();
      if (a.full_norm) {  // OLMoE: RMSNorm over all of q and all of k, then the rotary embedding
        const float q_scale = rms_scale(query_.data(), d, heads, d, a.eps);
        const float k_scale = rms_scale(key_rows, keys.head_stride, kv_heads, d, a.eps);
        barrier.wait();  // every thread has read the rows before any is rewritten
        const auto [n_first, n_last] = share(heads + kv_heads);
        for (int64_t head = n_first; head < n_last; ++head) {
          const bool q = head < heads;
          const int64_t h = q ? head : head - heads;
          bf16* row = q ? query_.data() + h * d : key_rows + h * keys.head_stride;
          const bf16* weight = bf16_data(q ? a.q_norm : a.k_norm) + h * d;
          const float scale = q ? q_scale : k_scale;
          for (int64_t c = 0; c < d; ++c) row[c] = to_bf16(to_float(weight[c]) * round_bf16(to_float(row[c]) * scale));
          rope_head(row, in.cos, in.sin, a.rotary_dim);
        }
        barrier.wait();
      }
      const auto [q_first, q_last] = share(heads);
      for (int64_t h = q_first; h < q_last; ++h)
        attend_head(query_.data() + h * d, d, h / group, keys, values, len, l.scale, scores, sums,
                    attended_.data() + h * d, l.extras, h);
    }
  }

  // This thread's part of layer i's multi-head latent attention (into attended_): q_a's and kv_a's
  // rows shared out as one range; then q by heads, while the last thread writes the token's latent
  // and rotary key to the cache; then attention by heads. `q_in`: q_a's rows of scratch.
  void latent_attention_part(const Layer& l, const bf16* normed, const Shared& in, size_t i, SpinBarrier& barrier,
                             int tid, int team, bf16* q_in, LatentScratch& scratch) {
    const LatentAttention& m = l.mla;
    const LatentShape& s = m.shape;
    const int64_t qa = m.q_a.rows, kva = m.kv_a.rows, width = s.nope + s.rope, len = in.lengths[i] + 1;
    const CacheView latents = in.keys[i], rotary = in.values[i];
    auto rope = [&](bf16* head) {
      if (m.interleaved)
        rope_head_interleaved(head, in.cos, in.sin, s.rope);
      else
        rope_head(head, in.cos, in.sin, s.rope);
    };
    const auto [first, last] = thread_share(qa + kva, tid, team);
    if (first < std::min(last, qa)) gemv_range(m.q_a, normed, first, std::min(last, qa), scratch_.data());
    if (std::max(first, qa) < last) gemv_range(m.kv_a, normed, std::max(first, qa) - qa, last - qa, scratch_.data() + qa);
    round_linear(scratch_.data() + first, nullptr, last - first, latent_in_.data() + first);
    barrier.wait();
    const bf16* q_from = normed;
    if (qa > 0) {
      rms_norm_row(latent_in_.data(), bf16_data(m.q_a_norm), qa, m.q_a_eps, q_in);
      q_from = q_in;
    }
    const auto [h_first, h_last] = thread_share(s.heads, tid, team);
    for (int64_t h = h_first; h < h_last; ++h) {
      gemv_rows(m.q_b, q_from, h * width, (h + 1) * width, scratch_.data() + h * width);
      round_linear(scratch_.data() + h * width, nullptr, width, query_.data() + h * width);
      rope(query_.data() + h * width + s.nope);
    }
    if (tid == team - 1) {  // (the last thread's share of heads is never the larger one)
      bf16* latent_row = const_cast<bf16*>(latents.data) + in.lengths[i] * latents.position_stride;
      bf16* rotary_row = const_cast<bf16*>(rotary.data) + in.lengths[i] * rotary.position_stride;
      rms_norm_row(latent_in_.data() + qa, bf16_data(m.kv_a_norm), s.rank, m.kv_a_eps, latent_row);
      std::memcpy(rotary_row, latent_in_.data() + qa + s.rank, s.rope * sizeof(bf16));
      rope(rotary_row);
    }
    barrier.wait();
    scratch.fit(s, len);
    for (int64_t h = h_first; h < h_last; ++h)
      latent_head(bf16_data(m.up), s, h, query_.data() + h * width, query_.data() + h * width + s.nope, latents.data,
                  latents.position_stride, rotary.data, rotary.position_stride, len, l.scale, scratch,
                  attended_.data() + h * s.v_dim);
  }

  // Rows [first, last) of a grouped router's float32 logits (router_acc_): its float32 weight
  // times the bf16 row widened, as the router's F.linear of x.float().
  void grouped_logits(const Layer& l, const bf16* x, int64_t first, int64_t last) {
    const float* w = l.router_tensor.data_ptr<float>();
    for (int64_t e = first; e < last; ++e) router_acc_[e] = dot_f32_bf16(w + e * hidden_, x, hidden_);
  }

  // DeepSeek-V3's routing from the logits in router_acc_ (set_grouped_router says what it computes),
  // as its router module writes it in float32; ties go to the lower index.
  void route_grouped(const Layer& l, int64_t* picked, float* weights) {
    const int64_t experts = l.router.rows, per_group = experts / l.groups;
    std::vector<float> score(experts), choice(experts), group_score(l.groups);
    const float* correction = l.correction.data_ptr<float>();
    for (int64_t e = 0; e < experts; ++e) {
      score[e] = 1.f / (1.f + std::exp(-router_acc_[e]));
      choice[e] = score[e] + correction[e];
    }
    for (int64_t g = 0; g < l.groups; ++g) {  // a group's score: the sum of its two best choices
      const float* c = choice.data() + g * per_group;
      float best = -INFINITY, second = -INFINITY;
      for (int64_t j = 0; j < per_group; ++j) {
        if (c[j] > best) {
          second = best;
          best = c[j];
        } else if (c[j] > second) {
          second = c[j];
        }
      }
      group_score[g] = best + second;
    }
    auto better = [](const std::vector<float>& v) {
      return [&v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
    };
    std::vector<int64_t> groups(l.groups), candidates;
    for (int64_t g = 0; g < l.groups; ++g) groups[g] = g;
    std::partial_sort(groups.begin(), groups.begin() + l.top_groups, groups.end(), better(group_score));
    for (int64_t n = 0; n < l.top_groups; ++n)
      for (int64_t j = 0; j < per_group; ++j) candidates.push_back(groups[n] * per_group + j);
    std::partial_sort(candidates.begin(), candidates.begin() + top_k_, candidates.end(), better(choice));
    float total = 0.f;
    for (int64_t j = 0; j < top_k_; ++j) total += (weights[j] = score[picked[j] = candidates[j]]);
    for (int64_t j = 0; j < top_k_; ++j) {
      if (normalize_) weights[j] /= total + 1e-20f;
      weights[j] *= l.routed_scale;
    }
  }

  // This thread's rows of a shared expert's activation, SiLU(gate x) * up x, rounded as transformers
  // rounds; thread 0 also its gate's sigmoid(gate . x) (bf16).
  void shared_activation(const Layer& l, const bf16* x, std::pair<int64_t, int64_t> rows, int tid) {
    const int64_t inter = l.shared_gate_proj.rows;
    float* gate = shared_acc_.data();
    float* up = gate + inter;
    gemv_range(l.shared_gate_proj, x, rows.first, rows.second, gate);
    gemv_range(l.shared_up_proj, x, rows.first, rows.second, up);
    for (int64_t i = rows.first; i < rows.second; ++i) {
      const float g = round_bf16(gate[i]);
      shared_act_[i] = to_bf16(round_bf16(g / (1.f + std::exp(-g))) * round_bf16(up[i]));
    }
    if (tid == 0 && l.shared_gated) {
      float logit = 0.f;
      gemv_range(l.shared_gate, x, 0, 1, &logit);
      shared_scale_ = round_bf16(1.f / (1.f + std::exp(-round_bf16(logit))));
    }
  }

  // delta[j) += the shared expert's down projection (times its gate) for this thread's rows,
  // each step rounded to bf16 as transformers' ops are; where nothing was `routed` (a dense
  // layer), delta[j) = the MLP's output.
  void add_shared_rows(const Layer& l, int64_t begin, int64_t end, bool routed) {
    float* out = shared_acc_.data() + 2 * l.shared_gate_proj.rows;
    gemv_range(l.shared_down_proj, shared_act_.data(), begin, end, out);
    for (int64_t j = begin; j < end; ++j) {
      float v = round_bf16(out[j]);
      if (l.shared_gated) v = round_bf16(v * shared_scale_);
      delta_[j] = routed ? to_bf16(to_float(delta_[j]) + v) : to_bf16(v);
    }
  }

  // out[rows) = W[rows) x (+ bias, before the one rounding as F.linear adds it), rounded to bf16
  // (this thread's rows of a projection).
  void rows_of(const Matrix& w, const bf16* x, std::pair<int64_t, int64_t> rows, bf16* out,
               const bf16* bias = nullptr) {
    gemv_range(w, x, rows.first, rows.second, scratch_.data());
    round_linear(scratch_.data() + rows.first, bias == nullptr ? nullptr : bias + rows.first,
                 rows.second - rows.first, out + rows.first);
  }

  at::Tensor embed_, final_norm_, lm_head_tensor_;
  Matrix lm_head_;
  float final_eps_;
  int64_t top_k_, hidden_ = 0;
  bool normalize_, cast_back_, softmax_of_top_, norms_round_once_;
  std::vector<Layer> layers_;
  // buffers the threads share within a step (each writes its own part)
  std::vector<float> scratch_, projected_, expert_out_, route_, shared_acc_;
  std::vector<bf16> shared_act_;  // a shared expert's activation
  float shared_scale_ = 1.f;  // its gate's sigmoid this layer
  std::vector<float> router_probs_;  // the router's float32 logits, then probabilities
  at::Tensor router_logits_;  // its bf16 logits (softmax_of_top)
  std::vector<bf16> query_, attended_, delta_, activation_;
  std::vector<bf16> latent_in_;  // a latent layer's q_a and kv_a rows, rounded
  std::vector<float> router_acc_;  // the router's float32 sums (a grouped router's: its logits)
  std::vector<const ExpertWeights*> chosen_;  // this layer's picked experts, in pick order
  std::array<double, kPhases> phase_seconds_{};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Weight>(m, "Weight", "a weight matrix: bf16 (type 0) or uint8 blocks of a GGML type")
      .def(pybind11::init<at::Tensor, int32_t, int64_t>(), pybind11::arg("tensor"), pybind11::arg("type") = 0,
           pybind11::arg("cols") = 0)
      .def_readonly("type", &Weight::type)
      .def_readonly("cols", &Weight::cols);
  m.def("gemv", &gemv, "a weight matrix times one bf16 row (plus a bias), float32 sums", pybind11::arg("weight"),
        pybind11::arg("x"), pybind11::arg("bias") = pybind11::none());
  m.def("set_integer_dots", [](bool on) { integer_dots_enabled() = on; },
        "block types with an integer kernel use it (default) or the reference-exact float loops");
  m.def("dequantize", &dequantize, "a weight matrix as bf16 or float32, the reference dequantizer's values");
  m.def("bf16_dot_products", [] {
#if defined(MOESCOPE_AVX512BF16)
    return true;
#else
    return false;
#endif
  }, "whether this build multiplies bf16 tiles with the CPU's bf16 dot products (as fast as oneDNN's on many rows)");
  m.def("set_amx", [](bool on) {
#if defined(MOESCOPE_AMX)
    amx_wanted() = on;
#else
    (void)on;
#endif
  }, "a prompt's bf16 products on AMX tiles where the CPU and the OS allow (default) or on dot products");
  m.def("amx", [] { return amx_on(); }, "whether a prompt's bf16 products run on AMX tiles");
  m.def("code_path", [] {
#if defined(MOESCOPE_AVX512BF16)
    std::string path = "avx512-bf16";
#elif defined(MOESCOPE_AVX512F)
    std::string path = "avx512";
#elif defined(MOESCOPE_AVX2)
    std::string path = "avx2";
#else
    std::string path = "portable";
#endif
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    path += "-vnni";
#endif
    if (amx_on()) path += "-amx";
    return path;
  }, "which of the build flavours' code paths this build compiled (avx2, avx512-bf16-vnni, portable, ...)");
  m.def("linear_rows", &linear_rows, "bf16 rows times a weight matrix's transpose (plus a bias), as F.linear",
        pybind11::arg("weight"), pybind11::arg("x"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("int8_inputs") = false);
  m.def("rms_norm", &rms_norm, "RMSNorm of a few bf16 rows", pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("eps"), pybind11::arg("round_once") = false);
  m.def("qkv_rope", &qkv_rope, "one token's q, k, v: projections (optional biases), optional q/k norms, rotary embedding",
        pybind11::arg("x"), pybind11::arg("wq"), pybind11::arg("wk"), pybind11::arg("wv"), pybind11::arg("q_norm"),
        pybind11::arg("k_norm"), pybind11::arg("eps"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("head_dim"), pybind11::arg("biases") = std::vector<at::Tensor>());
  m.def("attend", &attend, "one query's attention over cached keys and values (optional sinks, eager roundings)",
        pybind11::arg("q"), pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("scale"),
        pybind11::arg("sinks") = pybind11::none(), pybind11::arg("eager_rounding") = false);
  m.def("latent_attend", &latent_attend, "one query's multi-head latent attention, up-projection absorbed");
  pybind11::class_<GateRecipe>(m, "GateRecipe", "how an expert's gate/up projection becomes its activation")
      .def(pybind11::init<bool, bool, double, double>(), pybind11::arg("interleaved") = false,
           pybind11::arg("clamped_swiglu") = false, pybind11::arg("alpha") = 1.0, pybind11::arg("limit") = 0.0)
      .def_readonly("interleaved", &GateRecipe::interleaved)
      .def_readonly("clamped_swiglu", &GateRecipe::clamped_swiglu);
  m.def("moe_decode", &moe_decode, "one token through k gated experts, weighted and summed", pybind11::arg("x"),
        pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("weights"),
        pybind11::arg("gate_up_bias") = std::vector<at::Tensor>(),
        pybind11::arg("down_bias") = std::vector<at::Tensor>(), pybind11::arg("transposed") = false,
        pybind11::arg("recipe") = GateRecipe());
  m.def("combine_rows", &combine_rows, "a prompt's expert outputs (rows sorted by expert) weighted and summed per token",
        pybind11::arg("y"), pybind11::arg("weights"), pybind11::arg("order"), pybind11::arg("top_k"));
  m.def("moe_prompt", &moe_prompt, "a prompt's rows, sorted by expert, through a layer's gated experts",
        pybind11::arg("x"), pybind11::arg("start"), pybind11::arg("count"), pybind11::arg("gate_up"),
        pybind11::arg("down"), pybind11::arg("gate_up_bias") = std::vector<at::Tensor>(),
        pybind11::arg("down_bias") = std::vector<at::Tensor>(), pybind11::arg("recipe") = GateRecipe(),
        pybind11::arg("int8_inputs") = false);
  pybind11::class_<DecodeStep>(m, "DecodeStep", "a whole decode step of a MoE decoder")
      .def(pybind11::init<at::Tensor, at::Tensor, double, const Weight&, int64_t, bool, bool, bool, bool>(),
           pybind11::arg("embed"), pybind11::arg("final_norm"), pybind11::arg("final_eps"), pybind11::arg("lm_head"),
           pybind11::arg("top_k"), pybind11::arg("normalize"), pybind11::arg("cast_back"),
           pybind11::arg("softmax_of_top") = false, pybind11::arg("norms_round_once") = false)
      .def("add_layer", &DecodeStep::add_layer)
      .def("set_attention", &DecodeStep::set_attention)
      .def("set_latent_attention", &DecodeStep::set_latent_attention)
      .def("set_router", &DecodeStep::set_router)
      .def("set_grouped_router", &DecodeStep::set_grouped_router)
      .def("set_experts", &DecodeStep::set_experts, pybind11::arg("layer"), pybind11::arg("gate_up"),
           pybind11::arg("down"), pybind11::arg("gate_up_bias") = std::vector<at::Tensor>(),
           pybind11::arg("down_bias") = std::vector<at::Tensor>(), pybind11::arg("transposed") = false,
           pybind11::arg("recipe") = GateRecipe())
      .def("set_attention_biases", &DecodeStep::set_attention_biases)
      .def("set_attention_extras", &DecodeStep::set_attention_extras)
      .def("set_router_bias", &DecodeStep::set_router_bias)
      .def("set_shared_expert", &DecodeStep::set_shared_expert)
      .def("run", &DecodeStep::run)
      .def("phase_seconds", &DecodeStep::phase_seconds);
}
