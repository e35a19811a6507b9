// TolerantGather: an all-gather among the ranks this rank still counts on, that goes on without
// the ranks that stopped. It is the exchange of shrink mode (docs/legacy.md §4).
//
// Each rank counts on a set of ranks (its "live" set, itself included). A gather sends this rank's
// block to every live peer and reads theirs, over a channel of its own (puts into a per-source
// mailbox of a few slots in the receiver's symmetric memory, one counted signal per block). A peer
// is dropped when it left the group (its thread or process is gone, or it left this exchange:
// leave()), when its block does not arrive within the timeout, or when its next block belongs to
// another call (another tag or gather number: it is "doing something else"). A second round then
// exchanges every rank's verdict (the ranks it does not count on), and each rank drops the union
// of the verdicts it received, so that the ranks that took part agree on who did; a rank that
// learns that a peer dropped it is dropped from everyone's view and goes on alone. Dropped peers
// are told (a release block) so that they stop waiting for this rank at once.
//
// Guarantees:
//  - gather() never waits for a rank that left, and waits at most the timeout per round for a rank
//    that stays away; it never leaves the channel (no failure of a peer is an error here);
//  - the members of a call (Result::member) are the same on every member, unless a rank failed
//    while the verdicts were exchanged (then some members drop it one call before the others);
//  - after sending a peer its leave block, this rank writes nothing more into that peer's memory;
//    leave() returns true only once every peer has left or is gone, so that no peer writes into
//    this rank's memory or reads it any more (else the memory must stay mapped, and the mailboxes
//    stay mapped until the process exits).
// Limits: a block holds at most the capacity given at construction; calls are made by one thread
// at a time (the buffer's calls are serialised).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.hh"

namespace moe_ep::comm {

class TolerantGather {
 public:
  // Collective over `parent`'s ranks (all must take part): a duplicate channel and the mailboxes.
  TolerantGather(Transport& parent, std::size_t block_capacity, const Wait& setup);
  ~TolerantGather();
  TolerantGather(const TolerantGather&) = delete;
  TolerantGather& operator=(const TolerantGather&) = delete;

  struct Result {
    std::vector<char> member;                    // [rank]: 1 for the ranks of this call (this rank among them)
    std::vector<std::vector<std::byte>> blocks;  // [rank]: the members' blocks (this rank's too)
    std::vector<std::string> dropped;            // [rank]: why a rank counted on is not a member ("" otherwise)
  };
  // `live` [ranks]: the ranks this rank counts on (1), itself included. `tag` names the call (at most
  // 31 characters); every rank of the call passes the same. `timeout_secs` bounds each round's wait.
  Result gather(std::span<const std::byte> block, const std::string& tag, const std::vector<char>& live,
                double timeout_secs);
  // A gather of empty blocks among the ranks of `live`: its members (a barrier that survives failures).
  Result barrier(const std::string& tag, const std::vector<char>& live, double timeout_secs) {
    return gather({}, tag, live, timeout_secs);
  }
  // Tells every peer that this rank makes no more calls, then waits until every peer that is not
  // gone said the same (at most timeout_secs). Returns whether every peer did. Later calls of
  // gather() throw StateError.
  bool leave(double timeout_secs);

  // Why `peer` no longer takes part in the group (left its thread or process), or nullopt.
  std::optional<Departure> departure(int peer) const { return channel_->departure(peer); }
  std::size_t block_capacity() const { return capacity_; }

 private:
  enum class Kind : std::uint32_t { kBlock = 1, kVerdict = 2, kRelease = 3, kLeave = 4 };
  struct Header;
  struct Read {
    Kind kind;
    std::uint64_t number;
    std::string tag;
    std::vector<std::byte> payload;
  };
  enum class Outcome { kGot, kStale, kOther };

  void send(int peer, Kind kind, std::span<const std::byte> payload, const std::string& tag);
  // The next block from `peer` (its signal must have arrived), or nullopt if it was overwritten.
  std::optional<Read> next(int peer);
  // Reads the blocks of `kind` for this gather from every rank of `from`, dropping those that fail
  // (why[r]); blocks[r] gets what arrived. Returns whether a peer released this rank.
  bool collect(Kind kind, const std::string& tag, const std::vector<int>& from, double timeout_secs,
               std::vector<std::vector<std::byte>>& blocks, std::vector<std::string>& why);
  void release(int peer);

  std::unique_ptr<Transport> channel_;
  std::unique_ptr<SymmetricMemory> mailboxes_;
  std::size_t capacity_;
  std::size_t slot_bytes_;
  int rank_, size_;
  std::uint64_t gathers_ = 0;
  std::vector<std::uint64_t> sent_, consumed_;  // [peer]: blocks sent to it / read from it
  std::vector<char> released_;                  // [peer]: told that this rank dropped it
  bool left_ = false;
  bool all_left_ = false;  // leave() saw every peer leave or go
};

}  // namespace moe_ep::comm
