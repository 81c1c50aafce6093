// One query's attention over a layer's cached keys and values, every head: the heads that share a
// kv head together where the variant has that kernel (arch/x86/group_attention.h), else one by one.
#pragma once

#include <cstdint>
#include <vector>

#include "../base/features.h"
#include "../base/parallel.h"
#include "../base/scalar.h"
#include "single.h"

#if defined(MOESCOPE_X86)
#include "../arch/x86/group_attention.h"
#endif

namespace moescope {

#if !defined(MOESCOPE_HAS_GROUP_ATTENTION)
inline bool group_attention_applies(int64_t, int64_t) { return false; }
#endif

// The `group` query heads h0 .. of kv head g into out[0, group * d): together where
// group_attention_applies, else head by head. `scores`: group * len floats; `acc`: group * d floats.
inline void attend_group(const bf16* q, int64_t group, int64_t d, int64_t g, CacheView keys, CacheView values, int64_t len,
                  float scale, float* scores, float* acc, bf16* out, const AttendExtras& extras, int64_t h0) {
#if defined(MOESCOPE_HAS_GROUP_ATTENTION)
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

inline void attend_into(const bf16* q, int64_t heads, int64_t d, int64_t kv_heads, CacheView keys, CacheView values,
                 int64_t len, float scale, bf16* out, const AttendExtras& extras) {
  const int64_t group = heads / kv_heads;
  // splitting heads across threads costs a wake-up: not worth it for the first few positions
  const bool split = heads * len * d >= (1 << 15);
  if (group_attention_applies(group, d) && (!split || kv_heads % threads() == 0)) {
    parallel_for(0, kv_heads, split ? 1 : kv_heads, [&](int64_t first, int64_t last) {
      std::vector<float> scores(group * len), acc(group * d);
      for (int64_t g = first; g < last; ++g)
        attend_group(q + g * group * d, group, d, g, keys, values, len, scale, scores.data(), acc.data(),
                     out + g * group * d, extras, g * group);
    });
    return;
  }
  parallel_for(0, heads, split ? 1 : heads, [&](int64_t first, int64_t last) {
    std::vector<float> scores(len), acc(d);
    for (int64_t h = first; h < last; ++h)
      attend_head(q + h * d, d, h / group, keys, values, len, scale, scores.data(), acc.data(), out + h * d, extras, h);
  });
}


}  // namespace moescope
