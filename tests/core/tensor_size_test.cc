// Sizes, strides and byte counts of views: a view whose element count, byte count or byte
// extent does not fit in 64 bits is refused when it is made (InvalidArgument naming the shape).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/checks.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {
namespace {

constexpr std::int64_t kTwo33 = std::int64_t{1} << 33, kTwo61 = std::int64_t{1} << 61, kTwo62 = std::int64_t{1} << 62;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not an InvalidArgument: ") + e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(TensorSize, ContiguousShapesThatOverflowAreRefused) {
  alignas(64) static std::byte memory[256];
  // [2^33, 2^33]: 2^66 elements.
  std::string e = error_of([] { TensorView(memory, DType::kBF16, {kTwo33, kTwo33}); });
  EXPECT_TRUE(contains(e, "[8589934592, 8589934592]")) << e;
  // [8, 2^62]: 2^65 elements.
  e = error_of([] { TensorView(memory, DType::kFP32, {8, kTwo62}); });
  EXPECT_TRUE(contains(e, "[8, 4611686018427387904]")) << e;
  // 2^62 elements fit, their 2^65 bytes do not.
  e = error_of([] { TensorView(memory, DType::kInt64, {kTwo61, 2}); });
  EXPECT_TRUE(contains(e, "[2305843009213693952, 2]")) << e;
  // Empty, but the stride of the first dimension (2^124) does not exist.
  e = error_of([] { TensorView(memory, DType::kUInt8, {0, kTwo62, kTwo62}); });
  EXPECT_TRUE(contains(e, "[0, 4611686018427387904, 4611686018427387904]")) << e;
  // Tensor::empty must not hand out a 0-byte block that claims 2^64 elements.
  e = error_of([] { Tensor::empty({kTwo62, 4}, DType::kFP32); });
  EXPECT_TRUE(contains(e, "[4611686018427387904, 4]")) << e;
  // What fits is kept exactly.
  TensorView big(memory, DType::kUInt8, {kTwo62, 1});
  EXPECT_EQ(big.numel(), kTwo62);
  EXPECT_EQ(big.nbytes(), static_cast<std::size_t>(kTwo62));
  EXPECT_TRUE(big.is_contiguous());
  TensorView empty(memory, DType::kFP32, {0, kTwo61});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.nbytes(), 0u);
}

TEST(TensorSize, StridedViewsWhoseExtentOverflowsAreRefused) {
  alignas(64) static std::byte memory[256];
  auto make = [](DType dtype, std::vector<std::int64_t> shape, std::vector<std::int64_t> strides) {
    return error_of([&] { TensorView(memory, dtype, shape, strides); });
  };
  // (2^62 + 1) elements of 4 bytes.
  EXPECT_TRUE(contains(make(DType::kFP32, {2, 2}, {kTwo62, 1}), "[2, 2]"));
  EXPECT_FALSE(make(DType::kFP32, {2}, {kMax}).empty());
  EXPECT_FALSE(make(DType::kFP32, {2}, {-kTwo62}).empty());
  EXPECT_FALSE(make(DType::kUInt8, {3}, {std::numeric_limits<std::int64_t>::min()}).empty());
  EXPECT_FALSE(make(DType::kUInt8, {kMax, 2}, {1, 1}).empty());
  // Element count overflows although each stride is small.
  EXPECT_FALSE(make(DType::kUInt8, {kTwo33, kTwo33}, {0, 0}).empty());
}

TEST(TensorSize, TheOverlapCheckHandlesStridesNearTheLimit) {
  alignas(64) static std::byte memory[256];
  // Two rows 2^62 bytes apart: disjoint, and the span of the outer dimension is 2^63.
  const std::int64_t shape[] = {2, 2}, strides[] = {kTwo62, 1};
  const TensorView v(memory, DType::kUInt8, shape, strides);
  EXPECT_NO_THROW(core::expect_non_overlapping("test", "v", v));
  const std::int64_t overlapping[] = {1, 1};
  EXPECT_THROW(core::expect_non_overlapping("test", "v", TensorView(memory, DType::kUInt8, shape, overlapping)),
               InvalidArgument);
}

}  // namespace
}  // namespace moe_ep
