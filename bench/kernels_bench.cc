// Micro-benchmarks of the row kernels, each beside a memcpy of the same bytes as its baseline, and
// of the routing arithmetic of one dispatch (per token of a rank, single-threaded).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/reduce.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/limits.hpp"
#include "routing/handle_plan.hh"
#include "routing/plan.hh"

namespace {

constexpr std::int64_t kHidden = 7168;

// Sum of k BF16 rows (combine's inner loop) over many tokens: reads k rows, writes one.
void BM_SumBf16Rows(benchmark::State& state) {
  const int k = static_cast<int>(state.range(0));
  const int tokens = 256;
  std::vector<std::uint16_t> in(static_cast<size_t>(tokens) * k * kHidden, 0x3f80), out(static_cast<size_t>(tokens) * kHidden);
  std::vector<const std::uint16_t*> rows(static_cast<size_t>(k));
  for (auto _ : state) {
    for (int t = 0; t < tokens; ++t) {
      for (int i = 0; i < k; ++i) rows[static_cast<size_t>(i)] = &in[(static_cast<size_t>(t) * k + i) * kHidden];
      moe_ep::core::sum_bf16_rows(rows, &out[static_cast<size_t>(t) * kHidden], kHidden);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * tokens * (k + 1) * kHidden * 2);
}
BENCHMARK(BM_SumBf16Rows)->Arg(1)->Arg(2)->Arg(4)->Arg(8);

// Baseline: copying the same number of bytes.
void BM_Memcpy(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  std::vector<char> a(bytes, 1), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes) * 2);
}
BENCHMARK(BM_Memcpy)->Arg(8)->Arg(64);

void BM_QuantizeFp8(benchmark::State& state) {
  moe_ep::Tensor x = moe_ep::Tensor::zeros({256, kHidden}, moe_ep::DType::kBF16);
  for (auto _ : state) benchmark::DoNotOptimize(moe_ep::quantize_fp8(x));
  state.SetBytesProcessed(state.iterations() * 256 * kHidden * 3);
}
BENCHMARK(BM_QuantizeFp8);

// DeepSeek-V3 routing on 8 ranks: 4096 tokens, 256 experts, top-8, experts drawn uniformly.
struct Routing {
  static constexpr int kTokens = 4096, kTopk = 8;
  moe_ep::routing::Geometry geo{8, 256, 1};
  std::vector<std::int64_t> ids;
  Routing() : ids(static_cast<size_t>(kTokens) * kTopk) {
    std::mt19937 rng(1);
    std::vector<std::int64_t> experts(static_cast<size_t>(geo.num_experts));
    std::iota(experts.begin(), experts.end(), 0);
    for (int t = 0; t < kTokens; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      std::copy_n(experts.begin(), kTopk, ids.begin() + static_cast<std::ptrdiff_t>(t) * kTopk);
    }
  }
  moe_ep::routing::TopkRows rows() const { return {ids.data(), kTopk, kTokens, kTopk}; }
};

// The destination ranks of every token (the per-token step of counting and planning).
void BM_TokenRanks(benchmark::State& state) {
  const Routing r;
  std::array<moe_ep::routing::Destination, moe_ep::kMaxTopk> dests;
  for (auto _ : state)
    for (int t = 0; t < Routing::kTokens; ++t)
      benchmark::DoNotOptimize(moe_ep::routing::token_ranks(r.rows().row(t), Routing::kTopk, r.geo, dests));
  state.SetItemsProcessed(state.iterations() * Routing::kTokens);
}
BENCHMARK(BM_TokenRanks);

// A rank's counts (ranks, experts, nodes) of its tokens.
void BM_CountLocal(benchmark::State& state) {
  const Routing r;
  moe_ep::routing::LocalCounts counts;
  for (auto _ : state) moe_ep::routing::count_local(r.rows(), r.geo, counts);
  state.SetItemsProcessed(state.iterations() * Routing::kTokens);
}
BENCHMARK(BM_CountLocal);

// One rank's whole routing plan of a new dispatch on one node of 8 ranks: its counts and list,
// the layout from every rank's counts, its sources' rows, and its receive plan from the 8 lists.
void BM_DispatchPlan(benchmark::State& state) {
  namespace routing = moe_ep::routing;
  const Routing r;
  constexpr int kRanks = 8, me = 3;
  // Every rank routes the same tokens (the plan's work depends on the counts, not on which).
  routing::LocalCounts counts;
  routing::TokenRanks ranks;
  std::vector<routing::ListedToken> listed;
  routing::RoutingPlan plan;
  const routing::PlanningRank planner{.rank = me, .physical_scaleup = kRanks};
  for (auto _ : state) {
    routing::count_local(r.rows(), r.geo, counts, &ranks);
    listed.resize(static_cast<size_t>(std::accumulate(counts.per_rank.begin(), counts.per_rank.end(), 0)));
    routing::list_by_destination(ranks, counts.per_rank, listed);
    plan.layout.reset(r.geo, 1);
    for (int s = 0; s < kRanks; ++s) {
      std::copy(counts.per_rank.begin(), counts.per_rank.end(), plan.layout.per_rank_counts(s));
      std::copy(counts.per_expert.begin(), counts.per_expert.end(), plan.layout.per_expert_counts(s));
      std::copy(counts.per_node.begin(), counts.per_node.end(), plan.layout.per_node_counts(s));
    }
    plan.layout.finish();
    routing::plan_sources(plan, r.rows(), planner, listed);
    routing::start_receive_plan(plan, Routing::kTopk, planner);
    const std::vector<routing::LocalSource> sources(kRanks, routing::LocalSource{r.rows(), listed.data()});
    routing::plan_receive_local(plan, planner, sources);
    benchmark::DoNotOptimize(plan.rows.data());
  }
  state.SetItemsProcessed(state.iterations() * Routing::kTokens);
}
BENCHMARK(BM_DispatchPlan)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
