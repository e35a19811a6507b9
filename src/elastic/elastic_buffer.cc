#include "moe_ep/elastic_buffer.hpp"

#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <future>

#include "comm/agreement.hh"
#include "core/bandwidth.hh"
#include "core/log.hh"
#include "elastic/buffer_core.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace elastic {
namespace {

std::atomic<std::uint64_t> next_buffer_id{1};

Paths paths_for(const Topology& physical, int num_ranks, bool allow_hybrid) {
  return Paths{num_ranks, physical.num_scaleout, allow_hybrid ? physical.num_scaleout : 1};
}

std::exception_ptr check_config(const std::string& context, const ElasticBufferConfig& c) {
  try {
    auto fail = [&](const std::string& what) { throw InvalidArgument(fmt::format("{}: {}", context, what)); };
    if (c.num_bytes < 0) fail(fmt::format("num_bytes = {} is negative", c.num_bytes));
    if (c.num_bytes == 0 && c.num_max_tokens_per_rank <= 0)
      fail(fmt::format("num_max_tokens_per_rank = {} must be positive when num_bytes is not given",
                       c.num_max_tokens_per_rank));
    if (c.num_bytes == 0 && c.hidden <= 0)
      fail(fmt::format("hidden = {} must be positive when num_bytes is not given", c.hidden));
    if (c.num_max_tokens_per_rank < 0) fail(fmt::format("num_max_tokens_per_rank = {} is negative", c.num_max_tokens_per_rank));
    if (c.hidden < 0) fail(fmt::format("hidden = {} is negative", c.hidden));
    if (c.num_topk < 0 || c.num_topk > kMaxTopk) fail(fmt::format("num_topk = {} is outside [0, {}]", c.num_topk, kMaxTopk));
    if (c.num_bytes % kBufferAlignment != 0)
      fail(fmt::format("num_bytes = {} is not a multiple of {} (2 MiB)", c.num_bytes, kBufferAlignment));
    if (c.use_fp8_dispatch && c.hidden % 128 != 0)
      fail(fmt::format("hidden = {} must be a multiple of 128 with use_fp8_dispatch", c.hidden));
    if (!(c.num_cpu_timeout_secs > 0)) fail(fmt::format("num_cpu_timeout_secs = {} must be positive", c.num_cpu_timeout_secs));
    if (c.num_allocated_qps < 0) fail(fmt::format("num_allocated_qps = {} is negative", c.num_allocated_qps));
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace

BufferCore::BufferCore(Group& group, const ElasticBufferConfig& cfg)
    : config(cfg), rank(group.rank()), num_ranks(group.size()), physical(group.transport().topology()) {
  logical_scaleout = config.allow_hybrid_mode ? physical.num_scaleout : 1;
  logical_scaleup = num_ranks / logical_scaleout;
  paths = paths_for(physical, num_ranks, config.allow_hybrid_mode);
  id = next_buffer_id++;
  const std::string ctx = context("ElasticBuffer");
  std::exception_ptr error = check_config(ctx, config);
  num_bytes = config.num_bytes != 0 ? config.num_bytes
              : error               ? 0
                                    : buffer_size_hint(paths, config.num_max_tokens_per_rank, config.hidden,
                                                       config.num_topk, config.use_fp8_dispatch,
                                                       config.allow_multiple_reduction);
  num_allocated_qps = config.num_allocated_qps != 0 ? config.num_allocated_qps : config.allow_hybrid_mode ? 129 : 17;

  transport_ = group.transport().duplicate(wait("ElasticBuffer: channel setup"));
  comm::Agreement agreement(ctx, "ElasticBuffer");
  agreement.local_error(error)
      .field("num_bytes", num_bytes)
      .field("num_max_tokens_per_rank", config.num_max_tokens_per_rank)
      .field("hidden", config.hidden)
      .field("num_topk", config.num_topk)
      .field("use_fp8_dispatch", config.use_fp8_dispatch)
      .field("allow_hybrid_mode", config.allow_hybrid_mode)
      .field("allow_multiple_reduction", config.allow_multiple_reduction);
  agreement.exchange(*transport_, comm::Scope::kWorld, wait("ElasticBuffer: configuration agreement"), {});
  memory_ = transport_->allocate_symmetric(static_cast<std::size_t>(num_bytes), wait("ElasticBuffer: allocation"));
  signals_expected_.assign(static_cast<size_t>(num_ranks), 0);

  if (config.num_topk == 0)
    core::debug("{}: num_topk = 0, sizing conservatively for k = {}", ctx, kMaxTopk);
  core::debug("{}: {} bytes of symmetric memory (physical {}x{}, logical {}x{}, {} path), {} allocated qps", ctx,
              num_bytes, physical.num_scaleout, physical.num_scaleup, logical_scaleout, logical_scaleup,
              paths.hybrid() ? "hybrid" : paths.direct_remote() ? "direct (with scale-out)" : "direct (scale-up only)",
              num_allocated_qps);
}

BufferCore::~BufferCore() {
  comm_worker_.drain();
  if (!destroyed_ && config.explicitly_destroy)
    std::fprintf(stderr, "[moe-ep] warning: ElasticBuffer on rank %d was not destroyed explicitly\n", rank);
  // After a failed collective, peers may still read this memory: keep it mapped (see docs).
  if (!broken_reason().empty()) (void)memory_.release();
}

std::string BufferCore::context(const char* operation) const { return fmt::format("[rank {}] {}", rank, operation); }

std::string BufferCore::broken_reason() const {
  std::lock_guard lock(state_mutex_);
  return broken_;
}

void BufferCore::check_usable(const char* operation) const {
  std::lock_guard lock(state_mutex_);
  if (destroyed_) throw StateError(fmt::format("{}: the buffer was destroyed", context(operation)));
  if (!broken_.empty())
    throw StateError(fmt::format("{}: the buffer is unusable after a failed collective ({}); destroy it and create a "
                                 "new one", context(operation), broken_));
}

void BufferCore::run_guarded(Operation& op, const std::function<void()>& outputs_ready) {
  try {
    op.run(outputs_ready);
  } catch (const std::exception& e) {
    if (!op.in_step_failure) mark_broken(e.what());
    throw;
  }
}

Event BufferCore::submit(const std::shared_ptr<Operation>& op, bool async) {
  if (!async) {
    comm_worker_.drain();
    run_guarded(*op, [] {});
    return Event();
  }
  Event event = Event::pending();
  if (op->local_error) {
    // Take part in the agreement so that the peers learn about the rejection, but report now.
    comm_worker_.submit([this, op, event] {
      try {
        run_guarded(*op, [] {});
      } catch (...) {
        event.fail(std::current_exception());
      }
    });
    std::rethrow_exception(op->local_error);
  }
  if (op->outputs_known_early()) {
    op->allocate_outputs_early();
    comm_worker_.submit([this, op, event] {
      try {
        run_guarded(*op, [] {});
        event.complete();
      } catch (...) {
        event.fail(std::current_exception());
      }
    });
    return event;
  }
  // The output shapes depend on the count exchange: wait until the worker allocated them.
  auto ready = std::make_shared<std::promise<void>>();
  std::future<void> allocated = ready->get_future();
  comm_worker_.submit([this, op, event, ready] {
    bool signalled = false;
    try {
      run_guarded(*op, [&] {
        signalled = true;
        ready->set_value();
      });
      event.complete();
    } catch (...) {
      if (!signalled) ready->set_exception(std::current_exception());
      event.fail(std::current_exception());
    }
  });
  allocated.get();
  return event;
}

template <class Op>
auto BufferCore::execute(const std::shared_ptr<Op>& op, bool async) {
  Event event = submit(op, async);
  auto result = op->result;
  result.event = event;
  return result;
}

DispatchResult BufferCore::dispatch(const DispatchArgs& args) {
  check_usable("dispatch");
  return execute(make_dispatch(*this, args, next_sequence()), args.async_with_compute_stream);
}

CombineResult BufferCore::combine(const CombineArgs& args) {
  check_usable("combine");
  return execute(make_combine(*this, args, next_sequence()), args.async_with_compute_stream);
}

// Buffer-level collectives go through an agreement too, so that a rank in a different call
// (say dispatch) is reported instead of being matched with this one.
void BufferCore::simple_collective(const char* operation) {
  check_usable(operation);
  comm_worker_.drain();
  comm::Agreement agreement(context(operation), operation);
  agreement.field("operation number", static_cast<std::int64_t>(next_sequence()));
  try {
    agreement.exchange(*transport_, comm::Scope::kWorld, wait(operation), {});
  } catch (const std::exception& e) {
    if (!agreement.gathered()) mark_broken(e.what());
    throw;
  }
}

void BufferCore::mark_broken(const std::string& reason) {
  std::lock_guard lock(state_mutex_);
  if (broken_.empty()) broken_ = reason;
}

void BufferCore::barrier() { simple_collective("barrier"); }

void BufferCore::destroy() {
  simple_collective("destroy");
  memory_.reset();
  std::lock_guard lock(state_mutex_);
  destroyed_ = true;
}

int BufferCore::resolve_workers(int num_sms, int num_experts, int num_topk) {
  int workers = num_sms;
  if (workers <= 0) {
    const auto forced = env::get_int("MOE_EP_NUM_WORKERS");
    workers = forced > 0 ? static_cast<int>(forced) : theoretical_num_sms(num_experts, num_topk, 0, 0, 0, 0, 0);
  }
  pool_.resize(workers);
  return workers;
}

void BufferCore::check_num_qps(const std::string& ctx, int num_qps) const {
  if (num_qps < 0 || num_qps > num_allocated_qps)
    throw InvalidArgument(fmt::format("{}: num_qps = {} is outside [0, num_allocated_qps = {}]", ctx, num_qps,
                                      num_allocated_qps));
}

void BufferCore::wait_for_event(const std::optional<Event>& event, const std::string& ctx, const char* argument) const {
  if (event && !event->wait_for(config.num_cpu_timeout_secs))
    throw TimeoutError(fmt::format("{}: {} did not complete within {} s", ctx, argument, config.num_cpu_timeout_secs), {});
}

int BufferCore::theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk, double rdma_gbs,
                                    double nvlink_gbs, double sm_read_gbs, double sm_write_gbs) const {
  const std::string ctx = context("get_theoretical_num_sms");
  if (num_scaleout_topk != 0) throw InvalidArgument(fmt::format("{}: num_scaleout_topk must be 0", ctx));
  if (num_experts <= 0 || num_experts % num_ranks != 0)
    throw InvalidArgument(fmt::format("{}: num_experts = {} must be a positive multiple of the {} ranks", ctx,
                                      num_experts, num_ranks));
  if (num_topk < 1 || num_topk > kMaxTopk || num_topk > num_experts)
    throw InvalidArgument(fmt::format("{}: num_topk = {} is outside [1, min({}, num_experts = {})]", ctx, num_topk,
                                      kMaxTopk, num_experts));
  // Cores this rank may use: the host's cores shared by the ranks running on it.
  const auto& bw = core::machine_bandwidth();
  const int cap = std::max(1, bw.cores / std::max(1, transport_->ranks_on_host()));
  const int R = num_ranks, SO = logical_scaleout, SU = logical_scaleup;
  const int NVL = physical.num_scaleup, RDMA = physical.num_scaleout;
  // Scale-up and scale-out links are memory here: each rank's share of the host's copy bandwidth.
  const double share = bw.all_cores_gbs / std::max(1, transport_->ranks_on_host());
  if (nvlink_gbs <= 0) nvlink_gbs = share;
  if (rdma_gbs <= 0) rdma_gbs = share;
  if (sm_read_gbs <= 0) sm_read_gbs = bw.single_thread_gbs;
  if (sm_write_gbs <= 0) sm_write_gbs = bw.single_thread_gbs;
  // Expected number of groups (of G equal groups) hit by k distinct uniformly chosen experts.
  auto groups_hit = [&](int G) {
    const double per_group = static_cast<double>(num_experts) / G;
    double miss = 1.0;
    for (int i = 0; i < num_topk; ++i) miss *= (num_experts - per_group - i) / (num_experts - i);
    return G * (1.0 - std::max(miss, 0.0));
  };
  const double n = groups_hit(R), n_so = SO > 1 ? groups_hit(SO) : 0.0;
  double read = 1.0 / n, write, rdma, nvlink;
  if (SO > 1) {
    write = 1.0 / n + (1.0 / n) * (n_so / SO) + 1.0;
    read += n_so / n;
    rdma = (1.0 / n) * n_so * (1.0 - 1.0 / SO);
    nvlink = 1.0 - 1.0 / SU;
  } else {
    write = (RDMA > 1 ? 1.0 / n : 0.0) + static_cast<double>(NVL) / R;
    nvlink = (static_cast<double>(NVL) / R) * (1.0 - 1.0 / NVL);
    rdma = static_cast<double>(R - NVL) / R;
  }
  double bandwidth = nvlink_gbs, traffic = nvlink;
  if (SO > 1 && rdma / rdma_gbs > nvlink / nvlink_gbs) {
    bandwidth = rdma_gbs;
    traffic = rdma;
  }
  double sms = cap;
  if (traffic > 0)
    sms = std::max(bandwidth / traffic * read / sm_read_gbs, bandwidth / traffic * write / sm_write_gbs);
  int result = static_cast<int>(align_to(std::max<std::int64_t>(4, static_cast<std::int64_t>(std::ceil(1.25 * sms))), 2));
  if (!config.prefer_overlap_with_compute) result = std::max(result, 64);
  return std::min(result, cap);
}

}  // namespace elastic

ElasticBuffer::ElasticBuffer(Group& group, const ElasticBufferConfig& config)
    : core_(std::make_unique<elastic::BufferCore>(group, config)) {}
ElasticBuffer::~ElasticBuffer() = default;

std::int64_t ElasticBuffer::get_buffer_size_hint(const Group& group, int num_max_tokens_per_rank, int hidden,
                                                 int num_topk, bool use_fp8_dispatch, bool allow_hybrid_mode,
                                                 bool allow_multiple_reduction) {
  const std::string ctx = fmt::format("[rank {}] get_buffer_size_hint", group.rank());
  if (num_max_tokens_per_rank <= 0 || hidden <= 0 || num_topk < 0 || num_topk > elastic::kMaxTopk)
    throw InvalidArgument(fmt::format("{}: needs num_max_tokens_per_rank > 0 (got {}), hidden > 0 (got {}) and "
                                      "num_topk in [0, {}] (got {})",
                                      ctx, num_max_tokens_per_rank, hidden, elastic::kMaxTopk, num_topk));
  const Topology physical = group.transport().topology();
  return elastic::buffer_size_hint(elastic::paths_for(physical, group.size(), allow_hybrid_mode),
                                   num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                   allow_multiple_reduction);
}

DispatchResult ElasticBuffer::dispatch(const DispatchArgs& args) { return core_->dispatch(args); }
CombineResult ElasticBuffer::combine(const CombineArgs& args) { return core_->combine(args); }

int ElasticBuffer::get_theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk, double rdma_gbs,
                                           double nvlink_gbs, double sm_read_gbs, double sm_write_gbs) const {
  return core_->theoretical_num_sms(num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs,
                                    sm_write_gbs);
}

int ElasticBuffer::get_theoretical_num_qps(int num_sms) const {
  const int qps = core_->paths.hybrid() || core_->config.allow_hybrid_mode ? num_sms * 16 + 1 : std::min(num_sms, 9);
  return std::min(qps, core_->num_allocated_qps);
}

void ElasticBuffer::barrier() { core_->barrier(); }
std::pair<int, int> ElasticBuffer::get_physical_domain_size() const {
  return {core_->physical.num_scaleout, core_->physical.num_scaleup};
}
std::pair<int, int> ElasticBuffer::get_logical_domain_size() const {
  return {core_->logical_scaleout, core_->logical_scaleup};
}
void ElasticBuffer::destroy() {
  if (!core_->config.explicitly_destroy)
    throw StateError(fmt::format("{}: destroy() requires explicitly_destroy = true", core_->context("destroy")));
  core_->destroy();
}
int ElasticBuffer::rank() const { return core_->rank; }
int ElasticBuffer::num_ranks() const { return core_->num_ranks; }
std::int64_t ElasticBuffer::num_bytes() const { return core_->num_bytes; }
int ElasticBuffer::num_max_tokens_per_rank() const { return core_->config.num_max_tokens_per_rank; }
int ElasticBuffer::num_allocated_qps() const { return core_->num_allocated_qps; }
int ElasticBuffer::num_scaleout_ranks() const { return core_->logical_scaleout; }
int ElasticBuffer::num_scaleup_ranks() const { return core_->logical_scaleup; }
int ElasticBuffer::scaleout_rank_idx() const { return core_->rank / core_->logical_scaleup; }
int ElasticBuffer::scaleup_rank_idx() const { return core_->rank % core_->logical_scaleup; }
bool ElasticBuffer::is_hybrid() const { return core_->paths.hybrid(); }

}  // namespace moe_ep
