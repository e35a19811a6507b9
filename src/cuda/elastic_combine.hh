// ElasticDevice<Exec>::combine (included by elastic_device_impl.hh).
//
// On the host: validate, agree, then queue on the communication stream: stage (processes only)
// -> barrier 0 -> every token's units in reduction order -> the sums -> the weights -> barrier 1
// (elastic_steps.hh has the steps). Each token's source rank pulls the rows from the ranks that
// hold them: no rank writes into another's memory.
#pragma once

#include "cuda/elastic_device.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::cuda {

template <Executor Exec>
std::shared_ptr<const DeviceHandleState> ElasticDevice<Exec>::check_combine(const CombineArgs& a,
                                                                            const std::string& ctx) {
  const DLDevice dev = exec_->dl_device();
  if (a.num_sms < 0 || a.num_sms > kMaxWorkers) core::fail(ctx, "num_sms = {} is outside [0, {}]", a.num_sms, kMaxWorkers);
  if (!a.handle) core::fail(ctx, "handle is missing (combine needs the handle of a dispatch)");
  auto state = std::static_pointer_cast<const DeviceHandleState>(a.handle->provider_state);
  if (!state || state->buffer_id != id_) core::fail(ctx, "the handle was not made by this buffer (cuda provider, rank {})", rank_);
  auto same = [&](const char* name, std::int64_t given, std::int64_t made) {
    if (given != made) core::fail(ctx, "handle.{} = {} differs from the {} its dispatch produced", name, given, made);
  };
  same("do_expand", a.handle->do_expand, state->do_expand);
  same("num_tokens", a.handle->num_tokens, state->num_tokens);
  same("num_topk", a.handle->num_topk, state->num_topk);
  same("hidden", a.handle->hidden, state->hidden);
  same("num_recv_tokens", a.handle->num_recv_tokens, state->num_recv_tokens);
  same("num_expanded_tokens", a.handle->num_expanded_tokens, state->num_expanded_tokens);
  const std::int64_t rows = state->do_expand ? state->num_expanded_tokens : state->num_recv_tokens;
  const std::int64_t H = state->hidden, k = state->num_topk, N = state->num_tokens;
  core::expect_tensor(ctx, "x", a.x, a.x.dtype(), {-1, -1}, dev);
  if (a.x.dtype() != DType::kBF16)
    core::fail(ctx, "x has dtype {} ({}); combine reduces bfloat16 rows only", dtype_name(a.x.dtype()), a.x.describe());
  core::expect_tensor(ctx, "x", a.x, DType::kBF16, {-1, H}, dev);
  core::expect_rows_contiguous(ctx, "x", a.x);
  if (a.x.size(0) != rows)
    core::fail(ctx, "x has {} rows, the handle's {} layout has {}", a.x.size(0), state->do_expand ? "expanded" : "compact",
               rows);
  if (a.topk_weights.defined()) {
    if (state->do_expand) {
      core::expect_tensor(ctx, "topk_weights", a.topk_weights, DType::kFP32, {rows}, dev);
    } else {
      core::expect_tensor(ctx, "topk_weights", a.topk_weights, DType::kFP32, {rows, k}, dev);
      core::expect_rows_contiguous(ctx, "topk_weights", a.topk_weights);
    }
  }
  if (a.bias.size() > 2) core::fail(ctx, "{} biases given, at most 2", a.bias.size());
  for (std::size_t b = 0; b < a.bias.size(); ++b) {
    const std::string name = fmt::format("bias[{}]", b);
    core::expect_tensor(ctx, name, a.bias[b], DType::kBF16, {N, H}, dev);
    core::expect_rows_contiguous(ctx, name, a.bias[b]);
  }
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
  Geometry g;
  g.num_ranks = R_;
  g.rank = rank_;
  g.max_tokens_per_rank = config_.num_max_tokens_per_rank;
  std::int64_t rows = 0, off_w = 0, off_x = 0;
  if (!local) {
    try {
      state = check_combine(a, ctx);
      g.num_tokens = state->num_tokens;
      g.num_topk = state->num_topk;
      g.num_experts = state->num_experts;
      g.experts_per_rank = g.num_experts / R_;
      g.expanded_layout = state->do_expand;
      rows = g.expanded_layout ? state->num_expanded_tokens : state->num_recv_tokens;
      off_w = round_up(g.receive_capacity() * g.num_topk * 4, 256);  // staging: lanes, weights, x
      off_x = off_w + round_up((g.expanded_layout ? rows : rows * g.num_topk) * 4, 256);
      staging_bytes(off_x + rows * state->hidden * 2, op);
      exec_->after_caller(a.stream);  // before the agreement, as in dispatch
    } catch (const Error&) {
      local = std::current_exception();
    }
  }
  const int H = state ? state->hidden : 0;
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
CombineResult ElasticDevice<Exec>::reduce_rows(const CombineArgs& a, const DeviceHandleState& handle, const Geometry& g,
                                               std::int64_t rows, std::int64_t off_w, std::int64_t off_x,
                                               const PeerTensors& pt) {
  const char* op = "combine";
  const int H = handle.hidden;
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
