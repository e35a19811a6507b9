// The library's element conversions and FP8 block quantization against the independent
// references of tests/reference/numeric_reference.hh, which are themselves checked here against
// brute force (nearest representable value by exhaustive search, exact arithmetic in double).
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
#include "moe_ep/dtype.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

using reference::bf16_from_float;
using reference::bits_of;
using reference::float_from_bf16;
using reference::float_of;
using reference::fp8_e4m3_from_float;
using reference::fp8_e4m3_value;

// Nearest E4M3 code by exhaustive search over the 254 finite codes (ties to the even code,
// the sign of zero kept, saturation at 448).
int fp8_by_search(float f) {
  if (std::isnan(f)) return std::signbit(f) ? 0xff : 0x7f;
  const double x = std::clamp(static_cast<double>(f), -448.0, 448.0);
  int best = -1;
  double best_err = 0;
  for (int code = 0; code < 256; ++code) {
    const double v = fp8_e4m3_value(static_cast<std::uint8_t>(code));
    if (std::isnan(v) || (v == 0 && ((code & 0x80) != 0) != std::signbit(f))) continue;
    const double err = std::fabs(v - x);
    if (best < 0 || err < best_err || (err == best_err && (code & 1) == 0)) {
      best = code;
      best_err = err;
    }
  }
  return best;
}

// Nearest BF16 by exact comparison of the two neighbours in double, ties to the even one.
std::uint16_t bf16_by_search(float f) {
  if (std::isinf(f)) return static_cast<std::uint16_t>(bits_of(f) >> 16);
  const std::uint32_t lo = bits_of(f) & 0xffff0000u;
  const double below = float_of(lo);
  const double above = ((lo >> 16) & 0x7fffu) == 0x7f7fu ? std::copysign(std::ldexp(1.0, 128), f)  // past the largest
                                                         : static_cast<double>(float_of(lo + 0x10000u));
  const double d_below = std::fabs(static_cast<double>(f) - below), d_above = std::fabs(static_cast<double>(f) - above);
  const std::uint16_t b = static_cast<std::uint16_t>(lo >> 16);
  if (d_below < d_above || (d_below == d_above && (b & 1) == 0)) return b;
  return static_cast<std::uint16_t>(b + 1);
}

std::vector<float> interesting_floats() {
  std::vector<float> v;
  for (std::uint32_t code = 0; code < 65536; ++code) v.push_back(float_of(code << 16));  // every BF16 value
  for (int code = 0; code < 0x7f; ++code) {  // E4M3 values, midpoints and their neighbours
    const float lo = static_cast<float>(fp8_e4m3_value(static_cast<std::uint8_t>(code)));
    const float hi = code < 0x7e ? static_cast<float>(fp8_e4m3_value(static_cast<std::uint8_t>(code + 1))) : 512.0f;
    const float mid = (lo + hi) / 2;
    for (float f : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      v.push_back(f);
      v.push_back(-f);
    }
  }
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) v.push_back(float_of(bits(rng)));
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-std::numeric_limits<float>::infinity());
  v.push_back(std::numeric_limits<float>::denorm_min());
  return v;
}

TEST(NumericReference, Fp8EncoderIsTheNearestCode) {
  for (float f : interesting_floats()) {
    if (std::isnan(f)) {
      ASSERT_EQ(fp8_e4m3_from_float(f) & 0x7f, 0x7f) << bits_of(f);
      continue;
    }
    ASSERT_EQ(fp8_e4m3_from_float(f), fp8_by_search(f)) << f << " bits " << bits_of(f);
  }
}

TEST(NumericReference, Bf16ConversionIsTheNearestValue) {
  for (float f : interesting_floats()) {
    if (std::isnan(f)) {
      const std::uint16_t b = bf16_from_float(f);
      ASSERT_TRUE(std::isnan(float_from_bf16(b)));
      ASSERT_EQ(b & 0x0040, 0x0040) << "quiet bit";
      ASSERT_EQ(b >> 15, bits_of(f) >> 31) << "sign";
      continue;
    }
    ASSERT_EQ(bf16_from_float(f), bf16_by_search(f)) << f << " bits " << bits_of(f);
    ASSERT_EQ(bits_of(float_from_bf16(bf16_from_float(f))), static_cast<std::uint32_t>(bf16_from_float(f)) << 16);
  }
}

// The library's scalar conversions give the reference's bits for every input of the list.
TEST(NumericReference, LibraryScalarConversionsMatch) {
  for (float f : interesting_floats()) {
    ASSERT_EQ(float_to_fp8_e4m3(f), fp8_e4m3_from_float(f)) << f << " bits " << bits_of(f);
    ASSERT_EQ(float_to_bf16(f), bf16_from_float(f)) << f << " bits " << bits_of(f);
  }
  for (std::uint32_t code = 0; code < 65536; ++code)
    ASSERT_EQ(bits_of(bf16_to_float(static_cast<std::uint16_t>(code))), bits_of(float_from_bf16(static_cast<std::uint16_t>(code))));
}

// Rows of BF16 whose blocks cover the FP8 range: magnitudes from below the amax floor to the
// largest BF16, blocks with NaN, infinities, zeros, ties and a single non-zero value.
std::vector<std::uint16_t> test_rows(int rows, int hidden, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::vector<std::uint16_t> x(static_cast<size_t>(rows) * hidden);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < hidden / 128; ++b) {
      const int kind = (r * 7 + b) % 9;
      const int block_exp = exponent(rng);
      for (int i = 0; i < 128; ++i) {
        float v = normal(rng);
        switch (kind) {
          case 0: v = std::ldexp(v, block_exp); break;                      // one magnitude
          case 1: v = std::ldexp(v, exponent(rng)); break;                  // every magnitude in one block
          case 2: v = std::ldexp(v, -20); break;                            // amax below the 1e-4 floor
          case 3: v = i == 5 ? std::ldexp(1.0f, block_exp) : 0.0f; break;  // one value, rest zeros
          case 4: v = i % 17 == 3 ? std::numeric_limits<float>::quiet_NaN() : v; break;
          case 5: v = i == 9 ? -std::numeric_limits<float>::infinity() : v; break;
          case 6: v = std::ldexp(static_cast<float>(i % 16) + 0.5f, block_exp % 8); break;  // ties after scaling
          case 7: v = std::ldexp(v, 120); break;                            // near the top of the range
          default: break;
        }
        x[static_cast<size_t>(r) * hidden + static_cast<size_t>(b) * 128 + static_cast<size_t>(i)] = bf16_from_float(v);
      }
    }
  return x;
}

void expect_row_matches(const reference::Fp8Row& want, const std::uint8_t* codes, const std::byte* scale_bytes, int hidden,
                        const std::string& what) {
  for (int h = 0; h < hidden; ++h)
    ASSERT_EQ(codes[h], want.codes[static_cast<size_t>(h)]) << what << " element " << h;
  for (std::size_t p = 0; p < want.scales.size(); ++p) {
    std::uint32_t got;
    std::memcpy(&got, scale_bytes + 4 * p, 4);
    ASSERT_EQ(got, want.scales[p]) << what << " scale word " << p;
  }
}

TEST(NumericReference, RowCastMatchesTheDefinitionOnEveryPathAndOption) {
  // 640: the second UE8M0 word holds one block and three zero bytes; 2432: 19 blocks, past the AVX-512
  // path's chunks of 16
  for (int hidden : {128, 640, 1024, 2432}) {
    const int rows = 24;
    const auto x = test_rows(rows, hidden, static_cast<unsigned>(hidden));
    for (int option = 0; option < 3; ++option) {
      const bool round_scale = option >= 1, ue8m0 = option == 2;
      const std::string what = "hidden " + std::to_string(hidden) + " round_scale " + std::to_string(round_scale) +
                               " ue8m0 " + std::to_string(ue8m0);
      Tensor bf16 = Tensor::empty({rows, hidden}, DType::kBF16);
      Tensor fp32 = Tensor::empty({rows, hidden}, DType::kFP32);
      std::memcpy(bf16.data(), x.data(), x.size() * 2);
      for (std::size_t i = 0; i < x.size(); ++i) fp32.data_as<float>()[i] = float_from_bf16(x[i]);
      const Fp8Tensor q16 = quantize_fp8(bf16, {.round_scale = round_scale, .use_ue8m0 = ue8m0});
      const Fp8Tensor q32 = quantize_fp8(fp32, {.round_scale = round_scale, .use_ue8m0 = ue8m0});
      const std::size_t scale_row_bytes = q16.scales.nbytes() / rows;
      for (int r = 0; r < rows; ++r) {
        const std::uint16_t* row = x.data() + static_cast<size_t>(r) * hidden;
        const reference::Fp8Row want = reference::quantize_row_fp8(row, hidden, round_scale, ue8m0);
        ASSERT_EQ(want.scales.size() * 4, scale_row_bytes);
        expect_row_matches(want, q16.data.data_as<std::uint8_t>() + r * hidden,
                           static_cast<const std::byte*>(q16.scales.data()) + r * scale_row_bytes, hidden, what + " bf16");
        expect_row_matches(want, q32.data.data_as<std::uint8_t>() + r * hidden,
                           static_cast<const std::byte*>(q32.scales.data()) + r * scale_row_bytes, hidden, what + " fp32");
        // The row kernels the buffers call (vector path where available, and the portable one).
        std::vector<std::uint8_t> codes(static_cast<size_t>(hidden));
        std::vector<std::byte> scales(4 * static_cast<size_t>(hidden / 128), std::byte{0});
        core::cast_row_fp8(row, hidden, round_scale, ue8m0, codes.data(), scales.data());
        expect_row_matches(want, codes.data(), scales.data(), hidden, what + " cast_row_fp8");
        for (const core::Isa isa : {core::Isa::kPortable, core::Isa::kAvx2, core::Isa::kAvx512}) {
          std::fill(scales.begin(), scales.end(), std::byte{0});
          if (core::cast_row_fp8_on(isa, row, hidden, round_scale, ue8m0, codes.data(), scales.data()))
            expect_row_matches(want, codes.data(), scales.data(), hidden,
                               what + " cast_row_fp8_on(" + std::to_string(static_cast<int>(isa)) + ")");
        }
      }
    }
  }
}

TEST(NumericReference, TensorConversionsMatch) {
  const auto floats = interesting_floats();
  Tensor f = Tensor::empty({static_cast<std::int64_t>(floats.size())}, DType::kFP32);
  std::memcpy(f.data(), floats.data(), floats.size() * 4);
  const Tensor b = to_bf16(f);
  for (std::size_t i = 0; i < floats.size(); ++i) {
    ASSERT_EQ(b.data_as<std::uint16_t>()[i], bf16_from_float(floats[i])) << floats[i] << " bits " << bits_of(floats[i]);
  }
  const Tensor back = to_fp32(b);
  for (std::size_t i = 0; i < floats.size(); ++i)
    ASSERT_EQ(bits_of(back.data_as<float>()[i]), bits_of(float_from_bf16(b.data_as<std::uint16_t>()[i])));
}

}  // namespace
}  // namespace moe_ep
