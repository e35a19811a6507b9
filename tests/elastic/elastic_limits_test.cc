// Worker counts and sizes at their limits: MOE_EP_NUM_WORKERS and num_sms beyond the one worker
// limit, and tensor sizes beyond int32, are InvalidArgument naming the value as given (never
// wrapped, clamped or truncated), reported through the agreement like every argument error; the
// buffer stays usable.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "support/env_scope.hh"
#include "support/errors.hh"
#include "support/rank_runner.hh"
#include "support/text.hh"

namespace moe_ep {
namespace elastic_limits_test {

constexpr int kRanks = 2, kExperts = 8, kTopk = 2, kTokens = 4, kHidden = 128;

struct Inputs {
  explicit Inputs(int rank) {
    x.assign(static_cast<size_t>(kTokens * kHidden), 0x3f80);
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j) topk.push_back((rank + t + j * 3) % kExperts);
  }
  TensorView x_view() { return TensorView(x.data(), DType::kBF16, {kTokens, kHidden}); }
  TensorView topk_view() { return TensorView(topk.data(), DType::kInt64, {kTokens, kTopk}); }
  DispatchArgs args() { return {.x = x_view(), .topk_idx = topk_view(), .num_experts = kExperts}; }
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
};

ElasticBufferConfig config() {
  return {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk, .num_cpu_timeout_secs = 30};
}

using testing::contains;

// Every rank calls `call` on a fresh buffer; afterwards each dispatches and combines valid input
// with one explicit worker (so the environment is not read), which must succeed.
std::vector<testing::Caught> on_all_ranks(const std::function<void(ElasticBuffer&, int rank)>& call) {
  return testing::results_on_ranks<testing::Caught>(kRanks, {}, [&](Group& g) {
    ElasticBuffer buffer(g, config());
    const testing::Caught outcome = testing::catch_error([&] { call(buffer, g.rank()); });
    Inputs in(g.rank());
    DispatchArgs args = in.args();
    args.num_sms = 1;
    auto d = buffer.dispatch(args);
    auto c = buffer.combine({.x = d.recv_x, .handle = d.handle, .num_sms = 1});
    EXPECT_EQ(c.combined_x.size(0), kTokens);
    return outcome;
  });
}

TEST(ElasticLimits, WorkerCountsFromTheEnvironmentAreChecked) {
  // 2^32 + 1 wraps to 1 in an int, 2^31 to a negative count; 100000 threads cannot start.
  for (const char* value : {"4294967297", "2147483648", "100000", "1025"}) {
    std::vector<testing::Caught> outcomes;
    {
      testing::ScopedEnvironment set("MOE_EP_NUM_WORKERS", value);
      outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
        Inputs in(rank);
        b.dispatch(in.args());
      });
    }
    for (int r = 0; r < kRanks; ++r) {
      const auto& o = outcomes[static_cast<size_t>(r)];
      ASSERT_EQ(o.type, "InvalidArgument") << "MOE_EP_NUM_WORKERS=" << value << ": " << o.message;
      EXPECT_TRUE(contains(o.message, fmt::format("MOE_EP_NUM_WORKERS=\"{}\"", value))) << o.message;
      EXPECT_TRUE(contains(o.message, "1024")) << o.message;
    }
  }
}

void expect_rejected_by(const std::vector<testing::Caught>& outcomes, int bad_rank, const std::string& fragment) {
  for (int r = 0; r < kRanks; ++r) {
    const auto& o = outcomes[static_cast<size_t>(r)];
    if (r == bad_rank) {
      EXPECT_EQ(o.type, "InvalidArgument") << o.message;
      EXPECT_TRUE(contains(o.message, fmt::format("[rank {}] combine", r))) << o.message;
      EXPECT_TRUE(contains(o.message, fragment)) << "missing '" << fragment << "' in: " << o.message;
    } else {
      EXPECT_EQ(o.type, "PeerError") << o.message;
      EXPECT_EQ(o.ranks, std::vector<int>{bad_rank}) << o.message;
      EXPECT_TRUE(contains(o.message, fragment)) << o.message;
    }
  }
}

TEST(ElasticLimits, CombineChecksNumSms) {
  for (int bad : {-1, 1025, 1 << 20}) {
    auto outcomes = on_all_ranks([bad](ElasticBuffer& b, int rank) {
      Inputs in(rank);
      DispatchArgs args = in.args();
      args.num_sms = 1;
      auto d = b.dispatch(args);
      b.combine({.x = d.recv_x, .handle = d.handle, .num_sms = rank == 1 ? bad : 1});
    });
    ASSERT_EQ(outcomes[1].type, "InvalidArgument") << "num_sms = " << bad << ": " << outcomes[1].message;
    expect_rejected_by(outcomes, 1, fmt::format("num_sms = {} is outside [0, 1024]", bad));
  }
}

TEST(ElasticLimits, SizesBeyondInt32AreNamedNotTruncated) {
  // Only the shape is looked at: the views are refused before any element is read.
  std::vector<std::uint16_t> small(static_cast<size_t>(kTokens * kHidden), 0x3f80);
  for (const std::int64_t hidden : {(std::int64_t{1} << 31) + kHidden, (std::int64_t{1} << 32) + kHidden}) {
    auto outcomes = on_all_ranks([&](ElasticBuffer& b, int rank) {
      Inputs in(rank);
      DispatchArgs args = in.args();
      if (rank == 0) args.x = TensorView(small.data(), DType::kBF16, {kTokens, hidden});
      b.dispatch(args);
    });
    const auto& o = outcomes[0];
    ASSERT_EQ(o.type, "InvalidArgument") << o.message;
    ASSERT_TRUE(contains(o.message, std::to_string(hidden))) << o.message;
    EXPECT_TRUE(contains(o.message, "x has size")) << o.message;
    EXPECT_EQ(outcomes[1].type, "PeerError") << outcomes[1].message;
  }
  // A cached dispatch with 2^32 + kTokens rows is not the handle's kTokens.
  auto outcomes = on_all_ranks([&](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    auto first = b.dispatch(in.args());
    DispatchArgs again{.x = in.x_view(), .handle = first.handle};
    if (rank == 1) again.x = TensorView(small.data(), DType::kBF16, {(std::int64_t{1} << 32) + kTokens, kHidden});
    b.dispatch(again);
  });
  EXPECT_EQ(outcomes[1].type, "InvalidArgument") << outcomes[1].message;
  EXPECT_TRUE(contains(outcomes[1].message, "4294967300")) << outcomes[1].message;
}

}  // namespace elastic_limits_test
}  // namespace moe_ep
