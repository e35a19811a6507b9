// Validation of a dispatch's arguments (before the agreement) and of what the agreement gathered.
#include <fmt/format.h>

#include <algorithm>

#include "core/arith.hh"
#include "core/checks.hh"
#include "core/v2_contract.hh"
#include "engine/dispatch_op.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::engine::dispatch_detail {

void Dispatch::check_arguments() {
  if (!req_.rejection.empty()) core::fail(ctx_, "{}", req_.rejection);
  if (req_.check_generation_arguments) req_.check_generation_arguments(ctx_);
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
    cached_call_ = core::v2::CachedCall{.topk_given = a.topk_idx.defined(), .cpu_sync = a.cpu_sync,
                                        .stats_given = a.cumulative_local_expert_recv_stats.defined(),
                                        .expand = a.expand, .num_experts = a.num_experts,
                                        .expert_alignment = a.expert_alignment, .max_tokens = a.max_tokens};
    if (a.generation.expert_stride != h.expert_stride)
      core::fail(ctx_, "the expert stride {} differs from the handle's {}", a.generation.expert_stride, h.expert_stride);
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
  stride_ = a.generation.expert_stride;
}

// x and its scales.
void Dispatch::check_payload() {
  const core::v2::Payload p = core::v2::check_payload(ctx_, req_.x, req_.x_scales, shape_.max_tokens,
                                                      engine_.facts.config.fixed_hidden, DLDevice{kDLCPU, 0});
  x_dtype_ = p.x_dtype;
  scale_dtype_ = p.scale_dtype;
  fp8_ = p.fp8;
  shape_.tokens = p.tokens;
  shape_.hidden = p.hidden;
  shape_.scale_columns = p.scale_columns;
  row_bytes_ = p.row_bytes;
  const int H = p.hidden;
  if (req_.generation.handle_hidden < 0) core::fail(ctx_, "the handle's hidden size {} is negative", req_.generation.handle_hidden);
  handle_hidden_ = req_.generation.handle_hidden > 0 ? req_.generation.handle_hidden : H;
}

// The handle (cached) or topk_idx (new dispatch), the experts and the alignment.
void Dispatch::check_routing() {
  const auto& a = req_;
  const int N = shape_.tokens;
  if (cached_) {
    core::v2::check_cached(ctx_, cached_call_, cached_state_->facts, N, handle_hidden_);
  } else {
    shape_.topk = core::v2::check_topk(ctx_, a.topk_idx, N, DLDevice{kDLCPU, 0});
  }
  shape_.local_experts =
      core::v2::check_experts(ctx_, shape_.topk, shape_.experts, engine_.facts.num_ranks, shape_.alignment);
}

// Weights, statistics, options; the capacity; the routing of a new dispatch.
void Dispatch::check_options() {
  const auto& a = req_;
  has_weights_ = a.topk_weights.defined();
  core::v2::check_options(ctx_, a.topk_weights, a.cumulative_local_expert_recv_stats, shape_.tokens, shape_.topk,
                          shape_.local_experts, a.zero_padding, expand_, DLDevice{kDLCPU, 0});
  if (stride_ < 0) core::fail(ctx_, "the expert stride {} is negative", stride_);
  if (stride_ > 0 && !expand_) core::fail(ctx_, "an expert stride ({}) requires do_expand = true", stride_);
  if (shape_.max_tokens == 0 && !cpu_sync_ && a.generation.worst_rows <= 0)
    core::fail(ctx_, "outputs of worst-case size need num_max_tokens_per_rank or a worst-case row count");
  if (a.generation.worst_rows < 0) core::fail(ctx_, "the worst-case row count {} is negative", a.generation.worst_rows);
  engine_.facts.check_num_qps(ctx_, a.num_qps);
  geo_ = routing::Geometry{engine_.facts.num_ranks, shape_.experts, engine_.facts.logical_scaleout};
  if (shape_.max_tokens > 0) pool_need_ = check_capacity(shape_.max_tokens);

  // The routing of a new dispatch is checked here, before anything moves.
  if (!cached_)
    routing::validate_topk(
        ctx_, {a.topk_idx.data_as<const std::int64_t>(), a.topk_idx.stride(0), shape_.tokens, shape_.topk},
        shape_.experts);
}

// The row indices (int32) and the buffer must hold `tokens_bound` tokens per source. Returns the
// bytes the pool must hold: with EngineConfig::grow_pool, for this dispatch and for the combine
// of its handle (check_gathered grows the pool to it); otherwise a shortfall is a CapacityError.
std::int64_t Dispatch::check_capacity(int tokens_bound) const {
  const int k = shape_.topk, El = shape_.local_experts, H = shape_.hidden;
  core::v2::check_row_capacity(ctx_, tokens_bound, engine_.facts.num_ranks, k, El, shape_.alignment, stride_);
  const std::int64_t scale_bytes = std::int64_t{shape_.scale_columns} * 4;
  // Combine rows have the handle's hidden size.
  const RegionSizes need = region_sizes(engine_.facts.paths, tokens_bound, handle_hidden_, row_bytes_, scale_bytes, k,
                                        engine_.facts.config.allow_multiple_reduction);
  if (engine_.facts.config.grow_pool) return need.total();
  const std::int64_t holds = engine_.pool_bytes();
  if (need.dispatch_bytes > holds) {
    const std::int64_t bytes = core::round_up<std::int64_t>(need.dispatch_bytes, engine_.facts.config.pool_alignment);
    throw CapacityError(fmt::format("{}: this call needs {} bytes of buffer ({} tokens per rank, hidden = {}, k = {}), "
                                    "the buffer holds {}", ctx_, bytes, tokens_bound, H, k, holds),
                        bytes, holds);
  }
  return need.dispatch_bytes;
}

// Checks of what the agreement gathered: every rank computes the same answer, so a failure here is
// raised by all ranks alike.
void Dispatch::check_gathered(const std::vector<PeerTensors>& peers) {
  in_step([&] {
  if (shape_.max_tokens == 0) {
    for (const PeerTensors& p : peers) shape_.max_tokens = std::max(shape_.max_tokens, p.num_tokens);
    shape_.max_tokens = std::max(shape_.max_tokens, 1);
    pool_need_ = check_capacity(shape_.max_tokens);
  }
  if (!cached_) {
    const int e = plan_->layout.expert_over_stride();
    if (e >= 0)
      throw InvalidArgument(fmt::format("{}: expert {} receives {} rows, more than the expert stride {}", ctx_, e,
                                        plan_->layout.expert_total(e), stride_));
  }
  if (req_.generation.worst_rows > 0 && !cached_) {
    for (int d = 0; d < geo_.num_ranks; ++d)
      if (plan_->layout.rows_at(d) > req_.generation.worst_rows)
        throw InvalidArgument(fmt::format("{}: rank {} receives {} tokens, more than the worst-case row count {}",
                                          ctx_, d, plan_->layout.rows_at(d), req_.generation.worst_rows));
  }
  });
  // Outside in_step: a failed growth may leave the ranks out of step (the engine then breaks).
  if (engine_.facts.config.grow_pool) engine_.grow_pool(pool_need_, ctx_);
}

std::int64_t Dispatch::worst_rows() const {
  if (cached_) return cached_state_->facts.num_recv_tokens;
  if (req_.generation.worst_rows > 0) return req_.generation.worst_rows;
  return static_cast<std::int64_t>(shape_.max_tokens) * engine_.facts.num_ranks;
}

std::int64_t Dispatch::worst_expanded_rows() const {
  if (cached_) return cached_state_->facts.num_expanded_tokens;
  if (stride_ > 0) return static_cast<std::int64_t>(stride_) * shape_.local_experts;
  return core::v2::worst_expanded_rows(engine_.facts.num_ranks, shape_.max_tokens, shape_.topk, shape_.local_experts,
                                      shape_.alignment);
}

}  // namespace moe_ep::engine::dispatch_detail
