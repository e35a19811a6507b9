#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "core/checks.hh"
#include "core/host_allocator.hh"
#include "core/npy.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {
namespace {

TEST(Tensor, ContiguousShapeStridesAndAlignment) {
  Tensor t = Tensor::empty({3, 5, 7}, DType::kBF16);
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.numel(), 105);
  EXPECT_EQ(t.nbytes(), 210u);
  EXPECT_EQ(t.stride(0), 35);
  EXPECT_EQ(t.stride(1), 7);
  EXPECT_EQ(t.stride(2), 1);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(t.describe(), "bfloat16[3, 5, 7]");
  TensorView tr = t.transposed(0, 2);
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.size(0), 7);
  EXPECT_EQ(tr.stride(0), 1);
}

TEST(Tensor, CopiesShareStorage) {
  Tensor a = Tensor::zeros({4}, DType::kInt32);
  Tensor b = a;
  b.data_as<std::int32_t>()[2] = 9;
  EXPECT_EQ(a.data_as<std::int32_t>()[2], 9);
  EXPECT_EQ(a.use_count(), 2);
}

TEST(Tensor, RejectsBadShapes) {
  std::int64_t shape7[] = {1, 1, 1, 1, 1, 1, 1};
  EXPECT_THROW(Tensor::empty(shape7, DType::kFP32), InvalidArgument);
  EXPECT_THROW(Tensor::empty({2, -1}, DType::kFP32), InvalidArgument);
}

TEST(Tensor, LargeBlocksAreRecycledWithoutNewMappings) {
  { Tensor warm = Tensor::empty({8 << 20}, DType::kUInt8); }
  const auto before = host_allocator_stats();
  for (int i = 0; i < 10; ++i) {
    Tensor t = Tensor::empty({(8 << 20) - i * 4096}, DType::kUInt8);
    static_cast<std::uint8_t*>(t.data())[t.nbytes() - 1] = 1;
  }
  EXPECT_EQ(host_allocator_stats().num_maps, before.num_maps);
}

// Of the cached blocks that fit a request (at most twice its size), the one freed last is taken:
// a loop that allocates and frees the same sizes keeps using the same, recently touched blocks,
// whatever older blocks of other shapes are cached beside them.
TEST(HostAllocator, TheBlockFreedLastIsReusedFirst) {
  core::host_allocator_trim();
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  auto older = core::allocate_host(8 * kMiB), newer = core::allocate_host(8 * kMiB);
  auto bigger = core::allocate_host(14 * kMiB), too_big = core::allocate_host(20 * kMiB);
  void* const older_at = older.get();
  void* const newer_at = newer.get();
  void* const bigger_at = bigger.get();
  void* const too_big_at = too_big.get();
  older.reset();
  newer.reset();
  auto again = core::allocate_host(8 * kMiB);  // equal sizes: the one freed last
  EXPECT_EQ(again.get(), newer_at);
  again.reset();
  bigger.reset();
  too_big.reset();
  // 14 MiB fits 8 (at most twice as large) and was freed last; 20 MiB does not fit.
  auto next = core::allocate_host(8 * kMiB);
  EXPECT_EQ(next.get(), bigger_at);
  auto then = core::allocate_host(8 * kMiB);  // of the rest the 8 MiB block freed last
  EXPECT_EQ(then.get(), newer_at);
  auto last = core::allocate_host(8 * kMiB);
  EXPECT_EQ(last.get(), older_at);
  EXPECT_NE(last.get(), too_big_at);
  const std::size_t maps = host_allocator_stats().num_maps;
  next.reset();
  then.reset();
  last.reset();
  auto steady = core::allocate_host(8 * kMiB);
  EXPECT_EQ(steady.get(), older_at) << "freed last";
  EXPECT_EQ(host_allocator_stats().num_maps, maps) << "no new mapping while cached blocks fit";
  core::host_allocator_trim();
}

TEST(DLPack, ExportImportRoundTripKeepsDataAlive) {
  DLManagedTensor* managed = nullptr;
  {
    Tensor t = Tensor::empty({2, 3}, DType::kFP8E4M3);
    std::iota(t.data_as<std::uint8_t>(), t.data_as<std::uint8_t>() + 6, 1);
    managed = t.to_dlpack();
  }
  EXPECT_EQ(managed->dl_tensor.dtype.code, 10);  // float8_e4m3fn in DLPack >= 1.1
  EXPECT_EQ(managed->dl_tensor.ndim, 2);
  EXPECT_EQ(managed->dl_tensor.shape[1], 3);
  Tensor back = Tensor::from_dlpack(managed);
  EXPECT_EQ(back.dtype(), DType::kFP8E4M3);
  EXPECT_EQ(back.data_as<std::uint8_t>()[5], 6);
}

TEST(DLPack, ImportRunsDeleterWhenLastReferenceDies) {
  static int deleted = 0;
  std::int64_t shape[] = {2, 2};
  std::int64_t strides[] = {1, 2};  // column-major
  float storage[4] = {1, 2, 3, 4};
  auto* m = new DLManagedTensor{};
  m->dl_tensor = DLTensor{storage, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, strides, 0};
  m->deleter = [](DLManagedTensor* self) {
    ++deleted;
    delete self;
  };
  {
    Tensor t = Tensor::from_dlpack(m);
    EXPECT_FALSE(t.is_contiguous());
    EXPECT_EQ(t.stride(1), 2);
    Tensor copy = t;
    EXPECT_EQ(deleted, 0);
  }
  EXPECT_EQ(deleted, 1);
}

// CUDA memory is described, not touched: the view keeps its device, an export carries it, and a
// view of another device than a tensor's storage is refused.
TEST(DLPack, CudaTensorsKeepTheirDevice) {
  std::int64_t shape[] = {2, 3};
  float storage[6] = {};
  DLTensor t{storage, {kDLCUDA, 1}, 2, {kDLFloat, 32, 1}, shape, nullptr, 0};
  const TensorView v = view_from_dlpack(t);
  EXPECT_EQ(v.device().device_type, kDLCUDA);
  EXPECT_EQ(v.device().device_id, 1);
  EXPECT_FALSE(v.on_host());
  EXPECT_EQ(v.describe(), "float32[2, 3] on cuda:1");
  auto* managed = new DLManagedTensor{t, nullptr, [](DLManagedTensor* m) { delete m; }};
  const Tensor owned = Tensor::from_dlpack(managed);
  EXPECT_EQ(owned.device().device_id, 1);
  DLManagedTensor* out = owned.to_dlpack();
  EXPECT_EQ(out->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(out->dl_tensor.device.device_id, 1);
  out->deleter(out);
  EXPECT_THROW(owned.with_view(TensorView(storage, DType::kFP32, {2, 3})), InvalidArgument);  // a host view
  EXPECT_EQ(owned.with_view(owned.view()).device().device_id, 1);
  EXPECT_TRUE(TensorView(storage, DType::kFP32, {6}).on_host());
  EXPECT_EQ(device_name({kDLCUDAHost, 0}), "cuda_host");
}

TEST(DLPack, RejectsUnsupportedTypesAndDevices) {
  std::int64_t shape[] = {4};
  float storage[4] = {};
  DLTensor t{storage, {kDLROCM, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0};
  EXPECT_THROW(view_from_dlpack(t), InvalidArgument);
  t.device = {kDLCUDA, -1};
  EXPECT_THROW(view_from_dlpack(t), InvalidArgument);
  t.device = {kDLCPU, 0};
  t.dtype = {kDLFloat, 64, 1};
  EXPECT_THROW(view_from_dlpack(t), InvalidArgument);
  t.dtype = {kDLFloat, 32, 4};
  EXPECT_THROW(view_from_dlpack(t), InvalidArgument);
  t.dtype = {kDLBfloat, 16, 1};
  EXPECT_EQ(view_from_dlpack(t).dtype(), DType::kBF16);
}

TEST(Checks, MessagesNameArgumentValueAndLimit) {
  Tensor t = Tensor::empty({4, 8}, DType::kFP32);
  try {
    core::expect_tensor("[rank 2] dispatch", "topk_weights", t, DType::kFP32, {4, 6});
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(),
                 "[rank 2] dispatch: topk_weights has size 8 in dimension 1, expected 6 (topk_weights is "
                 "float32[4, 8])");
  }
  EXPECT_THROW(core::expect_tensor("c", "x", t, DType::kBF16, {4, 8}), InvalidArgument);
  std::int64_t shape[] = {4, 8};
  std::int64_t overlapping[] = {4, 1};
  EXPECT_THROW(core::expect_non_overlapping("c", "x", TensorView(t.data(), DType::kFP32, shape, overlapping)),
               InvalidArgument);
  core::expect_tensor("c", "x", t, DType::kFP32, {-1, 8});
}

TEST(Npy, WriteThenReadBack) {
  const auto path = (std::filesystem::temp_directory_path() / "moe_ep_npy_test.npy").string();
  Tensor t = Tensor::empty({3, 4}, DType::kBF16);
  for (int i = 0; i < 12; ++i) t.data_as<std::uint16_t>()[i] = static_cast<std::uint16_t>(i * 1000);
  core::write_npy(path, t);
  Tensor back = core::read_npy(path, DType::kBF16);
  ASSERT_EQ(back.size(0), 3);
  ASSERT_EQ(back.size(1), 4);
  EXPECT_EQ(std::memcmp(back.data(), t.data(), t.nbytes()), 0);
  EXPECT_THROW(core::read_npy(path, DType::kFP32), Error);
  std::remove(path.c_str());
}

TEST(Env, TypedReadsOverridesAndErrors) {
  EXPECT_EQ(env::current("MOE_EP_NUM_WORKERS").source, env::Source::kDefault);
  {
    env::ScopedOverride o("MOE_EP_NUM_WORKERS", "3");
    EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), 3);
    EXPECT_EQ(env::current("MOE_EP_NUM_WORKERS").source, env::Source::kOverride);
    {
      env::ScopedOverride inner("MOE_EP_NUM_WORKERS", "5");
      EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), 5);
    }
    EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), 3);
  }
  EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), 0);
  try {
    env::ScopedOverride bad("MOE_EP_DEBUG", "maybe");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("MOE_EP_DEBUG"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("accepted values"), std::string::npos);
  }
  EXPECT_THROW(env::get_bool("MOE_EP_NOT_DECLARED"), StateError);
  setenv("MOE_EP_TIMEOUT_SECS", "soon", 1);
  EXPECT_THROW(env::get_float("MOE_EP_TIMEOUT_SECS"), InvalidArgument);
  unsetenv("MOE_EP_TIMEOUT_SECS");
}

}  // namespace
}  // namespace moe_ep

namespace moe_ep {
namespace {

// Shareable large blocks (the MPI transport turns them on): memfd-backed, found by address.
TEST(HostAllocator, SharedBlocksAreFoundByAddress) {
  core::share_new_blocks();
  auto block = core::allocate_host(3 << 20);
  auto* p = static_cast<std::byte*>(block.get());
  core::SharedBlock found;
  ASSERT_TRUE(core::find_shared_block(p + 4096, 1 << 20, &found));
  EXPECT_GE(found.fd, 0);
  EXPECT_EQ(found.offset, 4096u);
  EXPECT_FALSE(core::find_shared_block(p + (3 << 20), 8 << 20, &found)) << "a range beyond the block";
  auto small = core::allocate_host(1024);
  EXPECT_FALSE(core::find_shared_block(small.get(), 1024, &found)) << "small blocks are not shareable";
  int local = 0;
  EXPECT_FALSE(core::find_shared_block(&local, sizeof local, &found));
  // The block is a shared mapping of its file: writes through either are seen by the other.
  p[100] = std::byte{42};
  std::byte seen{};
  ASSERT_EQ(pread(found.fd, &seen, 1, 100), 1);
  EXPECT_EQ(seen, std::byte{42});
}

// zero_host_sparse: an unaligned range of a dirty large block reads zero afterwards (its whole
// pages handed back to the kernel, the partial ones cleared), the bytes around it are kept, and the
// range is writable again; on a private block and on a shareable (memfd) one.
TEST(HostAllocator, SparseZeroingClearsExactlyTheRange) {
  for (bool shareable : {false, true}) {
    if (shareable) core::share_new_blocks();
    const std::size_t bytes = 6 << 20, begin = 100, length = (5 << 20) + 7;
    auto block = core::allocate_host(bytes);
    auto* p = static_cast<std::uint8_t*>(block.get());
    std::memset(p, 0xab, bytes);
    core::zero_host_sparse(p + begin, length);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < bytes; ++i) wrong += p[i] != (i >= begin && i < begin + length ? 0 : 0xab);
    EXPECT_EQ(wrong, 0u) << (shareable ? "memfd block" : "private block");
    p[begin + 4096 * 3] = 7;
    EXPECT_EQ(p[begin + 4096 * 3], 7);
  }
  std::vector<std::uint8_t> small(1000, 0xab);  // not a large block: cleared byte by byte
  core::zero_host_sparse(small.data() + 10, 980);
  EXPECT_EQ(small[9], 0xab);
  EXPECT_EQ(small[10], 0);
  EXPECT_EQ(small[989], 0);
  EXPECT_EQ(small[990], 0xab);
}

}  // namespace
}  // namespace moe_ep
