// V2 normal mode: dispatch(do_expand, do_cpu_sync = true) on the compute stream, then combine
// (output format kNormal for the compact layout, kV2Expanded for the expanded one).
#include "dispatcher/route.hh"

namespace moe_ep::dispatcher {
namespace {

class V2NormalRoute final : public Route {
 public:
  V2NormalRoute(const RouteContext& context, bool expanded) : c_(context), expanded_(expanded) {}

  OutputFormat format() const override { return expanded_ ? OutputFormat::kV2Expanded : OutputFormat::kNormal; }

  void start_dispatch(const RouteInputs& in) override {
    if (c_.fp8()) quantize_fp8_input(c_, in.x, x_fp8_, x_scales_);
    DispatchArgs a{.x = c_.fp8() ? x_fp8_.view() : in.x.view(),
                   .topk_idx = in.topk_idx,
                   .topk_weights = in.topk_weights,
                   .num_experts = c_.options.num_experts,
                   .expert_alignment = c_.options.expert_alignment,
                   .num_sms = *c_.options.num_workers,
                   .async_with_compute_stream = true,
                   .do_cpu_sync = true,
                   .do_expand = expanded_};
    if (c_.fp8()) a.x_scales = x_scales_;
    dispatched_ = c_.shared.elastic()->dispatch(a);
  }

  void finish_dispatch(const RouteInputs&, DispatchOutput& out) override {
    dispatched_.event.wait();
    take_received_rows(dispatched_, out);
    out.num_recv_tokens_per_expert = dispatched_.handle->num_recv_tokens_per_expert_list;
    if (expanded_) {
      out.masked_m = dispatched_.handle->num_unaligned_recv_tokens_per_expert;
      return;
    }
    // V2's compact rows carry the token's full weight row; the normal format (V1's) has 0 where
    // the expert lives elsewhere.
    const std::int64_t n = out.topk_ids.size(0) * out.topk_ids.size(1);
    for (std::int64_t i = 0; i < n; ++i)
      if (out.topk_ids.data_as<const std::int64_t>()[i] < 0) out.topk_weights.data_as<float>()[i] = 0.0f;
  }

  void check_combine_input(std::string_view context, const Tensor& y) const override {
    check_row_input(context, c_, dispatched_.recv_x.size(0), y);
  }

  void start_combine(const RouteInputs&, const Tensor& expert_output) override {
    combined_ = c_.shared.elastic()->combine({.x = expert_output,
                                              .handle = dispatched_.handle,
                                              .num_sms = *c_.options.num_workers,
                                              .async_with_compute_stream = true});
  }

  Tensor finish_combine() override { return wait_combined(combined_); }

 private:
  RouteContext c_;
  bool expanded_;
  Tensor x_fp8_, x_scales_;
  DispatchResult dispatched_;
  CombineResult combined_;
};

}  // namespace

std::unique_ptr<Route> make_v2_normal_route(const RouteContext& context, bool expanded) {
  return std::make_unique<V2NormalRoute>(context, expanded);
}

}  // namespace moe_ep::dispatcher
