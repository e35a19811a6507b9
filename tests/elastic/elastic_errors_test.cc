// Bad input and misuse: every case is a typed error naming the argument, the value and the
// limit; peers of a rank with bad input raise PeerError naming it; nothing hangs; the buffer
// stays usable after a rejected call.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "reference/dense_reference.hh"
#include "support/errors.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace elastic_errors_test {

constexpr int kRanks = 4, kExperts = 16, kTopk = 4, kTokens = 8, kHidden = 128;

struct Inputs {
  explicit Inputs(int rank, int n = kTokens, int hidden = kHidden) : n(n), hidden(hidden) {
    x.assign(static_cast<size_t>(n * hidden), 0x3f80);
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < kTopk; ++j) topk.push_back((rank * 3 + t + j * 4) % kExperts);
    weights.assign(static_cast<size_t>(n * kTopk), 0.5f);
  }
  TensorView x_view() { return TensorView(x.data(), DType::kBF16, {n, hidden}); }
  TensorView topk_view() { return TensorView(topk.data(), DType::kInt64, {n, kTopk}); }
  TensorView weights_view() { return TensorView(weights.data(), DType::kFP32, {n, kTopk}); }
  DispatchArgs args() {
    return {.x = x_view(), .topk_idx = topk_view(), .topk_weights = weights_view(), .num_experts = kExperts};
  }
  std::int64_t n;
  int hidden;
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
  std::vector<float> weights;
};

ElasticBufferConfig config() {
  return {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk, .num_cpu_timeout_secs = 30};
}

// What a call threw: type ("" when nothing), message and the ranks it names.
using Outcome = testing::Caught;
constexpr auto capture = testing::catch_error;

// Runs `call` on every rank of a fresh world with one buffer; returns each rank's outcome.
// Afterwards every rank dispatches valid input once more, which must succeed.
std::vector<Outcome> on_all_ranks(const std::function<void(ElasticBuffer&, int rank)>& call, Topology topology = {}) {
  return testing::results_on_ranks<Outcome>(kRanks, topology, [&](Group& g) {
    ElasticBuffer buffer(g, config());
    const Outcome outcome = capture([&] { call(buffer, g.rank()); });
    Inputs in(g.rank());
    auto result = buffer.dispatch(in.args());  // the buffer is still usable
    EXPECT_EQ(result.handle->num_tokens, kTokens);
    return outcome;
  });
}

void expect_rejected_by(const std::vector<Outcome>& outcomes, int bad_rank, const std::string& type,
                        const std::vector<std::string>& fragments) {
  for (int r = 0; r < kRanks; ++r) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    if (r == bad_rank) {
      EXPECT_EQ(o.type, type) << o.message;
      EXPECT_NE(o.message.find(fmt::format("[rank {}]", r)), std::string::npos) << o.message;
      for (const auto& f : fragments) EXPECT_NE(o.message.find(f), std::string::npos) << "missing '" << f << "' in: " << o.message;
    } else {
      EXPECT_EQ(o.type, "PeerError") << o.message;
      EXPECT_EQ(o.ranks, std::vector<int>{bad_rank}) << o.message;
      EXPECT_NE(o.message.find(fmt::format("rank [{}] rejected its arguments", bad_rank)), std::string::npos) << o.message;
    }
  }
}

TEST(ElasticErrors, ExpertIdOutOfRange) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    if (rank == 2) in.topk[5] = kExperts;
    b.dispatch(in.args());
  });
  expect_rejected_by(outcomes, 2, "InvalidArgument", {"topk_idx[1, 1] = 16", "[-1, 16)"});
  outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    if (rank == 0) in.topk[0] = -7;
    b.dispatch(in.args());
  });
  expect_rejected_by(outcomes, 0, "InvalidArgument", {"topk_idx[0, 0] = -7"});
}

// A caller's own refusal (what the Python binding sends when it cannot convert an argument) is
// reported through the call: every other rank learns it, and the next call pairs up as usual.
TEST(ElasticErrors, CallerRejectionReachesEveryRank) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    DispatchArgs a = in.args();
    if (rank == 2) a.rejection = "topk_weights must be a tensor, not list";
    b.dispatch(a);
  });
  expect_rejected_by(outcomes, 2, "InvalidArgument", {"dispatch", "topk_weights must be a tensor, not list"});
  outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    auto d = b.dispatch(in.args());
    CombineArgs c{.x = d.recv_x, .handle = d.handle};
    if (rank == 1) c = CombineArgs{.rejection = "x must be a tensor, not str"};  // nothing else given
    b.combine(c);
  });
  expect_rejected_by(outcomes, 1, "InvalidArgument", {"combine", "x must be a tensor, not str"});
}

TEST(ElasticErrors, DuplicateExpertInAToken) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    if (rank == 1) in.topk[3 * kTopk + 2] = in.topk[3 * kTopk];
    b.dispatch(in.args());
  });
  expect_rejected_by(outcomes, 1, "InvalidArgument", {"topk_idx[3] names expert", "twice"});
}

TEST(ElasticErrors, MoreTokensThanTheCap) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank, rank == 3 ? kTokens + 1 : kTokens);
    b.dispatch(in.args());
  });
  expect_rejected_by(outcomes, 3, "InvalidArgument", {"x has 9 tokens", "num_max_tokens_per_rank = 8"});
}

TEST(ElasticErrors, HiddenDiffersFromTheBuffer) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank, kTokens, rank == 1 ? 256 : kHidden);
    b.dispatch(in.args());
  });
  expect_rejected_by(outcomes, 1, "InvalidArgument", {"hidden size 256", "hidden = 128"});
}

TEST(ElasticErrors, Fp8ShapeRules) {
  // A buffer without a fixed hidden size: an FP8 row (hidden bytes) must be a multiple of 16 bytes.
  std::vector<Outcome> outcomes(kRanks);
  LocalWorld world(kRanks);
  world.run([&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = kTokens, .num_cpu_timeout_secs = 30});
    std::vector<std::uint8_t> x(kTokens * 200);
    std::vector<float> scales(kTokens * 2, 1.0f);
    Inputs in(g.rank());
    DispatchArgs a = in.args();
    a.x = TensorView(x.data(), DType::kFP8E4M3, {kTokens, 200});
    a.x_scales = TensorView(scales.data(), DType::kFP32, {kTokens, 2});
    outcomes[static_cast<size_t>(g.rank())] = capture([&] { b.dispatch(a); });
    // Scales with the wrong row count, the wrong dtype, or missing.
    std::vector<std::uint8_t> x2(kTokens * 128);
    a.x = TensorView(x2.data(), DType::kFP8E4M3, {kTokens, 128});
    a.x_scales = TensorView(scales.data(), DType::kFP32, {kTokens - 1, 1});
    Outcome rows = capture([&] { b.dispatch(a); });
    EXPECT_EQ(rows.type, "InvalidArgument");
    EXPECT_NE(rows.message.find("x_scales has size 7 in dimension 0, expected 8"), std::string::npos) << rows.message;
    std::vector<std::uint16_t> half(kTokens);
    a.x_scales = TensorView(half.data(), DType::kBF16, {kTokens, 1});
    Outcome dtype = capture([&] { b.dispatch(a); });
    EXPECT_NE(dtype.message.find("x_scales has dtype bfloat16, expected float32 or int32"), std::string::npos) << dtype.message;
    a.x_scales = TensorView();
    Outcome missing = capture([&] { b.dispatch(a); });
    EXPECT_NE(missing.message.find("x_scales is missing"), std::string::npos) << missing.message;
  });
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.type, "InvalidArgument");
    EXPECT_NE(o.message.find("x is float8_e4m3fn [8, 200]: a row is 200 bytes, which must be a multiple of 16"), std::string::npos) << o.message;
  }
}

TEST(ElasticErrors, ExpertsNotDivisibleAndTopkTooLarge) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    auto a = in.args();
    a.num_experts = 18;
    b.dispatch(a);
  });
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.type, "InvalidArgument");
    EXPECT_NE(o.message.find("num_experts = 18 is not divisible by the 4 ranks"), std::string::npos) << o.message;
  }
  outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    std::vector<std::uint16_t> x(kTokens * kHidden);
    std::vector<std::int64_t> topk(kTokens * 33, -1);
    b.dispatch({.x = TensorView(x.data(), DType::kBF16, {kTokens, kHidden}),
                .topk_idx = TensorView(topk.data(), DType::kInt64, {kTokens, 33}),
                .num_experts = 64});
  });
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.type, "InvalidArgument");
    EXPECT_NE(o.message.find("topk_idx has 33 columns (k), expected 1 to 32"), std::string::npos) << o.message;
  }
}

TEST(ElasticErrors, BufferTooSmallNamesTheRequiredSize) {
  // Across nodes the buffer holds records; a 2 MiB buffer cannot hold 4096 tokens of 7168.
  std::vector<Outcome> outcomes(kRanks);
  LocalWorld world(kRanks, {.num_scaleout = 2});
  world.run([&](Group& g) {
    ElasticBuffer b(g, {.num_bytes = 2 << 20, .num_max_tokens_per_rank = 4096, .num_cpu_timeout_secs = 30});
    std::vector<std::uint16_t> x(4 * 7168);
    std::vector<std::int64_t> topk(4 * kTopk, 0);
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < kTopk; ++j) topk[static_cast<size_t>(t * kTopk + j)] = j * 4;
    outcomes[static_cast<size_t>(g.rank())] = capture([&] {
      b.dispatch({.x = TensorView(x.data(), DType::kBF16, {4, 7168}),
                  .topk_idx = TensorView(topk.data(), DType::kInt64, {4, kTopk}),
                  .num_experts = kExperts});
    });
  });
  const std::int64_t record = 14336 + 64;  // a(2H, 32) + a(8k + 4, 32)
  const std::int64_t need = (2 * 4096 * record + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.type, "CapacityError");
    EXPECT_NE(o.message.find(fmt::format("needs {} bytes", need)), std::string::npos) << o.message;
    EXPECT_NE(o.message.find("the buffer holds 2097152"), std::string::npos) << o.message;
  }
}

TEST(ElasticErrors, HandleFromAnotherBufferOrShape) {
  LocalWorld world(kRanks);
  world.run([&](Group& g) {
    ElasticBuffer a(g, config());
    ElasticBuffer b(g, config());
    Inputs in(g.rank());
    auto first = a.dispatch(in.args());
    DispatchArgs cached{.x = in.x_view(), .handle = first.handle};
    Outcome other = capture([&] { b.dispatch(cached); });
    EXPECT_EQ(other.type, "InvalidArgument");
    EXPECT_NE(other.message.find("handle was created by another buffer"), std::string::npos) << other.message;
    Inputs fewer(g.rank(), kTokens - 2);
    cached.x = fewer.x_view();
    Outcome shape = capture([&] { a.dispatch(cached); });
    EXPECT_NE(shape.message.find("x has 6 tokens, the handle was made for 8"), std::string::npos) << shape.message;
    cached.x = in.x_view();
    cached.topk_idx = in.topk_view();
    Outcome both = capture([&] { a.dispatch(cached); });
    EXPECT_NE(both.message.find("topk_idx must not be given with a cached handle"), std::string::npos) << both.message;
    // Combine with a handle from the other buffer, or with the wrong number of rows.
    std::vector<std::uint16_t> y(static_cast<size_t>(first.recv_x.size(0) + 1) * kHidden);
    Outcome foreign = capture([&] {
      b.combine({.x = TensorView(y.data(), DType::kBF16, {first.recv_x.size(0), kHidden}), .handle = first.handle});
    });
    EXPECT_NE(foreign.message.find("handle was created by another buffer"), std::string::npos) << foreign.message;
    Outcome rows = capture([&] {
      a.combine({.x = TensorView(y.data(), DType::kBF16, {first.recv_x.size(0) + 1, kHidden}), .handle = first.handle});
    });
    EXPECT_EQ(rows.type, "InvalidArgument");
    EXPECT_NE(rows.message.find(fmt::format("x has {} rows, the handle's compact layout has {}", first.recv_x.size(0) + 1,
                                            first.recv_x.size(0))),
              std::string::npos)
        << rows.message;
    // Three biases are one too many.
    std::vector<std::uint16_t> bias(kTokens * kHidden);
    TensorView bv(bias.data(), DType::kBF16, {kTokens, kHidden});
    Outcome biases = capture([&] {
      a.combine({.x = TensorView(y.data(), DType::kBF16, {first.recv_x.size(0), kHidden}), .handle = first.handle,
                 .bias = {bv, bv, bv}});
    });
    EXPECT_NE(biases.message.find("3 bias tensors given, at most 2"), std::string::npos) << biases.message;
    // Still usable: a proper combine works.
    auto done = a.combine({.x = TensorView(y.data(), DType::kBF16, {first.recv_x.size(0), kHidden}), .handle = first.handle});
    EXPECT_EQ(done.combined_x.size(0), kTokens);
  });
}

TEST(ElasticErrors, RanksThatDisagreeAreNamed) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    auto a = in.args();
    a.num_experts = rank == 3 ? 32 : kExperts;
    b.dispatch(a);
  });
  for (int r = 0; r < kRanks; ++r) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    EXPECT_EQ(o.type, "PeerError");
    EXPECT_NE(o.message.find("ranks disagree on num_experts: 16 on ranks [0, 1, 2], 32 on rank [3]"), std::string::npos)
        << o.message;
    EXPECT_EQ(o.ranks, r == 3 ? std::vector<int>({0, 1, 2}) : std::vector<int>({3}));
  }
  outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    auto a = in.args();
    a.num_max_tokens_per_rank = rank < 2 ? 8 : 16;
    b.dispatch(a);
  });
  for (const auto& o : outcomes)
    EXPECT_NE(o.message.find("ranks disagree on num_max_tokens_per_rank: 16 on ranks [2, 3], 8 on ranks [0, 1]"),
              std::string::npos)
        << o.message;
  // Valid FP8 input on rank 1, BF16 elsewhere: the dtypes are named, not their codes.
  outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    auto a = in.args();
    std::vector<std::uint8_t> fp8(static_cast<size_t>(kTokens * kHidden), 0x38);
    std::vector<float> scales(static_cast<size_t>(kTokens * kHidden / 128), 1.0f);
    if (rank == 1) {
      a.x = TensorView(fp8.data(), DType::kFP8E4M3, {kTokens, kHidden});
      a.x_scales = TensorView(scales.data(), DType::kFP32, {kTokens, kHidden / 128});
    }
    b.dispatch(a);
  });
  for (int r = 0; r < kRanks; ++r) {
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    EXPECT_EQ(o.type, "PeerError") << o.message;
    EXPECT_NE(o.message.find("ranks disagree on x dtype: bfloat16 on ranks [0, 2, 3], float8_e4m3fn on rank [1]"),
              std::string::npos)
        << o.message;
    EXPECT_EQ(o.ranks, r == 1 ? std::vector<int>({0, 2, 3}) : std::vector<int>({1}));
  }
}

TEST(ElasticErrors, RanksThatDisagreeOnTopkAreNamed) {
  std::vector<Outcome> outcomes(kRanks);
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = 30});
    const int k = g.rank() == 2 ? 2 : kTopk;
    std::vector<std::uint16_t> x(kTokens * kHidden);
    std::vector<std::int64_t> topk(static_cast<size_t>(kTokens * k), -1);
    outcomes[static_cast<size_t>(g.rank())] = capture([&] {
      b.dispatch({.x = TensorView(x.data(), DType::kBF16, {kTokens, kHidden}),
                  .topk_idx = TensorView(topk.data(), DType::kInt64, {kTokens, k}),
                  .num_experts = kExperts});
    });
  });
  for (const auto& o : outcomes)
    EXPECT_NE(o.message.find("ranks disagree on num_topk: 2 on rank [2], 4 on ranks [0, 1, 3]"), std::string::npos)
        << o.message;
}

TEST(ElasticErrors, ConstructorDisagreementAndBadConfig) {
  std::vector<Outcome> outcomes(kRanks);
  LocalWorld(kRanks).run([&](Group& g) {
    auto c = config();
    if (g.rank() == 1) c.hidden = 256;
    outcomes[static_cast<size_t>(g.rank())] = capture([&] { ElasticBuffer b(g, c); });
  });
  for (const auto& o : outcomes) EXPECT_NE(o.message.find("ranks disagree on hidden"), std::string::npos) << o.message;
  LocalWorld(kRanks).run([&](Group& g) {
    auto c = config();
    c.num_bytes = g.rank() == 0 ? 3 << 20 : 4 << 20;
    Outcome o = capture([&] { ElasticBuffer b(g, c); });
    if (g.rank() == 0) {
      EXPECT_NE(o.message.find("num_bytes = 3145728 is not a multiple of 2097152"), std::string::npos) << o.message;
    } else {
      EXPECT_EQ(o.type, "PeerError") << o.message;
    }
  });
}

TEST(ElasticErrors, ADifferentCollectiveIsReportedNotMatched) {
  std::vector<Outcome> outcomes(kRanks);
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, config());
    Inputs in(g.rank());
    outcomes[static_cast<size_t>(g.rank())] = capture([&] {
      if (g.rank() == 0) {
        b.barrier();
      } else {
        b.dispatch(in.args());
      }
    });
  });
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.type, "PeerError") << o.message;
    EXPECT_NE(o.message.find("ranks disagree on the operation: barrier on rank [0], dispatch on ranks [1, 2, 3]"),
              std::string::npos)
        << o.message;
  }
}

// Timeouts here are long enough for every present rank to arrive, whatever the load; the absent
// rank stays away until the others reported (it waits for them, not for a clock).
TEST(ElasticErrors, ARankThatLeavesOrNeverCallsIsNamed) {
  std::vector<Outcome> outcomes(kRanks);
  std::atomic<int> reported{0};
  try {
    LocalWorld(kRanks).run([&](Group& g) {
      ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = 2});
      if (g.rank() == 2) {  // stays in the group but never makes the call
        while (reported.load() < kRanks - 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      Inputs in(g.rank());
      outcomes[static_cast<size_t>(g.rank())] = capture([&] { b.dispatch(in.args()); });
      ++reported;
    });
  } catch (const Error&) {
  }
  for (int r : {0, 1, 3}) {
    // (A timeout leaves the ranks out of step: those buffers refuse further calls, tested below.)
    const Outcome& o = outcomes[static_cast<size_t>(r)];
    EXPECT_EQ(o.type, "TimeoutError") << o.message;
    EXPECT_NE(std::find(o.ranks.begin(), o.ranks.end(), 2), o.ranks.end()) << o.message;
    EXPECT_NE(o.message.find("dispatch: agreement"), std::string::npos);
  }
  LocalWorld(kRanks).run([&](Group& g) {
    ElasticBuffer b(g, config());
    if (g.rank() == 1) return;  // leaves without calling
    Inputs in(g.rank());
    Outcome o = capture([&] { b.dispatch(in.args()); });
    EXPECT_EQ(o.type, "PeerError") << o.message;
    EXPECT_EQ(o.ranks, std::vector<int>{1});
    // Its buffer is being destroyed (collectively) while the others dispatch.
    EXPECT_NE(o.message.find("destruction on rank [1], dispatch on ranks [0, 2, 3]"), std::string::npos) << o.message;
  });
}

TEST(ElasticErrors, ABufferOutOfStepAfterATimeoutRefusesCalls) {
  std::atomic<int> reported{0};
  LocalWorld(2).run([&](Group& g) {
    ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_cpu_timeout_secs = 2});
    if (g.rank() == 1) {
      while (reported.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    Inputs in(g.rank());
    EXPECT_THROW(b.dispatch(in.args()), TimeoutError);
    Outcome again = capture([&] { b.dispatch(in.args()); });
    EXPECT_EQ(again.type, "StateError");
    EXPECT_NE(again.message.find("unusable after a failed collective"), std::string::npos) << again.message;
    EXPECT_NE(again.message.find("timed out"), std::string::npos) << again.message;
    ++reported;
  });
}

TEST(ElasticErrors, DestroyedBufferAndDestroyRules) {
  LocalWorld(2).run([&](Group& g) {
    ElasticBuffer plain(g, config());
    EXPECT_THROW(plain.destroy(), StateError);
    auto c = config();
    c.explicitly_destroy = true;
    ElasticBuffer b(g, c);
    b.destroy();
    Inputs in(g.rank());
    Outcome o = capture([&] { b.dispatch(in.args()); });
    EXPECT_EQ(o.type, "StateError");
    EXPECT_NE(o.message.find("the ElasticBuffer was destroyed"), std::string::npos);
  });
}

TEST(ElasticErrors, AsyncRejectionIsReportedAtOnceAndPeersAreNotLeftWaiting) {
  auto outcomes = on_all_ranks([](ElasticBuffer& b, int rank) {
    Inputs in(rank);
    if (rank == 1) in.topk[0] = 99;
    auto a = in.args();
    a.async_with_compute_stream = true;
    auto result = b.dispatch(a);
    result.event.wait();
  });
  expect_rejected_by(outcomes, 1, "InvalidArgument", {"topk_idx[0, 0] = 99"});
}

}  // namespace elastic_errors_test
}  // namespace moe_ep
