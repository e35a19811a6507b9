// Shrink mode under mpirun (tests/mpi/shrink_check.sh): the shrink scenario of
// tests/support/shrink_scenario.hh on MPI processes, with rank 1 killed (SIGKILL) when it first
// reaches dispatch and rank 2 when it first reaches combine. Every survivor checks its outputs and
// its mask after every call against the low-latency reference and prints one line, "rank R: OK"
// or "rank R: FAIL <problems>", then leaves without MPI's collective finalization (peers are gone).
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "moe_ep/env.hpp"
#include "moe_ep/mpi.hpp"
#include "reference/low_latency_reference.hh"
#include "support/shrink_scenario.hh"

int main(int argc, char** argv) {
  using namespace moe_ep;
  using testing::FailureAction;
  using At = testing::ShrinkFailure::At;
  mpi::Session session(&argc, &argv);
  std::vector<std::string> bad;
  int rank = -1;
  try {
    auto group = mpi::make_group(MPI_COMM_WORLD);
    rank = group->rank();
    const int scaleout = group->num_scaleout();
    const testing::ShrinkScenario sc{
        .spec = reference::low_latency_spec(group->size(), scaleout, 2 * group->size(), 3, 4, 128, 190, 0.5),
        .failures = {{1, At::kDispatch, FailureAction::kKill}, {2, At::kCombine, FailureAction::kKill}},
        .timeout_secs = env::get_float("MOE_EP_TIMEOUT_SECS")};
    testing::run_shrink_scenario(*group, sc, bad);
  } catch (const std::exception& e) {
    bad.push_back(e.what());
  }
  std::string text;
  for (const std::string& b : bad) text += " | " + b;
  for (char& ch : text)
    if (ch == '\n') ch = ' ';
  std::printf("rank %d: %s%s\n", rank, bad.empty() ? "OK" : "FAIL", text.c_str());
  std::fflush(stdout);
  mpi::Session::abandon();
  _exit(bad.empty() ? 0 : 1);
}
