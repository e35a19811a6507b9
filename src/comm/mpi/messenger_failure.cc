// The messenger's side of failures: departures (a notice that a member gave up, a process of this
// host that is gone), the notice this rank sends when it gives up, the errors of a wait that
// cannot complete, and the chains of waits (queries and answers); see messenger.hh.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstring>
#include <set>
#include <thread>

#include "comm/control_page.hh"
#include "comm/mpi/messenger.hh"
#include "comm/mpi/record_wire.hh"
#include "core/log.hh"

namespace moe_ep::comm::mpi {
using namespace wire;

bool Messenger::gone(int rank) const {
  if (!hosts_ || rank == rank_ || !hosts_->same_host(rank, rank_)) return false;
  return process_gone(hosts_->pids[static_cast<size_t>(rank)]);
}

std::optional<Departure> Messenger::departure_locked(int rank) {
  if (const auto it = abandoned_.find(rank); it != abandoned_.end()) return it->second;
  if (!gone(rank)) return std::nullopt;
  return Departure{fmt::format("was process {} on this host, which is gone", hosts_->pids[static_cast<size_t>(rank)]),
                   {}};
}

std::optional<Departure> Messenger::departure(int rank, bool probe) {
  std::lock_guard lock(mpi_mutex());
  if (probe) {
    try {
      progress();
    } catch (const std::exception&) {
      // A broken channel: what arrived so far has to do.
    }
  }
  return departure_locked(rank);
}

void Messenger::fail(const Wait& wait, const std::vector<int>& missing, double elapsed) {
  std::lock_guard lock(mpi_mutex());
  // A process that gave up usually said why before it went: take what arrived.
  try {
    progress();
  } catch (const std::exception&) {
  }
  auto departure = [&](int r) { return departure_locked(r); };
  // Ranks waited for that left: named by fail_wait (their root cause).
  for (int r : missing)
    if (departure_locked(r)) fail_wait(rank_, wait, missing, elapsed, departure);
  // Notices that name the ranks waited for (or ranks they wait for): this wait cannot complete.
  if (!abandoned_.empty() && blocked_by_notice(missing)) {
    std::vector<std::pair<int, Departure>> departed(abandoned_.begin(), abandoned_.end());
    fail_channel_left(rank_, wait, missing, departed);
  }
  fail_wait_chain(rank_, wait, missing, elapsed, [&](int r) -> const std::vector<int>* {
    const auto it = waiting_for_.find(r);
    return it == waiting_for_.end() ? nullptr : &it->second;
  });
}

bool Messenger::blocked_by_notice(const std::vector<int>& waiting) const {
  // The ranks the notices name: those that gave up and the culprits they named.
  std::set<int> failed;
  for (const auto& [r, why] : abandoned_) {
    failed.insert(r);
    failed.insert(why.culprits.begin(), why.culprits.end());
  }
  failed.erase(rank_);
  // A rank waited for is blocked if it failed, or waits (as it said) for one that is blocked.
  std::set<int> seen;
  std::vector<int> frontier = waiting;
  while (!frontier.empty()) {
    const int r = frontier.back();
    frontier.pop_back();
    if (!seen.insert(r).second) continue;
    if (failed.count(r)) return true;
    if (const auto it = waiting_for_.find(r); it != waiting_for_.end())
      frontier.insert(frontier.end(), it->second.begin(), it->second.end());
  }
  return false;
}

void Messenger::answer_query(int asker) {
  quiet_ = false;
  std::set<int> waited;
  for (const Messenger* m : messengers()) waited.insert(m->waiting_now_.begin(), m->waiting_now_.end());
  waited.erase(asker);
  core::trace(core::Subsys::kNet, "rank {} asked whom this rank waits for: ranks [{}]", asker, fmt::join(waited, ", "));
  const auto count = static_cast<std::uint32_t>(waited.size());
  Bytes message(sizeof count + count * sizeof(std::int32_t));
  std::memcpy(message.data(), &count, sizeof count);
  std::uint32_t i = 0;
  for (int r : waited) {
    const auto w = static_cast<std::int32_t>(r);
    std::memcpy(message.data() + sizeof count + i++ * sizeof w, &w, sizeof w);
  }
  send(asker, kTagWaiting, std::move(message), false);
}

void Messenger::answer_queries() {
  for (int source; (source = receive(MPI_ANY_SOURCE, kTagQuery, receive_)) >= 0;) answer_query(source);
}

void Messenger::ask_whom_they_wait_for(const std::vector<int>& missing, double secs) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  std::lock_guard lock(mpi_mutex());
  quiet_ = false;
  waiting_for_.clear();
  answered_.clear();
  std::set<int> asked;
  for (;;) {
    // Ask every rank of the chains known so far that was not asked yet (not gone, not named).
    std::vector<int> frontier = missing;
    std::set<int> seen;
    bool open = false;
    while (!frontier.empty()) {
      const int r = frontier.back();
      frontier.pop_back();
      if (r == rank_ || !seen.insert(r).second) continue;
      if (asked.insert(r).second && !gone(r) && !out_of_channel(r)) send(r, kTagQuery, Bytes(), false);
      if (const auto it = waiting_for_.find(r); it != waiting_for_.end()) {
        frontier.insert(frontier.end(), it->second.begin(), it->second.end());
      } else if (!answered_.count(r) && !gone(r) && !out_of_channel(r)) {
        open = true;  // no answer yet
      }
    }
    if (!open || std::chrono::steady_clock::now() >= deadline) {
      std::string answers;
      for (const auto& [r, ws] : waiting_for_) answers += fmt::format(" rank {} waits for [{}];", r, fmt::join(ws, ", "));
      core::trace(core::Subsys::kNet, "asked ranks [{}] whom they wait for; answered: [{}];{}", fmt::join(asked, ", "),
                  fmt::join(answered_, ", "), answers);
      return;
    }
    mpi_mutex().unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    mpi_mutex().lock();
    try {
      progress();
      for (Messenger* m : messengers())  // this rank, too, may be asked on its other channels
        if (m != this) m->answer_queries();
    } catch (const std::exception&) {
      return;  // a broken channel: what arrived has to do
    }
  }
}

void Messenger::abandon(const Departure& why, double secs) noexcept {
  try {
    std::lock_guard lock(mpi_mutex());
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (told_ || finalized) return;
    told_ = true;
    quiet_ = false;
    blamed_.insert(why.culprits.begin(), why.culprits.end());
    const auto count = static_cast<std::uint32_t>(why.culprits.size());
    Bytes message(sizeof count + count * sizeof(std::int32_t) + why.reason.size());
    std::memcpy(message.data(), &count, sizeof count);
    for (std::uint32_t i = 0; i < count; ++i) {
      const auto c = static_cast<std::int32_t>(why.culprits[i]);
      std::memcpy(message.data() + sizeof count + i * sizeof c, &c, sizeof c);
    }
    std::memcpy(message.data() + sizeof count + count * sizeof(std::int32_t), why.reason.data(), why.reason.size());
    // The notices to the ranks the failure named are sent (a stopped rank reads its notice when it
    // runs again) but not waited for: a rank that is gone or stuck never receives them.
    std::vector<MPI_Request> requests, unawaited;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || gone(r)) continue;
      MPI_Request request = MPI_REQUEST_NULL;
      if (MPI_Isend(message.data(), static_cast<int>(message.size()), MPI_BYTE, r, kTagAbandon, comm_, &request) ==
          MPI_SUCCESS)
        (blamed_.count(r) ? unawaited : requests).push_back(request);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
    for (;;) {
      int done = 0;
      if (MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
          done || std::chrono::steady_clock::now() >= deadline)
        break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    requests.insert(requests.end(), unawaited.begin(), unawaited.end());
    bool pending = false;
    for (MPI_Request& request : requests)
      if (request != MPI_REQUEST_NULL) {
        MPI_Request_free(&request);
        pending = true;
      }
    if (pending) keep_until_exit(std::move(message));
  } catch (...) {
    // No memory for the message: the peers will time out instead.
  }
}

}  // namespace moe_ep::comm::mpi
