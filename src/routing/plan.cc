#include "routing/plan.hh"

#include <algorithm>

#include "core/arith.hh"
#include "core/checks.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::routing {
namespace {

template <class TargetOf>
int distinct_targets(const std::int64_t* ids, int k, TargetOf target_of, std::array<Destination, kMaxTopk>& out) {
  // Lanes from high to low: the first lane seen for a target is its master lane.
  int n = 0;
  for (int j = k - 1; j >= 0; --j) {
    if (ids[j] < 0) continue;
    const int target = target_of(ids[j]);
    bool seen = false;
    for (int i = 0; i < n; ++i) seen |= out[static_cast<size_t>(i)].target == target;
    if (!seen) out[static_cast<size_t>(n++)] = {target, j};
  }
  std::reverse(out.begin(), out.begin() + n);  // ascending master lane
  return n;
}

}  // namespace

void validate_topk(std::string_view context, const TopkRows& topk, int num_experts) {
  for (int t = 0; t < topk.num_tokens; ++t) {
    const std::int64_t* ids = topk.row(t);
    for (int j = 0; j < topk.k; ++j) {
      const std::int64_t e = ids[j];
      if (e < -1 || e >= num_experts)
        core::fail(context, "topk_idx[{}, {}] = {} is outside [-1, {}) (num_experts = {})", t, j, e, num_experts,
                   num_experts);
      if (e < 0) continue;
      for (int i = 0; i < j; ++i)
        if (ids[i] == e)
          core::fail(context, "topk_idx[{}] names expert {} twice (positions {} and {}); each expert may appear "
                     "at most once per token", t, e, i, j);
    }
  }
}

// The divisors are read once, outside the lanes' loop (the output array could alias the geometry,
// so the compiler would otherwise divide twice per lane). A node is e / (El x ranks per node):
// floor(floor(e / El) / rpn) = floor(e / (El x rpn)) for non-negative integers.
int token_ranks(const std::int64_t* ids, int k, const Geometry& geometry, std::array<Destination, kMaxTopk>& out) {
  const int El = geometry.experts_per_rank();
  return distinct_targets(ids, k, [El](std::int64_t e) { return static_cast<int>(e) / El; }, out);
}

int token_nodes(const std::int64_t* ids, int k, const Geometry& geometry, std::array<Destination, kMaxTopk>& out) {
  const int per_node = geometry.experts_per_rank() * geometry.ranks_per_node();
  return distinct_targets(ids, k, [per_node](std::int64_t e) { return static_cast<int>(e) / per_node; }, out);
}

void count_local(const TopkRows& topk, const Geometry& geometry, LocalCounts& out, TokenRanks* ranks) {
  out.per_rank.assign(static_cast<size_t>(geometry.num_ranks), 0);
  out.per_expert.assign(static_cast<size_t>(geometry.num_experts), 0);
  out.per_node.assign(static_cast<size_t>(geometry.num_nodes), 0);
  if (ranks) {
    ranks->offset.assign(static_cast<size_t>(topk.num_tokens) + 1, 0);
    ranks->ranks.resize(static_cast<size_t>(topk.num_tokens) * static_cast<size_t>(std::min(topk.k, geometry.num_ranks)));
  }
  std::array<Destination, kMaxTopk> dests;
  std::size_t used = 0;
  for (int t = 0; t < topk.num_tokens; ++t) {
    const std::int64_t* ids = topk.row(t);
    for (int j = 0; j < topk.k; ++j)
      if (ids[j] >= 0) ++out.per_expert[static_cast<size_t>(ids[j])];
    const int nr = token_ranks(ids, topk.k, geometry, dests);
    for (int i = 0; i < nr; ++i) ++out.per_rank[static_cast<size_t>(dests[static_cast<size_t>(i)].target)];
    if (ranks) {
      std::copy(dests.begin(), dests.begin() + nr, ranks->ranks.begin() + static_cast<std::ptrdiff_t>(used));
      used += static_cast<std::size_t>(nr);
      ranks->offset[static_cast<size_t>(t) + 1] = static_cast<std::int32_t>(used);
    }
    const int nn = token_nodes(ids, topk.k, geometry, dests);
    for (int i = 0; i < nn; ++i) ++out.per_node[static_cast<size_t>(dests[static_cast<size_t>(i)].target)];
  }
}

void list_by_destination(const TokenRanks& ranks, std::span<const std::int32_t> per_rank, std::span<ListedToken> out) {
  std::vector<std::size_t> next(per_rank.size());
  std::size_t offset = 0;
  for (std::size_t d = 0; d < per_rank.size(); ++d) {
    next[d] = offset;
    offset += static_cast<std::size_t>(per_rank[d]);
  }
  const std::size_t tokens = ranks.offset.empty() ? 0 : ranks.offset.size() - 1;
  if (offset != out.size() || (tokens > 0 && static_cast<std::size_t>(ranks.offset.back()) != offset))
    throw StateError(fmt::format("list_by_destination: {} entries for {} rows", out.size(), offset));
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::int32_t i = ranks.offset[t]; i < ranks.offset[t + 1]; ++i) {
      const Destination& d = ranks.ranks[static_cast<size_t>(i)];
      out[next[static_cast<size_t>(d.target)]++] = {static_cast<std::int32_t>(t), d.master_lane};
    }
}

void GlobalLayout::reset(const Geometry& geometry, int alignment, int expert_stride) {
  geo_ = geometry;
  alignment_ = alignment;
  expert_stride_ = expert_stride;
  const auto R = static_cast<size_t>(geometry.num_ranks), E = static_cast<size_t>(geometry.num_experts),
             G = static_cast<size_t>(geometry.num_nodes);
  count_rank_.assign(R * R, 0);
  count_expert_.assign(R * E, 0);
  count_node_.assign(R * G, 0);
}

void GlobalLayout::finish() {
  const int R = geo_.num_ranks, E = geo_.num_experts, El = geo_.experts_per_rank();
  row_base_.resize(count_rank_.size());
  expanded_base_.resize(count_expert_.size());
  rows_at_.assign(static_cast<size_t>(R), 0);
  expanded_rows_at_.assign(static_cast<size_t>(R), 0);
  expert_total_.assign(static_cast<size_t>(E), 0);
  expert_start_.assign(static_cast<size_t>(E), 0);
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) {
      row_base_[idx(s, d, R)] = rows_at_[static_cast<size_t>(d)];
      rows_at_[static_cast<size_t>(d)] += count(s, d);
    }
    for (int e = 0; e < E; ++e) expert_total_[static_cast<size_t>(e)] += expert_count(s, e);
  }
  for (int d = 0; d < R; ++d) {
    std::int32_t start = 0;
    for (int i = 0; i < El; ++i) {
      const int e = d * El + i;
      expert_start_[static_cast<size_t>(e)] = start;
      const std::int32_t total = expert_total_[static_cast<size_t>(e)];
      start +=
          expert_stride_ > 0 ? expert_stride_ : static_cast<std::int32_t>(core::round_up<std::int64_t>(total, alignment_));
    }
    expanded_rows_at_[static_cast<size_t>(d)] = start;
  }
  for (int e = 0; e < E; ++e) {
    std::int32_t base = expert_start_[static_cast<size_t>(e)];
    for (int s = 0; s < R; ++s) {
      expanded_base_[idx(s, e, E)] = base;
      base += expert_count(s, e);
    }
  }
}

int GlobalLayout::expert_over_stride() const {
  if (expert_stride_ <= 0) return -1;
  for (int e = 0; e < geo_.num_experts; ++e)
    if (expert_total_[static_cast<size_t>(e)] > expert_stride_) return e;
  return -1;
}

void RowAssigner::start(const GlobalLayout& layout, int source) {
  geo_ = &layout.geometry();
  const int R = geo_->num_ranks, E = geo_->num_experts;
  rank_cursor_.resize(static_cast<size_t>(R));
  expert_cursor_.resize(static_cast<size_t>(E));
  for (int d = 0; d < R; ++d) rank_cursor_[static_cast<size_t>(d)] = layout.row_base(source, d);
  for (int e = 0; e < E; ++e) expert_cursor_[static_cast<size_t>(e)] = layout.expanded_base(source, e);
}

}  // namespace moe_ep::routing
