// V1 normal mode against the dense reference: layout, dispatch (received rows, ids, zeroed
// non-local weights, expert counts, handle fields), cached dispatch, num_worst_tokens, dispatch
// routed by is_token_in_rank alone, and combine (bit for bit), on one node and across nodes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>

#include "support/legacy_harness.hh"

namespace moe_ep {
namespace {

using reference::CaseSpec;
using testing::expect_legacy_case;
using testing::LegacyRunOptions;

CaseSpec random_spec(std::uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 3);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  CaseSpec s;
  s.seed = seed;
  s.ranks = pick(1, 8);
  if ((s.ranks == 4 || s.ranks == 8) && pick(0, 1)) s.scaleout = 2;
  s.num_experts = s.ranks * pick(1, 16);
  s.k = pick(1, std::min(8, s.num_experts));
  s.max_tokens = pick(1, 20);
  s.fp8 = pick(0, 2) == 0;
  s.hidden = s.fp8 ? 128 : 64 * pick(1, 3);
  s.scale_cols = s.fp8 ? 1 : 0;
  s.alignment = pick(0, 1) ? 1 : 4;
  s.weights = pick(0, 4) != 0;
  s.num_bias = pick(0, 2);
  s.mask_ratio = pick(0, 1) ? 0.2 : 0.0;
  s.skew = pick(0, 1) ? 1.5 : 0.0;
  for (int r = 0; r < s.ranks; ++r) s.tokens.push_back(pick(0, 3) == 0 ? s.max_tokens : pick(0, s.max_tokens));
  return s;
}

class LegacyRandom : public ::testing::TestWithParam<int> {};

TEST_P(LegacyRandom, NormalModeMatchesReference) {
  for (int i = 0; i < 8; ++i) {
    const auto spec = random_spec(static_cast<std::uint64_t>(GetParam() * 8 + i));
    LegacyRunOptions opt;
    opt.async = i % 3 == 1;
    expect_legacy_case(spec, opt);
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, LegacyRandom, ::testing::Range(0, 12));

TEST(LegacyNormal, WorstTokensAndRoutingWithoutTopk) {
  for (int scaleout : {1, 2}) {
    CaseSpec s = random_spec(1000 + scaleout);
    s.ranks = 4;
    s.scaleout = scaleout;
    s.num_experts = 16;
    s.k = 4;
    s.tokens = {s.max_tokens, 0, 3, s.max_tokens};
    expect_legacy_case(s, {.num_worst_tokens = 4 * s.max_tokens});
    s.weights = false;
    expect_legacy_case(s, {.with_topk = false});
  }
}

}  // namespace
}  // namespace moe_ep
