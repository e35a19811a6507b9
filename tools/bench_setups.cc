// The per-rank setups of `moe-ep bench`: the bench's MoE layer and inputs, then the operations of
// each API (V2 dispatch, cached dispatch and combine; V1 normal mode; V1 low-latency mode with and
// without LogFMT), each with its least traffic, and under MPI the baselines beside them.
#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <random>

#include "bench.hh"
#include "core/timeout.hh"
#include "moe_ep/dtype.hpp"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/legacy_buffer.hpp"
#ifdef MOE_EP_WITH_MPI
#include "alltoallv_baseline.hh"
#include "scaleout_alone.hh"
#include "shared_window_baseline.hh"
#endif

namespace moe_ep::tools::bench {

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

// Under MPI: the same dispatch and combine written with MPI_Alltoall + MPI_Alltoallv (bench/), and
// when every rank shares one node, with an MPI_Win_allocate_shared window.
#ifdef MOE_EP_WITH_MPI
// Beside our operation `name`: the network alone with the bytes one call of it puts on the network
// (counted around one more call here; collective).
void add_network_alone(Group& g, std::vector<Operation>& ops, const std::string& name) {
  for (Operation& ours : ops) {
    if (ours.name != name) continue;
    g.barrier();
    const std::uint64_t before = g.scaleout_bytes_sent();
    ours.call();
    const std::uint64_t bytes = g.scaleout_bytes_sent() - before;
    auto net = std::make_shared<::moe_ep::bench::ScaleoutAlone>(MPI_COMM_WORLD, g.size() / g.num_scaleout(), bytes);
    Operation op{"network alone (" + name + ")", [net] { net->exchange(); }, static_cast<std::int64_t>(bytes), 1};
    op.network_alone_of = name;
    ops.push_back(std::move(op));
    return;
  }
}
#endif

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
  if (g.num_scaleout() > 1) {
    add_network_alone(g, ops, dispatch_name);
    add_network_alone(g, ops, combine_name);
  }
  if (g.num_scaleout() > 1 || g.ranks_on_host() < g.size()) return;
  auto shared = std::make_shared<::moe_ep::bench::SharedWindowBaseline>(MPI_COMM_WORLD);
  auto routed = std::make_shared<::moe_ep::bench::BaselineDispatch>(
      shared->dispatch(in->x, in->scales, in->topk, in->weights, o.experts));
  const TensorView outputs = shared->output_rows(routed->recv_x.size(0), o.hidden);
  std::memset(outputs.data(), 0, static_cast<std::size_t>(outputs.nbytes()));  // the experts' outputs
  ops.push_back({"shared-window dispatch",
                 [=, &o] { shared->dispatch(in->x, in->scales, in->topk, in->weights, o.experts); }, rows,
                 compact_dispatch_row(o), dispatch_name});
  ops.push_back({"shared-window combine", [=] { shared->combine(*routed, outputs); }, rows, 2 * std::int64_t{o.hidden},
                 combine_name});
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
    ops[0].traffic = ops[1].traffic = dispatch_traffic(rows, routed_tokens(in->topk), compact_dispatch_row(o));
    ops[2].traffic = combine_traffic(rows, tokens, 2 * std::int64_t{o.hidden});  // no weights to combine
    add_baseline(o, g, in, ops, "dispatch", "combine");
    if (!o.payloads) return ops;
    // The same routing with BF16 rows (a buffer sized for them): per received row FP8 must not be slower.
    auto bf16_buffer = std::make_shared<ElasticBuffer>(
        g, ElasticBufferConfig{.num_max_tokens_per_rank = tokens, .hidden = o.hidden, .num_topk = o.topk,
                               .allow_hybrid_mode = o.allow_hybrid, .num_cpu_timeout_secs = core::timeout_from_env()});
    DispatchArgs bf16_args{.x = in->x_bf16, .topk_idx = in->topk, .topk_weights = in->weights, .num_experts = o.experts,
                           .num_sms = o.workers};
    const std::int64_t bf16_row = 2 * std::int64_t{o.hidden} + 12 * std::int64_t{o.topk};
    ops.push_back({"dispatch (BF16)", [=] { (void)in; bf16_buffer->dispatch(bf16_args); }, rows, bf16_row});
    ops.back().traffic = dispatch_traffic(rows, routed_tokens(in->topk), bf16_row);
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
    ops[0].traffic = ops[1].traffic = dispatch_traffic(rows, routed_tokens(in->topk), compact_dispatch_row(o));
    ops[2].traffic = combine_traffic(rows, tokens, 2 * std::int64_t{o.hidden});
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
    ops[0].traffic = low_latency_dispatch_traffic(expert_pairs, tokens, o.hidden);
    ops[1].traffic = ops[2].traffic = low_latency_combine_traffic(expert_pairs, tokens, o.hidden);
    if (o.payloads) {
      // The same routing with BF16 rows and with NVFP4 rows (E2M1 values, E4M3 block scales of 16
      // elements): per received row FP8 and NVFP4 must not be slower than BF16.
      auto global_scale = std::make_shared<Tensor>(Tensor::empty({}, DType::kFP32));
      *global_scale->data_as<float>() = 1.0f;
      LowLatencyDispatchArgs bf16 = args, nvfp4 = args;
      bf16.use_fp8 = false;
      nvfp4.use_fp8 = false;
      nvfp4.use_nvfp4 = true;
      nvfp4.x_global_scale = *global_scale;
      ops.push_back({"low-latency dispatch (BF16)", [=] { (void)in; *handle = buffer->low_latency_dispatch(bf16).handle; },
                     expert_pairs, 2 * std::int64_t{o.hidden} + 16});
      ops.back().traffic = {static_cast<double>(tokens) * 2.0 * o.hidden, static_cast<double>(expert_pairs) * 2.0 * o.hidden};
      ops.push_back({"low-latency dispatch (NVFP4)",
                     [=] { (void)in, (void)global_scale; *handle = buffer->low_latency_dispatch(nvfp4).handle; },
                     expert_pairs, o.hidden / 2 + o.hidden / 16 + 16});
      ops.back().traffic = {static_cast<double>(tokens) * 2.0 * o.hidden,
                            static_cast<double>(expert_pairs) * (o.hidden / 2 + o.hidden / 16)};
    }
    add_baseline(o, g, in, ops, "low-latency dispatch", "low-latency combine");
    return ops;
  };
}

}  // namespace moe_ep::tools::bench
