// Element types and exact scalar conversions.
//
// BF16 conversion rounds to nearest, ties to even; NaN stays NaN (quiet, sign kept); values
// beyond the BF16 range round to infinity as IEEE rounding does. FP8 is E4M3 "fn" (no
// infinities, 0x7F/0xFF are NaN, largest finite value 448): conversion rounds to nearest even
// and saturates, so every finite or infinite input beyond +-448 becomes +-448 and NaN stays NaN.
// Subnormals are kept in both formats. All functions are pure and exact for every input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace moe_ep {

enum class DType : std::uint8_t {
  kBool,
  kUInt8,
  kInt32,
  kInt64,
  kBF16,
  kFP32,
  kFP8E4M3,  // float8_e4m3fn
};

constexpr std::size_t element_size(DType t) {
  switch (t) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kFP8E4M3:
      return 1;
    case DType::kBF16:
      return 2;
    case DType::kInt32:
    case DType::kFP32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t);

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- BF16 -------------------------------------------------------------------------------------

inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}
inline float bf16_to_float(std::uint16_t b) { return bits_float(static_cast<std::uint32_t>(b) << 16); }

// ---- FP8 E4M3 (fn) ----------------------------------------------------------------------------

inline constexpr float kFp8E4M3Max = 448.0f;

// Branch-free (selects only) so that loops over it vectorize.
inline std::uint8_t float_to_fp8_e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t mag = u & 0x7fffffffu;
  // Normal range: keep 3 of the 23 mantissa bits, round to nearest even on the 20 dropped bits;
  // (biased float exponent << 3 | mantissa) - (120 << 3) rebiases the exponent from 127 to 7.
  const std::uint32_t rounded = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
  const std::uint32_t normal = rounded - (120u << 3);
  // Below 2^-6 the E4M3 values are m * 2^-9, m in [0, 8]: |f| * 512 rounded to an integer
  // (adding 2^23 rounds to nearest even in the default rounding mode; m = 8 is code 0x08).
  const std::uint32_t subnormal = float_bits(bits_float(mag) * 512.0f + 8388608.0f) - 0x4b000000u;
  std::uint32_t code = mag < 0x3c800000u ? subnormal : normal;
  code = mag > 0x43e00000u ? 0x7eu : code;  // beyond 448 (infinity included): saturate
  code = mag > 0x7f800000u ? 0x7fu : code;  // NaN
  return static_cast<std::uint8_t>(sign | code);
}
float fp8_e4m3_to_float(std::uint8_t code);

}  // namespace moe_ep
