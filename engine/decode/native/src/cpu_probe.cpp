// Which of the variants' instruction-set features this CPU and OS offer, as space-separated names
// (Linux /proc/cpuinfo's spelling). Built for the architecture's baseline, apart from the variant
// libraries: loading one of those on a CPU that lacks its features may already fault (the compiler
// is free to use them in static initializers), so the loader asks this library first.
#include <cstdint>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#include "include/moescope_cpu.h"

namespace {

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xgetbv0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

std::string probe() {
  std::string out;
  auto add = [&](bool present, const char* name) {
    if (present) (out += name) += ' ';
  };
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return out;
  const unsigned c1 = c;
  add(c1 & (1u << 9), "ssse3");
  add(c1 & (1u << 19), "sse4_1");
  add(c1 & (1u << 20), "sse4_2");
  add(c1 & (1u << 23), "popcnt");
  const bool osxsave = c1 & (1u << 27);
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool ymm = (xcr0 & 0x6) == 0x6;             // the OS saves SSE and AVX state
  const bool zmm = ymm && (xcr0 & 0xE0) == 0xE0;    // and the AVX-512 state
  const bool tiles = (xcr0 & 0x60000) == 0x60000;   // and the AMX tile state
  add(ymm && (c1 & (1u << 28)), "avx");
  add(ymm && (c1 & (1u << 12)), "fma");
  add(ymm && (c1 & (1u << 29)), "f16c");
  unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) b7 = b, c7 = c, d7 = d;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) a71 = a;
  add(b7 & (1u << 3), "bmi1");
  add(b7 & (1u << 8), "bmi2");
  add(ymm && (b7 & (1u << 5)), "avx2");
  add(ymm && (a71 & (1u << 4)), "avx_vnni");
  add(zmm && (b7 & (1u << 16)), "avx512f");
  add(zmm && (b7 & (1u << 17)), "avx512dq");
  add(zmm && (b7 & (1u << 28)), "avx512cd");
  add(zmm && (b7 & (1u << 30)), "avx512bw");
  add(zmm && (b7 & (1u << 31)), "avx512vl");
  add(zmm && (c7 & (1u << 11)), "avx512_vnni");
  add(zmm && (a71 & (1u << 5)), "avx512_bf16");
  add(tiles && (d7 & (1u << 24)), "amx_tile");
  add(tiles && (d7 & (1u << 22)), "amx_bf16");
  add(tiles && (d7 & (1u << 25)), "amx_int8");
  return out;
}
#elif defined(__aarch64__)
std::string probe() {
  std::string out = "asimd ";
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (hw & (1ul << 20)) out += "asimddp ";  // HWCAP_ASIMDDP
  if (hw & (1ul << 22)) out += "sve ";      // HWCAP_SVE
  if (hw2 & (1ul << 14)) out += "bf16 ";    // HWCAP2_BF16
  if (hw2 & (1ul << 13)) out += "i8mm ";    // HWCAP2_I8MM
#elif defined(__APPLE__)
  auto has = [](const char* name) {
    int value = 0;
    size_t size = sizeof(value);
    return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
  };
  if (has("hw.optional.arm.FEAT_DotProd")) out += "asimddp ";
  if (has("hw.optional.arm.FEAT_BF16")) out += "bf16 ";
  if (has("hw.optional.arm.FEAT_I8MM")) out += "i8mm ";
#endif
  return out;
}
#else
std::string probe() { return ""; }
#endif

}  // namespace

extern "C" const char* moescope_cpu_features(void) {
  static const std::string features = probe();
  return features.c_str();
}
