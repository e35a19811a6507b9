// Transport: what the buffers need from a set of ranks, in bytes, ranks and signals only.
//
// Collectives (barrier, all_gather, allocate_symmetric, duplicate) must be called by every rank
// of their scope in the same order. A scope is the whole world or this rank's node. Every wait
// has a phase name and a timeout; when it expires the error names the ranks that did not arrive,
// and when a rank it waits for has left the group the error names that rank at once.
//
// Memory model:
//  - all_gather: after it returns, every block a peer published in that call is visible. The
//    returned views stay valid until this rank's next collective in the same scope.
//  - Scale-up: ranks of one node may read and write each other's symmetric memory and published
//    addresses through node_address(); node_address() refuses ranks of other nodes.
//  - Scale-out: put() copies bytes into a peer's symmetric memory; signal() increments the
//    peer's counter for this rank once every earlier put to that peer is complete. A receiver
//    that observes the counter value (wait_signals) sees all data put before it. Completion is
//    counted, never inferred from the order in which writes land. put() has read `src` when it
//    returns (the in-process transport wrote the peer's memory; the MPI transport copied the
//    bytes into a message that leaves by the next signal() to that peer at the latest). Puts to
//    one peer between two signals write disjoint bytes (the order of writes to one byte within
//    that span is not defined; the MPI transport refuses such a message).
//  - put_retained(): like put(), but the transport may read `src` until finish_retained()
//    returns, so it can send the bytes from where they are instead of copying them first (the MPI
//    transport sends them with a derived datatype). The caller keeps those bytes valid and
//    unchanged until then; the in-process transport copies at once. finish_retained() waits until
//    every retained source was read (its sends completed) and is a wait like the others.
//  - share(): this rank's own memory (user tensors) that node peers read through node_address()
//    stays readable until this rank's next share() on the same transport.
//  - share_window() (where offers_windows()): memory node peers write into through node_window(),
//    between the node collective that follows its publication and the next one.
//
// Leaving after a failure: a failure that leaves the ranks of a channel out of step (a wait that
// expired or found a peer gone, an operation that failed after its agreement) ends this rank's part
// in the channel: abandon(). From then on every peer's wait on this rank fails at once with
// PeerError naming the root cause, a peer that completes a collective this rank published in but
// gave up on before completing learns it as that collective returns (PeerError: the collective is
// void), and this rank's own collectives raise StateError. Reads of what node peers published
// (their shared tensors and the addresses in their gathered blocks) happen inside peer-read
// sections (PeerReads): opening one fails with PeerError once a node peer abandoned the channel,
// and abandon() returns only when no node peer has a section open, so after it no peer reads this
// rank's published memory and it may be freed. Sections contain no waits on peers, so abandon()
// waits only for bounded work.
//
// What the transports share lives beside this file, written once: the failure messages and the
// ranks they name (peer_failure.hh), the peer-read sections and abandon()'s wait for them
// (peer_reads.hh), the epoch all-gather of the shared-memory transports and the rule that voids a
// collective (gather_protocol.hh), the arrival wait (wait.hh), and for the process transports the
// control pages (control_page.hh) and share()'s arenas (shared_arena.hh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm/peer_failure.hh"
#include "moe_ep/group.hpp"

namespace moe_ep::comm {

enum class Scope { kWorld, kNode };

struct Wait {
  const char* phase;    // names the step in error messages, e.g. "dispatch: count exchange"
  double timeout_secs;  // > 0; core::kNeverSecs and more never expire (core/timeout.hh)
};

// The ranks of one scope of a channel: ranks first .. first + count - 1, this rank among them.
// `index` numbers the scope (0 the world, 1 the node) for per-scope counters.
struct ScopeMembers {
  int first;
  int count;
  int index;
  int rank(int member) const { return first + member; }
};

// One block per rank of the scope, indexed by rank (world) or by local index (node).
class Gathered {
 public:
  Gathered() = default;
  explicit Gathered(std::vector<std::span<const std::byte>> blocks) : blocks_(std::move(blocks)) {}
  // Views of blocks the transport copied out (they stay where they are while the views are used).
  explicit Gathered(const std::vector<std::vector<std::byte>>& copies) {
    for (const auto& copy : copies) blocks_.emplace_back(copy.data(), copy.size());
  }
  std::span<const std::byte> operator[](int i) const { return blocks_[static_cast<size_t>(i)]; }
  int size() const { return static_cast<int>(blocks_.size()); }
  template <class T>
  const T& as(int i) const {
    return *reinterpret_cast<const T*>(blocks_[static_cast<size_t>(i)].data());
  }

 private:
  std::vector<std::span<const std::byte>> blocks_;
};

// Memory every rank allocated with the same size in one collective call.
class SymmetricMemory {
 public:
  virtual ~SymmetricMemory() = default;
  virtual std::byte* local() = 0;
  virtual std::size_t bytes() const = 0;
  // This region on a rank of the same node; throws StateError for other nodes.
  virtual std::byte* node_peer(int rank) = 0;
  // Peers reach this memory through mappings of their own (processes over memfds): releasing it
  // here cannot take it away from a peer still reading it, so retire() may release it.
  virtual bool peers_hold_own_mappings() const { return false; }
};

class Transport {
 public:
  virtual ~Transport() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Topology& topology() const { return topology_; }  // physical; num_scaleup filled in
  int node_of(int rank) const { return rank / topology_.num_scaleup; }
  bool same_node(int rank) const { return node_of(rank) == node_of(rank_); }
  int node_size() const { return topology_.num_scaleup; }
  int node_first_rank() const { return node_of(rank_) * topology_.num_scaleup; }
  ScopeMembers members(Scope scope) const {
    return scope == Scope::kWorld ? ScopeMembers{0, size_, 0} : ScopeMembers{node_first_rank(), node_size(), 1};
  }

  // Throws StateError unless `peer` is a rank of the group.
  void check_rank(int peer) const;
  // Throws StateError unless `peer` is a rank of this rank's node.
  void check_same_node(int peer) const;

  // Ranks of the group running on this machine (they share its cores).
  virtual int ranks_on_host() const = 0;
  // Whether every rank of the group runs in this process (ranks as threads), so that an address
  // of one rank's memory is valid at every other rank.
  virtual bool ranks_share_address_space() const { return false; }
  // Whether put() sends a message that reaches the peer's memory later (MPI), rather than writing
  // the peer's memory at once: a receiver then has time to fill while records travel.
  virtual bool puts_travel() const { return false; }

  // A new independent channel over the same ranks (own collective sequence). Collective.
  virtual std::unique_ptr<Transport> duplicate(const Wait& wait) = 0;

  // An all_gather of empty blocks.
  virtual void barrier(Scope scope, const Wait& wait) { all_gather({}, scope, wait); }
  virtual Gathered all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait) = 0;
  // prefault: the owner faults every page in now (else pages are faulted in by first use).
  virtual std::unique_ptr<SymmetricMemory> allocate_symmetric(std::size_t bytes, const Wait& wait,
                                                              bool prefault = true) = 0;

  // Scale-up: an address a rank of this node published (in a gathered block), made usable here.
  virtual const void* node_address(int rank, const void* published) const = 0;

  // Makes these bytes readable by the ranks of this node until the next share(); returns the
  // values to publish (null for empty spans). Ranks in one address space publish the addresses
  // themselves; processes copy into memory their node peers map.
  struct Span {
    const void* data;
    std::size_t bytes;
  };
  virtual std::vector<const void*> share(std::span<const Span> spans) {
    std::vector<const void*> out;
    for (const Span& s : spans) out.push_back(s.bytes ? s.data : nullptr);
    return out;
  }

  // Windows (push): memory a rank publishes so that the ranks of its node write into it, e.g.
  // the outputs of a dispatch and the receive plan that says which row goes where. Whether this
  // transport offers them: the in-process transport does (ranks share the address space), and so
  // do the process transports (memfd blocks node peers map writable; comm/shared_arena.hh); where
  // a transport does not, receivers read their rows from the sources instead (share()).
  virtual bool offers_windows() const { return ranks_share_address_space(); }
  // One span of a window. peers_write: node peers write these bytes (outputs), so they must be
  // published in place (processes: memory from core::allocate_host_shared, else StateError);
  // otherwise peers only read them (a plan), and a transport may publish a copy.
  struct WindowSpan {
    const void* data;
    std::size_t bytes;
    bool peers_write;
  };
  // What a rank publishes per span: a value only this transport interprets (0: empty span), the
  // identity of the memory it names (processes: the memfd's inode; 0 in one address space) and
  // the span's bytes.
  struct PublishedSpan {
    std::uint64_t value = 0, identity = 0, bytes = 0;
  };
  // Publishes these bytes of this rank's memory as a window. The bytes stay this rank's memory;
  // node peers may access them from the next collective in the node scope that follows (the
  // publication) until the one after it. Only where offers_windows() (else StateError).
  virtual std::vector<PublishedSpan> share_window(std::span<const WindowSpan> spans);
  // The first `bytes` bytes of a span a rank of this node published (share_window's value),
  // addressable here; StateError when `bytes` exceeds the span it published, so a writer never
  // reaches past it (null for an empty span and bytes 0). Checks, then map_window().
  std::byte* node_window(int rank, const PublishedSpan& published, std::size_t bytes) const;

  // Bytes this rank has put() to other ranks, over every channel of its group (monotonic).
  virtual std::uint64_t scaleout_bytes_sent() const = 0;

  // Bytes share() had to copy (memory node peers could not map in place), over every channel of
  // the group (monotonic).
  virtual std::uint64_t shared_bytes_copied() const { return 0; }

  // Scale-out: at most this many transfers in flight to one peer (>= 1).
  virtual void set_inflight_limit(int per_peer) {}

  // Scale-out, one-sided.
  virtual void put(int peer, SymmetricMemory& memory, std::size_t offset, const void* src, std::size_t bytes) = 0;
  virtual void put_retained(int peer, SymmetricMemory& memory, std::size_t offset, const void* src,
                            std::size_t bytes) {
    put(peer, memory, offset, src, bytes);
  }
  virtual void finish_retained(const Wait& wait) {}
  // Like put(), but the caller forms the bytes where they go: form(dst) writes exactly `bytes`
  // bytes at dst, which is the peer's memory (transports that write it directly) or the message
  // being filled (MPI), so a row computed for a peer (a sum) is written once, not formed in
  // scratch and copied. form must not call the transport.
  virtual void put_formed(int peer, SymmetricMemory& memory, std::size_t offset, std::size_t bytes,
                          const std::function<void(std::byte*)>& form);
  virtual void signal(int peer) = 0;
  // Waits until, for each i, the counter of source peers[i] reached targets[i].
  virtual void wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets,
                            const Wait& wait) = 0;

  // Like wait_signals, but a rank that left or is late does not make this rank leave the channel:
  // waits until each peer reached its target or left (departure()), or the timeout expired, and
  // returns the peers that did not reach their targets (empty when all did). Throws StateError
  // only if this rank already left the channel. For protocols that go on without the ranks that
  // stopped (TolerantGather, shrink mode).
  virtual std::vector<int> wait_signals_tolerant(std::span<const int> peers, std::span<const std::uint64_t> targets,
                                                 const Wait& wait) = 0;

  // Leaves the channel after a failure (see the top of this file). `culprits`: the ranks the
  // failure names. Idempotent; never throws.
  virtual void abandon(const std::string& reason, const std::vector<int>& culprits) noexcept = 0;
  // Why `peer` no longer takes part in this channel, or nullopt while it does.
  virtual std::optional<Departure> departure(int peer) const = 0;
  // Throws PeerError if `peer` left the group or abandoned the channel (for waits written outside
  // the transport, e.g. on a flag in symmetric memory).
  void check_peer(int peer, const char* phase) const;

  // A peer-read section (see the top of this file); opened by PeerReads.
  virtual void begin_peer_reads(const char* phase) = 0;
  virtual void end_peer_reads() noexcept = 0;

  // Runs fn; if it throws, the ranks are out of step: this rank abandons the channel (naming what
  // the error names), then rethrows. Every wait of every transport (and of the protocols they
  // share, gather_protocol.hh) runs under it.
  template <class Fn>
  auto leave_on_failure(Fn fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      abandon(message_of(error), culprits_of(error));
      throw;
    }
  }

 protected:
  // The StateError of a collective called after this rank abandoned the channel for `reason`.
  [[noreturn]] void fail_left_channel(const Wait& wait, const std::string& reason) const;
  // node_window() once its checks passed (a node peer's span that holds `bytes`): where this rank
  // reaches it. By default the published value is the address itself (one address space).
  virtual std::byte* map_window(int rank, const PublishedSpan& published, std::size_t bytes) const;
  // Throws StateError unless [offset, offset + bytes) lies in `memory`.
  void check_put_range(const SymmetricMemory& memory, std::size_t offset, std::size_t bytes) const;
  // The end of a symmetric allocation's size exchange (`sizes`: every rank's, this rank's is
  // `bytes`): throws PeerError naming the ranks whose allocation failed (`failed`), else the
  // disagreement on the size (comm/disagreement.hh) when the sizes differ.
  void check_allocation_agreed(std::size_t bytes, const std::vector<int>& failed,
                               const std::vector<std::uint64_t>& sizes) const;

  Transport(int rank, int size, Topology topology) : rank_(rank), size_(size), topology_(topology) {}

 private:
  int rank_;
  int size_;
  Topology topology_;
};

// While open, this rank reads what node peers published; see the top of this file.
class PeerReads {
 public:
  PeerReads(Transport& transport, const char* phase) : transport_(transport) { transport_.begin_peer_reads(phase); }
  ~PeerReads() { transport_.end_peer_reads(); }
  PeerReads(const PeerReads&) = delete;
  PeerReads& operator=(const PeerReads&) = delete;

 private:
  Transport& transport_;
};

// Keeps symmetric memory mapped until the process exits: for memory peers may still read after a
// failure left the ranks out of step. Memory whose peers hold their own mappings
// (peers_hold_own_mappings) is released at once instead.
void retire(std::shared_ptr<SymmetricMemory> memory);

// Checks a topology against a rank count and fills num_scaleup; throws InvalidArgument.
Topology resolve_topology(int num_ranks, Topology topology);

}  // namespace moe_ep::comm
