// The NVFP4 row cast (src/core/nvfp4_rows.hh) against the reference written from the definition
// (tests/reference/numeric_reference.hh): every scale path and rounding, over rows with wide
// value ranges, zero and tiny blocks, NaN and infinite elements and several global scales, on every
// instruction set the CPU has.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/nvfp4_rows.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace {

namespace ref = reference;

// The paths a cast can take: the default (the widest the CPU has), then each instruction set.
// Where the CPU lacks one, its call returns false and the check is made on the paths it has; the
// portable path runs everywhere.
constexpr int kPaths = 4;
const char* const kPathNames[kPaths] = {"default", "portable", "avx2", "avx512"};
bool cast_on_path(int path, const std::vector<std::uint16_t>& row, int hidden, const core::Nvfp4Cast& cast,
                  std::vector<std::uint8_t>& packed, std::vector<std::uint8_t>& scales) {
  if (path == 0) {
    core::cast_row_nvfp4(row.data(), hidden, cast, packed.data(), scales.data());
    return true;
  }
  const core::Isa isa[] = {core::Isa::kPortable, core::Isa::kAvx2, core::Isa::kAvx512};
  return core::cast_row_nvfp4_on(isa[path - 1], row.data(), hidden, cast, packed.data(), scales.data());
}

// The first index where two byte vectors differ (their size when they agree).
std::size_t first_difference(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  std::size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// Casts `row` with global scale gs, UE8M0 or E4M3 scales and the SM90 or nearest-even rounding on
// every path the CPU has, and compares with the reference; at the first difference, a failure
// naming `what`, the cast, the path and the byte, and false.
bool every_path_matches(const std::vector<std::uint16_t>& row, int hidden, float gs, bool ue8m0, bool sm90,
                        const std::string& what) {
  const ref::Nvfp4Row want = ref::quantize_row_nvfp4(row.data(), hidden, gs, ue8m0, sm90);
  const core::Nvfp4Cast cast{.global_scale = gs, .ue8m0 = ue8m0,
                             .rounding = sm90 ? E2M1Rounding::kSm90 : E2M1Rounding::kNearestEven};
  for (int path = 0; path < kPaths; ++path) {
    std::vector<std::uint8_t> packed(static_cast<size_t>(hidden) / 2), scales(static_cast<size_t>(hidden) / 16);
    if (!cast_on_path(path, row, hidden, cast, packed, scales)) continue;
    for (const auto& [name, got, expected] : {std::tuple{"scale", &scales, &want.scales}, {"packed", &packed, &want.packed}})
      if (*got != *expected) {
        const std::size_t i = first_difference(*got, *expected);
        ADD_FAILURE() << what << " gs " << gs << " ue8m0 " << ue8m0 << " sm90 " << sm90 << " path " << kPathNames[path]
                      << ": " << name << " byte " << i << " is " << (i < got->size() ? int{(*got)[i]} : -1)
                      << ", the reference " << (i < expected->size() ? int{(*expected)[i]} : -1);
        return false;
      }
  }
  return true;
}

std::vector<std::uint16_t> make_nvfp4_row(std::mt19937& gen, int hidden, int kind) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<std::uint16_t> row(static_cast<size_t>(hidden));
  for (int i = 0; i < hidden; ++i) {
    const int block = i / 16;
    float v = normal(gen);
    if (kind == 1) v = std::ldexp(v, exponent(gen));            // wide range within a block
    if (kind == 2 && block % 3 == 0) v = 0.0f;                  // zero blocks
    if (kind == 2 && block % 3 == 1) v = std::ldexp(v, -130);   // blocks near the bottom of FP32
    if (kind == 3 && i % 37 == 5) v = std::numeric_limits<float>::quiet_NaN();
    if (kind == 3 && i % 53 == 7) v = -std::numeric_limits<float>::infinity();
    if (kind == 4) v = std::ldexp(v, 100);                      // large
    row[static_cast<size_t>(i)] = ref::bf16_from_float(v);
  }
  return row;
}

TEST(Nvfp4Rows, MatchTheReferenceBitForBit) {
  std::mt19937 gen(2024);
  int rows = 0;
  for (const int hidden : {256, 336, 1120})  // 16 blocks; 21 (16 and 5 more); 70 (a chunk of 64 and 6 more)
    for (int kind = 0; kind < 5; ++kind)
      for (int rep = 0; rep < 40; ++rep) {
        const auto row = make_nvfp4_row(gen, hidden, kind);
        for (float gs : {1.0f, 0.37f, 1e-3f, 1e4f, 448.0f * 6.0f / 3.5f})
          for (bool ue8m0 : {false, true})
            for (bool sm90 : {false, true}) {
              ASSERT_TRUE(every_path_matches(row, hidden, gs, ue8m0, sm90,
                                             "hidden " + std::to_string(hidden) + " kind " + std::to_string(kind)));
              ++rows;
            }
      }
  EXPECT_EQ(rows, 3 * 5 * 40 * 5 * 2 * 2);
}

// Every BF16 code, twice: sixteen consecutive codes per block, and fifteen per block beside an
// anchor of 6.0 (so that the block scale is 1 wherever the codes stay within 6, and the values
// land exactly on the E2M1 midpoints: ties), subnormals, infinities and NaNs included; with E4M3
// and power-of-two (UE8M0) scales, both roundings, every path.
TEST(Nvfp4Rows, EveryBf16CodeMatchesTheReferenceOnEveryPath) {
  std::vector<std::uint16_t> row;
  for (int code = 0; code < 65536; ++code) row.push_back(static_cast<std::uint16_t>(code));
  for (int code = 0; code < 65536; ++code) {
    if (row.size() % 16 == 0) row.push_back(0x40c0);  // 6.0
    row.push_back(static_cast<std::uint16_t>(code));
  }
  while (row.size() % 16 != 0) row.push_back(0);
  const int hidden = static_cast<int>(row.size());
  for (float gs : {1.0f, 0.37f})
    for (bool ue8m0 : {false, true})
      for (bool sm90 : {false, true}) {
        EXPECT_TRUE(every_path_matches(row, hidden, gs, ue8m0, sm90, "every BF16 code"));
      }
}

TEST(Nvfp4Rows, NibbleOrderAndAKnownBlock) {
  // One block: x_i = i / 4 for i = 0..15 (vmax 3.75). UE8M0: vmax / 6 = 0.625 -> 2^0 -> byte 127,
  // out_scale 1, so the codes are e2m1(i / 4) with ties to even.
  std::vector<std::uint16_t> row(16);
  for (int i = 0; i < 16; ++i) row[static_cast<size_t>(i)] = ref::bf16_from_float(static_cast<float>(i) / 4.0f);
  std::vector<std::uint8_t> packed(8), scales(1);
  core::cast_row_nvfp4(row.data(), 16, {.ue8m0 = true}, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 127);
  // e2m1 of 0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75:
  //         0,   0,  1,   2, 2,    2,   3,    4, 4,    4,   4,    5, 5,    5,   6,    6
  const int codes[16] = {0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 4, 5, 5, 5, 6, 6};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(packed[static_cast<size_t>(i)], codes[2 * i] | codes[2 * i + 1] << 4) << i;
}

}  // namespace
}  // namespace moe_ep
