// Messenger: the point-to-point layer of the MPI transport, on one communicator (one channel).
//
// - Gathers: every member sends its block to every other member (tag per scope, epoch in the
//   header) and receives one block from each; a wait names exactly the members whose block has
//   not arrived, and a member on this host whose process is gone is reported at once.
// - Scale-out records: put() appends (memory id, offset, bytes) pieces to the peer's current
//   message (the wire needs one); a full message, or signal(), sends it. At most `inflight`
//   messages per peer are in flight. A signal carries the number of record messages sent to that
//   peer before it; the receiver counts the signal only once that many messages were applied to
//   its memory: completion is counted, never inferred from arrival order.
// - Progress is explicit: every wait (gather, signals, a full in-flight window) tests sends and
//   receives and applies arriving records; nothing relies on MPI's asynchronous progress.
// All MPI calls of the process go through one mutex (MPI_THREAD_SERIALIZED suffices).
#pragma once

#include <mpi.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <climits>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.hh"

namespace moe_ep::comm::mpi {

std::mutex& mpi_mutex();
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
  void put(int peer, std::uint32_t memory, std::size_t offset, const void* src, std::size_t bytes);
  void signal(int peer);
  void wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets, const Wait& wait);

  // Waits up to `secs` for sends in flight, then abandons the rest.
  void drain(double secs);

 private:
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<std::byte> buffer;
    int peer = -1;
    bool record = false;
  };
  struct Source {
    std::uint64_t applied = 0;             // record messages applied
    std::deque<std::uint64_t> thresholds;  // signals received, not yet counted
    std::uint64_t signals = 0;             // signals counted
  };

  void progress();  // with mpi_mutex held
  // Receives the next message from `source` (or MPI_ANY_SOURCE) with `tag` into `buffer` if one
  // has arrived; returns its source, or -1. With mpi_mutex held.
  int receive(int source, int tag, std::vector<std::byte>& buffer);
  void apply(int source, std::span<const std::byte> message);
  void send(int peer, int tag, std::vector<std::byte> buffer, bool record);
  void flush(int peer);  // with mpi_mutex held
  // Waits (with progress) until done() holds; on timeout or a departed member, throws naming
  // the ranks missing() returns.
  template <class Done, class Missing>
  void wait_until(const Wait& wait, Done done, Missing missing);
  [[noreturn]] void fail(const Wait& wait, const std::vector<int>& missing, double elapsed);
  bool gone(int rank) const;

  MPI_Comm comm_;
  int rank_, size_;
  std::shared_ptr<const HostInfo> hosts_;
  std::list<Pending> pending_;
  std::vector<int> inflight_;
  int inflight_limit_ = 16;
  Wait send_wait_{"scale-out send", 300};
  std::size_t chunk_bytes_;
  // The message being filled for a peer. Pieces are 8-byte aligned; a put that continues the last
  // piece (same memory, next offset) extends it instead of adding a header.
  struct Chunk {
    std::vector<std::byte> bytes;
    std::size_t last = SIZE_MAX;  // position of the last piece's header
    std::size_t end = 0;          // end of the last piece's data (before padding)
  };
  std::vector<Chunk> chunks_;  // [peer]
  std::vector<std::uint64_t> sent_records_;     // [peer]
  std::vector<Source> sources_;                 // [peer]
  std::map<std::uint32_t, std::pair<std::byte*, std::size_t>> memories_;
  std::vector<std::byte> receive_;
};

}  // namespace moe_ep::comm::mpi
