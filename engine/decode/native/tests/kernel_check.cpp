// kernel_check: holds each variant library named on the command line to the reference, through
// its C ABI only (dlopen), so that one program built at the architecture's baseline checks every
// variant, including ones built for instruction sets the build machine lacks (run under an emulator).
//
// For every block type of formats/types.h and plain bf16 it makes random rows (valid scale fields)
// and random bf16 inputs, and checks
//   - moescope_gemv with the integer dots on and off against sum_i w_i * x_i in double, w_i the
//     reference's bf16 weights: |ours - ref| <= 0.02 * sum_i |w_i x_i| + 1e-3 per row, and past the
//     output's bf16 rounding within 1e-4 of sum_i |w_i x_i| (a wrong sub-block or scale breaks it);
//   - for the K-quants, moescope_gemv with the opt-in 8-bit inputs against the same sum with x
//     rounded as they round it (per 256 values, levels of max|x| / 127), to the same bounds;
//   - moescope_dequantize (bf16 and float32) against the reference weights, bit for bit.
// The reference is formats/blocks.h compiled into this program: build it with -ffp-contract=off,
// as the libraries are, so that a weight's product and difference round as the reference's do.
//
//   usage: kernel_check libmoescope_kernels_<variant>.so...
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../src/base/scalar.h"
#include "../src/formats/blocks.h"
#include "../src/formats/types.h"
#include "../src/include/moescope_kernels.h"

namespace {

using namespace moescope;

struct Api {
  decltype(&moescope_abi_version) abi_version = nullptr;
  decltype(&moescope_variant) variant = nullptr;
  decltype(&moescope_code_path) code_path = nullptr;
  decltype(&moescope_last_error) last_error = nullptr;
  decltype(&moescope_set_threads) set_threads = nullptr;
  decltype(&moescope_set_integer_dots) set_integer_dots = nullptr;
  decltype(&moescope_set_int8_inputs) set_int8_inputs = nullptr;
  decltype(&moescope_gemv) gemv = nullptr;
  decltype(&moescope_dequantize) dequantize = nullptr;
};

template <class Fn>
bool bind(void* lib, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (fn == nullptr) std::printf("  missing symbol %s\n", name);
  return fn != nullptr;
}

bool load(const char* path, Api& api) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::printf("FAIL %s: dlopen: %s\n", path, dlerror());
    return false;
  }
  bool ok = bind(lib, "moescope_abi_version", api.abi_version) && bind(lib, "moescope_variant", api.variant) &&
            bind(lib, "moescope_code_path", api.code_path) && bind(lib, "moescope_last_error", api.last_error) &&
            bind(lib, "moescope_set_threads", api.set_threads) &&
            bind(lib, "moescope_set_integer_dots", api.set_integer_dots) &&
            bind(lib, "moescope_set_int8_inputs", api.set_int8_inputs) && bind(lib, "moescope_gemv", api.gemv) &&
            bind(lib, "moescope_dequantize", api.dequantize);
  if (ok && api.abi_version() != MOESCOPE_ABI_VERSION) {
    std::printf("FAIL %s: ABI %d, this check is for %d\n", path, api.abi_version(), MOESCOPE_ABI_VERSION);
    ok = false;
  }
  return ok;
}

// A fixed-seed generator whose values do not depend on the standard library's distributions.
struct Rng {
  std::mt19937_64 bits{0x6d6f6573636f7065ull};
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(bits() >> 11) * 0x1p-53; }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(bits() % n); }
};

// An fp16 field from a normal-range float (truncated: any stored half is a valid scale).
void put_half(uint8_t* p, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u, exponent = ((bits >> 23) & 0xFF) - 127 + 15, mantissa = (bits >> 13) & 0x3FF;
  const uint16_t half = static_cast<uint16_t>(sign | (exponent << 10) | mantissa);
  std::memcpy(p, &half, 2);
}

float scale_d(Rng& rng) { return static_cast<float>(rng.uniform(0.001, 0.05) * (rng.below(4) == 0 ? -1 : 1)); }

// One block of `type`: random levels, valid scale fields.
void fill_block(int32_t type, uint8_t* b, Rng& rng) {
  for (int64_t i = 0; i < block_bytes(type); ++i) b[i] = static_cast<uint8_t>(rng.below(256));
  switch (type) {
    case kQ4_0: case kQ5_0: case kQ8_0: put_half(b, scale_d(rng)); break;
    case kQ2_K: put_half(b + 80, scale_d(rng)); put_half(b + 82, scale_d(rng)); break;
    case kQ3_K: put_half(b + 108, scale_d(rng)); break;
    case kQ4_K: put_half(b, scale_d(rng)); put_half(b + 2, scale_d(rng)); break;
    case kQ6_K: put_half(b + 208, scale_d(rng)); break;
    case kMXFP4: b[0] = static_cast<uint8_t>(120 + rng.below(11)); break;
    case kFP8: {
      const float s = static_cast<float>(rng.uniform(0.001, 0.01));
      std::memcpy(b, &s, 4);
      for (int i = 4; i < 132; ++i)
        if ((b[i] & 0x7F) == 0x7F) b[i] ^= 1;  // e4m3's NaN codes are no weights
      break;
    }
    default: break;
  }
}

// x: per 256 values a magnitude (the integer dots scale each 256-value chunk on its own), a few
// exact zeros, now and then a chunk of zeros.
std::vector<bf16> random_x(int64_t cols, Rng& rng) {
  static const double kMagnitudes[] = {1.0, 0.01, 100.0, 3.0, 0.0};
  std::vector<bf16> x(cols);
  for (int64_t begin = 0; begin < cols; begin += 256) {
    const double m = kMagnitudes[rng.below(cols > 256 ? 5 : 4)];
    for (int64_t i = begin; i < std::min(cols, begin + 256); ++i)
      x[i] = rng.below(20) == 0 ? 0 : to_bf16(static_cast<float>(rng.uniform(-m, m)));
  }
  return x;
}

// x as the 8-bit inputs round it: per 256 values, nearest(x * 127 / max|x|) * max|x| / 127.
std::vector<double> rounded_to_8_bits(const std::vector<bf16>& x) {
  std::vector<double> out(x.size());
  for (size_t begin = 0; begin < x.size(); begin += 256) {
    const size_t end = std::min(x.size(), begin + 256);
    float amax = 0.f;
    for (size_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (size_t i = begin; i < end; ++i)
      out[i] = std::max(-127.f, std::min(127.f, std::nearbyint(to_float(x[i]) * inv))) * static_cast<double>(amax) / 127.0;
  }
  return out;
}

struct Case {
  int32_t type;
  int64_t rows, cols, row_bytes;
  std::vector<uint8_t> data;
  std::vector<bf16> ref_bf16;   // the reference's weights, rows x cols
  std::vector<float> ref_f32;   // the same before their rounding to bf16 (what integer dots take)
  std::vector<bf16> x;
};

Case make_case(int32_t type, int64_t rows, int64_t cols, bool padded, Rng& rng) {
  Case c{type, rows, cols, 0, {}, {}, {}, {}};
  const int64_t pad = padded ? 64 : 0;
  c.ref_bf16.resize(rows * cols);
  c.ref_f32.resize(rows * cols);
  if (type == kBF16) {
    c.row_bytes = 2 * cols + pad;
    c.data.assign(rows * c.row_bytes, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < cols; ++i) {
        const bf16 w = to_bf16(static_cast<float>(rng.uniform(-1.0, 1.0)));
        std::memcpy(c.data.data() + r * c.row_bytes + 2 * i, &w, 2);
        c.ref_bf16[r * cols + i] = w;
        c.ref_f32[r * cols + i] = to_float(w);
      }
  } else {
    const int64_t be = block_elements(type), bb = block_bytes(type), blocks = cols / be;
    c.row_bytes = blocks * bb + pad;
    c.data.assign(rows * c.row_bytes, 0);
    BlockScales s;
    int32_t q[32];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        uint8_t* b = c.data.data() + r * c.row_bytes + blk * bb;
        fill_block(type, b, rng);
        block_scales(type, b, s);
        for (int g = 0; g < be / 32; ++g) {
          const int64_t at = r * cols + blk * be + 32 * g;
          group_weights(type, b, s, g, c.ref_bf16.data() + at);
          group_levels(type, b, g, q);
          for (int l = 0; l < 32; ++l) {
            const int sub = (32 * g + l) / 16;
            const float product = s.scale[sub] * static_cast<float>(q[l]);
            c.ref_f32[at + l] = product - s.min[sub];
          }
        }
      }
  }
  c.x = random_x(cols, rng);
  return c;
}

struct Worst {
  double brief = 0.0;  // max |ours - ref| / (0.02 * mag + 1e-3): the bound is <= 1
  double rel = 0.0;    // max error beyond the output's bf16 rounding, over sum |w x|
  bool failed = false;
};

// Half a bf16 ulp at v (8 significant bits): what rounding the output to bf16 may move it by.
double half_ulp(double v) {
  int e = 0;
  std::frexp(v, &e);
  return v == 0.0 ? 0.0 : std::ldexp(1.0, e - 9);
}

// One gemv of the case with the library, every row checked; against `xs` where given (the input
// as the library takes it), else x.
void check_gemv(const Api& api, const Case& c, Worst& worst, const char* label, const std::vector<double>* xs = nullptr) {
  ms_matrix m{c.data.data(), c.type, c.rows, c.cols, c.row_bytes};
  std::vector<bf16> y(c.rows, 0xFFFF);
  if (api.gemv(&m, c.x.data(), ms_vector{nullptr, 0}, y.data()) != 0) {
    std::printf("  %s gemv %lldx%lld type %d: error: %s\n", label, static_cast<long long>(c.rows),
                static_cast<long long>(c.cols), c.type, api.last_error());
    worst.failed = true;
    return;
  }
  for (int64_t r = 0; r < c.rows; ++r) {
    double ref_b = 0.0, ref_f = 0.0, mag = 0.0;
    for (int64_t i = 0; i < c.cols; ++i) {
      const double xi = xs != nullptr ? (*xs)[i] : to_float(c.x[i]), wb = to_float(c.ref_bf16[r * c.cols + i]);
      ref_b += wb * xi;
      ref_f += static_cast<double>(c.ref_f32[r * c.cols + i]) * xi;
      mag += std::fabs(wb * xi);
    }
    const double ours = to_float(y[r]);
    const double brief = std::fabs(ours - ref_b) / (0.02 * mag + 1e-3);
    // The integer dots take the weights before their bf16 rounding, the float loops after it: past
    // the output's own rounding, the nearer of the two references is held to float32 sums and the
    // input's fixed point (2^-15 of each 256-value chunk's largest magnitude).
    const double near = std::min(std::fabs(ours - ref_b), std::fabs(ours - ref_f));
    const double excess = std::max(0.0, near - std::max(half_ulp(ours), half_ulp(ref_b)));
    const bool tight = excess <= 1e-4 * mag + 1e-6;
    if (!(brief <= 1.0) || !tight) {
      if (!worst.failed)
        std::printf("  %s type %d %lldx%lld row %lld: ours %.6g, reference %.6g (unrounded weights %.6g), sum|wx| %.6g\n",
                    label, c.type, static_cast<long long>(c.rows), static_cast<long long>(c.cols),
                    static_cast<long long>(r), ours, ref_b, ref_f, mag);
      worst.failed = true;
    }
    worst.brief = std::max(worst.brief, std::isnan(brief) ? 1e30 : brief);
    worst.rel = std::max(worst.rel, mag > 0 ? excess / mag : excess);
  }
}

// moescope_dequantize to bf16 and to float32: the reference's bf16 weights, bit for bit.
int64_t check_dequantize(const Api& api, const Case& c) {
  ms_matrix m{c.data.data(), c.type, c.rows, c.cols, c.row_bytes};
  std::vector<bf16> out(c.rows * c.cols, 0xFFFF);
  std::vector<float> out32(c.rows * c.cols, -1.f);
  if (api.dequantize(&m, out.data(), 0) != 0 || api.dequantize(&m, out32.data(), 1) != 0) {
    std::printf("  dequantize type %d: error: %s\n", c.type, api.last_error());
    return 1;
  }
  int64_t wrong = 0;
  for (int64_t i = 0; i < c.rows * c.cols; ++i) {
    const float expected = to_float(c.ref_bf16[i]);
    wrong += out[i] != c.ref_bf16[i] || std::memcmp(&out32[i], &expected, 4) != 0;
  }
  return wrong;
}

struct Shape {
  int64_t rows, cols;
  bool padded;
};

std::vector<Shape> shapes_of(int32_t type) {
  std::vector<int64_t> cols;
  if (type == kBF16)
    cols = {37, 96, 256, 1000, 1024};  // tails of every length class
  else if (block_elements(type) == 32)
    cols = {96, 256, 1024, 1056};  // a part chunk of the fixed-point input too
  else if (block_elements(type) == 128)
    cols = {128, 384, 1024};
  else
    cols = {256, 1024};
  std::vector<Shape> shapes;
  for (int64_t rows : {1, 7, 64})
    for (int64_t n : cols) shapes.push_back({rows, n, rows == 7});
  return shapes;
}

const char* type_name(int32_t type) { return type == kBF16 ? "bf16" : format_traits(type)->name; }

bool check_library(const char* path) {
  Api api;
  if (!load(path, api)) return false;
  const std::string variant = api.variant();
  std::printf("%s (%s): %s\n", variant.c_str(), api.code_path(), path);
  std::printf("  (worst per type; rel err: error past the output's bf16 rounding over sum|w x|, at most 1e-4;\n"
              "   bound use: |ours - ref| over 0.02 sum|w x| + 1e-3, at most 1)\n");
  api.set_threads(2);
  std::vector<int32_t> types{kBF16};
  for (const FormatTraits& f : kFormats) types.push_back(f.type);
  bool ok = true;
  for (int32_t type : types) {
    Rng rng;  // the same cases for every variant
    Worst on, off, eight;
    int64_t wrong = 0;
    for (const Shape& shape : shapes_of(type)) {
      const Case c = make_case(type, shape.rows, shape.cols, shape.padded, rng);
      api.set_integer_dots(1);
      check_gemv(api, c, on, "integer dots");
      if (has_two_plane_dot(type)) {
        const std::vector<double> rounded = rounded_to_8_bits(c.x);
        api.set_int8_inputs(1);
        check_gemv(api, c, eight, "8-bit inputs", &rounded);
        api.set_int8_inputs(0);
      }
      api.set_integer_dots(0);
      check_gemv(api, c, off, "float loops");
      wrong += check_dequantize(api, c);
    }
    api.set_integer_dots(1);
    const bool pass = !on.failed && !off.failed && !eight.failed && wrong == 0;
    ok = ok && pass;
    char eight_text[64] = "";
    if (has_two_plane_dot(type))
      std::snprintf(eight_text, sizeof eight_text, "  8-bit inputs: rel err %.1e, bound use %.3f", eight.rel, eight.brief);
    std::printf("  %-4s %-6s integer dots: rel err %.1e, bound use %.3f  float loops: rel err %.1e, bound use %.3f  "
                "dequantize: %s%s\n",
                pass ? "ok" : "FAIL", type_name(type), on.rel, on.brief, off.rel, off.brief,
                wrong == 0 ? "exact" : (std::to_string(wrong) + " values differ").c_str(), eight_text);
  }
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", variant.c_str());
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s libmoescope_kernels_<variant>.so...\n", argv[0]);
    return 2;
  }
  int failed = 0;
  for (int i = 1; i < argc; ++i) failed += check_library(argv[i]) ? 0 : 1;
  std::printf("kernel_check: %d of %d variant libraries passed\n", argc - 1 - failed, argc - 1);
  return failed == 0 ? 0 : 1;
}
