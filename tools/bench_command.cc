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
#include "core/bandwidth.hh"
#include "core/host_name.hh"
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
#include "shared_window_baseline.hh"
#endif

namespace moe_ep::tools {
namespace bench {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One barrier round on this group: after a synchronising barrier, `rounds` back to back; the time
// per round of this rank.
double barrier_round_seconds(Group& g, int rounds) {
  g.barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < rounds; ++i) g.barrier();
  return std::chrono::duration<double>(Clock::now() - t0).count() / rounds;
}

// Rank 0: every rank's block (workers, its pairs, three barrier runs; per operation its bytes,
// scale-out bytes and least traffic; then the times) into `result`: bytes and traffic summed,
// per iteration the slowest rank's time, its median the operation's time.
void merge_rank_blocks(const std::vector<std::vector<std::byte>>& all, const std::vector<Operation>& ops,
                       std::size_t block_size, int iterations, ShapeResult& result) {
  const int R = static_cast<int>(all.size());
  std::vector<std::vector<double>> slowest(ops.size(), std::vector<double>(static_cast<size_t>(iterations), 0));
  result.operations.resize(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    result.operations[i].operation = ops[i].name;
    result.operations[i].baseline_of = ops[i].baseline_of;
    result.operations[i].network_alone_of = ops[i].network_alone_of;
    result.operations[i].scaleout_bytes.resize(static_cast<size_t>(R));
  }
  constexpr std::size_t kHead = 6, kPerOp = 4;  // workers, pairs (2), barrier runs (3); per op
  std::vector<double> slowest_rounds(3, 0.0);
  for (int r = 0; r < R; ++r) {
    std::vector<double> theirs(all[static_cast<size_t>(r)].size() / sizeof(double));
    if (theirs.size() != block_size) throw StateError(fmt::format("bench: rank {} reported {} values", r, theirs.size()));
    std::memcpy(theirs.data(), all[static_cast<size_t>(r)].data(), all[static_cast<size_t>(r)].size());
    for (std::size_t run = 0; run < 3; ++run) slowest_rounds[run] = std::max(slowest_rounds[run], theirs[3 + run]);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const double* mine = &theirs[kHead + kPerOp * i];
      result.operations[i].bytes += mine[0];
      result.operations[i].scaleout_bytes[static_cast<size_t>(r)] = static_cast<std::uint64_t>(mine[1]);
      result.operations[i].read_bytes += mine[2];
      result.operations[i].write_bytes += mine[3];
      for (int it = 0; it < iterations; ++it)
        slowest[i][static_cast<size_t>(it)] =
            std::max(slowest[i][static_cast<size_t>(it)],
                     theirs[kHead + kPerOp * ops.size() + i * static_cast<size_t>(iterations) + static_cast<size_t>(it)]);
    }
    result.node_pairs.push_back(static_cast<std::int64_t>(theirs[1]));
    result.rank_pairs.push_back(static_cast<std::int64_t>(theirs[2]));
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    result.operations[i].samples = slowest[i];
    result.operations[i].seconds = median(slowest[i]);
  }
  result.barrier_seconds = median(slowest_rounds);
}

ShapeResult measure(Launch& launch, const BenchOptions& o, const std::string& shape, int tokens, int iterations,
                    const Setup& setup) {
  ShapeResult result{shape, tokens};
  launch.run([&](Group& g) {
    int workers = 1;
    std::pair<std::int64_t, std::int64_t> pairs{0, 0};
    std::vector<Operation> ops = setup(g, workers, pairs);
    for (Operation& op : ops)  // a baseline does the same work as the operation it stands beside
      for (const Operation& ours : ops)
        if (!op.baseline_of.empty() && ours.name == op.baseline_of) op.traffic = ours.traffic;
    std::vector<double> times(ops.size() * static_cast<size_t>(iterations));
    std::vector<std::uint64_t> scaleout(ops.size());
    // The memory bandwidth is sampled after every timed round too (the best sample kept), so that
    // the floor is priced by what the machine gave while the operations ran.
    double traffic = 0;
    for (const Operation& op : ops) traffic = std::max(traffic, op.traffic.read + op.traffic.write);
    const std::size_t working_set = bandwidth_working_set(traffic * g.size(), g.size() * workers);
    for (int it = -2; it < iterations; ++it) {  // two warm-up rounds
      if (g.rank() == 0) progress::show(it < 0 ? shape + " warm-up" : shape, it < 0 ? it + 3 : it + 1, it < 0 ? 2 : iterations);
      for (std::size_t i = 0; i < ops.size(); ++i) {
        g.barrier();
        const std::uint64_t sent = g.scaleout_bytes_sent();
        const auto t0 = Clock::now();
        ops[i].call();
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (it >= 0) times[i * static_cast<size_t>(iterations) + static_cast<size_t>(it)] = s;
        scaleout[i] = g.scaleout_bytes_sent() - sent;
      }
      g.barrier();
      if (it >= 0) sample_memory(g, workers, working_set, result);
    }
    // Every rank's numbers to rank 0: workers, then per operation its bytes and scale-out bytes,
    // then the times.
    // The latency floor: three runs of back-to-back barriers between the same ranks.
    std::vector<double> rounds;
    for (int run = 0; run < 3; ++run) rounds.push_back(barrier_round_seconds(g, 20));
    std::vector<double> block = {static_cast<double>(workers), static_cast<double>(pairs.first),
                                 static_cast<double>(pairs.second)};
    block.insert(block.end(), rounds.begin(), rounds.end());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      block.push_back(static_cast<double>(ops[i].rows * ops[i].row_bytes));
      block.push_back(static_cast<double>(scaleout[i]));
      block.push_back(ops[i].traffic.read);
      block.push_back(ops[i].traffic.write);
    }
    block.insert(block.end(), times.begin(), times.end());
    const auto all = gather_blocks(g, std::as_bytes(std::span(block)));
    result.workers = workers;
    if (g.rank() == 0) merge_rank_blocks(all, ops, block.size(), iterations, result);
  });
  return result;
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
        if (op.operation.find("combine") != std::string::npos && op.baseline_of.empty() && op.network_alone_of.empty())
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

// Each of our operations beside the network alone with its scale-out bytes (across hosts): how
// much of its time moving those bytes takes by itself on this transport.
void print_network_alone(const std::vector<ShapeResult>& results) {
  bool any = false;
  for (const auto& r : results)
    for (const auto& net : r.operations) {
      if (net.network_alone_of.empty()) continue;
      if (!any)
        fmt::print("\nnetwork alone = each rank sends the scale-out bytes of one call of ours to the ranks of the other "
                   "nodes\n  (split evenly) and receives as many, nothing else (bench/scaleout_alone); "
                   "share = network alone / our time:\n");
      any = true;
      for (const auto& ours : r.operations)
        if (ours.operation == net.network_alone_of)
          fmt::print("  {} {}: {:.2f} ms, network alone {:.2f} ms, share {:.2f}\n", r.shape, ours.operation,
                     ours.seconds * 1e3, net.seconds * 1e3, net.seconds / ours.seconds);
    }
}

// The memcpy ceiling at the same thread count: one process copies with as many threads as the
// ranks of its host use (the others wait), times the number of hosts (all alike). Measured after
// each shape, the higher kept: a ceiling that other load on the machine pulled down in one
// measurement would make the ratios look better than they are.

void Ceiling::measure(Launch& launch, int workers) {
  launch.run([&](Group& g) {
    const int on_host = std::min(g.ranks_on_host(), g.size());
    threads = g.size() * workers;
    if (g.rank() == 0) progress::show("memcpy ceiling");
    if (g.rank() == 0)
      gbs = std::max(gbs, core::measure_copy_bandwidth(on_host * workers, core::probe_bytes(core::kProbeWantedBytes,
                                                                                             on_host * workers),
                                                       5) * (g.size() / on_host));
    g.barrier();
  });
}

// Our operation beside the baseline that does the same exchange: baseline time / our time; none
// for the baselines themselves and where no baseline ran.
std::optional<double> speedup(const ShapeResult& r, const Measured& op) {
  std::optional<double> best;  // the fastest baseline of the operation
  for (const auto& base : r.operations)
    if (base.baseline_of == op.operation) best = std::min(best.value_or(base.seconds), base.seconds);
  if (!best) return std::nullopt;
  return *best / op.seconds;
}

nlohmann::json result_json(const ShapeResult& r, const Measured& op, double ceiling) {
  const double gbs = op.bytes / op.seconds / 1e9;
  const auto up = speedup(r, op);
  const auto floor = floor_seconds(op, r);
  auto or_null = [](std::optional<double> v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  return {{"shape", r.shape},
          {"tokens_per_rank", r.tokens},
          {"operation", op.operation},
          {"baseline", !op.baseline_of.empty()},
          {"network_alone_of", op.network_alone_of},
          {"seconds", op.seconds},
          {"samples_seconds", op.samples},
          {"bytes", op.bytes},
          {"gbs", gbs},
          {"ratio", gbs / ceiling},
          {"read_bytes", op.read_bytes},
          {"write_bytes", op.write_bytes},
          {"floor_seconds", or_null(floor)},
          {"efficiency", or_null(floor ? std::optional<double>(*floor / op.seconds) : std::nullopt)},
          {"streaming_copy_gbs", r.memory.copy_gbs},
          {"read_gbs", r.memory.read_gbs},
          {"write_gbs", r.memory.write_gbs},
          {"bandwidth_bytes_per_thread", r.memory_bytes_per_thread},
          {"barrier_seconds", r.barrier_seconds},
          {"x_barrier", r.barrier_seconds > 0 ? nlohmann::json(op.seconds / r.barrier_seconds) : nlohmann::json(nullptr)},
          {"x_floor_and_barrier", or_null(floor ? std::optional<double>(op.seconds / (*floor + r.barrier_seconds))
                                                : std::nullopt)},
          {"speedup_vs_alltoallv", or_null(up)},
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
  fmt::print("memory: {} threads each copying (memcpy; then with non-temporal stores), then reading, then writing (non-temporal\n"
             "  stores) its own buffer (the shape's traffic shared among them, 1 to 64 MiB, less where the machine cannot\n"
             "  hold that many: docs/performance.md), "
             "best of 5, {}{}.\n", threads,
             sweep ? "measured after each point at its thread count" : "measured after each shape of this run (the higher kept)",
             mpi ? " (by one process per host, with the threads of that host's ranks)" : "");
  fmt::print("bound = the least bytes any implementation must read + write, all ranks: dispatch reads every routed\n"
             "  token once at its source and writes every received row once (payload, scales, ids, weights); combine reads\n"
             "  every returned row once and writes every combined token once (hidden x 2 B each; no weights passed)");
  if (v1)
    fmt::print(";\n  low-latency dispatch reads every token's BF16 row once and writes every (token, expert) row once\n"
               "  (hidden x 1 B + scales); low-latency combine reads every (token, expert) row once and writes every token "
               "once");
  fmt::print(".\nfloor = bound read x (a byte read) + bound written x (a byte written): a byte read costs 1 / read bandwidth;\n"
             "  a byte written the cheaper of 1 / streaming copy bandwidth - 1 / read bandwidth and 1 / write bandwidth,\n"
             "  all three passes of the same threads measured in this run; efficiency = floor / time.\n"
             "x barrier = time / one barrier round of the same ranks on the same transport (the latency floor, measured\n"
             "  in this run: back-to-back barriers, the slowest rank, median of three runs); a call that moves data\n"
             "  cannot beat floor + one round: x (floor + barrier) = time / (floor + one round).\n");
  if (mpi)
    fmt::print("speed-up = time of the best baseline / our time, same inputs, same run: MPI_Alltoall of the counts, the\n"
               "  rows packed and sent straight into the receive tensor with MPI_Alltoallv (bench/alltoallv_baseline); on one\n"
               "  node also an MPI_Win_allocate_shared window, rows copied in once and read out by their receivers, expert\n"
               "  outputs read in place (bench/shared_window_baseline).\n");
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
  measure_memory(launch, results.back());
  results.push_back(measure(launch, o, "decode", o.decode_tokens, o.decode_iterations,
                            v1 ? low_latency_setup(o, o.decode_tokens) : v2_setup(o, o.decode_tokens)));
  ceiling.measure(launch, results.front().workers);
  measure_memory(launch, results.back());
  if (!launch.reports()) return 0;
  progress::clear();

  fmt::print("moe-ep bench ({}): {}, topology {}x{}, {} worker thread(s) per rank; hidden {}, {} experts, "
             "top-{}; FP8 dispatch (per-128 scales), BF16 combine\n\n",
             v1 ? "V1 Buffer: normal mode for prefill, low-latency mode for decode" : "V2 ElasticBuffer",
             launch.describe(), o.nodes, o.ranks / o.nodes, results.front().workers, o.hidden, o.experts, o.topk);
  for (const auto& r : results) {
    if (r.memory.usable()) {
      fmt::print("{}: {} threads, {} each: streaming copy {:.2f} GB/s, read {:.2f} GB/s, write {:.2f} GB/s (a byte read "
                 "{:.3f} ns, a byte written {:.3f} ns); one barrier round {:.1f} us\n",
                 r.shape, ceiling.threads, mib_text(r.memory_bytes_per_thread), r.memory.copy_gbs, r.memory.read_gbs,
                 r.memory.write_gbs,
                 r.memory.seconds_per_read_byte() * 1e9, r.memory.seconds_per_written_byte() * 1e9,
                 r.barrier_seconds * 1e6);
    } else {
      fmt::print("{}: streaming copy {:.2f} GB/s, read {:.2f} GB/s: the bandwidth measurement failed (a copy no slower "
                 "than reading the same bytes), so no floor or efficiency is printed; one barrier round {:.1f} us\n",
                 r.shape, r.memory.copy_gbs, r.memory.read_gbs, r.barrier_seconds * 1e6);
    }
  }
  fmt::print("\n");
  std::vector<std::string> columns = {"shape", "tokens/rank", "operation", "time (us)", "GB/s", "bound (MB)",
                                      "floor (us)", "efficiency", "x barrier", "x (floor + barrier)"};
  if (mpi) columns.push_back("speed-up vs alltoallv");
  Table table(columns);
  nlohmann::json json = record_header(o, launch);
  json["memcpy_threads"] = ceiling.threads;
  json["memcpy_gbs"] = ceiling.gbs;
  json["results"] = nlohmann::json::array();
  for (const auto& r : results) {
    for (const auto& op : r.operations) {
      const double gbs = op.bytes / op.seconds / 1e9;
      const auto floor = floor_seconds(op, r);
      std::vector<std::string> row = {r.shape, std::to_string(r.tokens), op.operation,
                                      fmt::format("{:.1f}", op.seconds * 1e6), fmt::format("{:.2f}", gbs),
                                      fmt::format("{:.1f}", (op.read_bytes + op.write_bytes) / 1e6),
                                      floor ? fmt::format("{:.1f}", *floor * 1e6) : "-",
                                      floor ? fmt::format("{:.2f}", *floor / op.seconds) : "-",
                                      r.barrier_seconds > 0 ? fmt::format("{:.1f}", op.seconds / r.barrier_seconds) : "-",
                                      floor ? fmt::format("{:.2f}", op.seconds / (*floor + r.barrier_seconds)) : "-"};
      const auto up = speedup(r, op);
      if (mpi) row.push_back(up ? fmt::format("{:.2f}x", *up) : op.baseline_of.empty() ? "-" : "1 (baseline)");
      table.row(row);
      json["results"].push_back(result_json(r, op, ceiling.gbs));
    }
  }
  table.print();
  print_formulas(o, v1, mpi, ceiling.threads, false);
  print_scaleout(results, o, v1);
  print_network_alone(results);
  if (!o.json_path.empty()) write_file(o.json_path, json.dump(2) + "\n");
  return 0;
}

}  // namespace moe_ep::tools
