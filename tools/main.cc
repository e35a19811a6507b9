// moe-ep: run a MoE layer end to end, benchmark dispatch/combine, list the configuration.
// Every usage error (a parse error, a value out of range, flags that conflict or mean nothing
// together, a transport that does not fit how the process was started) exits 2 with one line on
// stderr, "moe-ep: <message>", before anything runs; --help and --version exit 0.
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli.hh"
#include "commands.hh"
#include "moe_ep/dispatcher.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "moe_ep/version.hpp"
#include "progress.hh"

namespace moe_ep::tools {

void add_layer_options(CLI::App& app, LayerConfig& layer) {
  app.add_option("--ranks", layer.ranks, "ranks (threads of this process)")->check(integer_in(1, kMaxToolRanks));
  app.add_option("--nodes", layer.scaleout, "logical nodes the ranks are split into (scale-out x scale-up)")
      ->check(integer_in(1, kMaxToolRanks));
  app.add_flag("!--no-hybrid", layer.allow_hybrid, "across nodes, send each token to each rank (direct mode; V2)");
  app.add_flag("!--no-multiple-reduction", layer.multi, "reduce only at the token's rank in combine (V2)");
  app.add_option("--tokens", layer.tokens, "max tokens per rank (ranks use between 7/8 of it and all of it)")
      ->check(integer_in(1));
  app.add_option("--hidden", layer.hidden, "hidden size")->check(integer_in(1));
  app.add_option("--experts", layer.experts, "number of experts (a multiple of --ranks)")->check(integer_in(1));
  app.add_option("--topk", layer.topk, "experts per token (at most --experts)")->check(integer_in(1, kMaxTopk));
  app.add_flag("--fp8", layer.fp8, "dispatch FP8 E4M3 with per-128 block scales (hidden must be a multiple of 128)");
  app.add_flag("--nvfp4", layer.nvfp4,
               "dispatch NVFP4: E2M1 values with per-16 E4M3 scales (low-latency mode or the dispatcher; hidden a "
               "multiple of 128)");
  app.add_flag("--nvfp4-ue8m0", layer.nvfp4_ue8m0, "with --nvfp4: UE8M0 (power-of-two) block scales");
  app.add_option("--nvfp4-global-scale", layer.nvfp4_global_scale, "with --nvfp4: the global scale gs")
      ->check(number_from(0, true));
  app.add_flag("--expand", layer.expand, "receive one row per (token, local expert), grouped by expert");
  app.add_option("--alignment", layer.alignment,
                 "expert block alignment of the expanded layout (with --expand; --api v1 and --dispatcher: of the "
                 "per-expert counts)")
      ->check(integer_in(1));
  app.add_option("--skew", layer.skew, "Zipf exponent of expert popularity (0 = uniform)")->check(number_from(0, false));
  app.add_option("--seed", layer.seed, "seed of inputs, routing and experts")->check(integer_in<std::uint64_t>(0));
}

}  // namespace moe_ep::tools

namespace {

using moe_ep::tools::UsageError;

int usage_error(const std::string& message) {
  std::fprintf(stderr, "moe-ep: %s\n", message.c_str());
  return moe_ep::tools::kUsageExit;
}

void need(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

// Checks of a layer shape that hold whatever runs it. `ranks` is 0 when not known yet (an MPI job
// before it started).
void check_shape(int ranks, int experts, int topk, int hidden, bool needs_128, const char* why_128) {
  need(topk <= experts, fmt::format("--topk {} is more than --experts {} (each token picks distinct experts)", topk, experts));
  if (ranks > 0)
    need(experts % ranks == 0,
         fmt::format("--experts {} is not a multiple of --ranks {} (every rank holds as many experts)", experts, ranks));
  if (needs_128)
    need(hidden % 128 == 0, fmt::format("{} needs --hidden a multiple of 128 (per-128 block scales): --hidden is {}",
                                        why_128, hidden));
}

// The experts over the processes of an MPI job (its size is known once it started).
void check_job(int size, int experts) {
  need(experts % size == 0, fmt::format("--experts {} is not a multiple of the {} ranks of the MPI job", experts, size));
}

// Nodes of ranks as threads of this process.
void check_local_nodes(int ranks, int nodes, bool nodes_given, int ranks_per_node, bool rpn_given) {
  need(!(nodes_given && rpn_given), "--nodes and --ranks-per-node both set the logical nodes: give one of them");
  if (nodes_given) {
    need(nodes <= ranks, fmt::format("--nodes {} is more than --ranks {}", nodes, ranks));
    need(ranks % nodes == 0, fmt::format("--nodes {} does not divide --ranks {}", nodes, ranks));
  }
  if (rpn_given && ranks_per_node > 0)
    need(ranks % ranks_per_node == 0, fmt::format("--ranks-per-node {} does not divide --ranks {}", ranks_per_node, ranks));
}

// The `run` subcommand's options, and what it needs to tell its paths apart.
struct RunCommand {
  moe_ep::tools::RunOptions options;
  moe_ep::tools::DispatcherRunOptions dispatcher;
  std::string api = "v2";
  bool low_latency = false;
  bool through_dispatcher = false;
  CLI::App* app = nullptr;
  bool given(const char* flag) const { return app->count(flag) > 0; }
};

struct BenchCommand {
  moe_ep::tools::BenchOptions options;
  CLI::App* app = nullptr;
  bool given(const char* flag) const { return app->count(flag) > 0; }
};

void add_run_command(CLI::App& app, RunCommand& run) {
  using namespace moe_ep::tools;
  RunOptions& o = run.options;
  CLI::App* cmd = app.add_subcommand("run", "run a DeepSeek-V3-shaped MoE layer on in-process ranks and verify it");
  run.app = cmd;
  add_layer_options(*cmd, o.layer);
  cmd->add_option("--iters", o.iterations, "iterations (the best time per phase is reported)")->check(integer_in(1));
  cmd->add_option("--workers", o.workers, "worker threads per rank (0 = the theoretical model)")->check(integer_in(0));
  cmd->add_flag("--async", o.async, "run dispatch and combine on the communication workers, then wait");
  cmd->add_option("--dump", o.dump_dir, "write every rank's inputs and outputs as .npy files here (with --dispatcher: of every batch)");
  cmd->add_flag("--logfmt", o.layer.logfmt, "with --api v1 --low-latency: LogFMT-10 combine");
  cmd->add_option("--api", run.api, "which API runs the layer: v2 (ElasticBuffer) or v1 (Buffer)")->check(one_of({"v1", "v2"}));
  cmd->add_flag("--low-latency", run.low_latency, "with --api v1: low_latency_dispatch / low_latency_combine");
  cmd->add_flag("--dispatcher", run.through_dispatcher,
                "through the token dispatcher (generation from MOE_EP_USE_V2), over a sequence of batches");
  cmd->add_option("--mode", run.dispatcher.mode, "with --dispatcher: normal, low_latency or auto (default: MOE_EP_MODE)")
      ->check(one_of({moe_ep::mode_name(moe_ep::DispatchMode::kNormal), moe_ep::mode_name(moe_ep::DispatchMode::kLowLatency),
                      moe_ep::mode_name(moe_ep::DispatchMode::kAuto)}));
  cmd->add_option("--sequence", run.dispatcher.sequence, "with --dispatcher: batch kinds, P = prefill, D = decode");
  cmd->add_option("--decode-tokens", run.dispatcher.decode_tokens, "with --dispatcher: tokens per rank of decode batches")
      ->check(integer_in(1));
  cmd->add_flag("--quiet", o.quiet, "no progress line on stderr (shown only when stderr is a terminal)");
}

void add_bench_command(CLI::App& app, BenchCommand& bench) {
  using namespace moe_ep::tools;
  BenchOptions& o = bench.options;
  CLI::App* cmd = app.add_subcommand("bench", "dispatch/combine bandwidth against the memcpy ceiling");
  bench.app = cmd;
  cmd->add_option("--ranks", o.ranks, "ranks (threads of this process)")->check(integer_in(1, kMaxToolRanks));
  cmd->add_option("--nodes", o.nodes, "logical nodes")->check(integer_in(1, kMaxToolRanks));
  cmd->add_flag("!--no-hybrid", o.allow_hybrid, "direct mode across nodes (V2)");
  cmd->add_option("--hidden", o.hidden, "hidden size (a multiple of 128: FP8 dispatch)")->check(integer_in(1));
  cmd->add_option("--experts", o.experts, "experts (a multiple of --ranks)")->check(integer_in(1));
  cmd->add_option("--topk", o.topk, "experts per token (at most --experts)")->check(integer_in(1, moe_ep::kMaxTopk));
  cmd->add_option("--workers", o.workers, "worker threads per rank (0 = model)")->check(integer_in(0));
  cmd->add_option("--prefill-tokens", o.prefill_tokens, "tokens per rank, prefill shape")->check(integer_in(1));
  cmd->add_option("--decode-tokens", o.decode_tokens, "tokens per rank, decode shape")->check(integer_in(1));
  cmd->add_option("--prefill-iters", o.prefill_iterations, "timed iterations, prefill")->check(integer_in(1));
  cmd->add_option("--decode-iters", o.decode_iterations, "timed iterations, decode")->check(integer_in(1));
  cmd->add_option("--seed", o.seed, "seed")->check(integer_in<std::uint64_t>(0));
  cmd->add_option("--json", o.json_path, "also write the results as JSON to this file");
  cmd->add_option("--api", o.api, "v2 (ElasticBuffer) or v1 (Buffer: normal mode prefill, low-latency decode)")
      ->check(one_of({"v1", "v2"}));
  add_bench_record_options(*cmd, o);
  cmd->add_flag("--dispatcher", o.dispatcher,
                "time dispatch and combine through the token dispatcher beside the same calls on its buffer "
                "(generation from --api, else MOE_EP_USE_V2; decode in the mode the dispatcher resolves)");
  cmd->add_flag("--quiet", o.quiet, "no progress line on stderr (shown only when stderr is a terminal)");
  cmd->add_flag("--payloads", o.payloads,
                "also time the dispatch of other payloads on the same routing, per received row: BF16 beside FP8 (V2; "
                "a second buffer sized for BF16 rows); V1 low-latency: BF16 and NVFP4 beside FP8");
  cmd->add_option("--provider", o.provider,
                  "cpu: this library on host memory; cuda: the CUDA provider on device tensors (from MOE_EP_PROVIDER_PATH, "
                  "else the one built with this tool; docs/cuda.md)")
      ->check(one_of({"cpu", "cuda"}));
}

void add_launch_options(CLI::App& cmd, moe_ep::tools::LaunchOptions& launch) {
  using namespace moe_ep::tools;
  cmd.add_option("--transport", launch.transport, "local: ranks are threads of this process; mpi: this process is "
                                                  "one rank of an MPI job (start with mpirun; the default when "
                                                  "started by an MPI launcher); host: the same, over moe-ep's "
                                                  "shared-memory host transport (one host; MPI only bootstraps it)")
      ->check(one_of({"local", "mpi", "host"}));
  cmd.add_option("--ranks-per-node", launch.ranks_per_node,
                 "ranks per logical node (instead of --nodes; 0 = from --nodes); with mpi, processes of one host in "
                 "different logical nodes talk through MPI")
      ->check(integer_in(0, kMaxToolRanks));
}

// The logical nodes of a launch: threads of this process are checked against --ranks; processes
// of an MPI job only for the one conflict (their count is known once the job started).
void check_launch_nodes(bool local, int ranks, int nodes, bool nodes_given, int ranks_per_node, bool rpn_given) {
  if (local) {
    check_local_nodes(ranks, nodes, nodes_given, ranks_per_node, rpn_given);
  } else {
    need(!(nodes_given && rpn_given), "--nodes and --ranks-per-node both set the logical nodes: give one of them");
  }
}

// Starts the ranks of `run` or `bench` (threads, or this process's part of an MPI job), checks
// the experts against the job's size, and shows progress on rank 0 unless --quiet.
std::unique_ptr<moe_ep::tools::Launch> start_launch(moe_ep::tools::LaunchOptions& launch, int ranks, bool ranks_given,
                                                    int nodes, int experts, bool quiet, int& argc, char**& argv) {
  using namespace moe_ep::tools;
  launch.ranks = ranks;
  launch.ranks_given = ranks_given;
  launch.nodes = nodes;
  auto started = make_launch(&argc, &argv, launch);
  check_job(started->size(), experts);
  progress::start(!quiet && started->reports());
  return started;
}

int run_through_dispatcher(RunCommand& run) {
  using namespace moe_ep::tools;
  const LayerConfig& c = run.options.layer;
  need(!c.logfmt, "--logfmt is a V1 low-latency combine option: use --api v1 --low-latency");
  need(!run.options.launch.transport_given && !run.given("--ranks-per-node"),
       "--dispatcher runs its ranks as threads: drop --transport and --ranks-per-node");
  need(!run.given("--api") && !run.low_latency && !run.options.async,
       "--dispatcher chooses the API itself (MOE_EP_USE_V2, --mode): drop --api, --low-latency and --async");
  need(!run.given("--workers"), "--workers is not used by --dispatcher (its buffers choose their workers)");
  if (const int job = launcher_size(); job > 1)
    throw UsageError(fmt::format("started by an MPI launcher as {0} processes; --dispatcher runs its ranks as "
                                 "threads of one process and would run {0} independent jobs: run one process",
                                 job));
  check_shape(c.ranks, c.experts, c.topk, c.hidden, c.fp8 || c.nvfp4, c.fp8 ? "--fp8" : "--nvfp4");
  check_local_nodes(c.ranks, c.scaleout, run.given("--nodes"), 0, false);
  need(c.allow_hybrid || c.scaleout > 1, "--no-hybrid chooses how tokens cross nodes: it needs --nodes 2 or more");
  progress::start(!run.options.quiet);
  return dispatcher_command(run.options, run.dispatcher);
}

// Flags that belong to one API or mode only.
void check_run_api_flags(const RunCommand& run) {
  const moe_ep::tools::LayerConfig& c = run.options.layer;
  need(run.dispatcher.mode.empty() && !run.given("--sequence") && !run.given("--decode-tokens"),
       "--mode, --sequence and --decode-tokens need --dispatcher");
  need(!(run.low_latency && run.api != "v1"), "--low-latency needs --api v1");
  need(!((c.nvfp4 || c.logfmt) && !run.low_latency),
       "--nvfp4 and --logfmt need --api v1 --low-latency (or --dispatcher for --nvfp4)");
  if (run.api == "v1") {
    need(c.allow_hybrid && c.multi, "--no-hybrid and --no-multiple-reduction are V2 options: drop them with --api v1");
    need(!c.expand, run.low_latency ? "--expand with --low-latency: the slab is already per expert (drop --expand)"
                                    : "--expand with --api v1: V1's normal mode has no expanded layout (drop --expand)");
  }
  if (run.low_latency) {
    need(!run.given("--alignment"), "--alignment with --low-latency: the slab is per expert, nothing is aligned");
    need(!run.given("--workers"), "--workers with --low-latency: low-latency mode runs on one thread per rank");
  } else if (run.api == "v2") {
    need(!run.given("--alignment") || c.expand,
         "--alignment needs --expand (it aligns the expert blocks of the expanded layout)");
  }
}

int run_main(RunCommand& run, int& argc, char**& argv) {
  using namespace moe_ep::tools;
  RunOptions& o = run.options;
  LayerConfig& c = o.layer;
  o.launch.transport_given = run.given("--transport");
  need(!((c.nvfp4_ue8m0 || run.given("--nvfp4-global-scale")) && !c.nvfp4),
       "--nvfp4-ue8m0 and --nvfp4-global-scale need --nvfp4");
  need(!(c.nvfp4 && c.fp8), "--nvfp4 and --fp8: pick one wire format");
  if (run.through_dispatcher) return run_through_dispatcher(run);
  check_run_api_flags(run);
  resolve_transport(o.launch);
  const bool local = o.launch.transport == "local";
  check_shape(local || run.given("--ranks") ? c.ranks : 0, c.experts, c.topk, c.hidden, c.fp8 || c.nvfp4,
              c.fp8 ? "--fp8" : "--nvfp4");
  check_launch_nodes(local, c.ranks, c.scaleout, run.given("--nodes"), o.launch.ranks_per_node,
                     run.given("--ranks-per-node"));
  if (local)
    need(c.allow_hybrid || c.scaleout > 1 || o.launch.ranks_per_node > 0,
         "--no-hybrid chooses how tokens cross nodes: it needs --nodes (or --ranks-per-node) for 2 nodes or more");
  o.api = run.api == "v2" ? Api::kV2 : run.low_latency ? Api::kV1LowLatency : Api::kV1;
  auto launch = start_launch(o.launch, c.ranks, run.given("--ranks"), c.scaleout, c.experts, o.quiet, argc, argv);
  return run_command(o, *launch);
}

int bench_main(BenchCommand& bench, int& argc, char**& argv) {
  using namespace moe_ep::tools;
  BenchOptions& o = bench.options;
  if (o.provider == "cuda") {
    for (const char* flag : {"--dispatcher", "--sweep", "--csv", "--json", "--transport", "--nodes", "--ranks-per-node",
                             "--no-hybrid", "--workers"})
      need(!bench.given(flag), fmt::format("{} is not an option of --provider cuda (it times the V2 buffer on device "
                                           "tensors, ranks as threads)", flag));
    need(o.api == "v2", "--provider cuda offers the V2 buffer only: drop --api v1");
    need(o.ranks <= moe_ep::kMaxCudaRanks,
         fmt::format("--ranks {} is more than the {} ranks the cuda provider serves", o.ranks, moe_ep::kMaxCudaRanks));
    check_shape(o.ranks, o.experts, o.topk, o.hidden, false, "");
    need(o.hidden % 8 == 0, fmt::format("--provider cuda moves BF16 rows of a multiple of 16 bytes: --hidden {} is not "
                                        "a multiple of 8", o.hidden));
    return cuda_bench_command(o);
  }
  o.launch.transport_given = bench.given("--transport");
  o.api_given = bench.given("--api");
  need(!(o.dispatcher && (!o.sweep.empty() || !o.csv_path.empty())), "--dispatcher and --sweep: pick one");
  need(!(o.api == "v1" && !o.allow_hybrid), "--no-hybrid is a V2 option: drop it with --api v1");
  resolve_transport(o.launch);
  const bool local = o.launch.transport == "local";
  check_shape(local || bench.given("--ranks") ? o.ranks : 0, o.experts, o.topk, o.hidden, true, "bench (FP8 dispatch)");
  check_launch_nodes(local, o.ranks, o.nodes, bench.given("--nodes"), o.launch.ranks_per_node,
                     bench.given("--ranks-per-node"));
  auto launch = start_launch(o.launch, o.ranks, bench.given("--ranks"), o.nodes, o.experts, o.quiet, argc, argv);
  return bench_command(o, *launch);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moe_ep::tools;
  CLI::App app{"moe-ep: expert-parallel dispatch and combine on CPU memory", "moe-ep"};
  app.option_defaults()->always_capture_default();  // every option's default in --help
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("moe-ep ") + moe_ep::version(), "print the version and exit");
  RunCommand run;
  add_run_command(app, run);
  BenchCommand bench;
  add_bench_command(app, bench);
  add_launch_options(*run.app, run.options.launch);
  add_launch_options(*bench.app, bench.options.launch);
  bool env_markdown = false;
  CLI::App* env_cmd = app.add_subcommand("env", "list moe-ep's environment variables with their current values and sources");
  env_cmd->add_flag("--markdown", env_markdown, "print the documentation table (docs/env.md)");

  if (const std::string unknown = check_command_word(app, argc, argv); !unknown.empty()) return usage_error(unknown);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help, --version
    return usage_error(describe_parse_error(app, e));
  }
  try {
    if (app.got_subcommand("run")) return run_main(run, argc, argv);
    if (app.got_subcommand("bench")) return bench_main(bench, argc, argv);
    if (app.got_subcommand("env")) return env_command(env_markdown);
  } catch (const UsageError& e) {
    return usage_error(e.what());
  } catch (const moe_ep::PeerError& e) {
    // Other ranks failed: the message tells the story, the last words name the ranks at fault.
    std::fprintf(stderr, "moe-ep: %s (ranks at fault: [%s])\n", e.what(), fmt::format("{}", fmt::join(e.ranks(), ", ")).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe-ep: %s\n", e.what());
    return 2;
  }
  return 0;
}
