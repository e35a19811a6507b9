// ElasticDevice<Exec>::combine (included by elastic_device_impl.hh).
//
// On the host: validate, agree, then queue on the communication stream: stage (processes only)
// -> barrier 0 -> every token's units in reduction order -> the sums -> the weights -> barrier 1
// (elastic_steps.hh has the steps). Each token's source rank pulls the rows from the ranks that
// hold them: no rank writes into another's memory.
#pragma once

#include "core/arith.hh"
#include "cuda/elastic_device.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::cuda {

template <Executor Exec>
std::shared_ptr<const DeviceHandleState> ElasticDevice<Exec>::check_combine(const CombineArgs& a,
                                                                            const std::string& ctx,
                                                                            core::v2::CombineShape& shape) {
  // V2's rules (core/v2_contract.hh, shared with the built-in provider), then this provider's own.
  core::v2::check_call(ctx, a.num_sms, false);
  core::v2::check_combine_handle_given(ctx, a.handle.get());
  auto state = std::static_pointer_cast<const DeviceHandleState>(a.handle->provider_state);
  core::v2::check_handle(ctx, *a.handle, state.get(), state ? state->buffer_id : 0, id_);
  shape = core::v2::check_combine(ctx, a.x, a.topk_weights, a.bias, *state, exec_->dl_device());
  check_peer_readable(ctx, "x", a.x);  // read in place by each token's source rank
  check_peer_readable(ctx, "topk_weights", a.topk_weights);
  return state;
}

template <Executor Exec>
CombineResult ElasticDevice<Exec>::combine(const CombineArgs& a) {
  const char* op = "combine";
  check_usable(op);
  const std::string ctx = context(op);
  std::shared_ptr<const DeviceHandleState> state;
  std::exception_ptr local = take_device_error(op);
  if (!local && !a.rejection.empty()) local = std::make_exception_ptr(InvalidArgument(a.rejection));
  DeviceGeometry g;
  g.num_ranks = R_;
  g.rank = rank_;
  g.max_tokens_per_rank = config_.num_max_tokens_per_rank;
  std::int64_t rows = 0, off_w = 0, off_x = 0;
  int H = 0;
  if (!local) {
    try {
      core::v2::CombineShape shape;
      state = check_combine(a, ctx, shape);
      rows = shape.rows;
      H = shape.hidden;
      g.num_tokens = state->num_tokens;
      g.num_topk = state->num_topk;
      g.num_experts = state->num_experts;
      g.experts_per_rank = g.num_experts / R_;
      g.expanded_layout = state->do_expand;
      off_w = core::round_up<std::int64_t>(g.receive_capacity() * g.num_topk * 4, 256);  // staging: lanes, weights, x
      off_x = off_w + core::round_up<std::int64_t>((g.expanded_layout ? rows : rows * g.num_topk) * 4, 256);
      staging_bytes(off_x + rows * H * 2, op);
      exec_->after_caller(a.stream);  // before the agreement, as in dispatch
    } catch (const Error&) {
      local = std::current_exception();
    }
  }
  const bool has_weights = a.topk_weights.defined();
  Published mine{};
  if (!local) {
    mine.x = publish_address(direct_ ? a.x.data() : stage_at(off_x));
    mine.x_row = direct_ ? a.x.stride(0) * 2 : std::int64_t{H} * 2;
    if (has_weights) {
      mine.weights = publish_address(direct_ ? a.topk_weights.data() : stage_at(off_w));
      mine.weights_row = direct_ ? a.topk_weights.stride(0) : g.expanded_layout ? 1 : g.num_topk;
    }
    mine.lanes = publish_address(direct_ ? static_cast<const void*>(state->arrays.lane_rows) : stage_at(0));
    mine.num_tokens = g.num_tokens;
  }
  comm::Agreement agreement(ctx, "combine");
  agreement.field("operation number", static_cast<std::int64_t>(op_number_ + 1))
      .field("handle's dispatch number", state ? static_cast<std::int64_t>(state->dispatch_number) : 0)
      .field("hidden", H)
      .field("num_topk", g.num_topk)
      .field("do_expand", g.expanded_layout)
      .field("topk_weights given", has_weights)
      .local_error(local);
  const auto payloads = agreement.exchange(*channel_, comm::Scope::kWorld, wait("combine: agreement"),
                                           {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  ++op_number_;
  call_first_barrier_ = barriers_ + 1;
  return after_agreement(op, [&] {
    if (a.previous_event) a.previous_event->wait();
    return reduce_rows(a, *state, g, rows, off_w, off_x, resolve(payloads));
  });
}

template <Executor Exec>
CombineResult ElasticDevice<Exec>::reduce_rows(const CombineArgs& a, const DeviceHandleState& handle, const DeviceGeometry& g,
                                               std::int64_t rows, std::int64_t off_w, std::int64_t off_x,
                                               const DevicePeerTensors& pt) {
  const char* op = "combine";
  const int H = static_cast<int>(a.x.size(1));  // combine's hidden is x's (core::v2::check_combine)
  const bool has_weights = a.topk_weights.defined();
  if (!direct_) {
    if (g.expanded_layout)
      exec_->copy(stage_at(0), handle.arrays.lane_rows, static_cast<std::size_t>(g.receive_capacity()) * g.num_topk * 4);
    pack(*exec_, reinterpret_cast<std::uint16_t*>(stage_at(off_x)), a.x.data_as<const std::uint16_t>(), rows, H,
         a.x.stride(0), 1);
    if (has_weights)
      pack(*exec_, reinterpret_cast<float*>(stage_at(off_w)), a.topk_weights.data_as<const float>(), rows,
           g.expanded_layout ? 1 : g.num_topk, a.topk_weights.stride(0), 1);
  }
  barrier(0);

  CombineResult result;
  result.combined_x = exec_->empty(DType::kBF16, a.stream, g.num_tokens, H);
  if (has_weights) result.combined_topk_weights = exec_->empty(DType::kFP32, a.stream, g.num_tokens, g.num_topk);
  if (a.previous_event_before_epilogue) a.previous_event_before_epilogue->wait();
  auto* const inputs =
      static_cast<std::int64_t*>(exec_->temp(static_cast<std::size_t>(std::max(g.num_tokens, 1)) * g.num_topk * 8));
  auto* const unit_end =
      static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(std::max(g.num_tokens, 1)) * (g.num_topk + 1) * 4));
  combine_units(*exec_, g, config_.allow_multiple_reduction, pt, handle.arrays, status(), inputs, unit_end);
  const std::size_t nb = a.bias.size();
  combine_sums(*exec_, g, H, pt, inputs, unit_end, nb > 0 ? a.bias[0].data_as<const std::uint16_t>() : nullptr,
               nb > 0 ? a.bias[0].stride(0) : 0, nb > 1 ? a.bias[1].data_as<const std::uint16_t>() : nullptr,
               nb > 1 ? a.bias[1].stride(0) : 0, status(), result.combined_x.data_as<std::uint16_t>());
  if (has_weights) combine_weights(*exec_, g, pt, handle.arrays, status(), result.combined_topk_weights.data_as<float>());
  finish(a.stream, a.async_with_compute_stream, result.event, op);
  return result;
}

}  // namespace moe_ep::cuda
