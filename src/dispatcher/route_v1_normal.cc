// V1 normal mode: get_dispatch_layout + an asynchronous dispatch, then the asynchronous combine
// (output format kNormal).
#include "dispatcher/route.hh"

namespace moe_ep::dispatcher {
namespace {

class V1NormalRoute final : public Route {
 public:
  explicit V1NormalRoute(const RouteContext& context) : c_(context) {}

  OutputFormat format() const override { return OutputFormat::kNormal; }

  void start_dispatch(const RouteInputs& in) override {
    if (c_.fp8()) quantize_fp8_input(c_, in.x, x_fp8_, x_scales_);
    const TensorView x = c_.fp8() ? x_fp8_.view() : in.x.view();
    provider::LegacyBackend& b = *c_.shared.legacy();
    layout_ = b.get_dispatch_layout(in.topk_idx, c_.options.num_experts);
    Config config = Buffer::get_dispatch_config(c_.ranks());
    if (*c_.options.num_workers > 0) config.num_sms = 2 * *c_.options.num_workers;
    LegacyDispatchArgs a{.x = x,
                         .num_tokens_per_rank = layout_.num_tokens_per_rank,
                         .num_tokens_per_rdma_rank = layout_.num_tokens_per_rdma_rank,
                         .is_token_in_rank = layout_.is_token_in_rank,
                         .num_tokens_per_expert = layout_.num_tokens_per_expert,
                         .topk_idx = in.topk_idx,
                         .topk_weights = in.topk_weights,
                         .expert_alignment = c_.options.expert_alignment,
                         .config = config,
                         .async_finish = true};
    if (c_.fp8()) a.x_scales = x_scales_;
    c_.shared.normal_since_clean = true;
    dispatched_ = b.dispatch(a);
  }

  void finish_dispatch(const RouteInputs&, DispatchOutput& out) override {
    dispatched_.event.wait();
    take_received_rows(dispatched_, out);
    out.num_recv_tokens_per_expert = dispatched_.num_recv_tokens_per_expert_list;
  }

  void check_combine_input(std::string_view context, const Tensor& y) const override {
    check_row_input(context, c_, dispatched_.recv_x.size(0), y);
  }

  void start_combine(const RouteInputs&, const Tensor& expert_output) override {
    Config config = Buffer::get_combine_config(c_.ranks());
    if (*c_.options.num_workers > 0) config.num_sms = 2 * *c_.options.num_workers;
    combined_ = c_.shared.legacy()->combine(
        {.x = expert_output, .handle = dispatched_.handle, .config = config, .async_finish = true});
  }

  Tensor finish_combine() override { return wait_combined(combined_); }

 private:
  RouteContext c_;
  Tensor x_fp8_, x_scales_;
  DispatchLayout layout_;  // read by the asynchronous dispatch
  LegacyDispatchResult dispatched_;
  CombineResult combined_;
};

}  // namespace

std::unique_ptr<Route> make_v1_normal_route(const RouteContext& context) {
  return std::make_unique<V1NormalRoute>(context);
}

}  // namespace moe_ep::dispatcher
