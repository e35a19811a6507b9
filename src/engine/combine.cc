// The combine operation of both buffer generations (engine/combine_op.hh): validation, the
// contributions of other nodes' tokens and the reduction of this rank's tokens.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "comm/agreement.hh"
#include "core/arith.hh"
#include "core/checks.hh"
#include "core/env_vars.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/reduce.hh"
#include "core/v2_contract.hh"
#include "engine/combine_op.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "routing/combine_order.hh"

namespace moe_ep::engine {
namespace combine_detail {
namespace {

constexpr std::int64_t kTokensPerTask = 8;

// Per-thread rows for intermediate sums: at most one per rank unit (level 1) and one per node
// unit (level 2) of a token, and one weighted input row per lane (CombineRequest::row_weights),
// so 3 * kMaxTopk + 2 rows. Sized before a token is reduced, so the rows never move while
// pointers to them are live.
constexpr int kScratchRows = 3 * kMaxTopk + 2;
thread_local std::vector<std::uint16_t> scratch_rows;
thread_local std::vector<float> scratch_weights;  // one k-row per scratch row

void prepare_scratch(std::int64_t hidden) {
  const std::size_t need = static_cast<std::size_t>(kScratchRows) * static_cast<std::size_t>(hidden);
  if (scratch_rows.size() < need) scratch_rows.resize(need);
  if (scratch_weights.size() < static_cast<std::size_t>(kScratchRows * kMaxTopk))
    scratch_weights.resize(static_cast<std::size_t>(kScratchRows * kMaxTopk));
}

std::uint16_t* scratch_row(int index, std::int64_t hidden) {
  return scratch_rows.data() + static_cast<std::size_t>(index) * static_cast<std::size_t>(hidden);
}

// fn(t) for every token, in tasks of kTokensPerTask on the pool, each task with its scratch rows
// and its streaming stores fenced.
void for_each_token(core::WorkerPool& pool, int tokens, std::int64_t hidden, const std::function<void(int)>& fn) {
  pool.parallel_for(core::ceil_div<std::int64_t>(tokens, kTokensPerTask), [&](std::int64_t task) {
    prepare_scratch(hidden);
    const int end = static_cast<int>(std::min<std::int64_t>(tokens, (task + 1) * kTokensPerTask));
    for (int t = static_cast<int>(task * kTokensPerTask); t < end; ++t) fn(t);
    core::streaming_fence();
  });
}

// FP32 sum of k-rows of weights in order, the first as is.
void sum_weight_rows(std::span<const float* const> rows, int k, float* out) {
  for (int j = 0; j < k; ++j) {
    float acc = rows.empty() ? 0.0f : rows[0][j];
    for (std::size_t i = 1; i < rows.size(); ++i) acc += rows[i][j];
    out[j] = acc;
  }
}

}  // namespace

Combine::Combine(Engine& engine, CombineRequest request, std::uint64_t sequence)
    : CombineOperation(engine.facts.context(request.operation), request.operation, "combine: agreement"),
      engine_(engine),
      req_(std::move(request)),
      sequence_(sequence),
      ctx_(context()) {}

const std::uint16_t* Combine::row_of(int d, std::int32_t r, int& scratch) const {
  const PeerTensors& p = peers_[static_cast<size_t>(d)];
  const auto* row = reinterpret_cast<const std::uint16_t*>(p.x + r * p.x_row_bytes);
  if (!p.row_weights) return row;
  std::uint16_t* out = scratch_row(scratch++, shape_.hidden);
  core::weighted_sum_bf16_rows({&row, 1}, {p.row_weights + r, 1}, out, shape_.hidden);
  return out;
}

float Combine::lane_weight(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded,
                           int j) const {
  const int d = geo_.rank_of_expert(ids[j]);
  const PeerTensors& p = peers_[static_cast<size_t>(d)];
  const float* w = p.weights;
  if (expand_) return w[expanded[j]];
  for (int l = shape_.topk - 1; l >= 0; --l)
    if (ids[l] >= 0 && geo_.rank_of_expert(ids[l]) == d) return w[rows[l] * p.weights_row + j];
  return 0.0f;
}

void Combine::validate() {
  const auto& a = req_;
  if (!a.rejection.empty()) core::fail(ctx_, "{}", a.rejection);
  if (a.check_generation_arguments) a.check_generation_arguments(ctx_);
  core::v2::check_combine_handle_given(ctx_, a.handle.get());
  plan_ = &checked_handle(engine_, ctx_, *a.handle);
  const HandleFacts& h = plan_->facts;
  const core::v2::CombineShape checked =
      core::v2::check_combine(ctx_, a.x, a.topk_weights, a.bias, h, DLDevice{kDLCPU, 0});
  expand_ = h.do_expand;
  multi_ = engine_.facts.config.allow_multiple_reduction;
  shape_.tokens = h.num_tokens;
  shape_.topk = h.num_topk;
  shape_.max_tokens = h.num_max_tokens_per_rank;
  shape_.experts = h.num_experts;
  shape_.local_experts = h.num_experts / engine_.facts.num_ranks;
  shape_.alignment = h.expert_alignment;
  shape_.hidden = checked.hidden;
  geo_ = routing::Geometry{engine_.facts.num_ranks, h.num_experts, engine_.facts.logical_scaleout};
  has_weights_ = a.topk_weights.defined();
  if (a.row_weights.defined()) {
    if (!expand_) core::fail(ctx_, "row weights need the expanded layout");
    core::expect_tensor(ctx_, "row_weights", a.row_weights, DType::kFP32, {checked.rows});
    core::expect_contiguous(ctx_, "row_weights", a.row_weights);
  }
  if (req_.sum_weights_over_ranks && expand_)
    core::fail(ctx_, "summing weights over ranks needs the compact layout");
  engine_.facts.check_num_qps(ctx_, a.num_qps);
  record_ = CombineRecord(shape_.hidden, shape_.topk);
  const RegionSizes need = region_sizes(engine_.facts.paths, shape_.max_tokens, shape_.hidden, 0, 0, shape_.topk, multi_);
  // With EngineConfig::grow_pool the pool grows after the agreement (run) instead.
  pool_need_ = need.combine_bytes;
  const std::int64_t holds = engine_.pool_bytes();
  if (!engine_.facts.config.grow_pool && need.combine_bytes > holds) {
    const std::int64_t bytes = core::round_up<std::int64_t>(need.combine_bytes, engine_.facts.config.pool_alignment);
    throw CapacityError(fmt::format("{}: this call needs {} bytes of buffer ({} tokens per rank, hidden = {}, k = {}), "
                                    "the buffer holds {}", ctx_, bytes, shape_.max_tokens, shape_.hidden, shape_.topk, holds),
                        bytes, holds);
  }
}

void Combine::allocate_outputs_early() {
  result.combined_x = Tensor::empty({shape_.tokens, shape_.hidden}, DType::kBF16);
  if (has_weights_) result.combined_topk_weights = Tensor::empty({shape_.tokens, shape_.topk}, DType::kFP32);
}

// The workers, and this rank's shared input rows and weights.
std::vector<std::byte> Combine::prepare() {
  engine_.wait_for_event(req_.previous_event, ctx_, "previous_event");
  if (!result.combined_x.defined()) allocate_outputs_early();
  const int workers = req_.workers(geo_.num_experts, shape_.topk);
  engine_.set_workers(workers);
  core::trace(core::Subsys::kColl, "{}: hidden {}, {} experts, top-{}, {} workers", ctx_, shape_.hidden,
              geo_.num_experts, shape_.topk, workers);
  engine_.limit_inflight(req_.num_qps);
  mine_.x = static_cast<const std::byte*>(req_.x.data());
  mine_.x_row_bytes = req_.x.stride(0) * 2;
  own_x_bytes_ = view_extent(req_.x);
  if (has_weights_) {
    mine_.weights = req_.topk_weights.data_as<const float>();
    mine_.weights_row = expand_ ? 1 : req_.topk_weights.stride(0);
  }
  if (req_.row_weights.defined()) mine_.row_weights = req_.row_weights.data_as<const float>();
  mine_.num_tokens = shape_.tokens;
  const PeerTensors shared =
      share_tensors(engine_, mine_,
                    {.x = view_extent(req_.x),
                     .weights = has_weights_ ? view_extent(req_.topk_weights) : 0,
                     .row_weights = req_.row_weights.defined() ? view_extent(req_.row_weights) : 0});
  const auto* bytes = reinterpret_cast<const std::byte*>(&shared);
  return {bytes, bytes + sizeof shared};
}

void Combine::describe(comm::Agreement& agreement) const {
  agreement.field("operation number", static_cast<std::int64_t>(sequence_))
      .field("handle's dispatch number", plan_ ? static_cast<std::int64_t>(plan_->dispatch_sequence) : 0)
      .field("do_expand (handle)", expand_)
      .field("topk_weights given", has_weights_)
      .field("row weights given", req_.row_weights.defined())
      .field("weights summed over ranks", req_.sum_weights_over_ranks)
      .field("own node's rank terms", req_.own_node_rank_terms)
      .field("hidden", shape_.hidden);
}

void Combine::run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>& outputs_ready) {
  peers_ = payload_per_rank<PeerTensors>(payloads, ctx_);
  resolve_tensors(engine_, peers_, mine_);
  // The need is the same on every rank (the handle's shape and the agreed hidden size); the
  // handle's dispatch grew the pool for rows of its own hidden size already.
  if (engine_.facts.config.grow_pool) engine_.grow_pool(pool_need_, ctx_);
  outputs_ready();
  engine_.wait_for_event(req_.previous_event_before_epilogue, ctx_, "previous_event_before_epilogue");
  CountedExchange contributions(engine_, "combine: scale-out contributions");
  {
    // The forwarder of a hybrid combine sums its node peers' rows (and may wait for room to send).
    comm::PeerReads reads(engine_.transport(), "combine: forwarding");
    put_contributions(contributions);
  }
  if (expect_contributions(contributions) && presums_apply()) {
    // While the other nodes' records travel: this node's part of every token.
    comm::PeerReads reads(engine_.transport(), "combine: this node's sums");
    presum_tokens();
  }
  contributions.wait();
  {
    comm::PeerReads reads(engine_.transport(), "combine: reduction");  // node peers' rows and weights
    reduce_tokens();
  }
  engine_.transport().barrier(comm::Scope::kNode, engine_.facts.wait("combine: exit"));
}

const std::uint16_t* Combine::rank_unit(int d, const std::int64_t* ids, const std::int32_t* rows,
                                        const std::int32_t* expanded, int& scratch) const {
  if (!expand_) {
    for (int j = shape_.topk - 1; j >= 0; --j)
      if (ids[j] >= 0 && geo_.rank_of_expert(ids[j]) == d) return row_of(d, rows[j], scratch);
    return nullptr;
  }
  std::array<const std::uint16_t*, kMaxTopk> lanes;
  int n = 0;
  for (int j = 0; j < shape_.topk; ++j)
    if (ids[j] >= 0 && geo_.rank_of_expert(ids[j]) == d)
      lanes[static_cast<size_t>(n++)] = row_of(d, expanded[j], scratch);
  if (n == 1) return lanes[0];
  std::uint16_t* out = scratch_row(scratch++, shape_.hidden);
  core::sum_bf16_rows({lanes.data(), static_cast<size_t>(n)}, out, shape_.hidden);
  return out;
}

int Combine::node_units(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int node,
                        std::array<Unit, kMaxTopk>& units, int& scratch) const {
  std::array<routing::UnitRef, kMaxTopk> refs;
  const int n = routing::node_unit_refs(ids, shape_.topk, geo_, scheme(), node, refs);
  for (int i = 0; i < n; ++i)
    units[static_cast<size_t>(i)] = local_unit(refs[static_cast<size_t>(i)], ids, rows, expanded, scratch);
  return n;
}

Unit Combine::node_sum(const std::int64_t* ids, const std::int32_t* rows, const std::int32_t* expanded, int node,
                       int& scratch) const {
  std::array<Unit, kMaxTopk> units;
  const int n = node_units(ids, rows, expanded, node, units, scratch);
  if (n <= 1) return n == 1 ? units[0] : Unit{-1, nullptr};
  std::array<const std::uint16_t*, kMaxTopk> rows_in;
  std::array<const float*, kMaxTopk> weights_in;
  for (int i = 0; i < n; ++i) {
    rows_in[static_cast<size_t>(i)] = units[static_cast<size_t>(i)].row;
    weights_in[static_cast<size_t>(i)] = units[static_cast<size_t>(i)].weights;
  }
  const int index = scratch++;
  std::uint16_t* sum = scratch_row(index, shape_.hidden);
  core::sum_bf16_rows({rows_in.data(), static_cast<size_t>(n)}, sum, shape_.hidden);
  float* weights = nullptr;
  if (units[0].weights) {
    weights = scratch_weights.data() + static_cast<std::size_t>(index) * kMaxTopk;
    sum_weight_rows({weights_in.data(), static_cast<size_t>(n)}, shape_.topk, weights);
  }
  return {units[0].key, sum, weights};
}

Unit Combine::local_unit(const routing::UnitRef& ref, const std::int64_t* ids, const std::int32_t* rows,
                         const std::int32_t* expanded, int& scratch) const {
  switch (ref.kind) {
    case routing::UnitKind::kLane:
      return {ref.key, row_of(geo_.rank_of_expert(ids[ref.target]), expanded[ref.target], scratch)};
    case routing::UnitKind::kRank:
      return {ref.key, rank_unit(ref.target, ids, rows, expanded, scratch),
              expand_ ? nullptr : weight_row(ref.target, rows[ref.key])};
    default: {
      Unit unit = node_sum(ids, rows, expanded, ref.target, scratch);
      unit.key = ref.key;
      return unit;
    }
  }
}

void Combine::put_record(CountedExchange& contributions, int peer, int key, std::int32_t token,
                         const std::uint16_t* payload, const float* weights) {
  const std::int64_t offset = (static_cast<std::int64_t>(key) * shape_.max_tokens + token) * record_.bytes;
  const std::size_t row_bytes = static_cast<std::size_t>(shape_.hidden) * 2;
  // A row of this rank's input is sent from there (valid for the whole call); sums and weighted
  // rows live in scratch that the next token reuses, so they are copied.
  const auto at = reinterpret_cast<std::uintptr_t>(payload), own = reinterpret_cast<std::uintptr_t>(mine_.x);
  if (at >= own && at - own < own_x_bytes_) {
    contributions.put_retained(peer, static_cast<std::size_t>(offset), payload, row_bytes);
  } else {
    contributions.put(peer, static_cast<std::size_t>(offset), payload, row_bytes);
  }
  contributions.put(peer, static_cast<std::size_t>(offset + record_.weights_offset), weights,
                    sizeof(float) * static_cast<std::size_t>(shape_.topk));
}

void Combine::put_sum_record(CountedExchange& contributions, int peer, int key, std::int32_t token,
                             std::span<const std::uint16_t* const> parts, const float* weights) {
  const std::int64_t offset = (static_cast<std::int64_t>(key) * shape_.max_tokens + token) * record_.bytes;
  const std::size_t row_bytes = static_cast<std::size_t>(shape_.hidden) * 2;
  contributions.put_formed(peer, static_cast<std::size_t>(offset), row_bytes, [&](std::byte* row) {
    core::sum_bf16_rows(parts, reinterpret_cast<std::uint16_t*>(row), shape_.hidden);
  });
  contributions.put(peer, static_cast<std::size_t>(offset + record_.weights_offset), weights,
                    sizeof(float) * static_cast<std::size_t>(shape_.topk));
}

template <class Keep>
const float* Combine::record_weights(const Unit& unit, const std::int64_t* ids, const std::int32_t* rows,
                                     const std::int32_t* expanded, Keep keep) {
  if (req_.sum_weights_over_ranks && unit.weights) return unit.weights;
  send_weights_.fill(0.0f);
  if (!has_weights_) return send_weights_.data();
  for (int j = 0; j < shape_.topk; ++j)
    if (ids[j] >= 0 && keep(j)) send_weights_[static_cast<size_t>(j)] = lane_weight(ids, rows, expanded, j);
  return send_weights_.data();
}

void Combine::send_token(CountedExchange& contributions, int peer, std::int32_t token, const std::int64_t* ids,
                         const std::int32_t* rows, const std::int32_t* expanded, bool node_unit_key) {
  const int me = engine_.facts.rank, my_node = engine_.facts.node_of(me);
  int scratch = 0;
  if (node_unit_key) {
    // Hybrid with multiple reduction: one level-2 unit for this node, keyed by node (node_sum's
    // rows and weights). A sum of several rank units is formed straight into the record.
    std::array<Unit, kMaxTopk> units;
    const int n = node_units(ids, rows, expanded, my_node, units, scratch);
    if (n == 0) return;
    Unit unit = units[0];
    std::array<const std::uint16_t*, kMaxTopk> parts;
    if (n > 1) {
      std::array<const float*, kMaxTopk> part_weights;
      for (int i = 0; i < n; ++i) {
        parts[static_cast<size_t>(i)] = units[static_cast<size_t>(i)].row;
        part_weights[static_cast<size_t>(i)] = units[static_cast<size_t>(i)].weights;
      }
      if (unit.weights) {
        float* summed = scratch_weights.data() + static_cast<std::size_t>(scratch++) * kMaxTopk;
        sum_weight_rows({part_weights.data(), static_cast<size_t>(n)}, shape_.topk, summed);
        unit.weights = summed;
      }
    }
    const float* w = record_weights(unit, ids, rows, expanded,
                                    [&](int j) { return engine_.facts.node_of(geo_.rank_of_expert(ids[j])) == my_node; });
    const int key = engine_.facts.routing_node_of(me);
    if (n == 1) {
      put_record(contributions, peer, key, token, unit.row, w);
    } else {
      put_sum_record(contributions, peer, key, token, {parts.data(), static_cast<size_t>(n)}, w);
    }
    return;
  }
  std::array<Unit, kMaxTopk> units;
  const int n = node_units(ids, rows, expanded, my_node, units, scratch);
  for (int i = 0; i < n; ++i) {
    const Unit& unit = units[static_cast<size_t>(i)];
    const int unit_rank = geo_.rank_of_expert(ids[unit.key]);
    const float* w = record_weights(unit, ids, rows, expanded, [&](int j) {
      return expand_ && !multi_ ? j == unit.key : geo_.rank_of_expert(ids[j]) == unit_rank;
    });
    put_record(contributions, peer, unit.key, token, unit.row, w);
  }
}

// Contributions for tokens whose source is on another node: from each destination rank (direct
// mode) or from the forwarder of the destination node (hybrid mode).
void Combine::put_contributions(CountedExchange& contributions) {
  if (!engine_.facts.paths.hybrid() && !engine_.facts.paths.direct_remote()) return;
  const int me = engine_.facts.rank, k = shape_.topk;
  prepare_scratch(shape_.hidden);
  if (engine_.facts.paths.hybrid()) {
    for (const ForwardPlan& f : plan_->forward) {
      if (f.source < 0) continue;
      for (std::int32_t slot = 0; slot < f.count; ++slot) {
        const std::size_t base = static_cast<size_t>(slot) * k;
        send_token(contributions, f.source, f.token[static_cast<size_t>(slot)], &f.ids[base], &f.rows[base],
                   &f.expanded[base], multi_);
      }
    }
  } else {
    // Direct: this rank returns the rows it received from other nodes' ranks.
    std::array<std::int64_t, kMaxTopk> ids;
    std::array<std::int32_t, kMaxTopk> rows, expanded;
    for (std::size_t i = 0; i < plan_->rows.size(); ++i) {
      const int src = plan_->rows[i].source;
      if (engine_.facts.same_node(src)) continue;
      // Rebuild the token's lanes as seen from here: local lanes carry this rank's rows.
      for (int j = 0; j < k; ++j) {
        const std::int32_t local = plan_->local_ids[i * k + j];
        ids[static_cast<size_t>(j)] = local >= 0 ? std::int64_t{me} * geo_.experts_per_rank() + local : -1;
        rows[static_cast<size_t>(j)] = static_cast<std::int32_t>(i);
        expanded[static_cast<size_t>(j)] = expand_ ? plan_->expanded_rows[i * k + j] : -1;
      }
      // Keys must be the lanes of the original token: the local lanes are the token's lanes.
      send_token(contributions, src, plan_->row_token[i], ids.data(), rows.data(), expanded.data(), false);
    }
  }
  contributions.signal_written();
}

bool Combine::expect_contributions(CountedExchange& contributions) {
  if (!engine_.facts.paths.hybrid() && !engine_.facts.paths.direct_remote()) return false;
  const routing::PlanningRank me{.rank = engine_.facts.rank, .physical_scaleup = engine_.facts.physical.num_scaleup,
                                 .hybrid = engine_.facts.paths.hybrid(), .expand = expand_};
  for (const int sender : routing::contribution_senders(plan_->layout, me)) contributions.expect(sender);
  return contributions.expects_any();
}

int Combine::node_term(const routing::UnitRef& ref, const std::int64_t* ids, const std::int32_t* rows,
                       const std::int32_t* expanded, int& scratch, std::array<const std::uint16_t*, kMaxTopk>& term,
                       Unit& unit) const {
  std::array<Unit, kMaxTopk> parts;
  const int m = node_units(ids, rows, expanded, ref.target, parts, scratch);
  unit = {ref.key, m > 0 ? parts[0].row : nullptr, m > 0 ? parts[0].weights : nullptr};
  std::array<const float*, kMaxTopk> part_weights;
  for (int i = 0; i < m; ++i) {
    term[static_cast<size_t>(i)] = parts[static_cast<size_t>(i)].row;
    part_weights[static_cast<size_t>(i)] = parts[static_cast<size_t>(i)].weights;
  }
  if (m > 1 && parts[0].weights) {  // node_sum's weights: the sum of its units'
    float* summed = scratch_weights.data() + static_cast<std::size_t>(scratch++) * kMaxTopk;
    sum_weight_rows({part_weights.data(), static_cast<size_t>(m)}, shape_.topk, summed);
    unit.weights = summed;
  }
  return m;
}

void Combine::reduce_tokens() {
  for_each_token(engine_.pool(), shape_.tokens, shape_.hidden, [&](int t) {
    if (presum_of(t) != Presum::kReduced) reduce_token(t);
  });
}

Combine::TokenRoute Combine::route_of(int t) const {
  const HandleState& plan = *plan_;
  const int k = shape_.topk;
  const std::int64_t topk_row = plan.topk.defined() ? plan.topk.stride(0) : k;
  return {plan.topk.data_as<const std::int64_t>() + t * topk_row, &plan.dst_row[static_cast<size_t>(t) * k],
          &plan.dst_expanded[static_cast<size_t>(t) * k]};
}

// Records that travel (MPI: time to fill while they do; where puts write the peer's memory at once
// the early sums only add a write and a read of every output row), hybrid, multiple reduction,
// compact rows read in place: a token's units are at most one node unit of this node (the level-2
// sum of its rank rows) and records of other nodes. MOE_EP_COMBINE_PRESUM=0 turns it off.
bool Combine::presums_apply() const {
  if (!engine_.transport().puts_travel() || !env::get(env::kCombinePresum)) return false;
  if (!engine_.facts.paths.hybrid() || !multi_ || expand_) return false;
  for (int d = 0; d < engine_.facts.num_ranks; ++d)
    if (engine_.facts.same_node(d) && peers_[static_cast<size_t>(d)].row_weights) return false;
  return true;
}

// Before the records of other nodes arrive: a token with no such record is reduced; a token
// whose node unit sums two or more rank rows gets that sum, rounded to BF16 as the final kernel
// rounds it (docs/semantics.md, level 2), in its output row, which the final kernel then reads in
// place of those rows. The bits are those of reduce_token alone.
void Combine::presum_tokens() {
  presums_.assign(static_cast<size_t>(shape_.tokens), Presum::kNone);
  for_each_token(engine_.pool(), shape_.tokens, shape_.hidden, [&](int t) { presum_token(t); });
}

void Combine::presum_token(int t) {
  const TokenRoute route = route_of(t);
  const std::int64_t* ids = route.ids;
  const std::int32_t* rows = route.rows;
  const std::int32_t* expanded = route.expanded;
  std::array<routing::UnitRef, kMaxTopk> refs;
  const int n = routing::reduction_units(ids, shape_.topk, geo_, scheme(), engine_.facts.rank, refs);
  int local = -1, remote = 0;
  for (int u = 0; u < n; ++u) {
    const routing::UnitKind kind = refs[static_cast<size_t>(u)].kind;
    if (kind == routing::UnitKind::kNode) local = local < 0 ? u : -2;
    remote += kind == routing::UnitKind::kRemoteNode || kind == routing::UnitKind::kRemoteRank ||
              kind == routing::UnitKind::kRemoteLane;
  }
  if (remote == 0) {
    reduce_token(t);
    presums_[static_cast<size_t>(t)] = Presum::kReduced;
    return;
  }
  if (local < 0) return;  // no node unit of this node (own_node_rank_terms: its rank rows are terms)
  int scratch = 0;
  std::array<const std::uint16_t*, kMaxTopk> term;
  Unit unit;
  const int m = node_term(refs[static_cast<size_t>(local)], ids, rows, expanded, scratch, term, unit);
  if (m < 2) return;
  core::sum_bf16_rows({term.data(), static_cast<size_t>(m)},
                      result.combined_x.data_as<std::uint16_t>() + static_cast<std::int64_t>(t) * shape_.hidden,
                      shape_.hidden);
  presums_[static_cast<size_t>(t)] = Presum::kNodeUnit;
}

// Token t's result: the biases, then its units in reduction order (routing::reduction_units);
// units on this node are read in place, units of other nodes arrived as records.
void Combine::reduce_token(int t) {
  const int k = shape_.topk, my_node = engine_.facts.node_of(engine_.facts.rank);
  const TokenRoute route = route_of(t);
  const std::int64_t* ids = route.ids;
  const std::int32_t* rows = route.rows;
  const std::int32_t* expanded = route.expanded;
  float* w = has_weights_ ? result.combined_topk_weights.data_as<float>() + static_cast<std::int64_t>(t) * k : nullptr;
  if (w) std::fill(w, w + k, 0.0f);
  auto take_remote_weights = [&](const float* rw, auto keep) {
    if (!w || req_.sum_weights_over_ranks) return;
    for (int j = 0; j < k; ++j)
      if (ids[j] >= 0 && keep(j)) w[j] = rw[j];
  };
  std::array<routing::UnitRef, kMaxTopk> refs;
  std::array<Unit, kMaxTopk> units;
  // A unit of this node (level 2) is the BF16 sum of its rank units: its rows are summed in the
  // final kernel (sum_bf16_terms_streaming) rather than into a scratch row first.
  std::array<std::array<const std::uint16_t*, kMaxTopk>, kMaxTopk> node_rows;
  std::array<int, kMaxTopk> node_row_count{};
  const int n = routing::reduction_units(ids, k, geo_, scheme(), engine_.facts.rank, refs);
  int scratch = 0;
  for (int u = 0; u < n; ++u) {
    const routing::UnitRef& ref = refs[static_cast<size_t>(u)];
    Unit& unit = units[static_cast<size_t>(u)];
    if (ref.kind == routing::UnitKind::kNode) {
      node_row_count[static_cast<size_t>(u)] =
          node_term(ref, ids, rows, expanded, scratch, node_rows[static_cast<size_t>(u)], unit);
      continue;
    }
    if (ref.kind == routing::UnitKind::kLane || ref.kind == routing::UnitKind::kRank) {
      unit = local_unit(ref, ids, rows, expanded, scratch);
      continue;
    }
    const std::byte* record = combine_record(ref.region, t);
    unit = {ref.key, reinterpret_cast<const std::uint16_t*>(record),
            reinterpret_cast<const float*>(record + record_.weights_offset)};
    if (ref.kind == routing::UnitKind::kRemoteNode)
      take_remote_weights(unit.weights, [&](int j) { return geo_.node_of_rank(geo_.rank_of_expert(ids[j])) == ref.target; });
    else if (ref.kind == routing::UnitKind::kRemoteLane)
      take_remote_weights(unit.weights, [&](int j) { return j == ref.target; });
    else
      take_remote_weights(unit.weights, [&](int j) { return geo_.rank_of_expert(ids[j]) == ref.target; });
  }
  if (w && req_.sum_weights_over_ranks) {
    // Every unit's whole weight row, summed in unit order.
    std::array<const float*, kMaxTopk> rows_w;
    for (int u = 0; u < n; ++u) rows_w[static_cast<size_t>(u)] = units[static_cast<size_t>(u)].weights;
    sum_weight_rows({rows_w.data(), static_cast<size_t>(n)}, k, w);
  } else {
    // Lanes served on this node: the weight their rank returned for them.
    for (int j = 0; j < k && w; ++j)
      if (ids[j] >= 0 && engine_.facts.node_of(geo_.rank_of_expert(ids[j])) == my_node) w[j] = lane_weight(ids, rows, expanded, j);
  }
  std::array<const std::uint16_t*, kMaxTopk + 2> inputs;
  std::array<core::Bf16Term, kMaxTopk + 2> terms;
  int count = 0;
  for (const TensorView& b : req_.bias) {
    inputs[static_cast<size_t>(count)] = b.data_as<const std::uint16_t>() + t * b.stride(0);
    terms[static_cast<size_t>(count)] = {{&inputs[static_cast<size_t>(count)], 1}};
    ++count;
  }
  std::uint16_t* out = result.combined_x.data_as<std::uint16_t>() + static_cast<std::int64_t>(t) * shape_.hidden;
  for (int u = 0; u < n; ++u) {
    int m = node_row_count[static_cast<size_t>(u)];
    if (m > 1 && presum_of(t) == Presum::kNodeUnit) {  // its sum is in the output row (presum_token)
      m = 1;
      units[static_cast<size_t>(u)].row = out;
    }
    inputs[static_cast<size_t>(count)] = units[static_cast<size_t>(u)].row;
    terms[static_cast<size_t>(count)] = m > 1 ? core::Bf16Term{{node_rows[static_cast<size_t>(u)].data(), static_cast<size_t>(m)}}
                                              : core::Bf16Term{{&inputs[static_cast<size_t>(count)], 1}};
    ++count;
  }
  // The output row may be one of the inputs: the kernel reads every input of an element before it
  // writes that element.
  core::sum_bf16_terms_streaming({terms.data(), static_cast<size_t>(count)}, out, shape_.hidden);
}

}  // namespace combine_detail

std::shared_ptr<CombineOperation> make_combine(Engine& engine, CombineRequest request, std::uint64_t sequence) {
  return std::make_shared<combine_detail::Combine>(engine, std::move(request), sequence);
}

}  // namespace moe_ep::engine
