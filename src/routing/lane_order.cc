#include "routing/lane_order.hh"

#include <algorithm>
#include <array>
#include <numeric>

namespace moe_ep::routing {

void order_lanes_hybrid_ep(std::int64_t* ids, float* weights, std::int32_t* old_lane, int num_tokens, int k,
                           const Geometry& geometry, int source_rank) {
  const int nodes = geometry.num_nodes, source_node = geometry.node_of_rank(source_rank);
  const std::int64_t unused = std::int64_t{nodes} * geometry.num_experts;  // after every valid key
  std::array<std::int64_t, kMaxTopk> key, id;
  std::array<float, kMaxTopk> w;
  std::array<int, kMaxTopk> order;
  for (int t = 0; t < num_tokens; ++t) {
    std::int64_t* row = ids + static_cast<std::int64_t>(t) * k;
    float* wrow = weights ? weights + static_cast<std::int64_t>(t) * k : nullptr;
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = row[j];
      const int node = e < 0 ? 0 : geometry.node_of_rank(geometry.rank_of_expert(e));
      key[static_cast<size_t>(j)] = e < 0 ? unused : std::int64_t{(source_node - node + nodes) % nodes} * geometry.num_experts + e;
      id[static_cast<size_t>(j)] = e;
      if (wrow) w[static_cast<size_t>(j)] = wrow[j];
    }
    std::iota(order.begin(), order.begin() + k, 0);
    std::stable_sort(order.begin(), order.begin() + k,
                     [&](int a, int b) { return key[static_cast<size_t>(a)] < key[static_cast<size_t>(b)]; });
    for (int j = 0; j < k; ++j) {
      const int from = order[static_cast<size_t>(j)];
      row[j] = id[static_cast<size_t>(from)];
      if (wrow) wrow[j] = w[static_cast<size_t>(from)];
      if (old_lane) old_lane[static_cast<std::int64_t>(t) * k + j] = from;
    }
  }
}

}  // namespace moe_ep::routing
