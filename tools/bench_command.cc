// moe-ep bench: dispatch (FP8) and combine (BF16) logical bandwidth for the DeepSeek-V3 shape,
// prefill and decode, beside the memcpy ceiling measured in the same run at the same thread
// count. --api v1 measures the V1 Buffer: normal mode for prefill, low-latency mode for decode.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>

#include "commands.hh"
#include "core/bandwidth.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "report.hh"

namespace moe_ep::tools {
namespace {

using Clock = std::chrono::steady_clock;

// One timed operation of a shape: median over iterations of the slowest rank.
struct Measured {
  std::string operation;
  double seconds = 0;
  double bytes = 0;  // logical bytes, all ranks
};

struct ShapeResult {
  std::string shape;
  int tokens = 0;
  int workers = 1;
  std::vector<Measured> operations;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Per rank: set up, then return the operations to time and their logical bytes (after one run).
struct Operation {
  std::string name;
  std::function<void()> call;
  std::int64_t rows = 0;  // received rows on this rank
  std::int64_t row_bytes = 0;
};
using Setup = std::function<std::vector<Operation>(Group&, int& workers)>;

ShapeResult measure(const BenchOptions& o, const std::string& shape, int tokens, int iterations, const Setup& setup) {
  ShapeResult result{shape, tokens};
  std::vector<std::vector<std::vector<double>>> times;  // [operation][iteration][rank]
  std::vector<Measured> measured;
  std::vector<std::int64_t> bytes_per_rank;
  std::mutex mutex;
  LocalWorld world(o.ranks, {.num_scaleout = o.nodes});
  world.run([&](Group& g) {
    int workers = 1;
    std::vector<Operation> ops = setup(g, workers);
    {
      std::lock_guard lock(mutex);
      if (times.empty()) {
        times.assign(ops.size(), std::vector<std::vector<double>>(static_cast<size_t>(iterations),
                                                                  std::vector<double>(static_cast<size_t>(o.ranks), 0)));
        measured.resize(ops.size());
        for (std::size_t i = 0; i < ops.size(); ++i) measured[i].operation = ops[i].name;
        result.workers = workers;
      }
      for (std::size_t i = 0; i < ops.size(); ++i) measured[i].bytes += static_cast<double>(ops[i].rows * ops[i].row_bytes);
    }
    for (int it = -2; it < iterations; ++it) {  // two warm-up rounds
      for (std::size_t i = 0; i < ops.size(); ++i) {
        g.barrier();
        const auto t0 = Clock::now();
        ops[i].call();
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (it >= 0) times[i][static_cast<size_t>(it)][static_cast<size_t>(g.rank())] = s;
      }
    }
  });
  for (std::size_t i = 0; i < measured.size(); ++i) {
    std::vector<double> slowest;
    for (const auto& ranks : times[i]) slowest.push_back(*std::max_element(ranks.begin(), ranks.end()));
    measured[i].seconds = median(slowest);
  }
  result.operations = measured;
  return result;
}

LayerConfig layer(const BenchOptions& o, int tokens) {
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
  return c;
}

// Inputs of one rank: FP8 payload (contents do not matter), the layer's skewed router.
struct BenchInputs {
  BenchInputs(const LayerConfig& c, int rank) {
    x = Tensor::empty({c.tokens, c.hidden}, DType::kFP8E4M3);
    std::memset(x.data(), 0x38, x.nbytes());
    x_bf16 = Tensor::empty({c.tokens, c.hidden}, DType::kBF16);
    std::fill(x_bf16.data_as<std::uint16_t>(), x_bf16.data_as<std::uint16_t>() + x_bf16.numel(), 0x3f80);
    scales = Tensor::empty({c.tokens, c.hidden / 128}, DType::kFP32);
    std::fill(scales.data_as<float>(), scales.data_as<float>() + scales.numel(), 1.0f);
    route(c, rank, c.tokens, topk, weights);
  }
  Tensor x, x_bf16, scales, topk, weights;
};

std::int64_t compact_dispatch_row(const BenchOptions& o) { return o.hidden + 4 * (o.hidden / 128) + 12 * std::int64_t{o.topk}; }
std::int64_t compact_combine_row(const BenchOptions& o) { return 2 * std::int64_t{o.hidden} + 4 * std::int64_t{o.topk}; }

Setup v2_setup(const BenchOptions& o, int tokens) {
  return [&o, tokens](Group& g, int& workers) {
    const LayerConfig c = layer(o, tokens);
    auto in = std::make_shared<BenchInputs>(c, g.rank());
    auto buffer = std::make_shared<ElasticBuffer>(
        g, ElasticBufferConfig{.num_max_tokens_per_rank = tokens, .hidden = o.hidden, .num_topk = o.topk,
                               .use_fp8_dispatch = true, .allow_hybrid_mode = o.allow_hybrid});
    DispatchArgs args{.x = in->x, .x_scales = in->scales, .topk_idx = in->topk, .topk_weights = in->weights,
                      .num_experts = o.experts, .num_sms = o.workers};
    auto first = std::make_shared<DispatchResult>(buffer->dispatch(args));
    auto y = std::make_shared<Tensor>(Tensor::zeros({first->recv_x.size(0), o.hidden}, DType::kBF16));
    workers = first->handle->num_sms;
    const std::int64_t rows = first->recv_x.size(0);
    DispatchArgs replay{.x = in->x, .x_scales = in->scales, .topk_weights = in->weights, .num_sms = o.workers,
                        .handle = first->handle};
    return std::vector<Operation>{
        // The calls capture `in`: their argument views point into it.
        {"dispatch", [=] { (void)in; buffer->dispatch(args); }, rows, compact_dispatch_row(o)},
        {"cached dispatch", [=] { (void)in; buffer->dispatch(replay); }, rows, compact_dispatch_row(o)},
        {"combine", [=, &o] { buffer->combine({.x = *y, .handle = first->handle, .num_sms = o.workers}); }, rows,
         compact_combine_row(o)}};
  };
}

Setup v1_setup(const BenchOptions& o, int tokens) {
  return [&o, tokens](Group& g, int& workers) {
    const LayerConfig c = layer(o, tokens);
    auto in = std::make_shared<BenchInputs>(c, g.rank());
    const std::int64_t pool = o.nodes > 1 ? ElasticBuffer::get_buffer_size_hint(g, tokens, o.hidden, o.topk, true) : 0;
    auto buffer = std::make_shared<Buffer>(g, BufferConfig{.num_rdma_bytes = pool});
    Config dispatch_config = Buffer::get_dispatch_config(o.ranks), combine_config = Buffer::get_combine_config(o.ranks);
    if (o.workers > 0) dispatch_config.num_sms = combine_config.num_sms = 2 * o.workers;
    auto normal = [=] {
      const DispatchLayout layout = buffer->get_dispatch_layout(in->topk, o.experts);
      return buffer->dispatch({.x = in->x, .x_scales = in->scales, .num_tokens_per_rank = layout.num_tokens_per_rank,
                               .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                               .is_token_in_rank = layout.is_token_in_rank,
                               .num_tokens_per_expert = layout.num_tokens_per_expert, .topk_idx = in->topk,
                               .topk_weights = in->weights, .config = dispatch_config});
    };
    auto first = std::make_shared<LegacyDispatchResult>(normal());
    auto y = std::make_shared<Tensor>(Tensor::zeros({first->recv_x.size(0), o.hidden}, DType::kBF16));
    workers = first->handle->routing->num_sms;
    const std::int64_t rows = first->recv_x.size(0);
    return std::vector<Operation>{
        {"layout + dispatch", [=] { normal(); }, rows, compact_dispatch_row(o)},
        {"cached dispatch",
         [=] { buffer->dispatch({.x = in->x, .x_scales = in->scales, .handle = first->handle, .config = dispatch_config}); },
         rows, compact_dispatch_row(o)},
        {"combine", [=] { buffer->combine({.x = *y, .handle = first->handle, .config = combine_config}); }, rows,
         compact_combine_row(o)}};
  };
}

Setup low_latency_setup(const BenchOptions& o, int tokens) {
  return [&o, tokens](Group& g, int& workers) {
    const LayerConfig c = layer(o, tokens);
    auto in = std::make_shared<BenchInputs>(c, g.rank());
    auto buffer = std::make_shared<Buffer>(
        g, BufferConfig{.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(tokens, o.hidden, o.ranks, o.experts),
                        .low_latency_mode = true});
    LowLatencyDispatchArgs args{.x = in->x_bf16, .topk_idx = in->topk, .num_max_dispatch_tokens_per_rank = tokens,
                                .num_experts = o.experts, .use_fp8 = true};
    auto first = std::make_shared<LowLatencyDispatchResult>(buffer->low_latency_dispatch(args));
    const int El = o.experts / o.ranks;
    auto y = std::make_shared<Tensor>(Tensor::zeros({El, std::int64_t{o.ranks} * tokens, o.hidden}, DType::kBF16));
    std::int64_t pairs = 0;
    for (int i = 0; i < El; ++i) pairs += first->packed_recv_count.data_as<std::int32_t>()[i];
    workers = 1;
    // Each timed combine needs a live handle: dispatch again right before it (not timed).
    auto handle = std::make_shared<std::shared_ptr<LowLatencyHandle>>(first->handle);
    return std::vector<Operation>{
        {"low-latency dispatch", [=] { (void)in; *handle = buffer->low_latency_dispatch(args).handle; }, pairs,
         o.hidden + 4 * (o.hidden / 128) + 16},
        {"low-latency combine",
         [=] { buffer->low_latency_combine({.x = *y, .topk_idx = in->topk, .topk_weights = in->weights, .handle = *handle}); },
         pairs, 2 * std::int64_t{o.hidden}}};
  };
}

}  // namespace

int bench_command(const BenchOptions& o) {
  const bool v1 = o.api == "v1";
  std::vector<ShapeResult> results;
  results.push_back(measure(o, "prefill", o.prefill_tokens, o.prefill_iterations,
                            v1 ? v1_setup(o, o.prefill_tokens) : v2_setup(o, o.prefill_tokens)));
  results.push_back(measure(o, "decode", o.decode_tokens, o.decode_iterations,
                            v1 ? low_latency_setup(o, o.decode_tokens) : v2_setup(o, o.decode_tokens)));
  const int threads = o.ranks * results.front().workers;
  const double ceiling = core::measure_copy_bandwidth(threads, std::size_t{64} << 20, 5);

  fmt::print("moe-ep bench ({}): {} in-process ranks, topology {}x{}, {} worker thread(s) per rank; hidden {}, {} experts, "
             "top-{}; FP8 dispatch (per-128 scales), BF16 combine\n\n",
             v1 ? "V1 Buffer: normal mode for prefill, low-latency mode for decode" : "V2 ElasticBuffer", o.ranks,
             o.nodes, o.ranks / o.nodes, results.front().workers, o.hidden, o.experts, o.topk);
  Table table({"shape", "tokens/rank", "operation", "time (us)", "GB/s", "memcpy GB/s", "ratio", "floor (us)"});
  nlohmann::json json = {{"api", o.api}, {"ranks", o.ranks}, {"nodes", o.nodes}, {"hidden", o.hidden},
                         {"experts", o.experts}, {"topk", o.topk}, {"memcpy_threads", threads}, {"memcpy_gbs", ceiling}};
  for (const auto& r : results) {
    for (const auto& op : r.operations) {
      const double gbs = op.bytes / op.seconds / 1e9;
      const double floor_us = op.bytes / (ceiling * 1e9) * 1e6;  // one copy of the logical bytes at memcpy speed
      table.row({r.shape, std::to_string(r.tokens), op.operation, fmt::format("{:.1f}", op.seconds * 1e6),
                 fmt::format("{:.2f}", gbs), fmt::format("{:.2f}", ceiling), fmt::format("{:.2f}", gbs / ceiling),
                 fmt::format("{:.1f}", floor_us)});
      json["results"].push_back({{"shape", r.shape}, {"tokens_per_rank", r.tokens}, {"operation", op.operation},
                                 {"seconds", op.seconds}, {"bytes", op.bytes}, {"gbs", gbs}, {"ratio", gbs / ceiling},
                                 {"floor_seconds", floor_us / 1e6}});
    }
  }
  table.print();
  fmt::print("\ntime: median over iterations of the slowest rank (each call starts after a barrier).\n");
  fmt::print("GB/s = logical bytes / time, all ranks, local traffic included:\n");
  fmt::print("  dispatch: received rows x {} B = hidden x 1 B + {} scales x 4 B + top-{} x (8 B id + 4 B weight)\n",
             compact_dispatch_row(o), o.hidden / 128, o.topk);
  fmt::print("  combine:  received rows x {} B = hidden x 2 B + top-{} x 4 B weights\n", compact_combine_row(o), o.topk);
  if (v1)
    fmt::print("  low-latency: (token, expert) pairs x {} B dispatch (hidden x 1 B + scales + 16 B header), x {} B "
               "combine (hidden x 2 B)\n",
               o.hidden + 4 * (o.hidden / 128) + 16, 2 * o.hidden);
  fmt::print("memcpy: {} threads each copying its own 64 MiB buffer, best of 5, measured in this run.\n", threads);
  fmt::print("ratio = GB/s / memcpy GB/s; floor = logical bytes / memcpy GB/s (one copy at the ceiling).\n");
  if (!o.json_path.empty()) std::ofstream(o.json_path) << json.dump(2) << "\n";
  return 0;
}

}  // namespace moe_ep::tools
