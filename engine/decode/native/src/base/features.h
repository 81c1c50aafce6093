// What a variant's instruction set offers, named once from the compiler's flags.
//
// Every kernel tests these names, never the compiler's own macros, so that a variant is defined by
// its flags alone (CMakeLists.txt) and a new instruction set is one block here plus a folder in
// arch/. The library of each variant is chosen at run time from the CPU's features (cpu_probe.cpp).
#pragma once

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define MOESCOPE_X86 1
#include <immintrin.h>
// The widest float path: AVX-512 with BF16 dot products, AVX-512 without them, or AVX2 with FMA.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MOESCOPE_AVX512BF16 1
#elif defined(__AVX512F__)
#define MOESCOPE_AVX512F 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MOESCOPE_AVX2 1
#endif
// 256-bit integer lanes (every AVX2 or AVX-512 build): the integer dots and tiles use them.
#if defined(__AVX2__) && defined(__FMA__)
#define MOESCOPE_AVX2_INT 1
#endif
// AMX tiles for a prompt's bf16 products, beside the bf16 dot products; used only where the CPU and
// the OS grant them (arch/x86/prompt_amx.h asks at run time).
#if defined(MOESCOPE_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MOESCOPE_AMX 1
#endif
#elif defined(__aarch64__) || defined(_M_ARM64)
#define MOESCOPE_ARM 1
#include <arm_neon.h>
#define MOESCOPE_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define MOESCOPE_DOTPROD 1  // SDOT/UDOT: four int8 products into an int32 lane
#endif
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#define MOESCOPE_NEON_BF16 1  // BFDOT/BFMMLA
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define MOESCOPE_I8MM 1
#endif
#endif
