// One-token (decode) kernels for bf16 weights on the CPU: matrix-vector products that stream the
// weights once at close to memory bandwidth, and a whole MoE layer's experts in two passes.
//
// Why hand-written: for one row, oneDNN re-arranges a plain bf16 weight on every call and torch's
// native kernel pays a thread-pool round trip per matrix (8 experts x 2 matrices x every layer),
// so both stream expert weights at well under the memory bandwidth on a 2-core machine.
// Arithmetic: bf16 products summed in float32 (AVX-512 BF16 dot products where the CPU has them),
// rounded to bf16 where transformers rounds (each projection's output, the activation, the
// product), so results are close to, not bit-identical with, transformers' kernels.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define MOESCOPE_AVX512BF16 1
#elif defined(__AVX512F__)
#include <immintrin.h>
#define MOESCOPE_AVX512F 1
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

// One weight row with x, length k: four independent sums so the loads stream back to back.
// (Summing 4 rows at once, to share the loads of x, streamed at ~40 GB/s where one row at a time
// reaches the ~70 GB/s a plain read gets on the same machine.)
inline float dot_row(const bf16* w, const bf16* x, int64_t k) {
#if defined(MOESCOPE_AVX512BF16)
  auto dot = [](__m512 acc, const bf16* a, const bf16* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
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
  auto widen = [](const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(widen(w + i), widen(x + i), a0);
    a1 = _mm512_fmadd_ps(widen(w + i + 16), widen(x + i + 16), a1);
  }
  float tail = 0.f;
  for (; i < k; ++i) tail += to_float(w[i]) * to_float(x[i]);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail;
#else
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += to_float(w[i]) * to_float(x[i]);
  return sum;
#endif
}

// out[n] = W[n, :] . x for rows [begin, end) of a row-major matrix with row stride `ld`.
inline void gemv_range(const bf16* weight, int64_t ld, const bf16* x, int64_t k, int64_t begin, int64_t end,
                       float* out) {
  for (int64_t n = begin; n < end; ++n) out[n] = dot_row(weight + n * ld, x, k);
}

void check_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16, name, ": a bf16 CPU tensor is needed");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a 2-D matrix with contiguous rows is needed");
}

constexpr int64_t kGrain = 64;  // rows per task: ~128 KB of weights, enough to hide a task's start

// y = W x for one row x (any leading shape of size 1), as F.linear without bias.
torch::Tensor gemv(const torch::Tensor& weight, const torch::Tensor& x) {
  check_matrix(weight, "weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.numel() == k && x.scalar_type() == torch::kBFloat16, "x: one bf16 row of the weight's width needed");
  const torch::Tensor xc = x.contiguous();
  std::vector<float> acc(n);
  const bf16* w = reinterpret_cast<const bf16*>(weight.data_ptr());
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    gemv_range(w, weight.stride(0), xv, k, begin, end, acc.data());
  });
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  torch::Tensor y = torch::empty(sizes, x.options());
  bf16* yv = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t i = 0; i < n; ++i) yv[i] = to_bf16(acc[i]);
  return y;
}

// One token through `k` experts (gate_up [2I, H] and down [H, I] each, SiLU gate) weighted by
// `weights` (float32, [k]) and summed: what a decode step's MoE block computes.
torch::Tensor moe_decode(const torch::Tensor& x, const std::vector<torch::Tensor>& gate_up,
                         const std::vector<torch::Tensor>& down, const torch::Tensor& weights) {
  const int64_t experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(down.size()) == experts, "one gate_up and one down per expert");
  TORCH_CHECK(weights.numel() == experts, "one routing weight per expert");
  const int64_t hidden = x.numel(), inter = down[0].size(1);
  for (int64_t e = 0; e < experts; ++e) {
    check_matrix(gate_up[e], "gate_up");
    check_matrix(down[e], "down");
    TORCH_CHECK(gate_up[e].size(0) == 2 * inter && gate_up[e].size(1) == hidden, "gate_up: [2 * intermediate, hidden]");
    TORCH_CHECK(down[e].size(0) == hidden && down[e].size(1) == inter, "down: [hidden, intermediate]");
  }
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor wf = weights.to(torch::kFloat32).contiguous();
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  const float* route = wf.data_ptr<float>();

  // Pass 1: gate and up rows of every expert; the gated activation, rounded as transformers does.
  std::vector<float> projected(experts * 2 * inter);
  std::vector<bf16> activation(experts * inter);
  at::parallel_for(0, inter, kGrain / 2, [&](int64_t begin, int64_t end) {
    for (int64_t e = 0; e < experts; ++e) {
      const bf16* w = reinterpret_cast<const bf16*>(gate_up[e].data_ptr());
      const int64_t ld = gate_up[e].stride(0);
      float* gate = projected.data() + e * 2 * inter;
      gemv_range(w, ld, xv, hidden, begin, end, gate);
      gemv_range(w, ld, xv, hidden, inter + begin, inter + end, gate);
      for (int64_t i = begin; i < end; ++i) {
        const float g = round_bf16(gate[i]), u = round_bf16(gate[inter + i]);
        const float silu = round_bf16(g / (1.f + std::exp(-g)));
        activation[e * inter + i] = to_bf16(silu * u);
      }
    }
  });

  // Pass 2: down rows of every expert, each output rounded, weighted and summed over experts.
  std::vector<float> summed(hidden, 0.f);
  at::parallel_for(0, hidden, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(end - begin);
    for (int64_t e = 0; e < experts; ++e) {
      const bf16* w = reinterpret_cast<const bf16*>(down[e].data_ptr());
      gemv_range(w + begin * down[e].stride(0), down[e].stride(0), activation.data() + e * inter, inter, 0,
                 end - begin, rows.data());
      for (int64_t j = begin; j < end; ++j) summed[j] += round_bf16(rows[j - begin]) * route[e];
    }
  });
  torch::Tensor y = torch::empty_like(xc);
  bf16* yv = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t j = 0; j < hidden; ++j) yv[j] = to_bf16(summed[j]);
  return y;
}

// RMSNorm over the last dimension of a few rows (a decode step's hidden state, or its heads for
// q/k norms), Llama's recipe: float32 statistics, normalized row rounded to bf16, then times the
// bf16 weight. One call instead of transformers' eight small ops.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t n = weight.numel();
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16 && n > 0 &&
                  x.size(-1) == n,
              "rms_norm: bf16 rows and a bf16 weight of their width");
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const bf16* xv = reinterpret_cast<const bf16*>(xc.data_ptr());
  const bf16* wv = reinterpret_cast<const bf16*>(wc.data_ptr());
  torch::Tensor y = torch::empty_like(xc);
  bf16* yv = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t row = 0; row < xc.numel() / n; ++row) {
    const bf16* in = xv + row * n;
    bf16* out = yv + row * n;
    float squares = 0.f;
    for (int64_t i = 0; i < n; ++i) squares += to_float(in[i]) * to_float(in[i]);
    const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(to_float(wv[i]) * round_bf16(to_float(in[i]) * scale));
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "bf16 matrix times one row, float32 sums");
  m.def("rms_norm", &rms_norm, "RMSNorm of a few bf16 rows");
  m.def("moe_decode", &moe_decode, "one token through k SiLU-gated experts, weighted and summed");
}
