#include "core/reduce.hh"

#include <cstring>

#include "moe_ep/dtype.hpp"

// Vector paths: the same scalar code compiled for AVX2 and selected at run time. Every path does
// the same FP32 operations in the same order; -ffp-contract is off for this file (no FMA fusion).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_EP_X86_DISPATCH 1
#endif

namespace moe_ep::core {
namespace {

constexpr std::int64_t kChunk = 512;

inline __attribute__((always_inline)) float widen(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

inline __attribute__((always_inline)) std::uint16_t narrow(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline __attribute__((always_inline)) void sum_impl(std::span<const std::uint16_t* const> inputs, std::uint16_t* out,
                                                   std::int64_t hidden) {
  float acc[kChunk];
  for (std::int64_t h0 = 0; h0 < hidden; h0 += kChunk) {
    const std::int64_t n = hidden - h0 < kChunk ? hidden - h0 : kChunk;
    if (inputs.empty()) {
      for (std::int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
    } else {
      const std::uint16_t* first = inputs[0] + h0;
      for (std::int64_t i = 0; i < n; ++i) acc[i] = widen(first[i]);
    }
    for (std::size_t r = 1; r < inputs.size(); ++r) {
      const std::uint16_t* p = inputs[r] + h0;
      for (std::int64_t i = 0; i < n; ++i) acc[i] += widen(p[i]);
    }
    for (std::int64_t i = 0; i < n; ++i) out[h0 + i] = narrow(acc[i]);
  }
}

inline __attribute__((always_inline)) void weighted_impl(std::span<const std::uint16_t* const> inputs,
                                                        std::span<const float> weights, std::uint16_t* out,
                                                        std::int64_t hidden) {
  float acc[kChunk];
  for (std::int64_t h0 = 0; h0 < hidden; h0 += kChunk) {
    const std::int64_t n = hidden - h0 < kChunk ? hidden - h0 : kChunk;
    for (std::int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
    for (std::size_t r = 0; r < inputs.size(); ++r) {
      const std::uint16_t* p = inputs[r] + h0;
      const float w = weights[r];
      if (r == 0) {
        for (std::int64_t i = 0; i < n; ++i) acc[i] = w * widen(p[i]);
      } else {
        for (std::int64_t i = 0; i < n; ++i) {
          const float product = w * widen(p[i]);
          acc[i] += product;
        }
      }
    }
    for (std::int64_t i = 0; i < n; ++i) out[h0 + i] = narrow(acc[i]);
  }
}

void sum_generic(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden) {
  sum_impl(inputs, out, hidden);
}
void weighted_generic(std::span<const std::uint16_t* const> inputs, std::span<const float> weights,
                      std::uint16_t* out, std::int64_t hidden) {
  weighted_impl(inputs, weights, out, hidden);
}

#ifdef MOE_EP_X86_DISPATCH
__attribute__((target("avx2"))) void sum_avx2(std::span<const std::uint16_t* const> inputs, std::uint16_t* out,
                                              std::int64_t hidden) {
  sum_impl(inputs, out, hidden);
}
__attribute__((target("avx2"))) void weighted_avx2(std::span<const std::uint16_t* const> inputs,
                                                   std::span<const float> weights, std::uint16_t* out,
                                                   std::int64_t hidden) {
  weighted_impl(inputs, weights, out, hidden);
}
const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#endif

}  // namespace

void sum_bf16_rows(std::span<const std::uint16_t* const> inputs, std::uint16_t* out, std::int64_t hidden) {
#ifdef MOE_EP_X86_DISPATCH
  if (kHasAvx2) return sum_avx2(inputs, out, hidden);
#endif
  sum_generic(inputs, out, hidden);
}

void weighted_sum_bf16_rows(std::span<const std::uint16_t* const> inputs, std::span<const float> weights,
                            std::uint16_t* out, std::int64_t hidden) {
#ifdef MOE_EP_X86_DISPATCH
  if (kHasAvx2) return weighted_avx2(inputs, weights, out, hidden);
#endif
  weighted_generic(inputs, weights, out, hidden);
}

void copy_bytes(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }

}  // namespace moe_ep::core
