// Routing arithmetic of expert-parallel dispatch and combine. Pure: no I/O, no threads.
//
// Experts are owned contiguously: expert e lives on rank e / El (El = E / R), local index
// e % El; rank r lives on routing node r / (R / nodes). Expert id -1 means "no selection".
// A token goes to a rank once, however many of its experts live there; the *master lane* of a
// (token, rank) pair is the highest top-k position whose expert lives on that rank (likewise
// for (token, node)).
//
// Receive order is fixed: destination d stores the tokens of source 0, then source 1, ...;
// each source's tokens in ascending token index. Expanded (per-expert) layouts hold, for each
// local expert, its (token, lane) pairs in the same (source, token) order, each expert block
// padded to a multiple of the alignment, or (with a fixed expert stride S) local expert i's block
// starting at row i x S and holding at most S rows, the rest of it padding. Because every party
// derives rows from the same gathered counts in that order (RowAssigner over a source's tokens, or
// a receiver walking the source's list_by_destination group), sources, forwarders and receivers
// agree on every row without exchanging row indices.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "moe_ep/limits.hpp"

namespace moe_ep::routing {

struct Geometry {
  int num_ranks = 1;
  int num_experts = 1;
  int num_nodes = 1;  // routing nodes: logical scale-out domains

  int experts_per_rank() const { return num_experts / num_ranks; }
  int ranks_per_node() const { return num_ranks / num_nodes; }
  // Expert ids are below num_experts (an int): a 32-bit division, several times cheaper than a 64-bit one.
  int rank_of_expert(std::int64_t e) const { return static_cast<int>(e) / experts_per_rank(); }
  // Expert e's index among rank r's experts, or -1 when r does not own it (e < 0: no expert).
  int local_expert(std::int64_t e, int r) const {
    const std::int64_t first = std::int64_t{r} * experts_per_rank();
    return e >= first && e < first + experts_per_rank() ? static_cast<int>(e - first) : -1;
  }
  int node_of_rank(int r) const { return r / ranks_per_node(); }
};

// A [num_tokens, k] matrix of int64 expert ids; rows may be strided.
struct TopkRows {
  const std::int64_t* data = nullptr;
  std::int64_t row_stride = 0;
  int num_tokens = 0;
  int k = 0;
  const std::int64_t* row(int t) const { return data + static_cast<std::int64_t>(t) * row_stride; }
};

// Throws InvalidArgument naming topk_idx[t, j], its value and the limit, for an id outside
// [-1, num_experts) or an expert named twice in one row.
void validate_topk(std::string_view context, const TopkRows& topk, int num_experts);

struct Destination {
  int target;       // rank or node
  int master_lane;  // highest lane whose expert lives on target
};

// The distinct ranks (or nodes) a token goes to, ascending by master lane. Returns the count.
int token_ranks(const std::int64_t* ids, int k, const Geometry& geometry, std::array<Destination, kMaxTopk>& out);
int token_nodes(const std::int64_t* ids, int k, const Geometry& geometry, std::array<Destination, kMaxTopk>& out);

// Counts of one source's tokens.
struct LocalCounts {
  std::vector<std::int32_t> per_rank;    // [R] tokens with >= 1 expert on the rank
  std::vector<std::int32_t> per_expert;  // [E] (token, lane) pairs naming the expert
  std::vector<std::int32_t> per_node;    // [nodes] tokens with >= 1 expert on the node
};
// The distinct destination ranks of every token (token_ranks), as count_local found them.
struct TokenRanks {
  std::vector<std::int32_t> offset;  // [tokens + 1]: token t's ranks are ranks[offset[t], offset[t + 1])
  std::vector<Destination> ranks;
};
// With `ranks`, also records every token's destination ranks there.
void count_local(const TopkRows& topk, const Geometry& geometry, LocalCounts& out, TokenRanks* ranks = nullptr);

// A token of one source bound for one destination rank, and its master lane for that rank.
struct ListedToken {
  std::int32_t token;
  std::int32_t master_lane;
};
// A source's tokens grouped by destination rank: ranks ascending, each rank's tokens ascending,
// so entry i of rank d's group is the source's i-th row at d. `ranks` and `per_rank` are
// count_local's; `out` holds the sum of per_rank (StateError otherwise). Receivers read their
// group instead of every token of the source.
void list_by_destination(const TokenRanks& ranks, std::span<const std::int32_t> per_rank, std::span<ListedToken> out);

// Everyone's counts and the row bases derived from them.
class GlobalLayout {
 public:
  // expert_stride > 0: local expert i's block starts at expanded row i x expert_stride (at most
  // that many rows: a larger count is the caller's to refuse, see expert_over_stride), each rank
  // has El x expert_stride expanded rows; 0: blocks packed, each padded to the alignment.
  void reset(const Geometry& geometry, int alignment, int expert_stride = 0);
  // Source s's counts; call for every source, then finish().
  std::int32_t* per_rank_counts(int s) { return &count_rank_[idx(s, 0, geo_.num_ranks)]; }
  std::int32_t* per_expert_counts(int s) { return &count_expert_[idx(s, 0, geo_.num_experts)]; }
  std::int32_t* per_node_counts(int s) { return &count_node_[idx(s, 0, geo_.num_nodes)]; }
  void finish();

  const Geometry& geometry() const { return geo_; }
  int alignment() const { return alignment_; }
  int expert_stride() const { return expert_stride_; }
  // The first expert (global id) whose count exceeds the expert stride, or -1.
  int expert_over_stride() const;
  std::int32_t count(int src, int dst) const { return count_rank_[idx(src, dst, geo_.num_ranks)]; }
  std::int32_t expert_count(int src, int e) const { return count_expert_[idx(src, e, geo_.num_experts)]; }
  std::int32_t node_count(int src, int node) const { return count_node_[idx(src, node, geo_.num_nodes)]; }
  // First row of src's tokens at dst (non-expanded layout).
  std::int32_t row_base(int src, int dst) const { return row_base_[idx(src, dst, geo_.num_ranks)]; }
  // First expanded row of src's (token, e) pairs in expert e's block at e's rank.
  std::int32_t expanded_base(int src, int e) const { return expanded_base_[idx(src, e, geo_.num_experts)]; }
  std::int32_t rows_at(int dst) const { return rows_at_[static_cast<size_t>(dst)]; }
  std::int32_t expanded_rows_at(int dst) const { return expanded_rows_at_[static_cast<size_t>(dst)]; }
  std::int32_t expert_total(int e) const { return expert_total_[static_cast<size_t>(e)]; }  // unaligned
  std::int32_t expert_start(int e) const { return expert_start_[static_cast<size_t>(e)]; }  // at its rank

 private:
  static std::size_t idx(int a, int b, int n) { return static_cast<size_t>(a) * static_cast<size_t>(n) + static_cast<size_t>(b); }

  Geometry geo_;
  int alignment_ = 1;
  int expert_stride_ = 0;
  std::vector<std::int32_t> count_rank_, count_expert_, count_node_;
  std::vector<std::int32_t> row_base_, expanded_base_;
  std::vector<std::int32_t> rows_at_, expanded_rows_at_, expert_total_, expert_start_;
};

// Walks one source's tokens in ascending order and assigns their rows at the destinations.
class RowAssigner {
 public:
  void start(const GlobalLayout& layout, int source);
  // For the next token of the source (every token must be passed, in order, even when not
  // wanted): row_at_lane[j] = row at the rank of lane j's expert if j is that rank's master
  // lane, else -1; expanded_at_lane[j] = expanded row of (token, lane j), or -1 for id -1.
  // Only destinations for which want(rank) is true are advanced and filled (others get -1).
  template <class Want>
  void next(const std::int64_t* ids, int k, Want want, std::int32_t* row_at_lane, std::int32_t* expanded_at_lane) {
    std::array<Destination, kMaxTopk> dests;
    for (int j = 0; j < k; ++j) row_at_lane[j] = expanded_at_lane[j] = -1;
    const int n = token_ranks(ids, k, *geo_, dests);
    for (int i = 0; i < n; ++i)
      if (want(dests[static_cast<size_t>(i)].target))
        row_at_lane[dests[static_cast<size_t>(i)].master_lane] = rank_cursor_[static_cast<size_t>(dests[static_cast<size_t>(i)].target)]++;
    for (int j = 0; j < k; ++j) {
      if (ids[j] < 0 || !want(geo_->rank_of_expert(ids[j]))) continue;
      expanded_at_lane[j] = expert_cursor_[static_cast<size_t>(ids[j])]++;
    }
  }

 private:
  const Geometry* geo_ = nullptr;
  std::vector<std::int32_t> rank_cursor_, expert_cursor_;
};

}  // namespace moe_ep::routing
