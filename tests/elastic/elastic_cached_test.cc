// Cached dispatch replays a handle with new x, scales and weights (docs/semantics.md §3, "the
// handle is routing only"): the outputs are the new inputs placed by the first call's layout, on
// one node, across nodes (hybrid and direct), compact and expanded (with zero padding), BF16 and
// FP8 (row-major and column-major scales), with and without CPU sync, sync and async, with the
// shape arguments given or left at their defaults (then the handle's). The checks
// are those of tests/support/elastic_harness.cc (RunOptions::cached_new_inputs).
#include <gtest/gtest.h>

#include "support/elastic_harness.hh"

namespace moe_ep::testing {
namespace {

reference::CaseSpec spec_for(int ranks, int scaleout, bool hybrid, bool expand, bool fp8, std::uint64_t seed) {
  reference::CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.allow_hybrid = hybrid;
  s.num_experts = ranks * 3;
  s.k = 4;
  s.max_tokens = 10;
  s.fp8 = fp8;
  s.hidden = fp8 ? 256 : 128;
  s.scale_cols = fp8 ? 2 : 0;
  s.expand = expand;
  s.alignment = expand ? 4 : 1;
  s.mask_ratio = 0.2;
  s.seed = seed;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r == 1 ? 0 : 10 - r % 4);
  return s;
}

TEST(ElasticCached, ReplayWithNewInputsPlacesTheNewRows) {
  const struct {
    int ranks, scaleout;
    bool hybrid;
  } paths[] = {{4, 1, true}, {8, 2, true}, {8, 2, false}, {8, 4, true}};
  std::uint64_t seed = 200;
  for (const auto& p : paths)
    for (int variant = 0; variant < 4; ++variant) {
      const bool expand = variant & 1, fp8 = variant & 2;
      RunOptions o;
      o.cached_new_inputs = true;
      o.zero_padding = expand;
      o.col_major_scales = fp8 && p.ranks == 8;
      o.async = variant == 3;
      o.cpu_sync = variant != 1;
      o.cached_defaults = variant == 1 || variant == 2;  // shape arguments left for the handle to give
      expect_elastic_case(spec_for(p.ranks, p.scaleout, p.hybrid, expand, fp8, seed++), o);
    }
}

}  // namespace
}  // namespace moe_ep::testing
