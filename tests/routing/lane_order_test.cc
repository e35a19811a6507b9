// HybridEP's lane order (routing/lane_order.hh): a hand-worked token, and random tokens against a
// reference that walks HybridEP's order directly (the source's node, then node - 1, node - 2, ...
// wrapping; inside a node every expert id ascending; then the unused lanes in their order).
#include <gtest/gtest.h>

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

TEST(LaneOrder, RandomTokensMatchTheWalkedOrder) {
  std::mt19937 rng(7);
  for (const auto& [R, E, nodes] : std::vector<std::array<int, 3>>{{2, 8, 1}, {4, 16, 2}, {8, 64, 4}, {6, 24, 3}}) {
    const Geometry geo{R, E, nodes};
    for (int source = 0; source < R; ++source) {
      const int T = 20, k = 6;
      std::vector<std::int64_t> ids(T * k);
      std::vector<float> w(T * k);
      for (int t = 0; t < T; ++t) {
        std::vector<std::int64_t> pool(E);
        for (int e = 0; e < E; ++e) pool[e] = e;
        std::shuffle(pool.begin(), pool.end(), rng);
        for (int j = 0; j < k; ++j) {
          ids[t * k + j] = rng() % 4 == 0 ? -1 : pool[j];
          w[t * k + j] = static_cast<float>(t * k + j);
        }
      }
      const std::vector<std::int64_t> before = ids;
      std::vector<std::int32_t> old(T * k);
      order_lanes_hybrid_ep(ids.data(), w.data(), old.data(), T, k, geo, source);
      for (int t = 0; t < T; ++t) {
        const std::vector<int> lanes = reference_order(&before[t * k], k, R, E, nodes, source);
        ASSERT_EQ(static_cast<int>(lanes.size()), k);
        for (int j = 0; j < k; ++j) {
          EXPECT_EQ(ids[t * k + j], before[t * k + lanes[j]]) << "R " << R << " source " << source << " token " << t;
          EXPECT_EQ(w[t * k + j], static_cast<float>(t * k + lanes[j]));
          EXPECT_EQ(old[t * k + j], lanes[j]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe_ep::routing
