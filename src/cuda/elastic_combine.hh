// ElasticDevice<Exec>::combine (included by elastic_device_impl.hh).
//
// Steps on the communication stream: stage (processes only) -> barrier 0 -> for every token, its
// units in ascending key order (compact: one row per destination rank, keyed by its master lane;
// expanded with multiple reduction: per destination rank, its lanes ascending, summed and rounded
// to BF16 when more than one; expanded without: one row per lane) -> sum biases then units in FP32,
// one BF16 rounding (docs/semantics.md §4) -> weights back -> barrier 1. Each token's source rank
// pulls the rows from the ranks that hold them: no rank writes into another's memory.
#pragma once

#include "cuda/elastic_device.hh"

namespace moe_ep::cuda {

template <class Exec>
CombineResult ElasticDevice<Exec>::combine(const CombineArgs& a) {
  const char* op = "combine";
  check_usable(op);
  const std::string ctx = context(op);
  const DLDevice dev = exec_->dl_device();
  std::shared_ptr<const DeviceHandleState> state;
  bool has_weights = false;
  std::int64_t rows = 0;
  std::exception_ptr local = take_device_error(op);
  if (!local && !a.rejection.empty()) local = std::make_exception_ptr(InvalidArgument(a.rejection));
  if (!local) {
    try {
      if (a.num_sms < 0 || a.num_sms > 1024) core::fail(ctx, "num_sms = {} is outside [0, 1024]", a.num_sms);
      if (!a.handle) core::fail(ctx, "handle is missing (combine needs the handle of a dispatch)");
      state = std::static_pointer_cast<const DeviceHandleState>(a.handle->provider_state);
      if (!state || state->buffer_id != id_)
        core::fail(ctx, "the handle was not made by this buffer (cuda provider, rank {})", rank_);
      auto same = [&](const char* name, std::int64_t given, std::int64_t made) {
        if (given != made) core::fail(ctx, "handle.{} = {} differs from the {} its dispatch produced", name, given, made);
      };
      same("do_expand", a.handle->do_expand, state->do_expand);
      same("num_tokens", a.handle->num_tokens, state->num_tokens);
      same("num_topk", a.handle->num_topk, state->num_topk);
      same("hidden", a.handle->hidden, state->hidden);
      same("num_recv_tokens", a.handle->num_recv_tokens, state->num_recv_tokens);
      same("num_expanded_tokens", a.handle->num_expanded_tokens, state->num_expanded_tokens);
      rows = state->do_expand ? state->num_expanded_tokens : state->num_recv_tokens;
      core::expect_tensor(ctx, "x", a.x, a.x.dtype(), {-1, -1}, dev);
      if (a.x.dtype() != DType::kBF16)
        core::fail(ctx, "x has dtype {} ({}); combine reduces bfloat16 rows only", dtype_name(a.x.dtype()), a.x.describe());
      core::expect_tensor(ctx, "x", a.x, DType::kBF16, {std::int64_t{-1}, std::int64_t{state->hidden}}, dev);
      core::expect_rows_contiguous(ctx, "x", a.x);
      if (a.x.size(0) != rows)
        core::fail(ctx, "x has {} rows, the handle's {} layout has {}", a.x.size(0),
                   state->do_expand ? "expanded" : "compact", rows);
      if (a.topk_weights.defined()) {
        has_weights = true;
        if (state->do_expand) {
          core::expect_tensor(ctx, "topk_weights", a.topk_weights, DType::kFP32, {rows}, dev);
        } else {
          core::expect_tensor(ctx, "topk_weights", a.topk_weights, DType::kFP32, {rows, std::int64_t{state->num_topk}}, dev);
          core::expect_rows_contiguous(ctx, "topk_weights", a.topk_weights);
        }
      }
      if (a.bias.size() > 2) core::fail(ctx, "{} biases given, at most 2", a.bias.size());
      for (std::size_t b = 0; b < a.bias.size(); ++b) {
        const std::string name = fmt::format("bias[{}]", b);
        core::expect_tensor(ctx, name, a.bias[b], DType::kBF16, {std::int64_t{state->num_tokens}, std::int64_t{state->hidden}}, dev);
        core::expect_rows_contiguous(ctx, name, a.bias[b]);
      }
    } catch (const Error&) {
      local = std::current_exception();
    }
  }
  const int N = state ? state->num_tokens : 0, k = state ? state->num_topk : 0, H = state ? state->hidden : 0;
  const int R = R_, T = config_.num_max_tokens_per_rank, El = state ? state->num_experts / R_ : 1;
  const bool expand = state && state->do_expand, multi = config_.allow_multiple_reduction;
  const std::int64_t cap = std::int64_t{T} * R;
  const std::int64_t off_lanes = 0, off_w = round_up(cap * k * 4, 256);
  const std::int64_t off_x = off_w + round_up((expand ? rows : rows * k) * 4, 256);
  if (!local && !direct_) {
    try {
      staging_bytes(off_x + rows * H * 2, op);
    } catch (const Error&) {
      local = std::current_exception();
    }
  }
  Published mine{};
  if (!local) {
    if (direct_) {
      mine.x = publish_address(a.x.data());
      mine.x_row = a.x.stride(0) * 2;
      if (has_weights) {
        mine.weights = publish_address(a.topk_weights.data());
        mine.weights_row = a.topk_weights.stride(0);
      }
      mine.lanes = publish_address(state->lane_rows);
    } else {
      mine.x = publish_address(stage_at(off_x));
      mine.x_row = std::int64_t{H} * 2;
      if (has_weights) {
        mine.weights = publish_address(stage_at(off_w));
        mine.weights_row = expand ? 1 : k;  // packed by the staging copy
      }
      mine.lanes = publish_address(stage_at(off_lanes));
    }
    mine.num_tokens = N;
  }
  comm::Agreement agreement(ctx, "combine");
  agreement.field("operation number", static_cast<std::int64_t>(op_number_ + 1))
      .field("handle's dispatch number", state ? static_cast<std::int64_t>(state->dispatch_number) : 0)
      .field("hidden", H)
      .field("num_topk", k)
      .field("do_expand", expand)
      .field("topk_weights given", has_weights)
      .local_error(local);
  const auto payloads = agreement.exchange(*channel_, comm::Scope::kWorld, wait("combine: agreement"),
                                           {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  ++op_number_;
  if (a.previous_event) a.previous_event->wait();
  const PeerTensors pt = resolve(payloads);
  exec_->after_caller(a.stream);
  std::uint64_t* const status = reinterpret_cast<std::uint64_t*>(peers_.base[rank_] + layout_.status);

  if (!direct_) {
    if (expand) exec_->copy(stage_at(off_lanes), state->lane_rows, static_cast<std::size_t>(cap) * k * 4);
    const std::int64_t hc = H;
    {
      auto* const dst = reinterpret_cast<std::uint16_t*>(stage_at(off_x));
      const auto* const src = a.x.data_as<const std::uint16_t>();
      const std::int64_t row = a.x.stride(0);
      exec_->each(rows * hc, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) { dst[i] = src[(i / hc) * row + i % hc]; });
    }
    if (has_weights) {
      auto* const dst = reinterpret_cast<float*>(stage_at(off_w));
      const float* const src = a.topk_weights.data_as<const float>();
      const std::int64_t cols = expand ? 1 : k, row = a.topk_weights.stride(0);
      exec_->each(rows * cols, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) { dst[i] = src[(i / cols) * row + i % cols]; });
    }
  }
  barrier(0);

  CombineResult result;
  result.combined_x = exec_->empty(DType::kBF16, a.stream, N, H);
  if (has_weights) result.combined_topk_weights = exec_->empty(DType::kFP32, a.stream, N, k);
  if (a.previous_event_before_epilogue) a.previous_event_before_epilogue->wait();

  // Every token's inputs in reduction order: (rank, row) pairs; unit u spans [end[u-1], end[u]).
  auto* const inputs = static_cast<std::int64_t*>(exec_->temp(static_cast<std::size_t>(std::max(N, 1)) * k * 8));
  auto* const unit_end = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(std::max(N, 1)) * (k + 1) * 4));
  const std::int64_t* const topk = state->topk;
  const std::int32_t* const dst_slot = state->dst_slot;
  const std::int32_t* const send_base = state->send_base;
  exec_->each(N, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t t) {
    const std::int64_t* ids = topk + t * k;
    std::int64_t* in = inputs + t * k;
    std::int32_t* end = unit_end + t * (k + 1);
    int n = 0, units = 0;
    auto row_at = [&](int d) { return send_base[d] + dst_slot[t * R + d]; };
    for (int j = 0; j < k; ++j) {
      const int d = detail::rank_of(ids[j], El);
      if (d < 0) continue;
      if (expand && !multi) {  // one unit per lane
        in[n++] = (std::int64_t{d} << 32) | static_cast<std::uint32_t>(pt.lanes[d][std::int64_t{row_at(d)} * k + j]);
        end[units++] = n;
        continue;
      }
      bool master = true;  // the highest lane on d keys its unit
      for (int l = j + 1; l < k && master; ++l) master = detail::rank_of(ids[l], El) != d;
      if (!master) continue;
      if (!expand) {
        in[n++] = (std::int64_t{d} << 32) | static_cast<std::uint32_t>(row_at(d));
      } else {
        for (int l = 0; l < k; ++l)
          if (detail::rank_of(ids[l], El) == d)
            in[n++] = (std::int64_t{d} << 32) | static_cast<std::uint32_t>(pt.lanes[d][std::int64_t{row_at(d)} * k + l]);
      }
      end[units++] = n;
    }
    end[k] = units;
  });

  // The sums: 8 elements per index.
  {
    const std::int64_t groups = (std::int64_t{H} + 7) / 8;
    auto* const out = result.combined_x.data_as<std::uint16_t>();
    const int nb = static_cast<int>(a.bias.size());
    const std::uint16_t* b0 = nb > 0 ? a.bias[0].data_as<const std::uint16_t>() : nullptr;
    const std::uint16_t* b1 = nb > 1 ? a.bias[1].data_as<const std::uint16_t>() : nullptr;
    const std::int64_t s0 = nb > 0 ? a.bias[0].stride(0) : 0, s1 = nb > 1 ? a.bias[1].stride(0) : 0;
    exec_->each(std::int64_t{N} * groups, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t idx) {
      const std::int64_t t = idx / groups, h0 = (idx % groups) * 8;
      const int m = static_cast<int>(H - h0 < 8 ? H - h0 : 8);
      if (load_acquire(status + 1) != 0) return;
      float acc[8];
      bool started = false;
      auto add = [&](const float* v) {
        for (int e = 0; e < m; ++e) acc[e] = started ? acc[e] + v[e] : v[e];
        started = true;
      };
      float v[8];
      auto load = [&](const std::uint16_t* row) {
        for (int e = 0; e < m; ++e) v[e] = widen_bf16(row[h0 + e]);
      };
      if (b0) load(b0 + t * s0), add(v);
      if (b1) load(b1 + t * s1), add(v);
      const std::int64_t* in = inputs + t * k;
      const std::int32_t* end = unit_end + t * (k + 1);
      int first = 0;
      for (int u = 0; u < end[k]; ++u) {
        const int last = end[u];
        auto row_of = [&](int i) {
          const int d = static_cast<int>(in[i] >> 32);
          const std::int64_t r = static_cast<std::int32_t>(in[i] & 0xffffffff);
          return reinterpret_cast<const std::uint16_t*>(pt.x[d] + r * pt.x_row[d]);
        };
        if (last - first == 1) {
          load(row_of(first));
        } else {  // level 1: the rank's lanes, summed and rounded once
          float unit[8];
          for (int i = first; i < last; ++i) {
            load(row_of(i));
            for (int e = 0; e < m; ++e) unit[e] = i == first ? v[e] : unit[e] + v[e];
          }
          for (int e = 0; e < m; ++e) v[e] = widen_bf16(narrow_bf16(unit[e]));
        }
        add(v);
        first = last;
      }
      for (int e = 0; e < m; ++e) out[t * H + h0 + e] = started ? narrow_bf16(acc[e]) : 0;
    });
  }
  if (has_weights) {
    auto* const out = result.combined_topk_weights.data_as<float>();
    exec_->each(std::int64_t{N} * k, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      if (load_acquire(status + 1) != 0) return;
      const std::int64_t t = i / k;
      const int j = static_cast<int>(i % k);
      const int d = detail::rank_of(topk[i], El);
      if (d < 0) {
        out[i] = 0.0f;
        return;
      }
      const std::int64_t row = send_base[d] + dst_slot[t * R + d];
      out[i] = expand ? pt.weights[d][std::int64_t{pt.lanes[d][row * k + j]} * pt.weights_row[d]]
                      : pt.weights[d][row * pt.weights_row[d] + j];
    });
  }
  barrier(1);
  exec_->mirror_error(status + 1);
  exec_->end_op();
  finish(a.stream, a.async_with_compute_stream, result.event, op);
  return result;
}

}  // namespace moe_ep::cuda
