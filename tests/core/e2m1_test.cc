// FP4 E2M1 and UE8M0 conversions (moe_ep/dtype.hpp) against the search definitions of
// tests/reference: every BF16 value, every tie and its float neighbours, random float bit
// patterns, and the special values, for both E2M1 roundings.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "moe_ep/dtype.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

namespace ref = reference;

// Every value the conversions are checked on.
std::vector<float> probe_values() {
  std::vector<float> v;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) v.push_back(ref::float_of(b << 16));  // every BF16 value
  // Ties and thresholds of both roundings, their float neighbours, and their negatives.
  const float points[] = {0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f, 6.0f,
                          static_cast<float>(std::sqrt(2.0)), static_cast<float>(2 * std::sqrt(2.0)),
                          static_cast<float>(4 * std::sqrt(2.0)), 0x1p-127f, 0x1p-126f, 0x1p127f};
  for (float p : points)
    for (float q : {p, std::nextafter(p, 0.0f), std::nextafter(p, 1e30f)}) {
      v.push_back(q);
      v.push_back(-q);
    }
  std::mt19937 gen(12345);
  for (int i = 0; i < 1 << 20; ++i) v.push_back(ref::float_of(static_cast<std::uint32_t>(gen())));
  for (float s : {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()})
    v.push_back(s);
  return v;
}

TEST(E2M1, NearestEvenMatchesTheSearchDefinition) {
  int mismatches = 0;
  for (float f : probe_values()) {
    const std::uint8_t got = float_to_e2m1(f, E2M1Rounding::kNearestEven), want = ref::e2m1_from_float(f, false);
    if (got != want && ++mismatches <= 10) ADD_FAILURE() << "e2m1(" << f << ") = " << int(got) << ", expected " << int(want);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(E2M1, Sm90FallbackMatchesItsDefinition) {
  int mismatches = 0;
  for (float f : probe_values()) {
    const std::uint8_t got = float_to_e2m1(f, E2M1Rounding::kSm90), want = ref::e2m1_from_float(f, true);
    if (got != want && ++mismatches <= 10) ADD_FAILURE() << "e2m1_sm90(" << f << ") = " << int(got) << ", expected " << int(want);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(E2M1, TiesSaturationSignsAndDecoding) {
  // Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  const std::pair<float, float> ties[] = {{0.25f, 0}, {0.75f, 1}, {1.25f, 1}, {1.75f, 2}, {2.5f, 2}, {3.5f, 4}, {5.0f, 4}};
  for (auto [v, want] : ties) {
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(v)), want) << v;
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(-v)), -want) << -v;
  }
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1e30f)), 6.0f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(-std::numeric_limits<float>::infinity())), -6.0f);
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);  // negative zero keeps its sign bit
  EXPECT_EQ(float_to_e2m1(std::numeric_limits<float>::quiet_NaN()), 0x7);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(static_cast<double>(e2m1_to_float(static_cast<std::uint8_t>(c))), ref::e2m1_value(static_cast<std::uint8_t>(c)));
  // The fallback is not round-to-nearest: 0.99 becomes 0.5 and 1.45 becomes 1.5 (above sqrt 2).
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(0.99f, E2M1Rounding::kSm90)), 0.5f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.45f, E2M1Rounding::kSm90)), 1.5f);
  EXPECT_EQ(e2m1_to_float(float_to_e2m1(1.40f, E2M1Rounding::kSm90)), 1.0f);
}

TEST(UE8M0, CeilingMatchesTheSearchDefinition) {
  int mismatches = 0;
  for (float f : probe_values()) {
    if (!(f >= 0) && !std::isnan(f)) continue;  // defined for f >= 0 and NaN
    const std::uint8_t got = float_to_ue8m0_ceil(f), want = ref::ue8m0_ceil_from_float(f);
    if (got != want && ++mismatches <= 10) ADD_FAILURE() << "ue8m0(" << f << ") = " << int(got) << ", expected " << int(want);
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(float_to_ue8m0_ceil(1.0f), 127);
  EXPECT_EQ(float_to_ue8m0_ceil(std::nextafter(1.0f, 2.0f)), 128);
  EXPECT_EQ(float_to_ue8m0_ceil(0.0f), 0);
  EXPECT_EQ(float_to_ue8m0_ceil(-0.0f), 0);
  EXPECT_EQ(float_to_ue8m0_ceil(std::numeric_limits<float>::infinity()), 254);
  EXPECT_EQ(float_to_ue8m0_ceil(-1.0f), 255);
}

}  // namespace
}  // namespace moe_ep
