// Element types and exact scalar conversions.
//
// BF16 conversion rounds to nearest, ties to even; NaN stays NaN (quiet, sign kept); values
// beyond the BF16 range round to infinity as IEEE rounding does. FP8 is E4M3 "fn" (no
// infinities, 0x7F/0xFF are NaN, largest finite value 448): conversion rounds to nearest even
// and saturates, so every finite or infinite input beyond +-448 becomes +-448 and NaN stays NaN.
// Subnormals are kept in both formats. All functions are pure and exact for every input.
// float16, int8 and int16 exist as payload types: dispatch moves their bytes unchanged and
// nothing here converts them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
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
  kFP16,     // IEEE binary16 (torch.float16); a payload type, never converted
  kInt8,
  kInt16,
};

constexpr std::size_t element_size(DType t) {
  switch (t) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kFP8E4M3:
    case DType::kInt8:
      return 1;
    case DType::kBF16:
    case DType::kFP16:
    case DType::kInt16:
      return 2;
    case DType::kInt32:
    case DType::kFP32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

// The one table of dtype names: torch's (and numpy's) name of each DType ("bfloat16",
// "float8_e4m3fn", ...). all_dtypes() lists every DType in the order messages name them, which
// dtype_names() spells out: "bfloat16, float16, float32, float8_e4m3fn, int8, int16, int32,
// int64, uint8 or bool". parse_dtype is dtype_name's inverse; any other name is InvalidArgument
// "<context>: dtype '<name>' is not one of <dtype_names()>".
std::span<const DType> all_dtypes();
std::string_view dtype_name(DType t);
std::string dtype_names();
DType parse_dtype(std::string_view name, std::string_view context);

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

// ---- FP4 E2M1 and UE8M0 (NVFP4: docs/quantized-formats.md) -----------------------------------
// E2M1 codes are 4 bits: sign in bit 3, magnitude index 0..7 for {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
enum class E2M1Rounding : std::uint8_t {
  kNearestEven,  // nearest value, ties to the even code; above 6 (and infinity) saturates to 6
  kSm90,         // DeepEP's software fallback before SM100: thresholds at geometric midpoints
};
// NaN becomes magnitude 6 with the NaN's sign bit (E2M1 has no NaN). Negative zero keeps its sign.
inline std::uint8_t float_to_e2m1(float f, E2M1Rounding rounding = E2M1Rounding::kNearestEven) {
  const std::uint32_t u = float_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 28) & 0x8u);
  const float m = bits_float(u & 0x7fffffffu);
  if (m != m) return sign | 7u;  // NaN
  std::uint8_t code;
  if (rounding == E2M1Rounding::kNearestEven) {
    // Midpoints 0.25 .. 5 between neighbours; a tie goes to the even code (index).
    code = static_cast<std::uint8_t>((m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) +
                                     (m >= 3.5f) + (m > 5.0f));
  } else {
    constexpr float kSqrt2 = 1.41421356237309505f, k2Sqrt2 = 2.82842712474619010f, k4Sqrt2 = 5.65685424949238020f;
    if (m < 0.5f) code = 0;
    else if (m < 1.0f) code = 1;
    else if (m < 2.0f) code = m > kSqrt2 ? 3 : 2;
    else if (m < 4.0f) code = m > k2Sqrt2 ? 5 : 4;
    else code = m > k4Sqrt2 ? 7 : 6;
  }
  return static_cast<std::uint8_t>(sign | code);
}
inline float e2m1_to_float(std::uint8_t code) {
  constexpr float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kValues[code & 7u];
  return (code & 8u) ? -v : v;
}
// The UE8M0 byte (biased exponent, value 2^(b - 127)) of the smallest power of two >= f, for
// f >= 0: 0 for f <= 2^-127 (zero included), saturating at 254 (2^127) for larger values and
// infinity; NaN and negative inputs give 0xff (the format's NaN).
inline std::uint8_t float_to_ue8m0_ceil(float f) {
  if (!(f >= 0.0f)) return 0xffu;  // NaN or negative
  const std::uint32_t u = float_bits(f) & 0x7fffffffu;  // -0 is 0
  const std::uint32_t exponent = u >> 23;
  if (exponent == 0xffu) return 254u;      // infinity
  if (exponent == 0) {                     // zero or subnormal: <= 2^-127 -> 0, else 2^-126 -> 1
    return u <= (1u << 22) ? 0u : 1u;      // 2^-127 is the subnormal 1 << 22
  }
  const std::uint32_t b = exponent + ((u & 0x7fffffu) != 0 ? 1u : 0u);
  return static_cast<std::uint8_t>(b > 254u ? 254u : b);
}

}  // namespace moe_ep
