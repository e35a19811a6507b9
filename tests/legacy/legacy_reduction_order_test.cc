// V1 normal combine's reduction order on the order-sensitive case of
// tests/reference/order_sensitive_case.hh: ascending master lane on one node; across two nodes the
// forwarder first sums its node's ranks in ascending master-lane order (docs/legacy.md §3).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "reference/order_sensitive_case.hh"
#include "support/legacy_harness.hh"

namespace moe_ep::testing {
namespace {

TEST(LegacyReductionOrder, CombineSumsInAscendingMasterLaneOrder) {
  for (int scaleout : {1, 2})
    for (int num_bias : {0, 1}) {
      const reference::CaseSpec spec = legacy_reference_spec(reference::order_sensitive_case(scaleout, true, false, true, num_bias));
      SCOPED_TRACE(describe(spec, LegacyRunOptions{}));
      EXPECT_TRUE(reference::order_matters(spec, scaleout > 1 ? 2 : 4)) << "the case is order-sensitive";
      report_problems(run_legacy_case_in_process(spec, {}));
    }
}

}  // namespace
}  // namespace moe_ep::testing
