// The row kernels against a scalar reference written from their contract (with the BF16
// conversions of tests/reference), on every row count, odd lengths (vector tails), and special values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/reduce.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

using reference::bf16_from_float;
using reference::float_from_bf16;

std::vector<std::uint16_t> random_row(std::mt19937& rng, int n) {
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::normal_distribution<float> value(0.0f, 1.0f);
  std::uniform_int_distribution<int> special(0, 60);
  std::vector<std::uint16_t> row(static_cast<size_t>(n));
  for (auto& v : row) {
    const int s = special(rng);
    const float f = s == 0 ? std::numeric_limits<float>::infinity()
                    : s == 1 ? -std::numeric_limits<float>::quiet_NaN()
                    : s == 2 ? -0.0f
                             : std::ldexp(value(rng), exponent(rng));
    v = bf16_from_float(f);
  }
  return row;
}

TEST(Reduce, SumMatchesOrderedFp32Reference) {
  std::mt19937 rng(5);
  for (int n : {1, 7, 31, 32, 33, 100, 7168}) {
    for (int rows = 0; rows <= 9; ++rows) {
      std::vector<std::vector<std::uint16_t>> in;
      std::vector<const std::uint16_t*> ptrs;
      for (int r = 0; r < rows; ++r) in.push_back(random_row(rng, n));
      for (auto& r : in) ptrs.push_back(r.data());
      std::vector<std::uint16_t> out(static_cast<size_t>(n), 0xffff);
      core::sum_bf16_rows(ptrs, out.data(), n);
      for (int h = 0; h < n; ++h) {
        std::uint16_t expected = 0;
        if (rows == 1) {
          expected = in[0][static_cast<size_t>(h)];
        } else if (rows > 1) {
          float acc = float_from_bf16(in[0][static_cast<size_t>(h)]);
          for (int r = 1; r < rows; ++r) acc = acc + float_from_bf16(in[static_cast<size_t>(r)][static_cast<size_t>(h)]);
          expected = bf16_from_float(acc);
        }
        const bool both_nan = std::isnan(float_from_bf16(expected)) && std::isnan(float_from_bf16(out[static_cast<size_t>(h)]));
        ASSERT_TRUE(both_nan || out[static_cast<size_t>(h)] == expected) << "n " << n << " rows " << rows << " h " << h;
      }
    }
  }
}

TEST(Reduce, WeightedSumMatchesReference) {
  std::mt19937 rng(6);
  for (int n : {5, 64, 1000}) {
    for (int rows = 0; rows <= 4; ++rows) {
      std::vector<std::vector<std::uint16_t>> in;
      std::vector<const std::uint16_t*> ptrs;
      std::vector<float> w;
      for (int r = 0; r < rows; ++r) {
        in.push_back(random_row(rng, n));
        w.push_back(std::uniform_real_distribution<float>(-2, 2)(rng));
      }
      for (auto& r : in) ptrs.push_back(r.data());
      std::vector<std::uint16_t> out(static_cast<size_t>(n));
      core::weighted_sum_bf16_rows(ptrs, w, out.data(), n);
      for (int h = 0; h < n; ++h) {
        float acc = 0.0f;
        for (int r = 0; r < rows; ++r) {
          const float product = w[static_cast<size_t>(r)] * float_from_bf16(in[static_cast<size_t>(r)][static_cast<size_t>(h)]);
          acc = r == 0 ? product : acc + product;
        }
        const std::uint16_t expected = bf16_from_float(acc);
        const bool both_nan = std::isnan(float_from_bf16(expected)) && std::isnan(float_from_bf16(out[static_cast<size_t>(h)]));
        ASSERT_TRUE(both_nan || out[static_cast<size_t>(h)] == expected) << n << " " << rows << " " << h;
      }
    }
  }
}

}  // namespace
}  // namespace moe_ep
