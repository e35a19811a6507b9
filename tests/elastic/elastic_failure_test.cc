// Failures that leave the ranks out of step: a rank that arrives after its peers gave up on it,
// and a rank that fails after the agreement. No rank reads what a departed peer published (the
// sanitizer build checks that no freed memory is touched), every rank gets a typed error naming
// the root cause, and the buffers refuse further calls.
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <memory>
#include <thread>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "support/errors.hh"

namespace moe_ep {
namespace elastic_failure_test {

using Outcome = testing::Caught;
constexpr auto capture = testing::catch_error;
constexpr int kRanks = 4, kExperts = 8, kTopk = 2, kTokens = 16, kHidden = 128;
// Long enough that the ranks that are there all arrive well within it, whatever the load; the
// absent rank arrives only after they gave up (it waits for them, not for a clock).
constexpr double kTimeout = 3.0;

struct Tokens {
  explicit Tokens(int rank) {
    x.assign(static_cast<size_t>(kTokens) * kHidden, 0x3f80);
    for (int t = 0; t < kTokens; ++t)
      for (int j = 0; j < kTopk; ++j) topk.push_back((rank + t + j * 4) % kExperts);
  }
  TensorView xv() { return TensorView(x.data(), DType::kBF16, {kTokens, kHidden}); }
  TensorView tv() { return TensorView(topk.data(), DType::kInt64, {kTokens, kTopk}); }
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
};

bool contains(const std::vector<int>& ranks, int r) { return std::find(ranks.begin(), ranks.end(), r) != ranks.end(); }

// Ranks 0, 1 and 3 call `call` together and time out waiting for rank 2, then free their inputs;
// only then does rank 2 make the same call. Returns every rank's outcome and rank 2's second try.
template <class Buffer, class MakeBuffer, class Call>
std::vector<Outcome> late_rank(MakeBuffer make_buffer, Call call, Outcome* late_again) {
  std::vector<Outcome> outcomes(kRanks);
  std::latch present(kRanks - 1);
  std::atomic<int> gave_up{0};
  std::atomic<bool> late_done{false};
  LocalWorld(kRanks).run([&](Group& g) {
    std::unique_ptr<Buffer> buffer = make_buffer(g);
    const int r = g.rank();
    if (r == 2) {
      while (gave_up.load() < kRanks - 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      Tokens in(r);
      outcomes[2] = capture([&] { call(*buffer, in); });
      *late_again = capture([&] { call(*buffer, in); });
      late_done = true;
      return;
    }
    {
      auto in = std::make_unique<Tokens>(r);
      present.arrive_and_wait();
      outcomes[static_cast<size_t>(r)] = capture([&] { call(*buffer, *in); });
    }  // the inputs are gone, as they are when a caller moves on after an error
    ++gave_up;
    while (!late_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  });
  return outcomes;
}

void expect_late_rank_outcomes(const std::vector<Outcome>& outcomes, const Outcome& again, const char* phase) {
  for (int r : {0, 1, 3}) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    EXPECT_EQ(o.type, "TimeoutError") << o.message;
    EXPECT_TRUE(contains(o.ranks, 2)) << o.message;
    EXPECT_NE(o.message.find(phase), std::string::npos) << o.message;
  }
  // The late rank learns, as its agreement returns, that the others gave up on it: nothing of
  // theirs is read, and it does not wait for a timeout of its own.
  const Outcome& late = outcomes[2];
  EXPECT_EQ(late.type, "PeerError") << late.message;
  EXPECT_EQ(late.ranks, (std::vector<int>{0, 1, 3})) << late.message;
  EXPECT_NE(late.message.find(phase), std::string::npos) << late.message;
  EXPECT_NE(late.message.find("ranks [0, 1, 3] took part and then left"), std::string::npos) << late.message;
  EXPECT_NE(late.message.find("timed out"), std::string::npos) << late.message;  // their reason
  EXPECT_EQ(again.type, "StateError") << again.message;
  EXPECT_NE(again.message.find("unusable after a failed collective"), std::string::npos) << again.message;
}

TEST(ElasticFailures, ALateRankLearnsItsPeersGaveUpAndReadsNothingOfTheirs) {
  Outcome again;
  const auto outcomes = late_rank<ElasticBuffer>(
      [](Group& g) {
        return std::make_unique<ElasticBuffer>(
            g, ElasticBufferConfig{.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk,
                                   .num_cpu_timeout_secs = kTimeout});
      },
      [](ElasticBuffer& b, Tokens& in) { b.dispatch({.x = in.xv(), .topk_idx = in.tv(), .num_experts = kExperts}); },
      &again);
  expect_late_rank_outcomes(outcomes, again, "dispatch: agreement");
}

TEST(LegacyFailures, ALateRankLearnsItsPeersGaveUpAndReadsNothingOfTheirs) {
  Outcome again;
  const auto outcomes = late_rank<Buffer>(
      [](Group& g) { return std::make_unique<Buffer>(g, BufferConfig{.num_cpu_timeout_secs = kTimeout}); },
      [](Buffer& b, Tokens& in) {
        const DispatchLayout layout = b.get_dispatch_layout(in.tv(), kExperts);
        b.dispatch({.x = in.xv(), .num_tokens_per_rank = layout.num_tokens_per_rank,
                    .is_token_in_rank = layout.is_token_in_rank, .num_tokens_per_expert = layout.num_tokens_per_expert,
                    .topk_idx = in.tv()});
      },
      &again);
  expect_late_rank_outcomes(outcomes, again, "dispatch: agreement");
}

TEST(LegacyFailures, ALateRankInLowLatencyModeLearnsItsPeersGaveUp) {
  Outcome again;
  const auto outcomes = late_rank<Buffer>(
      [](Group& g) {
        return std::make_unique<Buffer>(
            g, BufferConfig{.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(kTokens, kHidden, kRanks, kExperts),
                            .low_latency_mode = true, .num_cpu_timeout_secs = kTimeout});
      },
      [](Buffer& b, Tokens& in) {
        b.low_latency_dispatch({.x = in.xv(), .topk_idx = in.tv(), .num_max_dispatch_tokens_per_rank = kTokens,
                                .num_experts = kExperts});
      },
      &again);
  expect_late_rank_outcomes(outcomes, again, "low_latency_dispatch: agreement");
}

// One rank cannot allocate its outputs after the agreement (it would receive 2^47 bytes: more than
// any address space), while the other reads its published top-k ids and rows. The failing rank
// says what it could not allocate; its peer names it; neither buffer accepts further calls.
TEST(ElasticFailures, ARankThatCannotAllocateItsOutputsIsNamedAndNothingOfItsIsReadAfter) {
  constexpr int kRanksHere = 2, kHiddenHuge = 1 << 24;
  // Rank 1 receives 2 x kManyTokens - 1 = 2^22 + 1 rows of 2^25 bytes: beyond the 2^47-byte address space.
  constexpr std::int64_t kManyTokens = (std::int64_t{1} << 21) + 1;
  std::vector<Outcome> outcomes(kRanksHere), again(kRanksHere);
  LocalWorld(kRanksHere).run([&](Group& g) {
    const int r = g.rank();
    ElasticBuffer buffer(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = static_cast<int>(kManyTokens),
                             .num_cpu_timeout_secs = 60});
    // Only row 0 of x is ever read (rank 1's token 0 goes to rank 0; rank 1 receives every other
    // token but fails to allocate room for them): one real row behind a view of 2^21 rows.
    std::vector<std::uint16_t> row(static_cast<size_t>(kHiddenHuge), 0x3f80);
    std::vector<std::int64_t> topk(static_cast<size_t>(kManyTokens), 1);  // expert 1 lives on rank 1
    if (r == 1) topk[0] = 0;
    const std::int64_t shape[] = {kManyTokens, kHiddenHuge};
    const std::int64_t strides[] = {kHiddenHuge, 1};
    const TensorView x(row.data(), DType::kBF16, shape, strides);
    const TensorView topk_view(topk.data(), DType::kInt64, {kManyTokens, 1});
    outcomes[static_cast<size_t>(r)] =
        capture([&] { buffer.dispatch({.x = x, .topk_idx = topk_view, .num_experts = kRanksHere, .num_sms = 1}); });
    again[static_cast<size_t>(r)] = capture([&] { buffer.barrier(); });
  });
  EXPECT_EQ(outcomes[1].type, "ResourceError") << outcomes[1].message;
  EXPECT_NE(outcomes[1].message.find("[rank 1] dispatch: allocating the outputs (4194305 rows of hidden 16777216"),
            std::string::npos)
      << outcomes[1].message;
  EXPECT_EQ(outcomes[0].type, "PeerError") << outcomes[0].message;
  EXPECT_EQ(outcomes[0].ranks, std::vector<int>{1}) << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("allocating the outputs"), std::string::npos) << outcomes[0].message;
  for (const Outcome& o : again) {
    EXPECT_EQ(o.type, "StateError") << o.message;
    EXPECT_NE(o.message.find("unusable after a failed collective"), std::string::npos) << o.message;
  }
}

}  // namespace elastic_failure_test
}  // namespace moe_ep
