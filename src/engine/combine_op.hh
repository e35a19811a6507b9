// The combine operation (private to the engine; combine.cc implements it): it returns every row a
// dispatch delivered to the rank that sent its token and reduces them there. Reduction order and
// rounding: docs/semantics.md ("Combine"); the units a token sums and their order come from
// routing/combine_order.hh.
//
// A token's contributions are grouped into units, each keyed by a top-k position (its master
// lane), and summed in ascending key order after the biases, in FP32 with one BF16 rounding:
//  - compact layout: one unit per destination rank (the row that rank returned);
//  - expanded layout with multiple reduction: one unit per destination rank, itself the sum of
//    that rank's lanes in ascending order, rounded to BF16 (level 1);
//  - expanded layout without multiple reduction: one unit per lane;
//  - hybrid with multiple reduction: one unit per destination node, the sum of that node's rank
//    units in ascending master-lane order, rounded to BF16 (level 2).
// Units with a single input are passed through unchanged.
//
// Guarantees: the phases of engine/operation.hh; run() puts the contributions of other nodes'
// tokens (one counted exchange, engine/counted_exchange.hh), waits for those addressed to this
// rank, then reduces every token of this rank, in the same order of steps on every rank. While
// contributions travel as messages (MPI), a hybrid combine with multiple reduction first sums
// this node's part of every token (presum_tokens: the same bits).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "engine/call_shape.hh"
#include "engine/counted_exchange.hh"
#include "engine/engine.hh"
#include "routing/combine_order.hh"

namespace moe_ep::engine::combine_detail {

// One input of a token's reduction: its key (master lane, lane or node), its BF16 row and, in the
// compact layout, the unit's whole weight row (else null).
struct Unit {
  int key;
  const std::uint16_t* row;
  const float* weights = nullptr;
};

class Combine final : public CombineOperation {
 public:
  Combine(Engine& engine, CombineRequest request, std::uint64_t sequence);

  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override;

 private:
  // The phases (engine/operation.hh).
  void validate() override;
  std::vector<std::byte> prepare() override;
  void describe(comm::Agreement& agreement) const override;
  void run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>& outputs_ready) override;

  // Contributions to other nodes' tokens: from each destination rank (direct) or from the
  // forwarder of the destination node (hybrid).
  void put_contributions(CountedExchange& contributions);
  // The records of one token to `peer`: its units on this node (level-2 sum keyed by routing node
  // when node_unit_key, else one per unit keyed by its lane).
  void send_token(CountedExchange& contributions, int peer, std::int32_t token, const std::int64_t* ids,
                  const std::int32_t* rows, const std::int32_t* expanded, bool node_unit_key);
  // The record's weights: the unit's whole weight row (weights summed over ranks), or the
  // weights of the lanes selected by keep, 0 elsewhere (in send_weights_).
  template <class Keep>
  const float* record_weights(const Unit& unit, const std::int64_t* ids, const std::int32_t* rows,
                              const std::int32_t* expanded, Keep keep);
  void put_record(CountedExchange& contributions, int peer, int key, std::int32_t token, const std::uint16_t* payload,
                  const float* weights);
  // A record whose row is the sum of `parts` (in order, one BF16 rounding), formed in place.
  void put_sum_record(CountedExchange& contributions, int peer, int key, std::int32_t token,
                      std::span<const std::uint16_t* const> parts, const float* weights);
  // Counts the contributions this rank receives (the ranks that send them); whether there are any.
  bool expect_contributions(CountedExchange& contributions);

  // Token t's top-k ids and its rows at the lanes' ranks (compact, expanded) in the plan.
  struct TokenRoute {
    const std::int64_t* ids;
    const std::int32_t* rows;
    const std::int32_t* expanded;
  };
  TokenRoute route_of(int t) const;
  // The reduction of this rank's tokens.
  void reduce_tokens();
  void reduce_token(int t);
  // What is done of a token before the records of other nodes are waited for (hybrid combine
  // with multiple reduction, compact rows): nothing, the sum of this node's rank rows in the
  // output row (read there by reduce_token), or the whole token (it has no records).
  enum class Presum : std::uint8_t { kNone, kNodeUnit, kReduced };
  bool presums_apply() const;
  void presum_tokens();
  void presum_token(int t);
  Presum presum_of(int t) const { return presums_.empty() ? Presum::kNone : presums_[static_cast<size_t>(t)]; }
  routing::ReductionScheme scheme() const {
    return {.expand = expand_, .multiple_reduction = multi_, .hybrid = engine_.facts.paths.hybrid(),
            .physical_scaleup = engine_.facts.physical.num_scaleup, .own_node_rank_terms = req_.own_node_rank_terms};
  }

  // Row r of rank d's combine input (d on this node); with row weights, the weighted row
  // bf16(w[r] * float(x[r])) in the next scratch row.
  const std::uint16_t* row_of(int d, std::int32_t r, int& scratch) const;
  // The whole weight row rank d (on this node) returned with its compact row r, or null.
  const float* weight_row(int d, std::int32_t r) const {
    const PeerTensors& p = peers_[static_cast<size_t>(d)];
    if (!has_weights_) return nullptr;
    return p.weights + r * p.weights_row;
  }
  // The weight that lane j's rank (on this node) returned for the token: column j of the rank's
  // row at its master lane (compact), or the weight of lane j's expanded row.
  float lane_weight(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int j) const;
  // The unit of destination rank d (on this node) for a token: its row, or the level-1 sum of
  // its lanes (expanded layout). rows/expanded: the token's rows at the lanes' ranks.
  const std::uint16_t* rank_unit(int d, const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded,
                                 int& scratch) const;
  // Fills `units` with the units of the token's destinations on `node`; keys are master lanes (or
  // lanes without multiple reduction).
  int node_units(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int node,
                 std::array<Unit, kMaxTopk>& units, int& scratch) const;
  // Level 2: the sum of a node's rank units in ascending master-lane order (row null if none);
  // its weights are the sum of theirs (compact layout).
  Unit node_sum(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int node,
                int& scratch) const;
  // A unit of this node (level 2) for the final kernel: its rank units' rows into `term` (their
  // count returned: more than one are summed and rounded inside the kernel, as node_sum would),
  // its key and weights into `unit`.
  int node_term(const routing::UnitRef& ref, const std::int64_t* ids, const std::int32_t* rows,
                const std::int32_t* expanded, int& scratch, std::array<const std::uint16_t*, kMaxTopk>& term,
                Unit& unit) const;
  // The unit a reference of this node names (kLane, kRank or kNode).
  Unit local_unit(const routing::UnitRef& ref, const std::int64_t* ids, const std::int32_t* rows,
                  const std::int32_t* expanded, int& scratch) const;
  // The record of `token` in region `key` of this rank's memory (a contribution of another node).
  const std::byte* combine_record(int key, std::int32_t token) const {
    return engine_.memory().local() + (static_cast<std::int64_t>(key) * shape_.max_tokens + token) * record_.bytes;
  }

  Engine& engine_;
  CombineRequest req_;
  std::uint64_t sequence_;
  std::string ctx_;
  const HandleState* plan_ = nullptr;
  PeerTensors mine_;             // this rank's input rows and weights (before sharing)
  std::size_t own_x_bytes_ = 0;  // the extent of mine_.x
  bool expand_ = false, multi_ = true, has_weights_ = false;
  CallShape shape_;
  std::array<float, kMaxTopk> send_weights_{};
  CombineRecord record_{1, 1};
  std::int64_t pool_need_ = 0;  // bytes of pool the call needs (validate)
  routing::Geometry geo_;
  std::vector<PeerTensors> peers_;
  std::vector<Presum> presums_;  // [tokens], empty unless presum_tokens() ran
};

}  // namespace moe_ep::engine::combine_detail
