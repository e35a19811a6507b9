// Messenger: the point-to-point layer of the MPI transport, on one communicator (one channel).
//
// - Gathers: every member sends its block to every other member (tag per scope, epoch in the
//   header) and receives one block from each; a wait names exactly the members whose block has
//   not arrived, and a member on this host whose process is gone is reported at once.
// - Scale-out records: put() appends (memory id, offset, bytes) pieces to the peer's current
//   message (the wire needs one); a full message, or signal(), sends it. At most `inflight`
//   messages per peer are in flight. Every record message carries its number (per peer) and its
//   piece list; a message with 16 KiB of data or more travels as the list and then the bare
//   data, which the receiver receives straight into its symmetric memory, one receive for all
//   pieces (no copy on arrival); smaller messages are copied into place on arrival. A retained
//   put (put(..., retain = true)) is not copied on the sender either: the message's data is sent
//   from the pieces' sources with an indexed datatype of their addresses (bytes copied by other
//   puts sit in the message buffer beside them), so those sources are read until
//   finish_retained() returns; a message below 16 KiB is still packed into one buffer
//   (MOE_EP_MPI_SEND_FROM_SOURCE=0 packs every message). Message
//   buffers are reused. A signal carries the number of record messages sent to that
//   peer before it; the receiver counts the signal only once every message numbered below it is
//   in its memory: completion is counted, never inferred from arrival order.
// - Progress is explicit: every wait (gather, signals, a full in-flight window) tests sends and
//   receives and applies arriving records; nothing relies on MPI's asynchronous progress.
// - Departures: abandon() tells every other member that this rank gave up on the channel (why,
//   and which ranks its failure named). A wait fails at once, naming the root cause, when a rank it
//   waits for gave up or was named by such a notice ("rank N is gone"), or said it waits for one
//   that was (the chains below); a wait on a member whose process on this host is gone fails at
//   once too. Waits that do not depend on the failed ranks (a gather among other ranks) go on.
// - Chains: a wait that expires first asks the ranks it waited for whom they wait for (a rank
//   answers from its progress calls on any of its channels: the ranks its waits in progress are
//   missing, on all its channels, or none), follows the
//   answers to the ranks they name and asks those in turn, for at most half a second, and then
//   names the ends of the chains: the ranks that did not answer (stopped, dead, or busy without
//   a progress call) or wait for nobody. With equal timeouts a rank waiting behind a live rank that
//   waits for a stopped one names the stopped one, whichever timeout expires first.
// All MPI calls of the process go through one mutex (MPI_THREAD_SERIALIZED suffices).
#pragma once

#include <mpi.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <climits>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.hh"

namespace moe_ep::comm::mpi {

// Message bytes: growing a buffer leaves the new bytes uninitialized (they are written at once).
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    std::construct_at(p, std::forward<Args>(args)...);
  }
};
using Bytes = std::vector<std::byte, UninitializedAllocator<std::byte>>;
// Keeps a message buffer that MPI may still read (a send to a peer that is gone) alive, and
// reachable, until the process exits.
void keep_until_exit(Bytes buffer);

std::mutex& mpi_mutex();
class Messenger;
// Every messenger of this process (with mpi_mutex held): a query on any channel is answered with
// what this process waits for on all of them (its channels share one rank numbering).
std::set<Messenger*>& messengers();
// Throws StateError naming the call and MPI's error text unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* call, int rank);

// Which ranks run on this host, and their process ids (for noticing that one is gone).
struct HostInfo {
  std::vector<pid_t> pids;       // [world]
  std::vector<int> host;         // [world] host id (lowest world rank on that host)
  int host_size = 1;             // ranks on this host
  // This rank's counters, over every channel of the group.
  mutable std::atomic<std::uint64_t> scaleout_bytes{0};       // put() bytes
  mutable std::atomic<std::uint64_t> shared_bytes_copied{0};  // share() bytes copied into arenas
  bool same_host(int a, int b) const { return host[static_cast<size_t>(a)] == host[static_cast<size_t>(b)]; }
  // The index of `rank` among the ranks of its host, in world order.
  int host_index(int rank) const {
    int index = 0;
    for (int r = 0; r < rank; ++r) index += same_host(r, rank) ? 1 : 0;
    return index;
  }
};

class Messenger {
 public:
  Messenger(MPI_Comm comm, int rank, int size);
  ~Messenger();
  Messenger(const Messenger&) = delete;
  Messenger& operator=(const Messenger&) = delete;

  MPI_Comm comm() const { return comm_; }
  void set_host_info(std::shared_ptr<const HostInfo> info) { hosts_ = std::move(info); }

  // One block from each of `members` (ascending world ranks, containing this rank).
  std::vector<std::vector<std::byte>> gather(std::span<const int> members, int tag, std::uint64_t epoch,
                                             std::span<const std::byte> mine, const Wait& wait);

  // Scale-out records.
  void register_memory(std::uint32_t id, std::byte* base, std::size_t bytes);
  void unregister_memory(std::uint32_t id);
  void set_inflight_limit(int per_peer, const Wait& wait);
  void put(int peer, std::uint32_t memory, std::size_t offset, const void* src, std::size_t bytes,
           bool retain = false);
  // Like put(), but form(dst) writes the bytes straight into the message (no copy); a piece that
  // does not fit in one message is formed aside and put.
  void put_formed(int peer, std::uint32_t memory, std::size_t offset, std::size_t bytes,
                  const std::function<void(std::byte*)>& form);
  // Sends every message holding retained bytes, and waits until all of them were sent, except
  // those to ranks that left the channel or that this rank's own failure named (abandon()): MPI
  // drops a send to a rank that is gone with the channel, and one that is stuck never reads it.
  void finish_retained(const Wait& wait);
  void signal(int peer);
  void wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets, const Wait& wait);
  // Transport::wait_signals_tolerant: the peers that did not reach their targets before they left
  // (a notice, or a process of this host that is gone) or the timeout expired; never throws for them.
  std::vector<int> wait_signals_tolerant(std::span<const int> peers, std::span<const std::uint64_t> targets,
                                         const Wait& wait);

  // No notice (abandon(), queries and answers) was sent or received on this channel: once its
  // members are done with it, no message of it can still be in flight.
  bool quiet() const { return quiet_; }

  // Waits up to `secs` for sends in flight, then abandons the rest.
  void drain(double secs);

  // Tells every other member that this rank gave up on the channel; waits (at most `secs`) for
  // those messages to leave. Never throws.
  void abandon(const Departure& why, double secs) noexcept;
  // Why `rank` no longer takes part (it abandoned the channel, or its process on this host is
  // gone), or nullopt. `probe`: look for messages that arrived first.
  std::optional<Departure> departure(int rank, bool probe = true);

 private:
  struct Chunk;
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    Bytes buffer;
    int peer = -1;
    bool record = false;
    bool retained = false;  // reads sources of retained puts
  };
  struct Source {
    std::uint64_t applied = 0;             // record messages 0 .. applied-1 are all in memory
    std::set<std::uint64_t> early;         // record messages in memory above `applied`
    std::deque<std::uint64_t> thresholds;  // signals received, not yet counted
    std::uint64_t signals = 0;             // signals counted
  };
  // A payload being received straight into symmetric memory.
  struct Incoming {
    MPI_Request request = MPI_REQUEST_NULL;
    int source = -1;
    std::uint64_t number = 0;
  };

  void progress();  // with mpi_mutex held
  // Counts the signals whose messages are all in memory. With mpi_mutex held.
  void count_signals();
  // Tests each transfer's request; calls finish() on those done and drops them.
  template <class Transfers, class Finish>
  void finish_completed(Transfers& transfers, const char* test, Finish finish);
  // Receives the next message from `source` (or MPI_ANY_SOURCE) with `tag` into `buffer` if one
  // has arrived; returns its source, or -1. With mpi_mutex held.
  int receive(int source, int tag, Bytes& buffer);
  // Where a record message's data goes: (memory id, bytes, offset) per piece, in data order.
  struct Piece {
    std::uint32_t memory;
    std::uint32_t bytes;
    std::uint64_t offset;
  };
  // With retained puts, where the message's bytes come from, in data order: a source of a
  // retained put, or (source null) `bytes` copied into the chunk's data at `at`.
  struct Segment {
    const std::byte* source;
    std::size_t at;
    std::size_t bytes;
  };
  // Reads a record message's number and piece list (into pieces_in_).
  std::uint64_t read_pieces(int source, std::span<const std::byte> message);
  // Copies the data of the pieces in pieces_in_ into place.
  void apply(int source, std::span<const std::byte> data);
  // Posts the receive of the data of the pieces in pieces_in_ straight into place.
  void receive_in_place(int source, std::uint64_t number);
  // Validates a piece against the registered memory; returns where it goes.
  std::byte* destination(int source, std::uint32_t memory, std::uint64_t offset, std::uint64_t bytes);
  void complete(int source, std::uint64_t number);
  // Sends buffer[from, from + bytes) (all of it by default); keeps the buffer until sent.
  void send(int peer, int tag, Bytes buffer, bool record, std::size_t from = 0, std::size_t bytes = SIZE_MAX);
  // Sends the data of a message with retained pieces from where it lies (`data` holds the copied
  // segments and stays alive until the send completes).
  void send_gathered(int peer, Bytes data, std::span<const Segment> segments);
  // Record message buffers are reused: a sent one is kept (up to kSpareBuffers) for the next.
  Bytes take_buffer();
  void recycle(Bytes buffer);
  void flush(int peer);  // with mpi_mutex held
  // Adds a piece of `n` bytes to peer's chunk (the caller made room), extending the last piece when
  // it continues it. With mpi_mutex held.
  void add_piece(Chunk& chunk, std::uint32_t memory, std::size_t offset, std::size_t n);
  // Appends `n` copied bytes to the chunk's data (and to its segments); returns where they go.
  std::byte* append_copied(Chunk& chunk, std::size_t n);
  // Waits (with progress) until done() holds; on timeout or a departed member, throws naming
  // the ranks missing() returns.
  // `channel_wide`: also end when the notices show that the ranks waited for cannot arrive (every
  // wait but finish_retained's, which only waits for sends to the ranks still taking part).
  void wait_until(const Wait& wait, const std::function<bool()>& done, const std::function<std::vector<int>()>& missing,
                  bool channel_wide = true);
  [[noreturn]] void fail(const Wait& wait, const std::vector<int>& missing, double elapsed);
  // Answers a rank's query: the ranks this process's waits in progress are missing, on any of its
  // channels (none if it is not waiting). With mpi_mutex held.
  void answer_query(int asker);
 public:
  // Answers the queries that arrived on this channel (a rank waiting on another channel calls it
  // every 50 ms). With mpi_mutex held.
  void answer_queries();
 private:
  // Asks the ranks of the chains from `missing` whom they wait for, for at most `secs` (until every
  // rank asked answered); the answers are in waiting_for_.
  void ask_whom_they_wait_for(const std::vector<int>& missing, double secs);
  // A rank this rank's failure named, or one that left the channel: sends to it are not waited for.
  // Whether one of `waiting` gave up, was named by a notice, or waits for one that did.
  bool blocked_by_notice(const std::vector<int>& waiting) const;
  bool out_of_channel(int rank) const { return blamed_.count(rank) != 0 || abandoned_.count(rank) != 0; }
  bool gone(int rank) const;  // its process on this host is gone
  // With mpi_mutex held.
  std::optional<Departure> departure_locked(int rank);

  MPI_Comm comm_;
  int rank_, size_;
  std::shared_ptr<const HostInfo> hosts_;
  std::list<Pending> pending_;
  std::vector<int> inflight_;
  int inflight_limit_ = 16;
  Wait send_wait_{"scale-out send", 300};
  std::size_t chunk_bytes_;
  bool send_from_source_;  // MOE_EP_MPI_SEND_FROM_SOURCE: retained puts are not copied
  // The message being filled for a peer: the pieces' bytes back to back, and where each goes. A
  // put that continues the last piece (same memory, next offset) extends it.
  struct Chunk {
    Bytes data;  // the copied bytes
    std::vector<Piece> pieces;
    std::vector<Segment> segments;  // empty unless a retained put added to this message
    std::size_t bytes = 0;          // data bytes of the message, copied or retained
  };
  std::vector<Chunk> chunks_;  // [peer]
  std::vector<std::uint64_t> sent_records_;     // [peer]
  std::vector<Source> sources_;                 // [peer]
  std::map<std::uint32_t, std::pair<std::byte*, std::size_t>> memories_;
  std::list<Incoming> incoming_;
  std::uint64_t received_in_place_ = 0, received_copied_ = 0;  // record messages, for MOE_EP_DEBUG
  Bytes receive_;
  std::vector<Piece> pieces_in_;
  std::vector<Bytes> spare_;
  std::vector<MPI_Request> requests_;  // finish_completed's scratch
  std::vector<int> completed_;
  std::map<int, Departure> abandoned_;  // members that said they gave up on the channel
  std::map<int, std::vector<int>> waiting_for_;  // answers to this rank's queries: whom they wait for
  std::set<int> answered_;                       // the ranks that answered
  std::vector<int> waiting_now_;                 // the ranks the wait in progress is missing
  std::set<int> blamed_;                // the ranks this rank's own abandon() named
  bool told_ = false;                   // this rank's abandon() sent its messages
  bool quiet_ = true;                   // see quiet()
};

}  // namespace moe_ep::comm::mpi
