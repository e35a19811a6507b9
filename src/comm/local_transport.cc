// In-process transport: ranks are threads of one process.
//
// Collectives publish into per-rank slots and bump a per-rank epoch (release); waiters read the
// epochs (acquire). Slots alternate by epoch parity: a rank can be at most one collective ahead
// of the slowest reader in a scope (it cannot finish collective e+1 before everyone published
// e+1, which each rank does only after reading every block of e), so two slots per rank suffice
// and no trailing barrier is needed. Every counter sits on its own cache line.
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "comm/transport.hh"
#include "comm/wait.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/placement.hh"
#include "core/timeout.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace comm {
namespace {

struct alignas(64) PaddedCounter {
  std::atomic<std::uint64_t> value{0};
};

// Ranks that are gone (from the world: returned from or threw out of their rank function; from a
// channel: abandoned it after a failure), and why. A flag is set once, after its reason.
class Departures {
 public:
  explicit Departures(int size) : flags_(new PaddedCounter[size]), reasons_(static_cast<size_t>(size)) {}

  // Returns false if the rank had already left.
  bool leave(int rank, Departure why) {
    {
      std::lock_guard lock(mutex_);
      if (flags_[rank].value.load(std::memory_order_relaxed) != 0) return false;
      reasons_[static_cast<size_t>(rank)] = std::move(why);
    }
    flags_[rank].value.store(1, std::memory_order_seq_cst);
    return true;
  }
  bool left(int rank) const { return flags_[rank].value.load(std::memory_order_seq_cst) != 0; }
  std::optional<Departure> why(int rank) const {
    if (!left(rank)) return std::nullopt;
    std::lock_guard lock(mutex_);
    return reasons_[static_cast<size_t>(rank)];
  }

 private:
  std::unique_ptr<PaddedCounter[]> flags_;
  mutable std::mutex mutex_;
  std::vector<Departure> reasons_;
};

// Publication slots of the members of one scope (the world, or one node).
struct ScopeSlots {
  explicit ScopeSlots(int members)
      : epochs(new PaddedCounter[members]), slots(static_cast<size_t>(members)) {}
  std::unique_ptr<PaddedCounter[]> epochs;
  std::vector<std::array<std::vector<std::byte>, 2>> slots;
};

struct ChannelState {
  ChannelState(int size, const Topology& topology)
      : world(size),
        signals(new PaddedCounter[size * size]),
        abandoned(size),
        reading(new PaddedCounter[size]),
        completed(new PaddedCounter[2 * size]) {
    for (int n = 0; n < topology.num_scaleout; ++n) nodes.emplace_back(topology.num_scaleup);
  }
  ScopeSlots world;
  std::vector<ScopeSlots> nodes;
  std::unique_ptr<PaddedCounter[]> signals;  // [destination * size + source], monotonic
  Departures abandoned;                      // ranks that abandoned this channel
  std::unique_ptr<PaddedCounter[]> reading;  // [rank]: its open peer-read sections
  // [rank * 2 + scope]: collectives the rank completed in each scope (world, node); a rank that
  // abandoned the channel before completing collective e voids e for everyone.
  std::unique_ptr<PaddedCounter[]> completed;
};

struct WorldState {
  WorldState(int size, Topology topology)
      : size(size), topology(topology), departures(size), scaleout_bytes(new PaddedCounter[size]) {}

  std::shared_ptr<ChannelState> channel(std::uint64_t parent, std::uint64_t index, std::uint64_t* id) {
    std::lock_guard lock(mutex);
    auto& entry = channels[{parent, index}];
    if (!entry.second) entry = {next_id++, std::make_shared<ChannelState>(size, topology)};
    *id = entry.first;
    return entry.second;
  }

  int size;
  Topology topology;
  Departures departures;
  std::unique_ptr<PaddedCounter[]> scaleout_bytes;  // [rank]: bytes put to other ranks
  std::mutex mutex;
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::pair<std::uint64_t, std::shared_ptr<ChannelState>>>
      channels;
  std::uint64_t next_id = 1;
};

class LocalTransport;

class LocalSymmetricMemory final : public SymmetricMemory {
 public:
  LocalSymmetricMemory(const LocalTransport& owner, std::byte* local, std::size_t bytes,
                       std::vector<std::byte*> bases)
      : owner_(owner), local_(local), bytes_(bytes), bases_(std::move(bases)) {}
  ~LocalSymmetricMemory() override { munmap(local_, bytes_); }

  std::byte* local() override { return local_; }
  std::size_t bytes() const override { return bytes_; }
  std::byte* node_peer(int rank) override;
  std::byte* any_peer(int rank) { return bases_[static_cast<size_t>(rank)]; }

 private:
  const LocalTransport& owner_;
  std::byte* local_;
  std::size_t bytes_;
  std::vector<std::byte*> bases_;
};

class LocalTransport final : public Transport {
 public:
  LocalTransport(int rank, std::shared_ptr<WorldState> world, std::uint64_t channel_id,
                 std::shared_ptr<ChannelState> channel)
      : Transport(rank, world->size, world->topology),
        world_(std::move(world)),
        channel_id_(channel_id),
        channel_(std::move(channel)) {}

  int ranks_on_host() const override { return size(); }

  std::unique_ptr<Transport> duplicate(const Wait& wait) override {
    std::uint64_t id = 0;
    auto channel = world_->channel(channel_id_, ++duplicates_, &id);
    auto dup = std::make_unique<LocalTransport>(rank(), world_, id, std::move(channel));
    barrier(Scope::kWorld, wait);  // every rank holds the new channel before anyone uses it
    return dup;
  }

  void barrier(Scope scope, const Wait& wait) override { all_gather({}, scope, wait); }

  Gathered all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait) override {
    check_in_step(wait);
    ScopeSlots& s = slots(scope);
    const int members = scope == Scope::kWorld ? size() : node_size();
    const int me = scope == Scope::kWorld ? rank() : rank() - node_first_rank();
    const int first = scope == Scope::kWorld ? 0 : node_first_rank();
    const int scope_index = scope == Scope::kWorld ? 0 : 1;
    const std::uint64_t epoch = ++epochs_[scope_index];
    const int parity = static_cast<int>(epoch & 1);
    s.slots[static_cast<size_t>(me)][static_cast<size_t>(parity)].assign(mine.begin(), mine.end());
    s.epochs[me].value.store(epoch, std::memory_order_release);

    leave_on_failure([&] {
      Backoff backoff(wait.timeout_secs);
      for (int m = 0; m < members; ++m) {
        while (s.epochs[m].value.load(std::memory_order_acquire) < epoch) {
          if (gone(first + m) || !backoff.pause()) {
            std::vector<int> missing;
            for (int q = 0; q < members; ++q)
              if (s.epochs[q].value.load(std::memory_order_acquire) < epoch) missing.push_back(first + q);
            if (missing.empty()) break;  // everyone arrived after all
            fail_waiting(wait, missing, backoff.elapsed_secs());
          }
        }
      }
      // A member that published and then gave up on the channel before completing this
      // collective (it timed out waiting for another rank) is gone: the collective is void. (One
      // that gave up later completed it; reads of what it published are guarded by PeerReads.)
      std::vector<std::pair<int, Departure>> departed;
      for (int m = 0; m < members; ++m)
        if (auto why = abandonment(first + m);
            why && channel_->completed[2 * (first + m) + scope_index].value.load(std::memory_order_acquire) < epoch)
          departed.emplace_back(first + m, std::move(*why));
      if (!departed.empty()) fail_abandoned(rank(), wait, departed);
    });
    channel_->completed[2 * rank() + scope_index].value.store(epoch, std::memory_order_release);
    std::vector<std::span<const std::byte>> blocks(static_cast<size_t>(members));
    for (int m = 0; m < members; ++m) {
      const auto& slot = s.slots[static_cast<size_t>(m)][static_cast<size_t>(parity)];
      blocks[static_cast<size_t>(m)] = {slot.data(), slot.size()};
    }
    return Gathered(std::move(blocks));
  }

  std::unique_ptr<SymmetricMemory> allocate_symmetric(std::size_t bytes, const Wait& wait, bool prefault) override {
    // MAP_POPULATE faults every page in from this (the owning) thread: first touch by the owner.
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (prefault ? MAP_POPULATE : MAP_NORESERVE), -1, 0);
    struct Published {
      std::byte* base;
      std::size_t bytes;
    } mine{p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p), bytes};
    Gathered all = all_gather(std::as_bytes(std::span(&mine, 1)), Scope::kWorld, wait);
    std::vector<std::byte*> bases(static_cast<size_t>(size()));
    std::vector<int> failed, mismatched;
    for (int r = 0; r < size(); ++r) {
      const auto& theirs = all.as<Published>(r);
      bases[static_cast<size_t>(r)] = theirs.base;
      if (theirs.base == nullptr) failed.push_back(r);
      if (theirs.bytes != bytes) mismatched.push_back(r);
    }
    if (!failed.empty() || !mismatched.empty()) {
      if (mine.base) munmap(mine.base, bytes);
      if (!failed.empty())
        throw PeerError(fmt::format("[rank {}] symmetric allocation of {} bytes failed on ranks [{}]", rank(),
                                    bytes, fmt::join(failed, ", ")),
                        failed);
      throw PeerError(fmt::format("[rank {}] symmetric allocation: ranks [{}] asked for a size other than {} bytes",
                                  rank(), fmt::join(mismatched, ", "), bytes),
                      mismatched);
    }
    return std::make_unique<LocalSymmetricMemory>(*this, mine.base, bytes, std::move(bases));
  }

  const void* node_address(int rank, const void* published) const override {
    check_same_node(rank);
    return published;
  }

  void put(int peer, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes) override {
    if (offset > memory.bytes() || bytes > memory.bytes() - offset)
      throw StateError(fmt::format("[rank {}] put of {} bytes at offset {} exceeds the {}-byte symmetric region",
                                   rank(), bytes, offset, memory.bytes()));
    auto& local = static_cast<LocalSymmetricMemory&>(memory);
    std::memcpy(local.any_peer(peer) + offset, src, bytes);
    world_->scaleout_bytes[rank()].value.fetch_add(bytes, std::memory_order_relaxed);
  }

  std::uint64_t scaleout_bytes_sent() const override {
    return world_->scaleout_bytes[rank()].value.load(std::memory_order_relaxed);
  }

  void signal(int peer) override {
    channel_->signals[peer * size() + rank()].value.fetch_add(1, std::memory_order_release);
  }

  void wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets, const Wait& wait) override {
    check_in_step(wait);
    leave_on_failure([&] {
      Backoff backoff(wait.timeout_secs);
      for (std::size_t i = 0; i < peers.size(); ++i) {
        auto& counter = channel_->signals[rank() * size() + peers[i]].value;
        while (counter.load(std::memory_order_acquire) < targets[i]) {
          if (gone(peers[i]) || !backoff.pause()) {
            std::vector<int> missing;
            for (std::size_t j = 0; j < peers.size(); ++j)
              if (channel_->signals[rank() * size() + peers[j]].value.load(std::memory_order_acquire) < targets[j])
                missing.push_back(peers[j]);
            if (missing.empty()) break;  // every signal arrived after all
            fail_waiting(wait, missing, backoff.elapsed_secs());
          }
        }
      }
    });
  }

  void abandon(const std::string& reason, const std::vector<int>& culprits) noexcept override {
    // Without memory left even for the reason, the peers time out instead.
    bool left_now = false;
    if (core::capture([&] { left_now = channel_->abandoned.leave(rank(), {reason, culprits}); }) || !left_now) return;
    // seq_cst: either a node peer opening a section sees the flag set above, or this loop sees its
    // section open (and waits for it to close).
    const int first = node_first_rank();
    for (int r = first; r < first + node_size(); ++r) {
      if (r == rank()) continue;
      while (channel_->reading[r].value.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
    }
  }

  std::optional<Departure> departure(int peer) const override {
    if (auto why = abandonment(peer)) return why;
    return world_->departures.why(peer);
  }

  void begin_peer_reads(const char* phase) override {
    auto& mine = channel_->reading[rank()].value;
    mine.fetch_add(1, std::memory_order_seq_cst);
    const int first = node_first_rank();
    std::vector<std::pair<int, Departure>> departed;
    for (int r = first; r < first + node_size(); ++r)
      if (r != rank())
        if (auto why = abandonment(r)) departed.emplace_back(r, std::move(*why));
    if (departed.empty()) return;
    mine.fetch_sub(1, std::memory_order_release);
    fail_abandoned(rank(), {phase, 0}, departed);
  }

  void end_peer_reads() noexcept override { channel_->reading[rank()].value.fetch_sub(1, std::memory_order_release); }

 private:
  bool gone(int peer) const { return channel_->abandoned.left(peer) || world_->departures.left(peer); }

  // Collectives after this rank abandoned the channel are refused: the ranks are out of step.
  void check_in_step(const Wait& wait) const {
    if (auto why = channel_->abandoned.why(rank())) fail_left_channel(wait, why->reason);
  }

  std::optional<Departure> abandonment(int peer) const {
    auto why = channel_->abandoned.why(peer);
    if (!why) return std::nullopt;
    return gave_up(why->reason, std::move(why->culprits));
  }

  ScopeSlots& slots(Scope scope) {
    return scope == Scope::kWorld ? channel_->world : channel_->nodes[static_cast<size_t>(node_of(rank()))];
  }

  [[noreturn]] void fail_waiting(const Wait& wait, const std::vector<int>& missing, double elapsed) {
    fail_wait(rank(), wait, missing, elapsed, [&](int r) { return departure(r); });
  }

  std::shared_ptr<WorldState> world_;
  std::uint64_t channel_id_;
  std::shared_ptr<ChannelState> channel_;
  std::uint64_t epochs_[2] = {0, 0};
  std::uint64_t duplicates_ = 0;
};

std::byte* LocalSymmetricMemory::node_peer(int rank) {
  owner_.check_same_node(rank);
  return bases_[static_cast<size_t>(rank)];
}

bool is_reaction_to_peer(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const PeerError&) {
    return true;
  } catch (...) {
    return false;
  }
}

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return fmt::format("threw: {}", ex.what());
  } catch (...) {
    return "threw a non-standard exception";
  }
}

}  // namespace

void retire(std::unique_ptr<SymmetricMemory> memory) {
  if (memory && memory->peers_hold_own_mappings()) return;  // released here; the peers keep theirs
  static std::mutex mutex;
  static auto* retired = new std::vector<std::unique_ptr<SymmetricMemory>>();  // reachable until exit
  std::lock_guard lock(mutex);
  retired->push_back(std::move(memory));
}

namespace {

// The ranks to name for departures: the culprits their failures named (other than this rank), or
// the departed ranks themselves when they failed on their own account (or blamed only this rank).
std::vector<int> root_cause(int rank, const std::vector<std::pair<int, Departure>>& departed) {
  std::vector<int> culprits, ranks;
  for (const auto& [r, why] : departed) {
    ranks.push_back(r);
    for (int c : why.culprits)
      if (c != rank && std::find(culprits.begin(), culprits.end(), c) == culprits.end()) culprits.push_back(c);
  }
  std::sort(culprits.begin(), culprits.end());
  return culprits.empty() ? ranks : culprits;
}

std::string reasons_of(const std::vector<std::pair<int, Departure>>& departed) {
  std::string reasons;
  for (const auto& [r, why] : departed) reasons += fmt::format("; rank {} {}", r, why.reason);
  return reasons;
}

}  // namespace

void fail_wait(int rank, const Wait& wait, const std::vector<int>& missing, double elapsed_secs,
               const std::function<std::optional<Departure>(int)>& departure) {
  std::vector<std::pair<int, Departure>> departed;
  std::vector<int> ranks;
  for (int r : missing)
    if (auto why = departure(r)) {
      ranks.push_back(r);
      departed.emplace_back(r, std::move(*why));
    }
  if (!departed.empty())
    throw PeerError(fmt::format("[rank {}] {}: ranks [{}] left the group instead of arriving{}", rank, wait.phase,
                                fmt::join(ranks, ", "), reasons_of(departed)),
                    root_cause(rank, departed));
  throw TimeoutError(fmt::format("[rank {}] {}: timed out after {:.1f} s (timeout {:g} s) waiting for ranks [{}]", rank,
                                 wait.phase, elapsed_secs, wait.timeout_secs, fmt::join(missing, ", ")),
                     missing);
}

void fail_abandoned(int rank, const Wait& wait, const std::vector<std::pair<int, Departure>>& departed) {
  std::vector<int> ranks;
  for (const auto& [r, why] : departed) ranks.push_back(r);
  throw PeerError(fmt::format("[rank {}] {}: ranks [{}] took part and then left (what they published is gone){}",
                              rank, wait.phase, fmt::join(ranks, ", "), reasons_of(departed)),
                  root_cause(rank, departed));
}

std::vector<int> culprits_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const PeerError& e) {
    return e.ranks();
  } catch (...) {
    return {};
  }
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

Departure gave_up(const std::string& reason, std::vector<int> culprits) {
  return {"gave up on this channel: " + reason, std::move(culprits)};
}

void Transport::fail_left_channel(const Wait& wait, const std::string& reason) const {
  throw StateError(fmt::format("[rank {}] {}: this rank left the channel after a failure ({}); create a new group or "
                               "buffer",
                               rank(), wait.phase, reason));
}

void Transport::check_peer(int peer, const char* phase) const {
  auto why = departure(peer);
  if (!why) return;
  std::vector<std::pair<int, Departure>> departed;
  departed.emplace_back(peer, std::move(*why));
  throw PeerError(fmt::format("[rank {}] {}: rank {} left instead of arriving{}", rank(), phase, peer,
                              reasons_of(departed)),
                  root_cause(rank(), departed));
}

void Transport::check_same_node(int peer) const {
  if (peer < 0 || peer >= size())
    throw StateError(fmt::format("[rank {}] rank {} is outside the group of {} ranks", rank(), peer, size()));
  if (!same_node(peer))
    throw StateError(fmt::format(
        "[rank {}] rank {} is on node {}, not on this rank's node {}: it is reachable only through the "
        "scale-out interface",
        rank(), peer, node_of(peer), node_of(rank())));
}

Topology resolve_topology(int num_ranks, Topology topology) {
  if (num_ranks < 1) throw InvalidArgument(fmt::format("num_ranks is {}, expected at least 1", num_ranks));
  if (topology.num_scaleout < 1)
    throw InvalidArgument(fmt::format("topology num_scaleout is {}, expected at least 1", topology.num_scaleout));
  if (topology.num_scaleup == 0) {
    if (num_ranks % topology.num_scaleout != 0)
      throw InvalidArgument(fmt::format("topology num_scaleout {} does not divide the {} ranks",
                                        topology.num_scaleout, num_ranks));
    topology.num_scaleup = num_ranks / topology.num_scaleout;
  }
  if (topology.num_scaleup < 1 || topology.num_scaleout * topology.num_scaleup != num_ranks)
    throw InvalidArgument(fmt::format("topology {} x {} does not match the {} ranks of the group",
                                      topology.num_scaleout, topology.num_scaleup, num_ranks));
  return topology;
}

}  // namespace comm

Group::Group(std::shared_ptr<comm::Transport> transport) : transport_(std::move(transport)) {}
Group::~Group() = default;
int Group::rank() const { return transport_->rank(); }
int Group::size() const { return transport_->size(); }
int Group::num_scaleout() const { return transport_->topology().num_scaleout; }
int Group::num_scaleup() const { return transport_->topology().num_scaleup; }

void Group::barrier(double timeout_secs) {
  timeout_secs = core::timeout_or_env(fmt::format("[rank {}] Group::barrier", rank()), timeout_secs);
  transport_->barrier(comm::Scope::kWorld, {"Group::barrier", timeout_secs});
}

LocalWorld::LocalWorld(int num_ranks, Topology topology)
    : num_ranks_(num_ranks), topology_(comm::resolve_topology(num_ranks, topology)) {}

LocalWorld::~LocalWorld() = default;

void LocalWorld::run(const std::function<void(Group&)>& fn) {
  auto world = std::make_shared<comm::WorldState>(num_ranks_, topology_);
  std::uint64_t root_id = 0;
  auto root = world->channel(0, 0, &root_id);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks_));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(num_ranks_));
  for (int r = 0; r < num_ranks_; ++r) {
    threads.emplace_back([&, r] {
      core::ScopedThreadRank as_rank(r);
      std::exception_ptr& error = errors[static_cast<size_t>(r)];
      error = core::capture([&] {
        core::place_rank_thread(num_ranks_, r);  // every rank of the world is on this host
        Group group(std::make_shared<comm::LocalTransport>(r, world, root_id, root));
        core::info(core::Subsys::kInit,
                   "group: rank {} of {}, {} logical node(s) x {} ranks per node; transport local (ranks as threads "
                   "of process {})",
                   r, num_ranks_, topology_.num_scaleout, topology_.num_scaleup, getpid());
        fn(group);
        world->departures.leave(r, {"returned from its rank function", {}});
      });
      if (error) world->departures.leave(r, {comm::describe(error), comm::culprits_of(error)});
    });
  }
  for (auto& t : threads) t.join();
  std::exception_ptr first, root_cause;
  for (auto& e : errors) {
    if (!e) continue;
    if (!first) first = e;
    if (!root_cause && !comm::is_reaction_to_peer(e)) root_cause = e;
  }
  if (root_cause) std::rethrow_exception(root_cause);
  if (first) std::rethrow_exception(first);
}

}  // namespace moe_ep
