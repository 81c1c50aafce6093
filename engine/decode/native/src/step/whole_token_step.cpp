// The whole-token step (whole_token_step.h): its setters, run, and each thread's part of a token.
#include "whole_token_step.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "../attention/attend.h"
#include "../attention/norms.h"
#include "../base/check.h"
#include "../kernels/gemv.h"

namespace moescope {

namespace {

void check_bf16_matrix(const Matrix& m, const char* name) {
  MOESCOPE_CHECK(m.type == kBF16 && m.data != nullptr && m.rows > 0 && m.row_bytes >= 2 * m.cols, name,
                 ": a bf16 matrix with contiguous rows is needed");
}

}  // namespace

WholeTokenStep::WholeTokenStep(const Matrix& embed, const Vector& final_norm, double final_eps, const Matrix& lm_head,
                               int64_t top_k, bool normalize, bool cast_back, bool softmax_of_top, bool norms_round_once)
    : embed_(embed), lm_head_(lm_head), final_eps_(static_cast<float>(final_eps)), top_k_(top_k),
      normalize_(normalize), cast_back_(cast_back), softmax_of_top_(softmax_of_top),
      norms_round_once_(norms_round_once) {
  check_bf16_matrix(embed_, "embed_tokens");
  hidden_ = embed_.cols;
  final_norm_ = checked(final_norm, hidden_, "norm");
  MOESCOPE_CHECK(final_norm_ != nullptr, "norm: the final norm's weight is needed");
  MOESCOPE_CHECK(lm_head_.cols == hidden_ && top_k_ > 0, "lm_head: [vocab, hidden]; top_k > 0");
}

WholeTokenStep::Layer& WholeTokenStep::at_layer(int64_t layer, const char* who) {
  MOESCOPE_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), who, ": no such layer");
  return layers_[layer];
}

int64_t WholeTokenStep::moe_layer_count() const {
  return std::count_if(layers_.begin(), layers_.end(), [](const Layer& l) { return l.router.rows > 0; });
}

void WholeTokenStep::add_layer(const Vector& input_norm, double input_eps, const Matrix& wo, const Vector& post_norm,
                               double post_eps) {
  Layer layer;
  layer.input_norm = checked(input_norm, hidden_, "input_layernorm");
  layer.post_norm = checked(post_norm, hidden_, "post_attention_layernorm");
  MOESCOPE_CHECK(layer.input_norm != nullptr && layer.post_norm != nullptr, "a layer's two norms are needed");
  layer.wo = wo;
  MOESCOPE_CHECK(layer.wo.rows == hidden_, "o_proj: [hidden, heads * head_dim]");
  layer.input_eps = static_cast<float>(input_eps);
  layer.post_eps = static_cast<float>(post_eps);
  layers_.push_back(std::move(layer));
}

void WholeTokenStep::set_attention(int64_t layer, const Matrix& wq, const Matrix& wk, const Matrix& wv,
                                   const Vector& q_norm, const Vector& k_norm, double qk_eps, int64_t head_dim,
                                   double scale, int64_t rotary_dim) {
  Layer& l = at_layer(layer, "set_attention");
  l.attention = attention_weights(wq, wk, wv, q_norm, k_norm, qk_eps, head_dim, hidden_);
  MOESCOPE_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
                 "set_attention: an even rotary size of at most the head size");
  l.attention.rotary_dim = rotary_dim;
  MOESCOPE_CHECK(l.wo.cols == l.attention.wq.rows, "o_proj: [hidden, heads * head_dim]");
  l.scale = static_cast<float>(scale);
  l.latent = false;
}

void WholeTokenStep::set_latent_attention(int64_t layer, const Matrix& q_a, const Vector& q_a_norm, double q_a_eps,
                                          const Matrix& q_b, const Matrix& kv_a, const Vector& kv_a_norm,
                                          double kv_a_eps, const Matrix& up, int64_t heads, int64_t nope, int64_t rope,
                                          int64_t v_dim, double scale, bool interleaved) {
  Layer& l = at_layer(layer, "set_latent_attention");
  LatentAttention& m = l.mla;
  m.shape = LatentShape{heads, nope, rope, v_dim, kv_a_norm.len};
  const bool lora = q_a.rows > 0;
  MOESCOPE_CHECK(lora == (q_a_norm.data != nullptr), "set_latent_attention: q_a_proj and its norm, or neither");
  m.q_a = q_a;
  if (lora) {
    m.q_a_norm = checked(q_a_norm, m.q_a.rows, "q_a_layernorm");
    MOESCOPE_CHECK(m.q_a.cols == hidden_, "q_a_proj: [q_lora_rank, hidden]");
  }
  m.q_b = q_b;
  m.kv_a = kv_a;
  m.kv_a_norm = checked(kv_a_norm, m.shape.rank, "kv_a_layernorm");
  check_bf16_matrix(up, "kv_b_proj");
  MOESCOPE_CHECK(heads > 0 && rope > 0 && rope % 2 == 0 && m.q_b.rows == heads * (nope + rope) &&
                     m.q_b.cols == (lora ? m.q_a.rows : hidden_),
                 "q_b_proj: [heads * (nope + rope), q_lora_rank or hidden]");
  MOESCOPE_CHECK(m.kv_a.rows == m.shape.rank + rope && m.kv_a.cols == hidden_, "kv_a_proj_with_mqa: [rank + rope, hidden]");
  MOESCOPE_CHECK(up.row_bytes == 2 * up.cols && up.rows == heads * (nope + v_dim) && up.cols == m.shape.rank,
                 "kv_b_proj: a contiguous [heads * (nope + v), rank] matrix");
  MOESCOPE_CHECK(l.wo.cols == heads * v_dim, "o_proj: [hidden, heads * v_head_dim]");
  m.up = up;
  m.q_a_eps = static_cast<float>(q_a_eps);
  m.kv_a_eps = static_cast<float>(kv_a_eps);
  m.interleaved = interleaved;
  l.scale = static_cast<float>(scale);
  l.latent = true;
}

void WholeTokenStep::set_router(int64_t layer, const Matrix& router) {
  Layer& l = at_layer(layer, "set_router");
  check_bf16_matrix(router, "router");
  MOESCOPE_CHECK(router.cols == hidden_ && router.rows >= top_k_, "router: [experts >= top_k, hidden]");
  l.router = router;
  l.grouped = false;
}

void WholeTokenStep::set_grouped_router(int64_t layer, const float* weight, int64_t experts, int64_t hidden,
                                        const float* correction, int64_t groups, int64_t top_groups, double routed_scale) {
  Layer& l = at_layer(layer, "set_grouped_router");
  MOESCOPE_CHECK(weight != nullptr && hidden == hidden_ && experts >= top_k_,
                 "grouped router: a contiguous float32 [experts >= top_k, hidden] weight");
  MOESCOPE_CHECK(correction != nullptr, "grouped router: a float32 correction bias per expert");
  MOESCOPE_CHECK(groups > 0 && experts % groups == 0 && experts / groups >= 2 && top_groups > 0 &&
                     top_groups <= groups && top_groups * (experts / groups) >= top_k_,
                 "grouped router: groups of at least two experts, enough of them for the top k");
  l.grouped_weight = weight;
  l.correction = correction;
  l.router = Matrix();
  l.router.rows = experts;
  l.router.cols = hidden_;
  l.groups = groups;
  l.top_groups = top_groups;
  l.routed_scale = static_cast<float>(routed_scale);
  l.grouped = true;
}

void WholeTokenStep::set_experts(int64_t layer, std::vector<ExpertWeights> experts, const GateRecipe& recipe) {
  Layer& l = at_layer(layer, "set_experts");
  MOESCOPE_CHECK(static_cast<int64_t>(experts.size()) == l.router.rows,
                 "set_experts: one gate_up and one down for every expert the router scores");
  for (const ExpertWeights& e : experts)
    MOESCOPE_CHECK(e.inter == experts[0].inter && e.gate_up.cols == (e.transposed ? 2 * e.inter : hidden_) &&
                       e.transposed == experts[0].transposed,
                   "set_experts: every expert of one intermediate size and layout, over the hidden size");
  l.experts = std::move(experts);
  l.gate = recipe;
  l.inter = l.experts[0].inter;
}

void WholeTokenStep::set_attention_biases(int64_t layer, const Vector& q, const Vector& k, const Vector& v) {
  at_layer(layer, "set_attention_biases").attention.set_biases(q, k, v);
}

void WholeTokenStep::set_attention_extras(int64_t layer, const Vector& sinks, bool eager_rounding, const Vector& o_bias) {
  Layer& l = at_layer(layer, "set_attention_extras");
  l.extras.eager_rounding = eager_rounding;
  l.extras.sinks = checked(sinks, l.attention.head_dim > 0 ? l.attention.wq.rows / l.attention.head_dim : 0, "sinks");
  l.o_bias = checked(o_bias, hidden_, "o_proj bias");
}

void WholeTokenStep::set_router_bias(int64_t layer, const Vector& bias) {
  Layer& l = at_layer(layer, "set_router_bias");
  l.router_bias = checked(bias, l.router.rows, "router bias");
}

void WholeTokenStep::set_shared_expert(int64_t layer, const Matrix& gate_proj, const Matrix& up_proj,
                                       const Matrix& down_proj, const Vector& gate) {
  Layer& l = at_layer(layer, "set_shared_expert");
  l.shared_gate_proj = gate_proj;
  l.shared_up_proj = up_proj;
  l.shared_down_proj = down_proj;
  const int64_t inter = l.shared_gate_proj.rows;
  MOESCOPE_CHECK(l.shared_gate_proj.cols == hidden_ && l.shared_up_proj.cols == hidden_ &&
                     l.shared_up_proj.rows == inter && l.shared_down_proj.rows == hidden_ &&
                     l.shared_down_proj.cols == inter,
                 "shared expert: gate/up [I, hidden] and down [hidden, I]");
  l.shared_gated = gate.data != nullptr;
  if (l.shared_gated) {
    checked(gate, hidden_, "shared_expert_gate");
    l.shared_gate = Matrix{reinterpret_cast<const uint8_t*>(gate.data), kBF16, 1, hidden_, 2 * hidden_};
  }
  l.shared = true;
}

void WholeTokenStep::size_buffers(int64_t rows, int64_t widest, int64_t widest_inter, int64_t latent_in) {
  widest_ = widest;
  latent_stride_ = latent_in;
  latent_in_.resize(rows * latent_in);
  scratch_stride_ = std::max<int64_t>({widest, hidden_, lm_head_.rows});
  scratch_.resize(rows * scratch_stride_);
  query_.resize(rows * widest);
  attended_.resize(rows * widest);
  delta_.resize(rows * hidden_);
  shared_inter_ = 0;
  for (const Layer& l : layers_) shared_inter_ = std::max<int64_t>(shared_inter_, l.shared ? l.shared_gate_proj.rows : 0);
  shared_stride_ = 2 * shared_inter_ + hidden_;
  shared_acc_.resize(rows * shared_stride_);
  shared_act_.resize(rows * shared_inter_);
  shared_scale_.assign(rows, 1.f);
  projected_.resize(rows * top_k_ * 2 * widest_inter);
  activation_.resize(rows * top_k_ * widest_inter);
  expert_out_.resize(rows * top_k_ * hidden_);
  route_.resize(rows * top_k_);
  router_stride_ = 0;
  for (const Layer& l : layers_) router_stride_ = std::max<int64_t>(router_stride_, l.router.rows);
  router_acc_.resize(rows * router_stride_);
  router_probs_.resize(router_stride_);
}

void WholeTokenStep::run(int64_t rows, const int64_t* tokens, const Vector& cos, const Vector& sin,
                         const KvBuffer* keys, const KvBuffer* values, const int64_t* starts, const int64_t* lengths,
                         int64_t layers, int64_t* picks, int64_t picks_len, bf16* logits, int64_t logits_len) {
  MOESCOPE_CHECK(rows >= 1 && rows <= kMaxRows && tokens != nullptr, "run: 1 to ", kMaxRows, " tokens");
  for (int64_t r = 0; r < rows; ++r)
    MOESCOPE_CHECK(tokens[r] >= 0 && tokens[r] < embed_.rows, "run: token id outside the vocabulary");
  MOESCOPE_CHECK(layers == static_cast<int64_t>(layers_.size()),
                 "run: one key and one value buffer, start and length per layer");
  // Every check before the parallel region: nothing may throw inside it.
  std::vector<CacheView> key_views, value_views;
  int64_t widest = 0, widest_inter = 0, longest = 0, routed = 0, latent_in = 0;
  bool transposed = false;
  MOESCOPE_CHECK(layers > 0, "run: add_layer was not called");
  const int64_t rotary_dim = layers_[0].rotary_dim();
  MOESCOPE_CHECK(cos.len == sin.len && cos.data != nullptr && sin.data != nullptr && cos.len % rows == 0,
                 "run: one cos and one sin row per token");
  std::vector<bf16> cos_rows, sin_rows;  // each token's rotary row, [rows, rotary_dim]
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = cos.len / rows;
    const RotaryRows rotary(cos.data + r * n, sin.data + r * n, n, rotary_dim, "run");
    cos_rows.insert(cos_rows.end(), rotary.cos.begin(), rotary.cos.end());
    sin_rows.insert(sin_rows.end(), rotary.sin.begin(), rotary.sin.end());
  }
  for (int64_t i = 0; i < layers; ++i) {
    Layer& l = layers_[i];
    MOESCOPE_CHECK(l.rotary_dim() > 0, "run: layer ", i, " has no attention (set_attention or set_latent_attention)");
    MOESCOPE_CHECK(l.rotary_dim() == rotary_dim, "run: every layer of one rotary size");
    if (l.latent) {
      const LatentShape& s = l.mla.shape;
      latent_in = std::max<int64_t>(latent_in, l.mla.q_a.rows + l.mla.kv_a.rows);
      widest = std::max<int64_t>({widest, s.heads * (s.nope + s.rope), s.heads * s.v_dim, latent_in});
    } else {
      widest = std::max<int64_t>(widest, l.attention.wq.rows + 2 * l.attention.wk.rows);
    }
    l.moe_row = l.router.rows > 0 ? routed++ : -1;
    MOESCOPE_CHECK(l.router.rows == 0 || !l.experts.empty(), "run: set_experts was not called for layer ", i);
    MOESCOPE_CHECK(l.router.rows > 0 || l.shared, "run: layer ", i, " has neither a router nor an MLP");
    widest_inter = std::max<int64_t>(widest_inter, l.inter);
    transposed = transposed || (!l.experts.empty() && l.experts[0].transposed);
  }
  MOESCOPE_CHECK(rows == 1 || !transposed, "run: transposed experts (GPT-OSS) run one token at a time");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < layers; ++i) {
      const Layer& l = layers_[i];
      const AttentionWeights& a = l.attention;
      const int64_t at = r * layers + i, start = starts[at], length = lengths[at];
      MOESCOPE_CHECK(start >= 0 && length >= 0, "run: starts and lengths are positions");
      const int64_t kv_heads = l.latent ? 1 : a.wk.rows / a.head_dim;
      const int64_t widths[2] = {l.latent ? l.mla.shape.rank : a.head_dim, l.latent ? l.mla.shape.rope : a.head_dim};
      for (int m = 0; m < 2; ++m) {
        const KvBuffer& t = m == 0 ? keys[at] : values[at];
        MOESCOPE_CHECK(t.data != nullptr && t.heads == kv_heads && t.capacity > start + length && t.width == widths[m] &&
                           t.element_stride == 1,
                       "run: layer ", i, "'s key/value buffers [1, kv_heads, capacity > start + length, width] in bf16");
      }
      // the views begin at the first position attended to
      key_views.push_back({keys[at].data + start * keys[at].position_stride, keys[at].head_stride,
                           keys[at].position_stride});
      value_views.push_back({values[at].data + start * values[at].position_stride, values[at].head_stride,
                             values[at].position_stride});
      longest = std::max(longest, length);
    }
  MOESCOPE_CHECK(picks != nullptr && picks_len == rows * routed * top_k_,
                 "run: picks must be [tokens, MoE layers, top_k] int64");
  // the logits of the last k rows (every row's, or where prompts' rows lead, the rows that need them)
  MOESCOPE_CHECK(logits != nullptr && logits_len % lm_head_.rows == 0 && logits_len >= lm_head_.rows &&
                     logits_len <= rows * lm_head_.rows,
                 "run: logits must hold the vocabulary's ", lm_head_.rows, " values for each of the last rows");
  const int64_t logit_rows = logits_len / lm_head_.rows;
  size_buffers(rows, widest, widest_inter, latent_in);
  Shared shared{rows, layers, longest, tokens, lengths, picks, routed * top_k_, cos_rows.data(), sin_rows.data(),
                rotary_dim, key_views.data(), value_views.data(), logits, logit_rows};
  SpinBarrier barrier;
#pragma omp parallel num_threads(threads())
  {
    barrier.join(omp_get_num_threads());  // the team may be smaller than asked for
    step_thread(shared, barrier, omp_get_thread_num(), omp_get_num_threads());
  }
  // each row's experts in order of id, as the caller's bookkeeping takes them (sorted here, the
  // step's own work done: a sort between tokens in numpy ran cold, several times this)
  for (int64_t at = 0; at < picks_len; at += top_k_) std::sort(picks + at, picks + at + top_k_);
}

// torch's CPU top-k (aten/src/ATen/native/cpu/SortingKernel.cpp, topk_impl_loop): (value, index)
// pairs with NaN largest, a partial sort where k * 64 <= n, else nth_element then a sort of the first
// k - 1; on the same standard library algorithms, so equal values come out in its order (a router
// whose logits tie picks the expert transformers' torch.topk picks). The best k first in `queue`.
static void torch_top_k(const float* values, int64_t n, int64_t k, std::vector<std::pair<float, int64_t>>& queue) {
  using Entry = std::pair<float, int64_t>;
  queue.resize(n);
  for (int64_t e = 0; e < n; ++e) queue[e] = {values[e], e};
  const auto larger = [](const Entry& x, const Entry& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
}

// GPT-OSS's routing: torch's top-k of the bf16 logits, then a softmax over those k rounded to bf16,
// as the router module calls them.
void WholeTokenStep::route_softmax_of_top(const bf16* logits, int64_t experts, int64_t* picked, float* weights) const {
  std::vector<float> values(experts);
  for (int64_t e = 0; e < experts; ++e) values[e] = to_float(logits[e]);
  std::vector<std::pair<float, int64_t>> queue;
  torch_top_k(values.data(), experts, top_k_, queue);
  float top = -std::numeric_limits<float>::infinity();
  float best[256];
  const int64_t k = std::min<int64_t>(top_k_, 256);
  for (int64_t j = 0; j < k; ++j) top = std::max(top, best[j] = queue[j].first);
  const float inverse = 1.f / exp_shifted(best, k, top);
  for (int64_t j = 0; j < k; ++j) {
    picked[j] = queue[j].second;
    weights[j] = round_bf16(best[j] * inverse);
  }
}

void WholeTokenStep::step_thread(const Shared& in, SpinBarrier& barrier, int tid, int team) {
  Clock clock(phase_seconds_, tid == 0);
  const int64_t rows = in.rows, hidden = hidden_;
  std::vector<bf16> x(rows * hidden), normed(rows * hidden), head_scratch(hidden);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(x.data() + r * hidden, embed_.row(in.tokens[r]), hidden * sizeof(bf16));
  int64_t group = 1, group_width = hidden;  // the most query heads sharing a kv head, and their rows
  for (const Layer& l : layers_)
    if (!l.latent) {
      const AttentionWeights& a = l.attention;
      group = std::max(group, a.wq.rows / a.wk.rows);
      group_width = std::max(group_width, a.wq.rows / (a.wk.rows / a.head_dim));
    }
  std::vector<float> scores(group * (in.longest + 1)), sums(group_width);
  std::vector<bf16> q_in(rows * latent_stride_);  // a latent layer's normed q_a rows
  LatentScratch latent_scratch;
  auto share = [&](int64_t n) { return thread_share(n, tid, team); };
  auto each_row = [&](auto&& f) {
    for (int64_t r = 0; r < rows; ++r) f(r, x.data() + r * hidden, normed.data() + r * hidden, delta_.data() + r * hidden);
  };
  const bool round_once = norms_round_once_;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    each_row([&](int64_t, bf16* xr, bf16* nr, bf16*) { rms_norm_row(xr, l.input_norm, hidden, l.input_eps, nr, round_once); });
    clock.lap(kNorms);
    if (l.latent)
      latent_attention_part(l, normed.data(), in, i, barrier, tid, team, q_in.data(), latent_scratch);
    else
      attention_part(l, normed.data(), in, i, barrier, tid, team, head_scratch.data(), scores.data(), sums.data());
    barrier.wait();
    clock.lap(kAttention);
    rows_of(l.wo, attended_.data(), widest_, rows, share(hidden), delta_.data(), hidden, l.o_bias);
    barrier.wait();
    each_row([&](int64_t, bf16* xr, bf16*, bf16* dr) { add_rows(xr, dr, hidden, xr); });
    clock.lap(kOutProj);
    each_row([&](int64_t, bf16* xr, bf16* nr, bf16*) { rms_norm_row(xr, l.post_norm, hidden, l.post_eps, nr, round_once); });
    clock.lap(kNorms);
    const bool routed = l.moe_row >= 0;
    int64_t* picked = in.picked + std::max<int64_t>(l.moe_row, 0) * top_k_;  // row r's at + r * picked_stride
    if (routed) {  // the router's rows shared out; then one thread picks from its logits
      const auto [first, last] = share(l.router.rows);
      if (l.grouped) {
        grouped_logits(l, normed.data(), rows, first, last);
      } else if (first < last) {
        const Rows<const bf16> inputs(normed.data(), hidden, rows);
        const Rows<float> sums_out(router_acc_.data(), router_stride_, rows);
        gemv_many_into_rows(l.router, inputs.data(), rows, first, last, sums_out.data(), 0);
      }
    }
    if (l.shared) shared_activation(l, normed.data(), rows, share(l.shared_gate_proj.rows), tid);
    if (routed) barrier.wait();  // every logit is in
    if (routed && tid == 0) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* acc = router_acc_.data() + r * router_stride_;
        int64_t* row_picks = picked + r * in.picked_stride;
        if (l.grouped)
          route_grouped(l, acc, row_picks, route_.data() + r * top_k_);
        else
          route(l, acc, row_picks, route_.data() + r * top_k_);
      }
      gather_union(l, picked, rows, in.picked_stride);
    }
    barrier.wait();
    clock.lap(kRouter);
    const auto [j_first, j_last] = share(hidden);  // the weighted sum by slices of the row
    if (routed) {
      experts_of_rows(l, normed.data(), barrier, tid, team);
      barrier.wait();
      each_row([&](int64_t r, bf16*, bf16*, bf16* dr) {
        weighted_sum_rows(expert_out_.data() + r * top_k_ * hidden, route_.data() + r * top_k_, top_k_, hidden,
                          j_first, j_last, cast_back_, dr);
      });
    }
    if (l.shared) add_shared_rows(l, rows, j_first, j_last, routed);
    barrier.wait();
    each_row([&](int64_t, bf16* xr, bf16*, bf16* dr) { add_rows(xr, dr, hidden, xr); });
    clock.lap(kExperts);
  }
  each_row([&](int64_t, bf16* xr, bf16* nr, bf16*) { rms_norm_row(xr, final_norm_, hidden, final_eps_, nr, round_once); });
  clock.lap(kNorms);
  rows_of(lm_head_, normed.data() + (rows - in.logit_rows) * hidden, hidden, in.logit_rows, share(lm_head_.rows),
          in.logits, lm_head_.rows);
  barrier.wait();
  clock.lap(kLmHead);
}


void WholeTokenStep::attention_part(const Layer& l, const bf16* normed, const Shared& in, size_t i, SpinBarrier& barrier, int tid,
                    int team, bf16* head_scratch, float* scores, float* sums) {
  auto share = [&](int64_t n) { return thread_share(n, tid, team); };
  const AttentionWeights& a = l.attention;
  const int64_t d = a.head_dim, heads = a.wq.rows / d, kv_heads = a.wk.rows / d, group = heads / kv_heads;
  const int64_t rows = in.rows, S = scratch_stride_, W = widest_;
  // row r's query and output, and where its key and value go
  auto query_of = [&](int64_t r) { return query_.data() + r * W; };
  auto out_of = [&](int64_t r) { return attended_.data() + r * W; };
  auto key_rows = [&](int64_t r) {
    return const_cast<bf16*>(in.key(r, i).data) + in.length(r, i) * in.key(r, i).position_stride;
  };
  auto value_rows = [&](int64_t r) {
    return const_cast<bf16*>(in.value(r, i).data) + in.length(r, i) * in.value(r, i).position_stride;
  };
  const Rows<const bf16> inputs(normed, hidden_, rows);
  // head h of projection m for every row, its sums at `sums` in each row's scratch, into out(r)
  // (each row's input put in fixed point once a layer, not once a head)
  auto project = [&](int m, int64_t h, int64_t sums, auto&& out) {
    const Rows<float> acc(scratch_.data() + sums, S, rows);
    gemv_many_into_rows(head_matrix(a, m), inputs.data(), rows, h * d, (h + 1) * d, acc.data(), h * d);
    for (int64_t r = 0; r < rows; ++r)
      finish_head(a, m, h, in.cos_of(r), in.sin_of(r), acc.at[r], head_scratch, out(r));
  };
  if (kv_heads % team == 0 && !a.full_norm) {
    // Each thread its own kv heads and the query heads sharing them: projections (one stream
    // of rows per kv head, every token's before the next head's), the KV write, then attention;
    // nothing comes from another thread.
    const auto [first, last] = share(kv_heads);
    for (int64_t g = first; g < last; ++g) {
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        project(0, h, h * d, [&](int64_t r) { return query_of(r) + h * d; });
      project(1, g, (heads + g) * d, [&](int64_t r) { return key_rows(r) + g * in.key(r, i).head_stride; });
      project(2, g, (heads + g) * d, [&](int64_t r) { return value_rows(r) + g * in.value(r, i).head_stride; });
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = first; g < last; ++g)
        attend_group(query_of(r) + g * group * d, group, d, g, in.key(r, i), in.value(r, i), in.length(r, i) + 1,
                     l.scale, scores, sums, out_of(r) + g * group * d, l.extras, g * group);
    return;
  }
  // Too few kv heads to share out: projections by heads, then attention by query heads.
  const auto [first, last] = share(heads + 2 * kv_heads);
  for (int64_t head = first; head < last; ++head) {
    const int m = head < heads ? 0 : head < heads + kv_heads ? 1 : 2;
    const int64_t h = m == 0 ? head : m == 1 ? head - heads : head - heads - kv_heads;
    project(m, h, head * d, [&](int64_t r) {
      return m == 0 ? query_of(r) + h * d
             : m == 1 ? key_rows(r) + h * in.key(r, i).head_stride
                      : value_rows(r) + h * in.value(r, i).head_stride;
    });
  }
  barrier.wait();
  if (a.full_norm) {  // OLMoE: RMSNorm over all of q and all of k, then the rotary embedding
    std::array<float, kMaxRows> q_scale{}, k_scale{};
    for (int64_t r = 0; r < rows; ++r) {
      q_scale[r] = rms_scale(query_of(r), d, heads, d, a.eps);
      k_scale[r] = rms_scale(key_rows(r), in.key(r, i).head_stride, kv_heads, d, a.eps);
    }
    barrier.wait();  // every thread has read the rows before any is rewritten
    const auto [n_first, n_last] = share(heads + kv_heads);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t head = n_first; head < n_last; ++head) {
        const bool q = head < heads;
        const int64_t h = q ? head : head - heads;
        bf16* row = q ? query_of(r) + h * d : key_rows(r) + h * in.key(r, i).head_stride;
        const bf16* weight = (q ? a.q_norm : a.k_norm) + h * d;
        const float scale = q ? q_scale[r] : k_scale[r];
        for (int64_t c = 0; c < d; ++c) row[c] = to_bf16(to_float(weight[c]) * round_bf16(to_float(row[c]) * scale));
        rope_head(row, in.cos_of(r), in.sin_of(r), a.rotary_dim);
      }
    barrier.wait();
  }
  const auto [q_first, q_last] = share(heads);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = q_first; h < q_last; ++h)
      attend_head(query_of(r) + h * d, d, h / group, in.key(r, i), in.value(r, i), in.length(r, i) + 1, l.scale,
                  scores, sums, out_of(r) + h * d, l.extras, h);
}


void WholeTokenStep::latent_attention_part(const Layer& l, const bf16* normed, const Shared& in, size_t i, SpinBarrier& barrier,
                           int tid, int team, bf16* q_in, LatentScratch& scratch) {
  const LatentAttention& m = l.mla;
  const LatentShape& s = m.shape;
  const int64_t rows = in.rows, S = scratch_stride_, W = widest_, L = latent_stride_;
  const int64_t qa = m.q_a.rows, kva = m.kv_a.rows, width = s.nope + s.rope;
  auto rope = [&](bf16* head, int64_t r) {
    if (m.interleaved)
      rope_head_interleaved(head, in.cos_of(r), in.sin_of(r), s.rope);
    else
      rope_head(head, in.cos_of(r), in.sin_of(r), s.rope);
  };
  const Rows<const bf16> inputs(normed, hidden_, rows);
  const auto [first, last] = thread_share(qa + kva, tid, team);
  if (first < std::min(last, qa)) {
    const Rows<float> out(scratch_.data(), S, rows);
    gemv_many_into_rows(m.q_a, inputs.data(), rows, first, std::min(last, qa), out.data(), 0);
  }
  if (std::max(first, qa) < last) {
    const Rows<float> out(scratch_.data() + qa, S, rows);
    gemv_many_into_rows(m.kv_a, inputs.data(), rows, std::max(first, qa) - qa, last - qa, out.data(), 0);
  }
  for (int64_t r = 0; r < rows; ++r)
    round_linear(scratch_.data() + r * S + first, nullptr, last - first, latent_in_.data() + r * L + first);
  barrier.wait();
  std::array<const bf16*, kMaxRows> q_from{};
  for (int64_t r = 0; r < rows; ++r) {
    q_from[r] = normed + r * hidden_;
    if (qa > 0) {
      rms_norm_row(latent_in_.data() + r * L, m.q_a_norm, qa, m.q_a_eps, q_in + r * L);
      q_from[r] = q_in + r * L;
    }
  }
  const auto [h_first, h_last] = thread_share(s.heads, tid, team);
  for (int64_t h = h_first; h < h_last; ++h) {
    const Rows<float> out(scratch_.data() + h * width, S, rows);
    gemv_many_into_rows(m.q_b, q_from.data(), rows, h * width, (h + 1) * width, out.data(), h * width);
    for (int64_t r = 0; r < rows; ++r) {
      bf16* query = query_.data() + r * W + h * width;
      round_linear(scratch_.data() + r * S + h * width, nullptr, width, query);
      rope(query + s.nope, r);
    }
  }
  if (tid == team - 1) {  // (the last thread's share of heads is never the larger one)
    for (int64_t r = 0; r < rows; ++r) {
      const CacheView latents = in.key(r, i), rotary = in.value(r, i);
      bf16* latent_row = const_cast<bf16*>(latents.data) + in.length(r, i) * latents.position_stride;
      bf16* rotary_row = const_cast<bf16*>(rotary.data) + in.length(r, i) * rotary.position_stride;
      rms_norm_row(latent_in_.data() + r * L + qa, m.kv_a_norm, s.rank, m.kv_a_eps, latent_row);
      std::memcpy(rotary_row, latent_in_.data() + r * L + qa + s.rank, s.rope * sizeof(bf16));
      rope(rotary_row, r);
    }
  }
  barrier.wait();
  for (int64_t r = 0; r < rows; ++r) {
    const CacheView latents = in.key(r, i), rotary = in.value(r, i);
    const int64_t len = in.length(r, i) + 1;
    scratch.fit(s, len);
    for (int64_t h = h_first; h < h_last; ++h) {
      const bf16* query = query_.data() + r * W + h * width;
      latent_head(reinterpret_cast<const bf16*>(m.up.data), s, h, query, query + s.nope, latents.data,
                  latents.position_stride, rotary.data, rotary.position_stride, len, l.scale, scratch,
                  attended_.data() + r * W + h * s.v_dim);
    }
  }
}


void WholeTokenStep::grouped_logits(const Layer& l, const bf16* x, int64_t rows, int64_t first, int64_t last) {
  const float* w = l.grouped_weight;
  for (int64_t e = first; e < last; ++e)
    for (int64_t r = 0; r < rows; ++r)
      router_acc_[r * router_stride_ + e] = dot_f32_bf16(w + e * hidden_, x + r * hidden_, hidden_);
}


void WholeTokenStep::route_grouped(const Layer& l, const float* acc, int64_t* picked, float* weights) {
  const int64_t experts = l.router.rows, per_group = experts / l.groups;
  std::vector<float> score(experts), choice(experts), group_score(l.groups);
  const float* correction = l.correction;
  for (int64_t e = 0; e < experts; ++e) {
    score[e] = 1.f / (1.f + std::exp(-acc[e]));
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


void WholeTokenStep::gather_union(const Layer& l, const int64_t* picked, int64_t rows, int64_t picked_stride) {
  union_.clear();
  std::vector<int64_t> ids;  // union_'s expert ids
  std::vector<int64_t> of_pick(rows * top_k_);  // each pick's place in the union
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < top_k_; ++j) {
      const int64_t e = picked[r * picked_stride + j];
      const auto found = std::find(ids.begin(), ids.end(), e);
      of_pick[r * top_k_ + j] = found - ids.begin();
      if (found == ids.end()) {
        ids.push_back(e);
        union_.push_back(&l.experts[e]);
      }
    }
  const int64_t n = static_cast<int64_t>(union_.size());
  user_begin_.assign(n + 1, 0);
  for (const int64_t u : of_pick) ++user_begin_[u + 1];
  for (int64_t u = 0; u < n; ++u) user_begin_[u + 1] += user_begin_[u];
  users_.resize(of_pick.size());
  std::vector<int64_t> filled(user_begin_.begin(), user_begin_.end() - 1);
  for (int64_t pick = 0; pick < static_cast<int64_t>(of_pick.size()); ++pick) users_[filled[of_pick[pick]]++] = pick;
}


// This thread's part of the layer's experts for every row (kernels/experts.h: experts_part): the
// union's experts, each expert's matrices read once for all the picks of it, into expert_out_
// [rows * top_k, hidden] (each pick's down projection, float32 sums).
void WholeTokenStep::experts_of_rows(const Layer& l, const bf16* normed, SpinBarrier& barrier, int tid, int team) {
  static_assert(kMaxRows <= kMaxPicks, "an expert is picked at most once a row");
  const int64_t inter = l.inter, hidden = hidden_, k = top_k_;
  auto picks_of = [&](int64_t u) {
    ExpertPicks p;
    for (int64_t at = user_begin_[u]; at < user_begin_[u + 1]; ++at) {
      const int64_t pick = users_[at];
      p.add(normed + (pick / k) * hidden, projected_.data() + pick * 2 * inter, activation_.data() + pick * inter,
            expert_out_.data() + pick * hidden);
    }
    return std::make_pair(union_[u], p);
  };
  experts_part(l.gate, static_cast<int64_t>(union_.size()), user_begin_.data(), hidden, inter, picks_of, barrier, tid,
               team);
}


void WholeTokenStep::shared_activation(const Layer& l, const bf16* x, int64_t rows, std::pair<int64_t, int64_t> range,
                                       int tid) {
  const int64_t inter = l.shared_gate_proj.rows;
  const Rows<const bf16> inputs(x, hidden_, rows);
  const Rows<float> gate(shared_acc_.data(), shared_stride_, rows), up(shared_acc_.data() + inter, shared_stride_, rows);
  gemv_many_into_rows(l.shared_gate_proj, inputs.data(), rows, range.first, range.second, gate.data(), 0);
  gemv_many_into_rows(l.shared_up_proj, inputs.data(), rows, range.first, range.second, up.data(), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = range.first; i < range.second; ++i) {
      const float g = round_bf16(gate.at[r][i]);
      shared_act_[r * shared_inter_ + i] = to_bf16(round_bf16(g / (1.f + std::exp(-g))) * round_bf16(up.at[r][i]));
    }
  if (tid == 0 && l.shared_gated)
    for (int64_t r = 0; r < rows; ++r) {
      float logit = 0.f;
      gemv_range(l.shared_gate, x + r * hidden_, 0, 1, &logit);
      shared_scale_[r] = round_bf16(1.f / (1.f + std::exp(-round_bf16(logit))));
    }
}


void WholeTokenStep::add_shared_rows(const Layer& l, int64_t rows, int64_t begin, int64_t end, bool routed) {
  const Rows<const bf16> activations(shared_act_.data(), shared_inter_, rows);
  const Rows<float> out(shared_acc_.data() + 2 * l.shared_gate_proj.rows, shared_stride_, rows);
  gemv_many_into_rows(l.shared_down_proj, activations.data(), rows, begin, end, out.data(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    bf16* delta = delta_.data() + r * hidden_;
    for (int64_t j = begin; j < end; ++j) {
      float v = round_bf16(out.at[r][j]);
      if (l.shared_gated) v = round_bf16(v * shared_scale_[r]);
      delta[j] = routed ? to_bf16(to_float(delta[j]) + v) : to_bf16(v);
    }
  }
}


void WholeTokenStep::rows_of(const Matrix& w, const bf16* x, int64_t x_stride, int64_t rows,
                             std::pair<int64_t, int64_t> range, bf16* out, int64_t out_stride, const bf16* bias) {
  const Rows<const bf16> inputs(x, x_stride, rows);
  const Rows<float> sums(scratch_.data(), scratch_stride_, rows);
  gemv_many_into_rows(w, inputs.data(), rows, range.first, range.second, sums.data(), 0);
  for (int64_t r = 0; r < rows; ++r)
    round_linear(sums.at[r] + range.first, bias == nullptr ? nullptr : bias + range.first, range.second - range.first,
                 out + r * out_stride + range.first);
}


void WholeTokenStep::route(const Layer& l, const float* acc, int64_t* picked, float* weights) {
  const int64_t experts = l.router.rows;
  std::vector<bf16> logits(experts);
  round_linear(acc, l.router_bias, experts, logits.data());
  if (softmax_of_top_) return route_softmax_of_top(logits.data(), experts, picked, weights);
  float* p = router_probs_.data();
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < experts; ++e) top = std::max(top, p[e] = to_float(logits[e]));
  const float inverse = 1.f / exp_shifted(p, experts, top);  // times the reciprocal, as ATen's softmax
  for (int64_t e = 0; e < experts; ++e) p[e] *= inverse;
  std::vector<std::pair<float, int64_t>> queue;  // best first, ties in torch.topk's order
  torch_top_k(p, experts, top_k_, queue);
  float total = 0.f;
  for (int64_t j = 0; j < top_k_; ++j) total += (weights[j] = p[picked[j] = queue[j].second]);
  for (int64_t j = 0; j < top_k_; ++j) {
    if (normalize_) weights[j] /= total;
    if (cast_back_) weights[j] = round_bf16(weights[j]);
  }
}

}  // namespace moescope
