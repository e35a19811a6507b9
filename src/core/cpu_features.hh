// Run-time selection of vector kernels: MOE_EP_X86_DISPATCH is defined where AVX2 paths can be
// compiled (x86-64 with GCC or Clang, through target attributes), and has_avx2() (has_avx512())
// says whether this CPU runs them. Kernels keep a portable path that gives identical results.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_EP_X86_DISPATCH 1
#include <immintrin.h>
#endif

namespace moe_ep::core {

// The instruction sets a kernel with several paths can be asked to run on (tests and benchmarks
// compare them; the kernels themselves take the widest the CPU has).
enum class Isa { kPortable, kAvx2, kAvx512 };

#ifdef MOE_EP_X86_DISPATCH
inline bool has_avx2() {
  // __builtin_cpu_init: this may run in a shared library's static initialisation, before libgcc's own.
  static const bool avx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return avx2;
}
// AVX-512 Foundation, Byte/Word and Doubleword/Quadword instructions (the LogFMT kernels).
inline bool has_avx512() {
  static const bool avx512 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") &&
                                                        __builtin_cpu_supports("avx512bw") &&
                                                        __builtin_cpu_supports("avx512dq"));
  return avx512;
}
#endif

}  // namespace moe_ep::core
