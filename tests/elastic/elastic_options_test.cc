// ElasticBuffer options of docs/semantics.md §3 and §5 that change where data lives or when it
// moves: do_handle_copy (the handle holds a copy of topk_idx, or the caller's tensor) and
// previous_event_before_epilogue (dispatch and combine write no output before the caller's event
// completes), on one node and across two. Every output is checked against the dense reference.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "moe_ep/elastic_buffer.hpp"
#include "reference/dense_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace elastic_options_test {

using reference::CaseSpec;
using reference::RankInputs;
using testing::collect_on_ranks;
using testing::RankProblems;
using testing::report_problems;

constexpr int kRanks = 4, kExperts = 16, kTopk = 4, kTokens = 8, kHidden = 128;

CaseSpec spec_for(int scaleout, std::uint64_t seed) {
  CaseSpec s;
  s.ranks = kRanks;
  s.scaleout = scaleout;
  s.num_experts = kExperts;
  s.k = kTopk;
  s.max_tokens = kTokens;
  s.hidden = kHidden;
  s.seed = seed;
  s.mask_ratio = 0.2;
  s.num_bias = 1;
  for (int r = 0; r < kRanks; ++r) s.tokens.push_back(kTokens - r);  // every rank has tokens
  return s;
}

// One rank's side of a case: its buffer, every rank's inputs (the reference's), its own, and views
// of them.
struct RankCase {
  int me;
  ElasticBuffer b;
  std::vector<RankInputs> all;
  RankInputs& in;
  std::int64_t n;
  TensorView x, topk, weights;
  RankCase(Group& g, const CaseSpec& s)
      : me(g.rank()),
        b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk}),
        all(reference::make_all_inputs(s)),
        in(all[static_cast<size_t>(me)]),
        n(in.num_tokens),
        x(in.x.data(), DType::kBF16, {n, kHidden}),
        topk(in.topk.data(), DType::kInt64, {n, kTopk}),
        weights(in.weights.data(), DType::kFP32, {n, kTopk}) {}
};

// Compact dispatch outputs against the reference (worst_case: outputs of num_max_tokens_per_rank x
// ranks rows, the received ones first and ids -1 after them).
void check_dispatch(const CaseSpec& s, const std::vector<RankInputs>& all, int me, const DispatchResult& r,
                    const std::string& what, std::vector<std::string>& bad, bool worst_case = false) {
  const auto ref = reference::reference_dispatch(s, all, me);
  if (worst_case) {
    if (r.recv_x.size(0) != std::int64_t{kTokens} * kRanks) {
      bad.push_back(fmt::format("{}: {} rows, expected the worst case {}", what, r.recv_x.size(0), kTokens * kRanks));
      return;
    }
    for (std::int64_t i = static_cast<std::int64_t>(ref.rows.size()) * kTopk; i < r.recv_topk_idx.numel(); ++i)
      if (r.recv_topk_idx.data_as<std::int64_t>()[i] != -1) {
        bad.push_back(fmt::format("{}: recv_topk_idx past the received rows is not -1", what));
        break;
      }
  } else if (r.recv_x.size(0) != static_cast<std::int64_t>(ref.rows.size())) {
    bad.push_back(fmt::format("{}: {} rows, expected {}", what, r.recv_x.size(0), ref.rows.size()));
    return;
  }
  for (std::size_t i = 0; i < ref.rows.size(); ++i) {
    const auto& row = ref.rows[i];
    const RankInputs& src = all[static_cast<size_t>(row.source)];
    if (std::memcmp(r.recv_x.data_as<std::uint16_t>() + i * kHidden, src.x.data() + static_cast<size_t>(row.token) * kHidden * 2,
                    kHidden * 2) != 0)
      bad.push_back(fmt::format("{}: recv_x row {} is not rank {} token {}", what, i, row.source, row.token));
    for (int j = 0; j < kTopk; ++j) {
      if (r.recv_topk_idx.data_as<std::int64_t>()[i * kTopk + j] != row.local_ids[static_cast<size_t>(j)])
        bad.push_back(fmt::format("{}: recv_topk_idx[{}, {}]", what, i, j));
      if (r.recv_topk_weights.data_as<float>()[i * kTopk + j] != src.weights[static_cast<size_t>(row.token * kTopk + j)])
        bad.push_back(fmt::format("{}: recv_topk_weights[{}, {}]", what, i, j));
    }
  }
}

// Expanded dispatch outputs: every row the reference places is its token's, with its lane's weight.
void check_expanded(const CaseSpec& s, const std::vector<RankInputs>& all, int me, const DispatchResult& r,
                    const std::string& what, std::vector<std::string>& bad) {
  const auto ref = reference::reference_dispatch(s, all, me);
  if (r.recv_x.size(0) < ref.expanded_rows) {
    bad.push_back(fmt::format("{}: {} rows, fewer than the reference's {}", what, r.recv_x.size(0), ref.expanded_rows));
    return;
  }
  for (int i = 0; i < ref.expanded_rows; ++i) {
    const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(i)];
    if (owner < 0) continue;
    const auto& row = ref.rows[static_cast<size_t>(owner)];
    const RankInputs& src = all[static_cast<size_t>(row.source)];
    if (std::memcmp(r.recv_x.data_as<std::uint16_t>() + i * kHidden,
                    src.x.data() + static_cast<size_t>(row.token) * kHidden * 2, kHidden * 2) != 0 ||
        r.recv_topk_weights.data_as<float>()[i] != src.weights[static_cast<size_t>(row.token * kTopk + lane)])
      bad.push_back(fmt::format("{}: expanded row {} is not rank {} token {} lane {}", what, i, row.source, row.token, lane));
  }
}

// Expert outputs for the compact rows of `r`, and the weights returned with them.
struct ExpertRows {
  Tensor y, weights;
};
ExpertRows expert_rows(const CaseSpec& s, const std::vector<RankInputs>& all, int me, const DispatchResult& r) {
  const auto ref = reference::reference_dispatch(s, all, me);
  ExpertRows out{Tensor::empty({r.recv_x.size(0), kHidden}, DType::kBF16), Tensor::empty({r.recv_x.size(0), kTopk}, DType::kFP32)};
  for (std::size_t i = 0; i < ref.rows.size(); ++i) {
    for (int h = 0; h < kHidden; ++h)
      out.y.data_as<std::uint16_t>()[i * kHidden + h] = s.value(me, -1, ref.rows[i].source * kTokens + ref.rows[i].token, h);
    for (int j = 0; j < kTopk; ++j)
      out.weights.data_as<float>()[i * kTopk + j] = r.recv_topk_weights.data_as<float>()[i * kTopk + j];
  }
  return out;
}

void check_combine(const CaseSpec& s, const std::vector<RankInputs>& all, int me, const CombineResult& c,
                   const std::string& what, std::vector<std::string>& bad) {
  const auto ref = reference::reference_combine(s, all, me, 1.0f);
  const std::int64_t n = all[static_cast<size_t>(me)].num_tokens;
  if (std::memcmp(c.combined_x.data(), ref.x.data(), static_cast<size_t>(n) * kHidden * 2) != 0)
    bad.push_back(what + ": combined_x differs from the reference");
  if (std::memcmp(c.combined_topk_weights.data(), ref.weights.data(), static_cast<size_t>(n) * kTopk * 4) != 0)
    bad.push_back(what + ": combined_topk_weights differ from the reference");
}

// Every rank's problems as test failures, each under `what` and naming its rank.
void report(const RankProblems& failures, const std::string& what) {
  report_problems(failures, {.context = what, .name_rank = true});
}

TEST(ElasticOptions, HandleHoldsACopyOfTopkOrTheCallersTensor) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = spec_for(scaleout, 11 + scaleout);
    const auto failures = collect_on_ranks(kRanks, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      RankCase rank_case(g, s);
      auto& [me, b, all, in, n, x, topk_view, weights] = rank_case;
      Tensor topk = Tensor::empty({n, kTopk}, DType::kInt64);
      std::memcpy(topk.data(), in.topk.data(), in.topk.size() * sizeof(std::int64_t));
      DispatchArgs a{.x = x,
                     .topk_idx = topk,
                     .topk_weights = weights,
                     .num_experts = kExperts};
      const DispatchResult copied = b.dispatch(a);
      a.do_handle_copy = false;
      const DispatchResult shared = b.dispatch(a);
      const Tensor& h1 = copied.handle->topk_idx;
      const Tensor& h2 = shared.handle->topk_idx;
      if (!h1.defined() || h1.dtype() != DType::kInt64 || h1.ndim() != 2 || h1.size(0) != n || h1.size(1) != kTopk) {
        bad.push_back("do_handle_copy = true: handle.topk_idx is not int64 [N, k]");
      } else {
        if (h1.data() == topk.data()) bad.push_back("do_handle_copy = true: handle.topk_idx is the caller's tensor, not a copy");
        bool same = true;
        for (std::int64_t t = 0; t < n; ++t)
          for (int j = 0; j < kTopk; ++j)
            same &= h1.data_as<std::int64_t>()[t * h1.stride(0) + j * h1.stride(1)] == in.topk[static_cast<size_t>(t * kTopk + j)];
        if (!same) bad.push_back("do_handle_copy = true: the copy differs from topk_idx");
      }
      if (!h2.defined() || h2.data() != topk.data() || h2.size(0) != n || h2.size(1) != kTopk)
        bad.push_back("do_handle_copy = false: handle.topk_idx is not the caller's tensor");
      check_dispatch(s, all, me, copied, "do_handle_copy = true", bad);
      check_dispatch(s, all, me, shared, "do_handle_copy = false", bad);

      // The copy keeps the routing when the caller's tensor changes (every peer is done with it:
      // the dispatches returned); without the copy the caller keeps it unchanged.
      b.barrier();
      std::fill(topk.data_as<std::int64_t>(), topk.data_as<std::int64_t>() + n * kTopk, std::int64_t{-1});
      const ExpertRows y1 = expert_rows(s, all, me, copied);
      const CombineResult c1 = b.combine({.x = y1.y, .handle = copied.handle, .topk_weights = y1.weights,
                                          .bias = {TensorView(in.bias[0].data(), DType::kBF16, {n, kHidden})}});
      check_combine(s, all, me, c1, "do_handle_copy = true, caller's topk_idx overwritten", bad);
      b.barrier();
      std::memcpy(topk.data(), in.topk.data(), in.topk.size() * sizeof(std::int64_t));
      b.barrier();
      const ExpertRows y2 = expert_rows(s, all, me, shared);
      const CombineResult c2 = b.combine({.x = y2.y, .handle = shared.handle, .topk_weights = y2.weights,
                                          .bias = {TensorView(in.bias[0].data(), DType::kBF16, {n, kHidden})}});
      check_combine(s, all, me, c2, "do_handle_copy = false", bad);
    });
    report(failures, fmt::format("{} nodes", scaleout));
  }
}

// How long a call whose event is held back must stay incomplete before the test lets it go. Only
// a library that ignored the event could complete within it; the check never fails otherwise.
constexpr double kHeldSeconds = 0.5;

template <class T>
void poison(const Tensor& t, T value) {
  if (!t.defined()) return;
  std::fill(t.data_as<T>(), t.data_as<T>() + t.numel(), value);
}

TEST(ElasticOptions, NoOutputIsWrittenBeforeThePreviousEventBeforeEpilogue) {
  for (int scaleout : {1, 2}) {
    const CaseSpec s = spec_for(scaleout, 21 + scaleout);
    const auto failures = collect_on_ranks(kRanks, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
      RankCase rank_case(g, s);
      auto& [me, b, all, in, n, x, topk, weights] = rank_case;
      // Dispatch: with CPU sync the call returns once the count exchange sized the outputs; the
      // rows must wait for the event.
      Event before_dispatch_epilogue = Event::pending();
      const DispatchResult r = b.dispatch({.x = x,
                                           .topk_idx = topk,
                                           .topk_weights = weights,
                                           .num_experts = kExperts,
                                           .previous_event_before_epilogue = before_dispatch_epilogue,
                                           .async_with_compute_stream = true});
      poison<std::uint16_t>(r.recv_x, 0x7fc1);
      poison<std::int64_t>(r.recv_topk_idx, -7);
      poison<float>(r.recv_topk_weights, -3.0f);
      if (r.event.wait_for(kHeldSeconds)) bad.push_back("dispatch completed before previous_event_before_epilogue");
      before_dispatch_epilogue.complete();
      r.event.wait();
      check_dispatch(s, all, me, r, "dispatch after previous_event_before_epilogue", bad);

      const ExpertRows y = expert_rows(s, all, me, r);
      Event before_combine_epilogue = Event::pending();
      const CombineResult c = b.combine({.x = y.y,
                                         .handle = r.handle,
                                         .topk_weights = y.weights,
                                         .bias = {TensorView(in.bias[0].data(), DType::kBF16, {n, kHidden})},
                                         .previous_event_before_epilogue = before_combine_epilogue,
                                         .async_with_compute_stream = true});
      poison<std::uint16_t>(c.combined_x, 0x7fc1);
      poison<float>(c.combined_topk_weights, -3.0f);
      if (c.event.wait_for(kHeldSeconds)) bad.push_back("combine completed before previous_event_before_epilogue");
      before_combine_epilogue.complete();
      c.event.wait();
      check_combine(s, all, me, c, "combine after previous_event_before_epilogue", bad);
    });
    report(failures, fmt::format("{} nodes", scaleout));
  }
}

// Calls whose outputs are allocated before any exchange (cached dispatch; expanded dispatch
// without CPU sync) and the combine of an expanded handle hold their outputs back the same way.
TEST(ElasticOptions, CachedAndWorstCaseCallsWaitForThePreviousEventBeforeEpilogue) {
  CaseSpec s = spec_for(2, 31);
  s.expand = true;
  s.alignment = 2;
  const auto failures = collect_on_ranks(kRanks, {.num_scaleout = 2}, [&](Group& g, std::vector<std::string>& bad) {
    RankCase rank_case(g, s);
    auto& [me, b, all, in, n, x, topk, weights] = rank_case;
    CaseSpec compact = s;
    compact.expand = false;
    compact.alignment = 1;
    const DispatchResult first = b.dispatch({.x = x, .topk_idx = topk, .topk_weights = weights, .num_experts = kExperts});

    Event gate = Event::pending();
    const DispatchResult cached = b.dispatch({.x = x, .topk_weights = weights, .previous_event_before_epilogue = gate,
                                              .async_with_compute_stream = true, .handle = first.handle});
    poison<std::uint16_t>(cached.recv_x, 0x7fc1);
    poison<std::int64_t>(cached.recv_topk_idx, -7);
    poison<float>(cached.recv_topk_weights, -3.0f);
    if (cached.event.wait_for(kHeldSeconds)) bad.push_back("cached dispatch completed before previous_event_before_epilogue");
    gate.complete();
    cached.event.wait();
    check_dispatch(compact, all, me, cached, "cached dispatch after previous_event_before_epilogue", bad);

    // Expanded, worst-case shapes: the rows land at the reference's expanded positions.
    Event gate2 = Event::pending();
    const DispatchResult worst = b.dispatch({.x = x, .topk_idx = topk, .topk_weights = weights, .num_experts = kExperts,
                                             .expert_alignment = s.alignment, .previous_event_before_epilogue = gate2,
                                             .async_with_compute_stream = true, .do_cpu_sync = false, .do_expand = true});
    poison<std::uint16_t>(worst.recv_x, 0x7fc1);
    poison<float>(worst.recv_topk_weights, -3.0f);
    if (worst.event.wait_for(kHeldSeconds)) bad.push_back("expanded dispatch completed before previous_event_before_epilogue");
    gate2.complete();
    worst.event.wait();
    check_expanded(s, all, me, worst, "expanded dispatch after previous_event_before_epilogue", bad);
    const auto ref = reference::reference_dispatch(s, all, me);
    Tensor y = Tensor::zeros({worst.recv_x.size(0), kHidden}, DType::kBF16);
    for (int r = 0; r < ref.expanded_rows; ++r) {
      const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(r)];
      if (owner < 0) continue;
      const auto& row = ref.rows[static_cast<size_t>(owner)];
      const int local = static_cast<int>(row.local_ids[static_cast<size_t>(lane)]);
      for (int h = 0; h < kHidden; ++h)
        y.data_as<std::uint16_t>()[r * kHidden + h] = s.value(me, local, row.source * kTokens + row.token, h);
    }

    Event gate3 = Event::pending();
    const CombineResult c = b.combine({.x = y,
                                       .handle = worst.handle,
                                       .topk_weights = worst.recv_topk_weights,
                                       .bias = {TensorView(in.bias[0].data(), DType::kBF16, {n, kHidden})},
                                       .previous_event_before_epilogue = gate3,
                                       .async_with_compute_stream = true});
    poison<std::uint16_t>(c.combined_x, 0x7fc1);
    poison<float>(c.combined_topk_weights, -3.0f);
    if (c.event.wait_for(kHeldSeconds)) bad.push_back("expanded combine completed before previous_event_before_epilogue");
    gate3.complete();
    c.event.wait();
    check_combine(s, all, me, c, "expanded combine after previous_event_before_epilogue", bad);
  });
  report(failures, "2 nodes");
}

// Ranks that differ in do_cpu_sync (exact outputs on even ranks, worst-case ones on odd ranks)
// dispatch together: every rank's rows are the reference's, in outputs of its own kind.
// Compact and expanded: the expanded CPU-synced outputs are allocated after the agreement, the
// others before it.
TEST(ElasticOptions, RanksMayDifferInCpuSync) {
  for (const bool expand : {false, true}) {
    CaseSpec s = spec_for(1, 51);
    s.expand = expand;
    const auto failures = collect_on_ranks(kRanks, {.num_scaleout = 1}, [&](Group& g, std::vector<std::string>& bad) {
      RankCase rank_case(g, s);
      auto& [me, b, all, in, n, x, topk, weights] = rank_case;
      const bool sync = me % 2 == 0;
      const DispatchResult r = b.dispatch({.x = x,
                                           .topk_idx = topk,
                                           .topk_weights = weights,
                                           .num_experts = kExperts, .do_cpu_sync = sync, .do_expand = expand});
      const std::string what = fmt::format("do_cpu_sync = {}, do_expand = {}", sync, expand);
      if (expand) {
        check_expanded(s, all, me, r, what, bad);
      } else {
        check_dispatch(s, all, me, r, what, bad, !sync);
      }
    });
    report(failures, expand ? "expanded" : "compact");
  }
}

// Only rank 0 holds its writes back; its node peers, whose calls have no event, write their rows
// into its outputs (push) only once it passed its event: until then its outputs keep the bytes it
// put there. New (CPU-synced) and cached dispatches, one node.
TEST(ElasticOptions, PeersDoNotWriteIntoOutputsWhoseCallerHoldsThemBack) {
  const CaseSpec s = spec_for(1, 41);
  const auto failures = collect_on_ranks(kRanks, {.num_scaleout = 1}, [&](Group& g, std::vector<std::string>& bad) {
    RankCase rank_case(g, s);
    auto& [me, b, all, in, n, x, topk, weights] = rank_case;
    std::shared_ptr<EPHandle> handle;
    for (const bool cached : {false, true}) {
      const std::string what = cached ? "cached dispatch" : "dispatch";
      Event gate = Event::pending();
      DispatchArgs a{.x = x, .topk_weights = weights, .async_with_compute_stream = true};
      if (cached) {
        a.handle = handle;
      } else {
        a.topk_idx = topk;
        a.num_experts = kExperts;
      }
      if (me == 0) a.previous_event_before_epilogue = gate;
      const DispatchResult r = b.dispatch(a);
      if (me == 0) {
        poison<std::uint16_t>(r.recv_x, 0x7fc1);
        if (r.event.wait_for(kHeldSeconds)) bad.push_back(what + " completed before previous_event_before_epilogue");
        const auto* row = r.recv_x.data_as<std::uint16_t>();
        if (std::any_of(row, row + r.recv_x.numel(), [](std::uint16_t v) { return v != 0x7fc1; }))
          bad.push_back(what + ": a peer wrote into rank 0's outputs before its previous_event_before_epilogue");
        gate.complete();
      }
      r.event.wait();
      check_dispatch(s, all, me, r, what + " after rank 0's previous_event_before_epilogue", bad);
      if (!cached) handle = r.handle;
    }
  });
  report(failures, "1 node");
}

}  // namespace elastic_options_test
}  // namespace moe_ep
