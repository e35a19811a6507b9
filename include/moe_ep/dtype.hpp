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

std::uint8_t float_to_fp8_e4m3(float f);
float fp8_e4m3_to_float(std::uint8_t code);

}  // namespace moe_ep
