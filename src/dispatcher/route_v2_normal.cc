// V2 normal mode, one route for the three layouts of MOE_EP_V2_NORMAL_LAYOUT (docs/dispatcher.md
// §4-§5): quantize as configured, dispatch(do_cpu_sync = true) on the compute stream, then combine.
// A layout is a LayoutSteps value (the format and the dispatch switches) and three named hooks of
// the route, which the steps above call in the same order for every layout:
//
// - compact (kNormal): the caller's lanes, dispatch(do_expand = false) on the cache's backend;
//   finish_dispatch zeroes the weights of lanes whose expert lives elsewhere.
// - expanded (kV2Expanded): as compact with do_expand = true; finish_dispatch gives masked_m.
// - hybrid_ep (kHybridEp): lanes_of reorders each token's top-k lanes into HybridEP's order
//   (routing/lane_order.hh), then an expanded dispatch with zero padding gives HybridEP's permuted
//   rows (grouped by local expert, ascending source id, each group padded to expert_alignment with
//   zero rows), and the combine sums with the source's own node's ranks as separate terms
//   (elastic::CombineExtras), so the result is bit-identical to HybridEP's combine_with_unpermute.
//   The transfers go to the built-in ElasticBuffer (its calls with extras): another provider's backend has
//   DeepEP's API only, whose combine rounds the own node's sum once more.
#include <fmt/format.h>

#include <utility>

#include "dispatcher/provider_registry.hh"
#include "dispatcher/route.hh"
#include "moe_ep/error.hpp"
#include "routing/lane_order.hh"

namespace moe_ep::dispatcher {
namespace {

// What a layout sets in the route's steps.
struct LayoutSteps {
  OutputFormat format = OutputFormat::kNormal;
  bool expand = false;        // DispatchArgs::do_expand
  bool zero_padding = false;  // DispatchArgs::do_zero_padding
  bool hybrid_ep = false;     // HybridEP's lane order and reduction order, on the built-in ElasticBuffer
};

LayoutSteps steps_of(V2NormalLayout layout) {
  switch (layout) {
    case V2NormalLayout::kExpanded:
      return {.format = OutputFormat::kV2Expanded, .expand = true};
    case V2NormalLayout::kHybridEp:
      return {.format = OutputFormat::kHybridEp, .expand = true, .zero_padding = true, .hybrid_ep = true};
    case V2NormalLayout::kCompact:
      break;
  }
  return {};
}

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

class V2NormalRoute final : public Route {
 public:
  V2NormalRoute(const RouteContext& context, V2NormalLayout layout) : c_(context), steps_(steps_of(layout)) {}

  OutputFormat format() const override { return steps_.format; }

  void start_dispatch(const RouteInputs& in) override {
    if (steps_.hybrid_ep) take_builtin_buffer();
    const auto [topk_idx, topk_weights] = lanes_of(in);
    if (c_.fp8()) quantize_fp8_input(c_, in.x, x_fp8_, x_scales_);
    DispatchArgs a{.x = c_.fp8() ? x_fp8_.view() : in.x.view(),
                   .topk_idx = topk_idx,
                   .topk_weights = topk_weights,
                   .num_experts = c_.options.num_experts,
                   .expert_alignment = c_.options.expert_alignment,
                   .num_sms = *c_.options.num_workers,
                   .async_with_compute_stream = true,
                   .do_cpu_sync = true,
                   .do_expand = steps_.expand,
                   .do_zero_padding = steps_.zero_padding};
    if (c_.fp8()) a.x_scales = x_scales_;
    dispatched_ = buffer_ ? buffer_->dispatch(a) : c_.shared.elastic()->dispatch(a);
  }

  void finish_dispatch(const RouteInputs&, DispatchOutput& out) override {
    dispatched_.event.wait();
    take_received_rows(dispatched_, out);
    out.num_recv_tokens_per_expert = dispatched_.handle->num_recv_tokens_per_expert_list;
    set_layout_fields(out);
  }

  void check_combine_input(std::string_view context, const Tensor& y) const override {
    check_row_input(context, c_, dispatched_.recv_x.size(0), y);
  }

  void start_combine(const RouteInputs&, const Tensor& expert_output) override {
    const CombineArgs a{.x = expert_output,
                        .handle = dispatched_.handle,
                        .num_sms = *c_.options.num_workers,
                        .async_with_compute_stream = true};
    combined_ = buffer_ ? buffer_->combine(a, CombineExtras{.own_node_rank_terms = true})
                        : c_.shared.elastic()->combine(a);
  }

  Tensor finish_combine() override { return wait_combined(combined_); }

 private:
  // Hook (hybrid_ep): the built-in ElasticBuffer behind the cache's backend, which every transfer
  // of this batch then goes to; InvalidArgument when another provider made the backend.
  void take_builtin_buffer() {
    buffer_ = builtin_elastic_buffer(c_.shared.elastic());
    if (!buffer_)
      throw InvalidArgument(fmt::format("[rank {}] dispatcher: MOE_EP_V2_NORMAL_LAYOUT = hybrid_ep needs the built-in "
                                        "provider's ElasticBuffer; this buffer's provider offers DeepEP's API only",
                                        c_.shared.group.rank()));
  }

  // Hook: the top-k ids and weights the dispatch moves: the caller's, or (hybrid_ep) copies with
  // their lanes in HybridEP's order, held by the route.
  std::pair<TensorView, TensorView> lanes_of(const RouteInputs& in) {
    if (!steps_.hybrid_ep) return {in.topk_idx, in.topk_weights};
    order_lanes(c_, in, topk_idx_, topk_weights_);
    return {topk_idx_, topk_weights_};
  }

  // Hook: the output fields of the layout. Expanded rows have masked_m (real rows per local
  // expert); V2's compact rows carry the token's full weight row, while the normal format (V1's)
  // has 0 where the expert lives elsewhere.
  void set_layout_fields(DispatchOutput& out) const {
    if (steps_.expand) {
      out.masked_m = dispatched_.handle->num_unaligned_recv_tokens_per_expert;
      return;
    }
    const std::int64_t n = out.topk_ids.size(0) * out.topk_ids.size(1);
    for (std::int64_t i = 0; i < n; ++i)
      if (out.topk_ids.data_as<const std::int64_t>()[i] < 0) out.topk_weights.data_as<float>()[i] = 0.0f;
  }

  RouteContext c_;
  LayoutSteps steps_;
  ElasticBuffer* buffer_ = nullptr;  // hybrid_ep: the built-in buffer the transfers go to
  Tensor topk_idx_, topk_weights_;   // hybrid_ep: the caller's, lanes in HybridEP's order
  Tensor x_fp8_, x_scales_;
  DispatchResult dispatched_;
  CombineResult combined_;
};

}  // namespace

std::unique_ptr<Route> make_v2_normal_route(const RouteContext& context, V2NormalLayout layout) {
  return std::make_unique<V2NormalRoute>(context, layout);
}

}  // namespace moe_ep::dispatcher
