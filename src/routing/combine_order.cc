#include "routing/combine_order.hh"

#include <algorithm>

#include "moe_ep/limits.hpp"

namespace moe_ep::routing {

int node_unit_refs(const std::int64_t* ids, int k, const Geometry& geometry, const ReductionScheme& scheme, int node,
                   std::array<UnitRef, kMaxTopk>& out) {
  int n = 0;
  if (scheme.expand && !scheme.multiple_reduction) {
    for (int j = 0; j < k; ++j)
      if (ids[j] >= 0 && scheme.physical_node_of(geometry.rank_of_expert(ids[j])) == node)
        out[static_cast<size_t>(n++)] = {j, UnitKind::kLane, j};
    return n;
  }
  std::array<Destination, kMaxTopk> dests;
  const int nd = token_ranks(ids, k, geometry, dests);
  for (int i = 0; i < nd; ++i) {
    const Destination& d = dests[static_cast<size_t>(i)];
    if (scheme.physical_node_of(d.target) == node) out[static_cast<size_t>(n++)] = {d.master_lane, UnitKind::kRank, d.target};
  }
  return n;
}

int reduction_units(const std::int64_t* ids, int k, const Geometry& geometry, const ReductionScheme& scheme, int rank,
                    std::array<UnitRef, kMaxTopk>& out) {
  const int my_node = scheme.physical_node_of(rank);
  std::array<Destination, kMaxTopk> dests;
  if (scheme.hybrid && scheme.multiple_reduction) {
    // One unit per routing node, keyed by the node's master lane (token_nodes: ascending).
    const int nn = token_nodes(ids, k, geometry, dests);
    int n = 0;
    for (int i = 0; i < nn; ++i) {
      const Destination& d = dests[static_cast<size_t>(i)];
      if (d.target != my_node) {
        out[static_cast<size_t>(n++)] = {d.master_lane, UnitKind::kRemoteNode, d.target, d.target};
      } else if (!scheme.own_node_rank_terms) {
        out[static_cast<size_t>(n++)] = {d.master_lane, UnitKind::kNode, d.target};
      } else {
        std::array<UnitRef, kMaxTopk> ranks;
        const int nr = node_unit_refs(ids, k, geometry, scheme, my_node, ranks);
        for (int r = 0; r < nr; ++r) out[static_cast<size_t>(n++)] = ranks[static_cast<size_t>(r)];
      }
    }
    // The own node's rank units may interleave with other nodes' keys.
    std::sort(out.begin(), out.begin() + n, [](const UnitRef& a, const UnitRef& b) { return a.key < b.key; });
    return n;
  }
  int n = node_unit_refs(ids, k, geometry, scheme, my_node, out);
  if (scheme.expand && !scheme.multiple_reduction) {
    for (int j = 0; j < k; ++j)
      if (ids[j] >= 0 && scheme.physical_node_of(geometry.rank_of_expert(ids[j])) != my_node)
        out[static_cast<size_t>(n++)] = {j, UnitKind::kRemoteLane, j, j};
  } else {
    const int nd = token_ranks(ids, k, geometry, dests);
    for (int i = 0; i < nd; ++i) {
      const Destination& d = dests[static_cast<size_t>(i)];
      if (scheme.physical_node_of(d.target) != my_node)
        out[static_cast<size_t>(n++)] = {d.master_lane, UnitKind::kRemoteRank, d.target, d.master_lane};
    }
  }
  std::sort(out.begin(), out.begin() + n, [](const UnitRef& a, const UnitRef& b) { return a.key < b.key; });
  return n;
}

std::vector<int> contribution_senders(const GlobalLayout& layout, const PlanningRank& me) {
  const Geometry& geo = layout.geometry();
  std::vector<int> senders;
  if (me.hybrid) {
    const int my_node = geo.node_of_rank(me.rank);
    for (int node = 0; node < geo.num_nodes; ++node)
      if (node != my_node && layout.node_count(me.rank, node) != 0) senders.push_back(forwarder_on(geo, me.rank, node));
  } else {
    for (int d = 0; d < geo.num_ranks; ++d)
      if (!me.same_node(d) && layout.count(me.rank, d) != 0) senders.push_back(d);
  }
  return senders;
}

}  // namespace moe_ep::routing
