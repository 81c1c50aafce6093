// A prompt's rows through a layer's resident gated experts, in one call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "../base/check.h"
#include "../base/features.h"
#include "../base/parallel.h"
#include "../base/scalar.h"
#include "../formats/types.h"
#include "../kernels/experts.h"
#include "int8.h"
#include "scratch.h"
#include "tiles.h"

namespace moescope {

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
// inputs rounded to 8 bits and multiply them in integers (prompt/int8.h).
//
// An expert with few rows (at most kFewRows, as most are in a short prompt: 16 tokens' top 8 of 64
// give about 2.5 rows an expert) takes the decode kernels' integer dots instead, its matrix read in
// place: expanding a tile costs more than it saves over so few rows. Their inputs are put in fixed
// point once a call (`x_fixed`, `act_fixed`); the sums are the decode step's, to the same reference.
constexpr int64_t kFewRows = 4;

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
  const FixedInput* x_fixed = nullptr;  // per row of x (filled for few-row experts' rows), or none
  const FixedInput* act_fixed = nullptr;  // and of the activation

  // Expert e takes the integer dots for matrix m (its few rows' inputs in fixed point).
  bool few_rows(const Matrix& m, int64_t e, const FixedInput* fixed) const {
    return fixed != nullptr && count[e] <= kFewRows && m.type != kBF16 && has_integer_dot(m.type);
  }

  // The tile's `height` rows at[] of matrix m times each of expert e's rows of `input` (or their 8-bit
  // groups where given and m is Q4_K, or AMX operands where given): emit(i, sums) with sums[r] = x_i . w_r.
  // On AMX tiles emit_block(i0, n, c) gets a block of rows instead (amx_tile_times_rows).
  template <class Emit, class EmitBlock>
  void tile(const Matrix& m, const int64_t* at, int64_t e, const PromptInput& input, const Int8Groups* groups,
            [[maybe_unused]] const AmxInput* amx_input, TileScratch& scratch, Emit&& emit,
            [[maybe_unused]] EmitBlock&& emit_block) const {
    const FixedInput* fixed = &input == &x ? x_fixed : act_fixed;
    if (few_rows(m, e, fixed)) {  // each weight row's dots with all the expert's rows (idot_rows)
      const FixedInput* inputs[kFewRows];
      float dots[kFewRows], sums[kFewRows][kMaxTile];
      for (int64_t i = 0; i < count[e]; ++i) inputs[i] = &fixed[start[e] + i];
      for (int64_t j = 0; j < height; ++j) {
        idot_rows(m, at[j], inputs, count[e], dots);
        for (int64_t i = 0; i < count[e]; ++i) sums[i][j] = dots[i];
      }
      for (int64_t i = 0; i < count[e]; ++i) emit(i, sums[i]);
      return;
    }
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
inline std::unique_ptr<Int8Groups> int8_groups(bool asked, const std::vector<ExpertWeights>& experts, bool down,
                                        const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                                        int64_t k) {
  const bool q4k = std::any_of(experts.begin(), experts.end(),
                               [&](const ExpertWeights& w) { return (down ? w.down : w.gate_up).type == kQ4_K; });
  return asked && q4k && k % 256 == 0 ? std::make_unique<Int8Groups>(start, count, k) : nullptr;
}

inline void moe_prompt(const bf16* x, int64_t rows, int64_t hidden, const std::vector<int64_t>& start,
                       const std::vector<int64_t>& count, const std::vector<ExpertWeights>& experts,
                       const GateRecipe& recipe, bool int8_inputs, bf16* y) {
  MOESCOPE_CHECK(!experts.empty() && start.size() == experts.size() && count.size() == experts.size(),
                 "one row range per expert");
  for (size_t e = 0; e < experts.size(); ++e) {
    MOESCOPE_CHECK(start[e] >= 0 && count[e] >= 0 && start[e] + count[e] <= rows, "expert ", e, "'s rows are not in x");
    MOESCOPE_CHECK(experts[e].inter == experts[0].inter && !experts[e].transposed,
                   "every expert of one intermediate size, not transposed");
  }
  const int64_t inter = experts[0].inter;
  std::vector<bf16> activation(rows * inter);
  const std::unique_ptr<Int8Groups> x8 = int8_groups(int8_inputs, experts, false, start, count, hidden);
  const std::unique_ptr<Int8Groups> act8 = int8_groups(int8_inputs, experts, true, start, count, inter);
  // The 8-bit path is asked for Q4_K matrices only; with it the others keep the dot products' tiles.
  // Where it applies to none of the layer's matrices, the switch changes nothing: the AMX tiles stay.
  [[maybe_unused]] const bool amx = amx_on() && x8 == nullptr && act8 == nullptr && hidden % 32 == 0 && inter % 32 == 0;
  // every expert's matrix a type with integer tiles, and the inputs not rounded to 8 bits for them
  // (those go to Q4_K matrices alone): the inputs in fixed point for arch/x86/prompt_fixed.h
  auto all_fixed = [&](bool down, const Int8Groups* groups) {
    return groups == nullptr && std::all_of(experts.begin(), experts.end(), [&](const ExpertWeights& w) {
      return has_fixed_tiles((down ? w.down : w.gate_up).type);
    });
  };
  PromptInput in(x, hidden, start, count, all_fixed(false, x8.get())),
      act(activation.data(), inter, start, count, all_fixed(true, act8.get()));
  PromptExperts work{recipe, experts, start, count, in, hidden, inter, act, activation.data(), y,
                     x8.get(), act8.get()};
  // the few-row experts' inputs in fixed point, where their integer dots apply (not beside the
  // opt-in 8-bit inputs or the AMX tiles, which take every expert)
  std::vector<int64_t> few;  // the rows of x that few-row experts multiply
  if (x8 == nullptr && act8 == nullptr && !amx && integer_dots_enabled())
    for (size_t e = 0; e < experts.size(); ++e)
      if (count[e] <= kFewRows && (has_integer_dot(experts[e].gate_up.type) || has_integer_dot(experts[e].down.type)))
        for (int64_t i = 0; i < count[e]; ++i) few.push_back(start[e] + i);
  std::vector<FixedInput> x_fixed(few.empty() ? 0 : rows), act_fixed(few.empty() ? 0 : rows);
  if (!few.empty()) work.x_fixed = x_fixed.data(), work.act_fixed = act_fixed.data();
#if defined(MOESCOPE_AMX)
  std::unique_ptr<AmxInput> x_amx, act_amx;
  if (amx) {
    x_amx = std::make_unique<AmxInput>(x, hidden, start, count);
    act_amx = std::make_unique<AmxInput>(activation.data(), inter, start, count);
    work.x_amx = x_amx.get(), work.act_amx = act_amx.get(), work.height = kAmxRows;
  }
#endif
  const TileList gate_tiles(count, inter, work.height / 2), down_tiles(count, hidden, work.height);
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads())
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
    auto fill_fixed = [&](std::vector<FixedInput>& fixed, const bf16* rows_of, int64_t width) {
      if (few.empty()) return;
      const auto [first, last] = thread_share(static_cast<int64_t>(few.size()), tid, team);
      for (int64_t f = first; f < last; ++f) fixed[few[f]].prepare(rows_of + few[f] * width, width);
      barrier.wait();
    };
    fill_fixed(x_fixed, x, hidden);
    fill_share(x8.get(), in, false);
    const auto [g_first, g_last] = gate_tiles.share(tid, team);
    for (int64_t t = g_first; t < g_last; ++t)
      work.gate_up_tile(gate_tiles.tiles[t].first, gate_tiles.tiles[t].second, scratch);
    barrier.wait();  // every expert's activation rows are complete
    fill_fixed(act_fixed, activation.data(), inter);
    fill_share(act8.get(), act, true);
    const auto [d_first, d_last] = down_tiles.share(tid, team);
    for (int64_t t = d_first; t < d_last; ++t)
      work.down_tile(down_tiles.tiles[t].first, down_tiles.tiles[t].second, scratch);
#if defined(MOESCOPE_AMX)
    if (amx) _tile_release();  // a thread holding tile state costs every context switch 8 KB more
#endif
  }
}

}  // namespace moescope
