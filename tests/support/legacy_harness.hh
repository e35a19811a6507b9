// The case runner of the V1 Buffer in normal mode: one case (get_dispatch_layout, dispatch,
// the handle's prefix tensors and channel counts, cached dispatch with the same and with new
// inputs, combine) on a group's rank (any transport); the same case on in-process ranks.
// Guarantees: every output is checked, the rows, counts and combined values against the dense
// reference of tests/reference with V1's semantics (compact layout, per-node reduction across
// nodes: legacy_reference_spec), the layout and the handle's fields against brute-force
// recomputations from their definitions (docs/legacy.md); nothing is taken from the code under
// test. A rank's mismatches are returned as strings (at most 20, each naming the rank), never as
// gtest assertions (an assertion on a rank thread would not stop the other ranks); an empty list
// means every output matched.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/dtype.hpp"
#include "moe_ep/tensor.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/dense_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep::testing {

struct LegacyRunOptions {
  bool cached = true;
  // After the cached replay with the same x, one with new x and scales: its rows must be the new
  // inputs placed by the handle's layout.
  bool cached_new_inputs = false;
  int num_worst_tokens = 0;
  bool async = false;
  bool with_topk = true;  // false: routed by is_token_in_rank alone
  int num_sms = 0;        // Config::num_sms of dispatch and combine (channels = num_sms / 2); 0: default config
  // x's dtype when it is neither bfloat16 nor FP8; its size must be spec.payload_element_bytes.
  std::optional<DType> payload_dtype;
  // The Buffer sized as engines size it with DeepEP's hints (deepep_hint_config) instead of with a
  // 4 MiB scale-out pool.
  bool deepep_hints = false;
};

// The pools an engine asks for when it sizes a normal-mode Buffer with DeepEP's hints for rows of
// `hidden_bytes`: the largest get_nvl_buffer_size_hint and get_rdma_buffer_size_hint of the
// default dispatch and combine configs of `num_ranks`.
BufferConfig deepep_hint_config(std::int64_t hidden_bytes, int num_ranks);

// The reference a V1 case is checked against: V1 has no expanded layout and, across nodes,
// always reduces per node at the forwarder (hybrid path with multiple reduction).
reference::CaseSpec legacy_reference_spec(reference::CaseSpec spec);

// Returns the mismatches found on `group`'s rank (empty when everything matched).
std::vector<std::string> run_legacy_case(Group& group, const reference::CaseSpec& spec, const LegacyRunOptions& options);
// The same on a given Buffer of `group` (options.deepep_hints is ignored).
std::vector<std::string> run_legacy_case_on(Buffer& buffer, Group& group, const reference::CaseSpec& spec,
                                            const LegacyRunOptions& options);

// The case on LocalWorld(spec.ranks, spec.scaleout nodes): every rank's mismatches.
RankProblems run_legacy_case_in_process(const reference::CaseSpec& spec, const LegacyRunOptions& options);

// The same, every rank's mismatches reported as test failures under describe(spec, options).
void expect_legacy_case(const reference::CaseSpec& spec, const LegacyRunOptions& options);

// num_rdma_bytes of a low-latency Buffer for case `s`: the size hint for its tokens per rank,
// hidden size, ranks and experts.
std::int64_t low_latency_rdma_bytes(const reference::CaseSpec& s);

std::string describe(const reference::CaseSpec& spec, const LegacyRunOptions& options);

// One rank's inputs of a low-latency case as the views a call takes: every rank's inputs (the
// reference needs them all), this rank's, its token count, and x, topk and weights over them.
struct RankCall {
  RankCall(const reference::CaseSpec& s, int me)
      : all(reference::make_all_inputs(s)),
        in(all[static_cast<size_t>(me)]),
        n(in.num_tokens),
        x(in.x.data(), DType::kBF16, {n, s.hidden}),
        topk(in.topk.data(), DType::kInt64, {n, s.k}),
        weights(in.weights.data(), DType::kFP32, {n, s.k}) {}
  RankCall(const RankCall&) = delete;
  RankCall& operator=(const RankCall&) = delete;
  std::vector<reference::RankInputs> all;
  reference::RankInputs& in;
  std::int64_t n;
  TensorView x, topk, weights;
};

// The calls of run_legacy_case one at a time, for threads that share one buffer: the layout and
// dispatch of this rank's inputs of the case (num_worst_tokens 0), and the combine of a dispatch's
// result, each checked as run_legacy_case checks it. One object per thread (it holds that
// thread's copy of the inputs); the calls throw what the buffer throws.
class LegacyCalls {
 public:
  struct Dispatched {
    DispatchLayout layout;
    LegacyDispatchResult result;
  };
  LegacyCalls(const reference::CaseSpec& spec, const LegacyRunOptions& options, int rank);
  Dispatched dispatch(Buffer& buffer, std::vector<std::string>& problems);
  void combine(Buffer& buffer, const Dispatched& dispatched, std::vector<std::string>& problems);

 private:
  reference::CaseSpec spec_;
  LegacyRunOptions options_;
  int rank_;
  std::vector<reference::RankInputs> all_;
  reference::RefDispatch ref_;
};

}  // namespace moe_ep::testing
