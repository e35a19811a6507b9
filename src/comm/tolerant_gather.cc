#include "comm/tolerant_gather.hh"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/arith.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm {
namespace {

// Mailbox slots per (receiver, source) pair. A peer is at most a few blocks ahead of this rank's
// reading: it waits for this rank's block in each round while it counts on it (two rounds per
// call), then sends at most a release and a leave block; eight slots leave room to spare.
constexpr std::uint64_t kSlots = 8;
constexpr std::size_t kTagBytes = 32;

using Clock = std::chrono::steady_clock;

double seconds_left(Clock::time_point deadline) {
  return std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
}

}  // namespace

struct TolerantGather::Header {
  std::uint64_t stamp;   // the block's number among those its sender sent this receiver (1, 2, ...)
  std::uint64_t number;  // the sender's gather number
  std::uint32_t kind;
  std::uint32_t bytes;   // of the payload that follows
  char tag[kTagBytes];
};

TolerantGather::TolerantGather(Transport& parent, std::size_t block_capacity, const Wait& setup)
    : capacity_(block_capacity), rank_(parent.rank()), size_(parent.size()) {
  slot_bytes_ = core::round_up(sizeof(Header) + capacity_, 64);
  channel_ = parent.duplicate(setup);
  // Faulted in by use: only the slots that carry blocks become resident.
  mailboxes_ = channel_->allocate_symmetric(static_cast<std::size_t>(size_) * kSlots * slot_bytes_, setup, false);
  sent_.assign(static_cast<size_t>(size_), 0);
  consumed_.assign(static_cast<size_t>(size_), 0);
  released_.assign(static_cast<size_t>(size_), 0);
}

TolerantGather::~TolerantGather() {
  // Peers may still write into the mailboxes unless every one of them left: keep them mapped.
  if (!all_left_) retire(std::shared_ptr<SymmetricMemory>(std::move(mailboxes_)));
}

void TolerantGather::send(int peer, Kind kind, std::span<const std::byte> payload, const std::string& tag) {
  if (payload.size() > capacity_)
    throw StateError(fmt::format("[rank {}] {}: a block of {} bytes exceeds the exchange's capacity of {} bytes", rank_,
                                 tag, payload.size(), capacity_));
  std::vector<std::byte> message(sizeof(Header) + payload.size());
  Header h{};
  h.stamp = ++sent_[static_cast<size_t>(peer)];
  h.number = gathers_;
  h.kind = static_cast<std::uint32_t>(kind);
  h.bytes = static_cast<std::uint32_t>(payload.size());
  std::strncpy(h.tag, tag.c_str(), kTagBytes - 1);
  std::memcpy(message.data(), &h, sizeof h);
  if (!payload.empty()) std::memcpy(message.data() + sizeof h, payload.data(), payload.size());
  const std::size_t offset = (static_cast<std::size_t>(rank_) * kSlots + h.stamp % kSlots) * slot_bytes_;
  channel_->put(peer, *mailboxes_, offset, message.data(), message.size());
  channel_->signal(peer);
}

std::optional<TolerantGather::Read> TolerantGather::next(int peer) {
  const std::uint64_t target = ++consumed_[static_cast<size_t>(peer)];
  const std::byte* slot =
      mailboxes_->local() + (static_cast<std::size_t>(peer) * kSlots + target % kSlots) * slot_bytes_;
  Header h;
  std::memcpy(&h, slot, sizeof h);
  if (h.stamp != target || h.bytes > capacity_) return std::nullopt;  // overwritten by a later block
  Read r{static_cast<Kind>(h.kind), h.number, std::string(h.tag, strnlen(h.tag, kTagBytes)), {}};
  r.payload.assign(slot + sizeof h, slot + sizeof h + h.bytes);
  return r;
}

void TolerantGather::release(int peer) {
  if (released_[static_cast<size_t>(peer)] || channel_->departure(peer)) return;
  released_[static_cast<size_t>(peer)] = 1;
  send(peer, Kind::kRelease, {}, "release");
}

// Each outcome is named where it is decided.
bool TolerantGather::collect(Kind kind, const std::string& tag, const std::vector<int>& from, double timeout_secs,
                             std::vector<std::vector<std::byte>>& blocks, std::vector<std::string>& why) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_secs));
  bool released_me = false;
  std::vector<int> pending = from;
  while (!pending.empty()) {
    std::vector<std::uint64_t> targets;
    for (int p : pending) targets.push_back(consumed_[static_cast<size_t>(p)] + 1);
    const std::vector<int> missing = channel_->wait_signals_tolerant(pending, targets, {tag.c_str(), seconds_left(deadline)});
    std::vector<int> again;
    for (int p : pending) {
      std::string& reason = why[static_cast<size_t>(p)];
      if (std::find(missing.begin(), missing.end(), p) != missing.end()) {
        const auto gone = channel_->departure(p);
        reason = gone ? fmt::format("rank {} left the group ({})", p, gone->reason)
                      : fmt::format("rank {} did not arrive within {:g} s", p, timeout_secs);
        continue;
      }
      const std::optional<Read> read = next(p);
      if (!read) {
        reason = fmt::format("rank {} is out of step (its blocks to this rank were overwritten)", p);
      } else if (read->kind == kind && read->number == gathers_ && read->tag == tag) {
        blocks[static_cast<size_t>(p)] = read->payload;
      } else if ((read->kind == Kind::kBlock || read->kind == Kind::kVerdict) && read->number < gathers_) {
        again.push_back(p);  // a block of an earlier call this rank did not wait for
      } else if (read->kind == Kind::kRelease) {
        reason = fmt::format("rank {} stopped counting on this rank", p);
        released_me = true;
      } else if (read->kind == Kind::kLeave) {
        reason = fmt::format("rank {} left the exchange (its buffer was destroyed)", p);
      } else {
        reason = fmt::format("rank {} is in another call ({} #{}, this rank: {} #{})", p, read->tag, read->number, tag,
                             gathers_);
      }
    }
    pending = std::move(again);
  }
  return released_me;
}

// The two rounds (blocks, verdicts) and the decision, in the order the header states them.
TolerantGather::Result TolerantGather::gather(std::span<const std::byte> block, const std::string& tag,
                                              const std::vector<char>& live, double timeout_secs) {
  if (left_)
    throw StateError(fmt::format("[rank {}] {}: this rank left the exchange (its buffer was destroyed)", rank_, tag));
  ++gathers_;
  const auto R = static_cast<size_t>(size_);
  Result result{std::vector<char>(R, 0), std::vector<std::vector<std::byte>>(R), std::vector<std::string>(R)};
  std::vector<std::string> why(R);
  std::vector<int> peers;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || !live[static_cast<size_t>(p)]) continue;
    if (const auto gone = channel_->departure(p)) {
      why[static_cast<size_t>(p)] = fmt::format("rank {} left the group ({})", p, gone->reason);
      continue;
    }
    peers.push_back(p);
  }
  // Round 1: the blocks.
  for (int p : peers) send(p, Kind::kBlock, block, tag);
  bool dropped_me = collect(Kind::kBlock, tag, peers, timeout_secs, result.blocks, why);
  // Round 2: the verdicts (1: not counted on) of the ranks whose blocks arrived.
  std::vector<std::byte> verdict(R);
  std::vector<int> voters;
  for (std::size_t r = 0; r < R; ++r) verdict[r] = std::byte{!live[r] || !why[r].empty() ? std::uint8_t{1} : std::uint8_t{0}};
  verdict[static_cast<size_t>(rank_)] = std::byte{dropped_me ? std::uint8_t{1} : std::uint8_t{0}};
  for (int p : peers)
    if (why[static_cast<size_t>(p)].empty()) voters.push_back(p);
  for (int p : voters) send(p, Kind::kVerdict, verdict, tag);
  std::vector<std::vector<std::byte>> verdicts(R);
  dropped_me = collect(Kind::kVerdict, tag, voters, timeout_secs, verdicts, why) || dropped_me;
  std::vector<char> out(R);
  for (std::size_t r = 0; r < R; ++r) out[r] = verdict[r] != std::byte{0} || !why[r].empty();
  for (int p : voters) {
    const auto& v = verdicts[static_cast<size_t>(p)];
    for (std::size_t r = 0; r < v.size() && r < R; ++r)
      if (v[r] != std::byte{0} && !out[r]) {
        out[r] = 1;
        if (why[r].empty()) why[r] = fmt::format("rank {} no longer counts on rank {}", p, r);
      }
  }
  dropped_me = dropped_me || out[static_cast<size_t>(rank_)];
  for (std::size_t r = 0; r < R; ++r) {
    const bool member = static_cast<int>(r) == rank_ || (!dropped_me && !out[r]);
    result.member[r] = member ? 1 : 0;
    if (member || !live[r]) continue;
    result.dropped[r] = why[r].empty() ? fmt::format("the other ranks no longer count on rank {} (this rank)", rank_)
                                        : why[r];
    release(static_cast<int>(r));
  }
  result.blocks[static_cast<size_t>(rank_)].assign(block.begin(), block.end());
  for (std::size_t r = 0; r < R; ++r)
    if (!result.member[r]) result.blocks[r].clear();
  return result;
}

bool TolerantGather::leave(double timeout_secs) {
  if (left_) return all_left_;
  left_ = true;
  std::vector<int> pending;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || channel_->departure(p)) continue;
    send(p, Kind::kLeave, {}, "leave");
    pending.push_back(p);
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_secs));
  while (!pending.empty()) {
    std::vector<std::uint64_t> targets;
    for (int p : pending) targets.push_back(consumed_[static_cast<size_t>(p)] + 1);
    const std::vector<int> missing = channel_->wait_signals_tolerant(pending, targets, {"leave", seconds_left(deadline)});
    std::vector<int> again;
    for (int p : pending) {
      if (std::find(missing.begin(), missing.end(), p) != missing.end()) {
        if (!channel_->departure(p)) return false;  // still there after the timeout
        continue;
      }
      const std::optional<Read> read = next(p);
      if (!read || read->kind != Kind::kLeave) again.push_back(p);  // an earlier block: read on
    }
    pending = std::move(again);
  }
  all_left_ = true;
  return true;
}

}  // namespace moe_ep::comm
