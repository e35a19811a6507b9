// The choice of a batch's route and what the routes share.
#include "dispatcher/route.hh"

#include "core/checks.hh"
#include "moe_ep/convert.hpp"

namespace moe_ep::dispatcher {

std::unique_ptr<Route> make_route(Generation generation, DispatchMode mode, const RouteContext& context) {
  const bool low_latency = mode == DispatchMode::kLowLatency;
  if (generation == Generation::kV1) return low_latency ? make_v1_low_latency_route(context) : make_v1_normal_route(context);
  if (low_latency) return make_v2_low_latency_route(context);
  return make_v2_normal_route(context, *context.options.v2_normal_layout);
}

void quantize_fp8_input(const RouteContext& context, const Tensor& x, Tensor& data, Tensor& scales) {
  Fp8Tensor q = quantize_fp8(x, {.round_scale = context.options.round_scale, .use_ue8m0 = context.options.use_ue8m0});
  data = q.data;
  scales = q.scales;
}

void check_row_input(std::string_view context, const RouteContext& c, std::int64_t rows, const Tensor& y) {
  core::expect_tensor(context, "expert_output", y, DType::kBF16, {rows, c.options.hidden});
  core::expect_rows_contiguous(context, "expert_output", y);
}

void check_slab_input(std::string_view context, const RouteContext& c, const Tensor& y) {
  core::expect_tensor(context, "expert_output", y, DType::kBF16,
                      {c.local_experts(), std::int64_t{c.ranks()} * c.cap(), c.options.hidden});
  core::expect_rows_contiguous(context, "expert_output", y);
}

}  // namespace moe_ep::dispatcher
