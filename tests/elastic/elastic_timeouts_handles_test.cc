// Limits of direct buffers beyond sizes and worker counts: timeouts that are not finite, hidden
// sizes beyond what any buffer accepts, handles whose public fields were changed, and where the
// worker-count model measures the machine. Each is a typed error naming the argument, the value
// and the limit, raised on every rank alike so that the buffer stays usable.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <limits>

#include "core/bandwidth.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "support/errors.hh"

namespace moe_ep {
namespace elastic_timeouts_handles_test {

using Outcome = testing::Caught;
constexpr auto capture = testing::catch_error;
constexpr int kRanks = 2, kExperts = 4, kTopk = 2, kTokens = 8, kHidden = 128;

struct Tokens {
  explicit Tokens(int rank, std::int64_t hidden = kHidden) : hidden(hidden) {
    x.assign(static_cast<size_t>(kTokens * hidden), 0x3f80);
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j) topk.push_back((rank + t + j) % kExperts);
  }
  DispatchArgs args() {
    return {.x = TensorView(x.data(), DType::kBF16, {kTokens, hidden}),
            .topk_idx = TensorView(topk.data(), DType::kInt64, {kTokens, kTopk}),
            .num_experts = kExperts};
  }
  std::int64_t hidden;
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
};

TEST(ElasticLimits, TimeoutsMustBePositiveAndFiniteAndLargeOnesNeverExpire) {
  for (double bad : {std::numeric_limits<double>::infinity(), 0.0, -3.0}) {
    std::vector<Outcome> outcomes(kRanks);
    LocalWorld(kRanks).run([&](Group& g) {
      outcomes[static_cast<size_t>(g.rank())] = capture([&] {
        ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden,
                            .num_cpu_timeout_secs = g.rank() == 1 ? bad : 30});
      });
    });
    EXPECT_EQ(outcomes[1].type, "InvalidArgument") << outcomes[1].message;
    EXPECT_NE(outcomes[1].message.find("[rank 1] ElasticBuffer: num_cpu_timeout_secs = "), std::string::npos)
        << outcomes[1].message;
    EXPECT_NE(outcomes[1].message.find("expected a positive, finite number of seconds"), std::string::npos)
        << outcomes[1].message;
    EXPECT_EQ(outcomes[0].type, "PeerError") << outcomes[0].message;
    EXPECT_EQ(outcomes[0].ranks, std::vector<int>{1});
  }
  // 1e10 and 1e300 s cannot be represented by the clock: they never expire (and do not expire at once).
  for (double huge : {1e10, 1e300}) {
    LocalWorld(kRanks).run([&](Group& g) {
      ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = huge});
      Tokens in(g.rank());
      const auto d = b.dispatch(in.args());
      const auto c = b.combine({.x = d.recv_x, .handle = d.handle});
      EXPECT_EQ(c.combined_x.size(0), kTokens);
    });
  }
}

TEST(ElasticLimits, HiddenSizesBeyondTheLimitAreRefusedBeforeAnythingMoves) {
  std::vector<Outcome> outcomes(kRanks);
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = kTokens, .num_cpu_timeout_secs = 30});
    // Rank 0's x claims hidden = 2^30 (a view: nothing behind it is read before the check).
    std::vector<std::uint16_t> row(16, 0);
    const std::int64_t shape[] = {kTokens, std::int64_t{1} << 30}, strides[] = {std::int64_t{1} << 30, 1};
    Tokens in(g.rank());
    DispatchArgs args = in.args();
    if (g.rank() == 0) args.x = TensorView(row.data(), DType::kBF16, shape, strides);
    outcomes[static_cast<size_t>(g.rank())] = capture([&] { b.dispatch(args); });
    EXPECT_EQ(b.dispatch(in.args()).recv_x.size(1), kHidden);  // still usable
  });
  EXPECT_EQ(outcomes[0].type, "InvalidArgument") << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("[rank 0] dispatch: x has hidden size 1073741824, expected 1 to 16777216"),
            std::string::npos)
      << outcomes[0].message;
  EXPECT_EQ(outcomes[1].type, "PeerError") << outcomes[1].message;
  EXPECT_EQ(outcomes[1].ranks, std::vector<int>{0});
}

TEST(ElasticLimits, AHandleWhoseFieldsWereChangedIsRefused) {
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = 30});
    Tokens in(g.rank());
    const auto d = b.dispatch(in.args());
    const std::int64_t rows = d.handle->num_recv_tokens;
    // Five more rows than the dispatch produced: combine would read past what the peers sent.
    auto changed = std::make_shared<EPHandle>(*d.handle);
    changed->num_recv_tokens += 5;
    const Tensor y = Tensor::zeros({rows + 5, kHidden}, DType::kBF16);
    const Outcome o = capture([&] { b.combine({.x = y, .handle = changed}); });
    EXPECT_EQ(o.type, "InvalidArgument") << o.message;
    EXPECT_NE(o.message.find(fmt::format("handle.num_recv_tokens = {} differs from the {} its dispatch produced",
                                         rows + 5, rows)),
              std::string::npos)
        << o.message;
    auto other = std::make_shared<EPHandle>(*d.handle);
    other->num_tokens -= 1;
    const Outcome cached = capture([&] {
      DispatchArgs a = in.args();
      a.topk_idx = {};
      a.handle = other;
      b.dispatch(a);
    });
    EXPECT_EQ(cached.type, "InvalidArgument") << cached.message;
    EXPECT_NE(cached.message.find("handle.num_tokens = 7 differs from the 8 its dispatch produced"), std::string::npos)
        << cached.message;
    // The handle itself still works.
    EXPECT_EQ(b.combine({.x = d.recv_x, .handle = d.handle}).combined_x.size(0), kTokens);
  });
}

// Cached dispatch: shape arguments left at their defaults are the handle's; given, they must
// equal it (DeepEP's rule), and do_expand = true with a compact handle is refused.
TEST(ElasticLimits, CachedDispatchTakesTheHandlesShapeAndRefusesAnother) {
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = 30});
    Tokens in(g.rank());
    DispatchArgs first = in.args();
    first.expert_alignment = 4;
    first.do_expand = true;
    const auto d = b.dispatch(first);
    ASSERT_EQ(d.handle->expert_alignment, 4);
    DispatchArgs again = in.args();
    again.topk_idx = {};
    again.num_experts = 0;
    again.handle = d.handle;  // expert_alignment 0, do_expand false, num_max_tokens_per_rank 0
    const auto cached = b.dispatch(again);
    EXPECT_EQ(cached.recv_x.size(0), d.recv_x.size(0));
    EXPECT_FALSE(cached.recv_topk_idx.defined()) << "an expanded handle replays expanded";
    EXPECT_EQ(cached.recv_x.size(0), d.handle->num_expanded_tokens);
    const Outcome wrong_alignment = capture([&] {
      DispatchArgs a = again;
      a.expert_alignment = 1;
      b.dispatch(a);
    });
    EXPECT_EQ(wrong_alignment.type, "InvalidArgument") << wrong_alignment.message;
    EXPECT_NE(wrong_alignment.message.find("expert_alignment = 1 differs from the handle's 4"), std::string::npos)
        << wrong_alignment.message;
    const Outcome wrong_experts = capture([&] {
      DispatchArgs a = again;
      a.num_experts = 2 * kExperts;
      b.dispatch(a);
    });
    EXPECT_NE(wrong_experts.message.find(fmt::format("num_experts = {} differs from the handle's {}", 2 * kExperts,
                                                     kExperts)),
              std::string::npos)
        << wrong_experts.message;
    const auto compact = b.dispatch(in.args());
    const Outcome expand_compact = capture([&] {
      DispatchArgs a = in.args();
      a.topk_idx = {};
      a.handle = compact.handle;
      a.do_expand = true;
      b.dispatch(a);
    });
    EXPECT_NE(expand_compact.message.find("do_expand = true differs from the handle's false"), std::string::npos)
        << expand_compact.message;
  });
}

// The worker-count model's bandwidths are measured once per process, when a buffer is built, so
// that the first dispatch with num_sms = 0 does not pay for the measurement.
TEST(ElasticLimits, TheMachineIsMeasuredWhenABufferIsBuiltNotInADispatch) {
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = 30});
    EXPECT_TRUE(core::machine_bandwidth_measured());
    Tokens in(g.rank());
    EXPECT_GE(b.dispatch(in.args()).handle->num_sms, 1);
  });
}

}  // namespace elastic_timeouts_handles_test
}  // namespace moe_ep
