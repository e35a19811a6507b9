// The case runner of ElasticBuffer: one dispatch -> cached dispatch -> combine case on a group's
// rank (any transport), every output checked against the dense reference (tests/reference); the
// same case on in-process ranks; random cases from a seed. Failures are collected as strings (gtest
// assertions from rank threads would not stop the other ranks).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/group.hpp"
#include "reference/dense_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep::testing {

struct RunOptions {
  bool async = false;
  bool cpu_sync = true;
  bool cached = true;
  // After the cached replay with the same inputs, one with new x, scales and weights (same
  // routing): its outputs must be the new inputs placed by the handle's layout.
  bool cached_new_inputs = false;
  // The cached dispatches leave the shape arguments (num_max_tokens_per_rank, expert_alignment,
  // do_expand) at their defaults: they are the handle's.
  bool cached_defaults = false;
  // do_handle_copy of the first dispatch: the handle's topk_idx is a copy, or the caller's tensor.
  bool handle_copy = true;
  bool zero_padding = false;
  bool col_major_scales = false;
  int num_sms = 0;
  int num_allocated_qps = 0;  // 0: auto
  // x's dtype when it is neither bfloat16 nor FP8; its size must be spec.payload_element_bytes.
  std::optional<DType> payload_dtype;
  // When set, receives a digest of this rank's outputs (received rows, handle counts, combined
  // rows and weights): equal digests mean bit-identical outputs.
  std::uint64_t* digest = nullptr;
};

// Returns the mismatches found on `group`'s rank (empty when everything matched).
std::vector<std::string> run_elastic_case(Group& group, const reference::CaseSpec& spec, const RunOptions& options);

// The case on LocalWorld(spec.ranks, spec.scaleout nodes): every rank's mismatches.
RankProblems run_elastic_case_in_process(const reference::CaseSpec& spec, const RunOptions& options);

// The same, every rank's mismatches reported as test failures under describe(spec, options).
void expect_elastic_case(const reference::CaseSpec& spec, const RunOptions& options);

// The digests (RunOptions::digest) of the case's outputs on in-process ranks, one per rank.
std::vector<std::uint64_t> in_process_digests(const reference::CaseSpec& spec, RunOptions options);

// A random case from a seed, covering the parameter space of the property tests.
reference::CaseSpec random_case(std::uint64_t seed, RunOptions* options);
// The same, on a fixed number of ranks and nodes (a group that exists already).
reference::CaseSpec random_case(std::uint64_t seed, int ranks, int scaleout, RunOptions* options);

std::string describe(const reference::CaseSpec& spec, const RunOptions& options);

// The calls of run_elastic_case one at a time, for threads that share one buffer: a dispatch of
// this rank's inputs of the case (new routing, no statistics) and the combine of a dispatch's
// result, each checked against the reference as run_elastic_case checks it. One object per thread
// (it holds that thread's copy of the inputs); the calls throw what the buffer throws.
class ElasticCalls {
 public:
  ElasticCalls(const reference::CaseSpec& spec, const RunOptions& options, int rank);
  DispatchResult dispatch(ElasticBuffer& buffer, std::vector<std::string>& problems);
  void combine(ElasticBuffer& buffer, const DispatchResult& dispatched, std::vector<std::string>& problems);

 private:
  reference::CaseSpec spec_;
  RunOptions options_;
  int rank_;
  std::vector<reference::RankInputs> all_;
  reference::RefDispatch ref_;
};

}  // namespace moe_ep::testing
