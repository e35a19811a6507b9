// Run-time selection of vector kernels: MOE_EP_X86_DISPATCH is defined where AVX2 paths can be
// compiled (x86-64 with GCC or Clang, through target attributes), and has_avx2() says whether
// this CPU runs them. Kernels keep a portable path that gives identical results.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_EP_X86_DISPATCH 1
#include <immintrin.h>
#endif

namespace moe_ep::core {

#ifdef MOE_EP_X86_DISPATCH
inline bool has_avx2() {
  // __builtin_cpu_init: this may run in a shared library's static initialisation, before libgcc's own.
  static const bool avx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return avx2;
}
#endif

}  // namespace moe_ep::core
