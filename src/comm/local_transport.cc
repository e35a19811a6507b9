// In-process transport: ranks are threads of one process.
//
// The medium of the shared protocols (gather_protocol.hh, peer_reads.hh): the channel's state
// holds, per rank, the epoch and the two parity slots of each scope (plain vectors), the
// completed-collectives and open-section counts, the signal counters and whether it abandoned the
// channel (with why); every counter sits on its own cache line. A rank that returned or threw out
// of its rank function has left the group (WorldState::departures).
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "comm/gather_protocol.hh"
#include "comm/peer_reads.hh"
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

class LocalTransport final : public Transport, private EpochSlots {
 public:
  LocalTransport(int rank, std::shared_ptr<WorldState> world, std::uint64_t channel_id,
                 std::shared_ptr<ChannelState> channel)
      : Transport(rank, world->size, world->topology),
        world_(std::move(world)),
        channel_id_(channel_id),
        channel_(std::move(channel)),
        gather_(*this, *this),
        peer_reads_(*this, channel_->reading[rank].value) {}

  int ranks_on_host() const override { return size(); }
  bool ranks_share_address_space() const override { return true; }

  std::unique_ptr<Transport> duplicate(const Wait& wait) override {
    std::uint64_t id = 0;
    auto channel = world_->channel(channel_id_, ++duplicates_, &id);
    auto dup = std::make_unique<LocalTransport>(rank(), world_, id, std::move(channel));
    barrier(Scope::kWorld, wait);  // every rank holds the new channel before anyone uses it
    return dup;
  }

  Gathered all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait) override {
    check_in_step(wait);
    return gather_.all_gather(mine, scope, wait);
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
    std::vector<int> failed;
    std::vector<std::uint64_t> sizes;
    bool mismatched = false;
    for (int r = 0; r < size(); ++r) {
      const auto& theirs = all.as<Published>(r);
      bases[static_cast<size_t>(r)] = theirs.base;
      if (theirs.base == nullptr) failed.push_back(r);
      sizes.push_back(theirs.bytes);
      mismatched = mismatched || theirs.bytes != bytes;
    }
    if ((!failed.empty() || mismatched) && mine.base) munmap(mine.base, bytes);
    check_allocation_agreed(bytes, failed, sizes);
    return std::make_unique<LocalSymmetricMemory>(*this, mine.base, bytes, std::move(bases));
  }

  const void* node_address(int rank, const void* published) const override {
    check_same_node(rank);
    return published;
  }

  void put(int peer, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes) override {
    check_put_range(memory, offset, bytes);
    auto& local = static_cast<LocalSymmetricMemory&>(memory);
    std::memcpy(local.any_peer(peer) + offset, src, bytes);
    world_->scaleout_bytes[rank()].value.fetch_add(bytes, std::memory_order_relaxed);
  }

  void put_formed(int peer, SymmetricMemory& memory, std::size_t offset, std::size_t bytes,
                  const std::function<void(std::byte*)>& form) override {
    check_put_range(memory, offset, bytes);
    form(static_cast<LocalSymmetricMemory&>(memory).any_peer(peer) + offset);
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
      wait_for_arrivals(
          *this, static_cast<int>(peers.size()), [&](int i) { return peers[static_cast<size_t>(i)]; },
          [&](int i) {
            return channel_->signals[rank() * size() + peers[static_cast<size_t>(i)]].value.load(
                       std::memory_order_acquire) >= targets[static_cast<size_t>(i)];
          },
          [&](int r, unsigned) { return gone(r); }, wait);
    });
  }

  std::vector<int> wait_signals_tolerant(std::span<const int> peers, std::span<const std::uint64_t> targets,
                                         const Wait& wait) override {
    check_in_step(wait);
    return wait_for_arrivals_or_departures(
        static_cast<int>(peers.size()), [&](int i) { return peers[static_cast<size_t>(i)]; },
        [&](int i) {
          return channel_->signals[rank() * size() + peers[static_cast<size_t>(i)]].value.load(std::memory_order_acquire) >=
                 targets[static_cast<size_t>(i)];
        },
        [&](int r, unsigned) { return gone(r); }, wait.timeout_secs);
  }

  void abandon(const std::string& reason, const std::vector<int>& culprits) noexcept override {
    // Without memory left even for the reason, the peers time out instead.
    bool left_now = false;
    if (core::capture([&] { left_now = channel_->abandoned.leave(rank(), {reason, culprits}); }) || !left_now) return;
    // A node peer in a section is a thread of this process doing bounded work: wait until it closes.
    peer_reads_.wait_for_readers([&](int r) { return &channel_->reading[r].value; }, core::kNeverSecs,
                                 [](int) { return false; }, [](int) {});
  }

  std::optional<Departure> departure(int peer) const override {
    if (auto why = abandonment(peer)) return why;
    return world_->departures.why(peer);
  }

  void begin_peer_reads(const char* phase) override {
    peer_reads_.open(phase, [&](int r) { return abandonment(r); });
  }

  void end_peer_reads() noexcept override { peer_reads_.close(); }

 private:
  // EpochSlots: the slots are the channel's per-scope vectors, the counters its padded lines.
  void publish(const ScopeMembers& scope, int parity, std::span<const std::byte> block) override {
    slots(scope).slots[static_cast<size_t>(rank() - scope.first)][static_cast<size_t>(parity)].assign(block.begin(),
                                                                                                      block.end());
  }
  void announce(const ScopeMembers& scope, std::uint64_t epoch) override {
    slots(scope).epochs[rank() - scope.first].value.store(epoch, std::memory_order_release);
  }
  std::uint64_t announced(const ScopeMembers& scope, int rank) const override {
    return slots(scope).epochs[rank - scope.first].value.load(std::memory_order_acquire);
  }
  bool left(int rank, unsigned) const override { return gone(rank); }
  std::optional<Departure> abandoned_before(const ScopeMembers& scope, int rank, std::uint64_t epoch) const override {
    auto why = abandonment(rank);
    if (why && completed(rank, scope).load(std::memory_order_acquire) < epoch) return why;
    return std::nullopt;
  }
  Gathered read_blocks(const ScopeMembers& scope, int parity, std::span<const std::byte>) override {
    const ScopeSlots& s = slots(scope);
    std::vector<std::span<const std::byte>> blocks(static_cast<size_t>(scope.count));
    for (int m = 0; m < scope.count; ++m) {
      const auto& slot = s.slots[static_cast<size_t>(m)][static_cast<size_t>(parity)];
      blocks[static_cast<size_t>(m)] = {slot.data(), slot.size()};
    }
    return Gathered(std::move(blocks));
  }
  void complete(const ScopeMembers& scope, std::uint64_t epoch) override {
    completed(rank(), scope).store(epoch, std::memory_order_release);
  }

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

  ScopeSlots& slots(const ScopeMembers& scope) const {
    return scope.index == 0 ? channel_->world : channel_->nodes[static_cast<size_t>(node_of(rank()))];
  }
  std::atomic<std::uint64_t>& completed(int rank, const ScopeMembers& scope) const {
    return channel_->completed[2 * rank + scope.index].value;
  }

  std::shared_ptr<WorldState> world_;
  std::uint64_t channel_id_;
  std::shared_ptr<ChannelState> channel_;
  EpochGather gather_;
  PeerReadSections peer_reads_;
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

}  // namespace comm

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
  auto rank_thread = [&](int r) {
    return core::start_thread("LocalWorld (rank threads)", r, num_ranks_, [&, r] {
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
  };
  for (int r = 0; r < num_ranks_; ++r) {
    const std::exception_ptr not_started = core::capture([&] { threads.push_back(rank_thread(r)); });
    if (!not_started) continue;
    // The ranks that could not start have left: the started ones' waits on them end at once.
    for (int q = r; q < num_ranks_; ++q) world->departures.leave(q, {"its thread could not be started", {}});
    for (auto& t : threads) t.join();
    std::rethrow_exception(not_started);
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
