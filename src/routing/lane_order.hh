// HybridEP's reduction order as a lane order (docs/hybrid-ep.md, "Reduction order").
//
// moe-ep's combine sums a token's units in ascending master-lane order (docs/semantics.md §4).
// HybridEP sums the ranks of the source's own node first (ascending), then every other node in
// the order source node - 1, source node - 2, ... (wrapping), and inside a rank its local experts
// ascending. Reordering each token's top-k lanes by (node key, expert id), node key = (source node
// - expert's node) mod nodes, with unused lanes (-1) last, makes the first order the second: a
// rank's lanes, and a node's ranks, become contiguous and ascending, so master lanes ascend in
// HybridEP's order. Pure; the reorder is stable, so lanes with equal keys keep their order.
#pragma once

#include <cstdint>

#include "routing/plan.hh"

namespace moe_ep::routing {

// Reorders the lanes of every row of ids [num_tokens, k] (row-major, contiguous) in place, for
// tokens of `source_rank`. `weights` [num_tokens, k] (may be null) moves with its lanes;
// `old_lane` [num_tokens, k] (may be null) receives, for every new lane, the lane it came from.
// Ids must be valid for `geometry` (-1 or in [0, num_experts)).
void order_lanes_hybrid_ep(std::int64_t* ids, float* weights, std::int32_t* old_lane, int num_tokens, int k,
                           const Geometry& geometry, int source_rank);

}  // namespace moe_ep::routing
