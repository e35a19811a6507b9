// Peer-read sections: the protocol behind Transport::begin_peer_reads / end_peer_reads and the end
// of abandon() (transport.hh, "Leaving after a failure"), written once for every transport.
//
// Every rank has a count of the peer-read sections it has open and a flag saying that it abandoned
// the channel, both readable by the other ranks of its node; where they live is the transport's
// business (the in-process transport keeps them in the channel's state, the process transports in
// control pages, control_page.hh). The protocol is a Dekker-style pair of sequentially consistent
// operations:
//  - a reader raises its own count, then looks at every node peer's flag; when some peer abandoned
//    the channel, it lowers its count again and the section fails with PeerError naming the root
//    cause (fail_abandoned), before anything was read;
//  - a leaving rank sets its flag (the transport does, reason first), then waits until every node
//    peer's count is zero (wait_for_readers).
// So either the reader sees the flag or the leaving rank sees the section open and waits for it to
// close: once abandon() returns, no node peer reads the leaving rank's published memory, which may
// then be freed. Sections hold no waits on peers, so the leaving rank waits only for bounded work.
#pragma once

#include <atomic>
#include <cstdint>

#include "comm/peer_failure.hh"
#include "comm/transport.hh"
#include "comm/wait.hh"

namespace moe_ep::comm {

class PeerReadSections {
 public:
  // The sections of `transport`'s rank, whose count of open sections is `open_count` (node peers
  // read it), over the ranks of its node.
  PeerReadSections(const Transport& transport, std::atomic<std::uint64_t>& open_count)
      : transport_(transport), open_count_(open_count) {}
  PeerReadSections(const PeerReadSections&) = delete;
  PeerReadSections& operator=(const PeerReadSections&) = delete;

  // Opens a section for `phase`. abandonment(r): why node peer r abandoned the channel (its flag,
  // read sequentially consistent), or nullopt.
  template <class Abandonment>
  void open(const char* phase, Abandonment abandonment) {
    open_count_.fetch_add(1, std::memory_order_seq_cst);
    const auto departed =
        departed_among(transport_.node_first_rank(), transport_.node_size(), transport_.rank(), abandonment);
    if (departed.empty()) return;
    open_count_.fetch_sub(1, std::memory_order_release);
    fail_abandoned(transport_.rank(), {phase, 0}, departed);
  }

  void close() noexcept { open_count_.fetch_sub(1, std::memory_order_release); }

  // The end of abandon(), once this rank's flag is set: waits until no node peer has a section
  // open. open_count_of(r): node peer r's count, or null where it cannot be seen from here (not
  // waited for). Waits at most `timeout_secs` in all (core::kNeverSecs: until they close); stops
  // waiting for a peer when gone(r) says its process is gone (it reads nothing any more), and
  // calls still_reading(r) for a peer it stopped waiting for.
  template <class OpenCountOf, class Gone, class StillReading>
  void wait_for_readers(OpenCountOf open_count_of, double timeout_secs, Gone gone,
                        StillReading still_reading) const noexcept {
    Backoff backoff(timeout_secs);
    const int first = transport_.node_first_rank();
    for (int r = first; r < first + transport_.node_size(); ++r) {
      if (r == transport_.rank()) continue;
      const std::atomic<std::uint64_t>* count = open_count_of(r);
      if (count == nullptr) continue;
      while (count->load(std::memory_order_seq_cst) != 0) {
        if (!backoff.pause() || gone(r)) {
          still_reading(r);
          break;
        }
      }
    }
  }

 private:
  const Transport& transport_;
  std::atomic<std::uint64_t>& open_count_;
};

}  // namespace moe_ep::comm
