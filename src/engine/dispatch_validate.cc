// Validation of a dispatch's arguments (before the agreement) and of what the agreement gathered.
#include <fmt/format.h>

#include <algorithm>

#include "core/checks.hh"
#include "engine/dispatch_op.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::engine::dispatch_detail {

void Dispatch::check_arguments() {
  if (!req_.rejection.empty()) core::fail(ctx_, "{}", req_.rejection);
  if (req_.validate_more) req_.validate_more(ctx_);
  cached_ = req_.handle != nullptr;
  if (req_.max_tokens < 0) core::fail(ctx_, "num_max_tokens_per_rank = {} is negative", req_.max_tokens);
  take_sizes();
  check_payload();
  check_routing();
  check_options();
}

// The sizes the handle fixes (cached dispatch) or the request gives.
void Dispatch::take_sizes() {
  const auto& a = req_;
  if (cached_) {
    cached_state_ = &checked_handle(engine_, ctx_, *a.handle);
    const HandleFacts& h = cached_state_->facts;
    if (a.topk_idx.defined()) core::fail(ctx_, "topk_idx must not be given with a cached handle");
    if (a.cpu_sync) core::fail(ctx_, "do_cpu_sync = true is not allowed with a cached handle");
    if (a.cumulative_local_expert_recv_stats.defined())
      core::fail(ctx_, "cumulative_local_expert_recv_stats is not allowed with a cached handle");
    if (a.num_experts != 0 && a.num_experts != h.num_experts)
      core::fail(ctx_, "num_experts = {} differs from the handle's {}", a.num_experts, h.num_experts);
    // Shape arguments left at their defaults (0, false) take the handle's values.
    if (a.expert_alignment != 0 && a.expert_alignment != h.expert_alignment)
      core::fail(ctx_, "expert_alignment = {} differs from the handle's {}", a.expert_alignment, h.expert_alignment);
    if (a.max_tokens != 0 && a.max_tokens != h.num_max_tokens_per_rank)
      core::fail(ctx_, "num_max_tokens_per_rank = {} differs from the handle's {}", a.max_tokens,
                 h.num_max_tokens_per_rank);
    if (a.expand && !h.do_expand) core::fail(ctx_, "do_expand = true differs from the handle's false");
    if (a.expert_stride != h.expert_stride)
      core::fail(ctx_, "the expert stride {} differs from the handle's {}", a.expert_stride, h.expert_stride);
    shape_.experts = h.num_experts;
    shape_.topk = h.num_topk;
    shape_.alignment = h.expert_alignment;
    shape_.max_tokens = h.num_max_tokens_per_rank;
    cpu_sync_ = false;
    expand_ = h.do_expand;
  } else {
    shape_.experts = a.num_experts;
    shape_.alignment = a.expert_alignment == 0 ? 1 : a.expert_alignment;
    shape_.max_tokens = a.max_tokens;
    cpu_sync_ = a.cpu_sync;
    expand_ = a.expand;
  }
  stride_ = a.expert_stride;
}

// x and its scales.
void Dispatch::check_payload() {
  const TensorView& x = req_.x;
  if (!x.defined()) core::fail(ctx_, "x is missing");
  x_dtype_ = x.dtype();
  fp8_ = x_dtype_ == DType::kFP8E4M3;
  // Rows travel as bytes: any 1-, 2- or 4-byte element type (bool and int64 are not payloads).
  if (x_dtype_ == DType::kBool || x_dtype_ == DType::kInt64)
    core::fail(ctx_, "x has dtype {}; the payload must have 1-, 2- or 4-byte elements (bfloat16, float16, float32, "
               "int8, int16, int32, uint8, or float8_e4m3fn with x_scales)", dtype_name(x_dtype_));
  core::expect_tensor(ctx_, "x", x, x_dtype_, {-1, -1});
  core::expect_rows_contiguous(ctx_, "x", x);
  shape_.tokens = core::int_size(ctx_, "x", x, 0);
  shape_.hidden = core::int_size(ctx_, "x", x, 1);
  const int T = shape_.max_tokens, H = shape_.hidden;
  if (T > 0 && x.size(0) > T) core::fail(ctx_, "x has {} tokens, more than num_max_tokens_per_rank = {}", x.size(0), T);
  if (engine_.facts.config.fixed_hidden > 0 && H != engine_.facts.config.fixed_hidden)
    core::fail(ctx_, "x has hidden size {}, the buffer was built for hidden = {}", H, engine_.facts.config.fixed_hidden);
  if (x.size(1) <= 0 || x.size(1) > kMaxHidden)
    core::fail(ctx_, "x has hidden size {}, expected 1 to {}", x.size(1), kMaxHidden);
  row_bytes_ = static_cast<std::int64_t>(H) * static_cast<std::int64_t>(element_size(x_dtype_));
  if (row_bytes_ % kRowByteMultiple != 0)
    core::fail(ctx_, "x is {} [{}, {}]: a row is {} bytes, which must be a multiple of {} (hidden x element size, "
               "here hidden must be a multiple of {})", dtype_name(x_dtype_), shape_.tokens, H, row_bytes_,
               kRowByteMultiple, kRowByteMultiple / static_cast<std::int64_t>(element_size(x_dtype_)));
  if (fp8_) {
    if (!req_.x_scales.defined()) core::fail(ctx_, "x is float8_e4m3fn but x_scales is missing");
    scale_dtype_ = req_.x_scales.dtype();
    if (scale_dtype_ != DType::kFP32 && scale_dtype_ != DType::kInt32)
      core::fail(ctx_, "x_scales has dtype {}, expected float32 or int32 (packed UE8M0)", dtype_name(scale_dtype_));
    core::expect_tensor(ctx_, "x_scales", req_.x_scales, scale_dtype_, {shape_.tokens, -1});
    shape_.scale_columns = core::int_size(ctx_, "x_scales", req_.x_scales, 1);
    if (shape_.scale_columns <= 0)
      core::fail(ctx_, "x_scales has {} columns, expected at least 1", shape_.scale_columns);
  } else if (req_.x_scales.defined()) {
    core::fail(ctx_, "x_scales is given but x is {} (scales go with float8_e4m3fn x only)", dtype_name(x_dtype_));
  }
  if (req_.handle_hidden < 0) core::fail(ctx_, "the handle's hidden size {} is negative", req_.handle_hidden);
  handle_hidden_ = req_.handle_hidden > 0 ? req_.handle_hidden : H;
}

// The handle (cached) or topk_idx (new dispatch), the experts and the alignment.
void Dispatch::check_routing() {
  const auto& a = req_;
  const int N = shape_.tokens;
  if (cached_) {
    const HandleFacts& h = cached_state_->facts;
    if (N != h.num_tokens) core::fail(ctx_, "x has {} tokens, the handle was made for {}", N, h.num_tokens);
    if (handle_hidden_ != h.hidden)
      core::fail(ctx_, "x has hidden size {}, the handle was made for {}", handle_hidden_, h.hidden);
  } else {
    if (!a.topk_idx.defined()) core::fail(ctx_, "topk_idx is missing (required without a handle)");
    core::expect_tensor(ctx_, "topk_idx", a.topk_idx, DType::kInt64, {N, -1});
    core::expect_rows_contiguous(ctx_, "topk_idx", a.topk_idx);
    shape_.topk = core::int_size(ctx_, "topk_idx", a.topk_idx, 1);
  }
  const int k = shape_.topk, E = shape_.experts;
  if (k < 1 || k > kMaxTopk) core::fail(ctx_, "topk_idx has {} columns (k), expected 1 to {}", k, kMaxTopk);
  if (E <= 0) core::fail(ctx_, "num_experts = {} must be positive", E);
  if (E % engine_.facts.num_ranks != 0)
    core::fail(ctx_, "num_experts = {} is not divisible by the {} ranks", E, engine_.facts.num_ranks);
  if (shape_.alignment < 1) core::fail(ctx_, "expert_alignment = {} must be at least 1", shape_.alignment);
  shape_.local_experts = E / engine_.facts.num_ranks;
}

// Weights, statistics, options; the capacity; the routing of a new dispatch.
void Dispatch::check_options() {
  const auto& a = req_;
  has_weights_ = a.topk_weights.defined();
  if (has_weights_) {
    core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {shape_.tokens, shape_.topk});
    core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  }
  if (a.cumulative_local_expert_recv_stats.defined()) {
    core::expect_tensor(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats,
                        DType::kInt32, {shape_.local_experts});
    core::expect_contiguous(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats);
  }
  if (a.zero_padding && !expand_) core::fail(ctx_, "do_zero_padding = true requires do_expand = true");
  if (stride_ < 0) core::fail(ctx_, "the expert stride {} is negative", stride_);
  if (stride_ > 0 && !expand_) core::fail(ctx_, "an expert stride ({}) requires do_expand = true", stride_);
  if (shape_.max_tokens == 0 && !cpu_sync_ && a.worst_rows <= 0)
    core::fail(ctx_, "outputs of worst-case size need num_max_tokens_per_rank or a worst-case row count");
  if (a.worst_rows < 0) core::fail(ctx_, "the worst-case row count {} is negative", a.worst_rows);
  engine_.facts.check_num_qps(ctx_, a.num_qps);
  geo_ = routing::Geometry{engine_.facts.num_ranks, shape_.experts, engine_.facts.logical_scaleout};
  if (shape_.max_tokens > 0) check_capacity(shape_.max_tokens);

  // The routing of a new dispatch is checked here, before anything moves.
  if (!cached_)
    routing::validate_topk(
        ctx_, {a.topk_idx.data_as<const std::int64_t>(), a.topk_idx.stride(0), shape_.tokens, shape_.topk},
        shape_.experts);
}

// The row indices (int32) and the buffer must hold `tokens_bound` tokens per source.
void Dispatch::check_capacity(int tokens_bound) const {
  const int k = shape_.topk, El = shape_.local_experts, H = shape_.hidden;
  const std::int64_t worst =
      std::max(static_cast<std::int64_t>(tokens_bound) * engine_.facts.num_ranks * std::min(k, El) +
                   std::int64_t{shape_.alignment} * El,
               std::int64_t{stride_} * El);
  if (worst > (std::int64_t{1} << 31) - 1)
    core::fail(ctx_, "num_max_tokens_per_rank = {} x {} ranks x min(k, local experts) = {} rows exceed the int32 "
               "row index", tokens_bound, engine_.facts.num_ranks, worst);
  const std::int64_t scale_bytes = std::int64_t{shape_.scale_columns} * 4;
  const RegionSizes need = region_sizes(engine_.facts.paths, tokens_bound, H, row_bytes_, scale_bytes, k,
                                        engine_.facts.config.allow_multiple_reduction);
  if (need.dispatch_bytes > engine_.facts.config.pool_bytes) {
    const std::int64_t bytes = align_to(need.dispatch_bytes, engine_.facts.config.pool_alignment);
    throw CapacityError(fmt::format("{}: this call needs {} bytes of buffer ({} tokens per rank, hidden = {}, k = {}), "
                                    "the buffer holds {}", ctx_, bytes, tokens_bound, H, k, engine_.facts.config.pool_bytes),
                        bytes, engine_.facts.config.pool_bytes);
  }
}

// Checks of what the agreement gathered: every rank computes the same answer, so a failure here is
// raised by all ranks alike.
void Dispatch::check_gathered(const std::vector<PeerTensors>& peers) {
  in_step([&] {
  if (shape_.max_tokens == 0) {
    for (const PeerTensors& p : peers) shape_.max_tokens = std::max(shape_.max_tokens, p.num_tokens);
    shape_.max_tokens = std::max(shape_.max_tokens, 1);
    check_capacity(shape_.max_tokens);
  }
  if (!cached_) {
    const int e = plan_->layout.expert_over_stride();
    if (e >= 0)
      throw InvalidArgument(fmt::format("{}: expert {} receives {} rows, more than the expert stride {}", ctx_, e,
                                        plan_->layout.expert_total(e), stride_));
  }
  if (req_.worst_rows > 0 && !cached_) {
    for (int d = 0; d < geo_.num_ranks; ++d)
      if (plan_->layout.rows_at(d) > req_.worst_rows)
        throw InvalidArgument(fmt::format("{}: rank {} receives {} tokens, more than the worst-case row count {}",
                                          ctx_, d, plan_->layout.rows_at(d), req_.worst_rows));
  }
  });
}

std::int64_t Dispatch::worst_rows() const {
  if (cached_) return cached_state_->facts.num_recv_tokens;
  if (req_.worst_rows > 0) return req_.worst_rows;
  return static_cast<std::int64_t>(shape_.max_tokens) * engine_.facts.num_ranks;
}

std::int64_t Dispatch::worst_expanded_rows() const {
  if (cached_) return cached_state_->facts.num_expanded_tokens;
  if (stride_ > 0) return static_cast<std::int64_t>(stride_) * shape_.local_experts;
  const int A = shape_.alignment, El = shape_.local_experts;
  return routing::align_up(static_cast<std::int64_t>(engine_.facts.num_ranks) * shape_.max_tokens *
                               std::min(shape_.topk, El) + static_cast<std::int64_t>(A - 1) * El, A);
}

}  // namespace moe_ep::engine::dispatch_detail
