// ElasticBuffer: DeepEP V2's API on the shared engine. This file translates arguments and
// configuration; the collective work happens in src/engine.
#include "moe_ep/elastic_buffer.hpp"

#include "elastic/agrs_sessions.hh"
#include "elastic/engram_store.hh"
#include "elastic/pp_channels.hh"

#include <fmt/format.h>

#include "core/checks.hh"
#include "core/failure.hh"
#include "core/executor.hh"
#include "core/log.hh"
#include "core/timeout.hh"
#include "core/v2_contract.hh"
#include "elastic/v2_config.hh"
#include "core/fabric.hh"
#include "engine/engine.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep {
namespace {

engine::Paths paths_for(const Topology& physical, int num_ranks, bool allow_hybrid) {
  return engine::Paths{num_ranks, physical.num_scaleout, allow_hybrid ? physical.num_scaleout : 1};
}

std::exception_ptr check_config(const std::string& context, const ElasticBufferConfig& c) {
  return core::attempt(context, [&] { elastic::check_config(context, c); });
}

engine::EngineConfig engine_config(const Group& group, const ElasticBufferConfig& c, bool valid) {
  engine::EngineConfig e;
  e.name = "ElasticBuffer";
  // With Engram storage, num_bytes is the total: the pool is what the storage leaves.
  if (valid && c.num_cpu_bytes > 0) {
    e.pool_bytes = c.num_bytes - c.num_cpu_bytes;
  } else if (c.num_bytes != 0 || !valid) {
    e.pool_bytes = c.num_bytes;
  } else {
    e.pool_bytes = engine::buffer_size_hint(paths_for(group.transport().topology(), group.size(), c.allow_hybrid_mode),
                                            c.num_max_tokens_per_rank, c.hidden, c.num_topk, c.use_fp8_dispatch,
                                            c.allow_multiple_reduction);
  }
  e.pool_alignment = kBufferAlignment;
  e.fixed_hidden = c.hidden;
  e.allow_hybrid_mode = c.allow_hybrid_mode;
  e.allow_multiple_reduction = c.allow_multiple_reduction;
  e.prefer_overlap_with_compute = c.prefer_overlap_with_compute;
  // 0 = auto-size; capped where the fabric's per-peer request ring is smaller (core/fabric.hh).
  e.num_allocated_qps = core::cap_inflight(c.num_allocated_qps != 0 ? c.num_allocated_qps : c.allow_hybrid_mode ? 129 : 17);
  e.timeout_secs = valid ? c.num_cpu_timeout_secs : 1;  // a rejected configuration still takes part in the agreement
  e.explicitly_destroy = c.explicitly_destroy;
  return e;
}

// num_sms: 0 = MOE_EP_NUM_WORKERS if set, else the theoretical model. num_sms is checked in
// validation, the variable where it is read (its range is the same limit); both errors travel
// through the agreement.
std::function<int(int, int)> worker_choice(engine::Engine& e, int num_sms) {
  return [&e, num_sms](int num_experts, int num_topk) {
    if (num_sms > 0) return num_sms;
    const std::int64_t forced = env::get(env::kNumWorkers);  // in [0, kMaxWorkers]
    if (forced > 0) return static_cast<int>(forced);
    return engine::theoretical_num_workers(e, num_experts, num_topk, 0, 0, 0, 0, 0);
  };
}

}  // namespace

ElasticBuffer::ElasticBuffer(Group& group, const ElasticBufferConfig& config) : config_(config) {
  const std::string ctx = fmt::format("[rank {}] ElasticBuffer", group.rank());
  const std::exception_ptr error = check_config(ctx, config);
  engine_ = std::make_unique<engine::Engine>(
      group, engine_config(group, config, error == nullptr), error,
      [&](comm::Agreement& a) { elastic::agree_config(a, config); });
  engram_ = std::make_unique<elastic::EngramStore>(*engine_, config.num_cpu_bytes);  // collective with storage
  pp_ = std::make_unique<elastic::PpChannels>(*engine_);
  const auto& e = *engine_;
  if (config.num_topk == 0)
    core::info(core::Subsys::kInit, "ElasticBuffer #{}: num_topk = 0, sizing conservatively for k = {}", engine_->facts.id,
               kMaxTopk);
  core::info(core::Subsys::kInit,
             "ElasticBuffer #{}: num_bytes {} ({}), Engram storage {} bytes, num_max_tokens_per_rank {}, hidden {}, "
             "num_topk {}, {}, hybrid mode {}, multiple reduction {}, {} allocated qps",
             e.facts.id, e.facts.config.pool_bytes, config.num_bytes == 0 ? "from the shape" : "given",
             config.num_cpu_bytes, config.num_max_tokens_per_rank, config.hidden, config.num_topk,
             config.use_fp8_dispatch ? "FP8 dispatch" : "BF16 dispatch", config.allow_hybrid_mode ? "allowed" : "off",
             config.allow_multiple_reduction ? "allowed" : "off", e.facts.config.num_allocated_qps);
}

// The Engram and PP memory, then the all-gather session region, each collectively where the
// engine's destruction is collective (a rank whose buffer is unusable, or not destroyed
// explicitly, releases it alone).
ElasticBuffer::~ElasticBuffer() {
  std::lock_guard lock(calls_);  // a call still running on another thread of this rank ends first
  release_extras();
  if (!agrs_) return;
  const bool collective =
      !config_.explicitly_destroy && core::attempt("", [&] { engine_->check_usable("destruction"); }) == nullptr;
  const std::exception_ptr error =
      core::attempt("", [&] { release_agrs(collective, "destruction"); });
  if (error) {
    core::warn(core::Subsys::kAlloc, "ElasticBuffer #{} on rank {}: the all-gather session region is released alone ({})",
               engine_->facts.id, engine_->facts.rank, comm::message_of(error));
    release_agrs(false, "destruction");
  }
}

std::int64_t ElasticBuffer::get_buffer_size_hint(const Group& group, int num_max_tokens_per_rank, int hidden,
                                                 int num_topk, bool use_fp8_dispatch, bool allow_hybrid_mode,
                                                 bool allow_multiple_reduction) {
  const std::string ctx = fmt::format("[rank {}] get_buffer_size_hint", group.rank());
  if (num_max_tokens_per_rank <= 0 || hidden <= 0 || num_topk < 0 || num_topk > kMaxTopk)
    throw InvalidArgument(fmt::format("{}: needs num_max_tokens_per_rank > 0 (got {}), hidden > 0 (got {}) and "
                                      "num_topk in [0, {}] (got {})",
                                      ctx, num_max_tokens_per_rank, hidden, kMaxTopk, num_topk));
  return engine::buffer_size_hint(paths_for(group.transport().topology(), group.size(), allow_hybrid_mode),
                                  num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                  allow_multiple_reduction);
}

namespace {

// DispatchArgs as an engine request.
engine::DispatchRequest dispatch_request(engine::Engine& engine, const ElasticBufferConfig& config,
                                         const DispatchArgs& args) {
  engine::DispatchRequest r;
  r.rejection = args.rejection;
  r.x = args.x;
  r.x_scales = args.x_scales;
  r.topk_idx = args.topk_idx;
  r.topk_weights = args.topk_weights;
  r.cumulative_local_expert_recv_stats = args.cumulative_local_expert_recv_stats;
  r.handle = args.handle;
  r.num_experts = args.num_experts;
  r.max_tokens = args.num_max_tokens_per_rank > 0 ? args.num_max_tokens_per_rank : config.num_max_tokens_per_rank;
  r.expert_alignment = args.expert_alignment;
  r.workers = worker_choice(engine, args.num_sms);
  r.num_qps = args.num_qps;
  r.previous_event = args.previous_event;
  r.previous_event_before_epilogue = args.previous_event_before_epilogue;
  r.async = args.async_with_compute_stream;
  r.do_handle_copy = args.do_handle_copy;
  r.cpu_sync = args.do_cpu_sync.value_or(args.handle == nullptr);
  r.expand = args.do_expand;
  r.zero_padding = args.do_zero_padding;
  r.generation.col_major_scales = args.use_tma_aligned_col_major_sf;
  const int num_sms = args.num_sms, requested_tokens = args.num_max_tokens_per_rank, tokens = r.max_tokens;
  const bool cached = args.handle != nullptr;
  const bool event_without_allocation = args.previous_event.has_value() && !args.allocate_on_comm_stream;
  r.check_generation_arguments = [num_sms, requested_tokens, tokens, cached, event_without_allocation](const std::string& context) {
    core::v2::check_call(context, num_sms, event_without_allocation);
    if (requested_tokens < 0) core::fail(context, "num_max_tokens_per_rank = {} is negative", requested_tokens);
    if (tokens == 0 && !cached)
      core::fail(context, "num_max_tokens_per_rank is 0: give it here or to the buffer's constructor");
  };
  return r;
}

// CombineArgs as an engine request.
engine::CombineRequest combine_request(engine::Engine& engine, const CombineArgs& args) {
  engine::CombineRequest r;
  r.rejection = args.rejection;
  r.x = args.x;
  r.handle = args.handle;
  r.topk_weights = args.topk_weights;
  r.bias = args.bias;
  const int num_sms = args.num_sms > 0 ? args.num_sms : (args.handle ? args.handle->num_sms : 0);
  r.workers = worker_choice(engine, num_sms);
  r.check_generation_arguments = [given = args.num_sms, num_sms, from_handle = args.num_sms <= 0 && args.handle != nullptr](
                        const std::string& context) {
    core::v2::check_call(context, given, false);
    if (from_handle && (num_sms < 0 || num_sms > kMaxWorkers))
      core::fail(context, "the handle's num_sms = {} is outside [0, {}]", num_sms, kMaxWorkers);
  };
  r.num_qps = args.num_qps;
  r.previous_event = args.previous_event;
  r.previous_event_before_epilogue = args.previous_event_before_epilogue;
  r.async = args.async_with_compute_stream;
  return r;
}

}  // namespace

// The plain calls are the ones without extras: one path from the arguments to the engine.
DispatchResult ElasticBuffer::dispatch(const DispatchArgs& args) { return dispatch(args, DispatchExtras{}); }

CombineResult ElasticBuffer::combine(const CombineArgs& args) { return combine(args, CombineExtras{}); }

DispatchResult ElasticBuffer::dispatch(const DispatchArgs& args, const DispatchExtras& extras) {
  std::lock_guard lock(calls_);
  engine::Engine& e = *engine_;
  e.check_usable("dispatch");
  engine::DispatchRequest r = dispatch_request(e, config_, args);
  r.generation.expert_stride = extras.expert_stride;
  return e.execute(engine::make_dispatch(e, std::move(r), e.next_sequence()), args.async_with_compute_stream);
}

CombineResult ElasticBuffer::combine(const CombineArgs& args, const CombineExtras& extras) {
  std::lock_guard lock(calls_);
  engine::Engine& e = *engine_;
  e.check_usable("combine");
  engine::CombineRequest r = combine_request(e, args);
  r.row_weights = extras.row_weights;
  r.sum_weights_over_ranks = extras.sum_weights_over_ranks;
  r.own_node_rank_terms = extras.own_node_rank_terms;
  return e.execute(engine::make_combine(e, std::move(r), e.next_sequence()), args.async_with_compute_stream);
}

int ElasticBuffer::get_theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk, double rdma_gbs,
                                           double nvlink_gbs, double sm_read_gbs, double sm_write_gbs) const {
  return engine::theoretical_num_workers(*engine_, num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs,
                                         sm_read_gbs, sm_write_gbs);
}

int ElasticBuffer::get_theoretical_num_qps(int num_sms) const {
  const int qps = config_.allow_hybrid_mode ? num_sms * 16 + 1 : std::min(num_sms, 9);
  return std::min(qps, engine_->facts.config.num_allocated_qps);
}

std::pair<int, int> ElasticBuffer::get_physical_domain_size() const {
  return {engine_->facts.physical.num_scaleout, engine_->facts.physical.num_scaleup};
}
std::pair<int, int> ElasticBuffer::get_logical_domain_size() const {
  return {engine_->facts.logical_scaleout, engine_->facts.logical_scaleup};
}
void ElasticBuffer::destroy() {
  std::lock_guard lock(calls_);
  if (!config_.explicitly_destroy)
    throw StateError(fmt::format("{}: destroy() requires explicitly_destroy = true", engine_->facts.context("destroy")));
  release_agrs(true, "destroy");
  engine_->destroy();
  engram_.reset();  // every rank passed destroy(): no peer reads or writes this memory any more
  pp_.reset();
}
int ElasticBuffer::rank() const { return engine_->facts.rank; }
int ElasticBuffer::num_ranks() const { return engine_->facts.num_ranks; }
std::int64_t ElasticBuffer::num_bytes() const {
  return engine_->facts.config.pool_bytes + config_.num_cpu_bytes;
}
std::int64_t ElasticBuffer::num_cpu_bytes() const { return config_.num_cpu_bytes; }
int ElasticBuffer::num_max_tokens_per_rank() const { return config_.num_max_tokens_per_rank; }
int ElasticBuffer::num_allocated_qps() const { return engine_->facts.config.num_allocated_qps; }
int ElasticBuffer::num_scaleout_ranks() const { return engine_->facts.logical_scaleout; }
int ElasticBuffer::num_scaleup_ranks() const { return engine_->facts.logical_scaleup; }
int ElasticBuffer::scaleout_rank_idx() const { return engine_->facts.rank / engine_->facts.logical_scaleup; }
int ElasticBuffer::scaleup_rank_idx() const { return engine_->facts.rank % engine_->facts.logical_scaleup; }
bool ElasticBuffer::is_hybrid() const { return engine_->facts.paths.hybrid(); }

}  // namespace moe_ep
