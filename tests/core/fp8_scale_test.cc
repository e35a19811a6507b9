// FP8 block scales against DeepEP's low-latency formula, written out here in plain FP32
// arithmetic (docs/quantized-formats.md, "Scale formulas"): scale_inv = max(amax, 1e-4) *
// (1.0f / 448.0f), one product; with round_scale 2^ceil(log2(that product)), its UE8M0 byte the
// exponent field. Random blocks over forty binades, in which the quotient amax / 448 differs from
// that product in about half of the blocks (the test counts them, so that the quotient would
// fail it), through quantize_fp8 (BF16 and FP32 rows), every path of the row kernel
// (portable, AVX2, AVX-512) and fp8_block_scale_inv, bit for bit; the codes against e4m3(x * (448 / amax)) or
// e4m3(x * 2^-e) with the reference FP8 encoder.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_rows.hh"
#include "moe_ep/convert.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace fp8_scale_test {
namespace {

constexpr int kHidden = 1024, kBlocks = kHidden / 128;

// One block as DeepEP's kernel computes it, from the values as the kernel reads them.
struct Want {
  float amax_raw;         // max |x|, NaN ignored, before the floor
  std::uint32_t scale;    // stored FP32 scale_inv
  std::uint8_t ue8m0;     // its exponent byte (round_scale)
  float multiplier;       // what the values are multiplied by
  bool quotient_differs;  // amax / 448 is not amax * (1 / 448)
};

Want deepep_block(const float* x, bool round_scale) {
  float amax = 0.0f;
  for (int i = 0; i < 128; ++i)
    if (!std::isnan(x[i]) && std::fabs(x[i]) > amax) amax = std::fabs(x[i]);
  Want w{};
  w.amax_raw = amax;
  if (amax < 1e-4f) amax = 1e-4f;
  const float product = amax * (1.0f / 448.0f);
  w.quotient_differs = reference::bits_of(amax / 448.0f) != reference::bits_of(product);
  if (!round_scale) {
    w.scale = reference::bits_of(product);
    w.multiplier = 448.0f / amax;
    return w;
  }
  int e = 0;
  const float m = std::frexp(product, &e);  // product = m * 2^e, m in [0.5, 1)
  const int up = m == 0.5f ? e - 1 : e;     // ceil(log2(product))
  w.scale = reference::bits_of(std::ldexp(1.0f, up));
  w.ue8m0 = static_cast<std::uint8_t>(up + 127);
  w.multiplier = std::ldexp(1.0f, -up);
  return w;
}

// Rows of values (BF16-representable with bf16_exact): each block's magnitudes from one binade in
// [-20, 20), every eleventh block below the amax floor, a NaN in every seventh block.
std::vector<float> random_rows(int rows, unsigned seed, bool bf16_exact) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-20, 19);
  std::vector<float> x(static_cast<std::size_t>(rows) * kHidden);
  for (std::size_t b = 0; b < x.size() / 128; ++b) {
    const int e = b % 11 == 5 ? -24 : binade(rng);
    for (std::size_t i = 0; i < 128; ++i) {
      const float v = normal(rng) * std::ldexp(1.0f, e);
      x[b * 128 + i] = bf16_exact ? reference::float_from_bf16(reference::bf16_from_float(v)) : v;
    }
    if (b % 7 == 3) x[b * 128 + 17] = std::numeric_limits<float>::quiet_NaN();
  }
  return x;
}

// Compares one row's codes and scales (as stored: FP32 words, or packed UE8M0 bytes) with the
// formula; counts the blocks whose quotient differs into `differ` when given.
void expect_row(const float* x, const std::uint8_t* codes, const std::byte* scales, bool round_scale, bool ue8m0,
                const std::string& what, int* differ = nullptr) {
  for (int b = 0; b < kBlocks; ++b) {
    const Want w = deepep_block(x + b * 128, round_scale);
    if (differ != nullptr && w.quotient_differs) ++*differ;
    if (ue8m0) {
      ASSERT_EQ(static_cast<std::uint8_t>(scales[b]), w.ue8m0) << what << " block " << b;
    } else {
      std::uint32_t got;
      std::memcpy(&got, scales + 4 * b, 4);
      ASSERT_EQ(got, w.scale) << what << " block " << b << " amax " << w.amax_raw;
      ASSERT_EQ(reference::bits_of(fp8_block_scale_inv(w.amax_raw, round_scale)), w.scale) << what << " block " << b;
    }
    for (int i = b * 128; i < (b + 1) * 128; ++i)
      ASSERT_EQ(codes[i], reference::fp8_e4m3_from_float(x[i] * w.multiplier)) << what << " element " << i;
  }
}

struct Option {
  bool round_scale, ue8m0;
  std::string name() const {
    return std::string("round_scale ") + (round_scale ? "1" : "0") + " ue8m0 " + (ue8m0 ? "1" : "0");
  }
};
constexpr Option kOptions[] = {{false, false}, {true, false}, {true, true}};
// Every path of the row kernel (those this CPU lacks are skipped by cast_row_fp8_on).
constexpr core::Isa kIsas[] = {core::Isa::kPortable, core::Isa::kAvx2, core::Isa::kAvx512};

TEST(Fp8Scale, Bf16RowsTakeDeepEpsProductOnEveryPath) {
  constexpr int kRows = 96;
  const std::vector<float> x = random_rows(kRows, 17, true);
  Tensor bf16 = Tensor::empty({kRows, kHidden}, DType::kBF16);
  for (std::size_t i = 0; i < x.size(); ++i) bf16.data_as<std::uint16_t>()[i] = reference::bf16_from_float(x[i]);
  for (const Option o : kOptions) {
    const std::string what = o.name();
    const Fp8Tensor q = quantize_fp8(bf16, {.round_scale = o.round_scale, .use_ue8m0 = o.ue8m0});
    const std::size_t scale_row_bytes = q.scales.nbytes() / kRows;
    int differ = 0;
    for (int r = 0; r < kRows; ++r) {
      const float* row = x.data() + static_cast<std::size_t>(r) * kHidden;
      const std::uint16_t* in = bf16.data_as<std::uint16_t>() + r * kHidden;
      ASSERT_NO_FATAL_FAILURE(expect_row(row, q.data.data_as<std::uint8_t>() + r * kHidden,
                                         static_cast<const std::byte*>(q.scales.data()) + r * scale_row_bytes,
                                         o.round_scale, o.ue8m0, what + " quantize_fp8", &differ));
      // The row kernel as the low-latency dispatch calls it (vector path where the CPU has one),
      // and its portable path: the same bits.
      std::vector<std::uint8_t> codes(kHidden);
      std::vector<std::byte> scales(4 * kBlocks);
      core::cast_row_fp8(in, kHidden, o.round_scale, o.ue8m0, codes.data(), scales.data());
      ASSERT_NO_FATAL_FAILURE(
          expect_row(row, codes.data(), scales.data(), o.round_scale, o.ue8m0, what + " cast_row_fp8"));
      for (const core::Isa isa : kIsas) {
        std::fill(codes.begin(), codes.end(), 0);
        if (!core::cast_row_fp8_on(isa, in, kHidden, o.round_scale, o.ue8m0, codes.data(), scales.data())) continue;
        ASSERT_NO_FATAL_FAILURE(expect_row(row, codes.data(), scales.data(), o.round_scale, o.ue8m0,
                                           what + " cast_row_fp8_on(" + std::to_string(static_cast<int>(isa)) + ")"));
      }
    }
    // amax / 448 would give other scales: about half of the blocks tell the two apart.
    if (!o.round_scale) {
      EXPECT_GT(differ, kRows * kBlocks / 4) << what;
    }
  }
}

TEST(Fp8Scale, Fp32RowsTakeTheSameProduct) {
  constexpr int kRows = 64;
  const std::vector<float> x = random_rows(kRows, 29, false);
  Tensor fp32 = Tensor::empty({kRows, kHidden}, DType::kFP32);
  std::memcpy(fp32.data(), x.data(), x.size() * sizeof(float));
  for (const Option o : kOptions) {
    const std::string what = "fp32 " + o.name();
    const Fp8Tensor q = quantize_fp8(fp32, {.round_scale = o.round_scale, .use_ue8m0 = o.ue8m0});
    const std::size_t scale_row_bytes = q.scales.nbytes() / kRows;
    int differ = 0;
    for (int r = 0; r < kRows; ++r)
      ASSERT_NO_FATAL_FAILURE(expect_row(x.data() + static_cast<std::size_t>(r) * kHidden,
                                         q.data.data_as<std::uint8_t>() + r * kHidden,
                                         static_cast<const std::byte*>(q.scales.data()) + r * scale_row_bytes,
                                         o.round_scale, o.ue8m0, what, &differ));
    if (!o.round_scale) {
      EXPECT_GT(differ, kRows * kBlocks / 4) << what;
    }
  }
}

}  // namespace
}  // namespace fp8_scale_test
}  // namespace moe_ep
