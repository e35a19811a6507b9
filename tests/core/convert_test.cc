// FP8 per-block quantization against the definition in convert.hpp (codes and scales from the
// independent reference of tests/reference/numeric_reference.hh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_rows.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/error.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

Tensor random_bf16(std::int64_t n, std::int64_t h, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor x = Tensor::empty({n, h}, DType::kBF16);
  for (std::int64_t i = 0; i < n * h; ++i) {
    const float scale = (i / 128) % 5 == 0 ? 1e-3f : (i / 128) % 5 == 1 ? 300.0f : 1.0f;
    x.data_as<std::uint16_t>()[i] = float_to_bf16(dist(rng) * scale);
  }
  return x;
}

TEST(Fp8Quantize, ScalesAndCodesFollowTheDefinition) {
  Tensor x = random_bf16(5, 512, 1);
  // One block entirely zero: amax is floored at 1e-4.
  for (int i = 128; i < 256; ++i) x.data_as<std::uint16_t>()[i] = 0;
  Fp8Tensor q = quantize_fp8(x);
  ASSERT_EQ(q.scales.size(1), 4);
  for (int t = 0; t < 5; ++t) {
    for (int b = 0; b < 4; ++b) {
      float amax = 0;
      for (int i = 0; i < 128; ++i)
        amax = std::max(amax, std::fabs(bf16_to_float(x.data_as<std::uint16_t>()[t * 512 + b * 128 + i])));
      const float floored = std::max(amax, 1e-4f);
      ASSERT_EQ(q.scales.data_as<float>()[t * 4 + b], floored * (1.0f / 448.0f));  // DeepEP: times fp32(1/448)
      for (int i = 0; i < 128; ++i) {
        const int k = t * 512 + b * 128 + i;
        const float v = bf16_to_float(x.data_as<std::uint16_t>()[k]);
        ASSERT_EQ(q.data.data_as<std::uint8_t>()[k], reference::fp8_e4m3_from_float(v * (448.0f / floored)));
      }
    }
  }
}

TEST(Fp8Quantize, DequantizedErrorIsWithinHalfAnFp8Step) {
  Tensor x = random_bf16(7, 1024, 2);
  for (bool round : {false, true}) {
    Fp8Tensor q = quantize_fp8(x, {.round_scale = round});
    Tensor back = dequantize_fp8(q.data, q.scales);
    for (std::int64_t i = 0; i < 7 * 1024; ++i) {
      const float v = bf16_to_float(x.data_as<std::uint16_t>()[i]);
      const float scale_inv = q.scales.data_as<float>()[i / 128];
      // E4M3 has 3 mantissa bits: relative error <= 2^-4, plus the subnormal step 2^-10 * scale.
      ASSERT_LE(std::fabs(back.data_as<float>()[i] - v), std::fabs(v) / 16 + scale_inv * std::ldexp(1.0f, -10))
          << i;
    }
  }
}

TEST(Fp8Quantize, RoundScaleGivesPowersOfTwoAndUe8m0PacksExponents) {
  Tensor x = random_bf16(3, 640, 3);  // 5 blocks: the second int holds one block and three zero bytes
  Fp8Tensor f = quantize_fp8(x, {.round_scale = true});
  Fp8Tensor u = quantize_fp8(x, {.round_scale = true, .use_ue8m0 = true});
  ASSERT_EQ(u.scales.dtype(), DType::kInt32);
  ASSERT_EQ(u.scales.size(1), 2);
  for (int t = 0; t < 3; ++t) {
    for (int b = 0; b < 5; ++b) {
      const float s = f.scales.data_as<float>()[t * 5 + b];
      int exp = 0;
      ASSERT_EQ(std::frexp(s, &exp), 0.5f) << "not a power of two: " << s;
      const auto* bytes = reinterpret_cast<const std::uint8_t*>(u.scales.data_as<std::int32_t>() + t * 2);
      ASSERT_EQ(bytes[b], (float_bits(s) >> 23) & 0xff);
    }
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(u.scales.data_as<std::int32_t>() + t * 2);
    EXPECT_EQ(bytes[5] | bytes[6] | bytes[7], 0);
  }
  EXPECT_EQ(std::memcmp(f.data.data(), u.data.data(), f.data.nbytes()), 0);
  Tensor a = dequantize_fp8(f.data, f.scales), b = dequantize_fp8(u.data, u.scales);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  EXPECT_EQ(fp8_block_scale_inv(448.0f, true), 1.0f);
  EXPECT_EQ(fp8_block_scale_inv(449.0f, true), 2.0f);
  EXPECT_EQ(fp8_block_scale_inv(0.0f, false), 1e-4f * (1.0f / 448.0f));
  EXPECT_EQ(fp8_block_scale_inv(3.0f, false), 3.0f * (1.0f / 448.0f));  // not 3.0f / 448.0f, one ulp below
}

// Blocks with NaN, infinities, subnormals and signed zeros, in BF16 and FP32, against the
// reference quantizer of tests/reference (NaN never raises amax).
TEST(Fp8Quantize, SpecialValuesInBothInputTypesFollowTheDefinition) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> values(4 * 256);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = dist(rng) * std::ldexp(1.0f, static_cast<int>(i / 128) * 9 - 30);
  values[3] = nan;
  values[130] = -nan;
  values[300] = inf;     // block 2: amax = inf, every value becomes 0 or NaN
  values[520] = -0.0f;
  values[700] = std::numeric_limits<float>::denorm_min();
  for (int i = 768; i < 896; ++i) values[static_cast<std::size_t>(i)] = nan;  // block 6: all NaN
  for (DType dtype : {DType::kBF16, DType::kFP32}) {
    for (bool round : {false, true}) {
      Tensor x = Tensor::empty({4, 256}, dtype);
      std::vector<float> as_read(values.size());
      for (std::size_t i = 0; i < values.size(); ++i) {
        if (dtype == DType::kBF16) {
          x.data_as<std::uint16_t>()[i] = float_to_bf16(values[i]);
          as_read[i] = bf16_to_float(x.data_as<std::uint16_t>()[i]);
        } else {
          x.data_as<float>()[i] = as_read[i] = values[i];
        }
      }
      Fp8Tensor q = quantize_fp8(x, {.round_scale = round});
      for (int row = 0; row < 4; ++row) {
        const reference::Fp8Row want = reference::quantize_row_fp8(as_read.data() + row * 256, 256, round, false);
        for (int b = 0; b < 2; ++b)
          ASSERT_EQ(float_bits(q.scales.data_as<float>()[row * 2 + b]), want.scales[static_cast<std::size_t>(b)])
              << dtype_name(dtype) << " block " << row * 2 + b;
        for (int i = 0; i < 256; ++i)
          ASSERT_EQ(q.data.data_as<std::uint8_t>()[row * 256 + i], want.codes[static_cast<std::size_t>(i)])
              << dtype_name(dtype) << " element " << row * 256 + i;
      }
    }
  }
}

// The row kernel's vector paths (AVX2, AVX-512: those this CPU has) against its portable one.
void expect_paths_agree(const std::uint16_t* x, std::int64_t hidden, bool round, bool ue8m0, const std::string& what) {
  std::vector<std::uint8_t> want(static_cast<size_t>(hidden)), got(static_cast<size_t>(hidden));
  std::vector<std::byte> want_scales(4 * static_cast<size_t>(hidden) / 128), got_scales(want_scales.size());
  ASSERT_TRUE(core::cast_row_fp8_on(core::Isa::kPortable, x, hidden, round, ue8m0, want.data(), want_scales.data()));
  for (const core::Isa isa : {core::Isa::kAvx2, core::Isa::kAvx512}) {
    std::fill(got.begin(), got.end(), 0);
    std::fill(got_scales.begin(), got_scales.end(), std::byte{0});
    if (!core::cast_row_fp8_on(isa, x, hidden, round, ue8m0, got.data(), got_scales.data())) continue;
    ASSERT_EQ(got, want) << what << ", path " << static_cast<int>(isa);
    ASSERT_EQ(got_scales, want_scales) << what << ", path " << static_cast<int>(isa);
  }
}

// Every BF16 code, in blocks whose scales span the FP8 range (saturation, subnormals, NaN and
// infinities included), through the vector paths and the portable one: identical bytes.
TEST(Fp8Quantize, VectorPathsMatchThePortablePathOnEveryBf16Code) {
  constexpr int kHidden = 1024;
  std::mt19937 rng(5);
  std::vector<std::uint16_t> codes(65536);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint16_t>(i);
  std::shuffle(codes.begin(), codes.end(), rng);
  for (bool round : {false, true}) {
    for (std::size_t row = 0; row < codes.size() / kHidden; ++row) {
      const std::uint16_t* x = codes.data() + row * kHidden;
      ASSERT_NO_FATAL_FAILURE(expect_paths_agree(x, kHidden, round, false, "row " + std::to_string(row)));
    }
  }
  // Blocks of one magnitude each, so that amax is finite and the values fill the FP8 range.
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int trial = 0; trial < 64; ++trial) {
    std::vector<std::uint16_t> x(kHidden);
    for (int i = 0; i < kHidden; ++i)
      x[static_cast<std::size_t>(i)] = float_to_bf16(dist(rng) * std::ldexp(1.0f, (i / 128) * 8 - 30 + trial % 7));
    for (bool ue8m0 : {false, true})
      ASSERT_NO_FATAL_FAILURE(expect_paths_agree(x.data(), kHidden, ue8m0, ue8m0, "trial " + std::to_string(trial)));
  }
}

TEST(Fp8Quantize, RejectsBadArguments) {
  Tensor x = Tensor::zeros({2, 100}, DType::kBF16);
  EXPECT_THROW(quantize_fp8(x), InvalidArgument);
  Tensor y = Tensor::zeros({2, 128}, DType::kInt32);
  EXPECT_THROW(quantize_fp8(y), InvalidArgument);
  Tensor z = Tensor::zeros({2, 128}, DType::kBF16);
  EXPECT_THROW(quantize_fp8(z, {.round_scale = false, .use_ue8m0 = true}), InvalidArgument);
  Fp8Tensor q = quantize_fp8(z);
  Tensor wrong = Tensor::zeros({2, 2}, DType::kFP32);
  EXPECT_THROW(dequantize_fp8(q.data, wrong), InvalidArgument);
}

TEST(Convert, Bf16AndFp32) {
  Tensor f = Tensor::empty({3}, DType::kFP32);
  f.data_as<float>()[0] = 1.0f + std::ldexp(1.0f, -8);
  f.data_as<float>()[1] = -2.5f;
  f.data_as<float>()[2] = 3e38f;
  Tensor b = to_bf16(f);
  EXPECT_EQ(b.data_as<std::uint16_t>()[0], 0x3f80);
  Tensor back = to_fp32(b);
  EXPECT_EQ(back.data_as<float>()[1], -2.5f);
}

}  // namespace
}  // namespace moe_ep
