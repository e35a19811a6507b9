// Several threads of each rank calling that rank's one ElasticBuffer at once (docs/semantics.md,
// "Concurrent calls"): the buffer serialises them. Identical calls pair across ranks in any order
// and all match the reference; threads that take turns in the same order on every rank make
// matching calls with inputs of their own; free-running threads get results equal to the reference
// or the PeerError of ranks that disagree, and the buffer stays usable. Every result is checked
// against the dense reference (tests/reference) bit for bit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "support/elastic_harness.hh"
#include "support/rank_runner.hh"
#include "support/rank_threads.hh"

namespace moe_ep {
namespace elastic_concurrent_calls_test {

using reference::CaseSpec;
using testing::Caught;
using testing::ElasticCalls;
using testing::RunOptions;

constexpr int kThreads = 3;

// A small case: 4 ranks, rank 2 without tokens; `seed` draws the routing and the rows.
CaseSpec small_case(int scaleout, std::uint64_t seed) {
  CaseSpec s;
  s.ranks = 4;
  s.scaleout = scaleout;
  s.num_experts = 8;
  s.k = 3;
  s.max_tokens = 6;
  s.hidden = 64;
  s.num_bias = 1;
  s.seed = seed;
  s.tokens = {6, 3, 0, 5};
  return s;
}

// Thread 1 queues its calls on the communication worker and waits for their events.
RunOptions options_of(int thread) { return {.async = thread == 1, .cached = false, .num_sms = 1}; }

// One ElasticCalls per thread, thread t with the options of options_of(t) and the case of spec_of(t).
template <class SpecOf>
std::vector<std::unique_ptr<ElasticCalls>> thread_calls(int rank, SpecOf&& spec_of) {
  std::vector<std::unique_ptr<ElasticCalls>> calls;
  for (int t = 0; t < kThreads; ++t) calls.push_back(std::make_unique<ElasticCalls>(spec_of(t), options_of(t), rank));
  return calls;
}

std::unique_ptr<ElasticBuffer> buffer_for(Group& g, const CaseSpec& s) {
  return std::make_unique<ElasticBuffer>(g, ElasticBufferConfig{.num_max_tokens_per_rank = s.max_tokens,
                                                                .hidden = s.hidden,
                                                                .num_topk = s.k,
                                                                .num_cpu_timeout_secs = 120});
}

// Every thread makes the same dispatch: whichever threads pair across ranks, every result is the
// reference's.
TEST(ElasticConcurrentCalls, IdenticalDispatchesFromThreeThreadsPerRank) {
  const CaseSpec s = small_case(1, 11);
  testing::report_problems(testing::collect_on_ranks(4, {}, [&](Group& g, std::vector<std::string>& bad) {
    auto buffer = buffer_for(g, s);
    const auto calls = thread_calls(g.rank(), [&](int) { return s; });
    bad = testing::run_rank_threads(kThreads, 60, false, [&](int t, int, std::vector<std::string>& problems) {
      calls[static_cast<size_t>(t)]->dispatch(*buffer, problems);
    });
  }), {.max_per_rank = 5});
}

// Threads take turns in the same order on every rank, each with inputs of its own: its dispatch
// and the combine of its handle pair with the same thread's on every rank.
TEST(ElasticConcurrentCalls, ThreadsTakingTurnsDispatchAndCombineTheirOwnInputs) {
  for (int scaleout : {1, 2}) {
    testing::report_problems(testing::collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      auto buffer = buffer_for(g, small_case(scaleout, 1));
      const auto calls = thread_calls(g.rank(), [&](int t) { return small_case(scaleout, 20 + t); });
      bad = testing::run_rank_threads(kThreads, 25, true, [&](int t, int, std::vector<std::string>& problems) {
        const DispatchResult d = calls[static_cast<size_t>(t)]->dispatch(*buffer, problems);
        calls[static_cast<size_t>(t)]->combine(*buffer, d, problems);
      });
    }), {.context = fmt::format("{} node(s)", scaleout), .max_per_rank = 5});
  }
}

// Free-running threads: each alternates a dispatch and the combine of its handle, in whatever
// order the threads get the buffer. Ranks that pair a dispatch with a combine, or combines of
// different dispatches, raise PeerError on every rank; every other call returns the reference's
// result. Each rank makes the same number of calls, so every call has partners; afterwards the
// buffer still works.
TEST(ElasticConcurrentCalls, FreeRunningThreadsGetTheReferenceOrADisagreement) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = small_case(scaleout, 31);
    testing::report_problems(testing::collect_on_ranks(4, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      auto buffer = buffer_for(g, s);
      const auto calls = thread_calls(g.rank(), [&](int) { return s; });
      std::vector<std::optional<DispatchResult>> held(kThreads);
      bad = testing::run_rank_threads(kThreads, 120, false, [&](int t, int, std::vector<std::string>& problems) {
        ElasticCalls& mine_calls = *calls[static_cast<size_t>(t)];
        std::optional<DispatchResult>& mine = held[static_cast<size_t>(t)];
        const Caught c = testing::catch_error([&] {
          if (mine) {
            const DispatchResult d = *std::exchange(mine, std::nullopt);
            mine_calls.combine(*buffer, d, problems);
          } else {
            mine = mine_calls.dispatch(*buffer, problems);
          }
        });
        if (!c.type.empty() && !testing::ranks_disagreed(c)) problems.push_back(fmt::format("{}: {}", c.type, c.message));
      });
      calls[0]->combine(*buffer, calls[0]->dispatch(*buffer, bad), bad);
    }), {.context = fmt::format("{} node(s)", scaleout), .max_per_rank = 5});
  }
}

}  // namespace elastic_concurrent_calls_test
}  // namespace moe_ep
