// Integer rounding shared by every layer, the CUDA provider's device code included.
//
// ceil_div(x, d) is x / d rounded up; round_up(x, m) is the least multiple of m that is >= x.
// Both compute in x's type (the divisor or multiple is converted to it), for x >= 0 and d, m > 0;
// like the plain expression (x + d - 1) / d they do not check for overflow: a caller whose x may
// come close to its type's maximum checks first (agrs_sessions.cc, engram_store.cc compute in
// __int128). constexpr and, under nvcc, __host__ __device__, so kernels and host code call the
// same function.
#pragma once

#include <type_traits>

#if defined(__CUDACC__)
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif

namespace moe_ep::core {

template <class T>
MOE_EP_HOST_DEVICE constexpr T ceil_div(T x, std::type_identity_t<T> d) {
  return (x + d - 1) / d;
}

template <class T>
MOE_EP_HOST_DEVICE constexpr T round_up(T x, std::type_identity_t<T> m) {
  return ceil_div(x, m) * m;
}

}  // namespace moe_ep::core
