// The routing plan of a dispatch (routing/handle_plan.hh) on a small hand-worked layout: every
// expected row below is derived by hand from the receive order (sources ascending, tokens
// ascending) and the contiguous expert ownership, not taken from the code's output.
//
// Layout: 4 ranks, 8 experts (rank r owns experts 2r and 2r+1), k = 2, two routing nodes
// {0, 1} and {2, 3}, physical nodes of 2 ranks.
//   rank 0: t0 = [1, 4] (ranks 0, 2), t1 = [3, 2] (rank 1, master lane 1), t2 = [-1, 7] (rank 3)
//   rank 1: t0 = [0, 6] (ranks 0, 3)
//   rank 2: t0 = [5, 2] (ranks 2, 1)
//   rank 3: no tokens
// Rows per destination (receive order):
//   rank 0: s0.t0, s1.t0     rank 1: s0.t1, s2.t0     rank 2: s0.t0, s2.t0     rank 3: s0.t2, s1.t0
// Expert blocks (alignment 1): expert 1 at rank 0 starts at 1 (expert 0 holds s1.t0); expert 2
// at rank 1 holds s0.t1, s2.t0 (rows 0, 1), expert 3 starts at 2; expert 4 at rank 2 starts at
// 0, expert 5 at 1; expert 6 at rank 3 starts at 0, expert 7 at 1.
#include <gtest/gtest.h>

#include <vector>

#include "moe_ep/error.hpp"
#include "routing/combine_order.hh"
#include "routing/handle_plan.hh"

namespace moe_ep::routing {
namespace {

constexpr int kRanks = 4, kExperts = 8, kTopk = 2;

const std::vector<std::vector<std::int64_t>> kTokens = {
    {1, 4, 3, 2, -1, 7},  // rank 0
    {0, 6},               // rank 1
    {5, 2},               // rank 2
    {},                   // rank 3
};

TopkRows rows_of(int rank) {
  const auto& ids = kTokens[static_cast<size_t>(rank)];
  return {ids.data(), kTopk, static_cast<int>(ids.size()) / kTopk, kTopk};
}

RoutingPlan plan_with_layout(int alignment = 1) {
  const Geometry geo{kRanks, kExperts, 2};
  RoutingPlan plan;
  plan.layout.reset(geo, alignment);
  for (int s = 0; s < kRanks; ++s) {
    LocalCounts counts;
    count_local(rows_of(s), geo, counts);
    std::copy(counts.per_rank.begin(), counts.per_rank.end(), plan.layout.per_rank_counts(s));
    std::copy(counts.per_expert.begin(), counts.per_expert.end(), plan.layout.per_expert_counts(s));
    std::copy(counts.per_node.begin(), counts.per_node.end(), plan.layout.per_node_counts(s));
  }
  plan.layout.finish();
  return plan;
}

// Rank `rank`'s tokens grouped by destination (list_by_destination over its own counts).
std::vector<ListedToken> listed_of(int rank) {
  const Geometry geo{kRanks, kExperts, 2};
  LocalCounts counts;
  TokenRanks ranks;
  count_local(rows_of(rank), geo, counts, &ranks);
  std::int32_t total = 0;
  for (const std::int32_t c : counts.per_rank) total += c;
  std::vector<ListedToken> listed(static_cast<size_t>(total));
  list_by_destination(ranks, counts.per_rank, listed);
  return listed;
}

PlanningRank planner(int rank, bool hybrid, bool expand = true) {
  return {.rank = rank, .physical_scaleup = 2, .hybrid = hybrid, .expand = expand};
}

using Ints = std::vector<std::int32_t>;

TEST(ListByDestination, TokensGroupedByRankWithTheirMasterLanes) {
  const std::vector<ListedToken> listed = listed_of(0);
  // Rank 0: t0 (lane 0); rank 1: t1 (lane 1, expert 2); rank 2: t0 (lane 1); rank 3: t2 (lane 1).
  const std::vector<std::pair<int, int>> expected = {{0, 0}, {1, 1}, {0, 1}, {2, 1}};
  ASSERT_EQ(listed.size(), expected.size());
  for (std::size_t i = 0; i < listed.size(); ++i) {
    EXPECT_EQ(listed[i].token, expected[i].first) << i;
    EXPECT_EQ(listed[i].master_lane, expected[i].second) << i;
  }
  EXPECT_TRUE(listed_of(3).empty());
}

TEST(ListByDestination, RefusesAnOutputOfAnotherSize) {
  const Geometry geo{kRanks, kExperts, 2};
  LocalCounts counts;
  TokenRanks ranks;
  count_local(rows_of(0), geo, counts, &ranks);
  std::vector<ListedToken> listed(3);
  EXPECT_THROW(list_by_destination(ranks, counts.per_rank, listed), StateError);
}

TEST(PlanSources, RowsAndExpandedRowsOfEachLane) {
  RoutingPlan plan = plan_with_layout();
  plan_sources(plan, rows_of(0), planner(0, false), listed_of(0));
  // t0: row 0 at rank 0 and at rank 2; t1: only lane 1 (rank 1's master lane), row 0; t2: row 0 at rank 3.
  EXPECT_EQ(plan.dst_row, (Ints{0, 0, -1, 0, -1, 0}));
  // Expanded: expert 1 row 1, expert 4 row 0; expert 3 row 2, expert 2 row 0; -, expert 7 row 1.
  EXPECT_EQ(plan.dst_expanded, (Ints{1, 0, 2, 0, -1, 1}));
  EXPECT_TRUE(plan.node_slot.empty());  // direct mode: no forwarder slots
}

TEST(PlanSources, SecondSourceStartsAfterTheFirstAtEachDestination) {
  RoutingPlan plan = plan_with_layout();
  plan_sources(plan, rows_of(2), planner(2, false), listed_of(2));
  // s2.t0 is the second row at rank 2 (after s0.t0) and at rank 1 (after s0.t1).
  EXPECT_EQ(plan.dst_row, (Ints{1, 1}));
  // Expert 5's block at rank 2 starts at 1; expert 2 holds s0.t1 first.
  EXPECT_EQ(plan.dst_expanded, (Ints{1, 1}));
}

TEST(PlanSources, AListOfAnotherSizeIsAStateError) {
  RoutingPlan plan = plan_with_layout();
  std::vector<ListedToken> listed = listed_of(0);
  listed.pop_back();
  EXPECT_THROW(plan_sources(plan, rows_of(0), planner(0, false), listed), StateError);
}

TEST(PlanSources, HybridForwarderSlotsPerNodeAtTheNodeMasterLane) {
  RoutingPlan plan = plan_with_layout();
  plan_sources(plan, rows_of(0), planner(0, true), listed_of(0));
  // Node 0 gets t0 (lane 0) then t1 (lane 1); node 1 gets t0 (lane 1) then t2 (lane 1).
  EXPECT_EQ(plan.node_slot, (Ints{0, 0, -1, 1, -1, 1}));
}

TEST(ReceivePlan, LocalThenRemoteSourcesInReceiveOrder) {
  RoutingPlan plan = plan_with_layout();
  const PlanningRank me = planner(1, false);
  start_receive_plan(plan, kTopk, me);
  ASSERT_EQ(plan.rows.size(), 2u);
  const std::vector<ListedToken> listed0 = listed_of(0), listed1 = listed_of(1);
  std::vector<LocalSource> sources(kRanks);
  sources[0] = {rows_of(0), listed0.data()};
  sources[1] = {rows_of(1), listed1.data()};
  plan_receive_local(plan, me, sources);
  // Row 0: rank 0's token 1, master lane 1, local ids [3 - 2, 2 - 2], expanded [2, 0].
  EXPECT_EQ(plan.rows[0].source, 0);
  EXPECT_EQ(plan.rows[0].index, 1);
  EXPECT_EQ(plan.row_token[0], 1);
  EXPECT_EQ(plan.master_lane[0], 1);
  // Rank 2 is on the other physical node: one record (slot 0) holding its token 0.
  EXPECT_EQ(remote_records(plan.layout, me, 0), 0);  // same node
  EXPECT_EQ(remote_records(plan.layout, me, 2), 1);
  EXPECT_EQ(remote_records(plan.layout, me, 3), 0);  // no rows here
  const std::vector<std::int64_t> record_ids = {5, 2};
  const std::vector<std::int32_t> record_tokens = {0};
  receive_source(plan, me, 2, {record_ids.data(), kTopk, 1, kTopk}, record_tokens.data());
  EXPECT_EQ(plan.rows[1].source, 2);
  EXPECT_EQ(plan.rows[1].index, 0);
  EXPECT_EQ(plan.row_token[1], 0);
  EXPECT_EQ(plan.master_lane[1], 1);
  EXPECT_EQ(plan.local_ids, (Ints{1, 0, -1, 0}));
  // s2.t0's lane 1 (expert 2) is expert 2's second row; lane 0 is not at rank 1.
  EXPECT_EQ(plan.expanded_rows, (Ints{2, 0, -1, 1}));
}

TEST(ReceivePlan, AListedTokenOutsideTheSourceIsAStateError) {
  RoutingPlan plan = plan_with_layout();
  const PlanningRank me = planner(1, false);
  start_receive_plan(plan, kTopk, me);
  std::vector<ListedToken> listed0 = listed_of(0);
  listed0[1] = {3, 1};  // rank 0 has 3 tokens
  std::vector<LocalSource> sources(kRanks);
  sources[0] = {rows_of(0), listed0.data()};
  EXPECT_THROW(plan_receive_local(plan, me, sources), StateError);
  listed0[1] = {1, kTopk};  // lane past top-k
  EXPECT_THROW(plan_receive_local(plan, me, sources), StateError);
  sources[0].listed = nullptr;  // rows here, but no list
  EXPECT_THROW(plan_receive_local(plan, me, sources), StateError);
}

TEST(ReceivePlan, HybridRemoteRecordsCountTokensForTheRoutingNode) {
  RoutingPlan plan = plan_with_layout();
  // At rank 1 (routing node 0): rank 2 sends one token to node 0.
  EXPECT_EQ(remote_records(plan.layout, planner(1, true), 2), 1);
  // At rank 3 (node 1): rank 0 sends t0 (rank 2) and t2 (rank 3) to node 1, rank 1 sends t0 (rank 3).
  EXPECT_EQ(remote_records(plan.layout, planner(3, true), 0), 2);
  EXPECT_EQ(remote_records(plan.layout, planner(3, true), 1), 1);
}

TEST(ReceivePlan, RecordSendersDirectAndHybrid) {
  RoutingPlan plan = plan_with_layout();
  // Direct: ranks of the other physical node with rows here.
  EXPECT_EQ(record_senders(plan.layout, planner(1, false)), (std::vector<int>{2}));
  EXPECT_EQ(record_senders(plan.layout, planner(3, false)), (std::vector<int>{0, 1}));
  // Hybrid: the rank with this scale-up index on the other node, if it forwards tokens to this node.
  EXPECT_EQ(record_senders(plan.layout, planner(0, true)), (std::vector<int>{2}));  // rank 2 -> node 0
  EXPECT_EQ(record_senders(plan.layout, planner(1, true)), (std::vector<int>{}));   // rank 3 has no tokens
  EXPECT_EQ(record_senders(plan.layout, planner(2, true)), (std::vector<int>{0}));  // rank 0 -> node 1
  EXPECT_EQ(record_senders(plan.layout, planner(3, true)), (std::vector<int>{1}));  // rank 1 -> node 1
}

TEST(Forwarding, RowsOfForwardedTokensAtThisNodesRanks) {
  RoutingPlan plan = plan_with_layout();
  // Rank 0 forwards for node 0 what rank 2 (same scale-up index, node 1) sends to node 0: s2.t0.
  start_forwarding(plan.forward, plan.layout, 0, kTopk);
  ASSERT_EQ(plan.forward.size(), 2u);
  EXPECT_EQ(plan.forward[0].source, -1);  // own node
  ASSERT_EQ(plan.forward[1].source, 2);
  ASSERT_EQ(plan.forward[1].count, 1);
  plan.forward[1].ids = {5, 2};
  plan.forward[1].token = {0};
  plan_forwarding(plan.forward, plan.layout, 0, kTopk);
  // Lane 0 (expert 5, rank 2) is not on node 0; lane 1 (expert 2) is rank 1's row 1, expanded row 1.
  EXPECT_EQ(plan.forward[1].rows, (Ints{-1, 1}));
  EXPECT_EQ(plan.forward[1].expanded, (Ints{-1, 1}));
}

TEST(HandleCounts, PrefixSumsPerScaleupRankAndExpert) {
  // Alignment 4: rank 1's experts 2 and 3 hold 2 and 1 rows, 4 each when aligned.
  RoutingPlan plan = plan_with_layout(4);
  const ReceiveCounts compact = receive_counts(plan.layout, 1, 2, false);
  // Sources 0 and 2 (scale-up index 0) send one token each, sources 1 and 3 none: [2, 2] inclusive.
  EXPECT_EQ(compact.psum_per_scaleup_rank.data_as<std::int32_t>()[0], 2);
  EXPECT_EQ(compact.psum_per_scaleup_rank.data_as<std::int32_t>()[1], 2);
  EXPECT_EQ(compact.unaligned_per_expert.data_as<std::int32_t>()[0], 2);
  EXPECT_EQ(compact.unaligned_per_expert.data_as<std::int32_t>()[1], 1);
  EXPECT_EQ(compact.psum_per_expert.data_as<std::int32_t>()[0], 4);
  EXPECT_EQ(compact.psum_per_expert.data_as<std::int32_t>()[1], 8);
  EXPECT_EQ(compact.aligned_per_expert, (std::vector<int>{4, 4}));
  // Expanded: the end of each expert's real rows (start 0 + 2, start 4 + 1).
  const ReceiveCounts expanded = receive_counts(plan.layout, 1, 2, true);
  EXPECT_EQ(expanded.psum_per_expert.data_as<std::int32_t>()[0], 2);
  EXPECT_EQ(expanded.psum_per_expert.data_as<std::int32_t>()[1], 5);
}

TEST(HandleCounts, BufferSlotsAreRowsWithinTheSourceBlock) {
  RoutingPlan plan = plan_with_layout();
  plan_sources(plan, rows_of(2), planner(2, false), listed_of(2));
  // Rank 2's only token is the first of its block at ranks 2 and 1: slot 2 * T + 0 at both lanes.
  const Tensor slots = buffer_slots(plan.layout, 2, 3, rows_of(2), plan.dst_row);
  EXPECT_EQ(slots.data_as<std::int32_t>()[0], 6);
  EXPECT_EQ(slots.data_as<std::int32_t>()[1], 6);
  plan_sources(plan, rows_of(0), planner(0, false), listed_of(0));
  const Tensor first = buffer_slots(plan.layout, 0, 3, rows_of(0), plan.dst_row);
  const Ints expected = {0, 0, -1, 0, -1, 0};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(first.data_as<std::int32_t>()[i], expected[static_cast<size_t>(i)]) << i;
}

TEST(CombineSenders, DestinationsOrForwardersThatReturnRows) {
  RoutingPlan plan = plan_with_layout();
  // Direct: rank 0 sent tokens to ranks 2 and 3 on the other physical node.
  EXPECT_EQ(contribution_senders(plan.layout, planner(0, false)), (std::vector<int>{2, 3}));
  // Hybrid: rank 0's tokens for node 1 come back through its forwarder there, rank 2.
  EXPECT_EQ(contribution_senders(plan.layout, planner(0, true)), (std::vector<int>{2}));
  EXPECT_EQ(contribution_senders(plan.layout, planner(2, true)), (std::vector<int>{0}));
  EXPECT_EQ(contribution_senders(plan.layout, planner(3, true)), (std::vector<int>{}));  // no tokens
}

}  // namespace
}  // namespace moe_ep::routing
