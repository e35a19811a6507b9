// moe-ep bench --dispatcher: the time the token dispatcher adds over calling its buffer directly,
// for prefill (normal mode) and decode (the mode the dispatcher resolves, low-latency in auto
// mode). Both sides run the same work on the same inputs in the same run: the dispatcher casts
// BF16 to FP8 and so does the direct side (quantize_fp8, or the V1 low-latency dispatch's own
// cast). Direct and dispatcher calls alternate within every iteration, so load on the machine
// hits both alike; times are medians over iterations of the slowest rank (bench::measure).
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.hh"
#include "core/timeout.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/dispatcher.hpp"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "progress.hh"
#include "report.hh"

namespace moe_ep::tools {
namespace bench {
namespace {

// What one shape's dispatcher resolved (rank 0's view; every rank resolves alike).
struct Resolved {
  Generation generation = Generation::kV1;
  DispatchMode mode = DispatchMode::kNormal;
  std::string provider;
};

DispatcherOptions dispatcher_options(const BenchOptions& o) {
  DispatcherOptions d;
  d.hidden = o.hidden;
  d.num_experts = o.experts;
  d.num_topk = o.topk;
  if (o.api_given) d.use_v2 = o.api == "v2";
  d.dispatch_dtype = WireDType::kFP8;
  d.allow_hybrid_mode = o.allow_hybrid;
  if (o.workers > 0) d.num_workers = o.workers;
  d.num_max_dispatch_tokens_per_rank = o.decode_tokens;
  d.num_max_prefill_tokens_per_rank = o.prefill_tokens;
  return d;
}

// Inputs of one rank: BF16 activations (the dispatcher's input), the layer's skewed router.
struct Inputs {
  Inputs(const LayerConfig& c, int rank) {
    x = Tensor::empty({c.tokens, c.hidden}, DType::kBF16);
    std::fill(x.data_as<std::uint16_t>(), x.data_as<std::uint16_t>() + x.numel(), 0x3f80);
    route(c, rank, c.tokens, topk, weights);
  }
  Tensor x, topk, weights;
};

// The direct calls of one mode and generation: what the dispatcher's route does, on a buffer of
// our own. Each combine uses the handle of the dispatch just before it.
std::vector<Operation> direct_operations(Group& g, const BenchOptions& o, int tokens, Generation generation,
                                         DispatchMode mode, int workers, const std::shared_ptr<Inputs>& in) {
  const bool low_latency = mode == DispatchMode::kLowLatency;
  if (generation == Generation::kV1 && low_latency) {
    auto buffer = std::make_shared<Buffer>(
        g, BufferConfig{.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(tokens, o.hidden, o.ranks, o.experts),
                        .low_latency_mode = true,
                        .num_cpu_timeout_secs = core::timeout_from_env()});
    LowLatencyDispatchArgs args{.x = in->x, .topk_idx = in->topk, .num_max_dispatch_tokens_per_rank = tokens,
                                .num_experts = o.experts, .use_fp8 = true};
    auto handle = std::make_shared<std::shared_ptr<LowLatencyHandle>>(buffer->low_latency_dispatch(args).handle);
    const int El = o.experts / o.ranks;
    auto y = std::make_shared<Tensor>(Tensor::zeros({El, std::int64_t{o.ranks} * tokens, o.hidden}, DType::kBF16));
    return {{"direct dispatch", [=] { (void)in; *handle = buffer->low_latency_dispatch(args).handle; }},
            {"direct combine",
             [=] { buffer->low_latency_combine({.x = *y, .topk_idx = in->topk, .topk_weights = in->weights, .handle = *handle}); }}};
  }
  if (generation == Generation::kV1) {
    const std::int64_t pool = o.nodes > 1 ? ElasticBuffer::get_buffer_size_hint(g, tokens, o.hidden, o.topk, true) : 0;
    auto buffer =
        std::make_shared<Buffer>(g, BufferConfig{.num_rdma_bytes = pool, .num_cpu_timeout_secs = core::timeout_from_env()});
    Config dispatch_config = Buffer::get_dispatch_config(o.ranks), combine_config = Buffer::get_combine_config(o.ranks);
    if (workers > 0) dispatch_config.num_sms = combine_config.num_sms = 2 * workers;
    auto last = std::make_shared<LegacyDispatchResult>();
    auto dispatch = [=] {
      const Fp8Tensor q = quantize_fp8(in->x);
      const DispatchLayout layout = buffer->get_dispatch_layout(in->topk, o.experts);
      *last = buffer->dispatch({.x = q.data, .x_scales = q.scales, .num_tokens_per_rank = layout.num_tokens_per_rank,
                                .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                                .is_token_in_rank = layout.is_token_in_rank,
                                .num_tokens_per_expert = layout.num_tokens_per_expert, .topk_idx = in->topk,
                                .topk_weights = in->weights, .config = dispatch_config});
    };
    dispatch();
    auto y = std::make_shared<Tensor>(Tensor::zeros({last->recv_x.size(0), o.hidden}, DType::kBF16));
    return {{"direct dispatch", dispatch},
            {"direct combine", [=] { buffer->combine({.x = *y, .handle = last->handle, .config = combine_config}); }}};
  }
  auto buffer = std::make_shared<ElasticBuffer>(
      g, ElasticBufferConfig{.num_max_tokens_per_rank = tokens, .hidden = o.hidden, .num_topk = o.topk,
                             .use_fp8_dispatch = true, .allow_hybrid_mode = o.allow_hybrid,
                             .num_cpu_timeout_secs = core::timeout_from_env()});
  auto last = std::make_shared<DispatchResult>();
  // Low-latency: what the dispatcher's V2 route does on the built-in buffer (dispatcher.md §5):
  // the expanded dispatch without host wait straight into the per-expert slab (R x tokens rows
  // per local expert, FP8 scales column-major per expert block), and a combine that weights
  // each slab row by its received weight as it reads it.
  const int stride = o.ranks * tokens;
  auto dispatch = [=] {
    const Fp8Tensor q = quantize_fp8(in->x);
    DispatchArgs a{.x = q.data, .x_scales = q.scales, .topk_idx = in->topk, .topk_weights = in->weights,
                   .num_experts = o.experts, .num_sms = workers};
    if (!low_latency) {
      *last = buffer->dispatch(a);
      return;
    }
    a.num_max_tokens_per_rank = tokens;
    a.async_with_compute_stream = true;
    a.do_cpu_sync = false;
    a.do_expand = true;
    a.use_tma_aligned_col_major_sf = true;
    *last = buffer->dispatch(a, DispatchExtras{.expert_stride = stride});
    last->event.wait();
  };
  dispatch();
  auto y = std::make_shared<Tensor>(Tensor::zeros({last->recv_x.size(0), o.hidden}, DType::kBF16));
  auto combine = [=] {
    if (!low_latency) {
      buffer->combine({.x = *y, .handle = last->handle, .num_sms = workers});
      return;
    }
    CombineArgs a{.x = *y, .handle = last->handle, .num_sms = workers, .async_with_compute_stream = true};
    CombineResult r = buffer->combine(a, CombineExtras{.row_weights = last->recv_topk_weights});
    r.event.wait();
  };
  return {{"direct dispatch", dispatch}, {"direct combine", combine}};
}

// One shape: the dispatcher's dispatch and combine beside the direct ones, alternating.
Setup overhead_setup(const BenchOptions& o, int tokens, BatchKind kind, Resolved& resolved) {
  return [&o, tokens, kind, &resolved](Group& g, int& workers, std::pair<std::int64_t, std::int64_t>&) {
    auto in = std::make_shared<Inputs>(layer(o, tokens), g.rank());
    auto cache = std::make_shared<BufferCache>(g);
    auto d = std::shared_ptr<TokenDispatcher>(new TokenDispatcher(*cache, dispatcher_options(o)),
                                              [cache](TokenDispatcher* p) { delete p; });  // before its cache
    const DispatchOutput first = d->dispatch(in->x, in->topk, in->weights, kind);
    Tensor shape = first.hidden_states;
    auto y = std::make_shared<Tensor>(
        Tensor::zeros(std::vector<std::int64_t>(shape.shape().begin(), shape.shape().end()), DType::kBF16));
    d->combine(*y);
    workers = *d->options().num_workers;
    if (g.rank() == 0) resolved = {first.generation, first.mode, first.provider};
    std::vector<Operation> direct = direct_operations(g, o, tokens, first.generation, first.mode, workers, in);
    return std::vector<Operation>{
        direct[0], direct[1],
        {"dispatcher dispatch", [=] { d->dispatch(in->x, in->topk, in->weights, kind); }},
        {"dispatcher combine", [=] { d->combine(*y); }}};
  };
}

}  // namespace

int dispatcher_bench_command(const BenchOptions& options, Launch& launch) {
  progress::Scope progress_line;
  BenchOptions o = options;
  o.ranks = launch.size();
  o.nodes = launch.topology().num_scaleout;
  struct Shape {
    std::string name;
    int tokens, iterations;
    BatchKind kind;
    Resolved resolved;
    ShapeResult result;
  };
  std::vector<Shape> shapes = {{"prefill", o.prefill_tokens, o.prefill_iterations, BatchKind::kPrefill, {}, {}},
                               {"decode", o.decode_tokens, o.decode_iterations, BatchKind::kDecode, {}, {}}};
  for (Shape& s : shapes)
    s.result = measure(launch, o, s.name, s.tokens, s.iterations, overhead_setup(o, s.tokens, s.kind, s.resolved));
  if (!launch.reports()) return 0;
  progress::clear();

  fmt::print("moe-ep bench --dispatcher: {}, topology {}x{}; hidden {}, {} experts, top-{}; BF16 input cast to FP8 "
             "(per-128 scales) on both sides, BF16 combine\n\n",
             launch.describe(), o.nodes, o.ranks / o.nodes, o.hidden, o.experts, o.topk);
  Table table({"shape", "tokens/rank", "generation", "mode", "operation", "direct (us)", "dispatcher (us)", "ratio",
               "overhead (us)"});
  nlohmann::json json = record_header(o, launch);
  json["api"] = "dispatcher";
  json["results"] = nlohmann::json::array();
  for (const Shape& s : shapes) {
    const std::vector<Measured>& ops = s.result.operations;  // direct dispatch, direct combine, dispatcher ...
    for (int i = 0; i < 2; ++i) {
      const Measured& direct = ops[static_cast<size_t>(i)];
      const Measured& through = ops[static_cast<size_t>(i + 2)];
      const std::string operation = i == 0 ? "dispatch" : "combine";
      const double ratio = through.seconds / direct.seconds, overhead = through.seconds - direct.seconds;
      table.row({s.name, std::to_string(s.tokens), generation_name(s.resolved.generation), mode_name(s.resolved.mode),
                 operation, fmt::format("{:.1f}", direct.seconds * 1e6), fmt::format("{:.1f}", through.seconds * 1e6),
                 fmt::format("{:.3f}", ratio), fmt::format("{:.1f}", overhead * 1e6)});
      json["results"].push_back({{"shape", s.name},
                                 {"tokens_per_rank", s.tokens},
                                 {"generation", generation_name(s.resolved.generation)},
                                 {"mode", mode_name(s.resolved.mode)},
                                 {"provider", s.resolved.provider},
                                 {"operation", operation},
                                 {"direct_seconds", direct.seconds},
                                 {"dispatcher_seconds", through.seconds},
                                 {"direct_samples_seconds", direct.samples},
                                 {"dispatcher_samples_seconds", through.samples},
                                 {"ratio", ratio},
                                 {"overhead_seconds", overhead}});
    }
  }
  table.print();
  fmt::print("\ntime: median over iterations of the slowest rank (each call starts after a barrier); every iteration "
             "runs the direct dispatch and combine, then the dispatcher's, on the same inputs.\n");
  fmt::print("direct: the buffer of the same generation called as the dispatcher calls it (V1 Buffer: get_dispatch_layout "
             "+ dispatch, or low_latency_dispatch; V2 ElasticBuffer: dispatch, expanded for low-latency), with the same "
             "FP8 cast.\n");
  fmt::print("ratio = dispatcher time / direct time; overhead = dispatcher time - direct time, per call.\n");
  fmt::print("targets: ratio at most 1.05 at prefill; overhead at most 20 us per call at decode.\n");
  fmt::print("generation: --api, else MOE_EP_USE_V2; mode: as the dispatcher resolved it (MOE_EP_MODE, auto: normal "
             "for prefill, low-latency for decode).\n");
  if (!o.json_path.empty()) write_file(o.json_path, json.dump(2) + "\n");
  return 0;
}

}  // namespace bench
}  // namespace moe_ep::tools
