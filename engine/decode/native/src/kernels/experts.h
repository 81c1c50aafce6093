// A decode token through a layer's k picked experts: each gated expert's gate/up projection, its
// activation, its down projection, then the outputs weighted by the router and summed, rounded
// where transformers rounds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../base/check.h"
#include "../base/parallel.h"
#include "../base/scalar.h"
#include "../formats/types.h"
#include "gemv.h"

namespace moescope {

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

// Checks one expert's matrices against each other and the hidden size, and fills in its
// intermediate size. `gate_up_bias`/`down_bias` (or null) are [2I] and [H].
inline ExpertWeights expert_weights(const Matrix& g, const Matrix& d, int64_t hidden, bool transposed,
                                    const bf16* gate_up_bias, const bf16* down_bias) {
  ExpertWeights out{g, d};
  out.transposed = transposed;
  if (transposed) {
    MOESCOPE_CHECK(g.type == kBF16 && d.type == kBF16, "transposed experts: bf16 matrices only");
    out.inter = d.rows;
    MOESCOPE_CHECK(g.cols == 2 * out.inter && g.rows == hidden, "gate_up: [hidden, 2 * intermediate] (transposed)");
    MOESCOPE_CHECK(d.cols == hidden, "down: [intermediate, hidden] (transposed)");
  } else {
    out.inter = d.cols;
    MOESCOPE_CHECK(g.rows == 2 * out.inter && g.cols == hidden, "gate_up: [2 * intermediate, hidden]");
    MOESCOPE_CHECK(d.rows == hidden, "down: [hidden, intermediate]");
  }
  out.gate_up_bias = gate_up_bias;
  out.down_bias = down_bias;
  return out;
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

// This thread's part of one token through k SiLU-gated experts, into `outputs` [k, hidden] (each
// expert's down projection, float32 sums). Whole experts per thread where they divide evenly:
// each thread streams its matrices end to end, which the hardware prefetchers like best (faster
// than splitting every matrix by rows), and an expert's down projection needs only its own
// activation, so there is no barrier between the passes. Otherwise every expert's gate/up rows are
// split, then (after the barrier) its down rows. Scratch: projected [k, 2I], activation [k, I].
inline void experts_part(const GateRecipe& r, const bf16* x, int64_t hidden, int64_t inter,
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
inline void moe_experts(const GateRecipe& r, const bf16* x, int64_t hidden, int64_t inter,
                 const std::vector<ExpertWeights>& picked, const float* route, bool round_products, bf16* out) {
  const int64_t k = static_cast<int64_t>(picked.size());
  std::vector<float> projected(k * 2 * inter), outputs(k * hidden);
  std::vector<bf16> activation(k * inter);
  std::vector<const ExpertWeights*> experts;
  for (const ExpertWeights& w : picked) experts.push_back(&w);
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads())
  {
    barrier.join(omp_get_num_threads());  // the team may be smaller than asked for
    experts_part(r, x, hidden, inter, experts.data(), k, projected.data(), activation.data(), outputs.data(), barrier,
                 omp_get_thread_num(), omp_get_num_threads());
  }
  weighted_sum_rows(outputs.data(), route, k, hidden, 0, hidden, round_products, out);
}

}  // namespace moescope
