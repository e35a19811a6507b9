// Shrink mode survives failed ranks (docs/legacy.md §4), ranks as threads: DeepEP's scenario (one
// rank fails when it first reaches dispatch, one at combine, one at clean, each destroying its
// buffer: the others find it in "another call"), ranks whose thread returns without a word (the
// buffer's destructor leaves), and a rank that stops making calls (found by the timeout). Every
// survivor's outputs and mask are checked after every call (support/shrink_scenario.hh).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>

#include "reference/low_latency_reference.hh"
#include "support/rank_runner.hh"
#include "support/shrink_scenario.hh"

namespace moe_ep {
namespace legacy_shrink_test {

using testing::FailureAction;
using testing::ShrinkFailure;
using testing::ShrinkScenario;
using At = ShrinkFailure::At;

void run_in_process(const ShrinkScenario& scenario, int scaleout, const std::string& what) {
  const auto failures = testing::collect_on_ranks(
      scenario.spec.ranks, {.num_scaleout = scaleout},
      [&](Group& g, std::vector<std::string>& bad) { testing::run_shrink_scenario(g, scenario, bad); });
  testing::report_problems(failures, {.context = what, .name_rank = true, .max_per_rank = 10});
}

TEST(ShrinkFailures, DeepEpScenarioRanksDestroyingTheirBuffers) {
  for (int scaleout : {1, 2}) {
    ShrinkScenario sc{.spec = reference::low_latency_spec(8, scaleout, 16, 3, 4, 128, 140 + scaleout, 0.5),
                      .failures = {{1, At::kDispatch, FailureAction::kDestroy},
                                   {3, At::kCombine, FailureAction::kDestroy},
                                   {5, At::kClean, FailureAction::kDestroy}}};
    run_in_process(sc, scaleout, fmt::format("8 ranks, {} node(s)", scaleout));
  }
}

TEST(ShrinkFailures, RanksWhoseThreadsReturn) {
  ShrinkScenario sc{.spec = reference::low_latency_spec(4, 1, 8, 3, 4, 128, 150, 0.5),
                    .failures = {{2, At::kCombine, FailureAction::kReturn}, {0, At::kClean, FailureAction::kReturn}}};
  run_in_process(sc, 1, "4 ranks, ranks 2 and 0 return");
}

TEST(ShrinkFailures, RankThatStopsIsFoundByTheTimeout) {
  std::atomic<int> done{0};
  ShrinkScenario sc{.spec = reference::low_latency_spec(4, 2, 8, 3, 4, 128, 160, 0.5),
                    .failures = {{3, At::kDispatch, FailureAction::kStop}},
                    .rounds = 2,
                    .timeout_secs = 8,
                    .survivors_done = &done};
  run_in_process(sc, 2, "4 ranks on 2 nodes, rank 3 stops");
}

}  // namespace legacy_shrink_test
}  // namespace moe_ep
