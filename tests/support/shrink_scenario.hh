// Shrink mode's failure scenario (docs/legacy.md §4), on any transport: rounds of low-latency
// dispatch, combine and clean on a Buffer with enable_shrink, in which some ranks fail the first
// time they reach a given call (they destroy their buffer, drop it, stop, or their process is
// killed) while the others go on. Every survivor checks, after every call, its mask (the ranks
// failed so far, exactly) and its outputs: the slab against the low-latency reference of the
// inputs without the failed ranks' tokens and without their experts, the combine against the
// reference without the lanes of experts whose rank had failed by the combine (tests/reference;
// nothing is taken from the code under test).
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "moe_ep/group.hpp"
#include "reference/dense_reference.hh"

namespace moe_ep::testing {

enum class FailureAction {
  kDestroy,  // destroy() its buffer and return (it is then in "another call" for the others)
  kReturn,   // return, its buffer going out of scope (its destructor leaves the exchange)
  kStop,     // make no call until the others are done (found by the timeout), then destroy()
  kKill,     // SIGKILL its own process (ranks in processes only)
};

struct ShrinkFailure {
  int rank;
  enum class At { kDispatch, kCombine, kClean } at;
  FailureAction action;
};

struct ShrinkScenario {
  reference::CaseSpec spec;          // ranks, experts, N, hidden, ...
  std::vector<ShrinkFailure> failures;
  int rounds = 3;                    // each: dispatch (twice in odd rounds: both slots), combine, clean
  double timeout_secs = 30;          // the buffer's timeout (what finds a stopped rank)
  // Set by the last survivor to finish, for kStop ranks (threads of one process only).
  std::atomic<int>* survivors_done = nullptr;
};

// Runs the scenario as rank `g.rank()`; appends one line per problem (a survivor's wrong output or
// mask, or an error it raised) to `bad`.
void run_shrink_scenario(Group& g, const ShrinkScenario& scenario, std::vector<std::string>& bad);

}  // namespace moe_ep::testing
