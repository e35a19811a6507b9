// The routing plan of one dispatch: for every row this rank receives, where it comes from; for
// every (token, lane) of this rank's tokens, where it goes; for every token this rank forwards
// (hybrid mode), its rows at this node's ranks. Pure functions over the agreed GlobalLayout and
// the top-k ids they are given: no I/O, no threads, no engine state.
//
// Guarantees: every function derives rows only through RowAssigner from the layout, so the plan
// of a source, of a forwarder and of a receiver agree row for row (plan.hh). Receive plans are
// filled in the fixed receive order: sources ascending, each source's tokens ascending.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe_ep/tensor.hpp"
#include "routing/plan.hh"

namespace moe_ep::routing {

struct RowSource {
  std::int32_t source;  // source rank
  std::int32_t index;   // token index (same node) or record slot (remote)
};

// Tokens of one source that a forwarder holds for its node.
struct ForwardPlan {
  int source = -1;
  std::int32_t count = 0;
  std::vector<std::int32_t> token;     // [count]
  std::vector<std::int64_t> ids;       // [count * k] global expert ids
  std::vector<std::int32_t> rows;      // [count * k] row at the lane's rank if master lane, else -1
  std::vector<std::int32_t> expanded;  // [count * k] expanded row of the lane, or -1
};

// The routing part of a dispatch's handle state: what the plan functions below fill.
struct RoutingPlan {
  GlobalLayout layout;
  std::vector<std::int32_t> source_tokens;  // [R]: token count of every rank in the call
  // As destination.
  std::vector<RowSource> rows;              // [real rows]
  std::vector<std::int32_t> row_token;      // [real rows] token index at the source
  std::vector<std::int32_t> master_lane;    // [real rows]
  std::vector<std::int32_t> local_ids;      // [real rows * k]
  std::vector<std::int32_t> expanded_rows;  // [real rows * k], expand only
  // As source.
  std::vector<std::int32_t> dst_row;        // [N * k]
  std::vector<std::int32_t> dst_expanded;   // [N * k]
  std::vector<std::int32_t> node_slot;      // [N * k] hybrid: forwarder slot at node master lanes
  // As forwarder (hybrid): one plan per source node (index = node; own node unused).
  std::vector<ForwardPlan> forward;
};

// The rank that plans, and the node boundaries of its data paths.
struct PlanningRank {
  int rank = 0;
  int physical_scaleup = 1;  // ranks per physical node: rows from the same one are read in place
  bool hybrid = false;       // two-hop path through the routing node's forwarder
  bool expand = false;       // expanded (per-expert) layout
  bool same_node(int r) const { return r / physical_scaleup == rank / physical_scaleup; }
};

// Rows of this rank's tokens at their destinations (dst_row, dst_expanded) and, in hybrid mode,
// the forwarder slot of each token at each destination node's master lane (node_slot, -1 elsewhere).
// `listed` is this rank's list_by_destination of topk.
void plan_sources(RoutingPlan& plan, const TopkRows& topk, const PlanningRank& me, std::span<const ListedToken> listed);

// Sizes the receive plan for the rows_at(me) rows this rank receives.
void start_receive_plan(RoutingPlan& plan, int k, const PlanningRank& me);
// Receives the tokens of `source` in order: ids.row(i) are the ids of its i-th token (record or
// token index i); tokens[i] its token index at the source (null: i itself).
void receive_source(RoutingPlan& plan, const PlanningRank& me, int source, const TopkRows& ids,
                    const std::int32_t* tokens);
// A source of this physical node as its node peers read it: its top-k ids and its
// list_by_destination (whole: every destination's group).
struct LocalSource {
  TopkRows ids;
  const ListedToken* listed = nullptr;
};
// Every source of this physical node with rows here (sources[s], unused for ranks of other
// nodes), from the group of the source's list for this rank: the work is the rows received, not
// every token of every source. Throws StateError if a listed entry is outside the source's tokens.
void plan_receive_local(RoutingPlan& plan, const PlanningRank& me, std::span<const LocalSource> sources);
// The records of `source` that arrive here from another node: 0 for a source of this node or one
// with no rows here; else one per row (direct) or one per token for this routing node (hybrid).
std::int32_t remote_records(const GlobalLayout& layout, const PlanningRank& me, int source);

// The ranks whose records reach this rank: in hybrid mode, the rank with this rank's scale-up
// index on every other routing node that sends tokens to this node; in direct mode, every rank
// of another physical node with rows here. Ascending.
std::vector<int> record_senders(const GlobalLayout& layout, const PlanningRank& me);
// The forwarder (hybrid) of this rank's tokens on routing node `node`.
int forwarder_on(const Geometry& geometry, int rank, int node);

// Hybrid: given forward[node].source, count, token and ids (one entry per routing node; own node
// unused), fills rows and expanded: the rows of every forwarded token at this node's ranks.
void plan_forwarding(std::span<ForwardPlan> forward, const GlobalLayout& layout, int rank, int k);
// Sizes and names the forwarding plans: forward[node].source and .count for every other routing
// node; token, ids, rows and expanded sized for count tokens of k lanes.
void start_forwarding(std::vector<ForwardPlan>& forward, const GlobalLayout& layout, int rank, int k);

// The handle's receive counts at `rank` (docs/semantics.md, EPHandle).
struct ReceiveCounts {
  Tensor psum_per_scaleup_rank;       // int32 [scaleup], inclusive prefix over source % scaleup
  Tensor psum_per_expert;             // int32 [local experts]
  Tensor unaligned_per_expert;        // int32 [local experts]
  std::vector<int> aligned_per_expert;  // [local experts]
};
ReceiveCounts receive_counts(const GlobalLayout& layout, int rank, int scaleup, bool expand);
// dst_buffer_slot_idx [N, k]: rank * max_tokens + the token's slot among this rank's rows at
// the lane's destination, at master lanes; -1 elsewhere.
Tensor buffer_slots(const GlobalLayout& layout, int rank, int max_tokens, const TopkRows& topk,
                    std::span<const std::int32_t> dst_row);

}  // namespace moe_ep::routing
