// The expanded layout with a fixed expert stride (GlobalLayout::reset's expert_stride), against
// rows worked out by hand.
#include <gtest/gtest.h>

#include <vector>

#include "routing/handle_plan.hh"
#include "routing/plan.hh"

namespace moe_ep::routing {
namespace {

// 2 ranks, 4 experts (rank 0: experts 0 and 1, rank 1: experts 2 and 3), one node, k = 2.
//   source 0: t0 = {0, 1}, t1 = {1, 3}, t2 = {2, -1}
//   source 1: t0 = {1, 2}, t1 = {0, 3}
// Per expert, (source, token) order: e0: (0,t0) (1,t1); e1: (0,t0) (0,t1) (1,t0);
// e2: (0,t2) (1,t0); e3: (0,t1) (1,t1).
const std::vector<std::vector<std::int64_t>> kTopkIds = {{0, 1, 1, 3, 2, -1}, {1, 2, 0, 3}};

GlobalLayout layout_with_stride(int alignment, int stride) {
  const Geometry geo{2, 4, 1};
  GlobalLayout layout;
  layout.reset(geo, alignment, stride);
  for (int s = 0; s < 2; ++s) {
    const auto& ids = kTopkIds[static_cast<size_t>(s)];
    LocalCounts counts;
    count_local({ids.data(), 2, static_cast<int>(ids.size() / 2), 2}, geo, counts);
    std::copy(counts.per_rank.begin(), counts.per_rank.end(), layout.per_rank_counts(s));
    std::copy(counts.per_expert.begin(), counts.per_expert.end(), layout.per_expert_counts(s));
    std::copy(counts.per_node.begin(), counts.per_node.end(), layout.per_node_counts(s));
  }
  layout.finish();
  return layout;
}

// Expanded rows of every (token, lane) of source s, in order (-1 for id -1).
std::vector<std::int32_t> expanded_rows(const GlobalLayout& layout, int s) {
  const auto& ids = kTopkIds[static_cast<size_t>(s)];
  RowAssigner assigner;
  assigner.start(layout, s);
  std::vector<std::int32_t> out;
  for (std::size_t t = 0; t < ids.size() / 2; ++t) {
    std::int32_t rows[2], expanded[2];
    assigner.next(&ids[t * 2], 2, [](int) { return true; }, rows, expanded);
    out.insert(out.end(), expanded, expanded + 2);
  }
  return out;
}

TEST(ExpertStride, GroupsStartAtMultiplesOfTheStride) {
  const GlobalLayout layout = layout_with_stride(1, 6);
  EXPECT_EQ(layout.expert_stride(), 6);
  EXPECT_EQ(layout.expert_over_stride(), -1);
  // Local expert i starts at row 6 i on its rank, whatever the counts; 2 x 6 rows per rank.
  EXPECT_EQ(layout.expert_start(0), 0);
  EXPECT_EQ(layout.expert_start(1), 6);
  EXPECT_EQ(layout.expert_start(2), 0);
  EXPECT_EQ(layout.expert_start(3), 6);
  EXPECT_EQ(layout.expanded_rows_at(0), 12);
  EXPECT_EQ(layout.expanded_rows_at(1), 12);
  // Within a group: source 0's pairs, then source 1's.
  EXPECT_EQ(expanded_rows(layout, 0), (std::vector<std::int32_t>{0, 6, 7, 6, 0, -1}));
  EXPECT_EQ(expanded_rows(layout, 1), (std::vector<std::int32_t>{8, 1, 1, 7}));

  const ReceiveCounts r0 = receive_counts(layout, 0, 1, true);
  EXPECT_EQ(r0.unaligned_per_expert.data_as<std::int32_t>()[0], 2);
  EXPECT_EQ(r0.unaligned_per_expert.data_as<std::int32_t>()[1], 3);
  EXPECT_EQ(r0.psum_per_expert.data_as<std::int32_t>()[0], 2);  // start 0 + 2 rows
  EXPECT_EQ(r0.psum_per_expert.data_as<std::int32_t>()[1], 9);  // start 6 + 3 rows
  const ReceiveCounts r1 = receive_counts(layout, 1, 1, true);
  EXPECT_EQ(r1.psum_per_expert.data_as<std::int32_t>()[0], 2);
  EXPECT_EQ(r1.psum_per_expert.data_as<std::int32_t>()[1], 8);
}

TEST(ExpertStride, WithoutAStrideGroupsArePackedAtTheAlignment) {
  const GlobalLayout layout = layout_with_stride(4, 0);
  EXPECT_EQ(layout.expert_over_stride(), -1);
  EXPECT_EQ(layout.expert_start(1), 4);  // expert 0's 2 rows padded to 4
  EXPECT_EQ(layout.expanded_rows_at(0), 8);
  EXPECT_EQ(expanded_rows(layout, 0), (std::vector<std::int32_t>{0, 4, 5, 4, 0, -1}));
}

TEST(ExpertStride, NamesTheFirstExpertOverTheStride) {
  EXPECT_EQ(layout_with_stride(1, 2).expert_over_stride(), 1);  // expert 1 receives 3 rows
  EXPECT_EQ(layout_with_stride(1, 3).expert_over_stride(), -1);
}

}  // namespace
}  // namespace moe_ep::routing
