// The C ABI (include/moescope_kernels.h): checks each call's arguments, converts them into the
// kernels' types, and turns a failed check into an error code and a message, so that no C++
// exception crosses into the caller.
#include "include/moescope_kernels.h"

#include <exception>
#include <string>
#include <vector>

#include "attention/single.h"
#include "base/check.h"
#include "base/features.h"
#include "base/parallel.h"
#include "formats/quantize.h"
#include "formats/types.h"
#include "kernels/gemv.h"
#include "ops/ops.h"
#include "prompt/experts.h"
#include "prompt/scratch.h"
#include "step/whole_token_step.h"

#ifndef MOESCOPE_VARIANT
#define MOESCOPE_VARIANT "unnamed"
#endif

struct ms_step {
  moescope::WholeTokenStep step;
};

namespace {

using namespace moescope;

std::string& last_error() {
  thread_local std::string message;
  return message;
}

// Runs `body`, returning 0, or -1 with the message of what it threw.
template <class Body>
int guarded(Body&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    last_error() = e.what();
  } catch (...) {
    last_error() = "unknown error in the native kernels";
  }
  return -1;
}

Matrix matrix_of(const ms_matrix* w, const char* name) {
  MOESCOPE_CHECK(w != nullptr && w->data != nullptr && w->rows > 0 && w->cols > 0, name, ": a matrix is needed");
  Matrix m;
  m.data = static_cast<const uint8_t*>(w->data);
  m.type = w->type;
  m.rows = w->rows;
  m.cols = w->cols;
  m.row_bytes = w->row_bytes;
  if (w->type == kBF16) {
    MOESCOPE_CHECK(w->row_bytes >= 2 * w->cols && w->row_bytes % 2 == 0, name, ": bf16 rows of ", w->cols,
                   " values are needed");
  } else {
    const int64_t be = block_elements(w->type), bb = block_bytes(w->type);
    MOESCOPE_CHECK(be > 0, name, ": no kernel reads weight type ", w->type);
    MOESCOPE_CHECK(w->cols % be == 0 && w->row_bytes >= w->cols / be * bb, name, ": ", w->cols,
                   " columns do not match rows of ", w->row_bytes, " bytes of type ", w->type);
  }
  return m;
}

// An optional matrix: none where it has no data.
Matrix optional_matrix(const ms_matrix* w, const char* name) {
  return w == nullptr || w->data == nullptr ? Matrix() : matrix_of(w, name);
}

Vector vector_of(ms_vector v) { return Vector{v.data, v.len}; }

GateRecipe gate_of(const ms_gate* g) {
  GateRecipe r;
  if (g != nullptr) {
    r.interleaved = g->interleaved != 0;
    r.clamped_swiglu = g->clamped_swiglu != 0;
    r.alpha = g->alpha;
    r.limit = g->limit;
  }
  return r;
}

std::vector<ExpertWeights> experts_of(const ms_expert* experts, int64_t n, int64_t hidden, bool transposed) {
  MOESCOPE_CHECK(experts != nullptr && n > 0, "one gate_up and one down per expert");
  std::vector<ExpertWeights> out;
  out.reserve(n);
  for (int64_t e = 0; e < n; ++e) {
    const ms_expert& x = experts[e];
    ExpertWeights w = expert_weights(matrix_of(&x.gate_up, "gate_up"), matrix_of(&x.down, "down"), hidden,
                                     transposed, nullptr, nullptr);
    w.gate_up_bias = checked(vector_of(x.gate_up_bias), 2 * w.inter, "gate_up bias");
    w.down_bias = checked(vector_of(x.down_bias), hidden, "down bias");
    MOESCOPE_CHECK(out.empty() || w.inter == out[0].inter, "every expert of one intermediate size");
    out.push_back(w);
  }
  return out;
}

CacheView view_of(const ms_kv* kv, int64_t heads, int64_t width, int64_t len, const char* name) {
  MOESCOPE_CHECK(kv != nullptr && kv->data != nullptr && kv->heads == heads && kv->width == width &&
                     kv->capacity >= len && kv->element_stride == 1 && len > 0,
                 name, ": [1, kv_heads, positions, d] with contiguous rows of the query's head size");
  return CacheView{kv->data, kv->head_stride, kv->position_stride};
}

std::string code_path() {
  static const std::string path = [] {
#if defined(MOESCOPE_AVX512BF16)
    std::string p = "avx512-bf16";
#elif defined(MOESCOPE_AVX512F)
    std::string p = "avx512";
#elif defined(MOESCOPE_AVX2)
    std::string p = "avx2";
#elif defined(MOESCOPE_NEON)
    std::string p = "neon";
#if defined(MOESCOPE_DOTPROD)
    p += "-dotprod";
#endif
#if defined(MOESCOPE_NEON_BF16)
    p += "-bf16";
#endif
#if defined(MOESCOPE_I8MM)
    p += "-i8mm";
#endif
#else
    std::string p = "generic";
#endif
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
    p += "-vnni";
#endif
    return p;
  }();
  return amx_on() ? path + "-amx" : path;  // the tiles only where the CPU and the OS grant them
}

}  // namespace

extern "C" {

int moescope_abi_version(void) { return MOESCOPE_ABI_VERSION; }

const char* moescope_last_error(void) { return last_error().c_str(); }

const char* moescope_variant(void) { return MOESCOPE_VARIANT; }

const char* moescope_code_path(void) {
  thread_local std::string path;
  path = code_path();
  return path.c_str();
}

int moescope_bf16_dot_products(void) {
#if defined(MOESCOPE_AVX512BF16)
  return 1;
#else
  return 0;
#endif
}

void moescope_set_threads(int threads) { thread_setting().store(threads < 1 ? 1 : threads); }

void moescope_set_integer_dots(int on) { integer_dots_enabled() = on != 0; }

void moescope_set_int8_inputs(int on) { int8_inputs_enabled() = on != 0; }

void moescope_set_amx([[maybe_unused]] int on) {
#if defined(MOESCOPE_AMX)
  amx_wanted() = on != 0;
#endif
}

int moescope_amx(void) { return amx_on() ? 1 : 0; }

int moescope_format_traits(int32_t type, int64_t* elements, int64_t* bytes) {
  const FormatTraits* f = format_traits(type);
  if (f == nullptr) return -1;
  *elements = f->elements;
  *bytes = f->bytes;
  return 0;
}

int moescope_gemv(const ms_matrix* w, const uint16_t* x, ms_vector bias, uint16_t* y) {
  return guarded([&] {
    const Matrix m = matrix_of(w, "weight");
    MOESCOPE_CHECK(x != nullptr && y != nullptr, "gemv: x and y are needed");
    gemv(m, x, checked(vector_of(bias), m.rows, "bias"), y);
  });
}

int moescope_dequantize(const ms_matrix* w, void* out, int out_kind) {
  return guarded([&] {
    const Matrix m = matrix_of(w, "weight");
    MOESCOPE_CHECK(out != nullptr, "dequantize: an output of rows x cols is needed");
    MOESCOPE_CHECK(out_kind >= 0 && out_kind <= 2, "dequantize: out_kind is 0 (bf16), 1 (float32 of bf16) or 2 (float32)");
    dequantize(m, out, static_cast<Dequantized>(out_kind));
  });
}

int moescope_quantize(const void* x, int bf16_input, int64_t rows, int64_t cols, int32_t type, uint8_t* out) {
  return guarded([&] {
    MOESCOPE_CHECK(can_quantize(type), "quantize: no native quantizer writes type ", type);
    const int64_t elements = block_elements(type), bytes = block_bytes(type);
    MOESCOPE_CHECK(x != nullptr && out != nullptr && rows >= 0 && cols > 0,
                   "quantize: rows of values and an output of rows x row bytes are needed");
    MOESCOPE_CHECK(cols % elements == 0, "quantize: ", cols, " columns are not a whole number of ", elements,
                   "-element blocks");
    const int64_t row_bytes = cols / elements * bytes;
    parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
      std::vector<float> widened(bf16_input ? cols : 0);  // a bf16 row as float32 (exact)
      for (int64_t r = first; r < last; ++r) {
        const float* row = static_cast<const float*>(x) + r * cols;
        if (bf16_input) {
          const bf16* source = static_cast<const bf16*>(x) + r * cols;
          for (int64_t c = 0; c < cols; ++c) widened[c] = to_float(source[c]);
          row = widened.data();
        }
        quantize_row(type, row, cols, out + r * row_bytes);
      }
    });
  });
}

int moescope_linear_rows(const ms_matrix* w, const uint16_t* x, int64_t m, ms_vector bias, int int8_inputs,
                         uint16_t* y) {
  return guarded([&] {
    const Matrix weight = matrix_of(w, "weight");
    MOESCOPE_CHECK(x != nullptr && y != nullptr && m > 0, "linear_rows: bf16 rows of the weight's width needed");
    linear(weight, x, m, checked(vector_of(bias), weight.rows, "bias"), int8_inputs != 0, y);
  });
}

int moescope_rms_norm(const uint16_t* x, int64_t rows, ms_vector weight, double eps, int round_once, uint16_t* y) {
  return guarded([&] {
    MOESCOPE_CHECK(x != nullptr && y != nullptr && weight.data != nullptr && weight.len > 0 && rows >= 0,
                   "rms_norm: bf16 rows and a bf16 weight of their width");
    rms_norm(x, rows, weight.data, weight.len, static_cast<float>(eps), round_once != 0, y);
  });
}

int moescope_qkv_rope(const uint16_t* x, int64_t hidden, const ms_matrix* wq, const ms_matrix* wk, const ms_matrix* wv,
                      ms_vector q_norm, ms_vector k_norm, double eps, ms_vector cos, ms_vector sin, int64_t head_dim,
                      const ms_vector* biases, uint16_t* q, uint16_t* k, uint16_t* v) {
  return guarded([&] {
    AttentionWeights a = attention_weights(matrix_of(wq, "q_proj"), matrix_of(wk, "k_proj"), matrix_of(wv, "v_proj"),
                                           vector_of(q_norm), vector_of(k_norm), eps, head_dim, hidden);
    MOESCOPE_CHECK(!a.full_norm, "qkv_rope: q/k norms over one head only");
    if (biases != nullptr) a.set_biases(vector_of(biases[0]), vector_of(biases[1]), vector_of(biases[2]));
    MOESCOPE_CHECK(cos.data != nullptr && sin.data != nullptr && cos.len == sin.len, "qkv_rope: one cos and sin row");
    const RotaryRows rows(cos.data, sin.data, cos.len, head_dim, "qkv_rope");
    qkv_rope(x, a, rows.cos.data(), rows.sin.data(), q, k, v);
  });
}

int moescope_attend(const uint16_t* q, int64_t heads, int64_t d, const ms_kv* keys, const ms_kv* values, int64_t len,
                    double scale, ms_vector sinks, int eager_rounding, uint16_t* out) {
  return guarded([&] {
    MOESCOPE_CHECK(keys != nullptr && keys->heads > 0 && heads % keys->heads == 0,
                   "attend: keys and values of the query's head size, whole groups of heads");
    const int64_t kv_heads = keys->heads;
    const CacheView k = view_of(keys, kv_heads, d, len, "attend: keys");
    const CacheView v = view_of(values, kv_heads, d, len, "attend: values");
    AttendExtras extras;
    extras.eager_rounding = eager_rounding != 0;
    extras.sinks = checked(vector_of(sinks), heads, "sinks");
    attend(q, heads, d, kv_heads, k, v, len, static_cast<float>(scale), extras, out);
  });
}

int moescope_latent_attend(const ms_matrix* up, const uint16_t* q_nope, const uint16_t* q_rot, int64_t heads,
                           int64_t nope, int64_t rope, const uint16_t* latents, int64_t latent_stride,
                           const uint16_t* k_rot, int64_t rot_stride, int64_t len, int64_t v_dim, double scale,
                           uint16_t* out) {
  return guarded([&] {
    const Matrix u = matrix_of(up, "kv_b_proj");
    MOESCOPE_CHECK(u.type == kBF16 && u.row_bytes == 2 * u.cols, "latent_attend: up [heads * (nope + v), rank], contiguous");
    MOESCOPE_CHECK(u.rows == heads * (nope + v_dim), "latent_attend: up's rows are heads * (nope + v)");
    MOESCOPE_CHECK(latents != nullptr && k_rot != nullptr && len > 0, "latent_attend: latents [positions, rank], k_rot [positions, rope]");
    latent_attend(reinterpret_cast<const bf16*>(u.data), heads, nope, rope, u.cols, v_dim, q_nope, q_rot, latents,
                  latent_stride, k_rot, rot_stride, len, static_cast<float>(scale), out);
  });
}

int moescope_moe_decode(const uint16_t* x, int64_t hidden, const ms_expert* experts, int64_t k, const float* weights,
                        int bf16_weights, int transposed, const ms_gate* gate, uint16_t* y) {
  return guarded([&] {
    MOESCOPE_CHECK(x != nullptr && y != nullptr && weights != nullptr, "moe_decode: x, weights and y are needed");
    const std::vector<ExpertWeights> picked = experts_of(experts, k, hidden, transposed != 0);
    moe_decode(x, hidden, picked, weights, bf16_weights != 0, gate_of(gate), y);
  });
}

int moescope_combine_rows(const uint16_t* y, int64_t n, int64_t hidden, const float* weights, int bf16_weights,
                          const int64_t* order, int64_t top_k, uint16_t* out) {
  return guarded([&] { combine_rows(y, n, hidden, weights, bf16_weights != 0, order, top_k, out); });
}

int moescope_moe_prompt(const uint16_t* x, int64_t rows, int64_t hidden, const int64_t* start, const int64_t* count,
                        const ms_expert* experts, int64_t n, const ms_gate* gate, int int8_inputs, uint16_t* y) {
  return guarded([&] {
    const std::vector<ExpertWeights> list = experts_of(experts, n, hidden, false);
    moe_prompt(x, rows, hidden, std::vector<int64_t>(start, start + n), std::vector<int64_t>(count, count + n), list,
               gate_of(gate), int8_inputs != 0, y);
  });
}

ms_step* moescope_step_new(const ms_matrix* embed, ms_vector final_norm, double final_eps, const ms_matrix* lm_head,
                           int64_t top_k, int normalize, int cast_back, int softmax_of_top, int norms_round_once) {
  ms_step* made = nullptr;
  guarded([&] {
    made = new ms_step{WholeTokenStep(matrix_of(embed, "embed_tokens"), vector_of(final_norm), final_eps,
                                      matrix_of(lm_head, "lm_head"), top_k, normalize != 0, cast_back != 0,
                                      softmax_of_top != 0, norms_round_once != 0)};
  });
  return made;
}

void moescope_step_free(ms_step* step) { delete step; }

int moescope_step_add_layer(ms_step* s, ms_vector input_norm, double input_eps, const ms_matrix* wo,
                            ms_vector post_norm, double post_eps) {
  return guarded([&] {
    s->step.add_layer(vector_of(input_norm), input_eps, matrix_of(wo, "o_proj"), vector_of(post_norm), post_eps);
  });
}

int moescope_step_set_attention(ms_step* s, int64_t layer, const ms_matrix* wq, const ms_matrix* wk,
                                const ms_matrix* wv, ms_vector q_norm, ms_vector k_norm, double qk_eps,
                                int64_t head_dim, double scale, int64_t rotary_dim) {
  return guarded([&] {
    s->step.set_attention(layer, matrix_of(wq, "q_proj"), matrix_of(wk, "k_proj"), matrix_of(wv, "v_proj"),
                          vector_of(q_norm), vector_of(k_norm), qk_eps, head_dim, scale, rotary_dim);
  });
}

int moescope_step_set_latent_attention(ms_step* s, int64_t layer, const ms_matrix* q_a, ms_vector q_a_norm,
                                       double q_a_eps, const ms_matrix* q_b, const ms_matrix* kv_a,
                                       ms_vector kv_a_norm, double kv_a_eps, const ms_matrix* up, int64_t heads,
                                       int64_t nope, int64_t rope, int64_t v_dim, double scale, int interleaved) {
  return guarded([&] {
    s->step.set_latent_attention(layer, optional_matrix(q_a, "q_a_proj"), vector_of(q_a_norm), q_a_eps,
                                 matrix_of(q_b, "q_b_proj"), matrix_of(kv_a, "kv_a_proj_with_mqa"),
                                 vector_of(kv_a_norm), kv_a_eps, matrix_of(up, "kv_b_proj"), heads, nope, rope, v_dim,
                                 scale, interleaved != 0);
  });
}

int moescope_step_set_router(ms_step* s, int64_t layer, const ms_matrix* router) {
  return guarded([&] { s->step.set_router(layer, matrix_of(router, "router")); });
}

int moescope_step_set_grouped_router(ms_step* s, int64_t layer, const float* weight, int64_t experts, int64_t hidden,
                                     const float* correction, int64_t groups, int64_t top_groups,
                                     double routed_scale) {
  return guarded([&] {
    s->step.set_grouped_router(layer, weight, experts, hidden, correction, groups, top_groups, routed_scale);
  });
}

int moescope_step_set_experts(ms_step* s, int64_t layer, const ms_expert* experts, int64_t n, int transposed,
                              const ms_gate* gate) {
  return guarded([&] {
    MOESCOPE_CHECK(experts != nullptr && n > 0, "set_experts: every expert of the layer");
    const int64_t hidden = transposed ? experts[0].gate_up.rows : experts[0].gate_up.cols;
    s->step.set_experts(layer, experts_of(experts, n, hidden, transposed != 0), gate_of(gate));
  });
}

int moescope_step_set_attention_biases(ms_step* s, int64_t layer, ms_vector q, ms_vector k, ms_vector v) {
  return guarded([&] { s->step.set_attention_biases(layer, vector_of(q), vector_of(k), vector_of(v)); });
}

int moescope_step_set_attention_extras(ms_step* s, int64_t layer, ms_vector sinks, int eager_rounding,
                                       ms_vector o_bias) {
  return guarded([&] { s->step.set_attention_extras(layer, vector_of(sinks), eager_rounding != 0, vector_of(o_bias)); });
}

int moescope_step_set_router_bias(ms_step* s, int64_t layer, ms_vector bias) {
  return guarded([&] { s->step.set_router_bias(layer, vector_of(bias)); });
}

int moescope_step_set_shared_expert(ms_step* s, int64_t layer, const ms_matrix* gate_proj, const ms_matrix* up_proj,
                                    const ms_matrix* down_proj, ms_vector gate) {
  return guarded([&] {
    s->step.set_shared_expert(layer, matrix_of(gate_proj, "shared gate_proj"), matrix_of(up_proj, "shared up_proj"),
                              matrix_of(down_proj, "shared down_proj"), vector_of(gate));
  });
}

int moescope_step_run(ms_step* s, int64_t rows, const int64_t* tokens, ms_vector cos, ms_vector sin,
                      const ms_kv* keys, const ms_kv* values, const int64_t* starts, const int64_t* lengths,
                      int64_t layers, int64_t* picks, int64_t picks_len, uint16_t* logits, int64_t logits_len) {
  return guarded([&] {
    MOESCOPE_CHECK(keys != nullptr && values != nullptr && starts != nullptr && lengths != nullptr,
                   "run: one key and one value buffer, start and length per layer");
    s->step.run(rows, tokens, vector_of(cos), vector_of(sin), keys, values, starts, lengths, layers, picks, picks_len,
                logits, logits_len);
  });
}

const char* moescope_step_phase_names(void) { return "norms,attention,o_proj,router,experts,lm_head"; }

int moescope_step_phase_seconds(const ms_step* s, double* out, int n) {
  const auto& seconds = s->step.phase_seconds();
  int written = 0;
  for (; written < n && written < WholeTokenStep::kPhases; ++written) out[written] = seconds[written];
  return written;
}

}  // extern "C"
