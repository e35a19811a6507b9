// moe-ep bench: dispatch (FP8) and combine (BF16) logical bandwidth for the DeepSeek-V3 shape,
// prefill and decode, beside the memcpy ceiling measured in the same run at the same thread
// count. --api v1 measures the V1 Buffer: normal mode for prefill, low-latency mode for decode.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <charconv>
#include <ctime>
#include <random>
#include <nlohmann/json.hpp>

#include "moe_ep/version.hpp"
#include "commands.hh"
#include "comm/transport.hh"
#include "core/bandwidth.hh"
#include "core/host_name.hh"
#include "core/timeout.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/dtype.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "launch.hh"
#include "moe_ep/error.hpp"
#include "progress.hh"
#include "bench.hh"
#include "report.hh"
#ifdef MOE_EP_WITH_MPI
#include "alltoallv_baseline.hh"
#endif

namespace moe_ep::tools {
namespace bench {

using Clock = std::chrono::steady_clock;



double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}


// (token, remote node) and (token, remote rank) pairs of this rank's routing: the scale-out
// records of hybrid and direct mode.
std::pair<std::int64_t, std::int64_t> remote_pairs(const LayerConfig& c, const Tensor& topk, int rank, int nodes) {
  const int El = c.experts / c.ranks, per_node = c.ranks / nodes;
  std::int64_t node_pairs = 0, rank_pairs = 0;
  for (std::int64_t t = 0; t < topk.size(0); ++t) {
    std::vector<bool> node_seen(static_cast<size_t>(nodes)), rank_seen(static_cast<size_t>(c.ranks));
    for (int j = 0; j < c.topk; ++j) {
      const std::int64_t id = topk.data_as<const std::int64_t>()[t * c.topk + j];
      if (id < 0) continue;
      const int r = static_cast<int>(id / El), node = r / per_node;
      if (node == rank / per_node) continue;
      if (!node_seen[static_cast<size_t>(node)]) ++node_pairs;
      if (!rank_seen[static_cast<size_t>(r)]) ++rank_pairs;
      node_seen[static_cast<size_t>(node)] = rank_seen[static_cast<size_t>(r)] = true;
    }
  }
  return {node_pairs, rank_pairs};
}

ShapeResult measure(Launch& launch, const BenchOptions& o, const std::string& shape, int tokens, int iterations,
                    const Setup& setup) {
  ShapeResult result{shape, tokens};
  const int R = launch.size();
  launch.run([&](Group& g) {
    int workers = 1;
    std::pair<std::int64_t, std::int64_t> pairs{0, 0};
    std::vector<Operation> ops = setup(g, workers, pairs);
    std::vector<double> times(ops.size() * static_cast<size_t>(iterations));
    std::vector<std::uint64_t> scaleout(ops.size());
    for (int it = -2; it < iterations; ++it) {  // two warm-up rounds
      if (g.rank() == 0) progress::show(it < 0 ? shape + " warm-up" : shape, it < 0 ? it + 3 : it + 1, it < 0 ? 2 : iterations);
      for (std::size_t i = 0; i < ops.size(); ++i) {
        g.barrier();
        const std::uint64_t sent = g.transport().scaleout_bytes_sent();
        const auto t0 = Clock::now();
        ops[i].call();
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (it >= 0) times[i * static_cast<size_t>(iterations) + static_cast<size_t>(it)] = s;
        scaleout[i] = g.transport().scaleout_bytes_sent() - sent;
      }
    }
    // Every rank's numbers to rank 0: workers, then per operation its bytes and scale-out bytes,
    // then the times.
    std::vector<double> block = {static_cast<double>(workers), static_cast<double>(pairs.first),
                                 static_cast<double>(pairs.second)};
    for (std::size_t i = 0; i < ops.size(); ++i) {
      block.push_back(static_cast<double>(ops[i].rows * ops[i].row_bytes));
      block.push_back(static_cast<double>(scaleout[i]));
    }
    block.insert(block.end(), times.begin(), times.end());
    const auto all = gather_blocks(g, std::as_bytes(std::span(block)));
    result.workers = workers;
    if (g.rank() != 0) return;
    std::vector<std::vector<double>> slowest(ops.size(), std::vector<double>(static_cast<size_t>(iterations), 0));
    result.operations.resize(ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      result.operations[i].operation = ops[i].name;
      result.operations[i].baseline_of = ops[i].baseline_of;
      result.operations[i].scaleout_bytes.resize(static_cast<size_t>(R));
    }
    for (int r = 0; r < R; ++r) {
      std::vector<double> theirs(all[static_cast<size_t>(r)].size() / sizeof(double));
      if (theirs.size() != block.size()) throw StateError(fmt::format("bench: rank {} reported {} values", r, theirs.size()));
      std::memcpy(theirs.data(), all[static_cast<size_t>(r)].data(), all[static_cast<size_t>(r)].size());
      for (std::size_t i = 0; i < ops.size(); ++i) {
        result.operations[i].bytes += theirs[3 + 2 * i];
        result.operations[i].scaleout_bytes[static_cast<size_t>(r)] = static_cast<std::uint64_t>(theirs[4 + 2 * i]);
        for (int it = 0; it < iterations; ++it)
          slowest[i][static_cast<size_t>(it)] = std::max(
              slowest[i][static_cast<size_t>(it)], theirs[3 + 2 * ops.size() + i * static_cast<size_t>(iterations) + static_cast<size_t>(it)]);
      }
      result.node_pairs.push_back(static_cast<std::int64_t>(theirs[1]));
      result.rank_pairs.push_back(static_cast<std::int64_t>(theirs[2]));
    }
    for (std::size_t i = 0; i < ops.size(); ++i) {
      result.operations[i].samples = slowest[i];
      result.operations[i].seconds = median(slowest[i]);
    }
  });
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

// Under MPI: the same dispatch and combine written with MPI_Alltoall + MPI_Alltoallv (bench/).
void add_baseline(const BenchOptions& o, Group& g, const std::shared_ptr<BenchInputs>& in, std::vector<Operation>& ops,
                  const std::string& dispatch_name, const std::string& combine_name) {
#ifdef MOE_EP_WITH_MPI
  if (o.launch.transport == "local") return;  // mpi and host run under mpirun
  auto baseline = std::make_shared<::moe_ep::bench::AlltoallvBaseline>(MPI_COMM_WORLD);
  auto first = std::make_shared<::moe_ep::bench::BaselineDispatch>(
      baseline->dispatch(in->x, in->scales, in->topk, in->weights, o.experts));
  auto y = std::make_shared<Tensor>(Tensor::zeros({first->recv_x.size(0), o.hidden}, DType::kBF16));
  const std::int64_t rows = first->recv_x.size(0);
  ops.push_back({"alltoallv dispatch", [=, &o] { baseline->dispatch(in->x, in->scales, in->topk, in->weights, o.experts); },
                 rows, compact_dispatch_row(o), dispatch_name});
  ops.push_back({"alltoallv combine", [=] { baseline->combine(*first, *y); }, rows, 2 * std::int64_t{o.hidden}, combine_name});
#else
  (void)o, (void)g, (void)in, (void)ops, (void)dispatch_name, (void)combine_name;
#endif
}

Setup v2_setup(const BenchOptions& o, int tokens) {
  return [&o, tokens](Group& g, int& workers, std::pair<std::int64_t, std::int64_t>& pairs) {
    const LayerConfig c = layer(o, tokens);
    auto in = std::make_shared<BenchInputs>(c, g.rank());
    pairs = remote_pairs(c, in->topk, g.rank(), o.nodes);
    auto buffer = std::make_shared<ElasticBuffer>(
        g, ElasticBufferConfig{.num_max_tokens_per_rank = tokens, .hidden = o.hidden, .num_topk = o.topk,
                               .use_fp8_dispatch = true, .allow_hybrid_mode = o.allow_hybrid,
                               .num_cpu_timeout_secs = core::timeout_from_env()});
    DispatchArgs args{.x = in->x, .x_scales = in->scales, .topk_idx = in->topk, .topk_weights = in->weights,
                      .num_experts = o.experts, .num_sms = o.workers};
    auto first = std::make_shared<DispatchResult>(buffer->dispatch(args));
    auto y = std::make_shared<Tensor>(Tensor::zeros({first->recv_x.size(0), o.hidden}, DType::kBF16));
    workers = first->handle->num_sms;
    const std::int64_t rows = first->recv_x.size(0);
    DispatchArgs replay{.x = in->x, .x_scales = in->scales, .topk_weights = in->weights, .num_sms = o.workers,
                        .handle = first->handle};
    std::vector<Operation> ops{
        // The calls capture `in`: their argument views point into it.
        {"dispatch", [=] { (void)in; buffer->dispatch(args); }, rows, compact_dispatch_row(o)},
        {"cached dispatch", [=] { (void)in; buffer->dispatch(replay); }, rows, compact_dispatch_row(o)},
        {"combine", [=, &o] { buffer->combine({.x = *y, .handle = first->handle, .num_sms = o.workers}); }, rows,
         compact_combine_row(o)}};
    add_baseline(o, g, in, ops, "dispatch", "combine");
    return ops;
  };
}

Setup v1_setup(const BenchOptions& o, int tokens) {
  return [&o, tokens](Group& g, int& workers, std::pair<std::int64_t, std::int64_t>& pairs) {
    const LayerConfig c = layer(o, tokens);
    auto in = std::make_shared<BenchInputs>(c, g.rank());
    pairs = remote_pairs(c, in->topk, g.rank(), o.nodes);
    const std::int64_t pool = o.nodes > 1 ? ElasticBuffer::get_buffer_size_hint(g, tokens, o.hidden, o.topk, true) : 0;
    auto buffer =
        std::make_shared<Buffer>(g, BufferConfig{.num_rdma_bytes = pool, .num_cpu_timeout_secs = core::timeout_from_env()});
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
    std::vector<Operation> ops{
        {"layout + dispatch", [=] { normal(); }, rows, compact_dispatch_row(o)},
        {"cached dispatch",
         [=] { buffer->dispatch({.x = in->x, .x_scales = in->scales, .handle = first->handle, .config = dispatch_config}); },
         rows, compact_dispatch_row(o)},
        {"combine", [=] { buffer->combine({.x = *y, .handle = first->handle, .config = combine_config}); }, rows,
         compact_combine_row(o)}};
    add_baseline(o, g, in, ops, "layout + dispatch", "combine");
    return ops;
  };
}

// The experts' outputs of a low-latency combine: the received rows of each local expert hold
// values of N(0, 0.1) (below 1 in magnitude, so that LogFMT codes them), the rest zeros.
Tensor expert_outputs(const LowLatencyDispatchResult& d, int local_experts, std::int64_t rows, int hidden,
                      std::uint64_t seed, int rank) {
  Tensor y = Tensor::zeros({local_experts, rows, hidden}, DType::kBF16);
  std::mt19937 gen(static_cast<std::uint32_t>(seed * 1000 + static_cast<std::uint64_t>(rank)));
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (int i = 0; i < local_experts; ++i) {
    auto* p = y.data_as<std::uint16_t>() + static_cast<std::int64_t>(i) * rows * hidden;
    const std::int64_t count = d.packed_recv_count.data_as<const std::int32_t>()[i];
    for (std::int64_t e = 0; e < count * hidden; ++e) p[e] = float_to_bf16(normal(gen));
  }
  return y;
}

Setup low_latency_setup(const BenchOptions& o, int tokens) {
  return [&o, tokens](Group& g, int& workers, std::pair<std::int64_t, std::int64_t>& pairs) {
    const LayerConfig c = layer(o, tokens);
    auto in = std::make_shared<BenchInputs>(c, g.rank());
    pairs = remote_pairs(c, in->topk, g.rank(), o.nodes);
    auto buffer = std::make_shared<Buffer>(
        g, BufferConfig{.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(tokens, o.hidden, o.ranks, o.experts),
                        .low_latency_mode = true,
                        .num_cpu_timeout_secs = core::timeout_from_env()});
    LowLatencyDispatchArgs args{.x = in->x_bf16, .topk_idx = in->topk, .num_max_dispatch_tokens_per_rank = tokens,
                                .num_experts = o.experts, .use_fp8 = true};
    auto first = std::make_shared<LowLatencyDispatchResult>(buffer->low_latency_dispatch(args));
    const int El = o.experts / o.ranks;
    auto y = std::make_shared<Tensor>(expert_outputs(*first, El, std::int64_t{o.ranks} * tokens, o.hidden, o.seed, g.rank()));
    std::int64_t expert_pairs = 0;
    for (int i = 0; i < El; ++i) expert_pairs += first->packed_recv_count.data_as<std::int32_t>()[i];
    workers = 1;
    // Each timed combine needs a live handle: dispatch again right before it (not timed).
    auto handle = std::make_shared<std::shared_ptr<LowLatencyHandle>>(first->handle);
    auto combine = [=](bool logfmt) {
      buffer->low_latency_combine(
          {.x = *y, .topk_idx = in->topk, .topk_weights = in->weights, .handle = *handle, .use_logfmt = logfmt});
    };
    std::vector<Operation> ops{
        {"low-latency dispatch", [=] { (void)in; *handle = buffer->low_latency_dispatch(args).handle; }, expert_pairs,
         o.hidden + 4 * (o.hidden / 128) + 16},
        {"low-latency combine", [=] { combine(false); }, expert_pairs, 2 * std::int64_t{o.hidden}},
        {"low-latency combine (LogFMT)", [=] { combine(true); }, expert_pairs, 2 * std::int64_t{o.hidden}}};
    add_baseline(o, g, in, ops, "low-latency dispatch", "low-latency combine");
    return ops;
  };
}

// Scale-out bytes each rank put in one call of each of our operations, beside the (token, remote
// node) and (token, remote rank) pairs of its routing: hybrid mode sends one record per
// (token, destination node), direct mode one per (token, destination rank).
void print_scaleout(const std::vector<ShapeResult>& results, const BenchOptions& o, bool v1) {
  if (o.nodes < 2) {
    fmt::print("\nscale-out bytes: none (one node)\n");
    return;
  }
  const bool hybrid = o.allow_hybrid || v1;
  fmt::print("\nscale-out bytes per rank, one call ({} mode: one record per (token, destination {})):\n",
             hybrid ? "hybrid" : "direct", hybrid ? "node" : "rank");
  for (const auto& r : results) {
    const Measured& dispatch = r.operations.front();
    if (dispatch.operation.rfind("low-latency", 0) == 0) {
      fmt::print("{}: low-latency mode sends one record per (token, remote expert); dispatch bytes per rank: [{}]\n",
                 r.shape, fmt::join(dispatch.scaleout_bytes, ", "));
      continue;
    }
    Table t({"shape", "rank", dispatch.operation + " bytes", hybrid ? "(token, node) pairs" : "(token, rank) pairs",
             "bytes / pair", "combine bytes", "per-rank sends (alltoallv)"});
    for (int rank = 0; rank < o.ranks; ++rank) {
      const std::int64_t pairs = hybrid ? r.node_pairs[static_cast<size_t>(rank)] : r.rank_pairs[static_cast<size_t>(rank)];
      const std::uint64_t bytes = dispatch.scaleout_bytes[static_cast<size_t>(rank)];
      std::uint64_t combine = 0;
      for (const auto& op : r.operations)
        if (op.operation.find("combine") != std::string::npos && op.baseline_of.empty())
          combine = op.scaleout_bytes[static_cast<size_t>(rank)];
      // What a per-rank exchange (the Alltoallv baseline, or direct mode) sends to other nodes:
      // one record per (token, remote rank).
      const std::int64_t per_rank = r.rank_pairs[static_cast<size_t>(rank)] * compact_dispatch_row(o);
      t.row({r.shape, std::to_string(rank), std::to_string(bytes), std::to_string(pairs),
             pairs ? fmt::format("{:.1f}", static_cast<double>(bytes) / static_cast<double>(pairs)) : "-",
             std::to_string(combine), std::to_string(per_rank)});
    }
    t.print();
  }
  fmt::print("per-rank sends = (token, remote rank) pairs x {} B: the dispatch bytes an exchange that sends each token "
             "to each of its ranks puts on the network\n",
             compact_dispatch_row(o));
}

// The memcpy ceiling at the same thread count: one process copies with as many threads as the
// ranks of its host use (the others wait), times the number of hosts (all alike). Measured after
// each shape, the higher kept: a ceiling that other load on the machine pulled down in one
// measurement would make the ratios look better than they are.

void Ceiling::measure(Launch& launch, int workers) {
  launch.run([&](Group& g) {
    const int on_host = std::min(g.transport().ranks_on_host(), g.size());
    threads = g.size() * workers;
    if (g.rank() == 0) progress::show("memcpy ceiling");
    if (g.rank() == 0)
      gbs = std::max(gbs, core::measure_copy_bandwidth(on_host * workers, std::size_t{64} << 20, 5) * (g.size() / on_host));
    g.barrier();
  });
}

// Our operation beside the baseline that does the same exchange: baseline time / our time; none
// for the baselines themselves and where no baseline ran.
std::optional<double> speedup(const ShapeResult& r, const Measured& op) {
  for (const auto& base : r.operations)
    if (base.baseline_of == op.operation) return base.seconds / op.seconds;
  return std::nullopt;
}

nlohmann::json result_json(const ShapeResult& r, const Measured& op, double ceiling) {
  const double gbs = op.bytes / op.seconds / 1e9;
  const auto up = speedup(r, op);
  return {{"shape", r.shape},
          {"tokens_per_rank", r.tokens},
          {"operation", op.operation},
          {"baseline", !op.baseline_of.empty()},
          {"seconds", op.seconds},
          {"samples_seconds", op.samples},
          {"bytes", op.bytes},
          {"gbs", gbs},
          {"ratio", gbs / ceiling},
          {"floor_seconds", op.bytes / (ceiling * 1e9)},
          {"speedup_vs_alltoallv", up ? nlohmann::json(*up) : nlohmann::json(nullptr)},
          {"scaleout_bytes_per_rank", op.scaleout_bytes}};
}

std::string first_line_of(const char* path, std::string_view key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) return {};
      const auto begin = line.find_first_not_of(" \t", colon + 1);
      return begin == std::string::npos ? std::string() : line.substr(begin);
    }
  return {};
}

// What a record needs to be read later: which build, where, when, and how it was started.
nlohmann::json record_header(const BenchOptions& o, const Launch& launch) {
  std::vector<std::string> argv;
  {
    std::ifstream in("/proc/self/cmdline", std::ios::binary);
    for (std::string arg; std::getline(in, arg, '\0');) argv.push_back(arg);
  }
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return {{"version", moe_ep::version()},
          {"host", core::host_name()},
          {"cpu_model", first_line_of("/proc/cpuinfo", "model name")},
          {"cores", std::thread::hardware_concurrency()},
          {"date", date},
          {"command_line", argv},
          {"launch", launch.describe()},
          {"transport", o.launch.transport},
          {"api", o.api},
          {"ranks", o.ranks},
          {"nodes", o.nodes},
          {"hybrid", o.allow_hybrid},
          {"hidden", o.hidden},
          {"experts", o.experts},
          {"topk", o.topk},
          {"seed", o.seed}};
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw InvalidArgument(fmt::format("cannot write '{}'", path));
}

void print_formulas(const BenchOptions& o, bool v1, bool mpi, int threads, bool sweep) {
  fmt::print("\ntime: median over iterations of the slowest rank (each call starts after a barrier).\n");
  fmt::print("GB/s = logical bytes / time, all ranks, local traffic included:\n");
  fmt::print("  dispatch: received rows x {} B = hidden x 1 B + {} scales x 4 B + top-{} x (8 B id + 4 B weight)\n",
             compact_dispatch_row(o), o.hidden / 128, o.topk);
  fmt::print("  combine:  received rows x {} B = hidden x 2 B + top-{} x 4 B weights\n", compact_combine_row(o), o.topk);
  if (v1)
    fmt::print("  low-latency: (token, expert) pairs x {} B dispatch (hidden x 1 B + scales + 16 B header), x {} B "
               "combine (hidden x 2 B); the LogFMT combine (use_logfmt) counts the same bytes, on the same expert "
               "outputs (N(0, 0.1) values)\n",
               o.hidden + 4 * (o.hidden / 128) + 16, 2 * o.hidden);
  fmt::print("memcpy: {} threads each copying its own 64 MiB buffer, best of 5, {}{}.\n", threads,
             sweep ? "measured after each point at its thread count" : "measured after each shape of this run (the higher kept)",
             mpi ? " (by one process per host, with the threads of that host's ranks)" : "");
  fmt::print("ratio = GB/s / memcpy GB/s; floor = logical bytes / memcpy GB/s (one copy at the ceiling).\n");
  if (mpi)
    fmt::print("speed-up = time of the MPI_Alltoall + pack + MPI_Alltoallv + unpack baseline (bench/alltoallv_baseline) / "
               "our time, same inputs, same run.\n");
}

}  // namespace bench

int bench_command(const BenchOptions& options, Launch& launch) {
  using namespace bench;
  if (options.dispatcher) return dispatcher_bench_command(options, launch);
  if (!options.sweep.empty()) return sweep_command(options, launch);
  progress::Scope progress_line;  // the progress line (stderr, a terminal only) ends with the command
  BenchOptions o = options;
  o.ranks = launch.size();
  o.nodes = launch.topology().num_scaleout;
  if (!o.csv_path.empty()) throw InvalidArgument("--csv needs --sweep (a single bench writes --json)");
  const bool v1 = o.api == "v1";
  const bool mpi = o.launch.transport != "local";  // under mpirun (MPI or host transport)
  Ceiling ceiling;
  std::vector<ShapeResult> results;
  results.push_back(measure(launch, o, "prefill", o.prefill_tokens, o.prefill_iterations,
                            v1 ? v1_setup(o, o.prefill_tokens) : v2_setup(o, o.prefill_tokens)));
  ceiling.measure(launch, results.front().workers);
  results.push_back(measure(launch, o, "decode", o.decode_tokens, o.decode_iterations,
                            v1 ? low_latency_setup(o, o.decode_tokens) : v2_setup(o, o.decode_tokens)));
  ceiling.measure(launch, results.front().workers);
  if (!launch.reports()) return 0;
  progress::clear();

  fmt::print("moe-ep bench ({}): {}, topology {}x{}, {} worker thread(s) per rank; hidden {}, {} experts, "
             "top-{}; FP8 dispatch (per-128 scales), BF16 combine\n\n",
             v1 ? "V1 Buffer: normal mode for prefill, low-latency mode for decode" : "V2 ElasticBuffer",
             launch.describe(), o.nodes, o.ranks / o.nodes, results.front().workers, o.hidden, o.experts, o.topk);
  std::vector<std::string> columns = {"shape", "tokens/rank", "operation", "time (us)", "GB/s", "memcpy GB/s", "ratio",
                                      "floor (us)"};
  if (mpi) columns.push_back("speed-up vs alltoallv");
  Table table(columns);
  nlohmann::json json = record_header(o, launch);
  json["memcpy_threads"] = ceiling.threads;
  json["memcpy_gbs"] = ceiling.gbs;
  json["results"] = nlohmann::json::array();
  for (const auto& r : results) {
    for (const auto& op : r.operations) {
      const double gbs = op.bytes / op.seconds / 1e9;
      std::vector<std::string> row = {r.shape, std::to_string(r.tokens), op.operation,
                                      fmt::format("{:.1f}", op.seconds * 1e6), fmt::format("{:.2f}", gbs),
                                      fmt::format("{:.2f}", ceiling.gbs), fmt::format("{:.2f}", gbs / ceiling.gbs),
                                      fmt::format("{:.1f}", op.bytes / (ceiling.gbs * 1e9) * 1e6)};
      const auto up = speedup(r, op);
      if (mpi) row.push_back(up ? fmt::format("{:.2f}x", *up) : op.baseline_of.empty() ? "-" : "1 (baseline)");
      table.row(row);
      json["results"].push_back(result_json(r, op, ceiling.gbs));
    }
  }
  table.print();
  print_formulas(o, v1, mpi, ceiling.threads, false);
  print_scaleout(results, o, v1);
  if (!o.json_path.empty()) write_file(o.json_path, json.dump(2) + "\n");
  return 0;
}

}  // namespace moe_ep::tools
