// Tensor sizes beyond int32 in V1 calls are InvalidArgument naming the argument and the size as
// given, never truncated into a smaller, valid-looking count.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "support/errors.hh"
#include "support/text.hh"

namespace moe_ep {
namespace {

constexpr std::int64_t kTwo31 = std::int64_t{1} << 31, kTwo32 = std::int64_t{1} << 32;

using testing::contains;

TEST(LegacyLimits, LowLatencyTokensBeyondInt32AreNotTruncated) {
  constexpr int kTokens = 8, kHidden = 128, kExperts = 4, kTopk = 2;
  LocalWorld(1).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(kTokens, kHidden, 1, kExperts),
                 .low_latency_mode = true});
    std::vector<std::uint16_t> x(kTokens * kHidden, 0x3f80);
    std::vector<std::int64_t> topk;
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j) topk.push_back((t + j) % kExperts);
    // 2^32 + 8 rows: an int would see 8. Only the shape is looked at before the refusal.
    const testing::Caught e = testing::catch_error([&] {
      b.low_latency_dispatch({.x = TensorView(x.data(), DType::kBF16, {kTwo32 + kTokens, kHidden}),
                              .topk_idx = TensorView(topk.data(), DType::kInt64, {kTokens, kTopk}),
                              .num_max_dispatch_tokens_per_rank = kTokens, .num_experts = kExperts,
                              .use_fp8 = false});
    });
    EXPECT_EQ(e.type, "InvalidArgument") << e.message;
    EXPECT_TRUE(contains(e.message, "4294967304")) << e.message;
    EXPECT_TRUE(contains(e.message, "x ")) << e.message;
  });
}

TEST(LegacyLimits, LayoutAndDispatchSizesBeyondInt32AreNamed) {
  LocalWorld(1).run([&](Group& g) {
    Buffer b(g, {});
    std::vector<std::int64_t> topk = {0, 1, 1, 0, 0, 1};
    // topk_idx with 2^32 + 3 rows: an int would see 3.
    testing::Caught e = testing::catch_error(
        [&] { b.get_dispatch_layout(TensorView(topk.data(), DType::kInt64, {kTwo32 + 3, 2}), 2); });
    EXPECT_EQ(e.type, "InvalidArgument") << e.message;
    EXPECT_TRUE(contains(e.message, "topk_idx")) << e.message;
    EXPECT_TRUE(contains(e.message, "4294967299")) << e.message;

    // Routing from is_token_in_rank with 2^31 experts: an int would see a negative count.
    std::vector<std::uint16_t> x(3 * 64, 0x3f80);
    std::vector<std::uint8_t> in_rank(3, 1);
    std::vector<std::int32_t> per_rank = {3}, per_expert(16, 0);
    e = testing::catch_error([&] {
      b.dispatch({.x = TensorView(x.data(), DType::kBF16, {3, 64}),
                  .num_tokens_per_rank = TensorView(per_rank.data(), DType::kInt32, {1}),
                  .is_token_in_rank = TensorView(in_rank.data(), DType::kBool, {3, 1}),
                  .num_tokens_per_expert = TensorView(per_expert.data(), DType::kInt32, {kTwo31})});
    });
    EXPECT_EQ(e.type, "InvalidArgument") << e.message;
    EXPECT_TRUE(contains(e.message, "num_tokens_per_expert")) << e.message;
    EXPECT_TRUE(contains(e.message, "2147483648")) << e.message;
  });
}

}  // namespace
}  // namespace moe_ep
