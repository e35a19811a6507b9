// A refused low-latency call changes nothing (docs/legacy.md §4, "Slots"): refused combines leave
// the dispatch's handle combinable, a refused dispatch between two dispatches leaves both handles
// valid, and a dispatch refused because the ranks disagree on N latches no shape. And the
// combine's topk_idx: -1 may replace a dispatched id (the lane is left out), no other id may.
// Every result is checked against the low-latency reference of tests/reference.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/low_latency_reference.hh"
#include "support/errors.hh"
#include "support/legacy_harness.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace legacy_refusal_test {

using reference::CaseSpec;
using testing::catch_error;
using testing::Caught;
using testing::collect_on_ranks;
using testing::RankCall;

CaseSpec refusal_spec(int scaleout, std::uint64_t seed) {
  return reference::low_latency_spec(4, scaleout, 8, 3, 4, 256, seed, 0.5);
}

// A buffer large enough for twice the case's N (the disagreement test asks for it on one rank).
Buffer make_buffer(Group& g, const CaseSpec& s) {
  CaseSpec doubled = s;
  doubled.max_tokens = 2 * s.max_tokens;
  return Buffer(g, {.num_rdma_bytes = testing::low_latency_rdma_bytes(doubled), .low_latency_mode = true,
                    .num_cpu_timeout_secs = 60});
}

LowLatencyDispatchResult dispatch(Buffer& b, const CaseSpec& s, const RankCall& call, int N) {
  return b.low_latency_dispatch({.x = call.x, .topk_idx = call.topk, .num_max_dispatch_tokens_per_rank = N,
                                 .num_experts = s.num_experts, .use_fp8 = false});
}

// Combines `handle`'s dispatch with the reference expert outputs and compares with the reference.
void combine_checked(Buffer& b, const CaseSpec& s, const RankCall& call, int me,
                     const std::shared_ptr<LowLatencyHandle>& handle, const std::string& what,
                     std::vector<std::string>& bad) {
  const Caught c = catch_error([&] {
    const Tensor y = reference::slab_expert_outputs(s, call.all, me, std::int64_t{s.ranks} * s.max_tokens);
    const LowLatencyCombineResult r =
        b.low_latency_combine({.x = y, .topk_idx = call.topk, .topk_weights = call.weights, .handle = handle});
    const auto expected = reference::low_latency_combine_reference(s, call.in, me);
    if (call.n > 0 && std::memcmp(r.combined_x.data(), expected.data(), expected.size() * 2) != 0)
      bad.push_back(fmt::format("{}: combined_x differs from the reference", what));
  });
  if (!c.type.empty()) bad.push_back(fmt::format("{}: {}: {}", what, c.type, c.message));
}

// `refuser`'s call is refused (its arguments), the others' with a PeerError naming it.
void expect_refused(const Caught& c, int me, int refuser, const std::string& what, std::vector<std::string>& bad) {
  const bool ok = me == refuser ? c.type == "InvalidArgument" : c.type == "PeerError" && c.ranks == std::vector<int>{refuser};
  if (!ok) bad.push_back(fmt::format("{}: {}: {}", what, c.type.empty() ? "nothing thrown" : c.type, c.message));
}

TEST(LowLatencyRefusal, RefusedCombinesLeaveTheHandleCombinable) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = refusal_spec(scaleout, 110 + scaleout);
    const auto failures = collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      const int me = g.rank();
      Buffer b = make_buffer(g, s);
      RankCall call(s, me);
      const LowLatencyDispatchResult d = dispatch(b, s, call, s.max_tokens);
      const Tensor wrong_weights = Tensor::zeros({call.n, s.k}, DType::kInt32);
      for (int attempt = 0; attempt < 3; ++attempt) {  // more refusals than there are slots
        const Tensor y = reference::slab_expert_outputs(s, call.all, me, std::int64_t{s.ranks} * s.max_tokens);
        const Caught c = catch_error([&] {
          b.low_latency_combine({.x = y, .topk_idx = call.topk,
                                 .topk_weights = me == 1 ? TensorView(wrong_weights) : call.weights, .handle = d.handle});
        });
        expect_refused(c, me, 1, fmt::format("refused combine {}", attempt), bad);
      }
      combine_checked(b, s, call, me, d.handle, "the combine after three refused ones", bad);
    });
    testing::report_problems(failures, {.context = fmt::format("{} nodes", scaleout), .name_rank = true});
  }
}

TEST(LowLatencyRefusal, RefusedDispatchBetweenTwoLeavesBothHandlesValid) {
  const CaseSpec s = refusal_spec(1, 120);
  const auto failures = collect_on_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    const int me = g.rank();
    Buffer b = make_buffer(g, s);
    RankCall call(s, me);
    const LowLatencyDispatchResult first = dispatch(b, s, call, s.max_tokens);
    const Tensor wrong_topk = Tensor::zeros({call.n, s.k}, DType::kInt32);
    const Caught c = catch_error([&] {
      b.low_latency_dispatch({.x = call.x, .topk_idx = me == 2 ? TensorView(wrong_topk) : call.topk,
                              .num_max_dispatch_tokens_per_rank = s.max_tokens, .num_experts = s.num_experts,
                              .use_fp8 = false});
    });
    expect_refused(c, me, 2, "refused dispatch", bad);
    const LowLatencyDispatchResult second = dispatch(b, s, call, s.max_tokens);
    combine_checked(b, s, call, me, first.handle, "the first dispatch's combine", bad);
    combine_checked(b, s, call, me, second.handle, "the second dispatch's combine", bad);
  });
  testing::report_problems(failures, {.context = "refused dispatch", .name_rank = true});
}

TEST(LowLatencyRefusal, DisagreementOnNLatchesNoShape) {
  const CaseSpec s = refusal_spec(1, 130);
  const auto failures = collect_on_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    const int me = g.rank();
    Buffer b = make_buffer(g, s);  // a new buffer: no (N, hidden, experts) yet
    RankCall call(s, me);
    const Caught c = catch_error([&] { dispatch(b, s, call, me == 0 ? 2 * s.max_tokens : s.max_tokens); });
    if (c.type != "PeerError" || c.message.find("num_max_dispatch_tokens_per_rank") == std::string::npos)
      bad.push_back(fmt::format("ranks disagreeing on N: {}: {}", c.type, c.message));
    // Every rank, the one that asked for 2N included, now dispatches with N.
    const Caught again = catch_error([&] {
      const LowLatencyDispatchResult d = dispatch(b, s, call, s.max_tokens);
      combine_checked(b, s, call, me, d.handle, "dispatch with the agreed N", bad);
    });
    if (!again.type.empty()) bad.push_back(fmt::format("dispatch with the agreed N: {}: {}", again.type, again.message));
  });
  testing::report_problems(failures, {.context = "disagreement on N", .name_rank = true});
}

// The combine's topk_idx may have -1 where the dispatch had an expert (the lane is left out of the
// sum); another id there is refused.
TEST(LowLatencyCombineIds, MinusOneLeavesALaneOutAndAnotherIdIsRefused) {
  const CaseSpec s = refusal_spec(2, 140);
  const auto failures = collect_on_ranks(4, {.num_scaleout = 2}, [&](Group& g, std::vector<std::string>& bad) {
    const int me = g.rank();
    Buffer b = make_buffer(g, s);
    RankCall call(s, me);
    const LowLatencyDispatchResult d = dispatch(b, s, call, s.max_tokens);
    reference::RankInputs dropped = call.in;  // every third valid lane left out
    int valid = 0;
    for (std::int64_t& id : dropped.topk)
      if (id >= 0 && valid++ % 3 == 0) id = -1;
    const Tensor y = reference::slab_expert_outputs(s, call.all, me, std::int64_t{s.ranks} * s.max_tokens);
    const Caught c = catch_error([&] {
      const LowLatencyCombineResult r = b.low_latency_combine(
          {.x = y, .topk_idx = TensorView(dropped.topk.data(), DType::kInt64, {call.n, s.k}), .topk_weights = call.weights,
           .handle = d.handle});
      const auto expected = reference::low_latency_combine_reference(s, dropped, me);
      if (call.n > 0 && std::memcmp(r.combined_x.data(), expected.data(), expected.size() * 2) != 0)
        bad.push_back("combined_x differs from the reference without the lanes set to -1");
    });
    if (!c.type.empty()) bad.push_back(fmt::format("combine with lanes set to -1: {}: {}", c.type, c.message));
    std::vector<std::int64_t> other = call.in.topk;  // a valid id replaced by another valid id (on rank 2)
    for (std::int64_t& id : other)
      if (me == 2 && id >= 0) {
        id = (id + 1) % s.num_experts;
        break;
      }
    const Caught refused = catch_error([&] {
      b.low_latency_combine({.x = y, .topk_idx = TensorView(other.data(), DType::kInt64, {call.n, s.k}),
                             .topk_weights = call.weights, .handle = d.handle});
    });
    expect_refused(refused, me, 2, "another id in topk_idx", bad);
    if (me == 2 && refused.message.find("differs from the dispatched") == std::string::npos)
      bad.push_back("the refusal does not name the differing id: " + refused.message);
  });
  testing::report_problems(failures, {.context = "combine ids", .name_rank = true});
}

}  // namespace legacy_refusal_test
}  // namespace moe_ep
