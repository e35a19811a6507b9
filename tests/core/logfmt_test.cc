// The LogFMT-10 row codec (src/core/logfmt_rows.hh) against the definition written in
// tests/reference/logfmt_reference.hh, on every instruction set this CPU has (scalar, AVX2,
// AVX-512, selected in turn): encoded bytes identical, decoded values identical (also of random
// codes), the fused weighted sum of the combine identical to decoding every row and summing, over
// rows with castable and uncastable chunks in every mix, zeros, negative zeros, subnormal, tiny and
// huge magnitudes, NaN and infinite elements, random bit patterns, and hidden sizes with 512- and
// 1024-element chunks and a short last one; every BF16 magnitude below 1 in castable blocks; the
// vector paths against the scalar one on many more rows; the codec's log2 and exp2 against the
// reference's and within their stated error of the exact functions; and the quantization error
// within the bounds the format promises.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/logfmt_math.hh"
#include "core/logfmt_rows.hh"
#include "reference/logfmt_reference.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

namespace ref = reference;
using core::LogfmtIsa;

constexpr int kKinds = 9;

// kind 0: N(0, 0.1) (castable); 1: wide range below 1; 2: some blocks with |x| >= 1; 3: zero and
// negative-zero blocks and elements; 4: NaN / infinity here and there; 5: one value per block;
// 6: subnormal and tiny magnitudes (levels below FP32's normal range, and every 4th block below
// BF16's range but for some subnormals: ln down to -165); 7: random bit patterns below
// 1 in magnitude; 8: each chunk castable or made uncastable (a value >= 1, an infinity, a NaN or an
// all-zero block) at random.
std::vector<std::uint16_t> make_row(std::mt19937& gen, int hidden, int kind) {
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::uniform_int_distribution<int> exponent(-40, -1), tiny(-140, -100), bits(0, 0xffff), pick(0, 4);
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
    if (kind == 6) v = std::copysign(std::ldexp(1.0f + std::fabs(normal(gen)), tiny(gen) - (block % 4 == 3 ? 30 : 0)), v);
    row[static_cast<size_t>(i)] = ref::bf16_from_float(v);
    if (kind == 7) row[static_cast<size_t>(i)] = static_cast<std::uint16_t>(bits(gen) & 0xbfff);  // exponent < 128
  }
  if (kind == 8) {
    const int chunk = hidden % 1024 == 0 ? 1024 : 512;
    for (int start = 0; start < hidden; start += chunk) {
      const int spoil = pick(gen), at = start + (bits(gen) % std::min(chunk, hidden - start));
      const float bad[3] = {1.5f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
      if (spoil < 3) row[static_cast<size_t>(at)] = ref::bf16_from_float(bad[spoil]);
      if (spoil == 3)
        for (int i = at / 128 * 128; i < at / 128 * 128 + 128; ++i) row[static_cast<size_t>(i)] = 0;
    }
  }
  return row;
}

std::vector<LogfmtIsa> isas() {
  std::vector<LogfmtIsa> out;
  for (LogfmtIsa isa : {LogfmtIsa::kScalar, LogfmtIsa::kAvx2, LogfmtIsa::kAvx512})
    if (core::logfmt_select_isa(isa)) out.push_back(isa);
  core::logfmt_select_isa(LogfmtIsa::kAuto);
  return out;
}

const char* isa_name(LogfmtIsa isa) {
  return isa == LogfmtIsa::kScalar ? "scalar" : isa == LogfmtIsa::kAvx2 ? "AVX2" : "AVX-512";
}

// Restores the widest instruction set when a test ends.
struct IsaScope {
  explicit IsaScope(LogfmtIsa isa) { EXPECT_TRUE(core::logfmt_select_isa(isa)); }
  ~IsaScope() { core::logfmt_select_isa(LogfmtIsa::kAuto); }
};

TEST(LogFmt, ScalarPathIsAlwaysThere) {
  const auto all = isas();
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front(), LogfmtIsa::kScalar);
  for (LogfmtIsa isa : all) std::printf("LogFMT kernels: %s\n", isa_name(isa));
}

TEST(LogFmt, EncoderAndDecoderMatchTheDefinitionBitForBit) {
  for (LogfmtIsa isa : isas()) {
    IsaScope scope(isa);
    std::mt19937 gen(77);
    int castable_rows = 0, bf16_rows = 0;
    for (int hidden : {128, 256, 512, 640, 1024, 1536, 2560, 7168})
      for (int kind = 0; kind < kKinds; ++kind)
        for (int rep = 0; rep < 4; ++rep) {
          const auto row = make_row(gen, hidden, kind);
          const std::vector<std::uint8_t> want = ref::logfmt_encode(row.data(), hidden);
          std::vector<std::byte> got(static_cast<size_t>(core::logfmt_max_row_bytes(hidden)));
          const std::int64_t bytes = core::logfmt_encode_row(row.data(), hidden, got.data());
          ASSERT_EQ(bytes, static_cast<std::int64_t>(want.size())) << isa_name(isa) << " hidden " << hidden << " kind " << kind;
          ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0)
              << isa_name(isa) << " hidden " << hidden << " kind " << kind;
          (bytes < 2 * hidden + 4 * (hidden / 128) ? castable_rows : bf16_rows)++;

          const std::vector<float> expect = ref::logfmt_decode(want, hidden);
          std::vector<float> decoded(static_cast<size_t>(hidden));
          ASSERT_EQ(core::logfmt_decode_row(got.data(), hidden, decoded.data()), bytes);
          for (int h = 0; h < hidden; ++h)
            ASSERT_EQ(ref::bits_of(decoded[static_cast<size_t>(h)]), ref::bits_of(expect[static_cast<size_t>(h)]))
                << isa_name(isa) << " hidden " << hidden << " kind " << kind << " element " << h;
        }
    // The cases cover both kinds of chunk.
    EXPECT_GT(castable_rows, 60) << isa_name(isa);
    EXPECT_GT(bf16_rows, 60) << isa_name(isa);
  }
}

// What the combine computes for one token: the reference's decoded rows (BF16 rows encoded first),
// weighted in FP32 in row order, one BF16 rounding.
std::vector<std::uint16_t> expected_sum(const std::vector<std::vector<std::uint16_t>>& rows, const std::vector<float>& w,
                                        int hidden) {
  std::vector<float> acc(static_cast<size_t>(hidden), 0.0f);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const std::vector<float> v = ref::logfmt_decode(ref::logfmt_encode(rows[r].data(), hidden), hidden);
    for (int h = 0; h < hidden; ++h) {
      const float product = w[r] * v[static_cast<size_t>(h)];
      acc[static_cast<size_t>(h)] = r == 0 ? product : acc[static_cast<size_t>(h)] + product;
    }
  }
  std::vector<std::uint16_t> out(static_cast<size_t>(hidden));
  for (int h = 0; h < hidden; ++h) out[static_cast<size_t>(h)] = ref::bf16_from_float(acc[static_cast<size_t>(h)]);
  return out;
}

TEST(LogFmt, WeightedSumMatchesDecodingEveryRowAndSumming) {
  for (LogfmtIsa isa : isas()) {
    IsaScope scope(isa);
    std::mt19937 gen(31);
    std::uniform_real_distribution<float> weight(-1.0f, 1.0f);
    for (int hidden : {128, 640, 1024, 2560, 7168})
      for (int count : {0, 1, 2, 5, 8}) {
        std::vector<std::vector<std::uint16_t>> rows;
        std::vector<std::vector<std::byte>> encoded;
        std::vector<core::LogfmtRow> inputs;
        std::vector<float> w;
        for (int r = 0; r < count; ++r) {
          rows.push_back(make_row(gen, hidden, static_cast<int>(gen() % kKinds)));
          w.push_back(weight(gen));
          encoded.emplace_back(static_cast<size_t>(core::logfmt_max_row_bytes(hidden)));
          const std::vector<std::uint8_t> bytes = ref::logfmt_encode(rows.back().data(), hidden);
          std::memcpy(encoded.back().data(), bytes.data(), bytes.size());
        }
        for (int r = 0; r < count; ++r)  // rows that traveled encoded, and rows read in place
          inputs.push_back(gen() % 2 ? core::LogfmtRow{.encoded = encoded[static_cast<size_t>(r)].data()}
                                     : core::LogfmtRow{.bf16 = rows[static_cast<size_t>(r)].data()});
        std::vector<std::uint16_t> out(static_cast<size_t>(hidden), 0xffff);
        core::logfmt_weighted_sum(inputs, w, out.data(), hidden);
        const std::vector<std::uint16_t> want = expected_sum(rows, w, hidden);
        for (int h = 0; h < hidden; ++h)
          ASSERT_EQ(out[static_cast<size_t>(h)], want[static_cast<size_t>(h)])
              << isa_name(isa) << " hidden " << hidden << " rows " << count << " element " << h;
      }
  }
}

// Random meta pairs (amax < 1, amin below it or 0: castable blocks) before random bytes: codes of
// every value 0..511 with random signs.
std::vector<std::uint8_t> random_encoding(std::mt19937& gen, int hidden) {
  std::uniform_int_distribution<int> byte(0, 255), exponent(0, 126), mantissa(0, 127), zero(0, 7);
  std::vector<std::uint8_t> bytes(static_cast<size_t>(core::logfmt_max_row_bytes(hidden)));
  for (auto& b : bytes) b = static_cast<std::uint8_t>(byte(gen));
  for (int b = 0; b < hidden / 128; ++b) {
    const int e = exponent(gen), lower = std::uniform_int_distribution<int>(0, e)(gen);
    const auto amax = static_cast<std::uint16_t>(e << 7 | mantissa(gen));
    const auto amin = static_cast<std::uint16_t>(zero(gen) == 0 ? 0 : (lower << 7 | mantissa(gen)));
    const std::uint16_t pair[2] = {amax, std::min(amin, static_cast<std::uint16_t>(amax - 1))};
    std::memcpy(bytes.data() + 4 * b, pair, 4);
  }
  return bytes;
}

// Random codes decoded: every level of many blocks.
TEST(LogFmt, DecodeOfRandomCodesMatchesTheDefinition) {
  for (LogfmtIsa isa : isas()) {
    IsaScope scope(isa);
    std::mt19937 gen(41);
    for (int hidden : {640, 7168})
      for (int rep = 0; rep < 60; ++rep) {
        const std::vector<std::uint8_t> bytes = random_encoding(gen, hidden);
        const std::vector<float> want = ref::logfmt_decode(bytes, hidden);
        std::vector<float> got(static_cast<size_t>(hidden));
        core::logfmt_decode_row(reinterpret_cast<const std::byte*>(bytes.data()), hidden, got.data());
        for (int h = 0; h < hidden; ++h)
          ASSERT_EQ(ref::bits_of(got[static_cast<size_t>(h)]), ref::bits_of(want[static_cast<size_t>(h)]))
              << isa_name(isa) << " hidden " << hidden << " rep " << rep << " element " << h;
      }
  }
}

// The vector paths against the scalar one (itself checked against the definition above) on many
// more rows: encodings and decoded values identical, and a row read in place weighted 1 beside its
// encoding weighted -1 sums to 0 exactly wherever the row is finite (encode and decode without
// packing give the decoded values of the packed codes; one ulp apart would leave that ulp).
TEST(LogFmt, VectorPathsMatchTheScalarPathOnManyRows) {
  constexpr int kHidden = 7168;
  std::mt19937 gen(43);
  std::vector<std::vector<std::uint16_t>> rows;
  std::vector<std::vector<std::uint8_t>> random_rows;
  for (int i = 0; i < 400; ++i) rows.push_back(make_row(gen, kHidden, i % kKinds));
  for (int i = 0; i < 400; ++i) random_rows.push_back(random_encoding(gen, kHidden));
  auto run = [&](LogfmtIsa isa, std::vector<std::vector<std::byte>>& enc, std::vector<std::vector<float>>& dec) {
    IsaScope scope(isa);
    for (const auto& row : rows) {
      enc.emplace_back(static_cast<size_t>(core::logfmt_max_row_bytes(kHidden)));
      enc.back().resize(static_cast<size_t>(core::logfmt_encode_row(row.data(), kHidden, enc.back().data())));
    }
    for (const auto& bytes : random_rows) {
      dec.emplace_back(kHidden);
      core::logfmt_decode_row(reinterpret_cast<const std::byte*>(bytes.data()), kHidden, dec.back().data());
    }
  };
  std::vector<std::vector<std::byte>> scalar_enc;
  std::vector<std::vector<float>> scalar_dec;
  run(LogfmtIsa::kScalar, scalar_enc, scalar_dec);
  for (LogfmtIsa isa : isas()) {
    std::vector<std::vector<std::byte>> enc;
    std::vector<std::vector<float>> dec;
    run(isa, enc, dec);
    for (std::size_t i = 0; i < rows.size(); ++i) ASSERT_EQ(enc[i], scalar_enc[i]) << isa_name(isa) << " row " << i;
    for (std::size_t i = 0; i < random_rows.size(); ++i)
      ASSERT_EQ(std::memcmp(dec[i].data(), scalar_dec[i].data(), kHidden * sizeof(float)), 0) << isa_name(isa) << " row " << i;
    IsaScope scope(isa);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const core::LogfmtRow pair[2] = {{.bf16 = rows[i].data()}, {.encoded = scalar_enc[i].data()}};
      const float w[2] = {1.0f, -1.0f};
      std::vector<std::uint16_t> out(kHidden);
      core::logfmt_weighted_sum(pair, w, out.data(), kHidden);
      for (int h = 0; h < kHidden; ++h) {
        if ((rows[i][static_cast<size_t>(h)] & 0x7f80) != 0x7f80) {
          ASSERT_EQ(out[static_cast<size_t>(h)], 0) << isa_name(isa) << " row " << i << " element " << h;
        }
      }
    }
  }
}

// Values for log2 and exp2: random bit patterns and the special ones.
std::vector<float> logfmt_probe_values(std::mt19937& gen, int count) {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, 2.0f, 0.5f, 0x1p-149f, 0x1p-126f, 0x1.fffffep-127f, 0x1.fffffep127f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), ref::float_of(0x3F3504F3u), ref::float_of(0x3F3504F2u),
                          127.5f, 128.0f, -149.5f, -150.0f, -159.5f, -160.0f, -160.5f, 0.5f, -0.5f, 1.5f, 2.5f};
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < count; ++i) v.push_back(ref::float_of(bits(gen)));
  return v;
}

TEST(LogFmt, Log2OfEveryBf16MagnitudeMatchesTheDefinition) {
  const float* table = core::logfmt::log2_of_bf16();
  for (std::uint32_t m = 0; m < 0x8000; ++m) {
    const float want = ref::logfmt_log2(ref::float_from_bf16(static_cast<std::uint16_t>(m)));
    ASSERT_TRUE(ref::bits_of(table[m]) == ref::bits_of(want) || (std::isnan(table[m]) && std::isnan(want))) << m;
  }
}

// Every BF16 magnitude below 1, each in a castable block, with both signs: block b holds the
// magnitudes 128 b .. 128 b + 127 (one exponent, every mantissa; block 0 zero and the subnormals),
// so every code argument the vector kernels compute (the mantissa table with the exponent, or the
// full table for zero and subnormal lanes) is checked against the definition: the encoding
// byte for byte, and the round trip of the row read in place against the decoded encoding.
TEST(LogFmt, EveryMagnitudeBelowOneEncodesAsDefined) {
  constexpr int kHidden = 128 * 128;  // magnitudes 0x0000 .. 0x3f7f, then block 0 again
  std::vector<std::uint16_t> row(kHidden);
  for (int i = 0; i < kHidden; ++i) {
    const int magnitude = i < 0x3f80 ? i : i - 0x3f80;
    row[static_cast<size_t>(i)] = static_cast<std::uint16_t>(magnitude | ((i * 7) % 3 == 0 ? 0x8000 : 0));
  }
  for (int b = 0; b < kHidden / 128; ++b)  // each block castable: its largest magnitude below 1
    ASSERT_LT(ref::float_from_bf16(static_cast<std::uint16_t>(row[static_cast<size_t>(128 * b + 127)] & 0x7fff)), 1.0f);
  const std::vector<std::uint8_t> want = ref::logfmt_encode(row.data(), kHidden);
  ASSERT_LT(want.size(), static_cast<size_t>(2 * kHidden)) << "every chunk castable";
  const std::vector<float> decoded = ref::logfmt_decode(want, kHidden);
  for (LogfmtIsa isa : isas()) {
    IsaScope scope(isa);
    std::vector<std::byte> got(static_cast<size_t>(core::logfmt_max_row_bytes(kHidden)));
    ASSERT_EQ(core::logfmt_encode_row(row.data(), kHidden, got.data()), static_cast<std::int64_t>(want.size()))
        << isa_name(isa);
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(static_cast<std::uint8_t>(got[i]), want[i]) << isa_name(isa) << " byte " << i;
    const core::LogfmtRow in[1] = {{.bf16 = row.data()}};
    const float w[1] = {1.0f};
    std::vector<std::uint16_t> out(kHidden);
    core::logfmt_weighted_sum(in, w, out.data(), kHidden);
    for (int h = 0; h < kHidden; ++h)
      ASSERT_EQ(out[static_cast<size_t>(h)], ref::bf16_from_float(decoded[static_cast<size_t>(h)]))
          << isa_name(isa) << " element " << h << " magnitude bits " << (row[static_cast<size_t>(h)] & 0x7fff);
  }
}

TEST(LogFmt, Log2AndExp2MatchTheDefinition) {
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> range(-170.0f, 130.0f);
  std::vector<float> values = logfmt_probe_values(gen, 1 << 20);
  for (int i = 0; i < (1 << 20); ++i) values.push_back(range(gen));
  for (float v : values) {
    const float l = core::logfmt::log2(v), want_l = ref::logfmt_log2(v);
    ASSERT_TRUE(ref::bits_of(l) == ref::bits_of(want_l) || (std::isnan(l) && std::isnan(want_l))) << std::hexfloat << v;
    const float e = core::logfmt::exp2(v), want_e = ref::logfmt_exp2(v);
    ASSERT_TRUE(ref::bits_of(e) == ref::bits_of(want_e) || (std::isnan(e) && std::isnan(want_e))) << std::hexfloat << v;
  }
  EXPECT_EQ(core::logfmt::log2(0.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(core::logfmt::log2(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(core::logfmt::log2(-1.0f)));
  EXPECT_EQ(core::logfmt::exp2(128.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(ref::bits_of(core::logfmt::exp2(-160.0f)), 0u);
  EXPECT_EQ(core::logfmt::exp2(-149.0f), 0x1p-149f);
  for (int k = -149; k < 128; ++k) {  // exact at powers of two
    EXPECT_EQ(core::logfmt::log2(std::ldexp(1.0f, k)), static_cast<float>(k));
    EXPECT_EQ(core::logfmt::exp2(static_cast<float>(k)), std::ldexp(1.0f, k));
  }
}

// The errors the doc states: log2 within 2.4e-7 relative (3.01 ulp) of the exact value, exp2
// within 1.1e-7 relative where the result is normal and one unit of 2^-149 below.
TEST(LogFmt, Log2AndExp2AreCloseToTheExactFunctions) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<std::uint32_t> positive(1, 0x7f7fffffu);
  double log2_error = 0, exp2_error = 0, subnormal_error = 0;
  for (int i = 0; i < (1 << 22); ++i) {
    const float v = ref::float_of(positive(gen));
    const double exact = std::log2(static_cast<double>(v));
    if (exact != 0) log2_error = std::max(log2_error, std::fabs((core::logfmt::log2(v) - exact) / exact));
  }
  std::uniform_real_distribution<float> range(-150.0f, 128.0f);
  for (int i = 0; i < (1 << 22); ++i) {
    const float x = range(gen);
    const double exact = std::exp2(static_cast<double>(x)), got = core::logfmt::exp2(x);
    if (exact >= 0x1p-126)
      exp2_error = std::max(exp2_error, std::fabs(got - exact) / exact);
    else
      subnormal_error = std::max(subnormal_error, std::fabs(got - exact) / 0x1p-149);
  }
  EXPECT_LT(log2_error, 2.4e-7);
  EXPECT_LT(exp2_error, 1.1e-7);
  EXPECT_LE(subnormal_error, 1.0);
  std::printf("max relative error: log2 %.3g, exp2 %.3g; exp2 below 2^-126: %.3g x 2^-149\n", log2_error, exp2_error,
              subnormal_error);
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
