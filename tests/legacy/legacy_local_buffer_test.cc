// Buffer::get_local_buffer_tensor: views of the rank's own scale-up buffer (num_nvl_bytes,
// zero-filled, private to the rank) and scale-out pool (num_rdma_bytes, where the low-latency
// slots live) from a byte offset on, typed by dtype; the memory outlives destroy() while a view
// holds it; and the refusals (offset outside the buffer or not a multiple of the element size,
// after destroy), each naming the argument, the value and the limit.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "support/errors.hh"

namespace moe_ep::testing {
namespace {

constexpr std::int64_t kNvl = 4096, kRdma = 8192;

TEST(LegacyLocalBuffer, ViewsAreTheRanksOwnBytesFromTheOffset) {
  LocalWorld(2).run([&](Group& g) {
    Buffer b(g, {.num_nvl_bytes = kNvl, .num_rdma_bytes = kRdma, .explicitly_destroy = true});
    const Tensor nvl = b.get_local_buffer_tensor(DType::kFP32);
    ASSERT_EQ(nvl.ndim(), 1);
    EXPECT_EQ(nvl.size(0), kNvl / 4);
    EXPECT_EQ(nvl.dtype(), DType::kFP32);
    for (std::int64_t i = 0; i < nvl.size(0); ++i) ASSERT_EQ(nvl.data_as<const float>()[i], 0.0f) << i;
    const Tensor tail = b.get_local_buffer_tensor(DType::kInt64, 1000);
    EXPECT_EQ(tail.size(0), (kNvl - 1000) / 8);
    EXPECT_EQ(static_cast<const std::byte*>(tail.data()) - static_cast<const std::byte*>(nvl.data()), 1000);
    const Tensor pool = b.get_local_buffer_tensor(DType::kUInt8, 0, true);
    EXPECT_EQ(pool.size(0), kRdma);
    EXPECT_NE(pool.data(), nvl.data());
    EXPECT_EQ(b.get_local_buffer_tensor(DType::kBF16, kNvl).size(0), 0);  // the offset at the end: empty
    // Writes land in the same bytes for every later view; the memory outlives destroy().
    nvl.data_as<float>()[250] = 1.5f;
    b.destroy();
    float read = 0;
    std::memcpy(&read, tail.data(), sizeof read);  // nvl[250] is byte 1000
    EXPECT_EQ(read, 1.5f);
    const Caught after = catch_error([&] { b.get_local_buffer_tensor(DType::kFP32); });
    EXPECT_EQ(after.type, "StateError") << after.message;
  });
}

TEST(LegacyLocalBuffer, RefusalsNameTheArgumentTheValueAndTheLimit) {
  LocalWorld(1).run([&](Group& g) {
    Buffer b(g, {.num_nvl_bytes = kNvl, .num_rdma_bytes = kRdma});
    struct Case {
      DType dtype;
      std::int64_t offset;
      bool rdma;
      std::string words;
    };
    for (const Case& c : {Case{DType::kFP32, kNvl + 4, false, "offset = 4100 is outside [0, num_nvl_bytes = 4096]"},
                          Case{DType::kUInt8, -1, true, "offset = -1 is outside [0, num_rdma_bytes = 8192]"},
                          Case{DType::kInt64, 12, false, "offset = 12 is not a multiple of the 8 bytes of int64"}}) {
      const Caught caught = catch_error([&] { b.get_local_buffer_tensor(c.dtype, c.offset, c.rdma); });
      EXPECT_EQ(caught.type, "InvalidArgument") << c.words;
      EXPECT_NE(caught.message.find(c.words), std::string::npos) << caught.message;
      EXPECT_EQ(caught.message.rfind("[rank 0] get_local_buffer_tensor", 0), 0u) << caught.message;
    }
  });
}

}  // namespace
}  // namespace moe_ep::testing
