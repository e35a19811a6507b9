// The row kernels against a scalar reference written from their contract (with the BF16
// conversions of tests/reference), on every row count, odd lengths (vector tails), and special values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
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

using SumRows = void (*)(std::span<const std::uint16_t* const>, std::uint16_t*, std::int64_t);

// `offset` elements into a 64-byte aligned buffer: 0 gives the streaming path an aligned output,
// 1 a misaligned one (its regular-store fallback).
void check_sum(SumRows sum, int offset) {
  std::mt19937 rng(5);
  for (int n : {1, 7, 31, 32, 33, 100, 7168}) {
    for (int rows = 0; rows <= 9; ++rows) {
      std::vector<std::vector<std::uint16_t>> in;
      std::vector<const std::uint16_t*> ptrs;
      for (int r = 0; r < rows; ++r) in.push_back(random_row(rng, n));
      for (auto& r : in) ptrs.push_back(r.data());
      alignas(64) static std::uint16_t buffer[7168 + 32];
      std::fill(std::begin(buffer), std::end(buffer), std::uint16_t{0xffff});
      std::uint16_t* out = buffer + offset;
      sum(ptrs, out, n);
      core::streaming_fence();
      for (int h = n + offset; h < static_cast<int>(std::size(buffer)); ++h)
        ASSERT_EQ(buffer[h], 0xffff) << "written past the row: n " << n << " rows " << rows;
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

TEST(Reduce, SumMatchesOrderedFp32Reference) { check_sum(core::sum_bf16_rows, 0); }
TEST(Reduce, StreamingSumMatchesOrderedFp32Reference) {
  check_sum(core::sum_bf16_rows_streaming, 0);
  check_sum(core::sum_bf16_rows_streaming, 1);
}

// The two-level sum: each term of several rows is rounded to BF16 before it joins the sum, exactly
// as if it had been written into a row of its own first. Terms of 1 to 4 rows, and terms of one
// row each (the compact layout's, which the kernel sums as plain rows).
TEST(Reduce, TermSumRoundsEachTermOnceThenSumsInOrder) {
  std::mt19937 rng(9);
  for (int most_rows : {4, 1}) {
    for (int n : {1, 31, 32, 33, 7168}) {
      std::uniform_int_distribution<int> rows_per_term(1, most_rows);
      for (int count = 0; count <= 6; ++count) {
        std::vector<std::vector<std::vector<std::uint16_t>>> in(static_cast<size_t>(count));
        std::vector<std::vector<const std::uint16_t*>> ptrs(static_cast<size_t>(count));
        std::vector<core::Bf16Term> terms;
        for (int t = 0; t < count; ++t) {
          const int rows = rows_per_term(rng);
          for (int r = 0; r < rows; ++r) in[static_cast<size_t>(t)].push_back(random_row(rng, n));
          for (auto& r : in[static_cast<size_t>(t)]) ptrs[static_cast<size_t>(t)].push_back(r.data());
          terms.push_back({ptrs[static_cast<size_t>(t)]});
        }
        for (int offset : {0, 1}) {
          alignas(64) static std::uint16_t buffer[7168 + 32];
          std::fill(std::begin(buffer), std::end(buffer), std::uint16_t{0xffff});
          std::uint16_t* out = buffer + offset;
          core::sum_bf16_terms_streaming(terms, out, n);
          core::streaming_fence();
          for (int h = n + offset; h < static_cast<int>(std::size(buffer)); ++h)
            ASSERT_EQ(buffer[h], 0xffff) << "written past the row: n " << n << " terms " << count;
          for (int h = 0; h < n; ++h) {
            // Each term's value: its row, or the BF16 rounding of its rows' ordered FP32 sum.
            auto term = [&](int t) {
              const auto& rows = in[static_cast<size_t>(t)];
              float acc = float_from_bf16(rows[0][static_cast<size_t>(h)]);
              if (rows.size() == 1) return acc;
              for (std::size_t r = 1; r < rows.size(); ++r) acc = acc + float_from_bf16(rows[r][static_cast<size_t>(h)]);
              return float_from_bf16(bf16_from_float(acc));
            };
            std::uint16_t expected = 0;
            if (count == 1 && in[0].size() == 1) {
              expected = in[0][0][static_cast<size_t>(h)];
            } else if (count >= 1) {
              float acc = term(0);
              for (int t = 1; t < count; ++t) acc = acc + term(t);
              expected = bf16_from_float(acc);
            }
            const bool both_nan =
                std::isnan(float_from_bf16(expected)) && std::isnan(float_from_bf16(out[static_cast<size_t>(h)]));
            ASSERT_TRUE(both_nan || out[static_cast<size_t>(h)] == expected)
                << "n " << n << " terms " << count << " h " << h << " offset " << offset;
          }
        }
      }
    }
  }
}

// Every length around the vector steps, aligned and misaligned destinations and sources: the
// bytes land exactly, and nothing around them changes.
TEST(Reduce, StreamingCopyIsExact) {
  std::mt19937 rng(11);
  std::vector<std::uint8_t> src(4096 + 64);
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  alignas(64) static std::uint8_t dst[4096 + 256];
  for (std::size_t bytes : {0, 1, 31, 32, 255, 256, 257, 384, 1000, 4096})
    for (std::size_t dst_offset : {0, 1, 16, 32})
      for (std::size_t src_offset : {0, 3}) {
        std::fill(std::begin(dst), std::end(dst), std::uint8_t{0xa5});
        core::copy_bytes_streaming(dst + dst_offset, src.data() + src_offset, bytes);
        core::streaming_fence();
        for (std::size_t i = 0; i < std::size(dst); ++i) {
          const bool inside = i >= dst_offset && i < dst_offset + bytes;
          ASSERT_EQ(dst[i], inside ? src[src_offset + i - dst_offset] : 0xa5)
              << "bytes " << bytes << " dst offset " << dst_offset << " src offset " << src_offset << " at " << i;
        }
      }
}

// Records of `columns` 4-byte values placed column-major: every value at column * stride + row,
// the rest of each column left as it was (poison) or, on the line-writing path, zero up to the end
// of the line that holds the last row; nothing outside the columns is written.
TEST(Reduce, PlaceColumnsStreamingTransposesRecords) {
  constexpr std::uint32_t kPoison = 0xdeadbeefu;
  constexpr int kColumns = 5;
  for (std::int64_t capacity : {std::int64_t{16}, std::int64_t{48}, std::int64_t{13}})
    for (std::int64_t misalign : {std::int64_t{0}, std::int64_t{1}})
      for (std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, std::int64_t{16}, std::int64_t{17},
                             capacity}) {
        if (n > capacity) continue;
        std::vector<std::vector<std::uint32_t>> records(static_cast<std::size_t>(n));
        std::vector<const std::byte*> pointers;
        for (std::int64_t r = 0; r < n; ++r) {
          for (int c = 0; c < kColumns + 2; ++c)  // longer records: only the first kColumns values are placed
            records[static_cast<std::size_t>(r)].push_back(static_cast<std::uint32_t>(1000 * r + c + 1));
          pointers.push_back(reinterpret_cast<const std::byte*>(records[static_cast<std::size_t>(r)].data()));
        }
        const std::int64_t stride = capacity, total = kColumns * capacity + 32;
        alignas(64) static std::uint32_t storage[kColumns * 48 + 32];
        std::fill(storage, storage + total, kPoison);
        std::uint32_t* dst = storage + misalign;
        core::place_columns_streaming(pointers, kColumns, dst, stride, capacity);
        core::streaming_fence();
        const bool lines = misalign == 0 && capacity % 16 == 0;
        const std::int64_t written = lines ? (n + 15) / 16 * 16 : n;  // rows written in each column
        for (std::int64_t i = 0; i < total - misalign; ++i) {
          const std::int64_t column = i / stride, row = i % stride;
          std::uint32_t expected = kPoison;
          if (column < kColumns && row < n) expected = static_cast<std::uint32_t>(1000 * row + column + 1);
          else if (column < kColumns && row < written) expected = 0;
          ASSERT_EQ(dst[i], expected) << "capacity " << capacity << " misalign " << misalign << " rows " << n
                                      << " at column " << column << " row " << row;
        }
        ASSERT_EQ(storage[0], misalign ? kPoison : dst[0]);
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
