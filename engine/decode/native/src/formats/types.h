// The weight formats the kernels read, and each one's block: the one table of their sizes
// (engine/formats/blocks.py holds the same numbers for the Python side; tests/test_native_library.py
// checks the two against each other through the library's moescope_format_traits).
#pragma once

#include <cstdint>

namespace moescope {

// GGML type ids (gguf.GGMLQuantizationType); 0 here means plain bf16, and kFP8 is MoEScope's own
// row blocks of block-wise FP8 checkpoints (engine/formats/blocks.py: a float32 scale, 128 e4m3).
enum WeightType : int32_t {
  kBF16 = 0, kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ6_K = 14, kMXFP4 = 39, kFP8 = 200
};

struct FormatTraits {
  int32_t type;
  const char* name;
  int64_t elements;  // per block
  int64_t bytes;     // per block
};

inline constexpr FormatTraits kFormats[] = {
    {kQ4_0, "q4_0", 32, 18}, {kQ5_0, "q5_0", 32, 22}, {kQ8_0, "q8_0", 32, 34},  {kQ2_K, "q2_k", 256, 84},
    {kQ3_K, "q3_k", 256, 110}, {kQ4_K, "q4_k", 256, 144}, {kQ6_K, "q6_k", 256, 210}, {kMXFP4, "mxfp4", 32, 17},
    {kFP8, "fp8", 128, 132},
};

// The traits of a block type by its id, looked up in one load (the kernels ask per row).
struct FormatIndex {
  FormatTraits by_id[256] = {};
  constexpr FormatIndex() {
    for (const FormatTraits& f : kFormats) by_id[f.type] = f;
  }
};
inline constexpr FormatIndex kFormatIndex{};

// nullptr for bf16 and unknown ids
constexpr const FormatTraits* format_traits(int32_t type) {
  if (type <= 0 || type > 255 || kFormatIndex.by_id[type].elements == 0) return nullptr;
  return &kFormatIndex.by_id[type];
}

// Elements and bytes per block of each type (0 for an unknown one).
constexpr int64_t block_elements(int32_t type) { return type > 0 && type < 256 ? kFormatIndex.by_id[type].elements : 0; }
constexpr int64_t block_bytes(int32_t type) { return type > 0 && type < 256 ? kFormatIndex.by_id[type].bytes : 0; }

// The K-quants: their sub-block scales weight int8 products, so their integer dots multiply both
// 8-bit planes of a 16-bit input, and an 8-bit input (--int8-inputs) takes half the products.
constexpr bool has_two_plane_dot(int32_t type) { return type == kQ4_K || type == kQ6_K || type == kQ3_K || type == kQ2_K; }

// A weight matrix [rows, cols] as the kernels read it: bf16 rows, or rows of quantized blocks.
struct Matrix {
  const uint8_t* data = nullptr;
  int32_t type = kBF16;
  int64_t rows = 0, cols = 0, row_bytes = 0;

  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
};

}  // namespace moescope
