#include "comm/mpi/messenger.hh"

#include <signal.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <numeric>

#include "comm/control_page.hh"
#include "comm/mpi/record_wire.hh"
#include "comm/wait.hh"
#include "core/log.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm::mpi {
using namespace wire;
// Keeps a message buffer that MPI may still read (a send to a peer that is gone) alive, and
// reachable, until the process exits.
void keep_until_exit(Bytes buffer) {
  static std::mutex mutex;
  static auto* kept = new std::vector<Bytes>();  // reachable until exit
  std::lock_guard lock(mutex);
  kept->push_back(std::move(buffer));
}

std::set<Messenger*>& messengers() {
  static auto* all = new std::set<Messenger*>();
  return *all;
}

std::mutex& mpi_mutex() {
  static std::mutex m;
  return m;
}

void check_mpi(int rc, const char* call, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw StateError(fmt::format("[rank {}] {} failed: {}", rank, call, std::string(text, static_cast<size_t>(length))));
}

Messenger::Messenger(MPI_Comm comm, int rank, int size)
    : comm_(comm),
      rank_(rank),
      size_(size),
      inflight_(static_cast<size_t>(size), 0),
      chunk_bytes_(static_cast<std::size_t>(std::max<std::int64_t>(env::get(env::kMpiChunkBytes), 4096))),
      send_from_source_(env::get(env::kMpiSendFromSource)),
      chunks_(static_cast<size_t>(size)),
      sent_records_(static_cast<size_t>(size), 0),
      sources_(static_cast<size_t>(size)) {
  {
    std::lock_guard lock(mpi_mutex());
    messengers().insert(this);
  }
  const std::int64_t requested = env::get(env::kMpiChunkBytes);
  if (requested < 4096)
    core::warn(core::Subsys::kNet, "MOE_EP_MPI_CHUNK_BYTES = {} is below 4096: 4096 bytes per scale-out message",
               requested);
}

Messenger::~Messenger() {
  {
    std::lock_guard lock(mpi_mutex());
    messengers().erase(this);
  }
  if (received_in_place_ + received_copied_ > 0)
    core::info(core::Subsys::kNet, "scale-out record messages received: {} in place, {} copied into place",
               received_in_place_, received_copied_);
  drain(1.0);
}

void Messenger::drain(double secs) {
  std::lock_guard lock(mpi_mutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // nothing may be called any more
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  while (!pending_.empty() && std::chrono::steady_clock::now() < deadline) {
    progress();
    if (!pending_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Whatever is left goes to a peer that is gone: let MPI drop it, keep the buffers alive.
  for (Pending& p : pending_) {
    MPI_Request_free(&p.request);
    keep_until_exit(std::move(p.buffer));
  }
  pending_.clear();
}


void Messenger::wait_until(const Wait& wait, const std::function<bool()>& done,
                           const std::function<std::vector<int>()>& missing, bool channel_wide) {
  Backoff backoff(wait.timeout_secs);
  auto last_check = std::chrono::steady_clock::now();
  // What this wait waits for, for ranks that ask (see the top of messenger.hh).
  struct Waiting {
    std::vector<int>& now;
    ~Waiting() { now.clear(); }
  } waiting_now{waiting_now_};
  {
    std::lock_guard lock(mpi_mutex());
    waiting_now_ = missing();  // from the start: a query answered now must not read "nobody"
  }
  for (;;) {
    {
      std::lock_guard lock(mpi_mutex());
      progress();
      if (done()) return;
    }
    bool expired = !backoff.pause();
    const auto now = std::chrono::steady_clock::now();
    const bool periodic = now - last_check > std::chrono::milliseconds(50);
    std::vector<int> waiting;
    bool any_gone = false, channel_left = false;
    {
      std::lock_guard lock(mpi_mutex());
      if (done()) return;
      if (periodic) {
        // A rank waiting here may be asked on another channel whom it waits for.
        for (Messenger* m : messengers())
          if (m != this) m->answer_queries();
      }
      if (!abandoned_.empty() || expired || periodic) {
        waiting = missing();
        waiting_now_ = waiting;
        for (int r : waiting) any_gone = any_gone || abandoned_.count(r) != 0;
        channel_left = channel_wide && !abandoned_.empty() && blocked_by_notice(waiting);
      }
    }
    if (!any_gone && (expired || periodic)) {
      last_check = now;
      for (int r : waiting) any_gone = any_gone || gone(r);
    }
    if (expired || any_gone || (channel_left && !waiting.empty())) {
      if (waiting.empty()) return;  // everything arrived after all
      // Before naming them, ask the ranks it waited for whom they wait for (at most kChainSecs):
      // the ones that answer are alive and stuck behind others.
      if (expired && !any_gone) ask_whom_they_wait_for(waiting, kChainSecs);
      fail(wait, waiting, backoff.elapsed_secs());
    }
  }
}

std::vector<std::vector<std::byte>> Messenger::gather(std::span<const int> members, int tag, std::uint64_t epoch,
                                                      std::span<const std::byte> mine, const Wait& wait) {
  std::vector<std::vector<std::byte>> blocks(members.size());
  std::vector<bool> have(members.size(), false);
  {
    std::lock_guard lock(mpi_mutex());
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] == rank_) {
        blocks[i].assign(mine.begin(), mine.end());
        have[i] = true;
        continue;
      }
      Bytes message(sizeof epoch + mine.size());
      std::memcpy(message.data(), &epoch, sizeof epoch);
      if (!mine.empty()) std::memcpy(message.data() + sizeof epoch, mine.data(), mine.size());
      send(members[i], tag, std::move(message), false);
    }
  }
  auto receive_some = [&] {
    bool all = true;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (have[i]) continue;
      Bytes data;
      if (receive(members[i], tag, data) < 0) {
        all = false;
        continue;
      }
      std::uint64_t theirs = 0;
      if (data.size() >= sizeof theirs) std::memcpy(&theirs, data.data(), sizeof theirs);
      if (data.size() < sizeof theirs || theirs != epoch)
        throw StateError(fmt::format("[rank {}] {}: rank {} sent collective number {} while this rank is at {}: the "
                                     "ranks do not call collectives in the same order",
                                     rank_, wait.phase, members[i], theirs, epoch));
      blocks[i].assign(data.begin() + sizeof theirs, data.end());
      have[i] = true;
    }
    return all;
  };
  wait_until(
      wait, receive_some, [&] {
        std::vector<int> missing;
        for (std::size_t i = 0; i < members.size(); ++i)
          if (!have[i]) missing.push_back(members[i]);
        return missing;
      });
  return blocks;
}

void Messenger::register_memory(std::uint32_t id, std::byte* base, std::size_t bytes) {
  std::lock_guard lock(mpi_mutex());
  memories_[id] = {base, bytes};
}

void Messenger::unregister_memory(std::uint32_t id) {
  std::lock_guard lock(mpi_mutex());
  memories_.erase(id);
}

void Messenger::set_inflight_limit(int per_peer, const Wait& wait) {
  std::lock_guard lock(mpi_mutex());
  inflight_limit_ = std::max(1, per_peer);
  send_wait_ = wait;
}

void Messenger::signal(int peer) {
  std::lock_guard lock(mpi_mutex());
  flush(peer);
  Bytes message(sizeof(std::uint64_t));
  std::memcpy(message.data(), &sent_records_[static_cast<size_t>(peer)], sizeof(std::uint64_t));
  send(peer, kTagSignal, std::move(message), false);
  progress();
}

std::byte* Messenger::destination(int source, std::uint32_t memory, std::uint64_t offset, std::uint64_t bytes) {
  const auto it = memories_.find(memory);
  if (it == memories_.end())
    throw StateError(fmt::format("[rank {}] rank {} put into symmetric memory #{} that this rank does not hold", rank_,
                                 source, memory));
  if (offset > it->second.second || bytes > it->second.second - offset)
    throw StateError(fmt::format("[rank {}] rank {} put {} bytes at offset {} of a {}-byte region", rank_, source, bytes,
                                 offset, it->second.second));
  return it->second.first + offset;
}

std::uint64_t Messenger::read_pieces(int source, std::span<const std::byte> message) {
  std::uint64_t number = 0, count = 0;
  if (message.size() >= kPrefix) {
    std::memcpy(&number, message.data(), sizeof number);
    std::memcpy(&count, message.data() + sizeof number, sizeof count);
  }
  if (message.size() < kPrefix || count > kMaxPieces || message.size() - kPrefix < count * sizeof(Piece))
    throw StateError(fmt::format("[rank {}] malformed record message from rank {}", rank_, source));
  pieces_in_.resize(count);
  std::memcpy(pieces_in_.data(), message.data() + kPrefix, count * sizeof(Piece));
  return number;
}

void Messenger::apply(int source, std::span<const std::byte> data) {
  std::size_t at = 0;
  for (const Piece& piece : pieces_in_) {
    if (piece.bytes > data.size() - at)
      throw StateError(fmt::format("[rank {}] malformed record message from rank {}", rank_, source));
    std::memcpy(destination(source, piece.memory, piece.offset, piece.bytes), data.data() + at, piece.bytes);
    at += piece.bytes;
  }
  if (at != data.size()) throw StateError(fmt::format("[rank {}] malformed record message from rank {}", rank_, source));
}

void Messenger::receive_in_place(int source, std::uint64_t number) {
  // Every piece is checked before anything is posted.
  std::size_t total = 0;
  std::vector<std::byte*> into(pieces_in_.size());
  for (std::size_t i = 0; i < pieces_in_.size(); ++i) {
    const Piece& piece = pieces_in_[i];
    into[i] = destination(source, piece.memory, piece.offset, piece.bytes);
    total += piece.bytes;
  }
  if (total > static_cast<std::size_t>(INT_MAX))
    throw StateError(fmt::format("[rank {}] record message of {} bytes from rank {} is too large", rank_, total, source));
  MPI_Request request = MPI_REQUEST_NULL;
  if (pieces_in_.size() == 1) {
    check_mpi(MPI_Irecv(into.front(), static_cast<int>(total), MPI_BYTE, source, kTagPayload, comm_, &request),
              "MPI_Irecv", rank_);
  } else {
    // Several pieces: one receive into all of them, through an indexed datatype of absolute addresses.
    // MPI does not allow a receive into overlapping bytes (puts between two signals are disjoint).
    std::vector<std::size_t> order(pieces_in_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    auto at = [&](std::size_t i) { return reinterpret_cast<std::uintptr_t>(into[i]); };
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return at(a) < at(b); });
    for (std::size_t i = 1; i < order.size(); ++i)
      if (at(order[i - 1]) + pieces_in_[order[i - 1]].bytes > at(order[i]))
        throw StateError(fmt::format("[rank {}] record message from rank {} puts overlapping pieces", rank_, source));
    std::vector<int> lengths(pieces_in_.size());
    std::vector<MPI_Aint> addresses(pieces_in_.size());
    for (std::size_t i = 0; i < pieces_in_.size(); ++i) {
      lengths[i] = static_cast<int>(pieces_in_[i].bytes);
      check_mpi(MPI_Get_address(into[i], &addresses[i]), "MPI_Get_address", rank_);
    }
    MPI_Datatype scattered = MPI_DATATYPE_NULL;
    check_mpi(MPI_Type_create_hindexed(static_cast<int>(pieces_in_.size()), lengths.data(), addresses.data(), MPI_BYTE,
                                       &scattered),
              "MPI_Type_create_hindexed", rank_);
    int rc = MPI_Type_commit(&scattered);
    if (rc == MPI_SUCCESS) rc = MPI_Irecv(MPI_BOTTOM, 1, scattered, source, kTagPayload, comm_, &request);
    MPI_Type_free(&scattered);  // released by MPI once the receive is done
    check_mpi(rc, "MPI_Irecv", rank_);
  }
  incoming_.push_back({request, source, number});
}

void Messenger::complete(int source, std::uint64_t number) {
  Source& s = sources_[static_cast<size_t>(source)];
  if (number != s.applied) {
    s.early.insert(number);
    return;
  }
  ++s.applied;
  while (!s.early.empty() && *s.early.begin() == s.applied) {
    s.early.erase(s.early.begin());
    ++s.applied;
  }
}

int Messenger::receive(int source, int tag, Bytes& buffer) {
  int flag = 0;
  MPI_Message message;
  MPI_Status status;
  check_mpi(MPI_Improbe(source, tag, comm_, &flag, &message, &status), "MPI_Improbe", rank_);
  if (!flag) return -1;
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  buffer.resize(static_cast<size_t>(count));
  check_mpi(MPI_Mrecv(buffer.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE), "MPI_Mrecv", rank_);
  return status.MPI_SOURCE;
}

template <class Transfers, class Finish>
void Messenger::finish_completed(Transfers& transfers, const char* test, Finish finish) {
  if (transfers.empty()) return;
  // One MPI_Testsome for all of them: every test call drives MPI's progress engine (on a network,
  // a poll of its sockets), so testing requests one by one multiplies the cost of every poll.
  requests_.clear();
  for (const auto& t : transfers) requests_.push_back(t.request);
  int done = 0;
  completed_.resize(requests_.size());
  check_mpi(MPI_Testsome(static_cast<int>(requests_.size()), requests_.data(), &done, completed_.data(),
                         MPI_STATUSES_IGNORE),
            test, rank_);
  if (done == MPI_UNDEFINED || done == 0) return;
  std::sort(completed_.begin(), completed_.begin() + done);
  int index = 0, next = 0;
  for (auto it = transfers.begin(); it != transfers.end(); ++index) {
    if (next < done && completed_[static_cast<size_t>(next)] == index) {
      ++next;
      it->request = MPI_REQUEST_NULL;
      finish(*it);
      it = transfers.erase(it);
    } else {
      ++it;
    }
  }
}

void Messenger::count_signals() {
  for (Source& s : sources_)
    while (!s.thresholds.empty() && s.thresholds.front() <= s.applied) {
      ++s.signals;
      s.thresholds.pop_front();
    }
}

void Messenger::progress() {
  finish_completed(pending_, "MPI_Testsome (send)", [&](Pending& sent) {
    if (!sent.record) return;
    --inflight_[static_cast<size_t>(sent.peer)];
    recycle(std::move(sent.buffer));
  });
  finish_completed(incoming_, "MPI_Testsome (receive)", [&](const Incoming& received) {
    complete(received.source, received.number);
    ++received_in_place_;
  });
  // Whether anything arrived at all: one probe, instead of one per kind of message.
  int arrived = 0;
  check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &arrived, MPI_STATUS_IGNORE), "MPI_Iprobe", rank_);
  if (!arrived) return count_signals();
  for (int source; (source = receive(MPI_ANY_SOURCE, kTagData, receive_)) >= 0;) {
    const std::uint64_t number = read_pieces(source, receive_);
    apply(source, std::span<const std::byte>(receive_).subspan(kPrefix + pieces_in_.size() * sizeof(Piece)));
    complete(source, number);
    ++received_copied_;
  }
  for (int source; (source = receive(MPI_ANY_SOURCE, kTagHeader, receive_)) >= 0;) {
    const std::uint64_t number = read_pieces(source, receive_);
    if (receive_.size() != kPrefix + pieces_in_.size() * sizeof(Piece) || pieces_in_.empty())
      throw StateError(fmt::format("[rank {}] malformed record header from rank {}", rank_, source));
    // The data is the next message with its tag from this source (MPI keeps their order).
    receive_in_place(source, number);
  }
  for (int source; (source = receive(MPI_ANY_SOURCE, kTagSignal, receive_)) >= 0;) {
    std::uint64_t threshold = 0;
    if (receive_.size() != sizeof threshold)
      throw StateError(fmt::format("[rank {}] malformed signal from rank {}", rank_, source));
    std::memcpy(&threshold, receive_.data(), sizeof threshold);
    sources_[static_cast<size_t>(source)].thresholds.push_back(threshold);
  }
  for (int source; (source = receive(MPI_ANY_SOURCE, kTagAbandon, receive_)) >= 0;) {
    quiet_ = false;
    std::uint32_t count = 0;
    if (receive_.size() >= sizeof count) std::memcpy(&count, receive_.data(), sizeof count);
    const std::size_t list = sizeof count + std::size_t{count} * sizeof(std::int32_t);
    if (receive_.size() < sizeof count || count > static_cast<std::uint32_t>(size_) || receive_.size() < list) {
      abandoned_.emplace(source, gave_up("(its message was malformed)", {}));
      continue;
    }
    std::vector<int> culprits;
    for (std::uint32_t i = 0; i < count; ++i) {
      std::int32_t c = 0;
      std::memcpy(&c, receive_.data() + sizeof count + i * sizeof c, sizeof c);
      if (c >= 0 && c < size_) culprits.push_back(c);
    }
    abandoned_.emplace(source, gave_up(std::string(reinterpret_cast<const char*>(receive_.data()) + list,
                                                   receive_.size() - list),
                                       std::move(culprits)));
  }
  answer_queries();
  for (int source; (source = receive(MPI_ANY_SOURCE, kTagWaiting, receive_)) >= 0;) {
    quiet_ = false;
    answered_.insert(source);
    std::uint32_t count = 0;
    if (receive_.size() >= sizeof count) std::memcpy(&count, receive_.data(), sizeof count);
    if (receive_.size() != sizeof count + std::size_t{count} * sizeof(std::int32_t) ||
        count > static_cast<std::uint32_t>(size_))
      continue;  // malformed: the chain is not followed through this rank
    std::vector<int> ranks;
    for (std::uint32_t i = 0; i < count; ++i) {
      std::int32_t w = 0;
      std::memcpy(&w, receive_.data() + sizeof count + i * sizeof w, sizeof w);
      if (w >= 0 && w < size_) ranks.push_back(w);
    }
    if (ranks.empty()) {
      waiting_for_.erase(source);
    } else {
      waiting_for_[source] = std::move(ranks);
    }
  }
  count_signals();
}

void Messenger::wait_signals(std::span<const int> peers, std::span<const std::uint64_t> targets, const Wait& wait) {
  auto reached = [&](std::size_t i) { return sources_[static_cast<size_t>(peers[i])].signals >= targets[i]; };
  wait_until(
      wait,
      [&] {
        for (std::size_t i = 0; i < peers.size(); ++i)
          if (!reached(i)) return false;
        return true;
      },
      [&] {
        std::vector<int> missing;
        for (std::size_t i = 0; i < peers.size(); ++i)
          if (!reached(i)) missing.push_back(peers[i]);
        return missing;
      });
}

std::vector<int> Messenger::wait_signals_tolerant(std::span<const int> peers, std::span<const std::uint64_t> targets,
                                                 const Wait& wait) {
  // Progress is driven while waiting, under the MPI lock, as in every wait of this messenger.
  return wait_for_arrivals_or_departures(
      static_cast<int>(peers.size()), [&](int i) { return peers[static_cast<size_t>(i)]; },
      [&](int i) {
        std::lock_guard lock(mpi_mutex());
        progress();
        return sources_[static_cast<size_t>(peers[static_cast<size_t>(i)])].signals >= targets[static_cast<size_t>(i)];
      },
      [&](int r, unsigned) {
        std::lock_guard lock(mpi_mutex());
        return departure_locked(r).has_value();
      },
      wait.timeout_secs);
}

}  // namespace moe_ep::comm::mpi
