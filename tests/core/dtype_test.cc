// Exhaustive and edge-case tests of the scalar BF16 and FP8 E4M3 conversions, against references
// written from the format definitions (nearest representable value by search, ties to even).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "moe_ep/dtype.hpp"

namespace moe_ep {
namespace {

// FP8 E4M3fn value of a code from the format definition: sign, 4-bit exponent (bias 7), 3-bit
// mantissa; exponent 0 is subnormal; S.1111.111 is NaN; no infinities.
double fp8_definition(int code) {
  const int sign = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? m * std::pow(2.0, -9) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return sign ? -mag : mag;
}

// Nearest finite FP8 code by exhaustive search; ties go to the even code; saturating.
int fp8_reference_encode(float f) {
  if (std::isnan(f)) return std::signbit(f) ? 0xff : 0x7f;
  const double x = std::clamp(static_cast<double>(f), -448.0, 448.0);  // saturating
  int best = -1;
  double best_err = 0;
  for (int code = 0; code < 256; ++code) {
    const double v = fp8_definition(code);
    if (std::isnan(v)) continue;
    if (v == 0 && (code & 0x80) != (std::signbit(f) ? 0x80 : 0)) continue;  // keep the sign of zero
    const double err = std::fabs(v - x);
    if (best < 0 || err < best_err || (err == best_err && (code & 1) == 0 && (best & 1) == 1)) {
      best = code;
      best_err = err;
    }
  }
  return best;
}

TEST(Fp8, DecodesEveryCodeAsTheFormatDefines) {
  for (int code = 0; code < 256; ++code) {
    const double expected = fp8_definition(code);
    const float got = fp8_e4m3_to_float(static_cast<std::uint8_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), expected) << "code " << code;
    }
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8, EveryFiniteCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float v = fp8_e4m3_to_float(static_cast<std::uint8_t>(code));
    EXPECT_EQ(float_to_fp8_e4m3(v), code) << "code " << code << " value " << v;
  }
}

TEST(Fp8, MidpointsTieToEvenAndNeighboursRoundToNearest) {
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = fp8_e4m3_to_float(static_cast<std::uint8_t>(code));
    const float hi = fp8_e4m3_to_float(static_cast<std::uint8_t>(code + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);  // exact in float
    for (float sign : {1.0f, -1.0f}) {
      const int s = sign < 0 ? 0x80 : 0;
      const int even = (code & 1) == 0 ? code : code + 1;
      EXPECT_EQ(float_to_fp8_e4m3(sign * mid), s | even) << "midpoint of " << code;
      EXPECT_EQ(float_to_fp8_e4m3(sign * std::nextafter(mid, 0.0f)), s | code);
      EXPECT_EQ(float_to_fp8_e4m3(sign * std::nextafter(mid, 1e9f)), s | (code + 1));
    }
  }
}

TEST(Fp8, SaturatesInfinityAndLargeValuesAndKeepsNaN) {
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(449.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7e);  // would round to 480, which does not exist
  EXPECT_EQ(float_to_fp8_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0xff);
  EXPECT_EQ(float_to_fp8_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(-0.0f), 0x80);
  // Float denormals and values below half the smallest FP8 subnormal flush to signed zero.
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(-std::ldexp(1.0f, -11)), 0x80);
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -10)), 0x00);             // exact tie with 0 -> even (0)
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.5f, -10)), 0x01);
}

TEST(Fp8, MatchesExhaustiveSearchOnRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::uniform_real_distribution<float> small(-500.0f, 500.0f);
  for (int i = 0; i < 20000; ++i) {
    float f = i % 2 ? small(rng) : bits_float(bits(rng));
    if (i % 4 == 3) f = std::ldexp(small(rng) / 500.0f, -(static_cast<int>(bits(rng) % 12)));
    ASSERT_EQ(float_to_fp8_e4m3(f), fp8_reference_encode(f)) << "input " << f;
  }
}

// BF16 reference: choose between the two neighbours by exact double arithmetic, ties to even.
std::uint16_t bf16_reference(float f) {
  const std::uint32_t u = float_bits(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const std::uint32_t lo = u & 0xffff0000u;
  const std::uint32_t hi = lo + 0x10000u;
  const double dlo = std::fabs(static_cast<double>(bits_float(lo)) - f);
  const double dhi = std::isinf(bits_float(hi)) && !std::isinf(f)
                         ? std::fabs(std::ldexp(1.0, 128) * (f < 0 ? -1 : 1) - f)
                         : std::fabs(static_cast<double>(bits_float(hi)) - f);
  if (dlo < dhi) return static_cast<std::uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<std::uint16_t>(hi >> 16);
  return static_cast<std::uint16_t>(((lo >> 16) & 1) == 0 ? lo >> 16 : hi >> 16);
}

TEST(Bf16, EveryCodeRoundTripsThroughFloat) {
  for (std::uint32_t code = 0; code < 65536; ++code) {
    const float f = bf16_to_float(static_cast<std::uint16_t>(code));
    EXPECT_EQ(float_bits(f), code << 16);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f))));
    } else {
      EXPECT_EQ(float_to_bf16(f), code);
    }
  }
}

TEST(Bf16, TiesRoundToEven) {
  // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: goes to 1 (even mantissa).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  for (std::uint32_t hi = 0; hi < 0x7f80; hi += 37) {
    const float tie = bits_float((hi << 16) | 0x8000u);
    EXPECT_EQ(float_to_bf16(tie), (hi & 1) ? hi + 1 : hi) << hi;
    EXPECT_EQ(float_to_bf16(-tie), 0x8000 | ((hi & 1) ? hi + 1 : hi)) << hi;
  }
}

TEST(Bf16, SpecialValues) {
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to infinity
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling-NaN payload confined to the low bits must not turn into infinity.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0xff800001u)))));
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_bf16(bits_float(0x00018000u)), 0x0002);  // subnormal tie, odd -> up
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
}

TEST(Bf16, MatchesReferenceOnRandomBitPatterns) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = bits_float(bits(rng));
    const std::uint16_t got = float_to_bf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(got)));
    } else {
      ASSERT_EQ(got, bf16_reference(f)) << float_bits(f);
    }
  }
}

}  // namespace
}  // namespace moe_ep
