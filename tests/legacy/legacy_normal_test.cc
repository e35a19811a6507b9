// V1 normal mode against the dense reference: layout, dispatch (received rows, ids, zeroed
// non-local weights, expert counts, handle fields), cached dispatch, num_worst_tokens, dispatch
// routed by is_token_in_rank alone, and combine (bit for bit), on one node and across nodes; a
// Buffer sized by DeepEP's hints across logical nodes, and the scale-out pool growing for calls
// that need more.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "support/legacy_harness.hh"

namespace moe_ep {
namespace {

using reference::CaseSpec;
using testing::collect_on_ranks;
using testing::deepep_hint_config;
using testing::expect_legacy_case;
using testing::LegacyRunOptions;
using testing::report_problems;
using testing::run_legacy_case_on;

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

// A BF16 case of `tokens` per rank (every third rank sends none) on ranks x scaleout.
CaseSpec spread_spec(std::uint64_t seed, int ranks, int scaleout, int tokens, int hidden) {
  CaseSpec s;
  s.seed = seed;
  s.ranks = ranks;
  s.scaleout = scaleout;
  s.num_experts = 3 * ranks;
  s.k = 4;
  s.max_tokens = tokens;
  s.hidden = hidden;
  s.num_bias = 1;
  s.mask_ratio = 0.1;
  for (int r = 0; r < ranks; ++r) s.tokens.push_back(r % 3 == 2 ? 0 : tokens - r);
  return s;
}

// Engines size a normal-mode Buffer with DeepEP's hints. DeepEP runs up to 8 ranks in one node and
// asks for no scale-out pool there (num_rdma_bytes = 0), also where moe-ep's logical topology
// makes several nodes of them; the Buffer provides the pool itself (docs/legacy.md §1).
TEST(LegacyNormal, DeepEPSizedBufferAcrossLogicalNodes) {
  const struct {
    int ranks, scaleout;
    bool fp8, async;
  } cases[] = {{4, 2, false, false}, {4, 2, true, true}, {8, 2, false, true}, {8, 4, false, false}};
  for (const auto& c : cases) {
    CaseSpec s = spread_spec(3000 + c.ranks * 10 + c.scaleout, c.ranks, c.scaleout, 24, 256);
    if (c.fp8) {
      s.fp8 = true;
      s.hidden = 128;
      s.scale_cols = 1;
    }
    ASSERT_EQ(deepep_hint_config(std::int64_t{s.hidden} * 2, s.ranks).num_rdma_bytes, 0);
    expect_legacy_case(s, {.async = c.async, .deepep_hints = true});
  }
}

// One Buffer across 2 logical nodes: a given pool is used while calls fit in it (a view of it
// stays the pool); a call that needs more replaces it by a larger one (a view taken before keeps
// the old pool, which the call leaves alone); smaller calls then use the grown pool.
TEST(LegacyNormal, ScaleOutPoolGrowsForACallThatNeedsMore) {
  const CaseSpec small = spread_spec(41, 4, 2, 8, 256);    // 2 x 8 x 576 B: fits in 128 KiB
  const CaseSpec large = spread_spec(42, 4, 2, 64, 1024);  // 2 x 64 x 2112 B: does not
  const auto problems = collect_on_ranks(4, {.num_scaleout = 2}, [&](Group& g, std::vector<std::string>& bad) {
    Buffer b(g, {.num_rdma_bytes = 128 << 10, .num_cpu_timeout_secs = 60});
    auto pool = [&] { return b.get_local_buffer_tensor(DType::kUInt8, 0, true); };
    const Tensor given = pool();
    for (const auto& p : run_legacy_case_on(b, g, small, {})) bad.push_back("small call: " + p);
    if (pool().data() != given.data()) bad.push_back("a call that fits replaced the pool");
    std::memset(given.data(), 0x5a, static_cast<std::size_t>(given.nbytes()));
    for (const auto& p : run_legacy_case_on(b, g, large, {.async = true})) bad.push_back("large call: " + p);
    const Tensor grown = pool();
    if (grown.data() == given.data()) bad.push_back("the large call did not replace the pool");
    const auto* old = given.data_as<const std::uint8_t>();
    if (std::any_of(old, old + given.nbytes(), [](std::uint8_t v) { return v != 0x5a; }))
      bad.push_back("the large call wrote into the pool it replaced");
    for (const auto& p : run_legacy_case_on(b, g, small, {})) bad.push_back("small call after: " + p);
    if (pool().data() != grown.data()) bad.push_back("a call that fits the grown pool replaced it");
  });
  report_problems(problems, {.name_rank = true});
}

}  // namespace
}  // namespace moe_ep
