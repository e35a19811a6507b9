// V1 handles are the caller's: their tensors can be written and their fields changed. The buffer
// works from its own copy of what the dispatch computed, so a changed handle changes nothing
// (low-latency mode) or is refused (normal mode), and a combine whose dispatch has not received
// yet is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "support/errors.hh"

namespace moe_ep {
namespace legacy_readonly_handle_test {

constexpr int kRanks = 2, kExperts = 4, kTopk = 2, kTokens = 8, kHidden = 128;

struct Tokens {
  explicit Tokens(int rank) {
    for (int t = 0; t < kTokens; ++t)
      for (int h = 0; h < kHidden; ++h) x.push_back(static_cast<std::uint16_t>(0x3f80 + ((rank * 31 + t * 7 + h) % 64)));
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j) topk.push_back((rank + t + j * 2) % kExperts);
    weights.assign(static_cast<size_t>(kTokens * kTopk), 0.5f);
  }
  TensorView xv() { return TensorView(x.data(), DType::kBF16, {kTokens, kHidden}); }
  TensorView tv() { return TensorView(topk.data(), DType::kInt64, {kTokens, kTopk}); }
  TensorView wv() { return TensorView(weights.data(), DType::kFP32, {kTokens, kTopk}); }
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
  std::vector<float> weights;
};

TEST(LegacyHandles, LowLatencyCombineReadsItsOwnLayoutNotTheHandlesTensors) {
  LocalWorld(kRanks).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(kTokens, kHidden, kRanks, kExperts),
                 .low_latency_mode = true, .num_cpu_timeout_secs = 30});
    Tokens in(g.rank());
    auto round = [&](bool scribble) {
      auto d = b.low_latency_dispatch({.x = in.xv(), .topk_idx = in.tv(), .num_max_dispatch_tokens_per_rank = kTokens,
                                       .num_experts = kExperts, .use_fp8 = false});
      if (scribble) {  // the caller writes into the handle's tensors: out-of-range tokens and ranges
        auto* info = d.handle->packed_recv_src_info.data_as<std::int32_t>();
        std::fill(info, info + d.handle->packed_recv_src_info.numel(), 1 << 30);
        auto* range = d.handle->packed_recv_layout_range.data_as<std::int64_t>();
        std::fill(range, range + d.handle->packed_recv_layout_range.numel(), (std::int64_t{1} << 40) | 0xfffff);
      }
      Tensor combined = b.low_latency_combine({.x = d.recv_x, .topk_idx = in.tv(), .topk_weights = in.wv(),
                                               .handle = d.handle})
                            .combined_x;
      return std::vector<std::uint16_t>(combined.data_as<std::uint16_t>(),
                                        combined.data_as<std::uint16_t>() + combined.numel());
    };
    const auto clean = round(false);
    const auto scribbled = round(true);
    EXPECT_EQ(clean, scribbled);
  });
}

TEST(LegacyHandles, ALowLatencyCombineBeforeItsDispatchReceivedIsRefused) {
  std::vector<testing::Caught> outcomes(kRanks);
  LocalWorld(kRanks).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(kTokens, kHidden, kRanks, kExperts),
                 .low_latency_mode = true, .num_cpu_timeout_secs = 30});
    Tokens in(g.rank());
    auto d = b.low_latency_dispatch({.x = in.xv(), .topk_idx = in.tv(), .num_max_dispatch_tokens_per_rank = kTokens,
                                     .num_experts = kExperts, .use_fp8 = false, .return_recv_hook = true});
    outcomes[static_cast<size_t>(g.rank())] = testing::catch_error([&] {
      b.low_latency_combine({.x = d.recv_x, .topk_idx = in.tv(), .topk_weights = in.wv(), .handle = d.handle});
    });
    d.hook();
  });
  EXPECT_EQ(outcomes[0].type, "InvalidArgument") << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("has not received its tokens yet: call its receive hook first"), std::string::npos)
      << outcomes[0].message;
}

TEST(LegacyHandles, ANormalHandleWithAChangedRoutingIsRefused) {
  LocalWorld(kRanks).run([&](Group& g) {
    Buffer b(g, {.num_cpu_timeout_secs = 30});
    Tokens in(g.rank());
    const DispatchLayout layout = b.get_dispatch_layout(in.tv(), kExperts);
    auto d = b.dispatch({.x = in.xv(), .num_tokens_per_rank = layout.num_tokens_per_rank,
                         .is_token_in_rank = layout.is_token_in_rank, .num_tokens_per_expert = layout.num_tokens_per_expert,
                         .topk_idx = in.tv(), .topk_weights = in.wv()});
    auto changed = std::make_shared<LegacyHandle>(*d.handle);
    auto routing = std::make_shared<EPHandle>(*d.handle->routing);
    routing->num_recv_tokens += 5;
    changed->routing = routing;
    const Tensor y = Tensor::zeros({d.recv_x.size(0) + 5, kHidden}, DType::kBF16);
    const auto o = testing::catch_error([&] { b.combine({.x = y, .handle = changed}); });
    EXPECT_EQ(o.type, "InvalidArgument") << o.message;
    EXPECT_NE(o.message.find("handle.num_recv_tokens"), std::string::npos) << o.message;
  });
}

}  // namespace legacy_readonly_handle_test
}  // namespace moe_ep
