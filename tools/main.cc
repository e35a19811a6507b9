// moe-ep: run a MoE layer end to end, benchmark dispatch/combine, list the configuration.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "moe_ep/version.hpp"
#include "commands.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::tools {

void add_layer_options(CLI::App& app, LayerConfig& layer) {
  app.add_option("--ranks", layer.ranks, "ranks (threads of this process)")->check(CLI::Range(1, 1024));
  app.add_option("--nodes", layer.scaleout, "logical nodes the ranks are split into (scale-out x scale-up)")
      ->check(CLI::PositiveNumber);
  app.add_flag("!--no-hybrid", layer.allow_hybrid, "across nodes, send each token to each rank (direct mode)");
  app.add_flag("!--no-multiple-reduction", layer.multi, "reduce only at the token's rank in combine");
  app.add_option("--tokens", layer.tokens, "max tokens per rank (ranks use between 7/8 of it and all of it)")
      ->check(CLI::PositiveNumber);
  app.add_option("--hidden", layer.hidden, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--experts", layer.experts, "number of experts (a multiple of --ranks)")->check(CLI::PositiveNumber);
  app.add_option("--topk", layer.topk, "experts per token")->check(CLI::Range(1, 32));
  app.add_flag("--fp8", layer.fp8, "dispatch FP8 E4M3 with per-128 block scales (hidden must be a multiple of 128)");
  app.add_flag("--nvfp4", layer.nvfp4,
               "dispatch NVFP4: E2M1 values with per-16 E4M3 scales (low-latency mode or the dispatcher; hidden a "
               "multiple of 128)");
  app.add_flag("--nvfp4-ue8m0", layer.nvfp4_ue8m0, "with --nvfp4: UE8M0 (power-of-two) block scales");
  app.add_option("--nvfp4-global-scale", layer.nvfp4_global_scale, "with --nvfp4: the global scale gs")
      ->check(CLI::PositiveNumber);
  app.add_flag("--expand", layer.expand, "receive one row per (token, local expert), grouped by expert");
  app.add_option("--alignment", layer.alignment, "expert block alignment of the expanded layout")->check(CLI::PositiveNumber);
  app.add_option("--skew", layer.skew, "Zipf exponent of expert popularity (0 = uniform)")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", layer.seed, "seed of inputs, routing and experts");
}

}  // namespace moe_ep::tools

int main(int argc, char** argv) {
  using namespace moe_ep::tools;
  CLI::App app{"moe-ep: expert-parallel dispatch and combine on CPU memory"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("moe-ep ") + moe_ep::version(), "print the version and exit");

  RunOptions run;
  CLI::App* run_cmd = app.add_subcommand("run", "run a DeepSeek-V3-shaped MoE layer on in-process ranks and verify it");
  add_layer_options(*run_cmd, run.layer);
  run_cmd->add_option("--iters", run.iterations, "iterations (the best time per phase is reported)")->check(CLI::PositiveNumber);
  run_cmd->add_option("--workers", run.workers, "worker threads per rank (0 = the theoretical model)")->check(CLI::NonNegativeNumber);
  run_cmd->add_flag("--async", run.async, "run dispatch and combine on the communication workers, then wait");
  run_cmd->add_option("--dump", run.dump_dir, "write every rank's inputs and outputs as .npy files here (with --dispatcher: of every batch)");
  run_cmd->add_flag("--logfmt", run.layer.logfmt, "with --api v1 --low-latency: LogFMT-10 combine");
  std::string run_api = "v2";
  bool run_low_latency = false;
  run_cmd->add_option("--api", run_api, "which API runs the layer: v2 (ElasticBuffer) or v1 (Buffer)")
      ->check(CLI::IsMember({"v1", "v2"}));
  run_cmd->add_flag("--low-latency", run_low_latency, "with --api v1: low_latency_dispatch / low_latency_combine");
  bool run_dispatcher = false;
  DispatcherRunOptions dispatcher_run;
  run_cmd->add_flag("--dispatcher", run_dispatcher,
                    "through the token dispatcher (generation from MOE_EP_USE_V2), over a sequence of batches");
  run_cmd->add_option("--mode", dispatcher_run.mode, "with --dispatcher: normal, low_latency or auto (default: MOE_EP_MODE)")
      ->check(CLI::IsMember({"normal", "low_latency", "auto"}));
  run_cmd->add_option("--sequence", dispatcher_run.sequence, "with --dispatcher: batch kinds, P = prefill, D = decode");
  run_cmd->add_option("--decode-tokens", dispatcher_run.decode_tokens, "with --dispatcher: tokens per rank of decode batches")
      ->check(CLI::PositiveNumber);

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "dispatch/combine bandwidth against the memcpy ceiling");
  bench_cmd->add_option("--ranks", bench.ranks, "ranks (threads of this process)")->check(CLI::Range(1, 1024));
  bench_cmd->add_option("--nodes", bench.nodes, "logical nodes")->check(CLI::PositiveNumber);
  bench_cmd->add_flag("!--no-hybrid", bench.allow_hybrid, "direct mode across nodes");
  bench_cmd->add_option("--hidden", bench.hidden, "hidden size")->check(CLI::PositiveNumber);
  bench_cmd->add_option("--experts", bench.experts, "experts")->check(CLI::PositiveNumber);
  bench_cmd->add_option("--topk", bench.topk, "experts per token")->check(CLI::Range(1, 32));
  bench_cmd->add_option("--workers", bench.workers, "worker threads per rank (0 = model)")->check(CLI::NonNegativeNumber);
  bench_cmd->add_option("--prefill-tokens", bench.prefill_tokens, "tokens per rank, prefill shape")->check(CLI::PositiveNumber);
  bench_cmd->add_option("--decode-tokens", bench.decode_tokens, "tokens per rank, decode shape")->check(CLI::PositiveNumber);
  bench_cmd->add_option("--prefill-iters", bench.prefill_iterations, "timed iterations, prefill")->check(CLI::PositiveNumber);
  bench_cmd->add_option("--decode-iters", bench.decode_iterations, "timed iterations, decode")->check(CLI::PositiveNumber);
  bench_cmd->add_option("--seed", bench.seed, "seed");
  bench_cmd->add_option("--json", bench.json_path, "also write the results as JSON to this file");
  bench_cmd->add_option("--api", bench.api, "v2 (ElasticBuffer) or v1 (Buffer: normal mode prefill, low-latency decode)")
      ->check(CLI::IsMember({"v1", "v2"}));
  add_bench_record_options(*bench_cmd, bench);

  for (auto [cmd, launch] : {std::pair{run_cmd, &run.launch}, std::pair{bench_cmd, &bench.launch}}) {
    cmd->add_option("--transport", launch->transport, "local: ranks are threads of this process; mpi: this process is "
                                                      "one rank of an MPI job (start with mpirun); host: the same, "
                                                      "over moe-ep's shared-memory host transport (one host; MPI only "
                                                      "bootstraps it)")
        ->check(CLI::IsMember({"local", "mpi", "host"}));
    cmd->add_option("--ranks-per-node", launch->ranks_per_node,
                    "ranks per logical node (instead of --nodes); with mpi, processes of one host in different logical "
                    "nodes talk through MPI")
        ->check(CLI::NonNegativeNumber);
  }

  bool env_markdown = false;
  CLI::App* env_cmd = app.add_subcommand("env", "list moe-ep's environment variables with their current values and sources");
  env_cmd->add_flag("--markdown", env_markdown, "print the documentation table (docs/env.md)");

  CLI11_PARSE(app, argc, argv);
  try {
    if ((run.layer.nvfp4_ue8m0 || run_cmd->count("--nvfp4-global-scale")) && !run.layer.nvfp4)
      throw moe_ep::InvalidArgument("--nvfp4-ue8m0 and --nvfp4-global-scale need --nvfp4");
    if (run.layer.nvfp4 && run.layer.fp8) throw moe_ep::InvalidArgument("--nvfp4 and --fp8: pick one wire format");
    if (app.got_subcommand("run") && run_dispatcher) {
      if (run.layer.logfmt) throw moe_ep::InvalidArgument("--logfmt is a V1 low-latency combine option: use --api v1 --low-latency");
      if (run.launch.transport != "local" || run.launch.ranks_per_node > 0)
        throw moe_ep::InvalidArgument("--dispatcher runs its ranks as threads: drop --transport and --ranks-per-node");
      if (run_cmd->count("--api") || run_low_latency || run.async)
        throw moe_ep::InvalidArgument("--dispatcher chooses the API itself (MOE_EP_USE_V2, --mode): drop --api, "
                                      "--low-latency and --async");
      return dispatcher_command(run, dispatcher_run);
    }
    if (app.got_subcommand("run") && (!dispatcher_run.mode.empty() || run_cmd->count("--sequence") || run_cmd->count("--decode-tokens")))
      throw moe_ep::InvalidArgument("--mode, --sequence and --decode-tokens need --dispatcher");
    if (app.got_subcommand("run")) {
      if (run_low_latency && run_api != "v1") throw moe_ep::InvalidArgument("--low-latency needs --api v1");
      if ((run.layer.nvfp4 || run.layer.logfmt) && !run_low_latency)
        throw moe_ep::InvalidArgument("--nvfp4 and --logfmt need --api v1 --low-latency (or --dispatcher for --nvfp4)");
      run.api = run_api == "v2" ? Api::kV2 : run_low_latency ? Api::kV1LowLatency : Api::kV1;
      run.launch.ranks = run.layer.ranks;
      run.launch.ranks_given = run_cmd->count("--ranks") > 0;
      run.launch.nodes = run.layer.scaleout;
      auto launch = make_launch(&argc, &argv, run.launch);
      return run_command(run, *launch);
    }
    if (app.got_subcommand("bench")) {
      bench.launch.ranks = bench.ranks;
      bench.launch.ranks_given = bench_cmd->count("--ranks") > 0;
      bench.launch.nodes = bench.nodes;
      auto launch = make_launch(&argc, &argv, bench.launch);
      return bench_command(bench, *launch);
    }
    if (app.got_subcommand("env")) return env_command(env_markdown);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe-ep: %s\n", e.what());
    return 2;
  }
  return 0;
}
