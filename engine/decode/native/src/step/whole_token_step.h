// The whole-token step: a decode token of a Llama-style MoE decoder (Qwen3-MoE, Mixtral, OLMoE,
// gpt-oss, DeepSeek-V3, GLM-4.5...) in one call, for when every expert it may pick is resident: per
// layer RMSNorm, attention (q/k/v + rotary, the KV cache, o_proj), residual, RMSNorm, router, the
// picked experts, residual; then the final norm and lm_head. The same kernels, in the same order,
// as the per-module fast path; what it saves is the Python and small torch ops between them, and
// (one parallel region for the whole token, spin barriers inside) the start of a region per kernel.
// The caller does the expert cache's bookkeeping afterwards from the picks it returns.
//
// Several replies' tokens run as one step (`rows` of them, each with its own KV cache and position):
// every weight is read from memory once for all of them (kernels/gemv.h's gemv_many_into_rows), and
// a layer's experts are the union of their picks, each loaded once for the rows that chose it. Each
// row's sums are the one-row step's, so every reply's logits are the ones it gets alone.
//
// Setting up (the setters) checks every shape; the memory stays the caller's, who keeps it alive
// while the step refers to it. run() checks its own arguments before its parallel region.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../attention/latent.h"
#include "../attention/qkv.h"
#include "../attention/single.h"
#include "../base/parallel.h"
#include "../include/moescope_kernels.h"
#include "../base/scalar.h"
#include "../formats/types.h"
#include "../kernels/experts.h"

namespace moescope {

// One layer's KV cache buffer [1, heads, capacity, width] (for latent attention: latents
// [1, 1, capacity, rank] as keys and rotary keys [1, 1, capacity, rope] as values), in elements:
// the ABI's own struct, so a token's buffers pass through unconverted.
using KvBuffer = ms_kv;

class WholeTokenStep {
 public:
  enum Phase { kNorms, kAttention, kOutProj, kRouter, kExperts, kLmHead, kPhases };
  // attention: q/k/v projections with norms and rotary, the KV write, attention over the cache
  static constexpr const char* kPhaseNames[kPhases] = {"norms", "attention", "o_proj", "router", "experts", "lm_head"};
  // tokens of one step: replies decoding together, and short prompts' tokens beside them
  static constexpr int64_t kMaxRows = 64;

  // `embed`: the embedding [vocab, hidden]; `softmax_of_top`: the routers take the top k of their
  // (biased) logits, then a softmax over those k in bf16 (GPT-OSS), instead of a float32 softmax
  // over all experts, then the top k. `norms_round_once`: the RMSNorms multiply by their weight in
  // float32 and round once (GPT-OSS).
  WholeTokenStep(const Matrix& embed, const Vector& final_norm, double final_eps, const Matrix& lm_head, int64_t top_k,
                 bool normalize, bool cast_back, bool softmax_of_top, bool norms_round_once);

  // A decoder layer: its norms and o_proj; its attention comes with set_attention or
  // set_latent_attention, its router with set_router or set_grouped_router (none: a dense MLP,
  // given as a shared expert alone), its experts with set_experts.
  void add_layer(const Vector& input_norm, double input_eps, const Matrix& wo, const Vector& post_norm, double post_eps);

  // `layer`'s Llama-style attention: q/k/v projections, optional per-head (or whole) q/k norms, the
  // rotary embedding over the first `rotary_dim` values of each head (all of it but in GLM-4-MoE).
  void set_attention(int64_t layer, const Matrix& wq, const Matrix& wk, const Matrix& wv, const Vector& q_norm,
                     const Vector& k_norm, double qk_eps, int64_t head_dim, double scale, int64_t rotary_dim);

  // `layer`'s multi-head latent attention (DeepSeek-V3): q from q_b(RMSNorm(q_a x)) (or q_b x alone
  // where the model has no q LoRA: q_a has no rows), the latent and rotary key from kv_a x, the
  // cache holding latents [rank] as keys and rotary keys [rope] as values; kv_b_proj (`up`, a bf16
  // [heads * (nope + v), rank] matrix) absorbed.
  void set_latent_attention(int64_t layer, const Matrix& q_a, const Vector& q_a_norm, double q_a_eps, const Matrix& q_b,
                            const Matrix& kv_a, const Vector& kv_a_norm, double kv_a_eps, const Matrix& up,
                            int64_t heads, int64_t nope, int64_t rope, int64_t v_dim, double scale, bool interleaved);

  // `layer`'s top-k router [experts, hidden] in bf16, scored as the constructor's recipe says.
  void set_router(int64_t layer, const Matrix& router);

  // `layer`'s DeepSeek-V3-style router: float32 logits (`weight` [experts, hidden] float32),
  // sigmoid scores, plus `correction` (float32 [experts]) to choose with; the best `top_groups` of
  // `groups` equal groups of experts (a group scored by its two best), the top k within them,
  // weighted by their scores (renormalised where the constructor says), times `routed_scale`.
  void set_grouped_router(int64_t layer, const float* weight, int64_t experts, int64_t hidden, const float* correction,
                          int64_t groups, int64_t top_groups, double routed_scale);

  // Every expert of `layer`, by expert id (they move when the cache re-plans its slots), checked,
  // and how they are gated.
  void set_experts(int64_t layer, std::vector<ExpertWeights> experts, const GateRecipe& recipe);

  // The q/k/v projections' biases of `layer` (each [rows of its projection]).
  void set_attention_biases(int64_t layer, const Vector& q, const Vector& k, const Vector& v);

  // What `layer`'s attention adds to Llama's (GPT-OSS): a sink logit per query head, an eager
  // attention function's roundings (AttendExtras), and o_proj's bias.
  void set_attention_extras(int64_t layer, const Vector& sinks, bool eager_rounding, const Vector& o_bias);

  // `layer`'s router bias [experts], added to its logits before their rounding (GPT-OSS).
  void set_router_bias(int64_t layer, const Vector& bias);

  // A shared expert beside `layer`'s routed experts, optionally gated by sigmoid(gate . x).
  void set_shared_expert(int64_t layer, const Matrix& gate_proj, const Matrix& up_proj, const Matrix& down_proj,
                         const Vector& gate);

  // `rows` tokens (one to kMaxRows): each reply's next token, or a short prompt's tokens as rows
  // sharing its cache. keys/values/starts/lengths: [rows, layers], row r's layer i cache buffer, whose
  // positions [starts, starts + lengths) are the ones the token attends to besides itself (all cached
  // positions, or a sliding window's); its key and value are written right behind them. Every row
  // writes its key and value before any row attends, so a prompt's row attends to the rows before it.
  // cos/sin: [rows, n], each token's rotary row for its position. picks: [rows, MoE layers, top_k],
  // filled with each MoE layer's experts in order of id. logits: [k, vocab] in bf16, the last k rows'
  // (every reply's token, each prompt's last position: the caller orders the rows so). Transposed
  // experts (GPT-OSS) run one row at a time.
  void run(int64_t rows, const int64_t* tokens, const Vector& cos, const Vector& sin, const KvBuffer* keys,
           const KvBuffer* values, const int64_t* starts, const int64_t* lengths, int64_t layers, int64_t* picks,
           int64_t picks_len, bf16* logits, int64_t logits_len);

  // Seconds spent in each part of the steps run so far (the profile of a native token, which
  // torch's profiler cannot see into), in kPhaseNames' order.
  const std::array<double, kPhases>& phase_seconds() const { return phase_seconds_; }

  int64_t layer_count() const { return static_cast<int64_t>(layers_.size()); }
  int64_t moe_layer_count() const;

 private:
  // Adds the time since the previous lap to a phase (a steady_clock read is small beside a phase).
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
    Matrix q_a, q_b, kv_a, up;  // q_a has no rows where q comes from q_b alone
    const bf16* q_a_norm = nullptr;
    const bf16* kv_a_norm = nullptr;
    float q_a_eps = 0.f, kv_a_eps = 0.f;
    bool interleaved = false;  // DeepSeek's interleaved rotary pairs
  };

  struct Layer {
    AttentionWeights attention;
    bool latent = false;  // the attention is `mla`, not `attention`
    LatentAttention mla;
    const bf16* input_norm = nullptr;
    const bf16* post_norm = nullptr;
    // router: no rows in a dense layer; a grouped router's only counts its experts (its weight is grouped_weight)
    Matrix wo, router;
    float input_eps = 0.f, post_eps = 0.f, scale = 1.f;
    // a DeepSeek-V3-style router (set_grouped_router)
    bool grouped = false;
    const float* grouped_weight = nullptr;
    const float* correction = nullptr;
    int64_t groups = 1, top_groups = 1;
    float routed_scale = 1.f;
    AttendExtras extras;
    const bf16* o_bias = nullptr;       // none where the model has none
    const bf16* router_bias = nullptr;
    GateRecipe gate;
    std::vector<ExpertWeights> experts;
    int64_t inter = 0;
    // A shared expert beside the routed ones (Qwen2-MoE, DeepSeek), or a dense layer's MLP alone:
    // SiLU-gated gate/up [Is, H], down [H, Is], its output scaled by sigmoid(shared_gate . x) where
    // the model has that gate.
    bool shared = false;
    Matrix shared_gate_proj, shared_up_proj, shared_down_proj, shared_gate;
    bool shared_gated = false;
    int64_t moe_row = -1;  // its row of `picks` (-1: a dense layer), numbered by run

    int64_t rotary_dim() const { return latent ? mla.shape.rope : attention.rotary_dim; }
  };

  // What one step's threads share: inputs, and where they write; per row r and layer i.
  struct Shared {
    int64_t rows, layers, longest;  // the longest of `lengths`
    const int64_t* tokens;
    const int64_t* lengths;  // [rows, layers]: the cached positions attended to besides the token's own
    int64_t* picked;  // [rows, MoE layers, top_k]
    int64_t picked_stride;
    const bf16 *cos, *sin;  // [rows, rotary]
    int64_t rotary;
    const CacheView *keys, *values;  // [rows, layers]
    bf16* logits;  // [logit_rows, vocab]: every row's, or the last row's
    int64_t logit_rows;

    int64_t length(int64_t r, size_t i) const { return lengths[r * layers + i]; }
    const CacheView& key(int64_t r, size_t i) const { return keys[r * layers + i]; }
    const CacheView& value(int64_t r, size_t i) const { return values[r * layers + i]; }
    const bf16* cos_of(int64_t r) const { return cos + r * rotary; }
    const bf16* sin_of(int64_t r) const { return sin + r * rotary; }
  };

  // Pointers to `rows` rows of a buffer, `stride` apart (the inputs or outputs of gemv_many_into_rows).
  template <class T>
  struct Rows {
    std::array<T*, kMaxRows> at{};
    Rows(T* base, int64_t stride, int64_t rows) {
      for (int64_t r = 0; r < rows; ++r) at[r] = base + r * stride;
    }
    T* const* data() const { return at.data(); }
  };

  Layer& at_layer(int64_t layer, const char* who);
  void size_buffers(int64_t rows, int64_t widest, int64_t widest_inter, int64_t latent_in);
  void route(const Layer& l, const float* acc, int64_t* picked, float* weights);
  void route_softmax_of_top(const bf16* logits, int64_t experts, int64_t* picked, float* weights) const;
  void route_grouped(const Layer& l, const float* acc, int64_t* picked, float* weights);
  void grouped_logits(const Layer& l, const bf16* x, int64_t rows, int64_t first, int64_t last);
  void gather_union(const Layer& l, const int64_t* picked, int64_t rows, int64_t picked_stride);
  void step_thread(const Shared& in, SpinBarrier& barrier, int tid, int team);
  void attention_part(const Layer& l, const bf16* normed, const Shared& in, size_t i, SpinBarrier& barrier, int tid,
                      int team, bf16* head_scratch, float* scores, float* sums);
  void latent_attention_part(const Layer& l, const bf16* normed, const Shared& in, size_t i, SpinBarrier& barrier,
                             int tid, int team, bf16* q_in, LatentScratch& scratch);
  void experts_of_rows(const Layer& l, const bf16* normed, SpinBarrier& barrier, int tid, int team);
  void shared_activation(const Layer& l, const bf16* x, int64_t rows, std::pair<int64_t, int64_t> range, int tid);
  void add_shared_rows(const Layer& l, int64_t rows, int64_t begin, int64_t end, bool routed);
  void rows_of(const Matrix& w, const bf16* x, int64_t x_stride, int64_t rows, std::pair<int64_t, int64_t> range,
               bf16* out, int64_t out_stride, const bf16* bias = nullptr);

  Matrix embed_;
  const bf16* final_norm_ = nullptr;
  Matrix lm_head_;
  float final_eps_;
  int64_t top_k_, hidden_ = 0;
  bool normalize_, cast_back_, softmax_of_top_, norms_round_once_;
  std::vector<Layer> layers_;
  // buffers the threads share within a step (each writes its own part), one row per token: a
  // buffer `b_` holds [rows, b_stride_] (the experts' per pick: [rows * top_k, ...])
  std::vector<float> scratch_, projected_, expert_out_, route_, shared_acc_;
  int64_t scratch_stride_ = 0, widest_ = 0, latent_stride_ = 0, router_stride_ = 0, shared_stride_ = 0;
  int64_t shared_inter_ = 0;  // the widest shared expert (shared_act_'s row)
  std::vector<bf16> shared_act_;  // a shared expert's activation
  std::vector<float> shared_scale_;  // its gate's sigmoid this layer, per row
  std::vector<float> router_probs_;  // the router's float32 logits, then probabilities (one row at a time)
  std::vector<bf16> query_, attended_, delta_, activation_;
  std::vector<bf16> latent_in_;  // a latent layer's q_a and kv_a rows, rounded
  std::vector<float> router_acc_;  // the router's float32 sums (a grouped router's: its logits)
  // this layer's experts, the union of the rows' picks in order of first pick; expert u's picks
  // (row * top_k + j) are users_[user_begin_[u], user_begin_[u + 1])
  std::vector<const ExpertWeights*> union_;
  std::vector<int64_t> users_, user_begin_;
  std::array<double, kPhases> phase_seconds_{};
};

}  // namespace moescope
