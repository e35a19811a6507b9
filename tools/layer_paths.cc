#include "layer_paths.hh"

#include <fmt/format.h>

#include "core/arith.hh"
#include "core/npy.hh"
#include "core/timeout.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"

namespace moe_ep::tools {
namespace {

// A view's storage as a contiguous tensor of `shape` (the layout a permuted or transposed view
// was made from), for .npy files.
TensorView storage(const TensorView& v, std::initializer_list<std::int64_t> shape) {
  return TensorView(v.data(), v.dtype(), shape);
}

// What every path holds: the layer, this rank's batch, one buffer and the last call's results.
template <class BufferT, class Received, class Combined>
class PathBase : public LayerPath {
 public:
  void barrier() override { buffer_.barrier(); }
  Tensor combined_x() const override { return combined_.combined_x; }

 protected:
  template <class BufferConfigT>
  PathBase(Group& g, const LayerConfig& c, const ExpertParams& p, const RankBatch& b, const PathOptions& o,
           const BufferConfigT& config)
      : c_(c), params_(p), batch_(b), options_(o), rank_(g.rank()), buffer_(g, config) {}

  std::string npy_path(const std::string& dir, const char* name) const {
    return fmt::format("{}/rank{}_{}.npy", dir, rank_, name);
  }
  // This rank's batch: x (and its FP8 cast), the routing.
  void dump_inputs(const std::string& dir, bool fp8) const {
    core::write_npy(npy_path(dir, "x"), batch_.x);
    if (fp8) {
      core::write_npy(npy_path(dir, "x_fp8"), batch_.x_fp8);
      core::write_npy(npy_path(dir, "x_scales"), batch_.x_scales);
    }
    core::write_npy(npy_path(dir, "topk_idx"), batch_.topk_idx);
    core::write_npy(npy_path(dir, "topk_weights"), batch_.topk_weights);
  }

  const LayerConfig& c_;
  const ExpertParams& params_;
  const RankBatch& batch_;
  PathOptions options_;
  int rank_;
  BufferT buffer_;
  Received received_;
  Tensor expert_out_;
  Combined combined_;
};

class V2Path final : public PathBase<ElasticBuffer, DispatchResult, CombineResult> {
 public:
  V2Path(Group& g, const LayerConfig& c, const ExpertParams& p, const RankBatch& b, const PathOptions& o)
      : PathBase(g, c, p, b, o,
                 ElasticBufferConfig{.num_max_tokens_per_rank = c.tokens,
                                     .hidden = c.hidden,
                                     .num_topk = c.topk,
                                     .use_fp8_dispatch = c.fp8,
                                     .allow_hybrid_mode = c.allow_hybrid,
                                     .allow_multiple_reduction = c.multi,
                                     .num_cpu_timeout_secs = core::timeout_from_env()}) {
    args_ = {.x = c.fp8 ? b.x_fp8.view() : b.x.view(),
             .topk_idx = b.topk_idx,
             .topk_weights = b.topk_weights,
             .num_experts = c.experts,
             .expert_alignment = c.alignment,
             .num_sms = o.workers,
             .async_with_compute_stream = o.async,
             .do_expand = c.expand,
             .do_zero_padding = c.expand};
    if (c.fp8) args_.x_scales = b.x_scales;
  }
  void dispatch() override {
    received_ = buffer_.dispatch(args_);
    received_.event.wait();
  }
  void experts() override { expert_out_ = run_experts(c_, params_, rank_, received_); }
  void combine() override {
    combined_ = buffer_.combine({.x = expert_out_,
                                 .handle = received_.handle,
                                 .topk_weights = received_.recv_topk_weights,
                                 .num_sms = options_.workers,
                                 .async_with_compute_stream = options_.async});
    combined_.event.wait();
  }
  Tensor combined_weights() const override { return combined_.combined_topk_weights; }
  std::int64_t received_rows() const override {
    const EPHandle& h = *received_.handle;
    if (!c_.expand) return h.psum_num_recv_tokens_per_scaleup_rank.data_as<const std::int32_t>()[h.psum_num_recv_tokens_per_scaleup_rank.size(0) - 1];
    std::int64_t rows = 0;
    for (int i = 0; i < h.num_unaligned_recv_tokens_per_expert.size(0); ++i)
      rows += h.num_unaligned_recv_tokens_per_expert.data_as<const std::int32_t>()[i];
    return rows;
  }
  int workers() const override { return received_.handle->num_sms; }
  void dump(const std::string& dir) const override {
    auto path = [&](const char* name) { return npy_path(dir, name); };
    dump_inputs(dir, c_.fp8);
    core::write_npy(path("recv_x"), received_.recv_x);
    if (c_.fp8) core::write_npy(path("recv_x_scales"), received_.recv_x_scales);
    if (!c_.expand) core::write_npy(path("recv_topk_idx"), received_.recv_topk_idx);
    core::write_npy(path("recv_topk_weights"), received_.recv_topk_weights);
    core::write_npy(path("recv_src_metadata"), received_.handle->recv_src_metadata);
    core::write_npy(path("psum_num_recv_tokens_per_expert"), received_.handle->psum_num_recv_tokens_per_expert);
    core::write_npy(path("expert_out"), expert_out_);
    core::write_npy(path("combined_x"), combined_.combined_x);
    core::write_npy(path("combined_topk_weights"), combined_.combined_topk_weights);
  }

 private:
  DispatchArgs args_;
};

Config v1_config(Config config, int workers) {
  if (workers > 0) config.num_sms = 2 * workers;
  return config;
}

class V1Path final : public PathBase<Buffer, LegacyDispatchResult, CombineResult> {
 public:
  V1Path(Group& g, const LayerConfig& c, const ExpertParams& p, const RankBatch& b, const PathOptions& o)
      // Across nodes, tokens travel through the scale-out pool: size it like V2's buffer.
      : PathBase(g, c, p, b, o,
                 BufferConfig{.num_rdma_bytes = c.scaleout > 1 ? ElasticBuffer::get_buffer_size_hint(
                                                                     g, c.tokens, c.hidden, c.topk, c.fp8)
                                                               : 0,
                              .num_cpu_timeout_secs = core::timeout_from_env()}),
        dispatch_config_(v1_config(Buffer::get_dispatch_config(c.ranks), o.workers)),
        combine_config_(v1_config(Buffer::get_combine_config(c.ranks), o.workers)) {
    if (c.expand) throw InvalidArgument("--api v1: normal mode has no expanded layout (drop --expand)");
  }
  void dispatch() override {
    const DispatchLayout layout = buffer_.get_dispatch_layout(batch_.topk_idx, c_.experts);
    LegacyDispatchArgs args{.x = c_.fp8 ? batch_.x_fp8.view() : batch_.x.view(),
                            .num_tokens_per_rank = layout.num_tokens_per_rank,
                            .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                            .is_token_in_rank = layout.is_token_in_rank,
                            .num_tokens_per_expert = layout.num_tokens_per_expert,
                            .topk_idx = batch_.topk_idx,
                            .topk_weights = batch_.topk_weights,
                            .expert_alignment = c_.alignment,
                            .config = dispatch_config_,
                            .async_finish = options_.async};
    if (c_.fp8) args.x_scales = batch_.x_scales;
    received_ = buffer_.dispatch(args);
    received_.event.wait();
  }
  void experts() override {
    // The experts read the rows, local ids and weights; the compact layout is V2's.
    DispatchResult view{.recv_x = received_.recv_x,
                        .recv_x_scales = received_.recv_x_scales,
                        .recv_topk_idx = received_.recv_topk_idx,
                        .recv_topk_weights = received_.recv_topk_weights,
                        .handle = std::const_pointer_cast<EPHandle>(received_.handle->routing)};
    expert_out_ = run_experts(c_, params_, rank_, view);
  }
  void combine() override {
    combined_ = buffer_.combine({.x = expert_out_,
                                 .handle = received_.handle,
                                 .topk_weights = received_.recv_topk_weights,
                                 .config = combine_config_,
                                 .async_finish = options_.async});
    combined_.event.wait();
  }
  Tensor combined_weights() const override { return combined_.combined_topk_weights; }
  std::int64_t received_rows() const override { return received_.recv_x.size(0); }
  int workers() const override { return received_.handle->routing->num_sms; }
  void dump(const std::string& dir) const override {
    auto path = [&](const char* name) { return npy_path(dir, name); };
    dump_inputs(dir, c_.fp8);
    core::write_npy(path("recv_x"), received_.recv_x);
    if (c_.fp8) core::write_npy(path("recv_x_scales"), received_.recv_x_scales);
    core::write_npy(path("recv_topk_idx"), received_.recv_topk_idx);
    core::write_npy(path("recv_topk_weights"), received_.recv_topk_weights);
    const LegacyHandle& h = *received_.handle;
    core::write_npy(path("rank_prefix_matrix"), h.rank_prefix_matrix);
    core::write_npy(path("recv_src_idx"), h.recv_src_idx);
    core::write_npy(path("is_token_in_rank"), h.is_token_in_rank);
    core::write_npy(path("send_head"), h.send_head);
    const std::vector<int>& counts = received_.num_recv_tokens_per_expert_list;
    Tensor per_expert = Tensor::empty({static_cast<std::int64_t>(counts.size())}, DType::kInt32);
    std::copy(counts.begin(), counts.end(), per_expert.data_as<std::int32_t>());
    core::write_npy(path("num_recv_tokens_per_expert_list"), per_expert);
    core::write_npy(path("expert_out"), expert_out_);
    core::write_npy(path("combined_x"), combined_.combined_x);
    core::write_npy(path("combined_topk_weights"), combined_.combined_topk_weights);
  }

 private:
  Config dispatch_config_, combine_config_;
};

class LowLatencyPath final : public PathBase<Buffer, LowLatencyDispatchResult, LowLatencyCombineResult> {
 public:
  LowLatencyPath(Group& g, const LayerConfig& c, const ExpertParams& p, const RankBatch& b, const PathOptions& o)
      : PathBase(g, c, p, b, o,
                 BufferConfig{.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(c.tokens, c.hidden, c.ranks, c.experts),
                              .low_latency_mode = true,
                              .num_cpu_timeout_secs = core::timeout_from_env()}) {
    if (c.expand) throw InvalidArgument("--low-latency: the slab is already per expert (drop --expand)");
  }
  void dispatch() override {
    LowLatencyDispatchArgs args{.x = batch_.x,
                                .topk_idx = batch_.topk_idx,
                                .num_max_dispatch_tokens_per_rank = c_.tokens,
                                .num_experts = c_.experts,
                                .topk_weights = batch_.topk_weights,
                                .use_fp8 = c_.fp8,
                                .use_nvfp4 = c_.nvfp4,
                                .use_ue8m0_for_sf = c_.nvfp4_ue8m0,
                                .async_finish = options_.async};
    if (c_.nvfp4) args.x_global_scale = batch_.x_global_scale;
    received_ = buffer_.low_latency_dispatch(args);
    received_.event.wait();
  }
  void experts() override { expert_out_ = run_experts_low_latency(c_, params_, rank_, received_); }
  void combine() override {
    combined_ = buffer_.low_latency_combine({.x = expert_out_,
                                             .topk_idx = batch_.topk_idx,
                                             .topk_weights = batch_.topk_weights,
                                             .handle = received_.handle,
                                             .use_logfmt = c_.logfmt,
                                             .async_finish = options_.async});
    combined_.event.wait();
  }
  Tensor combined_weights() const override { return Tensor(); }
  std::int64_t received_rows() const override {
    std::int64_t rows = 0;
    for (int i = 0; i < received_.packed_recv_count.size(0); ++i) rows += received_.packed_recv_count.data_as<const std::int32_t>()[i];
    return rows;
  }
  int workers() const override { return 1; }
  void dump(const std::string& dir) const override {
    auto path = [&](const char* name) { return npy_path(dir, name); };
    const std::int64_t El = c_.experts / c_.ranks, RN = std::int64_t{c_.ranks} * c_.tokens, H = c_.hidden;
    dump_inputs(dir, false);  // the low-latency dispatch casts x itself
    const TensorView& sf = received_.recv_x_scales;
    if (c_.nvfp4) {  // the storage of the permuted views
      core::write_npy(path("recv_x"), storage(received_.recv_x, {El, RN, H / 2}));
      core::write_npy(path("recv_x_scales"), storage(sf, {El, core::ceil_div(RN, 128), H / 64, 32, 4, 4}));
    } else {
      core::write_npy(path("recv_x"), received_.recv_x);
      if (c_.fp8) core::write_npy(path("recv_x_scales"), storage(sf, {El, sf.size(2), RN}));  // token stride 1
    }
    core::write_npy(path("packed_recv_count"), received_.packed_recv_count);
    core::write_npy(path("packed_recv_src_info"), received_.handle->packed_recv_src_info);
    core::write_npy(path("packed_recv_layout_range"), received_.handle->packed_recv_layout_range);
    core::write_npy(path("recv_topk_weights"), received_.recv_topk_weights);
    core::write_npy(path("recv_rank_info"), received_.recv_rank_info);
    core::write_npy(path("expert_out"), expert_out_);
    core::write_npy(path("combined_x"), combined_.combined_x);
  }
};

}  // namespace

std::unique_ptr<LayerPath> make_path(Api api, Group& group, const LayerConfig& config, const ExpertParams& params,
                                     const RankBatch& batch, const PathOptions& options) {
  switch (api) {
    case Api::kV2:
      return std::make_unique<V2Path>(group, config, params, batch, options);
    case Api::kV1:
      return std::make_unique<V1Path>(group, config, params, batch, options);
    case Api::kV1LowLatency:
      return std::make_unique<LowLatencyPath>(group, config, params, batch, options);
  }
  return nullptr;
}

std::int64_t dispatch_row_bytes(Api api, const LayerConfig& c) {
  const std::int64_t H = c.hidden, P = c.fp8 ? H / 128 : 0, k = c.topk;
  if (api == Api::kV1LowLatency) return (c.nvfp4 ? H / 2 + H / 16 : c.fp8 ? H + 4 * P : 2 * H) + 16;
  return (c.fp8 ? H : 2 * H) + 4 * P + (c.expand ? 4 : 12 * k);
}

std::int64_t combine_row_bytes(Api api, const LayerConfig& c) {
  if (api == Api::kV1LowLatency) return 2 * std::int64_t{c.hidden};
  return 2 * std::int64_t{c.hidden} + (c.expand ? 4 : 4 * std::int64_t{c.topk});
}

std::string dispatch_row_formula(Api api, const LayerConfig& c) {
  const std::string payload =
      c.fp8 ? fmt::format("hidden x 1 B + {} scales x 4 B", c.hidden / 128) : std::string("hidden x 2 B");
  if (api == Api::kV1LowLatency && c.nvfp4) return "hidden x 1/2 B (E2M1) + hidden/16 x 1 B scales + 16 B message header";
  if (api == Api::kV1LowLatency) return payload + " + 16 B message header";
  return payload + (c.expand ? " + one 4 B weight" : fmt::format(" + top-{} x (8 B id + 4 B weight)", c.topk));
}

std::string combine_row_formula(Api api, const LayerConfig& c) {
  if (api == Api::kV1LowLatency && c.logfmt)
    return "hidden x 2 B (BF16 size; LogFMT sends castable chunks in 10/16 of it, plus 4 B per 128 channels)";
  if (api == Api::kV1LowLatency) return "hidden x 2 B";
  return c.expand ? "hidden x 2 B + one 4 B weight" : fmt::format("hidden x 2 B + top-{} x 4 B weights", c.topk);
}

const char* api_name(Api api) {
  switch (api) {
    case Api::kV2:
      return "V2 ElasticBuffer";
    case Api::kV1:
      return "V1 Buffer, normal mode";
    case Api::kV1LowLatency:
      return "V1 Buffer, low-latency mode";
  }
  return "?";
}

}  // namespace moe_ep::tools
