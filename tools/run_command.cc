// moe-ep run: dispatch -> experts -> combine on in-process ranks, verified bit for bit against a
// single-threaded reference, with a time and bandwidth table per phase.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "commands.hh"
#include "core/bandwidth.hh"
#include "core/npy.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"
#include "launch.hh"
#include "layer_paths.hh"
#include "progress.hh"
#include "report.hh"

namespace moe_ep::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct RankOutcome {
  Tensor combined_x;
  Tensor combined_weights;
  std::int64_t received_rows = 0;  // rows carrying data (compact rows, or (token, expert) pairs)
  int workers = 1;
  std::vector<double> dispatch_s, experts_s, combine_s;  // per iteration
  std::vector<std::uint64_t> output_hashes;
};

std::uint64_t hash_bytes(const void* data, std::size_t n) {
  std::uint64_t h = 1469598103934665603ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

void write_manifest(const std::string& dir, const LayerConfig& c, const ExpertParams& params, Api api) {
  std::filesystem::create_directories(dir);
  core::write_npy(dir + "/expert_scale.npy", params.scale);
  core::write_npy(dir + "/expert_bias.npy", params.bias);
  nlohmann::json j = {{"ranks", c.ranks},         {"nodes", c.scaleout},   {"allow_hybrid_mode", c.allow_hybrid},
                      {"allow_multiple_reduction", c.multi}, {"num_max_tokens_per_rank", c.tokens},
                      {"hidden", c.hidden},       {"num_experts", c.experts}, {"num_topk", c.topk},
                      {"fp8", c.fp8},             {"expand", c.expand},    {"expert_alignment", c.alignment},
                      {"seed", c.seed},           {"nvfp4", c.nvfp4},      {"nvfp4_ue8m0", c.nvfp4_ue8m0},
                      {"nvfp4_global_scale", c.nvfp4_global_scale},
                      {"nvfp4_rounding", env::get(env::kNvfp4Rounding)}, {"logfmt", c.logfmt}};
  j["api"] = api == Api::kV2 ? "v2" : api == Api::kV1 ? "v1" : "v1_low_latency";
  std::vector<int> tokens;
  for (int r = 0; r < c.ranks; ++r) tokens.push_back(c.tokens_on(r));
  j["tokens_per_rank"] = tokens;
  std::ofstream(dir + "/config.json") << j.dump(2) << "\n";
}

}  // namespace

// What each rank reports: verification counts, then dispatch/experts/combine seconds per iteration.
struct RankSummary {
  std::int64_t tokens = 0, bad_tokens = 0, bad_weights = 0, unstable = 0, received_rows = 0, workers = 1;
};

namespace {

// Progress: rank 0 only (a thread of this process, or the process of rank 0).
void show(int rank, const char* phase, int step = 0, int steps = 0) {
  if (rank == 0) progress::show(phase, step, steps);
}

// The timed iterations of one rank, then its outputs (and their dump).
RankOutcome run_iterations(const RunOptions& options, Group& group, const LayerConfig& c, const ExpertParams& params,
                           const RankBatch& batch) {
  const int me = group.rank();
  RankOutcome out;
  auto path = make_path(options.api, group, c, params, batch, {.workers = options.workers, .async = options.async});
  // Each step starts after a barrier; its time is this rank's.
  auto timed = [&](auto step) {
    path->barrier();
    const auto start = Clock::now();
    step();
    return seconds(start, Clock::now());
  };
  for (int it = 0; it < options.iterations; ++it) {
    show(me, "dispatch", it + 1, options.iterations);
    out.dispatch_s.push_back(timed([&] { path->dispatch(); }));
    show(me, "experts", it + 1, options.iterations);
    out.experts_s.push_back(timed([&] { path->experts(); }));
    show(me, "combine", it + 1, options.iterations);
    out.combine_s.push_back(timed([&] { path->combine(); }));
    const Tensor combined = path->combined_x();
    out.output_hashes.push_back(hash_bytes(combined.data(), combined.nbytes()));
  }
  out.received_rows = path->received_rows();
  out.workers = path->workers();
  out.combined_x = path->combined_x();
  out.combined_weights = path->combined_weights();
  if (!options.dump_dir.empty()) {
    std::filesystem::create_directories(options.dump_dir);  // each host of an MPI job writes its ranks' files
    path->dump(options.dump_dir);
  }
  return out;
}

// This rank's verification against the single-threaded reference.
RankSummary verify(const RunOptions& options, const LayerConfig& c, const ExpertParams& params, const RankBatch& batch,
                   const RankOutcome& out) {
  RankSummary sum;
  const Tensor expected = options.api == Api::kV1LowLatency ? reference_low_latency_output(c, params, batch)
                                                            : reference_output(c, params, batch);
  const std::int64_t n = expected.size(0);
  sum.tokens = n;
  for (std::int64_t t = 0; t < n; ++t) {
    if (std::memcmp(out.combined_x.data_as<std::uint16_t>() + t * c.hidden, expected.data_as<std::uint16_t>() + t * c.hidden,
                    sizeof(std::uint16_t) * static_cast<size_t>(c.hidden)) != 0)
      ++sum.bad_tokens;
    if (out.combined_weights.defined() &&
        std::memcmp(out.combined_weights.data_as<float>() + t * c.topk, batch.topk_weights.data_as<float>() + t * c.topk,
                    sizeof(float) * static_cast<size_t>(c.topk)) != 0)
      ++sum.bad_weights;
  }
  for (std::uint64_t h : out.output_hashes) sum.unstable += h != out.output_hashes.front();
  sum.received_rows = out.received_rows;
  sum.workers = out.workers;
  return sum;
}

// Every rank's summary and timings, gathered on every rank; rank 0 keeps them.
void gather_results(Group& group, int iterations, const RankSummary& sum, const RankOutcome& out,
                    std::vector<RankSummary>& summaries, std::vector<RankOutcome>& outcomes) {
  std::vector<std::byte> block(sizeof sum);
  std::memcpy(block.data(), &sum, sizeof sum);
  for (const auto* v : {&out.dispatch_s, &out.experts_s, &out.combine_s}) {
    const auto* b = reinterpret_cast<const std::byte*>(v->data());
    block.insert(block.end(), b, b + v->size() * sizeof(double));
  }
  const auto all = gather_blocks(group, block);
  if (group.rank() != 0) return;
  const auto iters = static_cast<size_t>(iterations);
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto& b = all[r];
    if (b.size() != sizeof(RankSummary) + 3 * iters * sizeof(double))
      throw StateError(fmt::format("rank {} reported {} bytes", r, b.size()));
    std::memcpy(&summaries[r], b.data(), sizeof(RankSummary));
    RankOutcome& o = outcomes[r];
    for (auto* v : {&o.dispatch_s, &o.experts_s, &o.combine_s}) v->resize(iters);
    std::memcpy(o.dispatch_s.data(), b.data() + sizeof(RankSummary), iters * sizeof(double));
    std::memcpy(o.experts_s.data(), b.data() + sizeof(RankSummary) + iters * sizeof(double), iters * sizeof(double));
    std::memcpy(o.combine_s.data(), b.data() + sizeof(RankSummary) + 2 * iters * sizeof(double), iters * sizeof(double));
    o.received_rows = summaries[r].received_rows;
    o.workers = static_cast<int>(summaries[r].workers);
  }
}

// The time of a phase: the slowest rank's, best of the iterations.
double best_of_slowest(const std::vector<RankOutcome>& outcomes, int iterations,
                       std::vector<double> RankOutcome::*member) {
  double best = 1e30;
  for (int it = 0; it < iterations; ++it) {
    double worst_rank = 0;
    for (const auto& o : outcomes) worst_rank = std::max(worst_rank, (o.*member)[static_cast<size_t>(it)]);
    best = std::min(best, worst_rank);
  }
  return best;
}

void print_header(const RunOptions& options, const Launch& launch, const LayerConfig& c, int workers,
                  std::int64_t tokens) {
  fmt::print("moe-ep run ({}): {}, topology {}x{} ({}), {} worker thread(s) per rank\n",
             api_name(options.api), launch.describe(), c.scaleout, c.ranks / c.scaleout,
             c.scaleout > 1 ? (c.allow_hybrid ? "hybrid: scale-out then scale-up" : "direct across nodes") : "one node",
             workers);
  fmt::print("layer: hidden {}, {} experts, top-{}, up to {} tokens per rank ({} in all), {} dispatch{}, {} layout{}, "
             "seed {}\n\n",
             c.hidden, c.experts, c.topk, c.tokens, tokens,
             c.nvfp4 ? (c.nvfp4_ue8m0 ? "NVFP4 (per-16 UE8M0 scales)" : "NVFP4 (per-16 E4M3 scales)")
                     : c.fp8 ? "FP8 (per-128 scales)" : "BF16",
             c.logfmt ? ", LogFMT-10 combine" : "",
             options.api == Api::kV1LowLatency ? "per-expert slab" : c.expand ? "expanded" : "compact",
             c.expand ? fmt::format(" (alignment {})", c.alignment) : "", c.seed);
}

// The phase table with its formulas, measured against the memcpy ceiling of the same threads.
void print_phases(const RunOptions& options, const LayerConfig& c, const std::vector<RankOutcome>& outcomes) {
  std::int64_t rows = 0;
  for (const auto& o : outcomes) rows += o.received_rows;
  const std::int64_t dispatch_bytes_per_row = dispatch_row_bytes(options.api, c);
  const std::int64_t combine_bytes_per_row = combine_row_bytes(options.api, c);
  const int threads = c.ranks * outcomes.front().workers;
  progress::show("memcpy ceiling");
  const std::size_t bytes = core::probe_bytes(core::kProbeWantedBytes, threads);
  const double ceiling = core::measure_copy_bandwidth(threads, bytes, 3);
  progress::clear();
  Table table({"phase", "time (ms)", "bytes (MB)", "GB/s", "x memcpy"});
  const double d = best_of_slowest(outcomes, options.iterations, &RankOutcome::dispatch_s),
               e = best_of_slowest(outcomes, options.iterations, &RankOutcome::experts_s),
               cb = best_of_slowest(outcomes, options.iterations, &RankOutcome::combine_s);
  const double dispatch_bytes = static_cast<double>(rows * dispatch_bytes_per_row);
  const double combine_bytes = static_cast<double>(rows * combine_bytes_per_row);
  table.row({"dispatch", fmt::format("{:.3f}", d * 1e3), fmt::format("{:.1f}", dispatch_bytes / 1e6),
             fmt::format("{:.2f}", dispatch_bytes / d / 1e9), fmt::format("{:.2f}", dispatch_bytes / d / 1e9 / ceiling)});
  table.row({"experts", fmt::format("{:.3f}", e * 1e3), "-", "-", "-"});
  table.row({"combine", fmt::format("{:.3f}", cb * 1e3), fmt::format("{:.1f}", combine_bytes / 1e6),
             fmt::format("{:.2f}", combine_bytes / cb / 1e9), fmt::format("{:.2f}", combine_bytes / cb / 1e9 / ceiling)});
  table.row({"memcpy", "-", "-", fmt::format("{:.2f}", ceiling), "1.00"});
  table.print();
  fmt::print("\ntime: slowest rank, best of {} iteration(s). GB/s = logical bytes / time (all ranks, local traffic "
             "included).\n",
             options.iterations);
  fmt::print("dispatch bytes = received rows ({}) x {} B  [{}]\n", rows, dispatch_bytes_per_row,
             dispatch_row_formula(options.api, c));
  fmt::print("combine bytes  = rows ({}) x {} B  [{}]\n", rows, combine_bytes_per_row, combine_row_formula(options.api, c));
  fmt::print("memcpy = {} threads each copying its own {} buffer, measured in this run\n\n", threads, mib_text(bytes));
}

// The report of rank 0; returns the exit status (0: every token verified).
int report(const RunOptions& options, const Launch& launch, const LayerConfig& c,
           const std::vector<RankSummary>& summaries, const std::vector<RankOutcome>& outcomes) {
  std::int64_t tokens = 0, bad_tokens = 0, bad_weights = 0, unstable = 0;
  for (const RankSummary& s : summaries) {
    tokens += s.tokens;
    bad_tokens += s.bad_tokens;
    bad_weights += s.bad_weights;
    unstable += s.unstable;
  }
  print_header(options, launch, c, outcomes.front().workers, tokens);
  print_phases(options, c, outcomes);
  const bool ok = bad_tokens == 0 && bad_weights == 0 && unstable == 0;
  fmt::print("verification against the single-threaded reference: {} of {} tokens bit-identical, {} weight rows "
             "differ, {} iteration(s) not reproducible: {}\n",
             tokens - bad_tokens, tokens, bad_weights, unstable, ok ? "PASS" : "FAIL");
  if (!options.dump_dir.empty()) fmt::print("inputs and outputs written to {} (docs/dump-format.md)\n", options.dump_dir);
  return ok ? 0 : 1;
}

}  // namespace

int run_command(const RunOptions& options, Launch& launch) {
  progress::Scope progress_line;
  LayerConfig c = options.layer;
  c.ranks = launch.size();
  c.scaleout = launch.topology().num_scaleout;
  const ExpertParams params = make_experts(c);
  if (!options.dump_dir.empty() && launch.reports()) write_manifest(options.dump_dir, c, params, options.api);

  std::vector<RankOutcome> outcomes(static_cast<size_t>(c.ranks));
  std::vector<RankSummary> summaries(static_cast<size_t>(c.ranks));
  launch.run([&](Group& group) {
    show(group.rank(), "setup");
    const RankBatch batch = make_batch(c, group.rank());
    const RankOutcome out = run_iterations(options, group, c, params, batch);
    show(group.rank(), "verify");
    const RankSummary sum = verify(options, c, params, batch, out);
    gather_results(group, options.iterations, sum, out, summaries, outcomes);
  });
  if (!launch.reports()) return 0;  // rank 0 reports and returns the verdict
  return report(options, launch, c, summaries, outcomes);
}

}  // namespace moe_ep::tools
