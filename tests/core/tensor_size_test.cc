// Sizes, strides and byte counts of views: a view whose element count, byte count or byte
// extent does not fit in 64 bits is refused when it is made (InvalidArgument naming the shape);
// Tensor::with_view refuses views outside the tensor's storage; DLPack import refuses null data
// with elements, and descriptors it cannot read.
#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/checks.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"
#include "support/text.hh"

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

using testing::contains;

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

// A view without elements may have no data pointer: conversions copy nothing from it (memcpy
// from a null pointer is undefined even for 0 bytes; UBSan reports it).
TEST(TensorSize, EmptyViewsWithoutDataConvert) {
  EXPECT_EQ(to_fp32(TensorView(nullptr, DType::kFP32, {0, 4})).numel(), 0);
  EXPECT_EQ(to_bf16(TensorView(nullptr, DType::kBF16, {3, 0})).numel(), 0);
  EXPECT_EQ(to_fp32(TensorView(nullptr, DType::kBF16, {0})).size(0), 0);
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

DLTensor dl_tensor(void* data, DLDataType dtype, int ndim, std::int64_t* shape, std::int64_t* strides = nullptr,
                   std::uint64_t byte_offset = 0) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = byte_offset;
  return t;
}

constexpr DLDataType kDLF32{kDLFloat, 32, 1};

TEST(WithView, ViewsOutsideTheStorageAreRefused) {
  Tensor t = Tensor::empty({4, 8}, DType::kFP32);
  float* base = t.data_as<float>();
  const std::int64_t one[] = {1}, two[] = {2}, four[] = {4};
  const std::int64_t backwards[] = {-1}, huge[] = {kTwo62};
  std::string e = error_of([&] { t.with_view(TensorView(base + 32, DType::kFP32, one)); });
  ASSERT_FALSE(e.empty()) << "a view past the end was accepted";
  EXPECT_FALSE(error_of([&] { t.with_view(TensorView(base + 30, DType::kFP32, four)); }).empty());
  EXPECT_FALSE(error_of([&] { t.with_view(TensorView(base - 1, DType::kFP32, two)); }).empty());
  EXPECT_FALSE(error_of([&] { t.with_view(TensorView(base, DType::kFP32, two, backwards)); }).empty());
  EXPECT_FALSE(error_of([&] { t.with_view(TensorView(base, DType::kFP32, {4, 9})); }).empty());
  Tensor bytes = Tensor::empty({64}, DType::kUInt8);
  EXPECT_FALSE(error_of([&] { bytes.with_view(TensorView(bytes.data(), DType::kUInt8, two, huge)); }).empty());
  // A wider dtype over the same bytes: 32 floats are 128 bytes, 17 int64 are 136.
  EXPECT_FALSE(error_of([&] { t.with_view(TensorView(base, DType::kInt64, {17})); }).empty());
}

TEST(WithView, ViewsInsideTheStorageShareIt) {
  Tensor t = Tensor::empty({4, 8}, DType::kFP32);
  std::iota(t.data_as<float>(), t.data_as<float>() + 32, 0.0f);
  float* base = t.data_as<float>();
  Tensor tr = t.with_view(t.transposed(0, 1));
  EXPECT_EQ(t.use_count(), 2);
  EXPECT_EQ(tr.data_as<float>()[tr.stride(0) * 3 + tr.stride(1) * 2], 2 * 8 + 3);
  // The last element backwards to the first.
  const std::int64_t all[] = {32}, backwards[] = {-1};
  Tensor rev = t.with_view(TensorView(base + 31, DType::kFP32, all, backwards));
  EXPECT_EQ(rev.data_as<float>()[-31], 0.0f);
  // A block of rows 1..2, columns 2..5.
  const std::int64_t block[] = {2, 4}, strides[] = {8, 1};
  Tensor b = t.with_view(TensorView(base + 10, DType::kFP32, block, strides));
  EXPECT_EQ(b.data_as<float>()[8 + 3], 21.0f);
  // Empty views at either end, and the same bytes as another dtype.
  EXPECT_NO_THROW(t.with_view(TensorView(base + 32, DType::kFP32, {0})));
  EXPECT_NO_THROW(t.with_view(TensorView(base, DType::kInt64, {16})));
  // A tensor without storage wraps a caller's view as is and keeps nothing alive.
  float mine[6] = {};
  Tensor wrapped = Tensor().with_view(TensorView(mine, DType::kFP32, {2, 3}));
  EXPECT_EQ(wrapped.data(), mine);
  EXPECT_EQ(wrapped.use_count(), 0);
  // Views of views: the storage is still the whole block.
  Tensor row = t.with_view(TensorView(base + 8, DType::kFP32, {8}));
  EXPECT_NO_THROW(row.with_view(TensorView(base, DType::kFP32, {32})));
  EXPECT_THROW(row.with_view(TensorView(base, DType::kFP32, {33})), InvalidArgument);
}

// A view with elements but no data pointer is nowhere in the storage, even when its negative
// strides would make its first byte's address wrap around to a high one.
TEST(WithView, ViewsWithElementsAndNoDataAreRefused) {
  Tensor t = Tensor::empty({4}, DType::kFP32);
  const std::int64_t three[] = {3}, backwards[] = {-1};
  EXPECT_THROW(t.with_view(TensorView(nullptr, DType::kFP32, three, backwards)), InvalidArgument);
  EXPECT_THROW(t.with_view(TensorView(nullptr, DType::kFP32, {2})), InvalidArgument);
  Tensor none = Tensor::empty({0}, DType::kFP32);
  EXPECT_THROW(none.with_view(TensorView(nullptr, DType::kFP32, three, backwards)), InvalidArgument);
}

TEST(WithView, ImportedTensorsRefuseViewsOutsideTheImportedBytes) {
  float data[12] = {};
  std::int64_t shape[] = {3, 4};
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor = dl_tensor(data, kDLF32, 2, shape);
  managed->deleter = [](DLManagedTensor* self) { delete self; };
  Tensor t = Tensor::from_dlpack(managed);
  EXPECT_NO_THROW(t.with_view(TensorView(data + 4, DType::kFP32, {2, 4})));
  EXPECT_THROW(t.with_view(TensorView(data + 4, DType::kFP32, {3, 4})), InvalidArgument);
}

TEST(DLPackImport, NullDataAndUnreadableDescriptorsAreRefused) {
  std::int64_t four[] = {4};
  // byte_offset on a null pointer.
  std::string e = error_of([&] { view_from_dlpack(dl_tensor(nullptr, kDLF32, 1, four, nullptr, 64)); });
  ASSERT_FALSE(e.empty()) << "null data with a byte offset was accepted";
  EXPECT_TRUE(contains(e, "null")) << e;
  e = error_of([&] { view_from_dlpack(dl_tensor(nullptr, kDLF32, 1, four)); });
  EXPECT_TRUE(contains(e, "null")) << e;
  // No elements: null data is fine (and stays null).
  std::int64_t zero[] = {0};
  const TensorView none = view_from_dlpack(dl_tensor(nullptr, kDLF32, 1, zero));
  EXPECT_EQ(none.data(), nullptr);
  EXPECT_EQ(none.numel(), 0);
  // No shape array.
  float data[16] = {};
  e = error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, 2, nullptr)); });
  EXPECT_TRUE(contains(e, "shape")) << e;
  // A scalar (rank 0, no shape array needed) has one element: it needs data.
  const TensorView scalar = view_from_dlpack(dl_tensor(data, kDLF32, 0, nullptr));
  EXPECT_EQ(scalar.ndim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.nbytes(), 4u);
  e = error_of([&] { view_from_dlpack(dl_tensor(nullptr, kDLF32, 0, nullptr)); });
  EXPECT_TRUE(contains(e, "null data pointer")) << e;
  // Negative sizes, ranks outside [0, 6].
  std::int64_t negative[] = {2, -3};
  EXPECT_FALSE(error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, 2, negative)); }).empty());
  std::int64_t seven[] = {1, 1, 1, 1, 1, 1, 1};  // beyond the 6 dimensions supported
  EXPECT_FALSE(error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, 7, seven)); }).empty());
  EXPECT_FALSE(error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, -1, seven)); }).empty());
  // A byte offset that wraps the address space, shapes and strides that overflow.
  EXPECT_FALSE(error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, 1, four, nullptr, ~std::uint64_t{0} - 7)); }).empty());
  std::int64_t wide[] = {kTwo62, 8};
  EXPECT_FALSE(error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, 2, wide)); }).empty());
  std::int64_t two[] = {2}, far[] = {kMax};
  EXPECT_FALSE(error_of([&] { view_from_dlpack(dl_tensor(data, kDLF32, 1, two, far)); }).empty());
  // A good one: offset applied, strides kept.
  std::int64_t shape[] = {2, 3}, strides[] = {1, 2};
  const TensorView v = view_from_dlpack(dl_tensor(data, kDLF32, 2, shape, strides, 8));
  EXPECT_EQ(v.data(), data + 2);
  EXPECT_EQ(v.stride(1), 2);
}

TEST(DLPackImport, RefusedImportsRunTheDeleter) {
  static int deleted = 0;
  deleted = 0;
  std::int64_t four[] = {4};
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor = dl_tensor(nullptr, kDLF32, 1, four);
  managed->deleter = [](DLManagedTensor* self) {
    ++deleted;
    delete self;
  };
  EXPECT_THROW(Tensor::from_dlpack(managed), InvalidArgument);
  EXPECT_EQ(deleted, 1);
}

}  // namespace
}  // namespace moe_ep
