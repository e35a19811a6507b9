// Shrink mode over the host transport (docs/legacy.md §4): forked processes run the shrink
// scenario of tests/support/shrink_scenario.hh, in which ranks are killed (SIGKILL) when they
// first reach a call; the survivors find them gone at once and go on without them, and every
// survivor's outputs and mask are checked after every call against the low-latency reference.
// /dev/shm holds what it held before.
#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moe_ep/host.hpp"
#include "reference/low_latency_reference.hh"
#include "support/dev_shm.hh"
#include "support/processes.hh"
#include "support/shrink_scenario.hh"

namespace moe_ep {
namespace host_shrink_test {

using testing::Child;
using testing::FailureAction;
using testing::ShrinkFailure;
using testing::ShrinkScenario;
using At = ShrinkFailure::At;

class HostShrinkTest : public testing::DevShmUnchanged {};

// Runs `sc` on sc.spec.ranks processes (ranks_per_node: 0 one node); the killed ranks must die by
// SIGKILL, every other rank must exit cleanly with no problem found.
void run_on_processes(const ShrinkScenario& sc, int ranks_per_node) {
  const std::vector<Child> children =
      testing::run_processes(sc.spec.ranks, [&](int rank, int size, const host::AllGather& ag, std::string*) {
        host::GroupOptions o;
        o.ranks_per_node = ranks_per_node;
        o.timeout_secs = sc.timeout_secs;
        auto group = host::make_group(rank, size, ag, o);
        std::vector<std::string> bad;
        testing::run_shrink_scenario(*group, sc, bad);
        std::string text;
        for (std::size_t i = 0; i < bad.size() && i < 8; ++i) text += (text.empty() ? "" : "; ") + bad[i];
        return text;
      });
  for (int r = 0; r < sc.spec.ranks; ++r) {
    bool killed = false;
    for (const ShrinkFailure& f : sc.failures) killed = killed || (f.rank == r && f.action == FailureAction::kKill);
    const Child& c = children[static_cast<size_t>(r)];
    if (killed)
      EXPECT_TRUE(WIFSIGNALED(c.status) && WTERMSIG(c.status) == SIGKILL) << "rank " << r << ": " << testing::describe(children);
    else
      EXPECT_TRUE(c.exited_ok()) << "rank " << r << ": " << testing::describe(children);
  }
}

TEST_F(HostShrinkTest, KilledRanksAreMaskedAndTheOthersGoOn) {
  for (int ranks_per_node : {0, 2}) {
    const ShrinkScenario sc{.spec = reference::low_latency_spec(4, ranks_per_node == 0 ? 1 : 2, 8, 3, 4, 128, 170, 0.5),
                            .failures = {{1, At::kDispatch, FailureAction::kKill}, {2, At::kCombine, FailureAction::kKill}},
                            .timeout_secs = 30};
    run_on_processes(sc, ranks_per_node);
  }
}

TEST_F(HostShrinkTest, DeepEpScenarioOnProcesses) {
  const ShrinkScenario sc{.spec = reference::low_latency_spec(6, 1, 12, 3, 4, 128, 180, 0.5),
                          .failures = {{1, At::kDispatch, FailureAction::kDestroy},
                                       {3, At::kCombine, FailureAction::kKill},
                                       {5, At::kClean, FailureAction::kDestroy}},
                          .timeout_secs = 30};
  run_on_processes(sc, 0);
}

}  // namespace host_shrink_test
}  // namespace moe_ep
