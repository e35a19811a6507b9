// Randomized property tests of both buffer generations against the dense reference
// (tests/reference): each case draws a topology (1 to 8 ranks, one node, or 2-4 logical nodes,
// hybrid or direct), a shape, a layout (compact or expanded), a wire format (BF16 or FP8), token
// counts (ranks with no tokens, ranks with N = T) and a routing (drawn per token with -1 masks and
// skew, the same ids for every token, or every token to one rank; k up to beyond the experts per
// rank), runs dispatch, cached dispatch with the same inputs and with new ones, and combine, and
// checks every output (tests/support/elastic_harness.cc, tests/support/legacy_harness.cc).
//
// MOE_EP_PROPERTY_CASES sets the number of cases of each suite (default below, sized to keep the
// binary well under a minute in a Release build on two cores); MOE_EP_PROPERTY_SEED the first
// seed (default 1). Case i uses seed first + i. A failure prints its seed, its parameters and the
// command that replays it alone.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <random>
#include <string>

#include "support/elastic_harness.hh"
#include "support/legacy_harness.hh"

namespace moe_ep::testing {
namespace {

using reference::CaseSpec;

constexpr int kDefaultElasticCases = 400;
constexpr int kDefaultLegacyCases = 250;

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (*end != '\0') throw std::invalid_argument(fmt::format("{}={:?} is not a non-negative integer", name, text));
  return value;
}

struct Plan {
  std::uint64_t first_seed;
  std::uint64_t cases;
};

Plan plan(int default_cases) {
  return {env_number("MOE_EP_PROPERTY_SEED", 1), env_number("MOE_EP_PROPERTY_CASES", static_cast<std::uint64_t>(default_cases))};
}

class Draw {
 public:
  explicit Draw(std::uint64_t seed) : rng_(seed * 0x9e3779b97f4a7c15ULL + 0x2545f4914f6cdd1dULL) {}
  int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <class T>
  T one_of(std::initializer_list<T> values) {
    return *(values.begin() + pick(0, static_cast<int>(values.size()) - 1));
  }

 private:
  std::mt19937_64 rng_;
};

// The parts both generations share: routing shape, masks, empty ranks, k beyond the experts per rank.
void draw_routing(Draw& d, CaseSpec& s) {
  const int style = d.pick(0, 19);
  s.routing_style = style < 11 ? 0 : style < 15 ? 1 : 2;
  s.mask_ratio = d.one_of({0.0, 0.0, 0.25, 0.6, 1.0});
  if (d.chance(0.25)) {  // few experts per rank, k above them
    const int per_rank = d.pick(1, 2);
    s.num_experts = per_rank * s.ranks;
    s.k = d.pick(std::min(s.num_experts, per_rank + 1), std::min(8, s.num_experts));
  }
  for (auto& t : s.tokens)
    if (d.chance(0.15)) t = 0;
  if (!s.fp8) s.wide_range = d.chance(0.3);
}

CaseSpec elastic_case(std::uint64_t seed, RunOptions* options) {
  Draw d(seed);
  CaseSpec s = random_case(seed * 1000003ULL + 7, options);  // topology, shape, layout, dtype, options
  s.seed = seed;
  if (s.scaleout == 1 && (s.ranks == 4 || s.ranks == 6 || s.ranks == 8) && d.chance(0.3)) s.scaleout = 2;
  draw_routing(d, s);
  options->cached = true;
  options->cached_new_inputs = d.chance(0.85);
  options->handle_copy = d.chance(0.7);
  return s;
}

CaseSpec legacy_case(std::uint64_t seed, LegacyRunOptions* options) {
  Draw d(seed ^ 0x5851f42d4c957f2dULL);
  CaseSpec s;
  s.seed = seed;
  s.ranks = d.pick(1, 8);
  if (s.ranks == 4 || s.ranks == 8) s.scaleout = d.one_of({1, 2, s.ranks / 2});
  if (s.ranks == 6) s.scaleout = d.one_of({1, 2, 3});
  s.num_experts = s.ranks * (d.chance(0.3) ? d.pick(1, 2) : d.pick(1, 8));
  s.k = d.pick(1, std::min(8, s.num_experts));
  s.max_tokens = d.pick(1, 20);
  s.fp8 = d.chance(0.3);
  s.hidden = s.fp8 ? 128 * d.pick(1, 2) : 64 * d.pick(1, 3);
  s.scale_cols = s.fp8 ? (d.chance(0.5) ? s.hidden / 128 : 1) : 0;
  s.alignment = d.one_of({1, 4, 8});
  s.weights = d.chance(0.85);
  s.num_bias = d.pick(0, 2);
  s.skew = d.one_of({0.0, 1.5});
  for (int r = 0; r < s.ranks; ++r) s.tokens.push_back(d.chance(0.2) ? s.max_tokens : d.pick(0, s.max_tokens));
  draw_routing(d, s);
  LegacyRunOptions o;
  o.async = d.chance(0.3);
  o.cached_new_inputs = d.chance(0.85);
  o.num_sms = d.one_of({0, 0, 2, 4, 6, 24});
  o.with_topk = !d.chance(0.1);
  if (o.with_topk && d.chance(0.15)) o.num_worst_tokens = s.max_tokens * s.ranks;
  *options = o;
  return s;
}

std::string replay_hint(std::uint64_t seed, const char* test) {
  return fmt::format("replay this case alone: MOE_EP_PROPERTY_SEED={} MOE_EP_PROPERTY_CASES=1 "
                     "tests/property_test --gtest_filter=Property.{}",
                     seed, test);
}

template <class Options>
void run_cases(const char* test, int default_cases, CaseSpec (*make)(std::uint64_t, Options*),
               RankProblems (*run_in_process)(const CaseSpec&, const Options&)) {
  const Plan p = plan(default_cases);
  std::cout << fmt::format("Property.{}: {} cases, seeds {} to {}\n", test, p.cases, p.first_seed, p.first_seed + p.cases - 1);
  int failed = 0;
  for (std::uint64_t i = 0; i < p.cases && failed < 5; ++i) {
    const std::uint64_t seed = p.first_seed + i;
    Options options;
    const CaseSpec spec = make(seed, &options);
    const RankProblems failures = run_in_process(spec, options);
    std::string lines;
    int shown = 0;
    for (const auto& per_rank : failures)
      for (const auto& f : per_rank)
        if (shown++ < 12) lines += "\n  " + f;
    if (shown > 0) {
      ++failed;
      ADD_FAILURE() << "property case with seed " << seed << " failed (" << shown << " mismatches)\n  "
                    << describe(spec, options) << "\n  " << replay_hint(seed, test) << lines;
    }
  }
}

TEST(Property, ElasticBufferMatchesTheDenseReference) {
  run_cases<RunOptions>("ElasticBufferMatchesTheDenseReference", kDefaultElasticCases, &elastic_case,
                        &run_elastic_case_in_process);
}

TEST(Property, LegacyBufferMatchesTheDenseReference) {
  run_cases<LegacyRunOptions>("LegacyBufferMatchesTheDenseReference", kDefaultLegacyCases, &legacy_case,
                              &run_legacy_case_in_process);
}

}  // namespace
}  // namespace moe_ep::testing
