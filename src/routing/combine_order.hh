// The reduction order of combine (docs/semantics.md, "Combine"): which units a token's result is
// summed from, where each unit comes from, and in which order. Pure: over the token's top-k ids
// and the geometry only; the engine turns each unit into a row.
//
// Guarantees: units are listed in ascending key order and keys are unique within a token (a key
// is a lane, a master lane of a rank or a master lane of a routing node), so the order, and with
// it the rounding of the sum, is the same on every rank and in every run.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "routing/handle_plan.hh"
#include "moe_ep/limits.hpp"
#include "routing/plan.hh"

namespace moe_ep::routing {

// How a combine reduces: the layout, the reduction policy and the data paths.
struct ReductionScheme {
  bool expand = false;              // expanded layout: one row per (token, lane)
  bool multiple_reduction = true;   // ranks (and forwarders) pre-sum their lanes (levels 1 and 2)
  bool hybrid = false;              // two-hop path: one record per routing node
  int physical_scaleup = 1;         // ranks per physical node
  // Hybrid with multiple reduction: the source's own node contributes its rank units (kRank, as
  // node_unit_refs lists them) as units of their own instead of one level-2 unit (kNode); the
  // other nodes' units stay level-2 sums. Elsewhere it changes nothing (the own node already
  // contributes rank or lane units).
  bool own_node_rank_terms = false;
  int physical_node_of(int rank) const { return rank / physical_scaleup; }
};

enum class UnitKind {
  kLane,          // one lane's expanded row at its rank on this node (target: the lane)
  kRank,          // a rank's unit on this node: its row, or the sum of its lanes (target: the rank)
  kNode,          // the level-2 sum of a routing node's rank units, formed here (target: the node)
  kRemoteLane,    // a record of one lane from another node (target: the lane)
  kRemoteRank,    // a record of one rank's unit from another node (target: the rank)
  kRemoteNode,    // a record of a routing node's level-2 sum (target: the node)
};

struct UnitRef {
  int key = -1;     // the order key
  UnitKind kind = UnitKind::kLane;
  int target = -1;  // lane, rank or node (see UnitKind)
  int region = -1;  // remote kinds: the record region the unit arrives in (combine records [region][token])
};

// The units of the token's destinations on physical node `node` (kLane or kRank), ascending key:
// one per lane without multiple reduction in the expanded layout, else one per destination rank
// keyed by its master lane.
int node_unit_refs(const std::int64_t* ids, int k, const Geometry& geometry, const ReductionScheme& scheme, int node,
                   std::array<UnitRef, kMaxTopk>& out);

// Every unit of a token's result at its source rank `rank`, in reduction order (after the biases).
int reduction_units(const std::int64_t* ids, int k, const Geometry& geometry, const ReductionScheme& scheme, int rank,
                    std::array<UnitRef, kMaxTopk>& out);

// The ranks whose contribution records reach this rank (the source of the tokens): in hybrid
// mode the forwarder on every other routing node this rank sent tokens to, in direct mode every
// rank of another physical node it sent tokens to. Ascending.
std::vector<int> contribution_senders(const GlobalLayout& layout, const PlanningRank& me);

}  // namespace moe_ep::routing
