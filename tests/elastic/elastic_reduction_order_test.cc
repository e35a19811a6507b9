// Combine's reduction order (docs/semantics.md §4: ascending top-k position at every level, FP32
// accumulation, one BF16 rounding per level) on a fixed case where any other order changes the
// result (tests/reference/order_sensitive_case.hh): compact and expanded layouts, with and
// without multiple reduction, one node, two nodes direct and two nodes hybrid, with and without
// biases. Each case first checks that the levels it exercises are order-sensitive in the
// reference, then runs dispatch and combine against the reference through the harness.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/elastic_harness.hh"
#include "reference/order_sensitive_case.hh"

namespace moe_ep::testing {
namespace {

constexpr int kLevel1 = 1, kLevel2 = 2, kFinal = 4;  // CaseSpec::reversed_levels bits

void run(const reference::CaseSpec& spec, const RunOptions& options) {
  SCOPED_TRACE(describe(spec, options));
  // The case is sensitive to the order of every level this layout and path have.
  if (spec.expand && spec.multi) {
    EXPECT_TRUE(reference::order_matters(spec, kLevel1)) << "level 1 (lanes of a rank)";
  }
  if (spec.hybrid() && spec.multi) {
    EXPECT_TRUE(reference::order_matters(spec, kLevel2)) << "level 2 (ranks of a node)";
  } else {
    EXPECT_TRUE(reference::order_matters(spec, kFinal)) << "final sum";
  }
  report_problems(run_elastic_case_in_process(spec, options));
}

TEST(ReductionOrder, EveryLevelSumsInAscendingKeyOrder) {
  const struct {
    int scaleout;
    bool hybrid;
  } paths[] = {{1, true}, {2, false}, {2, true}};
  for (const auto& path : paths)
    for (bool expand : {false, true})
      for (bool multi : {true, false}) run(reference::order_sensitive_case(path.scaleout, path.hybrid, expand, multi, 0), {});
}

TEST(ReductionOrder, BiasesComeFirst) {
  run(reference::order_sensitive_case(1, true, true, true, 2), {.async = true});
  run(reference::order_sensitive_case(2, true, false, true, 1), {});
  run(reference::order_sensitive_case(2, true, true, false, 2), {.num_sms = 2});
}

}  // namespace
}  // namespace moe_ep::testing
