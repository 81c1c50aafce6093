// A prompt's bf16 products on AMX tiles (Intel Sapphire Rapids and later), where the CPU and the
// kernel (Linux asks each process to request the tile state) allow them.
//
// Why: a prompt's tile of W is dequantized once
// and multiplied by all of its expert's rows, and with AVX-512 BF16 dot products those products,
// not the dequantization, took most of the time (32 products an instruction). One tile instruction
// makes 16 x 16 x 32 = 8192, so what is left is reading and expanding W. The arithmetic is that of
// the dot products: bf16 pairs multiplied and summed into float32 (the order differs).
//
// Operands (the tile registers, each 16 rows of 64 bytes): A is 16 rows of W, expanded to bf16 with
// `cols` as the row stride; B is 16 input rows of the same 32 columns transposed in pairs (row p
// holds columns 2p and 2p+1 of each input row), which AmxInput packs once per call; the float32
// accumulator C[r][i] is w_r . x_i. Registers: A in 0, up to kAmxGroup inputs in 1.., their
// accumulators in 4.. (one block alone: its odd column groups' A and B in 2 and 3).

#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "../../base/features.h"
#include "../../base/scalar.h"
#include "../../base/simd.h"
#include "../../formats/types.h"
#include "../../kernels/experts.h"
#include "../../kernels/gemv.h"

#if defined(MOESCOPE_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace moescope {

#if defined(MOESCOPE_AMX)
constexpr int64_t kAmxRows = 16;  // rows of W per tile (an accumulator's rows)
constexpr int64_t kAmxBlock = 16;  // input rows per block (an accumulator's columns)
constexpr int kAmxGroup = 3;      // input blocks per pass over a tile of W: 1 + 3 + 3 of the 8 registers

// Tests compare the two paths on one machine; the user never needs to switch.
inline bool& amx_wanted() {
  static bool on = true;
  return on;
}

// Whether the kernel grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA; granted once for the whole process, as oneDNN asks too).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

inline bool amx_on() { return amx_wanted() && amx_granted(); }

// Every register 16 rows of 64 bytes. Loaded at the start of each thread's share: oneDNN, on the
// same threads between our calls, loads configurations of its own.
inline void amx_configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// An expert's input rows as B operands, kAmxBlock rows a block (the last padded with zero rows):
// per block [cols / 32][16 column pairs][16 rows][2].
struct AmxInput {
  const bf16* x = nullptr;
  int64_t k = 0;
  std::vector<int64_t> first;                     // each expert's first block, then the total
  std::vector<std::pair<int64_t, int64_t>> rows;  // each block's first row of x and row count
  std::vector<bf16> packed;

  AmxInput(const bf16* x_, int64_t k_, const std::vector<int64_t>& start, const std::vector<int64_t>& count)
      : x(x_), k(k_) {
    for (size_t e = 0; e < count.size(); ++e) {
      first.push_back(static_cast<int64_t>(rows.size()));
      for (int64_t r = 0; r < count[e]; r += kAmxBlock)
        rows.emplace_back(start[e] + r, std::min<int64_t>(kAmxBlock, count[e] - r));
    }
    first.push_back(static_cast<int64_t>(rows.size()));
    packed.resize(rows.size() * kAmxBlock * k);
  }

  int64_t blocks() const { return static_cast<int64_t>(rows.size()); }
  const bf16* block(int64_t b) const { return packed.data() + b * kAmxBlock * k; }

  // blocks [begin, end) packed from x: a 32-bit transpose of each 16 x 16 pair tile
  void pack(int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint32_t* out = reinterpret_cast<uint32_t*>(packed.data() + b * kAmxBlock * k);
      const auto [row0, n] = rows[b];
      for (int64_t i = 0; i < kAmxBlock; ++i) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(x + (row0 + i) * k);
        for (int64_t p = 0; p < k / 2; ++p) out[(p / 16) * 256 + (p % 16) * 16 + i] = i < n ? src[p] : 0u;
      }
    }
  }
};

// c[j][r][i] = w_r . x_i for the tile's kAmxRows rows of W (bf16, row stride k) and G blocks of
// inputs (c: kAmxGroup accumulators of 16 x 16 floats). One block alone takes two accumulators, the
// even and the odd column groups, summed at the end: in one, each product would wait for the last.
template <int G>
inline void amx_product(const bf16* w, int64_t k, const bf16* const* blocks, float* c) {
  const int64_t groups = k / 32, stride = k * sizeof(bf16);
  if (G == 1) {
    _tile_zero(4);
    _tile_zero(5);
    int64_t kb = 0;
    for (; kb + 2 <= groups; kb += 2) {
      _tile_loadd(0, w + 32 * kb, stride);
      _tile_loadd(1, blocks[0] + 512 * kb, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, w + 32 * (kb + 1), stride);
      _tile_loadd(3, blocks[0] + 512 * (kb + 1), 64);
      _tile_dpbf16ps(5, 2, 3);
    }
    if (kb < groups) {
      _tile_loadd(0, w + 32 * kb, stride);
      _tile_loadd(1, blocks[0] + 512 * kb, 64);
      _tile_dpbf16ps(4, 0, 1);
    }
    _tile_stored(4, c, 64);
    _tile_stored(5, c + 256, 64);
    for (int i = 0; i < 256; i += 16)
      _mm512_store_ps(c + i, _mm512_add_ps(_mm512_load_ps(c + i), _mm512_load_ps(c + 256 + i)));
    return;
  }
  _tile_zero(4);
  _tile_zero(5);
  if (G > 2) _tile_zero(6);
  for (int64_t kb = 0; kb < groups; ++kb) {
    _tile_loadd(0, w + 32 * kb, stride);
    _tile_loadd(1, blocks[0] + 512 * kb, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, blocks[1] + 512 * kb, 64);
    _tile_dpbf16ps(5, 0, 2);
    if (G > 2) {
      _tile_loadd(3, blocks[2] + 512 * kb, 64);
      _tile_dpbf16ps(6, 0, 3);
    }
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
  if (G > 2) _tile_stored(6, c + 512, 64);
}

// Rows at[] of W (kAmxRows) as A operands, bf16 rows with stride cols: a bf16 W's own rows where
// they are consecutive, else expanded into `expanded`.
inline const bf16* amx_rows(const Matrix& m, const int64_t* at, bf16* expanded) {
  bool consecutive = m.type == kBF16;
  for (int64_t j = 1; j < kAmxRows && consecutive; ++j) consecutive = at[j] == at[0] + j;
  if (consecutive) return reinterpret_cast<const bf16*>(m.row(at[0]));
  for (int64_t j = 0; j < kAmxRows; ++j) dequantize_rows(m, at[j], at[j] + 1, expanded + j * m.cols, at[j]);
  return expanded;
}

// The tile's rows (amx_rows' `w`) times expert e's input blocks (its rows from `first`), a block at
// a time: emit_block(i0, n, c) for inputs first + i0 .. first + i0 + n - 1, c[r * 16 + i] = x_(i0 + i) . w_r.
template <class EmitBlock>
inline void amx_tile_times_rows(const bf16* w, const AmxInput& in, int64_t e, int64_t first, EmitBlock&& emit_block) {
  alignas(64) float c[kAmxGroup * 256];
  for (int64_t b0 = in.first[e]; b0 < in.first[e + 1]; b0 += kAmxGroup) {
    const int64_t g = std::min<int64_t>(kAmxGroup, in.first[e + 1] - b0);
    const bf16* blocks[kAmxGroup];
    for (int64_t j = 0; j < kAmxGroup; ++j) blocks[j] = in.block(b0 + std::min(j, g - 1));
    switch (g) {
      case 1: amx_product<1>(w, in.k, blocks, c); break;
      case 2: amx_product<2>(w, in.k, blocks, c); break;
      default: amx_product<3>(w, in.k, blocks, c);
    }
    for (int64_t j = 0; j < g; ++j) emit_block(in.rows[b0 + j].first - first, in.rows[b0 + j].second, c + 256 * j);
  }
}

// Input i's sums in a block, lane r = row r of W.
inline __m512 amx_column(const float* c, int64_t i) {
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  return _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(i))), c, 4);
}

// Rows `offset` / 16 .. + 7 of W for inputs i (lanes 0-7) and i1 (lanes 8-15): with offsets 0 and
// 128, the gate and the up halves of a gate/up tile for two inputs.
inline __m512 amx_half_columns(const float* c, int64_t i, int64_t i1, int offset) {
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 0, 16, 32, 48, 64, 80, 96, 112);
  const __m512i at = _mm512_add_epi32(
      rows, _mm512_inserti64x4(_mm512_set1_epi32(static_cast<int>(i + offset)),
                               _mm256_set1_epi32(static_cast<int>(i1 + offset)), 1));
  return _mm512_i32gather_ps(at, c, 4);
}

// 16 lanes rounded to bf16 (and widened back), as round_bf16 each.
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// bf16 values at p where `keep` has a bit (0 elsewhere), widened to float32.
inline __m512 widen_bf16_masked(const bf16* p, __mmask16 keep) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}

// activate() in 16 lanes, with each lane's gate and up bias (or none): the same ops and roundings
// (exp16 for std::exp; min and max ordered as std::min and std::max, so a NaN goes where theirs does).
inline __m256i activate16(const GateRecipe& r, __m512 g, __m512 u, const float* gate_bias, const float* up_bias) {
  g = round16(g), u = round16(u);
  if (gate_bias != nullptr) {
    g = round16(_mm512_add_ps(g, _mm512_load_ps(gate_bias)));
    u = round16(_mm512_add_ps(u, _mm512_load_ps(up_bias)));
  }
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  if (!r.clamped_swiglu) {
    const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, g)))));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u));
  }
  const __m512 limit = _mm512_set1_ps(static_cast<float>(r.limit));
  g = _mm512_min_ps(limit, g);
  u = _mm512_max_ps(_mm512_min_ps(limit, u), _mm512_sub_ps(zero, limit));
  const __m512 scaled = round16(_mm512_mul_ps(g, _mm512_set1_ps(static_cast<float>(r.alpha))));
  const __m512 sigmoid = round16(_mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, scaled)))));
  const __m512 glu = round16(_mm512_mul_ps(g, sigmoid));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round16(_mm512_add_ps(u, one)), glu));
}
#else
constexpr int64_t kAmxRows = 0;
struct AmxInput {};  // no tiles in this variant: never made
inline bool amx_on() { return false; }
#endif

}  // namespace moescope
