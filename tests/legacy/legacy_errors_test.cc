// V1 configuration, size hints and bad input: every case is a typed error naming the argument,
// the value and the limit; peers of a rejecting rank raise PeerError naming it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "support/errors.hh"

namespace moe_ep {
namespace {

using testing::error_of;

TEST(LegacyConfig, ValidationAndDefaults) {
  EXPECT_NE(error_of([] { Config::make(21, 6, 256, 6, 128); }).find("num_sms = 21 must be an even number in [2, 1024]"),
            std::string::npos);
  EXPECT_NE(error_of([] { Config::make(0, 6, 256, 6, 128); }).find("num_sms = 0"), std::string::npos);
  EXPECT_NE(error_of([] { Config::make(2000, 6, 256, 6, 128); }).find("num_sms = 2000"), std::string::npos);
  EXPECT_NE(error_of([] { Config::make(20, 256, 256, 6, 128); }).find("must be less than num_max_nvl_chunked_recv_tokens"),
            std::string::npos);
  EXPECT_NE(error_of([] { Config::make(20, 6, 256, 128, 100); }).find("at most half"), std::string::npos);
  EXPECT_THROW(Buffer::set_num_sms(3), InvalidArgument);
  EXPECT_EQ(Config::make(20, 36, 288, 20, 128).num_max_rdma_chunked_recv_tokens, 140);  // rounded up to 20s
  const Config eight = Buffer::get_dispatch_config(8);
  EXPECT_EQ(eight.num_sms, 20);
  EXPECT_EQ(eight.num_max_nvl_chunked_send_tokens, 6);
  EXPECT_EQ(eight.num_max_nvl_chunked_recv_tokens, 256);
  EXPECT_EQ(Buffer::get_combine_config(8).num_max_nvl_chunked_send_tokens, 4);
  EXPECT_EQ(Buffer::get_dispatch_config(3).num_max_nvl_chunked_send_tokens, 6);   // the 4-rank entry
  EXPECT_EQ(Buffer::get_dispatch_config(500).num_max_nvl_chunked_send_tokens, 28);  // the largest entry
  Buffer::set_num_sms(24);
  EXPECT_EQ(Buffer::get_dispatch_config(8).num_sms, 24);
  Buffer::set_num_sms(20);
}

TEST(LegacyConfig, SizeHintsFollowDeepEPsFormulas) {
  // Hidden 7168 in BF16, 20 SMs: the numbers DeepEP's documentation quotes.
  EXPECT_EQ(Buffer::get_dispatch_config(8).get_nvl_buffer_size_hint(14336, 8), 335709824);
  EXPECT_EQ(Buffer::get_dispatch_config(8).get_rdma_buffer_size_hint(14336, 8), 0);
  EXPECT_EQ(Buffer::get_dispatch_config(16).get_rdma_buffer_size_hint(14336, 16), 91887744);
  EXPECT_EQ(Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 256), 1908410496);
  EXPECT_EQ(Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 288), 2146961792);
  EXPECT_EQ(Buffer::get_low_latency_rdma_size_hint(16, 5120, 8, 256), 170395776);
  EXPECT_THROW(Buffer::get_low_latency_rdma_size_hint(16, 100, 8, 256), InvalidArgument);
}

TEST(LegacyErrors, PoolsMustBeMultiplesOf128) {
  std::vector<std::string> errors(4);
  LocalWorld(4).run([&](Group& g) {
    errors[static_cast<size_t>(g.rank())] = error_of([&] {
      Buffer b(g, {.num_nvl_bytes = g.rank() == 2 ? 1000 : 1024});
    });
  });
  EXPECT_NE(errors[2].find("num_nvl_bytes = 1000 must be a non-negative multiple of 128"), std::string::npos) << errors[2];
  EXPECT_NE(errors[0].find("rank [2] rejected its arguments"), std::string::npos) << errors[0];
}

struct Tokens {
  explicit Tokens(int rank) {
    x.assign(6 * 64, 0x3f80);
    for (int t = 0; t < 6; ++t)
      for (int j = 0; j < 2; ++j) topk.push_back((t + rank + j * 4) % 8);
  }
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
  TensorView xv() { return TensorView(x.data(), DType::kBF16, {6, 64}); }
  TensorView tv() { return TensorView(topk.data(), DType::kInt64, {6, 2}); }
};

TEST(LegacyErrors, LayoutMustMatchTheRouting) {
  LocalWorld(4).run([&](Group& g) {
    Buffer b(g, {});
    Tokens in(g.rank());
    auto layout = b.get_dispatch_layout(in.tv(), 8);
    LegacyDispatchArgs args{.x = in.xv(), .num_tokens_per_rank = layout.num_tokens_per_rank,
                            .is_token_in_rank = layout.is_token_in_rank,
                            .num_tokens_per_expert = layout.num_tokens_per_expert, .topk_idx = in.tv()};
    Tensor wrong = Tensor::empty({4}, DType::kInt32);
    std::memcpy(wrong.data(), layout.num_tokens_per_rank.data(), 16);
    if (g.rank() == 1) wrong.data_as<std::int32_t>()[3] += 1;
    auto a = args;
    a.num_tokens_per_rank = wrong;
    const std::string e = error_of([&] { b.dispatch(a); });
    if (g.rank() == 1) {
      EXPECT_NE(e.find("num_tokens_per_rank[3] = "), std::string::npos) << e;
      EXPECT_NE(e.find("but topk_idx sends"), std::string::npos) << e;
    } else {
      EXPECT_NE(e.find("rank [1] rejected its arguments"), std::string::npos) << e;
    }
    Tensor in_rank = Tensor::empty({6, 4}, DType::kBool);
    std::memcpy(in_rank.data(), layout.is_token_in_rank.data(), 24);
    in_rank.data_as<std::uint8_t>()[0] ^= 1;
    a = args;
    a.is_token_in_rank = in_rank;
    EXPECT_NE(error_of([&] { b.dispatch(a); }).find("is_token_in_rank[0, 0]"), std::string::npos);
    a = args;
    a.num_tokens_per_expert = TensorView();
    EXPECT_NE(error_of([&] { b.dispatch(a); }).find("num_tokens_per_expert is missing"), std::string::npos);
    // The buffer is still usable.
    auto d = b.dispatch(args);
    // Cached dispatch refuses the top-k arguments and ignores layout tensors (DeepEP's rules).
    LegacyDispatchArgs cached{.x = in.xv(), .handle = d.handle, .topk_idx = in.tv()};
    EXPECT_NE(error_of([&] { b.dispatch(cached); }).find("topk_idx must not be given with a cached handle"), std::string::npos);
    LegacyDispatchArgs with_layout = args;
    with_layout.handle = d.handle;
    with_layout.topk_idx = TensorView();
    with_layout.topk_weights = TensorView();
    const auto again = b.dispatch(with_layout);
    ASSERT_EQ(again.recv_x.nbytes(), d.recv_x.nbytes());
    EXPECT_EQ(std::memcmp(again.recv_x.data(), d.recv_x.data(), d.recv_x.nbytes()), 0);
    // allocate_on_comm_stream needs previous_event and async_finish.
    a = args;
    a.allocate_on_comm_stream = true;
    EXPECT_NE(error_of([&] { b.dispatch(a); })
                  .find("allocate_on_comm_stream = true requires previous_event and async_finish = true (previous_event "
                        "missing, async_finish = false)"),
              std::string::npos);
    EXPECT_NE(error_of([&] { b.combine({.x = d.recv_x, .handle = d.handle, .allocate_on_comm_stream = true}); })
                  .find("allocate_on_comm_stream = true requires previous_event"),
              std::string::npos);
    EXPECT_NE(error_of([&] { b.get_dispatch_layout(in.tv(), 8, std::nullopt, false, true); })
                  .find("allocate_on_comm_stream = true requires previous_event"),
              std::string::npos);
    // Config checks go through the agreement too.
    a = args;
    a.config = Config{.num_sms = 7};
    EXPECT_NE(error_of([&] { b.dispatch(a); }).find("num_sms = 7"), std::string::npos);
    EXPECT_NE(error_of([&] { b.get_dispatch_layout(in.tv(), 7); }).find("num_experts = 7 must be a positive multiple"),
              std::string::npos);
  });
}

// Routed by is_token_in_rank alone: a layout the V1 checks refuse is named on the rank that
// passed it (its peers learn of it), and the next call routes as the mask says.
TEST(LegacyErrors, RankMaskRoutingIsCheckedBeforeUse) {
  LocalWorld(2).run([&](Group& g) {
    Buffer b(g, {});
    Tokens in(g.rank());
    std::vector<std::uint8_t> mask(12, 1);      // every token to both ranks
    std::vector<std::int32_t> per_rank = {6, 6};
    std::vector<std::int32_t> per_expert = {6, 0, 6, 0};  // lane d names rank d's first expert
    LegacyDispatchArgs args{.x = in.xv(), .num_tokens_per_rank = TensorView(per_rank.data(), DType::kInt32, {2}),
                            .is_token_in_rank = TensorView(mask.data(), DType::kBool, {6, 2}),
                            .num_tokens_per_expert = TensorView(per_expert.data(), DType::kInt32, {4})};
    auto a = args;
    if (g.rank() == 0) a.num_tokens_per_expert = TensorView(per_expert.data(), DType::kInt32, {3});
    testing::Caught e = testing::catch_error([&] { b.dispatch(a); });
    if (g.rank() == 0) {
      EXPECT_EQ(e.type, "InvalidArgument") << e.message;
      EXPECT_NE(e.message.find("num_tokens_per_expert has 3 entries, expected a positive multiple of 2"),
                std::string::npos) << e.message;
    } else {
      EXPECT_NE(e.message.find("rank [0] rejected its arguments"), std::string::npos) << e.message;
    }
    a = args;
    a.is_token_in_rank = TensorView(mask.data(), DType::kBool, {5, 2});  // one row short of x
    EXPECT_NE(error_of([&] { b.dispatch(a); }).find("is_token_in_rank"), std::string::npos);
    a = args;
    a.num_tokens_per_expert = TensorView(per_expert.data(), DType::kInt32, {0});
    EXPECT_NE(error_of([&] { b.dispatch(a); }).find("num_tokens_per_expert has 0 entries"), std::string::npos);
    // Both ranks send all 6 tokens to each other: 12 rows arrive on each.
    const LegacyDispatchResult d = b.dispatch(args);
    EXPECT_EQ(d.recv_x.size(0), 12);
  });
}

// A caller's own refusal (the Python binding's, for an argument it could not convert) reaches
// every rank through the call, in normal and low-latency mode; the next calls pair up as usual.
TEST(LegacyErrors, CallerRejectionReachesEveryRank) {
  const std::int64_t rdma = Buffer::get_low_latency_rdma_size_hint(8, 128, 4, 8);
  LocalWorld(4).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = rdma, .low_latency_mode = true});
    Tokens in(g.rank());
    auto layout = b.get_dispatch_layout(in.tv(), 8);
    LegacyDispatchArgs args{.x = in.xv(), .num_tokens_per_rank = layout.num_tokens_per_rank,
                            .is_token_in_rank = layout.is_token_in_rank,
                            .num_tokens_per_expert = layout.num_tokens_per_expert, .topk_idx = in.tv()};
    auto expect_named = [&](const testing::Caught& c, const char* call, const char* reason) {
      if (g.rank() == 1) {
        EXPECT_EQ(c.type, "InvalidArgument") << c.message;
        EXPECT_NE(c.message.find(fmt::format("[rank 1] {}: {}", call, reason)), std::string::npos) << c.message;
      } else {
        EXPECT_EQ(c.type, "PeerError") << c.message;
        EXPECT_EQ(c.ranks, std::vector<int>{1}) << c.message;
        EXPECT_NE(c.message.find(reason), std::string::npos) << c.message;
      }
    };
    LegacyDispatchArgs bad = args;
    if (g.rank() == 1) bad.rejection = "is_token_in_rank must be a tensor, not list";
    expect_named(testing::catch_error([&] { b.dispatch(bad); }), "dispatch", "is_token_in_rank must be a tensor, not list");
    auto d = b.dispatch(args);
    std::vector<std::uint16_t> y(static_cast<size_t>(d.recv_x.size(0)) * 64, 0x3f80);
    LegacyCombineArgs c{.x = TensorView(y.data(), DType::kBF16, {d.recv_x.size(0), 64}), .handle = d.handle};
    if (g.rank() == 1) c = LegacyCombineArgs{.rejection = "handle must be a handle returned by dispatch, not str"};
    expect_named(testing::catch_error([&] { b.combine(c); }), "combine", "handle must be a handle returned by dispatch");

    b.clean_low_latency_buffer(8, 128, 8);
    std::vector<std::uint16_t> x(6 * 128, 0x3f80);
    LowLatencyDispatchArgs ll{.x = TensorView(x.data(), DType::kBF16, {6, 128}), .topk_idx = in.tv(),
                              .num_max_dispatch_tokens_per_rank = 8, .num_experts = 8, .use_fp8 = false};
    LowLatencyDispatchArgs ll_bad = ll;
    if (g.rank() == 1) ll_bad.rejection = "x must be a tensor, not list";
    expect_named(testing::catch_error([&] { b.low_latency_dispatch(ll_bad); }), "low_latency_dispatch",
                 "x must be a tensor, not list");
    auto r = b.low_latency_dispatch(ll);  // the buffer is still usable
    EXPECT_EQ(r.packed_recv_count.size(0), 2);
  });
}

TEST(LegacyErrors, WorstTokensTooSmallIsNamedOnEveryRank) {
  LocalWorld(4).run([&](Group& g) {
    Buffer b(g, {});
    Tokens in(g.rank());
    auto layout = b.get_dispatch_layout(in.tv(), 8);
    const std::string e = error_of([&] {
      b.dispatch({.x = in.xv(), .num_tokens_per_rank = layout.num_tokens_per_rank,
                  .is_token_in_rank = layout.is_token_in_rank, .num_tokens_per_expert = layout.num_tokens_per_expert,
                  .topk_idx = in.tv(), .num_worst_tokens = 2});
    });
    EXPECT_NE(e.find("more than the worst-case row count 2"), std::string::npos) << e;
  });
}

}  // namespace
}  // namespace moe_ep
