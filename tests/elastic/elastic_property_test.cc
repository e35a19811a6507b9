// Randomized property tests: dispatch, cached dispatch and combine against the dense reference
// over many seeds (ranks 1-8, topologies 1xN, 2x2, 2x4, 4x2, 2x3, 3x2, hybrid and direct, k 1-8,
// 1-32 experts per rank, masks, skew, empty ranks, N = T, FP8 and BF16, compact and expanded,
// alignments, sync and async, CPU sync on and off, worker counts).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "support/elastic_harness.hh"

namespace moe_ep::testing {
namespace {

class RandomCases : public ::testing::TestWithParam<int> {};

TEST_P(RandomCases, MatchReference) {
  for (int i = 0; i < 10; ++i) {
    RunOptions options;
    const auto spec = random_case(static_cast<std::uint64_t>(GetParam() * 10 + i), &options);
    SCOPED_TRACE(describe(spec, options));
    expect_elastic_case(spec, options);
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomCases, ::testing::Range(0, 30));

reference::CaseSpec base(int ranks, int scaleout, bool hybrid) {
  reference::CaseSpec s;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.allow_hybrid = hybrid;
  s.num_experts = ranks * 4;
  s.k = 6;
  s.max_tokens = 16;
  s.hidden = 128;
  s.seed = 99;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 3 == 1 ? 0 : 16 - r);
  return s;
}

// Hand-picked corners on every topology and path.
TEST(ElasticCorners, EveryPathAndLayout) {
  const struct {
    int ranks, scaleout;
    bool hybrid;
  } topologies[] = {{8, 1, true}, {8, 2, true}, {8, 4, true}, {8, 2, false}, {8, 4, false}, {4, 2, true}, {2, 2, true}};
  for (const auto& topo : topologies) {
    for (int variant = 0; variant < 8; ++variant) {
      auto s = base(topo.ranks, topo.scaleout, topo.hybrid);
      s.expand = variant & 1;
      s.multi = variant & 2;
      s.fp8 = variant & 4;
      s.scale_cols = s.fp8 ? 1 : 0;
      s.alignment = s.expand ? 128 : 1;
      s.num_bias = variant % 3;
      s.mask_ratio = 0.2;
      RunOptions o;
      o.zero_padding = s.expand;
      o.async = variant & 1;
      SCOPED_TRACE(describe(s, o));
      expect_elastic_case(s, o);
    }
  }
}

TEST(ElasticCorners, TopkLargerThanExpertsPerRankAndAllTokensEverywhere) {
  auto s = base(4, 1, true);
  s.num_experts = 8;  // 2 per rank, k = 8: every token reaches every rank, several lanes per rank
  s.k = 8;
  s.expand = true;
  s.alignment = 3;
  s.tokens = {16, 16, 16, 16};  // N = T everywhere
  expect_elastic_case(s, {});
  s.expand = false;
  expect_elastic_case(s, {.async = true});
}

TEST(ElasticCorners, SingleRank) {
  auto s = base(1, 1, true);
  s.num_experts = 32;
  s.k = 8;
  expect_elastic_case(s, {});
  s.expand = true;
  expect_elastic_case(s, {.cpu_sync = false});
}

TEST(ElasticCorners, AllMaskedAndEmpty) {
  auto s = base(4, 2, true);
  s.mask_ratio = 1.0;
  expect_elastic_case(s, {});
  s.tokens = {0, 0, 0, 0};
  s.mask_ratio = 0.0;
  expect_elastic_case(s, {.async = true});
}

}  // namespace
}  // namespace moe_ep::testing
