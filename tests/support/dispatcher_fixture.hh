// The case runner of the token dispatcher (dispatcher and MPI suites): inputs from the dense
// reference, expert outputs for each output format, and the checks of dispatch outputs and
// combined results against the references in tests/reference (independent of src/).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/error.hpp"
#include "reference/dense_reference.hh"
#include "support/errors.hh"
#include "support/rank_runner.hh"

namespace moe_ep::testing {

using reference::CaseSpec;
using reference::RankInputs;

// `tokens_of(rank)` tokens per rank (default: max_tokens - rank % 3, rank 1 of 4+ ranks empty).
CaseSpec make_spec(int ranks, int scaleout, int experts, int k, int max_tokens, int hidden, std::uint64_t seed,
                   const std::function<int(int)>& tokens_of = {});

struct Inputs {
  Tensor x;             // bfloat16 [n, H]
  Tensor topk_idx;      // int64 [n, k]
  Tensor topk_weights;  // float32 [n, k]
};
Inputs to_tensors(const CaseSpec& s, const RankInputs& in);

struct Expectation {
  bool fp8 = false, round_scale = false, ue8m0 = false;
  int alignment = 1;
  bool multiple_reduction = true;
  bool hybrid = true;
};

// Checks a dispatch output against the reference; appends one line per problem.
void check_dispatch(const CaseSpec& s, const Expectation& e, const std::vector<RankInputs>& all, int me,
                    const DispatchOutput& out, std::vector<std::string>& bad);

// The expert code of the tests, per format: rows of expert_value (unweighted; see dispatcher_fixture.cc).
Tensor expert_outputs(const CaseSpec& s, const Expectation& e, const std::vector<RankInputs>& all, int me,
                      const DispatchOutput& out);

// What combine must return for those expert outputs.
std::vector<std::uint16_t> expected_combine(const CaseSpec& s, const Expectation& e, const std::vector<RankInputs>& all,
                                            int me, const DispatchOutput& out);

// Compares [n, H] BF16 results; appends at most one line.
void check_combined(const std::vector<std::uint16_t>& expected, const Tensor& got, const std::string& what,
                    std::vector<std::string>& bad);

// What the checks expect of a dispatcher's outputs, from its resolved options.
Expectation expectation(const DispatcherOptions& o);

// One batch through the dispatcher, checked end to end against the references (problems are
// appended to `bad`, prefixed with `label`); returns the combined output.
Tensor run_batch(Group& g, TokenDispatcher& d, const CaseSpec& s, BatchKind kind, std::vector<std::string>& bad,
                 const std::string& label, int micro_batch = 0);

// Runs fn on every rank of a LocalWorld and reports every rank's problems as test failures.
void run_ranks(int ranks, Topology topology, const std::function<void(Group&, std::vector<std::string>&)>& fn);

}  // namespace moe_ep::testing
