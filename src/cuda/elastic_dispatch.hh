// ElasticDevice<Exec>::dispatch (included by elastic_device_impl.hh).
//
// Steps on the communication stream: stage (processes only) -> route this rank's tokens (per
// destination, the tokens in ascending order, by one exclusive scan) -> barrier 0 -> plan the
// received rows (sources ascending, tokens ascending; expert positions by a second scan) ->
// [CPU sync: read the counts, allocate exact outputs] -> pull every row from its source -> barrier 1.
#pragma once

#include "cuda/elastic_device.hh"

namespace moe_ep::cuda {

template <class Exec>
DispatchResult ElasticDevice<Exec>::dispatch(const DispatchArgs& a) {
  const char* op = "dispatch";
  check_usable(op);
  const std::string ctx = context(op);
  const DLDevice dev = exec_->dl_device();
  const bool cached = a.handle != nullptr;
  std::shared_ptr<const DeviceHandleState> cached_state;
  Shape s;
  s.T = a.num_max_tokens_per_rank > 0 ? a.num_max_tokens_per_rank : config_.num_max_tokens_per_rank;
  bool fp8 = false, has_weights = false;
  const bool expand = a.do_expand;
  const bool cpu_sync = a.do_cpu_sync.value_or(!cached);
  DType x_dtype = DType::kUInt8, scale_dtype = DType::kFP32;
  std::int64_t row_bytes = 0;
  std::exception_ptr local = take_device_error(op);
  if (!local && !a.rejection.empty()) local = std::make_exception_ptr(InvalidArgument(a.rejection));
  if (!local) {
    try {
      if (a.num_sms < 0 || a.num_sms > 1024) core::fail(ctx, "num_sms = {} is outside [0, 1024]", a.num_sms);
      if (s.T != config_.num_max_tokens_per_rank)
        core::fail(ctx, "num_max_tokens_per_rank = {} differs from the buffer's {} (the cuda provider sizes its lists "
                   "for the buffer's)", s.T, config_.num_max_tokens_per_rank);
      core::expect_tensor(ctx, "x", a.x, a.x.dtype(), {-1, -1}, dev);
      core::expect_rows_contiguous(ctx, "x", a.x);
      x_dtype = a.x.dtype();
      s.N = core::int_size(ctx, "x", a.x, 0);
      s.H = core::int_size(ctx, "x", a.x, 1);
      if (!detail::payload_dtype(x_dtype))
        core::fail(ctx, "x has dtype {} ({}); dispatch moves 1-, 2- or 4-byte payloads", dtype_name(x_dtype), a.x.describe());
      row_bytes = std::int64_t{s.H} * static_cast<std::int64_t>(element_size(x_dtype));
      if (s.H < 1 || (1 << 24) < s.H) core::fail(ctx, "x has hidden size {}, outside [1, 2^24]", s.H);
      if (row_bytes % 16 != 0)
        core::fail(ctx, "x ({}) has rows of {} bytes: a row (hidden x element size) must be a multiple of 16 bytes",
                   a.x.describe(), row_bytes);
      if (config_.hidden > 0 && s.H != config_.hidden)
        core::fail(ctx, "x has hidden size {}, the buffer's hidden is {}", s.H, config_.hidden);
      if (s.N > s.T) core::fail(ctx, "x has {} tokens, more than num_max_tokens_per_rank = {}", s.N, s.T);
      fp8 = x_dtype == DType::kFP8E4M3;
      if (fp8) {
        if (!a.x_scales.defined()) core::fail(ctx, "x is float8_e4m3fn but x_scales is missing");
        scale_dtype = a.x_scales.dtype();
        if (scale_dtype != DType::kFP32 && scale_dtype != DType::kInt32)
          core::fail(ctx, "x_scales has dtype {}, expected float32 or int32", dtype_name(scale_dtype));
        core::expect_tensor(ctx, "x_scales", a.x_scales, scale_dtype, {std::int64_t{s.N}, std::int64_t{-1}}, dev);
        core::expect_non_overlapping(ctx, "x_scales", a.x_scales);
        s.P = core::int_size(ctx, "x_scales", a.x_scales, 1);
        if (s.P < 1) core::fail(ctx, "x_scales has {} columns, at least 1 needed", s.P);
      } else if (a.x_scales.defined()) {
        core::fail(ctx, "x_scales is given but x has dtype {} (scales travel with float8_e4m3fn only)", dtype_name(x_dtype));
      }
      if (a.expert_alignment < 1) core::fail(ctx, "expert_alignment = {} must be at least 1", a.expert_alignment);
      s.align = a.expert_alignment;
      if (a.do_zero_padding && !expand) core::fail(ctx, "do_zero_padding = true requires do_expand = true");
      if (cached) {
        cached_state = std::static_pointer_cast<const DeviceHandleState>(a.handle->provider_state);
        if (!cached_state || cached_state->buffer_id != id_)
          core::fail(ctx, "the handle was not made by this buffer (cuda provider, rank {})", rank_);
        const DeviceHandleState& h = *cached_state;
        if (a.topk_idx.defined()) core::fail(ctx, "topk_idx must not be given with a handle (cached dispatch)");
        if (a.cumulative_local_expert_recv_stats.defined())
          core::fail(ctx, "cumulative_local_expert_recv_stats must not be given with a handle");
        if (a.do_cpu_sync.value_or(false)) core::fail(ctx, "do_cpu_sync = true is refused with a handle (cached dispatch)");
        auto same = [&](const char* name, std::int64_t given, std::int64_t made) {
          if (given != made) core::fail(ctx, "handle.{} = {} differs from the {} its dispatch produced", name, given, made);
        };
        same("do_expand", a.handle->do_expand, h.do_expand);
        same("num_experts", a.handle->num_experts, h.num_experts);
        same("expert_alignment", a.handle->expert_alignment, h.expert_alignment);
        same("num_max_tokens_per_rank", a.handle->num_max_tokens_per_rank, h.num_max_tokens_per_rank);
        same("num_tokens", a.handle->num_tokens, h.num_tokens);
        same("num_topk", a.handle->num_topk, h.num_topk);
        same("hidden", a.handle->hidden, h.hidden);
        same("num_recv_tokens", a.handle->num_recv_tokens, h.num_recv_tokens);
        same("num_expanded_tokens", a.handle->num_expanded_tokens, h.num_expanded_tokens);
        if (a.num_experts != 0 && a.num_experts != h.num_experts)
          core::fail(ctx, "num_experts = {} differs from the handle's {}", a.num_experts, h.num_experts);
        if (expand != h.do_expand) core::fail(ctx, "do_expand = {} differs from the handle's {}", expand, h.do_expand);
        if (s.align != h.expert_alignment)
          core::fail(ctx, "expert_alignment = {} differs from the handle's {}", s.align, h.expert_alignment);
        if (s.N != h.num_tokens) core::fail(ctx, "x has {} tokens, the handle's dispatch had {}", s.N, h.num_tokens);
        if (s.H != h.hidden) core::fail(ctx, "x has hidden size {}, the handle's dispatch had {}", s.H, h.hidden);
        s.k = h.num_topk;
        s.E = h.num_experts;
      } else {
        core::expect_tensor(ctx, "topk_idx", a.topk_idx, DType::kInt64, {std::int64_t{s.N}, std::int64_t{-1}}, dev);
        core::expect_rows_contiguous(ctx, "topk_idx", a.topk_idx);
        s.k = core::int_size(ctx, "topk_idx", a.topk_idx, 1);
        if (s.k < 1 || s.k > kMaxTopk) core::fail(ctx, "topk_idx has {} columns, outside [1, {}]", s.k, kMaxTopk);
        s.E = a.num_experts;
        if (s.E <= 0 || s.E % R_ != 0)
          core::fail(ctx, "num_experts = {} must be positive and a multiple of the {} ranks", s.E, R_);
      }
      s.El = s.E / R_;
      if (a.topk_weights.defined()) {
        has_weights = true;
        core::expect_tensor(ctx, "topk_weights", a.topk_weights, DType::kFP32, {std::int64_t{s.N}, std::int64_t{s.k}}, dev);
        core::expect_rows_contiguous(ctx, "topk_weights", a.topk_weights);
      }
      if (a.cumulative_local_expert_recv_stats.defined()) {
        core::expect_tensor(ctx, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats,
                            DType::kInt32, {std::int64_t{s.El}}, dev);
        core::expect_contiguous(ctx, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats);
      }
    } catch (const Error&) {
      local = std::current_exception();
    }
  }
  const int N = s.N, k = s.k, T = s.T, R = R_, El = s.El, me = rank_, P = s.P;
  const std::int64_t cap = std::int64_t{T} * R;
  // Staging (processes): topk, weights, x, scales, packed, at fixed offsets.
  const std::int64_t off_topk = 0, off_w = round_up(std::int64_t{T} * k * 8, 256);
  const std::int64_t off_x = off_w + round_up(std::int64_t{T} * k * 4, 256);
  const std::int64_t off_s = off_x + round_up(std::int64_t{T} * row_bytes, 256);
  if (!local && !direct_) {
    try {
      staging_bytes(off_s + std::int64_t{T} * P * 4, op);
    } catch (const Error&) {
      local = std::current_exception();
    }
  }

  // The handle's routing state (device arrays), made before the agreement so its address is known.
  std::shared_ptr<DeviceHandleState> state;
  if (!local && !cached) {
    state = std::make_shared<DeviceHandleState>();
    DeviceHandleState& h = *state;
    h.buffer_id = id_;
    h.dispatch_number = op_number_ + 1;
    h.do_expand = expand;
    h.num_experts = s.E;
    h.expert_alignment = s.align;
    h.num_max_tokens_per_rank = T;
    h.num_tokens = N;
    h.num_topk = k;
    h.hidden = s.H;
    h.row_capacity = cap;
    const std::int64_t words = std::int64_t{N} * k * 2 + std::int64_t{N} * R + R + 2 + cap * (3 + 2 * std::int64_t{k}) +
                               2 * std::int64_t{El} + 64;
    h.memory = exec_->alloc(static_cast<std::size_t>(words * 4 + 256));
    auto* p = static_cast<std::int32_t*>(h.memory.get());
    h.topk = reinterpret_cast<std::int64_t*>(p);
    p += std::int64_t{N} * k * 2;
    h.dst_slot = p, p += std::int64_t{N} * R;
    h.send_base = p, p += R;
    h.sizes = p, p += 2;
    h.row_src = p, p += cap;
    h.local_ids = p, p += cap * k;
    h.lane_rows = p, p += cap * k;
    h.expert_start = p, p += El;
    h.expert_count = p, p += El;
    h.row_master = p, p += cap;
  }
  const DeviceHandleState* plan = cached ? cached_state.get() : state.get();

  Published mine{};
  if (!local) {
    if (direct_) {
      mine.x = publish_address(a.x.data());
      mine.x_row = a.x.stride(0) * static_cast<std::int64_t>(element_size(x_dtype));
      if (fp8) {
        mine.scales = publish_address(a.x_scales.data());
        mine.scale_stride0 = a.x_scales.stride(0);
        mine.scale_stride1 = a.x_scales.stride(1);
      }
      if (has_weights) {
        mine.weights = publish_address(a.topk_weights.data());
        mine.weights_row = a.topk_weights.stride(0);
      }
      mine.topk = publish_address(plan->topk);
    } else {
      mine.topk = publish_address(stage_at(off_topk)) ;
      mine.x = publish_address(stage_at(off_x));
      mine.x_row = row_bytes;
      if (fp8) {
        mine.scales = publish_address(stage_at(off_s));
        mine.scale_stride0 = P;
        mine.scale_stride1 = 1;
      }
      if (has_weights) {
        mine.weights = publish_address(stage_at(off_w));
        mine.weights_row = k;
      }
    }
    mine.topk_row = k;
    mine.num_tokens = N;
  }
  comm::Agreement agreement(ctx, "dispatch");
  agreement.field("operation number", static_cast<std::int64_t>(op_number_ + 1))
      .field("cached (handle given)", cached)
      .field("handle's dispatch number", cached_state ? static_cast<std::int64_t>(cached_state->dispatch_number) : 0)
      .field("num_max_tokens_per_rank", T)
      .field("num_experts", s.E)
      .field("num_topk", k)
      .field("hidden", s.H)
      .field("x dtype", local ? std::nullopt : std::optional(x_dtype))
      .field("x_scales columns", P)
      .field("x_scales dtype", fp8 ? std::optional(scale_dtype) : std::nullopt)
      .field("topk_weights given", has_weights)
      .field("expert_alignment", s.align)
      .field("do_expand", expand)
      .local_error(local);
  const auto payloads = agreement.exchange(*channel_, comm::Scope::kWorld, wait("dispatch: agreement"),
                                           {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  ++op_number_;
  if (a.previous_event) a.previous_event->wait();
  const PeerTensors peer = resolve(payloads);
  exec_->after_caller(a.stream);

  std::byte* const my_base = peers_.base[me];
  const SymLayout L = layout_;
  const Peers peers = peers_;
  std::uint64_t* const status = reinterpret_cast<std::uint64_t*>(my_base + L.status);
  auto* const counts = reinterpret_cast<std::int32_t*>(my_base + L.counts);
  auto* const lists = reinterpret_cast<std::int32_t*>(my_base + L.lists);

  // This rank's top-k ids, contiguous, in the handle state.
  if (!cached) {
    std::int64_t* const topk = state->topk;
    const std::int64_t* const src = a.topk_idx.data_as<const std::int64_t>();
    const std::int64_t row = a.topk_idx.stride(0);
    exec_->each(std::int64_t{N} * k, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      topk[i] = src[(i / k) * row + i % k];
    });
  }
  // Staging for peers in other processes.
  if (!direct_) {
    if (!cached) exec_->copy(stage_at(off_topk), plan->topk, static_cast<std::size_t>(N) * k * 8);
    if (has_weights) {
      float* const dst = reinterpret_cast<float*>(stage_at(off_w));
      const float* const src = a.topk_weights.data_as<const float>();
      const std::int64_t row = a.topk_weights.stride(0);
      exec_->each(std::int64_t{N} * k, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) { dst[i] = src[(i / k) * row + i % k]; });
    }
    {
      const std::int64_t chunks = row_bytes / 16;
      auto* const dst = reinterpret_cast<Chunk*>(stage_at(off_x));
      const std::byte* const src = static_cast<const std::byte*>(a.x.data());
      const std::int64_t row = a.x.stride(0) * static_cast<std::int64_t>(element_size(x_dtype));
      exec_->each(std::int64_t{N} * chunks, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
        dst[i] = reinterpret_cast<const Chunk*>(src + (i / chunks) * row)[i % chunks];
      });
    }
    if (fp8) {
      auto* const dst = reinterpret_cast<std::uint32_t*>(stage_at(off_s));
      const auto* const src = static_cast<const std::uint32_t*>(a.x_scales.data());
      const std::int64_t s0 = a.x_scales.stride(0), s1 = a.x_scales.stride(1);
      exec_->each(std::int64_t{N} * P, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
        dst[i] = src[(i / P) * s0 + (i % P) * s1];
      });
    }
  }

  // Route: per destination, this rank's tokens in ascending order.
  if (!cached) {
    exec_->each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) { status[0] = 0; });
    const std::int64_t n = std::int64_t{R} * N + 1;
    auto* const flags = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(n) * 4));
    auto* const pos = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(n) * 4));
    const std::int64_t* const topk = state->topk;
    const int E = s.E;
    exec_->each(N, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t t) {
      const std::int64_t* ids = topk + t * k;
      for (int d = 0; d < R; ++d) flags[d * std::int64_t{N} + t] = 0;
      for (int j = 0; j < k; ++j) {
        const std::int64_t e = ids[j];
        if (e < -1 || e >= E) {
          set_first(status, pack_error(ErrorCode::kExpertOutOfRange, static_cast<std::uint32_t>(t), j, e));
          continue;
        }
        if (e < 0) continue;
        bool twice = false;
        for (int l = 0; l < j; ++l) twice = twice || ids[l] == e;
        if (twice) {
          set_first(status, pack_error(ErrorCode::kDuplicateExpert, static_cast<std::uint32_t>(t), j, e));
          continue;
        }
        flags[detail::rank_of(e, El) * std::int64_t{N} + t] = 1;
      }
    });
    exec_->each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) { flags[n - 1] = 0; });
    exec_->scan(flags, pos, n);
    std::int32_t* const dst_slot = state->dst_slot;
    exec_->each(std::int64_t{R} * N, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      const std::int64_t d = i / N, t = i % N;
      const std::int32_t slot = pos[i] - pos[d * N];
      if (flags[i]) lists[d * T + slot] = static_cast<std::int32_t>(t);
      dst_slot[t * R + d] = flags[i] ? slot : -1;
    });
    exec_->each(R, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t d) { counts[d] = pos[(d + 1) * N] - pos[d * N]; });
  }
  barrier(0);

  // Plan the received rows.
  EPHandle* handle = nullptr;
  std::shared_ptr<EPHandle> new_handle;
  const int SU = R;  // one node: every rank is a scale-up peer
  if (!cached) {
    new_handle = std::make_shared<EPHandle>();
    handle = new_handle.get();
    handle->psum_num_recv_tokens_per_scaleup_rank = exec_->empty(DType::kInt32, a.stream, SU);
    handle->psum_num_recv_tokens_per_expert = exec_->empty(DType::kInt32, a.stream, El);
    handle->num_unaligned_recv_tokens_per_expert = exec_->empty(DType::kInt32, a.stream, El);
    auto* const base = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(R + 1) * 4));
    std::int32_t* const sizes = state->sizes;
    std::int32_t* const send_base = state->send_base;
    auto* const psum_su = handle->psum_num_recv_tokens_per_scaleup_rank.data_as<std::int32_t>();
    const std::int64_t counts_off = L.counts, status_off = L.status;
    exec_->each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) {
      // The first rank with bad top-k ids (every rank sees the same one).
      for (int r = 0; r < R; ++r) {
        const std::uint64_t w = *reinterpret_cast<const std::uint64_t*>(peers.base[r] + status_off);
        if (w != 0) {
          set_first(status + 1, r == me ? w : pack_error(ErrorCode::kPeerRejected, static_cast<std::uint32_t>(r), 0, 0));
          break;
        }
      }
      const bool bad = load_acquire(status + 1) != 0;
      std::int32_t total = 0;
      for (int r = 0; r < SU; ++r) psum_su[r] = 0;
      for (int r = 0; r < R; ++r) {
        const std::int32_t c = bad ? 0 : reinterpret_cast<const std::int32_t*>(peers.base[r] + counts_off)[me];
        base[r] = total;
        total += c;
        psum_su[r % SU] += c;
      }
      base[R] = total;
      for (int r = 1; r < SU; ++r) psum_su[r] += psum_su[r - 1];
      sizes[0] = total;
      for (int d = 0; d < R; ++d) {
        std::int32_t b = 0;
        for (int r = 0; r < me; ++r) b += bad ? 0 : reinterpret_cast<const std::int32_t*>(peers.base[r] + counts_off)[d];
        send_base[d] = b;
      }
    });
    // Every received row: its source, token, master lane and local experts; expert flags.
    const std::int64_t nf = std::int64_t{El} * cap + 1;
    auto* const eflag = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(nf) * 4));
    auto* const epos = static_cast<std::int32_t*>(exec_->temp(static_cast<std::size_t>(nf) * 4));
    std::int32_t* const row_src = state->row_src;
    std::int32_t* const local_ids = state->local_ids;
    std::int32_t* const row_master = state->row_master;
    const std::int64_t lists_off = L.lists;
    const PeerTensors pt = peer;
    exec_->each(cap, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      for (int l = 0; l < El; ++l) eflag[l * cap + i] = 0;
      if (i >= sizes[0]) return;
      int src = 0;
      while (base[src + 1] <= i) ++src;
      const std::int32_t t = reinterpret_cast<const std::int32_t*>(peers.base[src] + lists_off)[std::int64_t{me} * T + (i - base[src])];
      const std::int64_t* ids = pt.topk[src] + std::int64_t{t} * pt.topk_row[src];
      row_src[i] = src * T + t;
      int master = -1;
      for (int j = 0; j < k; ++j) {
        const std::int64_t e = ids[j];
        const bool here = e >= 0 && detail::rank_of(e, El) == me;
        local_ids[i * k + j] = here ? static_cast<std::int32_t>(e - std::int64_t{me} * El) : -1;
        if (here) {
          master = j;
          eflag[(e - std::int64_t{me} * El) * cap + i] = 1;
        }
      }
      row_master[i] = master;
    });
    exec_->each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) { eflag[nf - 1] = 0; });
    exec_->scan(eflag, epos, nf);
    std::int32_t* const start = state->expert_start;
    std::int32_t* const count = state->expert_count;
    auto* const psum_e = handle->psum_num_recv_tokens_per_expert.data_as<std::int32_t>();
    auto* const unaligned = handle->num_unaligned_recv_tokens_per_expert.data_as<std::int32_t>();
    auto* const stats = a.cumulative_local_expert_recv_stats.defined()
                            ? a.cumulative_local_expert_recv_stats.data_as<std::int32_t>()
                            : nullptr;
    const int align = s.align;
    exec_->each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) {
      std::int32_t next = 0, psum = 0;
      for (int l = 0; l < El; ++l) {
        const std::int32_t c = epos[(l + 1) * cap] - epos[l * cap];
        const auto aligned = static_cast<std::int32_t>(align_up(c, align));
        count[l] = c;
        start[l] = next;
        unaligned[l] = c;
        psum += aligned;
        psum_e[l] = expand ? next + c : psum;
        next += aligned;
        if (stats) stats[l] += c;
      }
      sizes[1] = next;
    });
    std::int32_t* const lane_rows = state->lane_rows;
    exec_->each(cap, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      if (i >= sizes[0]) return;
      for (int j = 0; j < k; ++j) {
        const std::int32_t l = local_ids[i * k + j];
        lane_rows[i * k + j] = l < 0 ? -1 : start[l] + (epos[l * cap + i] - epos[l * cap]);
      }
    });
  }

  // Output shapes: exact with CPU sync, else the worst case (the handle's for cached replay).
  std::int64_t rows = 0, expanded_rows = 0;
  std::vector<int> aligned_list;
  if (cached) {
    rows = plan->num_recv_tokens;
    expanded_rows = plan->num_expanded_tokens;
  } else if (cpu_sync) {
    std::int32_t sizes_host[2];
    std::uint64_t status_host[2];
    std::vector<std::int32_t> count_host(static_cast<size_t>(El));
    exec_->copy_to_host(sizes_host, state->sizes, sizeof sizes_host);
    exec_->copy_to_host(count_host.data(), state->expert_count, count_host.size() * 4);
    exec_->copy_to_host(status_host, status, sizeof status_host);
    if (status_host[1] != 0) {
      // Every rank found the same bad rank (or this rank timed out): leave the channel in step.
      exec_->each(1, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t) { status[1] = 0; });
      barrier(1);
      exec_->end_op();
      std::rethrow_exception(error_from(status_host[1], op));
    }
    rows = sizes_host[0];
    expanded_rows = sizes_host[1];
    for (int l = 0; l < El; ++l) aligned_list.push_back(static_cast<int>(align_up(count_host[static_cast<size_t>(l)], s.align)));
  } else {
    rows = cap;
    expanded_rows = align_up(cap * std::min(k, El) + std::int64_t{s.align - 1} * El, s.align);
  }

  DispatchResult result;
  const std::int64_t out_rows = expand ? expanded_rows : rows;
  result.recv_x = exec_->empty(x_dtype, a.stream, out_rows, std::int64_t{s.H});
  std::int64_t scale_block = 1;
  if (fp8) {
    if (a.use_tma_aligned_col_major_sf) {
      scale_block = align_up(std::max<std::int64_t>(out_rows, 1), 4);
      Tensor storage = exec_->empty(scale_dtype, a.stream, P, scale_block);
      const std::int64_t shape[] = {out_rows, P};
      const std::int64_t strides[] = {1, scale_block};
      result.recv_x_scales = storage.with_view(TensorView(storage.data(), scale_dtype, shape, strides).on_device(dev));
    } else {
      result.recv_x_scales = exec_->empty(scale_dtype, a.stream, out_rows, P);
    }
  }
  if (!expand) result.recv_topk_idx = exec_->empty(DType::kInt64, a.stream, rows, k);
  if (has_weights)
    result.recv_topk_weights = expand ? exec_->empty(DType::kFP32, a.stream, expanded_rows)
                                      : exec_->empty(DType::kFP32, a.stream, rows, k);
  if (!cached) {
    handle->recv_src_metadata = exec_->empty(DType::kInt32, a.stream, rows, k + 2);
    handle->dst_buffer_slot_idx = exec_->empty(DType::kInt32, a.stream, N, k);
    handle->do_expand = expand;
    handle->num_experts = s.E;
    handle->expert_alignment = s.align;
    handle->num_max_tokens_per_rank = T;
    handle->num_sms = a.num_sms;
    handle->num_tokens = N;
    handle->num_topk = k;
    handle->hidden = s.H;
    handle->num_recv_tokens = state->num_recv_tokens = rows;
    handle->num_expanded_tokens = state->num_expanded_tokens = expanded_rows;
    handle->num_recv_tokens_per_expert_list = aligned_list;
    if (a.do_handle_copy) {
      handle->topk_idx = exec_->empty(DType::kInt64, a.stream, N, k);
      exec_->copy(handle->topk_idx.data(), state->topk, static_cast<std::size_t>(N) * k * 8);
    } else {
      handle->topk_idx = Tensor().with_view(a.topk_idx);
    }
    handle->provider_state = state;
    // dst_buffer_slot_idx: this rank * T + slot at each destination's master lane.
    auto* const slots = handle->dst_buffer_slot_idx.data_as<std::int32_t>();
    const std::int64_t* const topk = state->topk;
    const std::int32_t* const dst_slot = state->dst_slot;
    exec_->each(std::int64_t{N} * k, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      const std::int64_t t = i / k;
      const int j = static_cast<int>(i % k);
      const int d = detail::rank_of(topk[i], El);
      bool master = d >= 0;
      for (int l = j + 1; l < k && master; ++l) master = detail::rank_of(topk[t * k + l], El) != d;
      slots[i] = master ? me * T + dst_slot[t * R + d] : -1;
    });
    result.handle = new_handle;
  } else {
    result.handle = std::const_pointer_cast<EPHandle>(a.handle);
  }
  if (a.previous_event_before_epilogue) a.previous_event_before_epilogue->wait();

  // Pull every row from its source.
  {
    const PeerTensors pt = peer;
    const std::int32_t* const sizes = plan->sizes;
    const std::int32_t* const row_src = plan->row_src;
    const std::int32_t* const lane_rows = plan->lane_rows;
    const std::int32_t* const local_ids = plan->local_ids;
    const std::int32_t* const row_master = plan->row_master;
    const std::int64_t chunks = row_bytes / 16;
    auto* const out = static_cast<std::byte*>(result.recv_x.data());
    exec_->each(rows * chunks, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t idx) {
      const std::int64_t i = idx / chunks, c = idx % chunks;
      if (i >= sizes[0] || load_acquire(status + 1) != 0) return;
      const int src = row_src[i] / T, t = row_src[i] % T;
      const Chunk v = reinterpret_cast<const Chunk*>(pt.x[src] + std::int64_t{t} * pt.x_row[src])[c];
      if (!expand) {
        reinterpret_cast<Chunk*>(out + i * row_bytes)[c] = v;
        return;
      }
      for (int j = 0; j < k; ++j) {
        const std::int32_t r = lane_rows[i * k + j];
        if (r >= 0) reinterpret_cast<Chunk*>(out + std::int64_t{r} * row_bytes)[c] = v;
      }
    });
    auto* const out_scales = fp8 ? static_cast<std::uint32_t*>(result.recv_x_scales.data()) : nullptr;
    auto* const out_ids = expand ? nullptr : result.recv_topk_idx.data_as<std::int64_t>();
    auto* const out_w = has_weights ? result.recv_topk_weights.data_as<float>() : nullptr;
    auto* const meta = cached ? nullptr : handle->recv_src_metadata.data_as<std::int32_t>();
    exec_->each(rows, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t i) {
      if (i >= sizes[0] || load_acquire(status + 1) != 0) {
        if (out_ids)
          for (int j = 0; j < k; ++j) out_ids[i * k + j] = -1;
        if (meta)
          for (int j = 0; j < k + 2; ++j) meta[i * (k + 2) + j] = -1;
        return;
      }
      const int src = row_src[i] / T, t = row_src[i] % T;
      const std::uint32_t* sc = out_scales ? pt.scales[src] + std::int64_t{t} * pt.scale_stride0[src] : nullptr;
      const float* w = out_w ? pt.weights[src] + std::int64_t{t} * pt.weights_row[src] : nullptr;
      if (!expand) {
        for (int p = 0; p < P && sc; ++p) out_scales[(scale_block == 1 ? i * P + p : p * scale_block + i)] = sc[p * pt.scale_stride1[src]];
        for (int j = 0; j < k; ++j) out_ids[i * k + j] = local_ids[i * k + j];
        for (int j = 0; j < k && w; ++j) out_w[i * k + j] = w[j];
      } else {
        for (int j = 0; j < k; ++j) {
          const std::int64_t r = lane_rows[i * k + j];
          if (r < 0) continue;
          for (int p = 0; p < P && sc; ++p)
            out_scales[(scale_block == 1 ? r * P + p : p * scale_block + r)] = sc[p * pt.scale_stride1[src]];
          if (w) out_w[r] = w[j];
        }
      }
      if (meta) {
        meta[i * (k + 2)] = row_src[i];
        meta[i * (k + 2) + 1] = src * k + row_master[i];
        for (int j = 0; j < k; ++j) meta[i * (k + 2) + 2 + j] = expand ? lane_rows[i * k + j] : -1;
      }
    });
    if (expand && a.do_zero_padding) {
      const std::int32_t* const start = plan->expert_start;
      const std::int32_t* const count = plan->expert_count;
      const int align = s.align;
      exec_->each(expanded_rows * chunks, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t idx) {
        const std::int64_t r = idx / chunks, c = idx % chunks;
        if (load_acquire(status + 1) != 0) return;
        int l = 0;
        while (l + 1 < El && start[l + 1] <= r) ++l;
        const std::int64_t begin = start[l] + count[l], end = start[l] + align_up(count[l], align);
        if (r < begin || r >= end) return;
        reinterpret_cast<Chunk*>(out + r * row_bytes)[c] = Chunk{};
        if (c == 0) {
          for (int p = 0; p < P && out_scales; ++p) out_scales[(scale_block == 1 ? r * P + p : p * scale_block + r)] = 0;
          if (out_w) out_w[r] = 0.0f;
        }
      });
    }
  }
  barrier(1);
  exec_->mirror_error(status + 1);
  exec_->end_op();
  finish(a.stream, a.async_with_compute_stream, result.event, op);
  return result;
}

}  // namespace moe_ep::cuda
