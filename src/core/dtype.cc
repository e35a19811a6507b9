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
    case DType::kFP16:
      return "float16";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
  }
  return "?";
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
