// The reduction order of combine (routing/combine_order.hh) on hand-worked tokens.
//
// 4 ranks, 8 experts (rank r owns 2r, 2r+1), two physical and routing nodes {0, 1}, {2, 3}.
// The token [4, 1, 5, 6] of rank 0 goes to rank 2 (lanes 0, 2; master lane 2), rank 0 (lane 1)
// and rank 3 (lane 3); to node 0 with master lane 1 and to node 1 with master lane 3.
#include <gtest/gtest.h>

#include <vector>

#include "moe_ep/limits.hpp"
#include "routing/combine_order.hh"

namespace moe_ep::routing {
namespace {

const Geometry kGeo{4, 8, 2};
const std::int64_t kIds[4] = {4, 1, 5, 6};

struct Expected {
  int key;
  UnitKind kind;
  int target;
  int region;
};

void expect_units(const ReductionScheme& scheme, int rank, const std::vector<Expected>& expected) {
  std::array<UnitRef, kMaxTopk> units;
  const int n = reduction_units(kIds, 4, kGeo, scheme, rank, units);
  ASSERT_EQ(n, static_cast<int>(expected.size()));
  for (int i = 0; i < n; ++i) {
    const UnitRef& u = units[static_cast<size_t>(i)];
    const Expected& e = expected[static_cast<size_t>(i)];
    EXPECT_EQ(u.key, e.key) << i;
    EXPECT_EQ(u.kind, e.kind) << i;
    EXPECT_EQ(u.target, e.target) << i;
    if (e.region >= 0) {
      EXPECT_EQ(u.region, e.region) << i;
    }
  }
}

TEST(ReductionUnits, CompactOneUnitPerRankByMasterLane) {
  const ReductionScheme scheme{.expand = false, .multiple_reduction = true, .hybrid = false, .physical_scaleup = 2};
  // At the source (rank 0, node 0): its own rank's row in place, ranks 2 and 3 as records keyed
  // (and stored) by their master lanes 2 and 3.
  expect_units(scheme, 0, {{1, UnitKind::kRank, 0, -1}, {2, UnitKind::kRemoteRank, 2, 2}, {3, UnitKind::kRemoteRank, 3, 3}});
  // The same token seen from a rank of node 1: ranks 2 and 3 in place, rank 0 as a record.
  expect_units(scheme, 2, {{1, UnitKind::kRemoteRank, 0, 1}, {2, UnitKind::kRank, 2, -1}, {3, UnitKind::kRank, 3, -1}});
}

TEST(ReductionUnits, ExpandedWithoutMultipleReductionOneUnitPerLane) {
  const ReductionScheme scheme{.expand = true, .multiple_reduction = false, .hybrid = false, .physical_scaleup = 2};
  expect_units(scheme, 0,
               {{0, UnitKind::kRemoteLane, 0, 0}, {1, UnitKind::kLane, 1, -1}, {2, UnitKind::kRemoteLane, 2, 2},
                {3, UnitKind::kRemoteLane, 3, 3}});
}

TEST(ReductionUnits, HybridMultipleReductionOneUnitPerNode) {
  const ReductionScheme scheme{.expand = false, .multiple_reduction = true, .hybrid = true, .physical_scaleup = 2};
  // Node 0 summed here (master lane 1); node 1's level-2 sum arrives in region 1.
  expect_units(scheme, 0, {{1, UnitKind::kNode, 0, -1}, {3, UnitKind::kRemoteNode, 1, 1}});
}

TEST(ReductionUnits, HybridOwnNodeRankTermsListTheOwnNodesRanks) {
  const ReductionScheme scheme{.expand = false, .multiple_reduction = true, .hybrid = true, .physical_scaleup = 2,
                               .own_node_rank_terms = true};
  // From rank 0: its own rank's row (lane 1), then node 1's level-2 sum.
  expect_units(scheme, 0, {{1, UnitKind::kRank, 0, -1}, {3, UnitKind::kRemoteNode, 1, 1}});
  // From rank 2 (node 1): node 0's sum (master lane 1) sorts before ranks 2 and 3 (keys 2, 3).
  expect_units(scheme, 2, {{1, UnitKind::kRemoteNode, 0, 0}, {2, UnitKind::kRank, 2, -1}, {3, UnitKind::kRank, 3, -1}});
  // Expanded: the same rank units (each the sum of its lanes).
  const ReductionScheme expanded{.expand = true, .multiple_reduction = true, .hybrid = true, .physical_scaleup = 2,
                                 .own_node_rank_terms = true};
  expect_units(expanded, 2, {{1, UnitKind::kRemoteNode, 0, 0}, {2, UnitKind::kRank, 2, -1}, {3, UnitKind::kRank, 3, -1}});
}

TEST(ReductionUnits, HybridWithoutMultipleReductionKeepsRankUnits) {
  const ReductionScheme scheme{.expand = false, .multiple_reduction = false, .hybrid = true, .physical_scaleup = 2};
  expect_units(scheme, 0, {{1, UnitKind::kRank, 0, -1}, {2, UnitKind::kRemoteRank, 2, 2}, {3, UnitKind::kRemoteRank, 3, 3}});
}

TEST(ReductionUnits, NodeUnitsOfOneNode) {
  std::array<UnitRef, kMaxTopk> units;
  const ReductionScheme multi{.expand = true, .multiple_reduction = true, .hybrid = false, .physical_scaleup = 2};
  // Node 1: rank 2 (master lane 2, its lanes 0 and 2 summed) and rank 3 (lane 3).
  ASSERT_EQ(node_unit_refs(kIds, 4, kGeo, multi, 1, units), 2);
  EXPECT_EQ(units[0].key, 2);
  EXPECT_EQ(units[0].kind, UnitKind::kRank);
  EXPECT_EQ(units[0].target, 2);
  EXPECT_EQ(units[1].key, 3);
  EXPECT_EQ(units[1].target, 3);
  const ReductionScheme lanes{.expand = true, .multiple_reduction = false, .hybrid = false, .physical_scaleup = 2};
  ASSERT_EQ(node_unit_refs(kIds, 4, kGeo, lanes, 1, units), 3);
  EXPECT_EQ(units[0].key, 0);
  EXPECT_EQ(units[1].key, 2);
  EXPECT_EQ(units[2].key, 3);
  EXPECT_EQ(units[2].kind, UnitKind::kLane);
}

TEST(ReductionUnits, UnselectedLanesAreSkipped) {
  const std::int64_t ids[3] = {-1, 3, -1};  // rank 1 only, lane 1
  std::array<UnitRef, kMaxTopk> units;
  const ReductionScheme scheme{.expand = false, .multiple_reduction = true, .hybrid = false, .physical_scaleup = 2};
  ASSERT_EQ(reduction_units(ids, 3, kGeo, scheme, 0, units), 1);
  EXPECT_EQ(units[0].key, 1);
  EXPECT_EQ(units[0].kind, UnitKind::kRank);
  EXPECT_EQ(units[0].target, 1);
}

}  // namespace
}  // namespace moe_ep::routing
