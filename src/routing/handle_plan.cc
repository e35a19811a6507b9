#include "routing/handle_plan.hh"

#include <fmt/format.h>

#include <array>

#include "core/arith.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::routing {
namespace {

std::size_t at(std::int64_t row, int k, int lane = 0) {
  return static_cast<std::size_t>(row) * static_cast<std::size_t>(k) + static_cast<std::size_t>(lane);
}

// Records the token as this rank's rows (one per master lane whose rank is this rank).
void accept_token(RoutingPlan& plan, const PlanningRank& me, RowAssigner& assigner, int source, std::int32_t index,
                  std::int32_t token, const std::int64_t* ids, int k) {
  const Geometry& geo = plan.layout.geometry();
  std::int32_t row_at_lane[kMaxTopk], expanded_at_lane[kMaxTopk];
  assigner.next(ids, k, [&](int r) { return r == me.rank; }, row_at_lane, expanded_at_lane);
  for (int j = 0; j < k; ++j) {
    if (row_at_lane[j] < 0) continue;
    const auto row = static_cast<std::size_t>(row_at_lane[j]);
    plan.rows[row] = {source, index};
    plan.row_token[row] = token;
    plan.master_lane[row] = j;
    for (int l = 0; l < k; ++l) {
      plan.local_ids[at(row_at_lane[j], k, l)] = geo.local_expert(ids[l], me.rank);
      if (me.expand) plan.expanded_rows[at(row_at_lane[j], k, l)] = expanded_at_lane[l];
    }
  }
}

}  // namespace

void plan_sources(RoutingPlan& plan, const TopkRows& topk, const PlanningRank& me, std::span<const ListedToken> listed) {
  const int N = topk.num_tokens, k = topk.k;
  const std::size_t nk = at(N, k);
  const Geometry& geo = plan.layout.geometry();
  // Row i of this rank's group for destination d is listed token i of that group.
  std::size_t rows = 0;
  for (int d = 0; d < geo.num_ranks; ++d) rows += static_cast<std::size_t>(plan.layout.count(me.rank, d));
  if (listed.size() != rows)
    throw StateError(fmt::format("plan_sources: rank {} listed {} rows, its counts say {}", me.rank, listed.size(), rows));
  plan.dst_row.assign(nk, -1);
  std::size_t entry = 0;
  for (int d = 0; d < geo.num_ranks; ++d) {
    const std::int32_t base = plan.layout.row_base(me.rank, d), count = plan.layout.count(me.rank, d);
    for (std::int32_t i = 0; i < count; ++i, ++entry) {
      const ListedToken& l = listed[entry];
      plan.dst_row[at(l.token, k, l.master_lane)] = base + i;
    }
  }
  // Every (token, lane) pair is its expert's next row, in token order.
  plan.dst_expanded.resize(nk);
  std::vector<std::int32_t> expert_next(static_cast<size_t>(geo.num_experts));
  for (int e = 0; e < geo.num_experts; ++e) expert_next[static_cast<size_t>(e)] = plan.layout.expanded_base(me.rank, e);
  for (int t = 0; t < N; ++t) {
    const std::int64_t* ids = topk.row(t);
    for (int j = 0; j < k; ++j)
      plan.dst_expanded[at(t, k, j)] = ids[j] < 0 ? -1 : expert_next[static_cast<size_t>(ids[j])]++;
  }
  if (!me.hybrid) return;
  plan.node_slot.assign(nk, -1);
  std::vector<std::int32_t> next(static_cast<size_t>(geo.num_nodes), 0);
  std::array<Destination, kMaxTopk> nodes;
  for (int t = 0; t < N; ++t) {
    const int n = token_nodes(topk.row(t), k, geo, nodes);
    for (int i = 0; i < n; ++i) {
      const Destination& node = nodes[static_cast<size_t>(i)];
      plan.node_slot[at(t, k, node.master_lane)] = next[static_cast<size_t>(node.target)]++;
    }
  }
}

void start_receive_plan(RoutingPlan& plan, int k, const PlanningRank& me) {
  const std::int32_t rows = plan.layout.rows_at(me.rank);
  plan.rows.resize(static_cast<size_t>(rows));
  plan.row_token.resize(static_cast<size_t>(rows));
  plan.master_lane.resize(static_cast<size_t>(rows));
  plan.local_ids.resize(at(rows, k));
  if (me.expand) plan.expanded_rows.resize(at(rows, k));
}

void receive_source(RoutingPlan& plan, const PlanningRank& me, int source, const TopkRows& ids,
                    const std::int32_t* tokens) {
  RowAssigner assigner;
  assigner.start(plan.layout, source);
  for (int i = 0; i < ids.num_tokens; ++i)
    accept_token(plan, me, assigner, source, i, tokens ? tokens[i] : i, ids.row(i), ids.k);
}

void plan_receive_local(RoutingPlan& plan, const PlanningRank& me, std::span<const LocalSource> sources) {
  const GlobalLayout& layout = plan.layout;
  const Geometry& geo = layout.geometry();
  const int El = geo.experts_per_rank();
  const std::int64_t first = std::int64_t{me.rank} * El;  // this rank's experts: [first, first + El)
  std::vector<std::int32_t> next(static_cast<size_t>(El));
  for (int src = 0; src < geo.num_ranks; ++src) {
    const std::int32_t count = layout.count(src, me.rank);
    if (!me.same_node(src) || count == 0) continue;
    const LocalSource& source = sources[static_cast<size_t>(src)];
    if (source.listed == nullptr)
      throw StateError(fmt::format("receive plan: rank {} sends {} rows here but published no list", src, count));
    const int k = source.ids.k;
    std::size_t offset = 0;  // this rank's group in the source's list
    for (int d = 0; d < me.rank; ++d) offset += static_cast<std::size_t>(layout.count(src, d));
    for (int i = 0; i < El; ++i) next[static_cast<size_t>(i)] = layout.expanded_base(src, static_cast<int>(first) + i);
    std::int32_t row = layout.row_base(src, me.rank);
    for (std::int32_t i = 0; i < count; ++i, ++row) {
      const ListedToken l = source.listed[offset + static_cast<std::size_t>(i)];
      if (l.token < 0 || l.token >= source.ids.num_tokens || l.master_lane < 0 || l.master_lane >= k)
        throw StateError(fmt::format("receive plan: rank {} listed token {} lane {} (it has {} tokens, top-{})", src,
                                     l.token, l.master_lane, source.ids.num_tokens, k));
      const std::int64_t* ids = source.ids.row(l.token);
      const auto r = static_cast<std::size_t>(row);
      plan.rows[r] = {src, l.token};
      plan.row_token[r] = l.token;
      plan.master_lane[r] = l.master_lane;
      for (int j = 0; j < k; ++j) {
        const int local = geo.local_expert(ids[j], me.rank);
        plan.local_ids[at(row, k, j)] = local;
        if (me.expand) plan.expanded_rows[at(row, k, j)] = local >= 0 ? next[static_cast<size_t>(local)]++ : -1;
      }
    }
  }
}

std::int32_t remote_records(const GlobalLayout& layout, const PlanningRank& me, int source) {
  if (me.same_node(source) || layout.count(source, me.rank) == 0) return 0;
  if (!me.hybrid) return layout.count(source, me.rank);
  return layout.node_count(source, layout.geometry().node_of_rank(me.rank));
}

int forwarder_on(const Geometry& geometry, int rank, int node) {
  const int SU = geometry.ranks_per_node();
  return node * SU + rank % SU;
}

std::vector<int> record_senders(const GlobalLayout& layout, const PlanningRank& me) {
  const Geometry& geo = layout.geometry();
  std::vector<int> senders;
  if (me.hybrid) {
    const int my_node = geo.node_of_rank(me.rank);
    for (int node = 0; node < geo.num_nodes; ++node) {
      const int src = forwarder_on(geo, me.rank, node);
      if (node != my_node && layout.node_count(src, my_node) != 0) senders.push_back(src);
    }
  } else {
    for (int src = 0; src < geo.num_ranks; ++src)
      if (!me.same_node(src) && layout.count(src, me.rank) != 0) senders.push_back(src);
  }
  return senders;
}

void start_forwarding(std::vector<ForwardPlan>& forward, const GlobalLayout& layout, int rank, int k) {
  const Geometry& geo = layout.geometry();
  const int my_node = geo.node_of_rank(rank);
  forward.assign(static_cast<size_t>(geo.num_nodes), ForwardPlan{});
  for (int node = 0; node < geo.num_nodes; ++node) {
    if (node == my_node) continue;
    ForwardPlan& f = forward[static_cast<size_t>(node)];
    f.source = forwarder_on(geo, rank, node);
    f.count = layout.node_count(f.source, my_node);
    f.token.resize(static_cast<size_t>(f.count));
    f.ids.resize(at(f.count, k));
    f.rows.resize(at(f.count, k));
    f.expanded.resize(at(f.count, k));
  }
}

void plan_forwarding(std::span<ForwardPlan> forward, const GlobalLayout& layout, int rank, int k) {
  const Geometry& geo = layout.geometry();
  const int my_node = geo.node_of_rank(rank);
  RowAssigner assigner;
  for (ForwardPlan& f : forward) {
    if (f.source < 0) continue;
    assigner.start(layout, f.source);
    for (std::int32_t slot = 0; slot < f.count; ++slot)
      assigner.next(&f.ids[at(slot, k)], k, [&](int r) { return geo.node_of_rank(r) == my_node; }, &f.rows[at(slot, k)],
                    &f.expanded[at(slot, k)]);
  }
}

ReceiveCounts receive_counts(const GlobalLayout& layout, int rank, int scaleup, bool expand) {
  const Geometry& geo = layout.geometry();
  const int El = geo.experts_per_rank();
  ReceiveCounts out;
  out.psum_per_scaleup_rank = Tensor::zeros({scaleup}, DType::kInt32);
  auto* region = out.psum_per_scaleup_rank.data_as<std::int32_t>();
  for (int src = 0; src < geo.num_ranks; ++src) region[src % scaleup] += layout.count(src, rank);
  for (int r = 1; r < scaleup; ++r) region[r] += region[r - 1];
  out.psum_per_expert = Tensor::empty({El}, DType::kInt32);
  out.unaligned_per_expert = Tensor::empty({El}, DType::kInt32);
  std::int32_t psum = 0;
  for (int i = 0; i < El; ++i) {
    const int e = rank * El + i;
    const std::int32_t count = layout.expert_total(e);
    const auto aligned = static_cast<std::int32_t>(core::round_up<std::int64_t>(count, layout.alignment()));
    out.unaligned_per_expert.data_as<std::int32_t>()[i] = count;
    psum += aligned;
    out.psum_per_expert.data_as<std::int32_t>()[i] = expand ? layout.expert_start(e) + count : psum;
    out.aligned_per_expert.push_back(aligned);
  }
  return out;
}

Tensor buffer_slots(const GlobalLayout& layout, int rank, int max_tokens, const TopkRows& topk,
                    std::span<const std::int32_t> dst_row) {
  const int k = topk.k;
  Tensor slots = Tensor::empty({topk.num_tokens, k}, DType::kInt32);
  auto* slot = slots.data_as<std::int32_t>();
  for (int t = 0; t < topk.num_tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int32_t row = dst_row[at(t, k, j)];
      slot[at(t, k, j)] =
          row < 0 ? -1 : rank * max_tokens + (row - layout.row_base(rank, layout.geometry().rank_of_expert(topk.row(t)[j])));
    }
  return slots;
}

}  // namespace moe_ep::routing
