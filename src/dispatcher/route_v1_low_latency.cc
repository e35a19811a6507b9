// V1 low-latency mode: low_latency_dispatch and low_latency_combine with their receive hooks
// (output format kLowLatency; FP8 and NVFP4 cast inside the buffer). The first low-latency batch
// after a normal-mode batch on the same buffer cleans the low-latency pool first.
#include "dispatcher/route.hh"

namespace moe_ep::dispatcher {
namespace {

class V1LowLatencyRoute final : public Route {
 public:
  explicit V1LowLatencyRoute(const RouteContext& context) : c_(context) {}

  OutputFormat format() const override { return OutputFormat::kLowLatency; }

  void start_dispatch(const RouteInputs& in) override {
    const int E = c_.options.num_experts;
    provider::LegacyBackend& b = *c_.shared.legacy();
    if (c_.shared.normal_since_clean) {  // normal -> low-latency transition
      b.clean_low_latency_buffer(c_.cap(), c_.options.hidden, E);
      c_.shared.normal_since_clean = false;
      ++c_.shared.stats.clean_calls;
    }
    const bool nvfp4 = c_.nvfp4();
    LowLatencyDispatchArgs a{.x = in.x,
                             .topk_idx = in.topk_idx,
                             .num_max_dispatch_tokens_per_rank = c_.cap(),
                             .num_experts = E,
                             .use_fp8 = c_.fp8(),
                             .round_scale = c_.options.round_scale,
                             .use_ue8m0 = c_.options.use_ue8m0,
                             .use_nvfp4 = nvfp4,
                             .use_ue8m0_for_sf = nvfp4 && c_.options.nvfp4_use_ue8m0,
                             .return_recv_hook = !in.dispatch_at_once};
    if (nvfp4) {
      global_scale_ = Tensor::empty({}, DType::kFP32);
      *global_scale_.data_as<float>() = c_.options.nvfp4_global_scale;
      a.x_global_scale = global_scale_;
    }
    dispatched_ = b.low_latency_dispatch(a);
  }

  void finish_dispatch(const RouteInputs& in, DispatchOutput& out) override {
    if (dispatched_.hook) dispatched_.hook();
    out.hidden_states = dispatched_.recv_x;
    out.hidden_states_scale = dispatched_.recv_x_scales;
    out.masked_m = dispatched_.packed_recv_count;
    out.expected_m = c_.expected_m(in.num_tokens);
  }

  void check_combine_input(std::string_view context, const Tensor& y) const override {
    check_slab_input(context, c_, y);
  }

  void start_combine(const RouteInputs& in, const Tensor& expert_output) override {
    combined_ = c_.shared.legacy()->low_latency_combine({.x = expert_output,
                                                         .topk_idx = in.topk_idx,
                                                         .topk_weights = in.topk_weights,
                                                         .handle = dispatched_.handle,
                                                         .return_recv_hook = !in.combine_at_once});
  }

  Tensor finish_combine() override {
    if (combined_.hook) combined_.hook();
    return combined_.combined_x;
  }

 private:
  RouteContext c_;
  Tensor global_scale_;  // NVFP4: the scalar gs the buffer reads
  LowLatencyDispatchResult dispatched_;
  LowLatencyCombineResult combined_;
};

}  // namespace

std::unique_ptr<Route> make_v1_low_latency_route(const RouteContext& context) {
  return std::make_unique<V1LowLatencyRoute>(context);
}

}  // namespace moe_ep::dispatcher
