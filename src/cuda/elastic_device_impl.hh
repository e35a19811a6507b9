// ElasticDevice<Exec>'s member functions (included by elastic_device.hh; see there).
#pragma once

#include "core/arith.hh"
#include "cuda/elastic_device.hh"
#include "moe_ep/limits.hpp"

namespace moe_ep::cuda {

namespace detail {

inline std::atomic<std::uint64_t> next_buffer_id{1};

struct ConfigBlock {
  std::uint64_t process[2];     // this process (process_token): pids repeat across pid namespaces
  std::int64_t device;
  std::int64_t direct_allowed;  // the executor may publish tensors as they are to ranks of its process
  std::int64_t queues;          // the device's hardware queues in this process (0: no limit)
};

// A random identity of this process, drawn once: two ranks are in one process exactly when their
// tokens agree (a pid does not say so across pid namespaces or hosts).
inline const std::uint64_t* process_token() {
  static const std::array<std::uint64_t, 2> token = [] {
    std::random_device rd;
    std::array<std::uint64_t, 2> t{};
    for (auto& w : t) w = (std::uint64_t{rd()} << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
    return t;
  }();
  return token.data();
}

// The hardware queues the executor's device offers this process, 0 when it has no such limit.
template <class Exec>
std::int64_t hardware_queues() {
  if constexpr (requires { Exec::hardware_queues(); }) {
    return Exec::hardware_queues();
  } else {
    return 0;
  }
}

// Every rank's barriers spin on its communication stream while it waits for its caller's stream:
// two streams per rank must not share a hardware queue, or a spinning kernel can hold back work a
// peer waits for. The same verdict on every rank (it reads every rank's block).
inline std::string queue_shortage(const std::vector<ConfigBlock>& blocks) {
  for (const ConfigBlock& b : blocks) {
    if (b.queues <= 0) continue;
    int sharing = 0;
    for (const ConfigBlock& o : blocks)
      sharing += o.device == b.device && o.process[0] == b.process[0] && o.process[1] == b.process[1];
    if (2 * sharing <= b.queues) continue;
    const std::string remedy =
        2 * sharing <= 32 ? fmt::format("set CUDA_DEVICE_MAX_CONNECTIONS={} or more before the process's first CUDA "
                                        "call, or use fewer ranks per device", 2 * sharing)
                          : std::string("use at most 16 ranks of one process per device (CUDA gives at most 32 queues)");
    return fmt::format("{} ranks of one process share cuda:{}, and each needs two hardware queues (its communication "
                       "stream and its caller's stream) while its barriers spin: CUDA_DEVICE_MAX_CONNECTIONS = {} "
                       "allows {}; {}",
                       sharing, b.device, b.queues, b.queues / 2, remedy);
  }
  return {};
}

struct MemoryBlock {
  std::uint64_t address;
  char ipc[64];
};

}  // namespace detail

template <Executor Exec>
ElasticDevice<Exec>::ElasticDevice(Group& group, const ElasticBufferConfig& config, int device)
    : group_(group), config_(config), rank_(group.rank()), R_(group.size()) {
  const std::string ctx = context("ElasticBuffer (cuda provider)");
  comm::Transport& transport = group.transport();
  std::exception_ptr local;
  try {
    elastic::check_config(ctx, config);  // V2's rules, as the built-in provider
    timeout_ = config.num_cpu_timeout_secs;
    // This provider's own limits: no Engram storage, one host, its ranks and its lists' size.
    if (config.num_cpu_bytes != 0)
      core::fail(ctx, "num_cpu_bytes = {}: the cuda provider has no Engram storage (the built-in provider has it, on "
                 "host tensors)", config.num_cpu_bytes);
    if (R_ > kMaxCudaRanks)
      core::fail(ctx, "the group has {} ranks; the cuda provider serves at most {} ranks on one host", R_, kMaxCudaRanks);
    if (group.num_scaleout() != 1)
      core::fail(ctx, "the group spans {} nodes; the cuda provider needs every rank on one node (use the built-in "
                 "provider across nodes)", group.num_scaleout());
    if (transport.ranks_on_host() != R_)
      core::fail(ctx, "{} of the group's {} ranks run on this host; the cuda provider needs all of them here",
                 transport.ranks_on_host(), R_);
    if (config.num_max_tokens_per_rank < 1 || config.num_max_tokens_per_rank > kMaxCudaTokensPerRank)
      core::fail(ctx, "num_max_tokens_per_rank = {} is outside [1, {}] (the cuda provider sizes its lists for it)",
                 config.num_max_tokens_per_rank, kMaxCudaTokensPerRank);
    exec_ = std::make_unique<Exec>(device);  // a device that cannot be used fails here, before the agreement
  } catch (const Error&) {
    local = std::current_exception();
  }
  detail::ConfigBlock mine{{detail::process_token()[0], detail::process_token()[1]}, device,
                           exec_ && exec_->direct_allowed() ? 1 : 0, detail::hardware_queues<Exec>()};
  comm::Agreement agreement(ctx, "ElasticBuffer");
  elastic::agree_config(agreement, config).local_error(local);
  const auto blocks = agreement.exchange(transport, comm::Scope::kWorld, wait("ElasticBuffer: agreement"),
                                         {reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  std::vector<detail::ConfigBlock> all(static_cast<size_t>(R_));
  for (int r = 0; r < R_; ++r) {
    detail::ConfigBlock& b = all[static_cast<size_t>(r)];
    std::memcpy(&b, blocks[static_cast<size_t>(r)].data(), sizeof b);
    const bool same_process = b.process[0] == mine.process[0] && b.process[1] == mine.process[1];
    direct_ = direct_ && same_process && b.direct_allowed != 0;
    other_devices_ = other_devices_ || (same_process && b.device != device);
  }
  if (const std::string shortage = detail::queue_shortage(all); !shortage.empty())
    throw ResourceError(fmt::format("{}: {}", ctx, shortage));
  channel_ = transport.duplicate(wait("ElasticBuffer: channel"));
  layout_ = sym_layout(R_, config.num_max_tokens_per_rank);
  bytes_ = config.num_bytes > 0 ? config.num_bytes : default_bytes();
  if (bytes_ < layout_.end)
    throw CapacityError(fmt::format("{}: num_bytes = {} is below the {} bytes of counts, lists and signals for {} ranks "
                                    "of {} tokens", ctx, bytes_, layout_.end, R_, config.num_max_tokens_per_rank),
                        core::round_up<std::int64_t>(layout_.end, kBufferAlignment), bytes_);
  map_peers();
  id_ = detail::next_buffer_id.fetch_add(1);
  channel_->barrier(comm::Scope::kWorld, wait("ElasticBuffer: ready"));
}

template <Executor Exec>
std::int64_t ElasticDevice<Exec>::default_bytes() const {
  std::int64_t stage = 0;
  if (!direct_) {
    const std::int64_t T = config_.num_max_tokens_per_rank;
    const std::int64_t H = config_.hidden > 0 ? config_.hidden : 7168, k = config_.num_topk > 0 ? config_.num_topk : kMaxTopk;
    const std::int64_t dispatch = T * (k * 12 + H * 4 + (H / 128 + 1) * 4);
    const std::int64_t combine = T * R_ * (H * 2 + k * 8);
    stage = std::max(dispatch, combine) + 4096;
  }
  return core::round_up<std::int64_t>(layout_.end + stage, kBufferAlignment);
}

template <Executor Exec>
void ElasticDevice<Exec>::map_peers() {
  sym_ = exec_->alloc_symmetric(static_cast<std::size_t>(bytes_));
  exec_->zero(sym_.get(), static_cast<std::size_t>(bytes_));
  exec_->synchronize();
  detail::MemoryBlock block{reinterpret_cast<std::uint64_t>(sym_.get()), {}};
  if (!direct_) exec_->ipc_handle(sym_.get(), block.ipc);
  const comm::Gathered g = channel_->all_gather({reinterpret_cast<const std::byte*>(&block), sizeof block},
                                                comm::Scope::kWorld, wait("ElasticBuffer: exchange of memory"));
  for (int r = 0; r < R_; ++r) {
    detail::MemoryBlock b;
    std::memcpy(&b, g[r].data(), sizeof b);
    if (r == rank_) {
      peers_.base[r] = static_cast<std::byte*>(sym_.get());
    } else if (direct_) {
      exec_->enable_peer_access_to(reinterpret_cast<void*>(b.address));
      peers_.base[r] = reinterpret_cast<std::byte*>(b.address);
    } else {
      mapped_.push_back(exec_->open_ipc(b.ipc));
      peers_.base[r] = static_cast<std::byte*>(mapped_.back().get());
    }
  }
}

template <Executor Exec>
ElasticDevice<Exec>::~ElasticDevice() {
  if (exec_) {
    try {
      exec_->synchronize();
    } catch (...) {
    }
  }
  // Without the collective destroy() (or after a failure) peers may still signal into this
  // rank's region or read it: it stays allocated, and mapped, until the process ends.
  if (!destroyed_ && sym_) {
    static std::mutex mu;
    static std::vector<std::shared_ptr<void>>* kept = new std::vector<std::shared_ptr<void>>;
    const std::lock_guard<std::mutex> lock(mu);
    kept->push_back(sym_);
    for (auto& m : mapped_) kept->push_back(m);
  }
}

// Collective: once every rank's device work finished (each synchronizes before the barrier), no
// peer touches this region again and it can be freed. After a failure it is kept (~ElasticDevice).
template <Executor Exec>
void ElasticDevice<Exec>::destroy() {
  if (destroyed_) return;
  exec_->synchronize();
  if (failed_) return;
  channel_->barrier(comm::Scope::kWorld, wait("ElasticBuffer: destroy"));
  mapped_.clear();
  sym_.reset();
  destroyed_ = true;
}

template <Executor Exec>
void ElasticDevice<Exec>::check_usable(const char* op) const {
  if (destroyed_) throw StateError(fmt::format("{}: the buffer was destroyed", context(op)));
  if (failed_)
    throw StateError(fmt::format("{}: the buffer is unusable after an earlier failure: {}", context(op), failure_));
}

template <Executor Exec>
void ElasticDevice<Exec>::check_peer_readable(const std::string& ctx, const char* name, const TensorView& t) const {
  if constexpr (requires { Exec::peer_readable(t.data()); }) {
    if (direct_ && other_devices_ && t.defined() && !Exec::peer_readable(t.data()))
      core::fail(ctx, "{} ({}) is not cudaMalloc memory (torch's expandable_segments or its cudaMallocAsync backend), "
                 "and ranks of this process on other devices read it in place; set PYTORCH_CUDA_ALLOC_CONF="
                 "expandable_segments:False (and no cudaMallocAsync backend), or run one rank per process",
                 name, t.describe());
  }
}

template <Executor Exec>
std::uint64_t ElasticDevice<Exec>::publish_address(const void* p) const {
  if (p == nullptr) return 0;
  if (direct_) return reinterpret_cast<std::uint64_t>(p);
  return static_cast<std::uint64_t>(static_cast<const std::byte*>(p) - peers_.base[rank_]);  // an offset in my region
}

template <Executor Exec>
DevicePeerTensors ElasticDevice<Exec>::resolve(const std::vector<std::span<const std::byte>>& payloads) const {
  DevicePeerTensors t{};
  for (int r = 0; r < R_; ++r) {
    Published p;
    std::memcpy(&p, payloads[static_cast<size_t>(r)].data(), sizeof p);
    auto at = [&](std::uint64_t v) -> const std::byte* {
      if (v == 0) return nullptr;
      return direct_ ? reinterpret_cast<const std::byte*>(v) : peers_.base[r] + v;
    };
    t.x[r] = at(p.x);
    t.scales[r] = reinterpret_cast<const std::uint32_t*>(at(p.scales));
    t.weights[r] = reinterpret_cast<const float*>(at(p.weights));
    t.topk[r] = reinterpret_cast<const std::int64_t*>(at(p.topk));
    t.lanes[r] = reinterpret_cast<const std::int32_t*>(at(p.lanes));
    t.x_row[r] = p.x_row;
    t.scale_stride0[r] = p.scale_stride0;
    t.scale_stride1[r] = p.scale_stride1;
    t.weights_row[r] = p.weights_row;
    t.topk_row[r] = p.topk_row;
  }
  return t;
}

template <Executor Exec>
std::int64_t ElasticDevice<Exec>::staging_bytes(std::int64_t need, const char* op) const {
  if (direct_) return 0;
  const std::int64_t have = bytes_ - layout_.stage;
  if (need > have) {
    const std::int64_t required = core::round_up<std::int64_t>(layout_.stage + need, kBufferAlignment);
    throw CapacityError(fmt::format("{}: the call stages {} bytes for its peers, the buffer has {} (num_bytes = {}); "
                                    "pass num_bytes = {}", context(op), need, have, bytes_, required),
                        required, bytes_);
  }
  return need;
}

template <Executor Exec>
void ElasticDevice<Exec>::barrier(int step) {
  const std::uint64_t limit = timeout_ >= core::kNeverSecs ? ~std::uint64_t{0} : static_cast<std::uint64_t>(timeout_ * 1e9);
  signal_and_wait(*exec_, peers_, rank_, R_, layout_.signals, ++barriers_, status() + 1, limit, step);
}

// What an error word says, for messages (timeout_secs: the timeout a barrier waited for).
inline std::string describe_error(std::uint64_t word, double timeout_secs) {
  const UnpackedError e = unpack_error(word);
  switch (e.code) {
    case ErrorCode::kExpertOutOfRange:
      return fmt::format("topk_idx[{}, {}] = {} is outside [-1, num_experts)", e.a, e.b, e.value);
    case ErrorCode::kDuplicateExpert:
      return fmt::format("topk_idx[{}, {}] = {} names an expert the row already names", e.a, e.b, e.value);
    case ErrorCode::kTimeout:
      return fmt::format("rank {} did not arrive at barrier {} of the call within {} s (num_cpu_timeout_secs)", e.a, e.b,
                         timeout_secs);
    case ErrorCode::kPeerRejected:
      return fmt::format("rank {} passed bad top-k ids", e.a);
    case ErrorCode::kPeerLeft:
      return fmt::format("rank {} failed after the call's agreement and left the buffer (barrier {})", e.a, e.b);
    default:
      return fmt::format("device error word {:#x}", word);
  }
}

template <Executor Exec>
std::exception_ptr ElasticDevice<Exec>::take_device_error(const char* op) {
  const std::uint64_t word = exec_->take_mirrored_error();
  if (word == 0) return nullptr;
  clear_error(*exec_, status());
  return error_from(word, op);
}

template <Executor Exec>
std::exception_ptr ElasticDevice<Exec>::error_from(std::uint64_t word, const char* op) {
  const UnpackedError e = unpack_error(word);
  const std::string what = describe_error(word, timeout_);
  if (e.code == ErrorCode::kTimeout) {
    failed_ = true;
    failure_ = what;
    return std::make_exception_ptr(TimeoutError(fmt::format("{}: {}", context(op), what), {static_cast<int>(e.a)}));
  }
  if (e.code == ErrorCode::kPeerLeft) {
    failed_ = true;
    failure_ = what;
    return std::make_exception_ptr(PeerError(fmt::format("{}: {}", context(op), what), {static_cast<int>(e.a)}));
  }
  if (e.code == ErrorCode::kPeerRejected)
    return std::make_exception_ptr(PeerError(fmt::format("{}: {} (found on the device)", context(op), what),
                                             {static_cast<int>(e.a)}));
  return std::make_exception_ptr(InvalidArgument(fmt::format("{}: {} (found on the device)", context(op), what)));
}

template <Executor Exec>
template <class F>
auto ElasticDevice<Exec>::after_agreement(const char* op, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const InvalidArgument&) {  // bad ids every rank saw (error_from)
    throw;
  } catch (const PeerError& e) {  // a timeout or a peer that left (error_from marked the buffer): leave too
    if (failed_) leave(e.what(), e.ranks().empty() ? rank_ : e.ranks().front());
    throw;
  } catch (const Error& e) {
    leave(e.what(), rank_);
    throw;
  } catch (const std::exception& e) {
    leave(e.what(), rank_);
    throw ResourceError(fmt::format("{}: {}", context(op), e.what()));
  }
}

template <Executor Exec>
void ElasticDevice<Exec>::leave(const std::string& reason, int culprit) noexcept {
  failed_ = true;
  failure_ = reason;
  try {
    signal_left(*exec_, peers_, rank_, R_, layout_.signals, culprit);
    exec_->end_op();
  } catch (...) {  // the device may be what failed: the peers then time out, naming this rank
  }
  channel_->abandon(reason, culprit == rank_ ? std::vector<int>{} : std::vector<int>{culprit});
  wait_for_readers();
}

// seen[p] = the signal rank p last wrote into this rank's region.
template <class Exec>
void copy_signals(Exec& exec, const Peers& peers, int me, int R, std::int64_t signals_off, std::uint64_t* seen) {
  const Peers p = peers;
  exec.each(R, [=] MOE_EP_DEVICE_LAMBDA(std::int64_t peer) {
    seen[peer] = load_acquire(reinterpret_cast<std::uint64_t*>(p.base[me] + signals_off) + peer);
  });
}

// Ranks as threads read this rank's tensors in place between the call's two barriers: after a
// failure, the call returns only once no peer can still read them (its caller may free them).
// Each peer has signalled the call's last barrier (its reads are done), has left (its reads, queued
// before, are done), or has not reached the first barrier (it will find this rank's left signal
// there and move nothing). Bounded by the timeout. Ranks as processes read this rank's staging
// region, which a failed buffer keeps (~ElasticDevice).
template <Executor Exec>
void ElasticDevice<Exec>::wait_for_readers() noexcept {
  if (!direct_ || call_first_barrier_ == 0 || barriers_ < call_first_barrier_) return;
  const std::uint64_t first = call_first_barrier_, last = call_first_barrier_ + 1;
  try {
    auto* const seen = static_cast<std::uint64_t*>(exec_->temp(static_cast<std::size_t>(R_) * 8));
    std::vector<std::uint64_t> host(static_cast<size_t>(R_));
    comm::Backoff backoff(timeout_);
    for (;;) {
      copy_signals(*exec_, peers_, rank_, R_, layout_.signals, seen);
      exec_->copy_to_host(host.data(), seen, host.size() * 8);
      bool reading = false;
      for (int p = 0; p < R_; ++p)
        reading = reading || (p != rank_ && host[static_cast<size_t>(p)] >= first && host[static_cast<size_t>(p)] < last);
      if (!reading || !backoff.pause()) break;
    }
    exec_->end_op();
  } catch (...) {  // the device may be what failed
  }
}

template <Executor Exec>
void ElasticDevice<Exec>::finish(std::uintptr_t stream, bool async, Event& event, const char* op) {
  barrier(1);  // every peer is done reading this rank's memory
  exec_->mirror_error(status() + 1);
  exec_->end_op();
  if (!async) {
    exec_->before_caller(stream);
    // A synchronous call fails in the call: it waits for its work on the host and raises what the
    // device recorded (a timeout, a peer that left, bad ids), unless the caller's stream is being
    // captured into a graph, where no host wait is allowed (the next call raises it then).
    bool capturing = false;
    if constexpr (requires { exec_->capturing(stream); }) capturing = exec_->capturing(stream);
    if (!capturing) {
      exec_->synchronize();
      if (std::exception_ptr e = take_device_error(op)) std::rethrow_exception(e);
    }
    return;
  }
  // Completes when the work finished; fails with the device's error if it recorded one (which
  // the next call on the buffer raises as well, on every rank alike).
  Event pending = Event::pending();
  event = pending;
  const std::uint64_t* word = exec_->mirrored_error();
  const std::string where = context(op);
  const double timeout = timeout_;
  exec_->then([pending, word, where, timeout] {
    const std::uint64_t w = std::atomic_ref<std::uint64_t>(*const_cast<std::uint64_t*>(word)).load();
    if (w == 0) {
      pending.complete();
    } else {
      pending.fail(std::make_exception_ptr(Error(fmt::format("{}: {} (found on the device; the next call on the buffer "
                                                             "raises it)", where, describe_error(w, timeout)))));
    }
  });
}

}  // namespace moe_ep::cuda

#include "cuda/elastic_dispatch.hh"
#include "cuda/elastic_combine.hh"
