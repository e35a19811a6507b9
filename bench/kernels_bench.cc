// Micro-benchmarks of the row kernels, each beside a memcpy of the same bytes as its baseline, and
// of the routing arithmetic of one dispatch (per token of a rank, single-threaded).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/fp8_rows.hh"
#include "core/logfmt_rows.hh"
#include "core/nvfp4_rows.hh"
#include "core/reduce.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/dtype.hpp"
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

// The two streaming row kernels of a combine on the same rows: 6 rows per token (a token's ranks
// at top-8 over 8 ranks, on average), 0: sum_bf16_rows_streaming (the shared-window baseline's),
// 1: sum_bf16_terms_streaming with one row per term (V2 combine's, compact layout).
void BM_CombineRowKernels(benchmark::State& state) {
  constexpr int k = 6, tokens = 512;
  std::vector<std::uint16_t> in(static_cast<size_t>(tokens) * k * kHidden, 0x3f80);
  alignas(64) static std::uint16_t out[static_cast<size_t>(tokens) * kHidden];
  std::vector<const std::uint16_t*> rows(static_cast<size_t>(k));
  std::vector<moe_ep::core::Bf16Term> terms(static_cast<size_t>(k));
  for (auto _ : state) {
    for (int t = 0; t < tokens; ++t) {
      for (int i = 0; i < k; ++i) rows[static_cast<size_t>(i)] = &in[(static_cast<size_t>(t) * k + i) * kHidden];
      for (int i = 0; i < k; ++i) terms[static_cast<size_t>(i)].rows = {&rows[static_cast<size_t>(i)], 1};
      if (state.range(0) == 0)
        moe_ep::core::sum_bf16_rows_streaming(rows, &out[static_cast<size_t>(t) * kHidden], kHidden);
      else
        moe_ep::core::sum_bf16_terms_streaming(terms, &out[static_cast<size_t>(t) * kHidden], kHidden);
    }
    moe_ep::core::streaming_fence();
    benchmark::DoNotOptimize(out);
  }
  state.SetBytesProcessed(state.iterations() * tokens * (k + 1) * kHidden * 2);
  state.SetLabel(state.range(0) == 0 ? "rows" : "terms");
}
BENCHMARK(BM_CombineRowKernels)->Arg(0)->Arg(1);

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

// A push dispatch's memory traffic on one thread: each 7488-byte row (FP8 payload, scales and
// metadata of DeepSeek-V3) read once from a 64 MiB source and written with non-temporal stores
// into `fan_out` destination buffers; fan-out 1 is the streaming copy the bench's floor prices.
// Counters: bytes read (once each) and written per second.
void BM_FanOutCopy(benchmark::State& state) {
  const int fan_out = static_cast<int>(state.range(0));
  constexpr std::size_t kRow = 7488;
  const std::size_t rows = (std::size_t{64} << 20) / kRow;
  std::vector<char> src(rows * kRow, 1);
  std::vector<std::vector<char>> dst(static_cast<size_t>(fan_out), std::vector<char>(rows * kRow, 0));
  for (auto _ : state) {
    for (std::size_t r = 0; r < rows; ++r)
      for (auto& d : dst) moe_ep::core::copy_bytes_streaming(d.data() + r * kRow, src.data() + r * kRow, kRow);
    moe_ep::core::streaming_fence();
    benchmark::DoNotOptimize(dst.front().data());
  }
  const double read = static_cast<double>(state.iterations()) * static_cast<double>(rows * kRow);
  state.counters["read_GBps"] = benchmark::Counter(read / 1e9, benchmark::Counter::kIsRate);
  state.counters["written_GBps"] = benchmark::Counter(read * fan_out / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_FanOutCopy)->Arg(1)->Arg(5)->Unit(benchmark::kMillisecond);

void BM_QuantizeFp8(benchmark::State& state) {
  moe_ep::Tensor x = moe_ep::Tensor::zeros({256, kHidden}, moe_ep::DType::kBF16);
  for (auto _ : state) benchmark::DoNotOptimize(moe_ep::quantize_fp8(x));
  state.SetBytesProcessed(state.iterations() * 256 * kHidden * 3);
}
BENCHMARK(BM_QuantizeFp8);

// The low-latency dispatch's row casts: FP8 (per-128 scales) and NVFP4 (16-element blocks, E4M3
// scales), on N(0, 1) BF16 rows, beside a memcpy of the BF16 row (the BF16 dispatch's staging).
std::vector<std::uint16_t> normal_bf16_rows(int rows) {
  std::vector<std::uint16_t> x(static_cast<size_t>(rows) * kHidden);
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = moe_ep::float_to_bf16(normal(gen));
  return x;
}
void BM_CastRow(benchmark::State& state) {
  const int rows = 32, kind = static_cast<int>(state.range(0));
  const auto x = normal_bf16_rows(rows);
  std::vector<std::uint8_t> q(static_cast<size_t>(kHidden) * 2), scales(kHidden);
  const moe_ep::core::Nvfp4Cast nvfp4{.global_scale = 1.0f};
  for (auto _ : state) {
    for (int t = 0; t < rows; ++t) {
      const std::uint16_t* row = &x[static_cast<size_t>(t) * kHidden];
      if (kind == 0) std::memcpy(q.data(), row, kHidden * 2);
      if (kind == 1) moe_ep::core::cast_row_fp8(row, kHidden, false, false, q.data(), reinterpret_cast<std::byte*>(scales.data()));
      if (kind == 2) moe_ep::core::cast_row_nvfp4(row, kHidden, nvfp4, q.data(), scales.data());
      if (kind == 3 && !moe_ep::core::cast_row_fp8_on(moe_ep::core::Isa::kAvx2, row, kHidden, false, false, q.data(),
                                                      reinterpret_cast<std::byte*>(scales.data())))
        return state.SkipWithError("this CPU has no AVX2");
    }
    benchmark::DoNotOptimize(q.data());
  }
  state.SetLabel(kind == 0 ? "memcpy" : kind == 1 ? "fp8" : kind == 2 ? "nvfp4" : "fp8 on AVX2");
  state.SetItemsProcessed(state.iterations() * rows * kHidden);
}
// 3: the FP8 cast's AVX2 path, which cast_row_fp8 (1) takes only on CPUs without AVX-512.
BENCHMARK(BM_CastRow)->Arg(0)->Arg(1)->Arg(2)->Arg(3);

// LogFMT rows: expert outputs of N(0, 0.1) values (every chunk castable), one token's top-8.
struct LogfmtRows {
  static constexpr int kRows = 8;
  std::vector<std::uint16_t> bf16;
  std::vector<std::byte> encoded;
  std::vector<float> weights;
  LogfmtRows() : bf16(static_cast<size_t>(kRows) * kHidden), encoded(static_cast<size_t>(kRows) * moe_ep::core::logfmt_max_row_bytes(kHidden)) {
    std::mt19937 rng(2);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (auto& x : bf16) x = moe_ep::float_to_bf16(normal(rng));
    for (int r = 0; r < kRows; ++r) {
      moe_ep::core::logfmt_encode_row(row(r), kHidden, encoded_row(r));
      weights.push_back(0.125f + 0.01f * static_cast<float>(r));
    }
  }
  const std::uint16_t* row(int r) const { return bf16.data() + static_cast<size_t>(r) * kHidden; }
  std::byte* encoded_row(int r) { return encoded.data() + static_cast<size_t>(r) * moe_ep::core::logfmt_max_row_bytes(kHidden); }
};

// Arg: the instruction set (0 scalar, 1 AVX2, 2 AVX-512); skipped where this CPU lacks it.
bool select_logfmt_isa(benchmark::State& state) {
  const moe_ep::core::LogfmtIsa isa[] = {moe_ep::core::LogfmtIsa::kScalar, moe_ep::core::LogfmtIsa::kAvx2,
                                         moe_ep::core::LogfmtIsa::kAvx512};
  if (moe_ep::core::logfmt_select_isa(isa[state.range(0)])) return true;
  state.SkipWithError("this CPU lacks the instruction set");
  return false;
}

// One row encoded (meta, codes, packing), per row.
void BM_LogfmtEncodeRow(benchmark::State& state) {
  if (!select_logfmt_isa(state)) return;
  LogfmtRows rows;
  for (auto _ : state) benchmark::DoNotOptimize(moe_ep::core::logfmt_encode_row(rows.row(0), kHidden, rows.encoded_row(1)));
  state.SetItemsProcessed(state.iterations() * kHidden);
  moe_ep::core::logfmt_select_isa(moe_ep::core::LogfmtIsa::kAuto);
}
BENCHMARK(BM_LogfmtEncodeRow)->Arg(0)->Arg(1)->Arg(2);

// One encoded row decoded to FP32, per row.
void BM_LogfmtDecodeRow(benchmark::State& state) {
  if (!select_logfmt_isa(state)) return;
  LogfmtRows rows;
  std::vector<float> out(kHidden);
  for (auto _ : state) {
    moe_ep::core::logfmt_decode_row(rows.encoded_row(0), kHidden, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * kHidden);
  moe_ep::core::logfmt_select_isa(moe_ep::core::LogfmtIsa::kAuto);
}
BENCHMARK(BM_LogfmtDecodeRow)->Arg(0)->Arg(1)->Arg(2);

// One token of the LogFMT combine: 8 rows weighted and summed, read in place (encoded and decoded
// by the reader: range(1) = 0) or encoded (range(1) = 1); items = row elements.
void BM_LogfmtWeightedSum(benchmark::State& state) {
  if (!select_logfmt_isa(state)) return;
  LogfmtRows rows;
  std::vector<moe_ep::core::LogfmtRow> in;
  for (int r = 0; r < LogfmtRows::kRows; ++r)
    in.push_back(state.range(1) ? moe_ep::core::LogfmtRow{.encoded = rows.encoded_row(r)} : moe_ep::core::LogfmtRow{.bf16 = rows.row(r)});
  std::vector<std::uint16_t> out(kHidden);
  for (auto _ : state) {
    moe_ep::core::logfmt_weighted_sum(in, rows.weights, out.data(), kHidden);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * LogfmtRows::kRows * kHidden);
  moe_ep::core::logfmt_select_isa(moe_ep::core::LogfmtIsa::kAuto);
}
BENCHMARK(BM_LogfmtWeightedSum)->ArgsProduct({{0, 1, 2}, {0, 1}});

// Its baseline: the BF16 combine's weighted sum of the same 8 rows.
void BM_WeightedSumBf16(benchmark::State& state) {
  LogfmtRows rows;
  std::vector<const std::uint16_t*> in;
  for (int r = 0; r < LogfmtRows::kRows; ++r) in.push_back(rows.row(r));
  std::vector<std::uint16_t> out(kHidden);
  for (auto _ : state) {
    moe_ep::core::weighted_sum_bf16_rows(in, rows.weights, out.data(), kHidden);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * LogfmtRows::kRows * kHidden);
}
BENCHMARK(BM_WeightedSumBf16);

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
