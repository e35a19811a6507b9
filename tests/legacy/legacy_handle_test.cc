// The V1 handle's prefix tensors (rank_prefix_matrix, channel_prefix_matrix,
// recv_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_rdma_rank_prefix_sum) against their
// definitions in docs/legacy.md §3, for channel counts from 1 to more than the tokens, on one node
// and across nodes; and cached dispatch of new x (and scales), which must place the new rows by
// the handle's layout. The checks are those of tests/support/legacy_harness.cc.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/legacy_harness.hh"

namespace moe_ep::testing {
namespace {

using reference::CaseSpec;

CaseSpec spec_for(int ranks, int scaleout, std::uint64_t seed) {
  CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.num_experts = ranks * 3;
  s.k = 4;
  s.max_tokens = 13;
  s.hidden = 64;
  s.seed = seed;
  s.mask_ratio = 0.2;
  s.skew = 0.7;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 4 == 2 ? 0 : 13 - 2 * (r % 3));  // uneven, one empty rank
  return s;
}

// num_sms 2..26: one channel, a few, and more channels than any rank has tokens.
TEST(LegacyHandle, PrefixTensorsFollowTheirDefinitions) {
  const struct {
    int ranks, scaleout;
  } topologies[] = {{4, 1}, {4, 2}, {8, 2}, {8, 4}, {6, 3}};
  std::uint64_t seed = 40;
  for (const auto& t : topologies)
    for (int num_sms : {2, 6, 26}) expect_legacy_case(spec_for(t.ranks, t.scaleout, seed++), {.num_sms = num_sms});
}

TEST(LegacyHandle, CachedDispatchPlacesNewRows) {
  for (int scaleout : {1, 2}) {
    for (bool fp8 : {false, true}) {
      CaseSpec s = spec_for(4, scaleout, 60 + scaleout * 2 + fp8);
      s.fp8 = fp8;
      s.hidden = fp8 ? 256 : 64;
      s.scale_cols = fp8 ? 2 : 0;
      expect_legacy_case(s, {.cached_new_inputs = true});
      expect_legacy_case(s, {.cached_new_inputs = true, .async = true, .num_sms = 4});
    }
  }
}

}  // namespace
}  // namespace moe_ep::testing
