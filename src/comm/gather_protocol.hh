// The all-gather protocol: the rule that voids a collective (every transport), and the epoch
// all-gather of the transports whose ranks share memory (in-process and host), written once;
// each transport provides only its medium (EpochSlots).
//
// Void collectives: a member that published its block of collective e and then abandoned the
// channel before completing e (it timed out waiting for another rank) is gone, and e is void for
// everyone: a late rank that finds every block there raises PeerError naming it (fail_abandoned,
// "took part and then left") instead of reading what it published. A member that abandoned after
// completing e leaves e valid; reads of what it published are guarded by peer-read sections
// (peer_reads.hh). Every rank stores the count of collectives it completed per scope, after
// reading the blocks, for its peers to check.
//
// The epoch all-gather (EpochGather). Every rank owns, per scope, an epoch counter and two block
// slots (parity 0 and 1), readable by the members of the scope. Collective e of a scope:
//  1. the rank writes its block into its slot e & 1, then stores epoch e (release);
//  2. it waits until every member's epoch reached e (acquire; wait_for_arrivals): PeerError at
//     once when a member that has not arrived left the group or abandoned the channel, else
//     TimeoutError naming the members that did not arrive;
//  3. it fails if the collective is void (above);
//  4. it reads every member's block out of slot e & 1 (the medium copies it or views it in
//     place), then stores that it completed e (release).
// A failure in 2-4 leaves the ranks out of step: the rank abandons the channel
// (Transport::leave_on_failure). A rank cannot finish e + 1 before every member published e + 1,
// which each does only after reading the blocks of e, so two slots per rank suffice, no trailing
// barrier is needed, and the views of the blocks stay valid until this rank's next collective in
// the scope.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "comm/peer_failure.hh"
#include "comm/transport.hh"

namespace moe_ep::comm {

// Fails (PeerError) if collective `epoch` of `members` is void: abandoned_before(r, epoch), for
// every member r but this rank, says why r abandoned the channel before completing it, or nullopt.
template <class AbandonedBefore>
void check_not_void(const Transport& transport, const Wait& wait, const ScopeMembers& members, std::uint64_t epoch,
                    AbandonedBefore abandoned_before) {
  const auto departed = departed_among(members.first, members.count, transport.rank(),
                                       [&](int r) { return abandoned_before(r, epoch); });
  if (!departed.empty()) fail_abandoned(transport.rank(), wait, departed);
}

// A shared-memory transport's medium for the epoch all-gather: per rank and scope, the epoch, the
// two slots and the count of completed collectives. Only the owner writes its own.
class EpochSlots {
 public:
  virtual ~EpochSlots() = default;
  // Writes this rank's block into its slot `parity` of the scope.
  virtual void publish(const ScopeMembers& scope, int parity, std::span<const std::byte> block) = 0;
  // Stores this rank's epoch of the scope (release), which publishes the block.
  virtual void announce(const ScopeMembers& scope, std::uint64_t epoch) = 0;
  // The epoch member `rank` stored in the scope (acquire).
  virtual std::uint64_t announced(const ScopeMembers& scope, int rank) const = 0;
  // Whether `rank`, awaited, left the group or abandoned the channel; `poll` counts the polls of
  // the wait (a costly check can run every few polls only).
  virtual bool left(int rank, unsigned poll) const = 0;
  // Why `rank` abandoned the channel before completing collective `epoch` of the scope, or nullopt
  // (it takes part, or it completed `epoch` before it left).
  virtual std::optional<Departure> abandoned_before(const ScopeMembers& scope, int rank,
                                                    std::uint64_t epoch) const = 0;
  // The members' blocks from their slots `parity` (this rank's own is `mine`), valid until this
  // rank's next collective in the scope.
  virtual Gathered read_blocks(const ScopeMembers& scope, int parity, std::span<const std::byte> mine) = 0;
  // Stores that this rank completed collective `epoch` of the scope (release).
  virtual void complete(const ScopeMembers& scope, std::uint64_t epoch) = 0;
};

// The epoch all-gather of one rank on one channel: its epochs per scope, over its medium.
class EpochGather {
 public:
  EpochGather(Transport& transport, EpochSlots& slots) : transport_(transport), slots_(slots) {}
  EpochGather(const EpochGather&) = delete;
  EpochGather& operator=(const EpochGather&) = delete;

  // Transport::all_gather, once the transport checked that this rank is still in step.
  Gathered all_gather(std::span<const std::byte> mine, Scope scope, const Wait& wait);

 private:
  Transport& transport_;
  EpochSlots& slots_;
  std::uint64_t epochs_[2] = {0, 0};  // [scope index]: the last collective this rank began
};

}  // namespace moe_ep::comm
