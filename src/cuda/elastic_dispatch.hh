// ElasticDevice<Exec>::dispatch (included by elastic_device_impl.hh).
//
// On the host: validate, agree, then queue on the communication stream: stage (processes only)
// -> route this rank's tokens -> barrier 0 -> plan the received rows -> [CPU sync: read the
// counts, allocate exact outputs] -> pull every row from its source -> barrier 1
// (elastic_steps.hh has the steps).
#pragma once

#include "core/arith.hh"
#include "cuda/elastic_device.hh"
#include "core/v2_contract.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::cuda {

template <Executor Exec>
void ElasticDevice<Exec>::check_handle(const DispatchArgs& a, DispatchCall& c, const std::string& ctx, int hidden) {
  c.cached_state = std::static_pointer_cast<const DeviceHandleState>(a.handle->provider_state);
  core::v2::check_handle(ctx, *a.handle, c.cached_state.get(), c.cached_state ? c.cached_state->buffer_id : 0, id_);
  const DeviceHandleState& h = *c.cached_state;
  core::v2::check_cached(ctx,
                         {.topk_given = a.topk_idx.defined(), .cpu_sync = a.do_cpu_sync.value_or(false),
                          .stats_given = a.cumulative_local_expert_recv_stats.defined(), .expand = a.do_expand,
                          .num_experts = a.num_experts, .expert_alignment = a.expert_alignment,
                          .max_tokens = a.num_max_tokens_per_rank},
                         h, c.g.num_tokens, hidden);
  c.g.expanded_layout = h.do_expand;
  c.g.expert_alignment = h.expert_alignment;
  c.g.num_topk = h.num_topk;
  c.g.num_experts = h.num_experts;
}

// V2's rules (core/v2_contract.hh, shared with the built-in provider), then this provider's own:
// the buffer's token count, 16-byte aligned rows, memory peers can read, the staging size.
template <Executor Exec>
void ElasticDevice<Exec>::check_dispatch(const DispatchArgs& a, DispatchCall& c, const std::string& ctx) {
  const DLDevice dev = exec_->dl_device();
  DeviceGeometry& g = c.g;
  core::v2::check_call(ctx, a.num_sms, a.previous_event && !a.allocate_on_comm_stream);
  if (g.max_tokens_per_rank != config_.num_max_tokens_per_rank)
    core::fail(ctx, "num_max_tokens_per_rank = {} differs from the buffer's {} (the cuda provider sizes its lists "
               "for the buffer's)", g.max_tokens_per_rank, config_.num_max_tokens_per_rank);
  const core::v2::Payload p = core::v2::check_payload(ctx, a.x, a.x_scales, g.max_tokens_per_rank, config_.hidden, dev);
  c.x_dtype = p.x_dtype;
  c.scale_dtype = p.scale_dtype;
  c.fp8 = p.fp8;
  g.num_tokens = p.tokens;
  g.row_bytes = p.row_bytes;
  g.scale_columns = p.scale_columns;
  if (reinterpret_cast<std::uintptr_t>(a.x.data()) % 16 != 0 ||
      a.x.stride(0) * static_cast<std::int64_t>(element_size(c.x_dtype)) % 16 != 0)
    core::fail(ctx, "x ({}, at {}) must start at a 16-byte boundary with rows 16-byte aligned: the cuda provider "
               "moves rows in 16-byte loads", a.x.describe(), a.x.data());
  g.expert_alignment = a.expert_alignment == 0 ? 1 : a.expert_alignment;
  if (c.cached) {
    check_handle(a, c, ctx, p.hidden);
  } else {
    g.num_topk = core::v2::check_topk(ctx, a.topk_idx, g.num_tokens, dev);
    g.num_experts = a.num_experts;
  }
  g.experts_per_rank = core::v2::check_experts(ctx, g.num_topk, g.num_experts, R_, g.expert_alignment);
  c.has_weights = a.topk_weights.defined();
  core::v2::check_options(ctx, a.topk_weights, a.cumulative_local_expert_recv_stats, g.num_tokens, g.num_topk,
                          g.experts_per_rank, a.do_zero_padding, g.expanded_layout, dev);
  core::v2::check_row_capacity(ctx, g.max_tokens_per_rank, R_, g.num_topk, g.experts_per_rank, g.expert_alignment, 0);
  check_peer_readable(ctx, "x", a.x);
  check_peer_readable(ctx, "x_scales", a.x_scales);
  check_peer_readable(ctx, "topk_weights", a.topk_weights);
  // Staging (processes): topk, weights, x, scales, packed, at fixed offsets.
  c.off_weights = core::round_up<std::int64_t>(std::int64_t{g.max_tokens_per_rank} * g.num_topk * 8, 256);
  c.off_x = c.off_weights + core::round_up<std::int64_t>(std::int64_t{g.max_tokens_per_rank} * g.num_topk * 4, 256);
  c.off_scales = c.off_x + core::round_up<std::int64_t>(std::int64_t{g.max_tokens_per_rank} * g.row_bytes, 256);
  c.stage_end = c.off_scales + std::int64_t{g.max_tokens_per_rank} * g.scale_columns * 4;
  staging_bytes(c.stage_end, "dispatch");
}

template <Executor Exec>
void ElasticDevice<Exec>::new_routing_state(DispatchCall& c) {
  const DeviceGeometry& g = c.g;
  c.state = std::make_shared<DeviceHandleState>();
  DeviceHandleState& h = *c.state;
  h.buffer_id = id_;
  h.dispatch_number = op_number_ + 1;
  h.do_expand = g.expanded_layout;
  h.num_experts = g.num_experts;
  h.expert_alignment = g.expert_alignment;
  h.num_max_tokens_per_rank = g.max_tokens_per_rank;
  h.num_tokens = g.num_tokens;
  h.num_topk = g.num_topk;
  h.hidden = static_cast<int>(g.row_bytes / static_cast<std::int64_t>(element_size(c.x_dtype)));
  const std::int64_t cap = g.receive_capacity(), N = g.num_tokens, k = g.num_topk, R = g.num_ranks;
  const std::int64_t El = g.experts_per_rank;
  const std::int64_t words = N * k * 2 + N * R + R + 2 + cap * (2 + 2 * k) + 2 * El + 64;
  h.memory = exec_->alloc(static_cast<std::size_t>(words * 4 + 256));
  auto* p = static_cast<std::int32_t*>(h.memory.get());
  RoutingArrays& r = h.arrays;
  r.topk = reinterpret_cast<std::int64_t*>(p);
  p += N * k * 2;
  auto take = [&](std::int64_t n) {
    std::int32_t* q = p;
    p += n;
    return q;
  };
  r.dst_slot = take(N * R);
  r.send_base = take(R);
  r.sizes = take(2);
  r.row_src = take(cap);
  r.row_master = take(cap);
  r.local_ids = take(cap * k);
  r.lane_rows = take(cap * k);
  r.expert_start = take(El);
  r.expert_count = take(El);
}

template <Executor Exec>
Published ElasticDevice<Exec>::publish_dispatch(const DispatchArgs& a, const DispatchCall& c) const {
  Published mine{};
  const DeviceGeometry& g = c.g;
  if (direct_) {
    mine.x = publish_address(a.x.data());
    mine.x_row = a.x.stride(0) * static_cast<std::int64_t>(element_size(c.x_dtype));
    if (c.fp8) {
      mine.scales = publish_address(a.x_scales.data());
      mine.scale_stride0 = a.x_scales.stride(0);
      mine.scale_stride1 = a.x_scales.stride(1);
    }
    if (c.has_weights) {
      mine.weights = publish_address(a.topk_weights.data());
      mine.weights_row = a.topk_weights.stride(0);
    }
    mine.topk = publish_address(c.plan->arrays.topk);
  } else {
    mine.topk = publish_address(stage_at(c.off_topk));
    mine.x = publish_address(stage_at(c.off_x));
    mine.x_row = g.row_bytes;
    if (c.fp8) {
      mine.scales = publish_address(stage_at(c.off_scales));
      mine.scale_stride0 = g.scale_columns;
      mine.scale_stride1 = 1;
    }
    if (c.has_weights) {
      mine.weights = publish_address(stage_at(c.off_weights));
      mine.weights_row = g.num_topk;
    }
  }
  mine.topk_row = g.num_topk;
  mine.num_tokens = g.num_tokens;
  return mine;
}

template <Executor Exec>
void ElasticDevice<Exec>::stage_dispatch(const DispatchArgs& a, const DispatchCall& c) {
  const DeviceGeometry& g = c.g;
  if (!c.cached)
    pack(*exec_, c.state->arrays.topk, a.topk_idx.data_as<const std::int64_t>(), g.num_tokens, g.num_topk,
         a.topk_idx.stride(0), 1);
  if (direct_) return;
  if (!c.cached)
    exec_->copy(stage_at(c.off_topk), c.plan->arrays.topk, static_cast<std::size_t>(g.num_tokens) * g.num_topk * 8);
  if (c.has_weights)
    pack(*exec_, reinterpret_cast<float*>(stage_at(c.off_weights)), a.topk_weights.data_as<const float>(), g.num_tokens,
         g.num_topk, a.topk_weights.stride(0), 1);
  const std::int64_t chunks = g.row_bytes / 16;
  const std::int64_t row = a.x.stride(0) * static_cast<std::int64_t>(element_size(c.x_dtype));
  pack(*exec_, reinterpret_cast<Chunk*>(stage_at(c.off_x)), static_cast<const Chunk*>(a.x.data()), g.num_tokens, chunks,
       row / 16, 1);  // check_dispatch: 16-byte aligned
  if (c.fp8)
    pack(*exec_, reinterpret_cast<std::uint32_t*>(stage_at(c.off_scales)), static_cast<const std::uint32_t*>(a.x_scales.data()),
         g.num_tokens, g.scale_columns, a.x_scales.stride(0), a.x_scales.stride(1));
}

// After the count barrier: the handle and its count tensors, every received row's plan.
template <Executor Exec>
std::shared_ptr<EPHandle> ElasticDevice<Exec>::plan_receive(const DispatchArgs& a, DispatchCall& c,
                                                            const DevicePeerTensors& pt) {
  const DeviceGeometry& g = c.g;
  auto handle = std::make_shared<EPHandle>();
  handle->psum_num_recv_tokens_per_scaleup_rank = exec_->empty(DType::kInt32, a.stream, g.num_ranks);
  handle->psum_num_recv_tokens_per_expert = exec_->empty(DType::kInt32, a.stream, g.experts_per_rank);
  handle->num_unaligned_recv_tokens_per_expert = exec_->empty(DType::kInt32, a.stream, g.experts_per_rank);
  auto* const base = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(g.num_ranks + 1) * 4));
  const RoutingArrays& r = c.state->arrays;
  plan_counts(*exec_, g, peers_, layout_.counts, layout_.status, status(), base, r,
              handle->psum_num_recv_tokens_per_scaleup_rank.data_as<std::int32_t>());
  auto* const stats = a.cumulative_local_expert_recv_stats.defined()
                          ? a.cumulative_local_expert_recv_stats.data_as<std::int32_t>()
                          : nullptr;
  plan_rows(*exec_, g, peers_, layout_.lists, pt, base, r, handle->psum_num_recv_tokens_per_expert.data_as<std::int32_t>(),
            handle->num_unaligned_recv_tokens_per_expert.data_as<std::int32_t>(), stats);
  return handle;
}

// The outputs: exact shapes with CPU sync (one host wait for the counts), else the worst case
// (the handle's for a cached replay); the handle's fields.
// Long: every output tensor and handle field, in the order of docs/semantics.md.
template <Executor Exec>
void ElasticDevice<Exec>::make_outputs(const DispatchArgs& a, DispatchCall& c, EPHandle* handle, DispatchResult& result) {
  const DeviceGeometry& g = c.g;
  const DLDevice dev = exec_->dl_device();
  std::int64_t rows = 0, expanded_rows = 0;
  std::vector<int> aligned;
  if (c.cached) {
    rows = c.plan->num_recv_tokens;
    expanded_rows = c.plan->num_expanded_tokens;
  } else if (c.cpu_sync) {
    std::int32_t sizes[2];
    std::uint64_t words[2];
    std::vector<std::int32_t> counts(static_cast<size_t>(g.experts_per_rank));
    exec_->copy_to_host(sizes, c.state->arrays.sizes, sizeof sizes);
    exec_->copy_to_host(counts.data(), c.state->arrays.expert_count, counts.size() * 4);
    exec_->copy_to_host(words, status(), sizeof words);
    if (words[1] != 0) {
      // Every rank found the same bad rank (or this rank timed out): leave the channel in step.
      clear_error(*exec_, status());
      barrier(1);
      exec_->end_op();
      std::rethrow_exception(error_from(words[1], "dispatch"));
    }
    rows = sizes[0];
    expanded_rows = sizes[1];
    for (const std::int32_t n : counts)
      aligned.push_back(static_cast<int>(core::round_up<std::int64_t>(n, g.expert_alignment)));
  } else {
    rows = g.receive_capacity();
    expanded_rows = core::v2::worst_expanded_rows(g.num_ranks, g.max_tokens_per_rank, g.num_topk, g.experts_per_rank,
                                                  g.expert_alignment);
  }
  const std::int64_t out_rows = g.expanded_layout ? expanded_rows : rows;
  const std::int64_t H = g.row_bytes / static_cast<std::int64_t>(element_size(c.x_dtype));
  result.recv_x = exec_->empty(c.x_dtype, a.stream, out_rows, H);
  if (c.fp8 && a.use_tma_aligned_col_major_sf) {
    const std::int64_t block = core::round_up(std::max<std::int64_t>(out_rows, 1), 4);
    Tensor storage = exec_->empty(c.scale_dtype, a.stream, g.scale_columns, block);
    const std::int64_t shape[] = {out_rows, g.scale_columns};
    const std::int64_t strides[] = {1, block};
    result.recv_x_scales = storage.with_view(TensorView(storage.data(), c.scale_dtype, shape, strides).on_device(dev));
  } else if (c.fp8) {
    result.recv_x_scales = exec_->empty(c.scale_dtype, a.stream, out_rows, g.scale_columns);
  }
  if (!g.expanded_layout) result.recv_topk_idx = exec_->empty(DType::kInt64, a.stream, rows, g.num_topk);
  if (c.has_weights)
    result.recv_topk_weights = g.expanded_layout ? exec_->empty(DType::kFP32, a.stream, expanded_rows)
                                                 : exec_->empty(DType::kFP32, a.stream, rows, g.num_topk);
  if (c.cached) {
    result.handle = std::const_pointer_cast<EPHandle>(a.handle);
    return;
  }
  handle->recv_src_metadata = exec_->empty(DType::kInt32, a.stream, rows, g.num_topk + 2);
  handle->dst_buffer_slot_idx = exec_->empty(DType::kInt32, a.stream, g.num_tokens, g.num_topk);
  c.state->num_recv_tokens = rows;
  c.state->num_expanded_tokens = expanded_rows;
  core::v2::write_handle_fields(*handle, *c.state);
  handle->num_sms = a.num_sms;
  handle->num_recv_tokens_per_expert_list = aligned;
  if (a.do_handle_copy) {
    handle->topk_idx = exec_->empty(DType::kInt64, a.stream, g.num_tokens, g.num_topk);
    exec_->copy(handle->topk_idx.data(), c.state->arrays.topk, static_cast<std::size_t>(g.num_tokens) * g.num_topk * 8);
  } else {
    handle->topk_idx = Tensor().with_view(a.topk_idx);
  }
  handle->provider_state = c.state;
  write_slots(*exec_, g, c.state->arrays, handle->dst_buffer_slot_idx.data_as<std::int32_t>());
}

template <Executor Exec>
DispatchResult ElasticDevice<Exec>::dispatch(const DispatchArgs& a) {
  const char* op = "dispatch";
  check_usable(op);
  const std::string ctx = context(op);
  DispatchCall c;
  c.cached = a.handle != nullptr;
  c.cpu_sync = a.do_cpu_sync.value_or(!c.cached);
  c.g.max_tokens_per_rank = a.num_max_tokens_per_rank > 0 ? a.num_max_tokens_per_rank : config_.num_max_tokens_per_rank;
  c.g.num_ranks = R_;
  c.g.rank = rank_;
  c.g.expanded_layout = a.do_expand;
  std::exception_ptr local = take_device_error(op);
  if (!local && !a.rejection.empty()) local = std::make_exception_ptr(InvalidArgument(a.rejection));
  if (!local) {
    try {
      check_dispatch(a, c, ctx);
      if (!c.cached) new_routing_state(c);
      c.plan = c.cached ? c.cached_state.get() : c.state.get();
      // Before the agreement: the call's work follows what the caller's stream queued before the
      // call, never what another rank's call queued there after it (docs/cuda.md, Streams).
      exec_->after_caller(a.stream);
    } catch (const Error&) {
      local = std::current_exception();
    }
  }
  const Published mine = local ? Published{} : publish_dispatch(a, c);
  comm::Agreement agreement(ctx, "dispatch");
  agreement.field("operation number", static_cast<std::int64_t>(op_number_ + 1))
      .field("cached (handle given)", c.cached)
      .field("handle's dispatch number", c.cached_state ? static_cast<std::int64_t>(c.cached_state->dispatch_number) : 0)
      .field("num_max_tokens_per_rank", c.g.max_tokens_per_rank)
      .field("num_experts", c.g.num_experts)
      .field("num_topk", c.g.num_topk)
      .field("row bytes", c.g.row_bytes)
      .field("x dtype", local ? std::nullopt : std::optional(c.x_dtype))
      .field("x_scales columns", c.g.scale_columns)
      .field("x_scales dtype", c.fp8 ? std::optional(c.scale_dtype) : std::nullopt)
      .field("topk_weights given", c.has_weights)
      .field("expert_alignment", c.g.expert_alignment)
      .field("do_expand", c.g.expanded_layout)
      .local_error(local);
  const auto payloads = agreement.exchange(*channel_, comm::Scope::kWorld, wait("dispatch: agreement"),
                                           {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  ++op_number_;
  call_first_barrier_ = barriers_ + 1;
  return after_agreement(op, [&] {
    if (a.previous_event) a.previous_event->wait();
    return move_rows(a, c, resolve(payloads));
  });
}

template <Executor Exec>
DispatchResult ElasticDevice<Exec>::move_rows(const DispatchArgs& a, DispatchCall& c, const DevicePeerTensors& pt) {
  const char* op = "dispatch";
  stage_dispatch(a, c);
  if (!c.cached)
    route(*exec_, c.g, c.state->arrays.topk, status(), reinterpret_cast<std::int32_t*>(peers_.base[rank_] + layout_.counts),
          reinterpret_cast<std::int32_t*>(peers_.base[rank_] + layout_.lists), c.state->arrays.dst_slot);
  barrier(0);
  const std::shared_ptr<EPHandle> handle = c.cached ? nullptr : plan_receive(a, c, pt);
  DispatchResult result;
  make_outputs(a, c, handle.get(), result);
  if (!c.cached) result.handle = handle;
  if (a.previous_event_before_epilogue) a.previous_event_before_epilogue->wait();
  DispatchOutputs out;
  out.x = static_cast<std::byte*>(result.recv_x.data());
  out.scales = c.fp8 ? static_cast<std::uint32_t*>(result.recv_x_scales.data()) : nullptr;
  out.scale_block = c.fp8 && a.use_tma_aligned_col_major_sf ? result.recv_x_scales.stride(1) : 1;
  out.ids = c.g.expanded_layout ? nullptr : result.recv_topk_idx.data_as<std::int64_t>();
  out.weights = c.has_weights ? result.recv_topk_weights.data_as<float>() : nullptr;
  out.metadata = c.cached ? nullptr : result.handle->recv_src_metadata.data_as<std::int32_t>();
  out.rows = c.plan->num_recv_tokens;
  out.expanded_rows = c.plan->num_expanded_tokens;
  pull_rows(*exec_, c.g, pt, c.plan->arrays, status(), out);
  if (c.g.expanded_layout && a.do_zero_padding) zero_padding(*exec_, c.g, c.plan->arrays, status(), out);
  finish(a.stream, a.async_with_compute_stream, result.event, op);
  return result;
}

}  // namespace moe_ep::cuda
