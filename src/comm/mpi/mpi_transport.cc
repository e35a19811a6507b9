// The MPI transport: ranks are MPI processes (include/moe_ep/mpi.hpp).
//
// Scale-up (ranks of one node): symmetric memory is an MPI_Win_allocate_shared window over the
// node's communicator, every member's segment mapped in every member; shared user tensors are
// copied into the rank's SharedArena, which node peers map. Scale-out: Messenger records and
// counted signals. Collectives are Messenger gathers (a timeout names the missing ranks); MPI's
// own blocking collectives (communicator split, window creation and release) run only after a
// gather showed that every member arrived. The rule that voids a collective and the peer-read
// sections are the shared ones (comm/gather_protocol.hh, comm/peer_reads.hh), over the node
// peers' control pages.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>

#include "comm/control_page.hh"
#include "comm/mpi/census.hh"
#include "comm/gather_protocol.hh"
#include "comm/mpi/messenger.hh"
#include "comm/peer_reads.hh"
#include "comm/shared_arena.hh"
#include "comm/transport.hh"
#include "comm/wait.hh"
#include "core/host_allocator.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/placement.hh"
#include "core/timeout.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/mpi.hpp"

namespace moe_ep {
namespace comm::mpi {
namespace {

constexpr int kTagWorld = 11;
constexpr int kTagNode = 12;

std::atomic<bool> g_abandoned{false};

// Duplicates a communicator without blocking past the timeout (MPI_Comm_idup).
MPI_Comm duplicate_comm(MPI_Comm comm, int rank, const Wait& wait) {
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  {
    std::lock_guard lock(mpi_mutex());
    check_mpi(MPI_Comm_idup(comm, &dup, &request), "MPI_Comm_idup", rank);
  }
  Backoff backoff(wait.timeout_secs);
  for (;;) {
    int done = 0;
    {
      std::lock_guard lock(mpi_mutex());
      check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test (MPI_Comm_idup)", rank);
    }
    if (done) break;
    if (!backoff.pause())
      throw TimeoutError(fmt::format("[rank {}] {}: timed out after {:.1f} s (timeout {:g} s) duplicating the "
                                     "communicator: some rank of it did not make the call",
                                     rank, wait.phase, backoff.elapsed_secs(), wait.timeout_secs),
                         {});
  }
  std::lock_guard lock(mpi_mutex());
  check_mpi(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
  return dup;
}

// A node peer's control page (comm/control_page.hh) mapped here read-only, or null when its
// process cannot be opened.
const ControlPage* map_peer_control(pid_t pid, int fd, int peer, int rank) {
  std::string error;
  void* p = map_peer_region(pid, fd, ControlPage::kBytes, false, &error);
  if (p == nullptr)
    core::warn(core::Subsys::kP2P, "the control page of rank {} cannot be mapped ({}): reads of its memory are unguarded",
               peer, error);
  return static_cast<const ControlPage*>(p);
}

class MpiTransport;

class WindowMemory final : public SymmetricMemory {
 public:
  WindowMemory(MpiTransport& owner, std::uint32_t id, MPI_Win window, std::byte* local, std::size_t bytes,
               std::vector<std::byte*> node_bases, Wait wait)
      : owner_(owner), id_(id), window_(window), local_(local), bytes_(bytes), node_bases_(std::move(node_bases)),
        wait_(wait) {}
  ~WindowMemory() override;

  std::byte* local() override { return local_; }
  std::size_t bytes() const override { return bytes_; }
  std::byte* node_peer(int rank) override;
  std::uint32_t id() const { return id_; }

 private:
  MpiTransport& owner_;
  std::uint32_t id_;
  MPI_Win window_;
  std::byte* local_;
  std::size_t bytes_;
  std::vector<std::byte*> node_bases_;  // by local index
  Wait wait_;
};

class MpiTransport final : public Transport {
 public:
  // Collective over `comm` (already duplicated; owned from now on).
  MpiTransport(MPI_Comm comm, int rank, int size, Topology topology, std::shared_ptr<const HostInfo> hosts,
               const Wait& wait)
      : Transport(rank, size, topology),
        peer_reads_(*this, control_.page().reading),
        control_pages_(node_first_rank()),
        messenger_(comm, rank, size),
        hosts_(std::move(hosts)),
        timeout_(wait.timeout_secs) {
    messenger_.set_host_info(hosts_);
    for (int m = 0; m < node_size(); ++m) node_members_.push_back(node_first_rank() + m);
    for (int r = 0; r < size; ++r) world_members_.push_back(r);
    // Node peers learn where this rank's shared arena and control page are.
    const int fds_mine[2] = {shared_.arena_fd(), control_.fd()};
    const Gathered fds = all_gather(std::as_bytes(std::span(fds_mine)), Scope::kNode, wait);
    for (int m = 0; m < node_size(); ++m) {
      if (fds[m].size() != sizeof fds_mine)
        throw StateError(fmt::format("[rank {}] channel setup: rank {} sent {} bytes", rank, node_first_rank() + m,
                                     fds[m].size()));
      int theirs[2];
      std::memcpy(theirs, fds[m].data(), sizeof theirs);
      const int peer = node_first_rank() + m;
      shared_views_.push_back(std::make_unique<PeerSharedViews>(
          PeerProcess{rank, peer, hosts_->pids[static_cast<size_t>(peer)]}, theirs[0]));
      if (peer == rank)
        control_pages_.add_own(control_.page());
      else
        control_pages_.add_mapped(map_peer_control(hosts_->pids[static_cast<size_t>(peer)], theirs[1], peer, rank),
                                  ControlPage::kBytes);
    }
  }

  ~MpiTransport() override {
    control_pages_.clear();
    shared_views_.clear();
    messenger_.drain(1.0);
    if (g_abandoned.load()) return;
    std::lock_guard lock(mpi_mutex());
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm comm = messenger_.comm();
    if (node_comm_ != MPI_COMM_NULL) MPI_Comm_free(&node_comm_);
    // A channel whose members exchanged notices (a failure, a slow wait) may still have one in
    // flight to this rank: Open MPI would keep it for the next communicator that gets this one's
    // context id and deliver it there. Such a channel keeps its communicator (and its id).
    if (messenger_.quiet()) MPI_Comm_free(&comm);
  }

  int ranks_on_host() const override { return hosts_->host_size; }

  std::unique_ptr<Transport> duplicate(const Wait& wait) override {
    barrier(Scope::kWorld, wait);  // every rank is here: the MPI call below cannot wait for a missing one
    MPI_Comm dup = leave_on_failure([&] { return duplicate_comm(messenger_.comm(), rank(), wait); });
    return std::make_unique<MpiTransport>(dup, rank(), size(), topology(), hosts_, wait);
  }

  // A Messenger gather; a node member that published and then gave up before completing it
  // voids it (check_not_void, over the node's control pages; other nodes' members cannot read
  // this rank's memory).
  Gathered all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait) override {
    check_in_step(wait);
    const ScopeMembers members = this->members(scope);
    const bool world = scope == Scope::kWorld;
    auto& store = world ? world_blocks_ : node_blocks_;
    const std::uint64_t epoch = ++epochs_[members.index];
    leave_on_failure([&] {
      store = messenger_.gather(world ? world_members_ : node_members_, world ? kTagWorld : kTagNode, epoch, mine, wait);
      check_not_void(*this, wait, members, epoch,
                     [&](int r, std::uint64_t e) { return control_pages_.abandoned_before(r, members.index, e); });
    });
    control_.page().completed[members.index].store(epoch, std::memory_order_release);
    return Gathered(store);
  }

  std::unique_ptr<SymmetricMemory> allocate_symmetric(std::size_t bytes, const Wait& wait, bool prefault) override {
    check_in_step(wait);
    const std::uint64_t mine = bytes;
    const Gathered sizes = all_gather(std::as_bytes(std::span(&mine, 1)), Scope::kWorld, wait);
    std::vector<std::uint64_t> held;
    for (int r = 0; r < size(); ++r) held.push_back(sizes.as<std::uint64_t>(r));
    check_allocation_agreed(bytes, {}, held);
    timeout_ = wait.timeout_secs;
    void* base = nullptr;
    MPI_Win window = MPI_WIN_NULL;
    std::vector<std::byte*> bases;
    {
      std::lock_guard lock(mpi_mutex());
      if (node_comm_ == MPI_COMM_NULL)
        check_mpi(MPI_Comm_split(messenger_.comm(), node_of(rank()), rank(), &node_comm_), "MPI_Comm_split", rank());
      MPI_Info info;
      MPI_Info_create(&info);
      MPI_Info_set(info, "alloc_shared_noncontig", "true");
      const int rc = MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, node_comm_, &base, &window);
      MPI_Info_free(&info);
      check_mpi(rc, "MPI_Win_allocate_shared", rank());
      for (int m = 0; m < node_size(); ++m) {
        MPI_Aint peer_bytes = 0;
        int unit = 0;
        void* peer = nullptr;
        check_mpi(MPI_Win_shared_query(window, m, &peer_bytes, &unit, &peer), "MPI_Win_shared_query", rank());
        bases.push_back(static_cast<std::byte*>(peer));
      }
    }
    // First touch by the owner, and the zeroed start every transport guarantees (MPI does not
    // promise zeroed windows): every page becomes resident, whether or not `prefault` asked.
    (void)prefault;
    std::memset(base, 0, bytes);
    const std::uint32_t id = next_memory_++;
    messenger_.register_memory(id, static_cast<std::byte*>(base), bytes);
    auto memory = std::make_unique<WindowMemory>(*this, id, window, static_cast<std::byte*>(base), bytes,
                                                 std::move(bases), wait);
    barrier(Scope::kNode, wait);  // every segment is zeroed before anyone uses the memory
    return memory;
  }

  std::vector<const void*> share(std::span<const Span> spans) override {
    if (node_size() == 1) return std::vector<const void*>(spans.size(), nullptr);  // no node peers to read it
    return shared_.share(spans, hosts_->shared_bytes_copied);
  }

  // Windows: memfd blocks node peers map writable (comm/shared_arena.hh).
  bool offers_windows() const override { return true; }
  std::vector<PublishedSpan> share_window(std::span<const WindowSpan> spans) override {
    return shared_.share_window(rank(), spans, hosts_->shared_bytes_copied);
  }
  std::byte* map_window(int peer_rank, const PublishedSpan& published, std::size_t bytes) const override {
    return shared_views_[static_cast<size_t>(peer_rank - node_first_rank())]->window(published, bytes);
  }

  std::uint64_t shared_bytes_copied() const override {
    return hosts_->shared_bytes_copied.load(std::memory_order_relaxed);
  }

  const void* node_address(int peer, const void* published) const override {
    check_same_node(peer);
    return shared_views_[static_cast<size_t>(peer - node_first_rank())]->at(published);
  }

  void set_inflight_limit(int per_peer) override { messenger_.set_inflight_limit(per_peer, {"scale-out send", timeout_}); }

  void put(int peer, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes) override {
    put_checked(peer, memory, offset, src, bytes, false);
  }
  void put_retained(int peer, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes) override {
    put_checked(peer, memory, offset, src, bytes, true);
  }

  void put_formed(int peer, SymmetricMemory& memory, std::size_t offset, std::size_t bytes,
                  const std::function<void(std::byte*)>& form) override {
    check_put_range(memory, offset, bytes);
    check_rank(peer);
    messenger_.put_formed(peer, static_cast<WindowMemory&>(memory).id(), offset, bytes, form);
    hosts_->scaleout_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }

  void finish_retained(const Wait& wait) override {
    // Also after this rank left the channel: the sources must not be read once the caller returns.
    leave_on_failure([&] { messenger_.finish_retained(wait); });
  }

  void put_checked(int peer, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes, bool retain) {
    check_put_range(memory, offset, bytes);
    check_rank(peer);
    messenger_.put(peer, static_cast<WindowMemory&>(memory).id(), offset, src, bytes, retain);
    hosts_->scaleout_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }

  bool puts_travel() const override { return true; }
  std::uint64_t scaleout_bytes_sent() const override { return hosts_->scaleout_bytes.load(std::memory_order_relaxed); }

  void signal(int peer) override { messenger_.signal(peer); }

  void wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets, const Wait& wait) override {
    check_in_step(wait);
    leave_on_failure([&] { messenger_.wait_signals(peers, targets, wait); });
  }

  std::vector<int> wait_signals_tolerant(std::span<const int> peers, std::span<const std::uint64_t> targets,
                                         const Wait& wait) override {
    check_in_step(wait);
    return messenger_.wait_signals_tolerant(peers, targets, wait);
  }

  void abandon(const std::string& reason, const std::vector<int>& culprits) noexcept override {
    // Either a node peer opening a section sees the flag, or the loop below sees its section open
    // and waits for it to close.
    if (!control_.page().abandon(reason, culprits)) return;
    // Best effort: without memory for the notice, the peers time out instead.
    (void)core::capture([&] { messenger_.abandon({reason, culprits}, 1.0); });
    // Sections are bounded work; a peer whose process is gone reads nothing any more.
    peer_reads_.wait_for_readers(
        [&](int r) { return control_pages_.open_sections(r); }, std::max(timeout_, 1.0),
        [&](int r) { return process_gone(r); },
        [](int r) {
          core::warn(core::Subsys::kP2P, "rank {} still reads this rank's memory while it leaves the channel", r);
        });
  }

  std::optional<Departure> departure(int peer) const override {
    if (auto why = abandonment(peer)) return why;
    return messenger_.departure(peer);
  }

  void begin_peer_reads(const char* phase) override {
    peer_reads_.open(phase, [&](int r) { return control_pages_.abandonment(r); });
  }

  void end_peer_reads() noexcept override { peer_reads_.close(); }

  // Frees a window: collective over the node, so it runs only once every member arrived.
  void release(std::uint32_t id, MPI_Win window, const Wait& wait) noexcept {
    messenger_.unregister_memory(id);
    if (g_abandoned.load()) return;
    try {
      barrier(Scope::kNode, {"symmetric memory release", wait.timeout_secs});
      std::lock_guard lock(mpi_mutex());
      MPI_Win_free(&window);
    } catch (const std::exception& e) {
      core::warn(core::Subsys::kAlloc, "symmetric memory kept mapped: {}", e.what());
    }
  }

 private:
  // A node peer's abandonment as its control page shows it (other ranks' come as messages).
  std::optional<Departure> abandonment(int peer) const {
    return peer == rank() ? std::nullopt : control_pages_.abandonment(peer);
  }

  bool process_gone(int peer) const { return messenger_.departure(peer, false).has_value(); }

  void check_in_step(const Wait& wait) const {
    const ControlPage& page = control_.page();
    if (page.has_abandoned()) fail_left_channel(wait, page.read_reason());
  }

  ControlRegion control_;
  PeerReadSections peer_reads_;
  ControlPages control_pages_;  // the node's, by rank; this rank's own among them
  mutable Messenger messenger_;
  std::shared_ptr<const HostInfo> hosts_;
  std::vector<int> world_members_, node_members_;
  std::vector<std::vector<std::byte>> world_blocks_, node_blocks_;
  std::uint64_t epochs_[2] = {0, 0};
  MPI_Comm node_comm_ = MPI_COMM_NULL;
  std::uint32_t next_memory_ = 1;
  double timeout_;
  SharedSpans shared_;
  std::vector<std::unique_ptr<PeerSharedViews>> shared_views_;  // by local index
};

WindowMemory::~WindowMemory() { owner_.release(id_, window_, wait_); }

std::byte* WindowMemory::node_peer(int rank) {
  owner_.check_same_node(rank);
  return node_bases_[static_cast<size_t>(rank - owner_.node_first_rank())];
}

// MPI is initialized, not finalized, and runs at MPI_THREAD_SERIALIZED or above.
void check_mpi_ready() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw StateError("mpi::make_group: MPI is not initialized (use moe_ep::mpi::Session or MPI_Init_thread)");
  MPI_Finalized(&finalized);
  if (finalized) throw StateError("mpi::make_group: MPI is already finalized");
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED)
    throw StateError(fmt::format("mpi::make_group: MPI was initialized with thread level {}; moe-ep needs at least "
                                 "MPI_THREAD_SERIALIZED (initialize with MPI_Init_thread)",
                                 level));
}

// This process's rank in comm, an intracommunicator.
int intracomm_rank(MPI_Comm comm) {
  if (comm == MPI_COMM_NULL) throw InvalidArgument("mpi::make_group: comm is MPI_COMM_NULL");
  int rank = 0, inter = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_test_inter(comm, &inter);
  if (inter)
    throw InvalidArgument(fmt::format("[rank {}] mpi::make_group: comm is an intercommunicator; a group is the ranks of "
                                      "one intracommunicator (merge it with MPI_Intercomm_merge first)",
                                      rank));
  return rank;
}

// The ranks per node this rank asks for: the option, else MOE_EP_RANKS_PER_NODE (0 = per host).
int requested_ranks_per_node(const moe_ep::mpi::GroupOptions& options, int rank) {
  const int requested = options.ranks_per_node ? *options.ranks_per_node
                                               : static_cast<int>(env::get(env::kRanksPerNode));
  if (requested < 0)
    throw InvalidArgument(fmt::format("[rank {}] ranks_per_node = {} is negative (0 = the ranks of each host)", rank, requested));
  return requested;
}

}  // namespace
}  // namespace comm::mpi

namespace mpi {

std::unique_ptr<Group> make_group(MPI_Comm comm, const GroupOptions& options) {
  using namespace comm::mpi;
  check_mpi_ready();
  const int rank = intracomm_rank(comm);
  int size = 0;
  MPI_Comm_size(comm, &size);
  core::set_process_rank(rank);
  const double timeout = core::timeout_or_env(fmt::format("[rank {}] mpi::make_group", rank), options.timeout_secs);
  const comm::Wait wait{"group creation", timeout};
  const int requested = requested_ranks_per_node(options, rank);

  MPI_Comm dup = duplicate_comm(comm, rank, wait);
  // Tensors this process allocates from now on can be mapped by node peers instead of copied.
  core::share_new_blocks();
  Messenger messenger(dup, rank, size);
  const Census census = take_census(messenger, kTagWorld, local_facts(dup, rank, requested), rank, size, wait);
  messenger.drain(timeout);
  int per_node = 0;
  std::shared_ptr<HostInfo> hosts;
  try {
    check_same_build(census, rank);
    per_node = agreed_ranks_per_node(census, rank, requested);
    check_nodes_share_memory(census, rank, per_node);
    hosts = host_info(census, rank);
    core::place_rank_thread(hosts->host_size, hosts->host_index(rank));
  } catch (...) {
    MPI_Comm_free(&dup);
    throw;
  }
  const Topology topology{.num_scaleout = size / per_node, .num_scaleup = per_node};
  core::info(core::Subsys::kInit,
             "group: rank {} of {}, {} logical node(s) x {} ranks per node ({}), {} host(s); transport MPI "
             "(shared memory in a node, MPI messages across nodes, {} bytes per scale-out message)",
             rank, size, topology.num_scaleout, topology.num_scaleup,
             requested == 0 ? "the ranks of each host" : "MOE_EP_RANKS_PER_NODE / ranks_per_node",
             census.host_members().size(), std::max<std::int64_t>(env::get(env::kMpiChunkBytes), 4096));
  return std::make_unique<Group>(std::make_shared<MpiTransport>(dup, rank, size, topology, hosts, wait));
}

Session::Session(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&provided_);
  } else {
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided_);
    owns_ = true;
  }
  if (provided_ < MPI_THREAD_SERIALIZED)
    throw StateError(fmt::format("MPI provides thread level {}; moe-ep needs at least MPI_THREAD_SERIALIZED", provided_));
}

Session::~Session() {
  if (!owns_ || comm::mpi::g_abandoned.load()) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void Session::abandon() { comm::mpi::g_abandoned.store(true); }

}  // namespace mpi
}  // namespace moe_ep
