// V2 normal mode with HybridEP's layout and reduction order (docs/dispatcher.md §4-§5): each
// token's top-k lanes are reordered into HybridEP's order (routing/lane_order.hh), then an
// expanded dispatch with zero padding gives HybridEP's permuted rows (grouped by local expert,
// ascending source id, each group padded to expert_alignment with zero rows), and the combine sums
// with the source's own node's ranks as separate terms (elastic::CombineExtras), so the result is
// bit-identical to HybridEP's combine_with_unpermute. Needs the built-in ElasticBuffer: another
// provider's backend has DeepEP's API only, whose combine rounds the own node's sum once more.
#include <fmt/format.h>

#include "dispatcher/provider_registry.hh"
#include "dispatcher/route.hh"
#include "elastic/elastic_access.hh"
#include "moe_ep/error.hpp"
#include "routing/lane_order.hh"

namespace moe_ep::dispatcher {
namespace {

// The caller's top-k ids and weights as contiguous copies with their lanes in HybridEP's order.
void order_lanes(const RouteContext& c, const RouteInputs& in, Tensor& ids, Tensor& weights) {
  const std::int64_t n = in.topk_idx.size(0), k = in.topk_idx.size(1);
  ids = Tensor::empty({n, k}, DType::kInt64);
  weights = Tensor::empty({n, k}, DType::kFP32);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      ids.data_as<std::int64_t>()[t * k + j] =
          in.topk_idx.data_as<const std::int64_t>()[t * in.topk_idx.stride(0) + j * in.topk_idx.stride(1)];
      weights.data_as<float>()[t * k + j] =
          in.topk_weights.data_as<const float>()[t * in.topk_weights.stride(0) + j * in.topk_weights.stride(1)];
    }
  const routing::Geometry geo{c.ranks(), c.options.num_experts, c.shared.group.num_scaleout()};
  routing::order_lanes_hybrid_ep(ids.data_as<std::int64_t>(), weights.data_as<float>(), nullptr,
                                 static_cast<int>(n), static_cast<int>(k), geo, c.shared.group.rank());
}

class V2HybridEpRoute final : public Route {
 public:
  explicit V2HybridEpRoute(const RouteContext& context) : c_(context) {}

  OutputFormat format() const override { return OutputFormat::kHybridEp; }

  void start_dispatch(const RouteInputs& in) override {
    buffer_ = builtin_elastic_buffer(c_.shared.elastic());
    if (!buffer_)
      throw InvalidArgument(fmt::format("[rank {}] dispatcher: MOE_EP_V2_NORMAL_LAYOUT = hybrid_ep needs the built-in "
                                        "provider's ElasticBuffer; this buffer's provider offers DeepEP's API only",
                                        c_.shared.group.rank()));
    order_lanes(c_, in, topk_idx_, topk_weights_);
    if (c_.fp8()) quantize_fp8_input(c_, in.x, x_fp8_, x_scales_);
    DispatchArgs a{.x = c_.fp8() ? x_fp8_.view() : in.x.view(),
                   .topk_idx = topk_idx_,
                   .topk_weights = topk_weights_,
                   .num_experts = c_.options.num_experts,
                   .expert_alignment = c_.options.expert_alignment,
                   .num_sms = *c_.options.num_workers,
                   .async_with_compute_stream = true,
                   .do_cpu_sync = true,
                   .do_expand = true,
                   .do_zero_padding = true};
    if (c_.fp8()) a.x_scales = x_scales_;
    dispatched_ = elastic::Access::dispatch(*buffer_, a, {});
  }

  void finish_dispatch(const RouteInputs&, DispatchOutput& out) override {
    dispatched_.event.wait();
    take_received_rows(dispatched_, out);
    out.num_recv_tokens_per_expert = dispatched_.handle->num_recv_tokens_per_expert_list;
    out.masked_m = dispatched_.handle->num_unaligned_recv_tokens_per_expert;
  }

  void check_combine_input(std::string_view context, const Tensor& y) const override {
    check_row_input(context, c_, dispatched_.recv_x.size(0), y);
  }

  void start_combine(const RouteInputs&, const Tensor& expert_output) override {
    combined_ = elastic::Access::combine(
        *buffer_,
        {.x = expert_output, .handle = dispatched_.handle, .num_sms = *c_.options.num_workers,
         .async_with_compute_stream = true},
        {.own_node_rank_terms = true});
  }

  Tensor finish_combine() override { return wait_combined(combined_); }

 private:
  RouteContext c_;
  ElasticBuffer* buffer_ = nullptr;
  Tensor topk_idx_, topk_weights_;  // the caller's, lanes in HybridEP's order
  Tensor x_fp8_, x_scales_;
  DispatchResult dispatched_;
  CombineResult combined_;
};

}  // namespace

std::unique_ptr<Route> make_v2_hybrid_ep_route(const RouteContext& context) {
  return std::make_unique<V2HybridEpRoute>(context);
}

}  // namespace moe_ep::dispatcher
