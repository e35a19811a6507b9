// Micro-benchmarks of the row kernels, each beside a memcpy of the same bytes as its baseline.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "core/reduce.hh"
#include "moe_ep/convert.hpp"

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

}  // namespace

BENCHMARK_MAIN();
