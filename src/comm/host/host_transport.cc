// The host transport: ranks are processes of one host (include/moe_ep/host.hpp).
//
// Bootstrap: every process publishes one JSON record through the caller's all-gather (its rank,
// pid, host identity = hostname + boot_id, ranks_per_node request, and the descriptors of its
// first channel's memory). After the checks (one host, one ranks_per_node, peers' processes
// visible), everything goes through shared memory; the caller's all-gather is never used again.
//
// Per channel, every rank owns three memfds (no name in any file system), which every other rank
// maps through /proc/<pid>/fd/<fd> (all ranks are on one host):
//  - its control region, mapped read-write by everyone: the ControlPage (comm/control_page.hh:
//    abandoned flag, reason and culprits, open peer-read sections, collectives completed per
//    scope), then the epoch it published per scope, where its two parity slots per scope lie in
//    its data arena, and the signal counters [source] that other ranks raise for it (monotonic);
//  - its data arena (grow-only, mapped read-only by peers): the bytes of its published blocks;
//  - its share arena (SharedSpans): the bytes share() copies for node peers.
// Only the owner writes its region, except the signal counters, which each source increments.
//
// The collectives are the epoch all-gather (comm/gather_protocol.hh) over this medium: the epochs
// and the places of the parity slots are in the control regions, the slots' bytes in the data
// arenas, and a rank copies its peers' blocks out into its own storage, so the Gathered views stay
// valid until its next collective in the scope. Peer-read sections are comm/peer_reads.hh over
// the control pages. put() is a memcpy into the peer's mapping of symmetric memory, signal() a
// release increment of the peer's counter.
//
// Liveness: a peer whose process is gone (kill(pid, 0) fails with ESRCH, or it is a zombie) has
// left the group; one whose control page says it abandoned the channel has left the channel.
// Waits check both and fail at once with PeerError naming it.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "comm/control_page.hh"
#include "comm/gather_protocol.hh"
#include "comm/peer_reads.hh"
#include "comm/shared_arena.hh"
#include "comm/transport.hh"
#include "comm/wait.hh"
#include "core/arith.hh"
#include "core/host_allocator.hh"
#include "core/host_name.hh"
#include "core/log.hh"
#include "core/placement.hh"
#include "core/timeout.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/host.hpp"
#include "comm/host/bootstrap.hh"

namespace moe_ep {
namespace comm::host {
namespace {

struct alignas(64) PaddedCounter {
  std::atomic<std::uint64_t> value;
};

// The transport's part of a control region, after the ControlPage; the signal counters follow.
struct ChannelPage {
  PaddedCounter epochs[2];  // [scope]: the last collective the owner published in
  struct Slot {
    std::uint64_t offset;  // in the owner's data arena
    std::uint64_t bytes;
  };
  alignas(64) Slot slots[2][2];  // [scope][parity]; written before the epoch that publishes them
};
constexpr std::size_t kSignalsAt = core::round_up(sizeof(ChannelPage), 64);
constexpr std::size_t extra_bytes(int size) { return kSignalsAt + static_cast<std::size_t>(size) * sizeof(PaddedCounter); }

// One process's facts, shared by its channels.
struct HostInfo {
  int size = 0;
  Topology topology;
  std::vector<pid_t> pids;  // [rank]
  double timeout_secs = 0;  // group creation's; bounds abandon()'s wait for open sections
  std::atomic<std::uint64_t> scaleout_bytes{0};       // put() bytes, every channel
  std::atomic<std::uint64_t> shared_bytes_copied{0};  // share() bytes copied, every channel
};

// This rank's memory of one channel.
struct OwnChannel {
  explicit OwnChannel(int size) : control(extra_bytes(size)) { data.reserve(1); }  // peers map the arena at once
  ChannelPage& page() const { return *reinterpret_cast<ChannelPage*>(control.extra()); }
  PaddedCounter* signals() const { return reinterpret_cast<PaddedCounter*>(control.extra() + kSignalsAt); }
  ChannelFds fds() const { return {control.fd(), data.fd(), shared.arena_fd()}; }

  ControlRegion control;
  SharedArena data;
  SharedSpans shared;
  std::uint64_t data_end = 0;             // bytes of the data arena given to slots
  std::uint64_t capacity[2][2] = {};      // [scope][parity]: room at the slot's offset
};

// Keeps a channel's memory until the process exits: peers may still map it after this rank failed
// during setup (they then find it abandoned).
void keep_until_exit(std::unique_ptr<OwnChannel> channel) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::unique_ptr<OwnChannel>>();  // reachable until exit
  std::lock_guard lock(mutex);
  kept->push_back(std::move(channel));
}

std::string gone_reason(pid_t pid) { return fmt::format("is gone (its process {} exited or was killed)", pid); }

class HostTransport;

class HostSymmetricMemory final : public SymmetricMemory {
 public:
  HostSymmetricMemory(const HostTransport& owner, int fd, std::size_t bytes, std::size_t mapped,
                      std::vector<std::byte*> bases, int rank)
      : owner_(owner), fd_(fd), bytes_(bytes), mapped_(mapped), bases_(std::move(bases)), rank_(rank) {}
  ~HostSymmetricMemory() override {
    for (std::byte* b : bases_)
      if (b) munmap(b, mapped_);
    close(fd_);
  }

  std::byte* local() override { return bases_[static_cast<size_t>(rank_)]; }
  std::size_t bytes() const override { return bytes_; }
  std::byte* node_peer(int rank) override;
  std::byte* any_peer(int rank) { return bases_[static_cast<size_t>(rank)]; }
  // Every rank maps every segment through its own mapping of the memfd (no collective release).
  bool peers_hold_own_mappings() const override { return true; }

 private:
  const HostTransport& owner_;
  int fd_;
  std::size_t bytes_;
  std::size_t mapped_;
  std::vector<std::byte*> bases_;  // [rank], this rank's own at its index
  int rank_;
};

class HostTransport final : public Transport, private EpochSlots {
 public:
  // Collective over the channel: maps every rank's part (`fds`, by rank), then a barrier on it.
  HostTransport(int rank, std::shared_ptr<HostInfo> info, std::unique_ptr<OwnChannel> own,
                const std::vector<ChannelFds>& fds, const Wait& wait)
      : Transport(rank, info->size, info->topology),
        info_(std::move(info)),
        own_(std::move(own)),
        gather_(*this, *this),
        peer_reads_(*this, own_->control.page().reading) {
    peers_.resize(static_cast<size_t>(size()));
    try {
      for (int r = 0; r < size(); ++r) map_peer(r, fds[static_cast<size_t>(r)], wait);
    } catch (...) {
      own_->control.page().abandon(message_of(std::current_exception()), culprits_of(std::current_exception()));
      keep_until_exit(std::move(own_));
      unmap_peers();
      throw;
    }
    barrier(Scope::kWorld, wait);  // everyone mapped this channel before anyone uses or frees it
  }

  ~HostTransport() override { unmap_peers(); }

  int ranks_on_host() const override { return size(); }

  std::unique_ptr<Transport> duplicate(const Wait& wait) override {
    check_in_step(wait);
    auto own = std::make_unique<OwnChannel>(size());
    const ChannelFds mine = own->fds();
    const Gathered all = all_gather(std::as_bytes(std::span(&mine, 1)), Scope::kWorld, wait);
    std::vector<ChannelFds> fds(static_cast<size_t>(size()));
    for (int r = 0; r < size(); ++r) {
      if (all[r].size() != sizeof(ChannelFds))
        throw StateError(fmt::format("[rank {}] {}: rank {} sent {} bytes for its channel, expected {}", rank(),
                                     wait.phase, r, all[r].size(), sizeof(ChannelFds)));
      std::memcpy(&fds[static_cast<size_t>(r)], all[r].data(), sizeof(ChannelFds));
    }
    return std::make_unique<HostTransport>(rank(), info_, std::move(own), fds, wait);
  }

  Gathered all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait) override {
    check_in_step(wait);
    return gather_.all_gather(mine, scope, wait);
  }

  std::unique_ptr<SymmetricMemory> allocate_symmetric(std::size_t bytes, const Wait& wait, bool prefault) override {
    check_in_step(wait);
    // A memfd is zeroed; MAP_POPULATE faults every page in from the owner (first touch by it).
    const std::size_t mapped = std::max<std::size_t>(bytes, 1);
    const int fd = memfd_create("moe-ep-symmetric", MFD_CLOEXEC);
    void* p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(mapped)) == 0)
      p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | (prefault ? MAP_POPULATE : 0), fd, 0);
    std::vector<std::byte*> bases(static_cast<size_t>(size()), nullptr);
    auto release = [&] {
      for (std::byte* b : bases)
        if (b) munmap(b, mapped);
      if (fd >= 0) close(fd);
    };
    if (p != MAP_FAILED) bases[static_cast<size_t>(rank())] = static_cast<std::byte*>(p);
    struct Published {
      std::int32_t fd;
      std::int32_t ok;
      std::uint64_t bytes;
    } mine{fd, p != MAP_FAILED, bytes};
    try {
      const Gathered all = all_gather(std::as_bytes(std::span(&mine, 1)), Scope::kWorld, wait);
      std::vector<int> failed;
      std::vector<std::uint64_t> sizes;
      for (int r = 0; r < size(); ++r) {
        const auto& theirs = all.as<Published>(r);
        if (!theirs.ok) failed.push_back(r);
        sizes.push_back(theirs.bytes);
      }
      check_allocation_agreed(bytes, failed, sizes);
      // Every rank maps every segment (put() reaches any rank), then says whether it could.
      std::string error;
      for (int r = 0; r < size() && error.empty(); ++r) {
        if (r == rank()) continue;
        void* q = map_peer_region(pid(r), all.as<Published>(r).fd, mapped, true, &error);
        if (q == nullptr) error = fmt::format("the segment of rank {}: {}", r, error);
        bases[static_cast<size_t>(r)] = static_cast<std::byte*>(q);
      }
      const std::int32_t mapped_all = error.empty();
      const Gathered done = all_gather(std::as_bytes(std::span(&mapped_all, 1)), Scope::kWorld, wait);
      if (!error.empty())
        throw StateError(fmt::format("[rank {}] symmetric allocation of {} bytes: cannot map {}", rank(), bytes, error));
      std::vector<int> unmapped;
      for (int r = 0; r < size(); ++r)
        if (!done.as<std::int32_t>(r)) unmapped.push_back(r);
      if (!unmapped.empty())
        throw PeerError(fmt::format("[rank {}] symmetric allocation of {} bytes: ranks [{}] could not map the segments",
                                    rank(), bytes, fmt::join(unmapped, ", ")),
                        unmapped);
    } catch (...) {
      release();
      throw;
    }
    return std::make_unique<HostSymmetricMemory>(*this, fd, bytes, mapped, std::move(bases), rank());
  }

  const void* node_address(int peer_rank, const void* published) const override {
    check_same_node(peer_rank);
    return peer(peer_rank).shared->at(published);
  }

  std::vector<const void*> share(std::span<const Span> spans) override {
    if (node_size() == 1) return std::vector<const void*>(spans.size(), nullptr);  // no node peers to read it
    return own_->shared.share(spans, info_->shared_bytes_copied);
  }

  // Windows: memfd blocks node peers map writable (comm/shared_arena.hh).
  bool offers_windows() const override { return true; }
  std::vector<PublishedSpan> share_window(std::span<const WindowSpan> spans) override {
    return own_->shared.share_window(rank(), spans, info_->shared_bytes_copied);
  }
  std::byte* map_window(int peer_rank, const PublishedSpan& published, std::size_t bytes) const override {
    return peer(peer_rank).shared->window(published, bytes);
  }

  std::uint64_t shared_bytes_copied() const override {
    return info_->shared_bytes_copied.load(std::memory_order_relaxed);
  }

  void put(int peer_rank, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes) override {
    check_put_range(memory, offset, bytes);
    check_rank(peer_rank);
    std::memcpy(static_cast<HostSymmetricMemory&>(memory).any_peer(peer_rank) + offset, src, bytes);
    info_->scaleout_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }

  void put_formed(int peer_rank, SymmetricMemory& memory, std::size_t offset, std::size_t bytes,
                  const std::function<void(std::byte*)>& form) override {
    check_put_range(memory, offset, bytes);
    check_rank(peer_rank);
    form(static_cast<HostSymmetricMemory&>(memory).any_peer(peer_rank) + offset);
    info_->scaleout_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }

  std::uint64_t scaleout_bytes_sent() const override {
    return info_->scaleout_bytes.load(std::memory_order_relaxed);
  }

  void signal(int peer_rank) override {
    check_rank(peer_rank);
    peer(peer_rank).signals[rank()].value.fetch_add(1, std::memory_order_release);
  }

  void wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets, const Wait& wait) override {
    check_in_step(wait);
    const PaddedCounter* mine = own_->signals();
    leave_on_failure([&] {
      wait_for_arrivals(
          *this, static_cast<int>(peers.size()), [&](int i) { return peers[static_cast<size_t>(i)]; },
          [&](int i) {
            return mine[peers[static_cast<size_t>(i)]].value.load(std::memory_order_acquire) >=
                   targets[static_cast<size_t>(i)];
          },
          [&](int r, unsigned poll) { return left(r, poll); }, wait);
    });
  }

  std::vector<int> wait_signals_tolerant(std::span<const int> peers, std::span<const std::uint64_t> targets,
                                         const Wait& wait) override {
    check_in_step(wait);
    const PaddedCounter* mine = own_->signals();
    return wait_for_arrivals_or_departures(
        static_cast<int>(peers.size()), [&](int i) { return peers[static_cast<size_t>(i)]; },
        [&](int i) {
          return mine[peers[static_cast<size_t>(i)]].value.load(std::memory_order_acquire) >= targets[static_cast<size_t>(i)];
        },
        [&](int r, unsigned poll) { return left(r, poll); }, wait.timeout_secs);
  }

  void abandon(const std::string& reason, const std::vector<int>& culprits) noexcept override {
    if (!own_ || !own_->control.page().abandon(reason, culprits)) return;
    // Sections are bounded work; a peer whose process is gone reads nothing any more.
    peer_reads_.wait_for_readers([&](int r) { return control_pages_.open_sections(r); },
                                 std::max(info_->timeout_secs, 1.0), [&](int r) { return process_gone(pid(r)); },
                                 [](int) {});
  }

  std::optional<Departure> departure(int peer_rank) const override {
    if (auto why = control_pages_.abandonment(peer_rank)) return why;
    if (peer_rank != rank() && process_gone(pid(peer_rank))) return Departure{gone_reason(pid(peer_rank)), {}};
    return std::nullopt;
  }

  void begin_peer_reads(const char* phase) override {
    peer_reads_.open(phase, [&](int r) { return control_pages_.abandonment(r); });
  }

  void end_peer_reads() noexcept override { peer_reads_.close(); }

 private:
  // Another rank's part of this channel, mapped here (this rank's own at its index); its control
  // page is in control_pages_.
  struct Peer {
    ChannelPage* page = nullptr;
    PaddedCounter* signals = nullptr;  // the counters it waits on, [source]
    std::unique_ptr<ArenaView> data;   // its published blocks
    std::unique_ptr<PeerSharedViews> shared;  // what it shared (node peers only)
  };

  const Peer& peer(int r) const { return peers_[static_cast<size_t>(r)]; }
  pid_t pid(int r) const { return info_->pids[static_cast<size_t>(r)]; }

  void map_peer(int r, const ChannelFds& fds, const Wait& wait) {
    Peer& p = peers_[static_cast<size_t>(r)];
    if (same_node(r)) p.shared = std::make_unique<PeerSharedViews>(PeerProcess{rank(), r, pid(r)}, fds.shared);
    if (r == rank()) {
      control_pages_.add_own(own_->control.page());
      p.page = &own_->page();
      p.signals = own_->signals();
      return;
    }
    auto fail = [&](const std::string& what) {
      if (process_gone(pid(r)))
        throw PeerError(fmt::format("[rank {}] {}: rank {} left the group instead of arriving; rank {} {}", rank(),
                                    wait.phase, r, r, gone_reason(pid(r))),
                        {r});
      throw StateError(fmt::format("[rank {}] {}: cannot map the channel of rank {}: {}", rank(), wait.phase, r, what));
    };
    std::string error;
    void* q = map_peer_region(pid(r), fds.control, own_->control.bytes(), true, &error);
    if (q == nullptr) fail(error);
    control_pages_.add_mapped(static_cast<const ControlPage*>(q), own_->control.bytes());
    p.page = reinterpret_cast<ChannelPage*>(static_cast<std::byte*>(q) + ControlPage::kBytes);
    p.signals = reinterpret_cast<PaddedCounter*>(static_cast<std::byte*>(q) + ControlPage::kBytes + kSignalsAt);
    p.data = std::make_unique<ArenaView>(PeerProcess{rank(), r, pid(r)}, fds.data);
    try {
      p.data->at(0, 1);  // opened now, while its process is surely there
    } catch (const StateError& e) {
      fail(e.what());
    }
  }

  void unmap_peers() {
    control_pages_.clear();
    for (Peer& p : peers_) p = Peer{};
  }

  // EpochSlots: this rank's block goes into its slot [scope][parity] of the data arena.
  void publish(const ScopeMembers& scope, int parity, std::span<const std::byte> mine) override {
    ChannelPage::Slot& slot = own_->page().slots[scope.index][parity];
    std::uint64_t& capacity = own_->capacity[scope.index][parity];
    if (mine.size() > capacity) {  // a new place at the end; the old one is not reused
      capacity = core::round_up(std::max<std::uint64_t>({mine.size(), 2 * capacity, 64}), 64);
      slot.offset = own_->data_end;
      own_->data_end += capacity;
    }
    std::byte* base = own_->data.reserve(own_->data_end);
    if (!mine.empty()) std::memcpy(base + slot.offset, mine.data(), mine.size());
    slot.bytes = mine.size();
  }

  void announce(const ScopeMembers& scope, std::uint64_t epoch) override {
    own_->page().epochs[scope.index].value.store(epoch, std::memory_order_release);
  }
  std::uint64_t announced(const ScopeMembers& scope, int r) const override {
    return peer(r).page->epochs[scope.index].value.load(std::memory_order_acquire);
  }
  // Its page is a memory read; whether its process is there costs system calls.
  bool left(int r, unsigned poll) const override {
    return control_pages_.has_abandoned(r) || (poll % 256 == 0 && r != rank() && process_gone(pid(r)));
  }
  std::optional<Departure> abandoned_before(const ScopeMembers& scope, int r, std::uint64_t epoch) const override {
    return control_pages_.abandoned_before(r, scope.index, epoch);
  }
  Gathered read_blocks(const ScopeMembers& scope, int parity, std::span<const std::byte> mine) override {
    auto& store = blocks_[scope.index];
    store.resize(static_cast<size_t>(scope.count));
    for (int m = 0; m < scope.count; ++m) {
      const int r = scope.rank(m);
      auto& block = store[static_cast<size_t>(m)];
      if (r == rank()) {
        block.assign(mine.begin(), mine.end());
        continue;
      }
      const ChannelPage::Slot slot = peer(r).page->slots[scope.index][parity];
      block.resize(slot.bytes);
      if (slot.bytes) std::memcpy(block.data(), peer(r).data->at(slot.offset, slot.bytes), slot.bytes);
    }
    return Gathered(store);
  }
  void complete(const ScopeMembers& scope, std::uint64_t epoch) override {
    own_->control.page().completed[scope.index].store(epoch, std::memory_order_release);
  }

  // Collectives after this rank abandoned the channel are refused: the ranks are out of step.
  void check_in_step(const Wait& wait) const {
    const ControlPage& page = own_->control.page();
    if (page.has_abandoned()) fail_left_channel(wait, page.read_reason());
  }

  std::shared_ptr<HostInfo> info_;
  std::unique_ptr<OwnChannel> own_;
  EpochGather gather_;
  PeerReadSections peer_reads_;
  ControlPages control_pages_;  // every rank's, by rank
  std::vector<Peer> peers_;
  std::vector<std::vector<std::byte>> blocks_[2];  // [scope]: the blocks of its last collective
};

std::byte* HostSymmetricMemory::node_peer(int rank) {
  owner_.check_same_node(rank);
  return bases_[static_cast<size_t>(rank)];
}

}  // namespace
}  // namespace comm::host

namespace host {

std::unique_ptr<Group> make_group(int rank, int size, const AllGather& all_gather, const GroupOptions& options) {
  using namespace comm::host;
  check_arguments(rank, size, all_gather);
  core::set_process_rank(rank);
  const double timeout = core::timeout_or_env(fmt::format("[rank {}] host::make_group", rank), options.timeout_secs);
  const comm::Wait wait{"group creation", timeout};
  const int requested = options.ranks_per_node ? *options.ranks_per_node
                                               : static_cast<int>(env::get(env::kRanksPerNode));
  // Tensors this process allocates from now on can be mapped by node peers instead of copied.
  core::share_new_blocks();
  auto own = std::make_unique<OwnChannel>(size);
  const nlohmann::json mine = bootstrap_record(rank, size, requested, own->control.fd(), own->data.fd(),
                                               own->shared.arena_fd());
  const std::vector<std::string> blocks = all_gather(mine.dump());

  try {
    const std::vector<Record> records = parse_records(blocks, rank, size);
    check_one_host(records, rank);
    const int per_node = agreed_ranks_per_node(records, rank, size, requested);
    for (int r = 0; r < size; ++r)
      if (r != rank) check_visible(records[static_cast<size_t>(r)], r, rank);

    auto info = std::make_shared<HostInfo>();
    info->size = size;
    info->topology = Topology{.num_scaleout = size / per_node, .num_scaleup = per_node};
    info->timeout_secs = timeout;
    std::vector<ChannelFds> fds;
    for (const Record& rec : records) {
      info->pids.push_back(rec.pid);
      fds.push_back(rec.fds);
    }
    core::place_rank_thread(size, rank);  // one host: the group's ranks are its host ranks
    core::info(core::Subsys::kInit,
               "group: rank {} of {}, {} logical node(s) x {} ranks per node; transport host shared memory (processes "
               "of host {}, memfd regions)",
               rank, size, info->topology.num_scaleout, info->topology.num_scaleup, core::host_name());
    // Every check above gives every rank the same answer; only mapping can fail on one rank alone,
    // and the transport then abandons its own channel, so its peers learn it at once.
    return std::make_unique<Group>(std::make_shared<HostTransport>(rank, info, std::move(own), fds, wait));
  } catch (...) {
    if (own) {
      own->control.page().abandon(comm::message_of(std::current_exception()), comm::culprits_of(std::current_exception()));
      keep_until_exit(std::move(own));
    }
    throw;
  }
}

}  // namespace host
}  // namespace moe_ep
