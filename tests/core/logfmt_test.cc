// The LogFMT-10 row codec (src/core/logfmt_rows.hh) against the definition written in
// tests/reference/logfmt_reference.hh: encoded bytes identical, decoded values identical, over
// rows with castable and uncastable chunks, zeros, negative zeros, tiny and huge magnitudes, NaN
// and infinite elements, and hidden sizes with 512- and 1024-element chunks and a short last one;
// and the quantization error within the bounds the format promises.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/logfmt_rows.hh"
#include "reference/logfmt_reference.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

namespace ref = reference;

// kind 0: N(0, 0.1) (castable); 1: wide range below 1; 2: some blocks with |x| >= 1; 3: zero and
// negative-zero blocks and elements; 4: NaN / infinity here and there; 5: one value per block.
std::vector<std::uint16_t> make_row(std::mt19937& gen, int hidden, int kind) {
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::uniform_int_distribution<int> exponent(-40, -1);
  std::vector<std::uint16_t> row(static_cast<size_t>(hidden));
  for (int i = 0; i < hidden; ++i) {
    const int block = i / 128;
    float v = normal(gen);
    if (kind == 1) v = std::copysign(std::ldexp(1.0f + std::fabs(normal(gen)), exponent(gen)), v);
    if (kind == 2 && block % 3 == 1) v *= 40.0f;
    if (kind == 3 && (block % 2 == 0 || i % 7 == 0)) v = (i % 2) ? -0.0f : 0.0f;
    if (kind == 4 && i % 97 == 3) v = std::numeric_limits<float>::quiet_NaN();
    if (kind == 4 && i % 131 == 5) v = std::numeric_limits<float>::infinity();
    if (kind == 5) v = i % 128 == 0 ? 0.25f : 0.0f;
    row[static_cast<size_t>(i)] = ref::bf16_from_float(v);
  }
  return row;
}

TEST(LogFmt, EncoderAndDecoderMatchTheDefinitionBitForBit) {
  std::mt19937 gen(77);
  int castable_rows = 0, bf16_rows = 0;
  for (int hidden : {128, 512, 640, 1024, 2560, 7168})
    for (int kind = 0; kind < 6; ++kind)
      for (int rep = 0; rep < 6; ++rep) {
        const auto row = make_row(gen, hidden, kind);
        const std::vector<std::uint8_t> want = ref::logfmt_encode(row.data(), hidden);
        std::vector<std::byte> got(static_cast<size_t>(core::logfmt_max_row_bytes(hidden)));
        const std::int64_t bytes = core::logfmt_encode_row(row.data(), hidden, got.data());
        ASSERT_EQ(bytes, static_cast<std::int64_t>(want.size())) << "hidden " << hidden << " kind " << kind;
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0) << "hidden " << hidden << " kind " << kind;
        (bytes < 2 * hidden + 4 * (hidden / 128) ? castable_rows : bf16_rows)++;

        const std::vector<float> expect = ref::logfmt_decode(want, hidden);
        std::vector<float> decoded(static_cast<size_t>(hidden));
        ASSERT_EQ(core::logfmt_decode_row(got.data(), hidden, decoded.data()), bytes);
        for (int h = 0; h < hidden; ++h)
          ASSERT_EQ(ref::bits_of(decoded[static_cast<size_t>(h)]), ref::bits_of(expect[static_cast<size_t>(h)]))
              << "hidden " << hidden << " kind " << kind << " element " << h;
      }
  // The cases cover both kinds of chunk.
  EXPECT_GT(castable_rows, 30);
  EXPECT_GT(bf16_rows, 30);
}

TEST(LogFmt, WireSizeIsTenBitsPerElementWhenEveryChunkIsCastable) {
  std::mt19937 gen(5);
  for (int hidden : {1024, 2048, 7168}) {
    const auto row = make_row(gen, hidden, 0);
    std::vector<std::byte> out(static_cast<size_t>(core::logfmt_max_row_bytes(hidden)));
    EXPECT_EQ(core::logfmt_encode_row(row.data(), hidden, out.data()), hidden * 10 / 8 + 4 * (hidden / 128));
  }
}

TEST(LogFmt, UncastableChunksTravelAsTheirBf16Bits) {
  // One block of the first 1024-element chunk has a value >= 1: that whole chunk is BF16, the
  // second chunk stays LogFMT.
  std::mt19937 gen(9);
  auto row = make_row(gen, 2048, 0);
  row[300] = ref::bf16_from_float(1.5f);
  std::vector<std::byte> out(static_cast<size_t>(core::logfmt_max_row_bytes(2048)));
  const std::int64_t bytes = core::logfmt_encode_row(row.data(), 2048, out.data());
  EXPECT_EQ(bytes, 4 * 16 + 2 * 1024 + 1024 * 10 / 8);
  EXPECT_EQ(std::memcmp(out.data() + 64, row.data(), 2048), 0);
  std::vector<float> decoded(2048);
  core::logfmt_decode_row(out.data(), 2048, decoded.data());
  for (int h = 0; h < 1024; ++h) ASSERT_EQ(ref::bf16_from_float(decoded[static_cast<size_t>(h)]), row[static_cast<size_t>(h)]);
}

TEST(LogFmt, QuantizationErrorWithinOneLevel) {
  // A decoded magnitude is a level 2^((c - 1) step + ln) whose neighbours bracket the value: the
  // relative error is below 2^step - 1, and codes keep signs and zeros.
  std::mt19937 gen(11);
  for (int rep = 0; rep < 20; ++rep) {
    const int hidden = 1024;
    const auto row = make_row(gen, hidden, rep % 2);
    std::vector<std::byte> out(static_cast<size_t>(core::logfmt_max_row_bytes(hidden)));
    core::logfmt_encode_row(row.data(), hidden, out.data());
    std::vector<float> decoded(static_cast<size_t>(hidden));
    core::logfmt_decode_row(out.data(), hidden, decoded.data());
    for (int b = 0; b < hidden / 128; ++b) {
      double amax = 0, amin = INFINITY;
      for (int i = 0; i < 128; ++i) {
        const double v = std::fabs(ref::float_from_bf16(row[static_cast<size_t>(b * 128 + i)]));
        amax = std::max(amax, v);
        amin = std::min(amin, v);
      }
      const double la = std::log2(amax), ln = amin == 0 ? la - 32 : std::max(std::log2(amin), la - 32);
      const double step = (la - ln) / 510;
      for (int i = 0; i < 128; ++i) {
        const int h = b * 128 + i;
        const double v = ref::float_from_bf16(row[static_cast<size_t>(h)]), d = decoded[static_cast<size_t>(h)];
        if (v == 0) {
          EXPECT_EQ(d, 0.0) << h;
          continue;
        }
        if (std::fabs(v) < std::exp2(ln)) continue;  // below the lowest level: 0 or that level
        EXPECT_EQ(std::signbit(v), std::signbit(d)) << h;
        EXPECT_LE(std::fabs(d - v), std::fabs(v) * (std::exp2(step) - 1) * 1.001 + 1e-30) << "element " << h;
      }
    }
    std::vector<double> x(row.size()), y(row.size());
    for (std::size_t h = 0; h < row.size(); ++h) {
      x[h] = ref::float_from_bf16(row[h]);
      y[h] = decoded[h];
    }
    EXPECT_LT(ref::calc_diff(x, y), 9e-4);
  }
}

}  // namespace
}  // namespace moe_ep
