// What measured faster on one CPU vendor than on another, chosen once when the library loads (a
// prebuilt variant runs on both), and the prefetch helpers that follow it. Figures: docs/performance.md.
//
// On Intel cores:
// - weight rows are asked ahead into the second-level cache (T1), whose queue holds more lines in
//   flight than the first level's fill buffers, and the lines kNearPrefetchBytes ahead are moved
//   on into the first level (T0). On AMD cores the lines ahead are non-temporal: the weights, read
//   once a token, then no longer evict the KV cache, the activations and the interpreter's data;
// - quantized rows are asked for further ahead (kBlockAhead), every line of a block;
// - MXFP4 rows take the integer dots where the CPU has bf16 dot products too (arch/x86/quant_int.h).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "features.h"

#if defined(MOESCOPE_X86) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace moescope {

struct Tune {
  bool intel = false;
};

inline Tune detect_tune() {
  Tune tune;
#if defined(MOESCOPE_X86) && (defined(__GNUC__) || defined(__clang__))
  unsigned a = 0, b = 0, c = 0, d = 0;
  char vendor[13] = {};
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    tune.intel = std::strcmp(vendor, "GenuineIntel") == 0;
  }
#endif
  return tune;
}

inline const Tune kTune = detect_tune();

// The kernels that prefetch take the vendor as a template parameter (kIntel), chosen once per row
// by `tuned`: a branch on it inside their loops cost the Q4_K dot a few percent.
template <class F>
inline decltype(auto) tuned(F&& f) {
  return kTune.intel ? f(std::true_type{}) : f(std::false_type{});
}

// How far ahead (elements) a bf16 row asks for weight lines. A line past the end of a matrix is only
// a hint: prefetches never fault. (2K-16K elements ahead were tried: 4K was best or tied.)
constexpr int64_t kPrefetchAhead = 4096;
// On an Intel core, weight lines this many bytes ahead (already asked into the second level) are
// moved on into the first.
constexpr int64_t kNearPrefetchBytes = 512;
// How far ahead (bytes) a quantized row asks for its lines.
template <bool kIntel>
constexpr int64_t kBlockAhead = kIntel ? 4096 : 256;

// A weight line far ahead of the one being read.
template <bool kIntel>
inline void prefetch_far(const void* p) {
#if defined(MOESCOPE_X86)
  _mm_prefetch(static_cast<const char*>(p), kIntel ? _MM_HINT_T1 : _MM_HINT_NTA);
#else
  __builtin_prefetch(p, 0, 0);
#endif
}

// A line about to be read, into the first-level cache.
inline void prefetch_near(const void* p) {
#if defined(MOESCOPE_X86)
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// The block kBlockAhead bytes past `block` (`bytes` long): on an Intel core every line of it (the
// first line alone left the rest of a K-quant block to the hardware prefetchers and streamed Q4_K
// rows slower), with the lines kNearPrefetchBytes ahead moved on into the first level; elsewhere
// its first line.
template <bool kIntel>
inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  const uint8_t* ahead = block + kBlockAhead<kIntel>;
  if constexpr (kIntel) {
    for (int64_t line = 0; line < bytes; line += 64) {
      prefetch_far<true>(ahead + line);
      prefetch_near(block + kNearPrefetchBytes + line);
    }
  } else {
    (void)bytes;
    prefetch_far<false>(ahead);
  }
}

}  // namespace moescope
