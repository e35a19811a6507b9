// moe-ep run --dispatcher: the layer through the token dispatcher over a sequence of prefill and
// decode batches, each verified against the single-threaded reference of the format it was
// delivered in, with the generation, provider and mode that ran it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "commands.hh"
#include "core/arith.hh"
#include "core/npy.hh"
#include "moe_ep/dispatcher.hpp"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"
#include "progress.hh"
#include "report.hh"

namespace moe_ep::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct BatchRecord {
  DispatchOutput info;  // format, generation, mode, provider (tensors dropped)
  Tensor combined;
  double dispatch_s = 0, combine_s = 0;
};

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

template <env::Type T>
bool env_is_set(env::Var<T> variable) { return env::current(variable).source != env::Source::kDefault; }

// A view's storage as a contiguous tensor of `shape` (the layout a permuted view was made from).
TensorView storage(const TensorView& v, std::initializer_list<std::int64_t> shape) {
  return TensorView(v.data(), v.dtype(), shape);
}

// One rank's batch and what the dispatcher delivered for it (docs/dump-format.md).
void dump_dispatch(const std::string& prefix, const LayerConfig& c, const RankBatch& in, const DispatchOutput& out) {
  auto path = [&](const char* name) { return fmt::format("{}{}.npy", prefix, name); };
  core::write_npy(path("x"), in.x);
  core::write_npy(path("topk_idx"), in.topk_idx);
  core::write_npy(path("topk_weights"), in.topk_weights);
  const TensorView& x = out.hidden_states;
  const TensorView& sf = out.hidden_states_scale;
  if (out.format == OutputFormat::kLowLatency && x.dtype() == DType::kUInt8) {  // NVFP4: the storage of the permuted views
    const std::int64_t El = x.size(2), RN = x.size(0);
    core::write_npy(path("hidden_states"), storage(x, {El, RN, x.size(1)}));
    core::write_npy(path("hidden_states_scale"),
                    storage(sf, {El, core::ceil_div(RN, 128), core::ceil_div(c.hidden, 64), 32, 4, 4}));
  } else {
    core::write_npy(path("hidden_states"), x);
    if (sf.defined()) {
      if (out.format == OutputFormat::kLowLatency)  // [El, R*cap, S] with token stride 1
        core::write_npy(path("hidden_states_scale"), storage(sf, {sf.size(0), sf.size(2), sf.size(1)}));
      else
        core::write_npy(path("hidden_states_scale"), sf);
    }
  }
  if (out.format == OutputFormat::kNormal) core::write_npy(path("topk_ids"), out.topk_ids);
  if (out.format != OutputFormat::kLowLatency) {
    core::write_npy(path("recv_topk_weights"), out.topk_weights);
    Tensor counts = Tensor::empty({static_cast<std::int64_t>(out.num_recv_tokens_per_expert.size())}, DType::kInt32);
    std::copy(out.num_recv_tokens_per_expert.begin(), out.num_recv_tokens_per_expert.end(), counts.data_as<std::int32_t>());
    core::write_npy(path("num_recv_tokens_per_expert"), counts);
  }
  if (out.format != OutputFormat::kNormal) core::write_npy(path("masked_m"), out.masked_m);
}

// config.json of a dispatcher dump: the layer, the resolved options and one entry per batch.
void write_manifest(const std::string& dir, const LayerConfig& c, const DispatcherOptions& o,
                    const std::vector<BatchKind>& kinds, const std::vector<LayerConfig>& configs,
                    const std::vector<std::vector<RankBatch>>& batches, const std::vector<std::vector<BatchRecord>>& records) {
  nlohmann::json j = {{"api", "dispatcher"},
                      {"ranks", c.ranks},
                      {"nodes", c.scaleout},
                      {"hidden", c.hidden},
                      {"num_experts", c.experts},
                      {"num_topk", c.topk},
                      {"seed", c.seed},
                      {"dispatch_dtype", wire_dtype_name(*o.dispatch_dtype)},
                      {"allow_hybrid_mode", *o.allow_hybrid_mode},
                      {"allow_multiple_reduction", *o.allow_multiple_reduction},
                      {"expert_alignment", o.expert_alignment},
                      {"round_scale", o.round_scale},
                      {"use_ue8m0", o.use_ue8m0},
                      {"nvfp4_global_scale", o.nvfp4_global_scale},
                      {"nvfp4_ue8m0", o.nvfp4_use_ue8m0},
                      {"nvfp4_rounding", env::get(env::kNvfp4Rounding)},
                      {"num_max_dispatch_tokens_per_rank", *o.num_max_dispatch_tokens_per_rank},
                      {"num_max_prefill_tokens_per_rank", *o.num_max_prefill_tokens_per_rank}};
  nlohmann::json list = nlohmann::json::array();
  for (std::size_t b = 0; b < kinds.size(); ++b) {
    const DispatchOutput& info = records[0][b].info;
    std::vector<std::int64_t> tokens;
    std::vector<int> expected_m;
    for (std::size_t r = 0; r < batches[b].size(); ++r) {
      tokens.push_back(batches[b][r].x.size(0));
      expected_m.push_back(records[r][b].info.expected_m);
    }
    const WireDType wire = *o.dispatch_dtype == WireDType::kNVFP4 && info.mode != DispatchMode::kLowLatency
                               ? WireDType::kBF16
                               : *o.dispatch_dtype;
    list.push_back({{"kind", batch_kind_name(kinds[b])},
                    {"tokens", configs[b].tokens},
                    {"tokens_per_rank", tokens},
                    {"generation", info.generation == Generation::kV2 ? "v2" : "v1"},
                    {"provider", info.provider},
                    {"mode", mode_name(info.mode)},
                    {"format", format_name(info.format)},
                    {"wire_dtype", wire_dtype_name(wire)},
                    {"seed", configs[b].seed},
                    {"expected_m", expected_m}});
  }
  j["batches"] = list;
  std::ofstream(dir + "/config.json") << j.dump(2) << "\n";
}

// The layer's reference must know the wire format the dispatcher casts to: without --fp8 or
// --nvfp4 it is the one MOE_EP_DISPATCH_DTYPE gives the dispatcher (the flags win over it).
LayerConfig layer_with_wire_format(const LayerConfig& layer) {
  LayerConfig c = layer;
  if (!c.fp8 && !c.nvfp4) {
    const WireDType wire = parse_wire_dtype(env::get(env::kDispatchDtype), env::kDispatchDtype.name);
    c.fp8 = wire == WireDType::kFP8;
    c.nvfp4 = wire == WireDType::kNVFP4;
    if (c.fp8 && c.hidden % 128 != 0)
      throw InvalidArgument(fmt::format("MOE_EP_DISPATCH_DTYPE=fp8 needs --hidden a multiple of 128 (per-128 scales); "
                                        "--hidden is {}", c.hidden));
  }
  return c;
}

std::vector<BatchKind> batch_kinds(const std::string& sequence) {
  std::vector<BatchKind> kinds;
  for (char k : sequence) {
    if (k != 'P' && k != 'D' && k != 'p' && k != 'd')
      throw InvalidArgument(fmt::format("--sequence: '{}' is not P (prefill) or D (decode)", k));
    kinds.push_back(k == 'P' || k == 'p' ? BatchKind::kPrefill : BatchKind::kDecode);
  }
  if (kinds.empty()) throw InvalidArgument("--sequence is empty");
  return kinds;
}

// The batches of this run and how the dispatcher will serve them: prefill batches of --tokens,
// decode batches of --decode-tokens per rank.
struct RunPlan {
  std::vector<BatchKind> kinds;
  DispatcherOptions options;
  DispatchMode mode = DispatchMode::kAuto;  // --mode, or MOE_EP_MODE
  int tokens_of(BatchKind k, const LayerConfig& c, int decode_tokens) const {
    return k == BatchKind::kPrefill ? c.tokens : decode_tokens;
  }
  bool low_latency(BatchKind k) const {
    return mode == DispatchMode::kLowLatency || (mode == DispatchMode::kAuto && k == BatchKind::kDecode);
  }
};

RunPlan plan_run(const LayerConfig& c, const DispatcherRunOptions& run) {
  RunPlan plan;
  plan.kinds = batch_kinds(run.sequence);
  DispatcherOptions& o = plan.options;
  o.hidden = c.hidden;
  o.num_experts = c.experts;
  o.num_topk = c.topk;
  if (!run.mode.empty()) o.mode = parse_mode(run.mode, "--mode");
  if (c.fp8) o.dispatch_dtype = WireDType::kFP8;
  if (c.nvfp4) {
    o.dispatch_dtype = WireDType::kNVFP4;
    o.nvfp4_global_scale = c.nvfp4_global_scale;
    o.nvfp4_use_ue8m0 = c.nvfp4_ue8m0;
  }
  if (c.expand) o.v2_normal_layout = V2NormalLayout::kExpanded;
  if (c.alignment != 1) o.expert_alignment = c.alignment;
  if (!c.allow_hybrid) o.allow_hybrid_mode = false;
  if (!c.multi) o.allow_multiple_reduction = false;
  plan.mode = o.mode ? *o.mode : parse_mode(env::get(env::kMode), env::kMode.name);
  // Unless the environment sets them, the caps are sized to fit the batches.
  int ll_tokens = 1, normal_tokens = 1;
  for (BatchKind k : plan.kinds) {
    int& cap = plan.low_latency(k) ? ll_tokens : normal_tokens;
    cap = std::max(cap, plan.tokens_of(k, c, run.decode_tokens));
  }
  if (!env_is_set(env::kNumMaxDispatchTokensPerRank)) o.num_max_dispatch_tokens_per_rank = ll_tokens;
  if (!env_is_set(env::kNumMaxPrefillTokensPerRank)) o.num_max_prefill_tokens_per_rank = normal_tokens;
  return plan;
}

// Each batch's layer (its tokens, seed and wire format) and every rank's inputs for it.
struct Batches {
  std::vector<LayerConfig> configs;
  std::vector<std::vector<RankBatch>> inputs;  // [batch][rank]
};

Batches make_batches(const LayerConfig& c, const RunPlan& plan, int decode_tokens) {
  Batches batches;
  for (std::size_t b = 0; b < plan.kinds.size(); ++b) {
    LayerConfig cb = c;
    cb.tokens = plan.tokens_of(plan.kinds[b], c, decode_tokens);
    cb.seed = c.seed + 1000 * b;
    cb.nvfp4 = c.nvfp4 && plan.low_latency(plan.kinds[b]);  // normal-mode batches travel BF16
    batches.configs.push_back(cb);
    batches.inputs.emplace_back();
    for (int r = 0; r < c.ranks; ++r) batches.inputs.back().push_back(make_batch(cb, r));
  }
  return batches;
}

// What the ranks' dispatchers did: every rank's records, the options rank 0's dispatcher
// resolved, and its buffer cache's counts.
struct RunRecords {
  std::vector<std::vector<BatchRecord>> records;  // [rank][batch]
  DispatcherOptions resolved;
  BufferCacheStats stats;
};

// One batch on one rank: dispatch, experts, combine, timed after a barrier each; dumped if asked.
BatchRecord run_batch(Group& g, TokenDispatcher& d, const RunOptions& options, const ExpertParams& params,
                      const LayerConfig& config, const RankBatch& in, BatchKind kind, std::size_t b, int n) {
  const int step = static_cast<int>(b) + 1;
  const bool prefill = kind == BatchKind::kPrefill;
  if (g.rank() == 0) progress::show(prefill ? "prefill dispatch" : "decode dispatch", step, n);
  BatchRecord rec;
  g.barrier();
  const auto t0 = Clock::now();
  const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, kind);
  const auto t1 = Clock::now();
  const std::string prefix = fmt::format("{}/batch{}_rank{}_", options.dump_dir, b, g.rank());
  if (!options.dump_dir.empty()) dump_dispatch(prefix, config, in, out);
  if (g.rank() == 0) progress::show(prefill ? "prefill experts" : "decode experts", step, n);
  const Tensor y = run_experts(config, params, g.rank(), out);
  if (g.rank() == 0) progress::show(prefill ? "prefill combine" : "decode combine", step, n);
  g.barrier();
  const auto t2 = Clock::now();
  rec.combined = d.combine(y);
  const auto t3 = Clock::now();
  if (!options.dump_dir.empty()) {
    core::write_npy(prefix + "expert_out.npy", y);
    core::write_npy(prefix + "combined_x.npy", rec.combined);
  }
  rec.info = out;
  rec.info.hidden_states = rec.info.hidden_states_scale = rec.info.topk_ids = rec.info.topk_weights = rec.info.masked_m = Tensor();
  rec.dispatch_s = seconds(t0, t1);
  rec.combine_s = seconds(t2, t3);
  return rec;
}

RunRecords run_batches(const LayerConfig& c, const RunOptions& options, const RunPlan& plan, const Batches& batches,
                       const ExpertParams& params) {
  LocalWorld world(c.ranks, {.num_scaleout = c.scaleout});
  RunRecords run;
  run.records.resize(static_cast<size_t>(c.ranks));
  world.run([&](Group& g) {
    BufferCache cache(g);
    TokenDispatcher d(cache, plan.options);
    if (g.rank() == 0) run.resolved = d.options();
    const int n = static_cast<int>(plan.kinds.size());
    for (std::size_t b = 0; b < plan.kinds.size(); ++b)
      run.records[static_cast<size_t>(g.rank())].push_back(run_batch(
          g, d, options, params, batches.configs[b], batches.inputs[b][static_cast<size_t>(g.rank())], plan.kinds[b], b, n));
    if (g.rank() == 0) run.stats = cache.stats();
  });
  return run;
}

// One table row per batch, each verified against the reference of the format it was delivered
// in; returns whether every batch passed.
bool verify_batches(const LayerConfig& c, const RunPlan& plan, const Batches& batches, const ExpertParams& params,
                    const RunRecords& run, Table& table) {
  bool all_ok = true;
  const DispatcherOptions& resolved = run.resolved;
  for (std::size_t b = 0; b < plan.kinds.size(); ++b) {
    const DispatchOutput& info = run.records[0][b].info;
    progress::show("verify", static_cast<int>(b) + 1, static_cast<int>(plan.kinds.size()));
    LayerConfig ref = batches.configs[b];
    ref.allow_hybrid = *resolved.allow_hybrid_mode;
    ref.multi = *resolved.allow_multiple_reduction;
    ref.expand = info.format != OutputFormat::kNormal;
    ref.alignment = resolved.expert_alignment;
    ref.lanes_weighted_after_rounding = info.format == OutputFormat::kLowLatency;
    ref.hybrid_ep_order = info.format == OutputFormat::kHybridEp;
    std::int64_t bad = 0, tokens = 0;
    double dispatch_s = 0, combine_s = 0;
    for (int r = 0; r < c.ranks; ++r) {
      const BatchRecord& rec = run.records[static_cast<size_t>(r)][b];
      const RankBatch& in = batches.inputs[b][static_cast<size_t>(r)];
      dispatch_s = std::max(dispatch_s, rec.dispatch_s);
      combine_s = std::max(combine_s, rec.combine_s);
      const Tensor expected = info.format == OutputFormat::kLowLatency && info.generation == Generation::kV1
                                  ? reference_low_latency_output(batches.configs[b], params, in)
                                  : reference_output(ref, params, in);
      tokens += expected.size(0);
      for (std::int64_t t = 0; t < expected.size(0); ++t)
        bad += std::memcmp(rec.combined.data_as<std::uint16_t>() + t * c.hidden, expected.data_as<std::uint16_t>() + t * c.hidden,
                           sizeof(std::uint16_t) * static_cast<size_t>(c.hidden)) != 0;
    }
    all_ok &= bad == 0;
    table.row({std::to_string(b), batch_kind_name(plan.kinds[b]),
               std::to_string(batches.configs[b].tokens), generation_name(info.generation), info.provider,
               mode_name(info.mode), format_name(info.format), fmt::format("{:.3f}", dispatch_s * 1e3),
               fmt::format("{:.3f}", combine_s * 1e3),
               bad == 0 ? fmt::format("PASS ({} tokens)", tokens) : fmt::format("FAIL ({} of {} tokens differ)", bad, tokens)});
  }
  return all_ok;
}

void print_header(const LayerConfig& c, const DispatcherRunOptions& run, const DispatcherOptions& resolved) {
  const Generation generation = *resolved.use_v2 ? Generation::kV2 : Generation::kV1;
  const ProbeReport& probe = probe_providers(*resolved.provider_path);
  progress::clear();  // before anything goes to stdout (the same terminal)
  fmt::print("moe-ep run --dispatcher: {} ranks as threads, topology {}x{}; hidden {}, {} experts, top-{}, {} dispatch\n",
             c.ranks, c.scaleout, c.ranks / c.scaleout, c.hidden, c.experts, c.topk,
             c.nvfp4 ? "NVFP4 (low-latency batches)" : c.fp8 ? "FP8" : "BF16");
  fmt::print("generation {} ({}), provider '{}' ({}), mode {} ({}); caps: low-latency {} tokens, normal {} tokens per rank\n\n",
             generation_name(generation), env_is_set(env::kUseV2) ? "MOE_EP_USE_V2 from the environment" : "MOE_EP_USE_V2 default",
             probe[generation].provider, probe[generation].origin, mode_name(*resolved.mode),
             run.mode.empty() ? "MOE_EP_MODE" : "--mode", *resolved.num_max_dispatch_tokens_per_rank,
             *resolved.num_max_prefill_tokens_per_rank);
}

}  // namespace

int dispatcher_command(const RunOptions& options, const DispatcherRunOptions& run) {
  progress::Scope progress_line;
  const LayerConfig c = layer_with_wire_format(options.layer);
  const ExpertParams params = make_experts(c);
  const RunPlan plan = plan_run(c, run);
  progress::show("setup");
  const Batches batches = make_batches(c, plan, run.decode_tokens);
  if (!options.dump_dir.empty()) {
    std::filesystem::create_directories(options.dump_dir);
    core::write_npy(options.dump_dir + "/expert_scale.npy", params.scale);
    core::write_npy(options.dump_dir + "/expert_bias.npy", params.bias);
  }
  const RunRecords done = run_batches(c, options, plan, batches, params);
  if (!options.dump_dir.empty())
    write_manifest(options.dump_dir, c, done.resolved, plan.kinds, batches.configs, batches.inputs, done.records);
  print_header(c, run, done.resolved);
  Table table({"batch", "kind", "tokens/rank", "generation", "provider", "mode", "format", "dispatch (ms)", "combine (ms)",
               "verified"});
  const bool all_ok = verify_batches(c, plan, batches, params, done, table);
  progress::clear();
  table.print();
  const BufferCacheStats& stats = done.stats;
  fmt::print("\nbuffer cache: {} build(s), {} reuse(s), {} V1 clean_low_latency_buffer call(s), {:.1f} MB buffer\n",
             stats.builds, stats.reuses, stats.clean_calls, static_cast<double>(stats.buffer_bytes) / 1e6);
  fmt::print("time: slowest rank; dispatch includes the receive (and, for the first batch, building the buffer), "
             "combine the reduction.\nEach batch is verified bit for bit against the single-threaded reference of its "
             "output format (docs/dispatcher.md).\n");
  fmt::print("verification: {}\n", all_ok ? "PASS" : "FAIL");
  if (!options.dump_dir.empty()) fmt::print("inputs and outputs of every batch written to {} (docs/dump-format.md)\n", options.dump_dir);
  return all_ok ? 0 : 1;
}

}  // namespace moe_ep::tools
