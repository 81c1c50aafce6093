// Decode tokens through a layer's picked experts: each gated expert's gate/up projection, its
// activation, its down projection (for one token, or for every token of a step that picked it),
// then the outputs weighted by the router and summed, rounded where transformers rounds.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
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

// The picks of one expert in a step: each pick's input, its gate/up sums [2I], activation [I] and
// down sums [H] (one pick per token that chose the expert; several tokens' in a step of several).
// Only the first `count` entries are set (made once per expert and pass: no zeroing of the rest).
constexpr int64_t kMaxPicks = 64;
struct ExpertPicks {
  std::array<const bf16*, kMaxPicks> x, activation_in;
  std::array<float*, kMaxPicks> projected, out;
  std::array<bf16*, kMaxPicks> activation;
  int64_t count = 0;

  void add(const bf16* input, float* gate_up, bf16* act, float* down) {
    x[count] = input, projected[count] = gate_up, activation[count] = act, activation_in[count] = act, out[count] = down;
    ++count;
  }
};

// Intermediate rows [begin, end) of an expert for all its picks: the gate/up rows they need (each
// weight row read once for all of them: gemv_many_into_rows), then the activation. Transposed
// matrices (x @ W) take one pick.
inline void gate_up_picks(const GateRecipe& r, const ExpertWeights& w, const ExpertPicks& p, int64_t inter,
                          int64_t begin, int64_t end) {
  if (w.transposed) {
    if (r.interleaved) {
      expert_rows(w, 0, p.x[0], 2 * begin, 2 * end, p.projected[0]);
    } else {
      expert_rows(w, 0, p.x[0], begin, end, p.projected[0]);
      expert_rows(w, 0, p.x[0], inter + begin, inter + end, p.projected[0]);
    }
  } else if (r.interleaved) {
    gemv_many_into_rows(w.gate_up, p.x.data(), p.count, 2 * begin, 2 * end, p.projected.data(), 0);
  } else {
    gemv_many_into_rows(w.gate_up, p.x.data(), p.count, begin, end, p.projected.data(), 0);
    gemv_many_into_rows(w.gate_up, p.x.data(), p.count, inter + begin, inter + end, p.projected.data(), 0);
  }
  for (int64_t c = 0; c < p.count; ++c) gate_rows(r, p.projected[c], w.gate_up_bias, inter, begin, end, p.activation[c]);
}

// The down projection's rows [begin, end) for all the expert's picks, plus its bias, kept in
// float32 (already bf16 values).
inline void down_picks(const ExpertWeights& w, const ExpertPicks& p, int64_t begin, int64_t end) {
  if (w.transposed)
    expert_rows(w, 1, p.activation_in[0], begin, end, p.out[0]);
  else
    gemv_many_into_rows(w.down, p.activation_in.data(), p.count, begin, end, p.out.data(), 0);
  if (w.down_bias != nullptr)
    for (int64_t c = 0; c < p.count; ++c)
      for (int64_t j = begin; j < end; ++j) p.out[c][j] = biased(p.out[c][j], w.down_bias, j);
}

// This thread's part of n experts (`picks_of(u)`: expert u's weights and ExpertPicks), their picks
// counted up to each in `picks_before` [n + 1]. Whole experts per thread, shared out by their picks
// (an expert's cost grows with the tokens that chose it), where they divide evenly or are many: each
// thread streams its matrices end to end, which the hardware prefetchers like best (faster than
// splitting every matrix by rows), and an expert's down projection needs only its own activation,
// so there is no barrier between the passes. Otherwise every expert's gate/up rows are split, then
// (after the barrier) its down rows.
template <class PicksOf>
inline void experts_part(const GateRecipe& r, int64_t n, const int64_t* picks_before, int64_t hidden, int64_t inter,
                         PicksOf&& picks_of, SpinBarrier& barrier, int tid, int team) {
  if (n % team == 0 || n >= 4 * team) {
    auto first_at = [&](int t) {
      const int64_t picks = picks_before[n] * t / team;
      return static_cast<int64_t>(std::lower_bound(picks_before, picks_before + n, picks) - picks_before);
    };
    const int64_t first = first_at(tid), last = first_at(tid + 1);
    for (int64_t u = first; u < last; ++u) {
      const auto [w, p] = picks_of(u);
      gate_up_picks(r, *w, p, inter, 0, inter);
    }
    for (int64_t u = first; u < last; ++u) {
      const auto [w, p] = picks_of(u);
      down_picks(*w, p, 0, hidden);
    }
    return;
  }
  const auto [begin, end] = thread_share(inter, tid, team);
  for (int64_t u = 0; u < n; ++u) {
    const auto [w, p] = picks_of(u);
    gate_up_picks(r, *w, p, inter, begin, end);
  }
  barrier.wait();
  const auto [h_begin, h_end] = thread_share(hidden, tid, team);
  for (int64_t u = 0; u < n; ++u) {
    const auto [w, p] = picks_of(u);
    down_picks(*w, p, h_begin, h_end);
  }
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
  std::vector<int64_t> picks_before(k + 1);
  for (int64_t e = 0; e <= k; ++e) picks_before[e] = e;  // one pick each
  auto picks_of = [&](int64_t e) {
    ExpertPicks p;
    p.add(x, projected.data() + e * 2 * inter, activation.data() + e * inter, outputs.data() + e * hidden);
    return std::make_pair(&picked[e], p);
  };
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads())
  {
    barrier.join(omp_get_num_threads());  // the team may be smaller than asked for
    experts_part(r, k, picks_before.data(), hidden, inter, picks_of, barrier, omp_get_thread_num(),
                 omp_get_num_threads());
  }
  weighted_sum_rows(outputs.data(), route, k, hidden, 0, hidden, round_products, out);
}

}  // namespace moescope
