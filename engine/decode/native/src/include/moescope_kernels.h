/* MoEScope's native kernels: the C ABI every variant library exports.
 *
 * Plain pointers and sizes only (no torch, no Python), so one build serves every torch and Python
 * version. Tensors are bf16 (uint16_t bits) unless a name says otherwise; the caller owns all
 * memory and keeps what a step refers to alive. A function returning int returns 0 on success and
 * -1 on bad arguments, with moescope_last_error() saying why (the thread's last message).
 * engine/decode/native/library.py is the Python side; engine/decode/native/tests/kernel_check.cpp a C++ one. */
#ifndef MOESCOPE_KERNELS_H
#define MOESCOPE_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MOESCOPE_API __declspec(dllexport)
#else
#define MOESCOPE_API __attribute__((visibility("default")))
#endif

#define MOESCOPE_ABI_VERSION 5

/* A weight matrix [rows, cols]: bf16 rows (type 0), or rows of blocks of a GGML type (type = its
 * gguf.GGMLQuantizationType id; 200: MoEScope's FP8 row blocks) with `cols` logical columns. */
typedef struct {
  const void* data;
  int32_t type;
  int64_t rows, cols, row_bytes;
} ms_matrix;

/* A bf16 vector (data NULL: none). */
typedef struct {
  const uint16_t* data;
  int64_t len;
} ms_vector;

/* How an expert's gate/up projection becomes its activation (engine/decode/paths/expert_recipe.py). */
typedef struct {
  int32_t interleaved, clamped_swiglu;
  double alpha, limit;
} ms_gate;

/* One expert: gate_up [2I, H] and down [H, I] (transposed: [H, 2I] and [I, H]); optional biases. */
typedef struct {
  ms_matrix gate_up, down;
  ms_vector gate_up_bias, down_bias;
} ms_expert;

/* A layer's KV cache buffer [1, heads, capacity, width], strides in elements. */
typedef struct {
  uint16_t* data;
  int64_t heads, capacity, width, head_stride, position_stride, element_stride;
} ms_kv;

MOESCOPE_API int moescope_abi_version(void);
MOESCOPE_API const char* moescope_last_error(void);
/* The variant's name (as CMakeLists.txt gave it) and the code paths it compiled, e.g. avx512-bf16-vnni-amx. */
MOESCOPE_API const char* moescope_variant(void);
MOESCOPE_API const char* moescope_code_path(void);
MOESCOPE_API int moescope_bf16_dot_products(void);
MOESCOPE_API void moescope_set_threads(int threads);
MOESCOPE_API void moescope_set_integer_dots(int on);  /* tests and A/B measurements */
/* The integer dots' inputs rounded to 8 bits (opt-in, lossy) or kept at 16 (default). */
MOESCOPE_API void moescope_set_int8_inputs(int on);
MOESCOPE_API void moescope_set_amx(int on);           /* tests and A/B measurements */
MOESCOPE_API int moescope_amx(void);
/* A block type's elements and bytes per block; -1 for bf16 and unknown ids. */
MOESCOPE_API int moescope_format_traits(int32_t type, int64_t* elements, int64_t* bytes);

MOESCOPE_API int moescope_gemv(const ms_matrix* w, const uint16_t* x, ms_vector bias, uint16_t* y);
/* out_kind: 0 bf16; 1 float32 holding the bf16 values; 2 float32 never rounded (a float32 model's). */
MOESCOPE_API int moescope_dequantize(const ms_matrix* w, void* out, int out_kind);
/* Rows [rows, cols] of float32 values (bf16 with bf16_input) as rows of blocks of a GGML type (Q8_0,
 * Q4_0, Q5_0, Q2_K, Q3_K, Q4_K, Q6_K) in `out` [rows, cols / elements * bytes]: the bytes of
 * engine/formats/quantize.py. */
MOESCOPE_API int moescope_quantize(const void* x, int bf16_input, int64_t rows, int64_t cols, int32_t type,
                                   uint8_t* out);
MOESCOPE_API int moescope_linear_rows(const ms_matrix* w, const uint16_t* x, int64_t m, ms_vector bias,
                                      int int8_inputs, uint16_t* y);
MOESCOPE_API int moescope_rms_norm(const uint16_t* x, int64_t rows, ms_vector weight, double eps, int round_once,
                                   uint16_t* y);
MOESCOPE_API int moescope_qkv_rope(const uint16_t* x, int64_t hidden, const ms_matrix* wq, const ms_matrix* wk,
                                   const ms_matrix* wv, ms_vector q_norm, ms_vector k_norm, double eps, ms_vector cos,
                                   ms_vector sin, int64_t head_dim, const ms_vector* biases, uint16_t* q, uint16_t* k,
                                   uint16_t* v);
MOESCOPE_API int moescope_attend(const uint16_t* q, int64_t heads, int64_t d, const ms_kv* keys, const ms_kv* values,
                                 int64_t len, double scale, ms_vector sinks, int eager_rounding, uint16_t* out);
MOESCOPE_API int moescope_latent_attend(const ms_matrix* up, const uint16_t* q_nope, const uint16_t* q_rot,
                                        int64_t heads, int64_t nope, int64_t rope, const uint16_t* latents,
                                        int64_t latent_stride, const uint16_t* k_rot, int64_t rot_stride, int64_t len,
                                        int64_t v_dim, double scale, uint16_t* out);
MOESCOPE_API int moescope_moe_decode(const uint16_t* x, int64_t hidden, const ms_expert* experts, int64_t k,
                                     const float* weights, int bf16_weights, int transposed, const ms_gate* gate,
                                     uint16_t* y);
MOESCOPE_API int moescope_combine_rows(const uint16_t* y, int64_t n, int64_t hidden, const float* weights,
                                       int bf16_weights, const int64_t* order, int64_t top_k, uint16_t* out);
MOESCOPE_API int moescope_moe_prompt(const uint16_t* x, int64_t rows, int64_t hidden, const int64_t* start,
                                     const int64_t* count, const ms_expert* experts, int64_t n, const ms_gate* gate,
                                     int int8_inputs, uint16_t* y);

/* The whole-token step (src/step/whole_token_step.h). */
typedef struct ms_step ms_step;
MOESCOPE_API ms_step* moescope_step_new(const ms_matrix* embed, ms_vector final_norm, double final_eps,
                                        const ms_matrix* lm_head, int64_t top_k, int normalize, int cast_back,
                                        int softmax_of_top, int norms_round_once);
MOESCOPE_API void moescope_step_free(ms_step* step);
MOESCOPE_API int moescope_step_add_layer(ms_step* step, ms_vector input_norm, double input_eps, const ms_matrix* wo,
                                         ms_vector post_norm, double post_eps);
MOESCOPE_API int moescope_step_set_attention(ms_step* step, int64_t layer, const ms_matrix* wq, const ms_matrix* wk,
                                             const ms_matrix* wv, ms_vector q_norm, ms_vector k_norm, double qk_eps,
                                             int64_t head_dim, double scale, int64_t rotary_dim);
MOESCOPE_API int moescope_step_set_latent_attention(ms_step* step, int64_t layer, const ms_matrix* q_a,
                                                    ms_vector q_a_norm, double q_a_eps, const ms_matrix* q_b,
                                                    const ms_matrix* kv_a, ms_vector kv_a_norm, double kv_a_eps,
                                                    const ms_matrix* up, int64_t heads, int64_t nope, int64_t rope,
                                                    int64_t v_dim, double scale, int interleaved);
MOESCOPE_API int moescope_step_set_router(ms_step* step, int64_t layer, const ms_matrix* router);
MOESCOPE_API int moescope_step_set_grouped_router(ms_step* step, int64_t layer, const float* weight, int64_t experts,
                                                  int64_t hidden, const float* correction, int64_t groups,
                                                  int64_t top_groups, double routed_scale);
MOESCOPE_API int moescope_step_set_experts(ms_step* step, int64_t layer, const ms_expert* experts, int64_t n,
                                           int transposed, const ms_gate* gate);
MOESCOPE_API int moescope_step_set_attention_biases(ms_step* step, int64_t layer, ms_vector q, ms_vector k,
                                                    ms_vector v);
MOESCOPE_API int moescope_step_set_attention_extras(ms_step* step, int64_t layer, ms_vector sinks, int eager_rounding,
                                                    ms_vector o_bias);
MOESCOPE_API int moescope_step_set_router_bias(ms_step* step, int64_t layer, ms_vector bias);
MOESCOPE_API int moescope_step_set_shared_expert(ms_step* step, int64_t layer, const ms_matrix* gate_proj,
                                                 const ms_matrix* up_proj, const ms_matrix* down_proj, ms_vector gate);
/* `rows` tokens in one step (src/step/whole_token_step.h): one each of several replies, and the tokens
 * of short prompts; keys, values, starts and lengths [rows, layers]; cos, sin [rows, n]; picks [rows,
 * MoE layers, top_k] in order of id; logits [k, vocab] for the last k rows (1 <= k <= rows). */
MOESCOPE_API int moescope_step_run(ms_step* step, int64_t rows, const int64_t* tokens, ms_vector cos, ms_vector sin,
                                   const ms_kv* keys, const ms_kv* values, const int64_t* starts,
                                   const int64_t* lengths, int64_t layers, int64_t* picks, int64_t picks_len,
                                   uint16_t* logits, int64_t logits_len);
/* The phase names (comma-separated) and seconds so far, in that order (at most `n`). */
MOESCOPE_API const char* moescope_step_phase_names(void);
MOESCOPE_API int moescope_step_phase_seconds(const ms_step* step, double* out, int n);

#ifdef __cplusplus
}
#endif

#endif /* MOESCOPE_KERNELS_H */
