// moe-ep bench: dispatch (FP8) and combine (BF16) logical bandwidth for the DeepSeek-V3 shape,
// prefill and decode, beside the memcpy ceiling measured in the same run at the same thread
// count.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "commands.hh"
#include "core/bandwidth.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/group.hpp"
#include "report.hh"

namespace moe_ep::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct ShapeResult {
  std::string shape;
  int tokens = 0;
  int workers = 1;
  std::int64_t rows = 0;  // received rows, all ranks
  double dispatch_s = 0, cached_s = 0, combine_s = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

ShapeResult run_shape(const BenchOptions& o, const std::string& name, int tokens, int iterations) {
  LayerConfig c;
  c.ranks = o.ranks;
  c.scaleout = o.nodes;
  c.allow_hybrid = o.allow_hybrid;
  c.tokens = tokens;
  c.hidden = o.hidden;
  c.experts = o.experts;
  c.topk = o.topk;
  c.fp8 = true;
  c.seed = o.seed;
  const int P = o.hidden / 128;
  ShapeResult result{name, tokens};
  std::vector<std::vector<double>> dispatch(static_cast<size_t>(iterations)), cached(static_cast<size_t>(iterations)),
      combine(static_cast<size_t>(iterations));
  for (int i = 0; i < iterations; ++i) {
    dispatch[static_cast<size_t>(i)].assign(static_cast<size_t>(o.ranks), 0);
    cached[static_cast<size_t>(i)].assign(static_cast<size_t>(o.ranks), 0);
    combine[static_cast<size_t>(i)].assign(static_cast<size_t>(o.ranks), 0);
  }
  std::vector<std::int64_t> rows(static_cast<size_t>(o.ranks), 0);
  LocalWorld world(o.ranks, {.num_scaleout = o.nodes});
  world.run([&](Group& g) {
    const int me = g.rank();
    // Payload contents do not matter here; routing does (the layer's skewed router).
    Tensor x = Tensor::empty({tokens, o.hidden}, DType::kFP8E4M3);
    std::memset(x.data(), 0x38, x.nbytes());
    Tensor scales = Tensor::empty({tokens, P}, DType::kFP32);
    std::fill(scales.data_as<float>(), scales.data_as<float>() + scales.numel(), 1.0f);
    Tensor topk, weights;
    route(c, me, tokens, topk, weights);
    ElasticBuffer buffer(g, {.num_max_tokens_per_rank = tokens, .hidden = o.hidden, .num_topk = o.topk,
                             .use_fp8_dispatch = true, .allow_hybrid_mode = o.allow_hybrid});
    DispatchArgs args{.x = x, .x_scales = scales, .topk_idx = topk, .topk_weights = weights,
                      .num_experts = o.experts, .num_sms = o.workers};
    DispatchResult first = buffer.dispatch(args);
    Tensor y = Tensor::zeros({first.recv_x.size(0), o.hidden}, DType::kBF16);
    rows[static_cast<size_t>(me)] = first.recv_x.size(0);
    if (me == 0) result.workers = first.handle->num_sms;
    DispatchArgs replay{.x = x, .x_scales = scales, .topk_weights = weights, .num_sms = o.workers, .handle = first.handle};
    auto timed = [&](auto&& call) {
      buffer.barrier();
      const auto t0 = Clock::now();
      call();
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    for (int i = -2; i < iterations; ++i) {  // two warm-up rounds
      const double d = timed([&] { buffer.dispatch(args); });
      const double cd = timed([&] { buffer.dispatch(replay); });
      const double cb = timed([&] { buffer.combine({.x = y, .handle = first.handle, .num_sms = o.workers}); });
      if (i < 0) continue;
      dispatch[static_cast<size_t>(i)][static_cast<size_t>(me)] = d;
      cached[static_cast<size_t>(i)][static_cast<size_t>(me)] = cd;
      combine[static_cast<size_t>(i)][static_cast<size_t>(me)] = cb;
    }
  });
  auto slowest = [&](const std::vector<std::vector<double>>& per_iteration) {
    std::vector<double> v;
    for (const auto& ranks : per_iteration) v.push_back(*std::max_element(ranks.begin(), ranks.end()));
    return median(v);
  };
  result.dispatch_s = slowest(dispatch);
  result.cached_s = slowest(cached);
  result.combine_s = slowest(combine);
  for (auto r : rows) result.rows += r;
  return result;
}

}  // namespace

int bench_command(const BenchOptions& o) {
  const int P = o.hidden / 128;
  const std::int64_t dispatch_row = o.hidden + 4 * P + 12 * std::int64_t{o.topk};
  const std::int64_t combine_row = 2 * std::int64_t{o.hidden} + 4 * std::int64_t{o.topk};
  std::vector<ShapeResult> results;
  results.push_back(run_shape(o, "prefill", o.prefill_tokens, o.prefill_iterations));
  results.push_back(run_shape(o, "decode", o.decode_tokens, o.decode_iterations));
  const int threads = o.ranks * results.front().workers;
  const double ceiling = core::measure_copy_bandwidth(threads, std::size_t{64} << 20, 5);

  fmt::print("moe-ep bench: {} in-process ranks, topology {}x{}, {} worker thread(s) per rank; hidden {}, {} experts, "
             "top-{}; FP8 dispatch (per-128 scales), BF16 combine\n\n",
             o.ranks, o.nodes, o.ranks / o.nodes, results.front().workers, o.hidden, o.experts, o.topk);
  Table table({"shape", "tokens/rank", "operation", "time (us)", "GB/s", "memcpy GB/s", "ratio"});
  nlohmann::json json = {{"ranks", o.ranks}, {"nodes", o.nodes}, {"hidden", o.hidden}, {"experts", o.experts},
                         {"topk", o.topk}, {"memcpy_threads", threads}, {"memcpy_gbs", ceiling}};
  for (const auto& r : results) {
    const double dispatch_bytes = static_cast<double>(r.rows * dispatch_row);
    const double combine_bytes = static_cast<double>(r.rows * combine_row);
    const struct {
      const char* name;
      double seconds, bytes;
    } ops[] = {{"dispatch", r.dispatch_s, dispatch_bytes},
               {"cached dispatch", r.cached_s, dispatch_bytes},
               {"combine", r.combine_s, combine_bytes}};
    for (const auto& op : ops) {
      const double gbs = op.bytes / op.seconds / 1e9;
      table.row({r.shape, std::to_string(r.tokens), op.name, fmt::format("{:.1f}", op.seconds * 1e6),
                 fmt::format("{:.2f}", gbs), fmt::format("{:.2f}", ceiling), fmt::format("{:.2f}", gbs / ceiling)});
      json["results"].push_back({{"shape", r.shape}, {"tokens_per_rank", r.tokens}, {"operation", op.name},
                                 {"seconds", op.seconds}, {"bytes", op.bytes}, {"gbs", gbs}, {"ratio", gbs / ceiling}});
    }
  }
  table.print();
  fmt::print("\ntime: median over iterations of the slowest rank (each call starts after a barrier).\n");
  fmt::print("GB/s = logical bytes / time, all ranks, local traffic included:\n");
  fmt::print("  dispatch: received rows x {} B = hidden x 1 B + {} scales x 4 B + top-{} x (8 B id + 4 B weight)\n",
             dispatch_row, P, o.topk);
  fmt::print("  combine:  received rows x {} B = hidden x 2 B + top-{} x 4 B weights\n", combine_row, o.topk);
  fmt::print("memcpy: {} threads each copying its own 64 MiB buffer, best of 5, measured in this run.\n", threads);
  fmt::print("ratio = GB/s / memcpy GB/s (the copy ceiling for the same number of threads).\n");
  if (!o.json_path.empty()) std::ofstream(o.json_path) << json.dump(2) << "\n";
  return 0;
}

}  // namespace moe_ep::tools
