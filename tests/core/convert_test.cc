// FP8 per-block quantization against a reference written from the definition in convert.hpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "moe_ep/convert.hpp"
#include "moe_ep/error.hpp"

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
      ASSERT_EQ(q.scales.data_as<float>()[t * 4 + b], floored / 448.0f);
      for (int i = 0; i < 128; ++i) {
        const int k = t * 512 + b * 128 + i;
        const float v = bf16_to_float(x.data_as<std::uint16_t>()[k]);
        ASSERT_EQ(q.data.data_as<std::uint8_t>()[k], float_to_fp8_e4m3(v * (448.0f / floored)));
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
  EXPECT_EQ(fp8_block_scale_inv(0.0f, false), 1e-4f / 448.0f);
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
