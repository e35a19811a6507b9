// HybridEP's lane order (routing/lane_order.hh): a hand-worked token, and random tokens against a
// reference that walks HybridEP's order directly (the source's node, then node - 1, node - 2, ...
// wrapping; inside a node every expert id ascending; then the unused lanes in their order).
// HybridEPBuffer computes the same order in torch; tests/python/test_hybrid_ep_lane_order.py checks
// it against the same walk, over the same kinds of cases and the same hand-worked token.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "routing/lane_order.hh"

namespace moe_ep::routing {
namespace {

TEST(LaneOrder, HandWorkedToken) {
  // 4 ranks of 2 experts on 2 nodes {0, 1}, {2, 3}; a token of rank 2 (node 1).
  const Geometry geo{4, 8, 2};
  std::vector<std::int64_t> ids = {1, -1, 5, 4, 0, 6};
  std::vector<float> w = {0.1f, 0.0f, 0.5f, 0.4f, 0.0625f, 0.6f};
  std::vector<std::int32_t> old(6);
  order_lanes_hybrid_ep(ids.data(), w.data(), old.data(), 1, 6, geo, 2);
  EXPECT_EQ(ids, (std::vector<std::int64_t>{4, 5, 6, 0, 1, -1}));
  EXPECT_EQ(w, (std::vector<float>{0.4f, 0.5f, 0.6f, 0.0625f, 0.1f, 0.0f}));
  EXPECT_EQ(old, (std::vector<std::int32_t>{3, 2, 5, 4, 0, 1}));
}

// The expected lanes of one token, walked in HybridEP's order.
std::vector<int> reference_order(const std::int64_t* row, int k, int R, int E, int nodes, int source) {
  const int L = R / nodes, El = E / R, source_node = source / L;
  std::vector<int> lanes;
  for (int step = 0; step < nodes; ++step) {
    const int node = ((source_node - step) % nodes + nodes) % nodes;
    for (int e = node * L * El; e < (node + 1) * L * El; ++e)
      for (int j = 0; j < k; ++j)
        if (row[j] == e) lanes.push_back(j);
  }
  for (int j = 0; j < k; ++j)
    if (row[j] < 0) lanes.push_back(j);
  return lanes;
}

// One token of k lanes: `count` distinct experts at random lanes, -1 (padding) at the others.
std::vector<std::int64_t> random_token(std::mt19937& rng, int E, int k, int count) {
  std::vector<std::int64_t> pool(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) pool[static_cast<size_t>(e)] = e;
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<std::int64_t> row(static_cast<size_t>(k), -1);
  for (int j = 0; j < count; ++j) row[static_cast<size_t>(j)] = pool[static_cast<size_t>(j)];
  std::shuffle(row.begin(), row.end(), rng);
  return row;
}

// Random tokens of every source rank over domains of 1 to 4 ranks, 1 to 4 domains, 1 to 8
// experts a rank, k from 1 to kMaxTopk, with 0 to min(k, E) routed lanes a token (the rest padding).
TEST(LaneOrder, RandomTokensMatchTheWalkedOrder) {
  std::mt19937 rng(7);
  struct Shape {
    int ranks_per_node, nodes, experts_per_rank;
  };
  const std::vector<Shape> shapes = {{1, 1, 4}, {2, 1, 4}, {1, 2, 2}, {2, 2, 2}, {4, 2, 8}, {2, 3, 4},
                                     {3, 2, 4}, {1, 4, 1}, {4, 4, 2}, {3, 3, 3}};
  for (const Shape& s : shapes)
    for (int k : {1, 6, 9, kMaxTopk}) {
      const int R = s.ranks_per_node * s.nodes, E = R * s.experts_per_rank, T = 20;
      const Geometry geo{R, E, s.nodes};
      for (int source = 0; source < R; ++source) {
        std::vector<std::int64_t> ids;
        std::vector<float> w(static_cast<size_t>(T * k));
        for (int t = 0; t < T; ++t) {
          const int most = std::min(k, E), count = t == 0 ? 0 : t == 1 ? most : static_cast<int>(rng() % (most + 1));
          const std::vector<std::int64_t> row = random_token(rng, E, k, count);
          ids.insert(ids.end(), row.begin(), row.end());
        }
        for (int i = 0; i < T * k; ++i) w[static_cast<size_t>(i)] = static_cast<float>(i);
        const std::vector<std::int64_t> before = ids;
        std::vector<std::int32_t> old(static_cast<size_t>(T * k));
        order_lanes_hybrid_ep(ids.data(), w.data(), old.data(), T, k, geo, source);
        for (int t = 0; t < T; ++t) {
          const std::vector<int> lanes = reference_order(&before[static_cast<size_t>(t * k)], k, R, E, s.nodes, source);
          ASSERT_EQ(static_cast<int>(lanes.size()), k);
          for (int j = 0; j < k; ++j) {
            const int lane = lanes[static_cast<size_t>(j)];
            const size_t at = static_cast<size_t>(t * k + j), from = static_cast<size_t>(t * k + lane);
            EXPECT_EQ(ids[at], before[from]) << "R " << R << " nodes " << s.nodes << " k " << k << " source " << source
                                             << " token " << t << " lane " << j;
            EXPECT_EQ(w[at], static_cast<float>(from));
            EXPECT_EQ(old[at], lane);
          }
        }
      }
    }
}

}  // namespace
}  // namespace moe_ep::routing
