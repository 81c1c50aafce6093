// The one-row kernels every variant has: its instruction set's forms where arch/ has one, the
// generic reference otherwise. This file is the rule that picks (as ggml's arch-fallback.h):
// an arch header defines MOESCOPE_HAS_<KERNEL> beside each kernel it provides, and whatever no
// arch header provided maps to its *_generic form here.
#pragma once

#include <cstdint>

#include "../base/features.h"
#include "../base/scalar.h"
#include "../formats/blocks.h"
#include "../formats/types.h"
#include "../generic/dots.h"
#include "fixed_input.h"

#if defined(MOESCOPE_X86)
#include "../arch/x86/bf16_dot.h"
#include "../arch/x86/quant_dot.h"
#include "../arch/x86/quant_int.h"
#elif defined(MOESCOPE_ARM)
#include "../arch/arm/bf16_dot.h"
#include "../arch/arm/quant_int.h"
#endif

namespace moescope {

#if !defined(MOESCOPE_HAS_DOT_ROW)
inline float dot_row(const bf16* w, const bf16* x, int64_t k) { return dot_row_generic(w, x, k); }
#endif

#if !defined(MOESCOPE_HAS_DOT_F32_BF16)
inline float dot_f32_bf16(const float* w, const bf16* x, int64_t k) { return dot_f32_bf16_generic(w, x, k); }
#endif

#if !defined(MOESCOPE_HAS_QDOT_ROW)
inline float qdot_row(const Matrix& m, int64_t r, const bf16* x) { return qdot_row_generic(m, r, x); }
#endif

#if !defined(MOESCOPE_HAS_IDOT_ROW)
inline float idot_row(const Matrix& m, int64_t r, const FixedInput& in) { return idot_row_generic(m, r, in); }
#endif

#if !defined(MOESCOPE_HAS_IDOT_ROWS)
// Row r's dot with each of n inputs (an arch header may share work between them).
inline void idot_rows(const Matrix& m, int64_t r, const FixedInput* const* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = idot_row(m, r, *in[i]);
}
#endif

#if !defined(MOESCOPE_HAS_FLOAT_DOT_PREFERENCE)
inline bool prefers_float_dot(int32_t) { return false; }
#endif

#if !defined(MOESCOPE_HAS_GROUP_WEIGHTS)
inline void group_weights_f32(int32_t type, const uint8_t* b, const BlockScales& s, int g, float* w) {
  group_weights_f32_generic(type, b, s, g, w);
}
inline void group_weights_bf16(int32_t type, const uint8_t* b, const BlockScales& s, int g, bf16* w) {
  group_weights(type, b, s, g, w);
}
#endif

// Types whose one-row products take an integer dot (where integer_dots_enabled); FP8 and, where the
// variant prefers it, others keep the reference-exact float loops (qdot_row).
inline bool has_integer_dot(int32_t type) {
  if (prefers_float_dot(type)) return false;
  return type == kQ4_K || type == kQ8_0 || type == kQ6_K || type == kQ4_0 || type == kQ5_0 || type == kQ3_K ||
         type == kQ2_K || type == kMXFP4;
}

}  // namespace moescope
