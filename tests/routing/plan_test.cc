// Routing arithmetic against brute-force enumeration of the receive order.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "routing/plan.hh"

namespace moe_ep::routing {
namespace {

std::vector<std::int64_t> random_topk(std::mt19937& rng, int n, int k, int num_experts, double mask) {
  std::vector<std::int64_t> ids(static_cast<size_t>(n * k));
  std::vector<std::int64_t> all(static_cast<size_t>(num_experts));
  for (int e = 0; e < num_experts; ++e) all[static_cast<size_t>(e)] = e;
  std::bernoulli_distribution masked(mask);
  for (int t = 0; t < n; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) ids[static_cast<size_t>(t * k + j)] = masked(rng) ? -1 : all[static_cast<size_t>(j)];
  }
  return ids;
}

TEST(Validate, NamesTheEntryValueAndLimit) {
  std::vector<std::int64_t> ids = {0, 1, 2, 3, 4, 64};
  TopkRows rows{ids.data(), 3, 2, 3};
  try {
    validate_topk("[rank 5] dispatch", rows, 64);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "[rank 5] dispatch: topk_idx[1, 2] = 64 is outside [-1, 64) (num_experts = 64)");
  }
  ids[5] = -2;
  EXPECT_THROW(validate_topk("c", rows, 64), InvalidArgument);
  ids[5] = 3;
  try {
    validate_topk("c", rows, 64);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx[1] names expert 3 twice (positions 0 and 2)"), std::string::npos);
  }
  ids[5] = -1;
  ids[4] = -1;
  validate_topk("c", rows, 64);  // repeated -1 is fine
}

TEST(Destinations, AscendingByHighestLane) {
  Geometry g{4, 16, 2};  // 4 experts per rank, 2 ranks per node
  const std::int64_t ids[] = {5, 0, 6, -1, 13, 1};
  std::array<Destination, kMaxTopk> d;
  ASSERT_EQ(token_ranks(ids, 6, g, d), 3);
  // rank 1: lanes 0, 2 -> master 2; rank 0: lanes 1, 5 -> master 5; rank 3: lane 4.
  EXPECT_EQ(d[0].target, 1);
  EXPECT_EQ(d[0].master_lane, 2);
  EXPECT_EQ(d[1].target, 3);
  EXPECT_EQ(d[1].master_lane, 4);
  EXPECT_EQ(d[2].target, 0);
  EXPECT_EQ(d[2].master_lane, 5);
  ASSERT_EQ(token_nodes(ids, 6, g, d), 2);
  EXPECT_EQ(d[0].target, 1);  // node 1 (rank 3): lane 4
  EXPECT_EQ(d[0].master_lane, 4);
  EXPECT_EQ(d[1].target, 0);
  EXPECT_EQ(d[1].master_lane, 5);
}

struct Case {
  int ranks, experts, nodes, k, tokens, alignment;
  double mask;
};

using Topk = std::vector<std::vector<std::int64_t>>;
using RowMap = std::map<std::tuple<int, int, int>, int>;

// Every source's counts into `layout`, then finished.
void build_layout(const Case& c, const Geometry& geo, const Topk& topk, const std::vector<int>& tokens, GlobalLayout& layout) {
  layout.reset(geo, c.alignment);
  for (int s = 0; s < c.ranks; ++s) {
    LocalCounts counts;
    count_local({topk[s].data(), c.k, tokens[s], c.k}, geo, counts);
    std::copy(counts.per_rank.begin(), counts.per_rank.end(), layout.per_rank_counts(s));
    std::copy(counts.per_expert.begin(), counts.per_expert.end(), layout.per_expert_counts(s));
    std::copy(counts.per_node.begin(), counts.per_node.end(), layout.per_node_counts(s));
  }
  layout.finish();
}

// Brute force: enumerate (source, token) in order for each destination and expert, asserting
// the layout's totals and starts; fills row_of (dst, src, token) and expanded_of (src, token, lane).
void brute_force_receive_order(const Case& c, const Geometry& geo, const Topk& topk, const std::vector<int>& tokens,
                               const GlobalLayout& layout, RowMap& row_of, RowMap& expanded_of) {
  const int El = geo.experts_per_rank();
  for (int d = 0; d < c.ranks; ++d) {
    int row = 0;
    std::vector<int> per_expert(static_cast<size_t>(El), 0);
    for (int s = 0; s < c.ranks; ++s)
      for (int t = 0; t < tokens[s]; ++t) {
        bool hit = false;
        for (int j = 0; j < c.k; ++j) {
          const auto e = topk[s][static_cast<size_t>(t * c.k + j)];
          if (e >= 0 && e / El == d) {
            hit = true;
            ++per_expert[static_cast<size_t>(e % El)];
          }
        }
        if (hit) row_of[{d, s, t}] = row++;
      }
    ASSERT_EQ(layout.rows_at(d), row);
    int start = 0;
    for (int i = 0; i < El; ++i) {
      ASSERT_EQ(layout.expert_total(d * El + i), per_expert[static_cast<size_t>(i)]);
      ASSERT_EQ(layout.expert_start(d * El + i), start);
      int next = start;
      for (int s = 0; s < c.ranks; ++s)
        for (int t = 0; t < tokens[s]; ++t)
          for (int j = 0; j < c.k; ++j)
            if (topk[s][static_cast<size_t>(t * c.k + j)] == d * El + i) expanded_of[{s, t, j}] = next++;
      start += (per_expert[static_cast<size_t>(i)] + c.alignment - 1) / c.alignment * c.alignment;
    }
    ASSERT_EQ(layout.expanded_rows_at(d), start);
  }
}

// The rows a RowAssigner gives source s's tokens: the brute-force rows at master lanes, -1 elsewhere.
void check_assigner(const Case& c, const Geometry& geo, const Topk& topk, const std::vector<int>& tokens,
                    const GlobalLayout& layout, int s, RowMap& row_of, RowMap& expanded_of) {
  const int El = geo.experts_per_rank();
  RowAssigner a;
  a.start(layout, s);
  for (int t = 0; t < tokens[s]; ++t) {
    std::int32_t rows[kMaxTopk], expanded[kMaxTopk];
    const std::int64_t* ids = &topk[s][static_cast<size_t>(t * c.k)];
    a.next(ids, c.k, [](int) { return true; }, rows, expanded);
    std::set<int> seen;
    for (int j = c.k - 1; j >= 0; --j) {
      if (ids[j] < 0) {
        EXPECT_EQ(rows[j], -1);
        EXPECT_EQ(expanded[j], -1);
        continue;
      }
      const int d = static_cast<int>(ids[j] / El);
      EXPECT_EQ(expanded[j], (expanded_of[{s, t, j}]));
      if (seen.insert(d).second) {
        EXPECT_EQ(rows[j], (row_of[{d, s, t}])) << "master lane " << j;
      } else {
        EXPECT_EQ(rows[j], -1);
      }
    }
  }
}

// A filtered walk (as a receiver does) assigns the same rows for its own rank.
void check_filtered_assigner(const Case& c, const Topk& topk, const std::vector<int>& tokens, const GlobalLayout& layout,
                             int s, RowMap& row_of) {
  RowAssigner mine;
  mine.start(layout, s);
  for (int t = 0; t < tokens[s]; ++t) {
    std::int32_t rows[kMaxTopk], expanded[kMaxTopk];
    const std::int64_t* ids = &topk[s][static_cast<size_t>(t * c.k)];
    mine.next(ids, c.k, [&](int r) { return r == c.ranks - 1; }, rows, expanded);
    for (int j = 0; j < c.k; ++j) {
      if (rows[j] >= 0) {
        EXPECT_EQ(rows[j], (row_of[{c.ranks - 1, s, t}]));
      }
    }
  }
}

TEST(Layout, RowAssignerMatchesBruteForceReceiveOrder) {
  std::mt19937 rng(3);
  const Case cases[] = {{1, 4, 1, 2, 9, 1, 0.0}, {4, 8, 2, 3, 17, 1, 0.2}, {8, 64, 2, 8, 33, 128, 0.1},
                        {8, 8, 4, 8, 20, 4, 0.3}, {3, 96, 1, 5, 0, 2, 0.0},  {6, 12, 3, 1, 25, 3, 0.5}};
  for (const Case& c : cases) {
    Geometry geo{c.ranks, c.experts, c.nodes};
    Topk topk;
    std::vector<int> tokens;
    for (int s = 0; s < c.ranks; ++s) {
      tokens.push_back(s % 3 == 2 ? 0 : c.tokens - s);  // some ranks have no tokens
      topk.push_back(random_topk(rng, std::max(tokens.back(), 0), c.k, c.experts, c.mask));
    }
    GlobalLayout layout;
    build_layout(c, geo, topk, tokens, layout);
    RowMap row_of, expanded_of;
    brute_force_receive_order(c, geo, topk, tokens, layout, row_of, expanded_of);
    if (::testing::Test::HasFatalFailure()) return;  // a failed ASSERT there ends the test, as it would inline
    for (int s = 0; s < c.ranks; ++s) {
      check_assigner(c, geo, topk, tokens, layout, s, row_of, expanded_of);
      check_filtered_assigner(c, topk, tokens, layout, s, row_of);
    }
  }
}

}  // namespace
}  // namespace moe_ep::routing
