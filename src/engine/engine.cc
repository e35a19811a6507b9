#include "engine/engine.hh"

#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <future>

#include "core/arith.hh"
#include "core/bandwidth.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::engine {
namespace {

std::atomic<std::uint64_t> next_engine_id{1};

}  // namespace

EngineFacts::EngineFacts(const Group& group, EngineConfig cfg)
    : config(std::move(cfg)), rank(group.rank()), num_ranks(group.size()), physical(group.transport().topology()) {
  logical_scaleout = config.allow_hybrid_mode ? physical.num_scaleout : 1;
  logical_scaleup = num_ranks / logical_scaleout;
  paths = Paths{num_ranks, physical.num_scaleout, logical_scaleout};
  id = next_engine_id++;
}

std::string EngineFacts::context(const std::string& operation) const {
  return fmt::format("[rank {}] {}", rank, operation);
}

void EngineFacts::check_num_qps(const std::string& ctx, int num_qps) const {
  if (num_qps < 0 || num_qps > config.num_allocated_qps)
    throw InvalidArgument(fmt::format("{}: num_qps = {} is outside [0, num_allocated_qps = {}]", ctx, num_qps,
                                      config.num_allocated_qps));
}

Engine::Engine(Group& group, EngineConfig cfg, std::exception_ptr config_error,
               const std::function<void(comm::Agreement&)>& fields)
    : facts(group, std::move(cfg)) {
  const EngineConfig& config = facts.config;
  const std::string ctx = facts.context(config.name);
  transport_ = group.transport().duplicate(facts.wait("construction: channel setup"));
  // The worker-count model's inputs, measured once per process: here, not in the first dispatch.
  core::machine_bandwidth();
  limit_inflight(0);
  comm::Agreement agreement(ctx, config.name);
  agreement.local_error(config_error);
  fields(agreement);
  agreement.exchange(*transport_, comm::Scope::kWorld, facts.wait("construction: configuration agreement"), {});
  // At least one page: a buffer may need no pool at all (one node, normal mode only). Pools up
  // to kPrefaultLimit are faulted in by their owner now; larger ones (sized for worst cases most
  // calls never reach) are faulted in by first use, so only what is used becomes resident.
  const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(config.pool_bytes, 4096));
  memory_ = transport_->allocate_symmetric(bytes, facts.wait("construction: allocation"), config.pool_bytes <= kPrefaultLimit);
  signals_expected_.assign(static_cast<size_t>(facts.num_ranks), 0);
  const Topology& physical = facts.physical;
  core::info(core::Subsys::kInit,
             "{} #{}: {} bytes of symmetric memory per rank; {} ranks, {} node(s) x {} ranks per node (logical {} x "
             "{}), {} path; {} queue pairs; {} cores per rank for workers; timeout {} s",
             config.name, facts.id, config.pool_bytes, facts.num_ranks, physical.num_scaleout, physical.num_scaleup,
             facts.logical_scaleout, facts.logical_scaleup,
             facts.paths.hybrid()          ? "hybrid"
             : facts.paths.direct_remote() ? "direct (with scale-out)"
                                           : "direct (scale-up only)",
             config.num_allocated_qps, cores_per_rank(), config.timeout_secs);
  core::trace(core::Subsys::kAlloc, "{} #{}: symmetric pool of {} bytes mapped, {}", config.name, facts.id, bytes,
              config.pool_bytes <= kPrefaultLimit ? "faulted in now" : "faulted in on first use");
}

void Engine::set_workers(int workers) {
  if (workers != last_workers_) {
    if (last_workers_ == 0) {
      core::info(core::Subsys::kInit, "{} #{}: {} worker thread(s) per rank for the copies", facts.config.name, facts.id, workers);
    } else {
      core::info(core::Subsys::kInit, "{} #{}: {} worker thread(s) per rank for the copies (was {})", facts.config.name, facts.id,
                 workers, last_workers_);
    }
    last_workers_ = workers;
  }
  pool_.resize(workers);
}

Engine::~Engine() {
  comm_worker_.drain();
  const std::string broken = broken_reason();
  bool keep_memory = !broken.empty();  // peers may still read it
  const int on_thread_of = core::thread_rank();  // an in-process rank's thread, else -1
  if (!destroyed_ && tolerant_) {
    // Shrink mode: leave the tolerant exchange (every rank that is not gone leaves too, or the
    // memory stays mapped).
    if (facts.config.explicitly_destroy)
      core::warn_always(core::Subsys::kAlloc, "{} #{} on rank {} was not destroyed explicitly", facts.config.name,
                        facts.id, facts.rank);
    keep_memory = !leave_tolerant() || keep_memory;
  } else if (!destroyed_ && !keep_memory && on_thread_of >= 0 && on_thread_of != facts.rank) {
    // Destroyed on another in-process rank's thread (Python's garbage collector runs on whichever
    // thread triggers it): the destruction collective would wait for that rank, which is this very
    // thread. Leave the channel instead: peers' waits on this rank (their destruction included) end
    // at once, and the memory stays mapped as after any departure.
    const std::string reason = fmt::format("{} #{} of rank {} was destroyed on rank {}'s thread", facts.config.name,
                                           facts.id, facts.rank, on_thread_of);
    core::warn(core::Subsys::kAlloc, "{}; it leaves its channel and its memory stays mapped", reason);
    transport_->abandon(reason, {facts.rank});
    keep_memory = true;
  } else if (!destroyed_ && !keep_memory) {
    if (facts.config.explicitly_destroy) {
      core::warn_always(core::Subsys::kAlloc, "{} #{} on rank {} was not destroyed explicitly; its memory stays mapped",
                 facts.config.name, facts.id, facts.rank);
      keep_memory = true;
    } else {
      // Peers may still read this rank's memory (a receive hook not yet run): free it only once
      // every rank got here.
      try {
        simple_collective("destruction");
      } catch (const std::exception& e) {
        core::warn(core::Subsys::kAlloc, "{} #{} on rank {}: the destruction collective failed ({}); its memory stays "
                   "mapped", facts.config.name, facts.id, facts.rank, e.what());
        keep_memory = true;
      }
    }
  } else if (keep_memory && memory_) {
    core::warn(core::Subsys::kAlloc, "{} #{} on rank {} is unusable ({}); its memory stays mapped", facts.config.name, facts.id,
               facts.rank, broken);
  }
  if (keep_memory) comm::retire(std::move(memory_));
}

std::string Engine::broken_reason() const {
  std::lock_guard lock(state_mutex_);
  return broken_;
}

void Engine::mark_broken(const std::string& reason) {
  std::lock_guard lock(state_mutex_);
  if (broken_.empty()) broken_ = reason;
}

void Engine::check_usable(const char* operation) const {
  std::lock_guard lock(state_mutex_);
  if (destroyed_) throw StateError(fmt::format("{}: the {} was destroyed", facts.context(operation), facts.config.name));
  if (!broken_.empty())
    throw StateError(fmt::format("{}: the {} is unusable after a failed collective ({}); destroy it and create a "
                                 "new one", facts.context(operation), facts.config.name, broken_));
}

// A failure that leaves the ranks out of step breaks the engine and makes this rank abandon its
// channel before the operation (and what it published) goes away: peers waiting for this rank fail
// at once, and none still reads this rank's memory once abandon() returned.
void Engine::run_guarded(Operation& op, const std::function<void()>& outputs_ready) {
  const std::exception_ptr error = core::attempt(op.context(), [&] { run_phases(op, outputs_ready); });
  if (!error) return;
  // A call that counts on some ranks only goes on without those that fail: no failure of it leaves.
  if (!op.in_step_failure_ && !op.tolerant_) leave(error);
  std::rethrow_exception(error);
}

// Everything before the agreement reports failure through it, so that peers are not left waiting
// for a rank that threw.
void Engine::run_phases(Operation& op, const std::function<void()>& outputs_ready) {
  std::exception_ptr error = op.rejection_;
  std::vector<std::byte> payload;
  if (!error) error = core::attempt(op.context(), [&] { payload = op.prepare(); });
  comm::Agreement agreement(op.context(), op.name_);
  agreement.local_error(error);
  op.describe(agreement);
  std::vector<std::span<const std::byte>> payloads;
  const std::vector<char> live = op.counted_on();
  op.tolerant_ = !live.empty();
  comm::TolerantGather::Result among;  // the blocks payloads point into (shrink mode)
  const std::exception_ptr failed = core::attempt(op.context(), [&] {
    if (!op.tolerant_) {
      payloads = agreement.exchange(*transport_, comm::Scope::kWorld, facts.wait(op.agreement_phase_.c_str()), payload);
      return;
    }
    if (!tolerant_)
      throw StateError(fmt::format("{}: the {} has no tolerant exchange (it was not made for shrink mode)", op.context(),
                                   facts.config.name));
    const std::exception_ptr checks = core::attempt(op.context(), [&] {
      payloads = agreement.exchange_among(*tolerant_, live, facts.config.timeout_secs, payload, among, facts.rank);
    });
    if (!among.member.empty()) {  // who took part is known even when the checks failed
      op.members_ = among.member;
      op.dropped(among.dropped);
    }
    if (checks) std::rethrow_exception(checks);
  });
  if (failed) {
    // The agreement's own checks fail on every rank alike; a failed exchange does not.
    op.in_step_failure_ = agreement.gathered();
    std::rethrow_exception(failed);
  }
  op.run(payloads, outputs_ready);
}

void Engine::leave(const std::exception_ptr& error) {
  const std::string why = comm::message_of(error);
  mark_broken(why);
  transport_->abandon(why, comm::culprits_of(error));
  std::rethrow_exception(error);
}

Event Engine::submit(const std::shared_ptr<Operation>& op, bool async) {
  // Lines of this call (and of the communication worker, when it starts now) show this rank,
  // also on threads that have none of their own (a Python thread holding a kept group).
  core::ScopedThreadRank as_rank(facts.rank);
  op->rejection_ = core::attempt(op->context(), [&] { op->validate(); });
  core::trace(core::Subsys::kColl, "{}: submitted ({})", op->context(), async ? "async" : "inline");
  if (!async) {
    comm_worker_.drain();
    run_guarded(*op, [] {});
    return Event();
  }
  // A rejected call takes part in the agreement, so that the peers learn about the rejection, but
  // reports now. Otherwise the caller waits for the outputs unless their shapes are known now.
  const bool rejected = op->rejected();
  const bool early = !rejected && op->outputs_known_early();
  if (early) op->allocate_outputs_early();
  const bool wait_for_outputs = !rejected && !early;
  Event event = Event::pending();
  auto ready = std::make_shared<std::promise<void>>();
  std::future<void> allocated = ready->get_future();
  comm_worker_.submit([this, op, event, ready, wait_for_outputs] {
    bool signalled = false;
    const std::exception_ptr error = core::attempt(op->context(), [&] {
      run_guarded(*op, [&] {
        if (!wait_for_outputs) return;
        signalled = true;
        ready->set_value();
      });
    });
    if (!error) return event.complete();
    if (wait_for_outputs && !signalled) ready->set_exception(error);
    event.fail(error);
  });
  if (rejected) std::rethrow_exception(op->rejection_);
  if (wait_for_outputs) allocated.get();
  return event;
}

namespace {

// A buffer-level collective (barrier, destroy, destruction): an agreement and nothing else, so
// that a rank in a different call (say dispatch) is reported instead of being matched with this one.
class NamedCollective final : public Operation {
 public:
  NamedCollective(const EngineFacts& facts, const char* operation, std::uint64_t sequence)
      : Operation(facts.context(operation), operation, operation), sequence_(sequence) {}
  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {}

 private:
  void describe(comm::Agreement& agreement) const override {
    agreement.field("operation number", static_cast<std::int64_t>(sequence_));
  }
  void run(const std::vector<std::span<const std::byte>>&, const std::function<void()>&) override {}

  std::uint64_t sequence_;
};

}  // namespace

void Engine::simple_collective(const char* operation) {
  check_usable(operation);
  run_sync(std::make_shared<NamedCollective>(facts, operation, next_sequence()));
}

void Engine::make_tolerant(std::size_t block_capacity) {
  tolerant_ = std::make_unique<comm::TolerantGather>(*transport_, block_capacity,
                                                      facts.wait("construction: tolerant exchange"));
}

bool Engine::leave_tolerant() {
  const bool clear = tolerant_->leave(facts.config.timeout_secs);
  if (!clear)
    core::warn(core::Subsys::kAlloc, "{} #{} on rank {}: not every rank left within {} s; its memory stays mapped",
               facts.config.name, facts.id, facts.rank, facts.config.timeout_secs);
  return clear;
}

void Engine::destroy() {
  if (tolerant_) {
    // Shrink mode: no collective (a failed rank cannot take part); leave the tolerant exchange.
    check_usable("destroy");
    comm_worker_.drain();
    if (!leave_tolerant()) comm::retire(std::move(memory_));
    memory_.reset();
    std::lock_guard lock(state_mutex_);
    destroyed_ = true;
    return;
  }
  simple_collective("destroy");
  memory_.reset();
  std::lock_guard lock(state_mutex_);
  destroyed_ = true;
}

int Engine::ranks_on_host() const { return std::max(1, transport_->ranks_on_host()); }

int Engine::cores_per_rank() const { return std::max(1, core::available_cores() / ranks_on_host()); }

void Engine::limit_inflight(int num_qps) {
  transport_->set_inflight_limit(num_qps > 0 ? num_qps : std::max(facts.config.num_allocated_qps, 1));
}

void Engine::wait_for_event(const std::optional<Event>& event, const std::string& ctx, const char* argument) const {
  if (event && !event->wait_for(facts.config.timeout_secs))
    throw TimeoutError(fmt::format("{}: {} did not complete within {} s", ctx, argument, facts.config.timeout_secs), {});
}

int theoretical_num_workers(const Engine& engine, int num_experts, int num_topk, int num_scaleout_topk,
                            double rdma_gbs, double nvlink_gbs, double sm_read_gbs, double sm_write_gbs) {
  const std::string ctx = engine.facts.context("get_theoretical_num_sms");
  const int R = engine.facts.num_ranks, SO = engine.facts.logical_scaleout, SU = engine.facts.logical_scaleup;
  if (num_scaleout_topk != 0) throw InvalidArgument(fmt::format("{}: num_scaleout_topk must be 0", ctx));
  if (num_experts <= 0 || num_experts % R != 0)
    throw InvalidArgument(
        fmt::format("{}: num_experts = {} must be a positive multiple of the {} ranks", ctx, num_experts, R));
  if (num_topk < 1 || num_topk > kMaxTopk || num_topk > num_experts)
    throw InvalidArgument(fmt::format("{}: num_topk = {} is outside [1, min({}, num_experts = {})]", ctx, num_topk,
                                      kMaxTopk, num_experts));
  // Cores this rank may use: the host's cores shared by the ranks running on it.
  const auto& bw = core::machine_bandwidth();
  const int cap = engine.cores_per_rank();
  const int NVL = engine.facts.physical.num_scaleup, RDMA = engine.facts.physical.num_scaleout;
  // Scale-up and scale-out links are memory here: each rank's share of the host's copy bandwidth.
  const double share = bw.all_cores_gbs / engine.ranks_on_host();
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
  int result =
      static_cast<int>(core::round_up(std::max<std::int64_t>(4, static_cast<std::int64_t>(std::ceil(1.25 * sms))), 2));
  if (!engine.facts.config.prefer_overlap_with_compute) result = std::max(result, 64);
  return std::min(result, cap);
}

const HandleState& checked_handle(const Engine& engine, const std::string& ctx, const EPHandle& h) {
  core::v2::check_handle(ctx, h, h.state ? &h.state->facts : nullptr, h.state ? h.state->engine_id : 0, engine.facts.id);
  return *h.state;
}

std::size_t view_extent(const TensorView& view) {
  // Exact for any view (its byte range fits in int64, checked when it was made).
  return static_cast<std::size_t>(view.byte_range().end);
}

PeerTensors share_tensors(Engine& engine, const PeerTensors& mine, const TensorExtents& extents) {
  const comm::Transport::Span spans[] = {
      {mine.x, mine.x ? extents.x : 0},
      {mine.scales, mine.scales ? extents.scales : 0},
      {mine.weights, mine.weights ? extents.weights : 0},
      {mine.topk, mine.topk ? extents.topk : 0},
      {mine.row_weights, mine.row_weights ? extents.row_weights : 0},
      {mine.listed, mine.listed ? extents.listed : 0},
  };
  const auto published = engine.transport().share(spans);
  PeerTensors p = mine;
  p.x = static_cast<const std::byte*>(published[0]);
  p.scales = static_cast<const std::byte*>(published[1]);
  p.weights = static_cast<const float*>(published[2]);
  p.topk = static_cast<const std::int64_t*>(published[3]);
  p.row_weights = static_cast<const float*>(published[4]);
  p.listed = static_cast<const routing::ListedToken*>(published[5]);
  return p;
}

void resolve_tensors(Engine& engine, std::vector<PeerTensors>& peers, const PeerTensors& mine) {
  auto& t = engine.transport();
  for (int r = 0; r < static_cast<int>(peers.size()); ++r) {
    PeerTensors& p = peers[static_cast<size_t>(r)];
    if (r == engine.facts.rank) {
      p = mine;
    } else if (engine.facts.same_node(r)) {
      p.x = static_cast<const std::byte*>(t.node_address(r, p.x));
      p.scales = static_cast<const std::byte*>(t.node_address(r, p.scales));
      p.weights = static_cast<const float*>(t.node_address(r, p.weights));
      p.topk = static_cast<const std::int64_t*>(t.node_address(r, p.topk));
      p.row_weights = static_cast<const float*>(t.node_address(r, p.row_weights));
      p.listed = static_cast<const routing::ListedToken*>(t.node_address(r, p.listed));
    }
  }
}

}  // namespace moe_ep::engine
