// Subcommands of the `moe-ep` tool. Each returns the process exit status.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "launch.hh"
#include "layer_paths.hh"
#include "moe_layer.hh"

namespace moe_ep::tools {

// The most ranks (threads of this process) and logical nodes a run, a benchmark or a sweep point
// may have: the tool's own limit (the library's limits are those of moe_ep/limits.hpp).
inline constexpr int kMaxToolRanks = 1024;

struct RunOptions {
  Api api = Api::kV2;
  LayerConfig layer;
  int iterations = 3;
  int workers = 0;  // num_sms; 0 = the theoretical model
  bool async = false;
  std::string dump_dir;
  bool quiet = false;  // no progress line on a terminal's stderr
  LaunchOptions launch;
};

struct DispatcherRunOptions {
  std::string mode;              // normal | low_latency | auto; empty = MOE_EP_MODE
  std::string sequence = "PDDPD";  // batch kinds: P = prefill, D = decode
  int decode_tokens = 64;
};

struct BenchOptions {
  std::string api = "v2";
  bool api_given = false;   // --api on the command line (--dispatcher: else MOE_EP_USE_V2)
  bool dispatcher = false;  // --dispatcher: the token dispatcher's time over the direct buffer calls
  int ranks = 8;
  int nodes = 1;
  bool allow_hybrid = true;
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  int workers = 0;
  int prefill_tokens = 4096;
  int decode_tokens = 128;
  int prefill_iterations = 5;
  int decode_iterations = 50;
  std::uint64_t seed = 1;
  std::string json_path;
  std::string sweep;     // KEY=LIST (tokens, ranks, hidden or experts); empty = the two shapes
  std::string csv_path;  // with sweep
  bool quiet = false;  // no progress line on a terminal's stderr
  bool payloads = false;  // --payloads: also the dispatch of other payloads (BF16 beside FP8) on the same routing
  std::string provider = "cpu";  // cuda: the CUDA provider's bench on device tensors (docs/cuda.md)
  LaunchOptions launch;
};

void add_layer_options(CLI::App& app, LayerConfig& layer);
void add_bench_record_options(CLI::App& bench, BenchOptions& options);  // --sweep, --csv

int run_command(const RunOptions& options, Launch& launch);
int dispatcher_command(const RunOptions& options, const DispatcherRunOptions& run);
int bench_command(const BenchOptions& options, Launch& launch);
// `moe-ep bench --provider cuda`: loads the CUDA provider and runs its bench entry.
int cuda_bench_command(const BenchOptions& options);
int env_command(bool markdown);

}  // namespace moe_ep::tools
