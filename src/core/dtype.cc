#include "moe_ep/dtype.hpp"

#include <cmath>
#include <limits>

namespace moe_ep {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBF16:
      return "bfloat16";
    case DType::kFP32:
      return "float32";
    case DType::kFP8E4M3:
      return "float8_e4m3fn";
  }
  return "?";
}

std::uint8_t float_to_fp8_e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7f;               // NaN
  if (mag > float_bits(kFp8E4M3Max)) return sign | 0x7e;   // saturate (includes infinity)
  if (mag < 0x3c800000u) {                                 // below 2^-6: subnormal range
    // Subnormal E4M3 values are m * 2^-9, m in [0, 8]; m = 8 is the smallest normal (code 0x08).
    // a * 512 is exact in float, and nearbyint rounds half to even in the default mode.
    const float scaled = bits_float(mag) * 512.0f;
    return sign | static_cast<std::uint8_t>(std::nearbyint(scaled));
  }
  // Normal: keep 3 of the 23 mantissa bits, round to nearest even on the dropped 20 bits.
  const std::uint32_t rounded = (mag + 0x7ffffu + ((mag >> 20) & 1u)) & ~0xfffffu;
  const int exponent = static_cast<int>(rounded >> 23) - 127 + 7;
  const std::uint32_t mantissa = (rounded >> 20) & 7u;
  // rounded <= 448 here (448 = exponent 15, mantissa 6), so no overflow into the NaN code.
  return sign | static_cast<std::uint8_t>((exponent << 3) | mantissa);
}

float fp8_e4m3_to_float(std::uint8_t code) {
  const bool negative = code & 0x80;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 7;
  float magnitude;
  if (exponent == 0xf && mantissa == 7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return negative ? -magnitude : magnitude;
}

}  // namespace moe_ep
