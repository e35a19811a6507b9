// Polling with backoff and a deadline, for waits on peers.
//
// Backoff spins briefly with a pause instruction, then yields the core, then sleeps in short steps
// so that oversubscribed ranks (more ranks than cores) leave the CPU to the rank being waited for.
// The clock is read only every few iterations. wait_for_arrivals is the wait of the transports
// whose ranks share memory (a gather's epochs, the signal counters): it fails at once when a rank
// it waits for left, else when the timeout expires, and the error names exactly the ranks that
// did not arrive (peer_failure.hh).
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "comm/transport.hh"
#include "core/timeout.hh"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moe_ep::comm {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Backoff {
 public:
  // Timeouts of core::kNeverSecs and more (and anything not a number) never expire: the deadline
  // saturates instead of overflowing the clock.
  explicit Backoff(double timeout_secs) : start_(std::chrono::steady_clock::now()), deadline_(deadline(timeout_secs)) {}

  // Waits a little. Returns false once the deadline has passed.
  bool pause() {
    ++iterations_;
    if (iterations_ < 64) {
      cpu_relax();
      return true;
    }
    if (iterations_ < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (iterations_ % 16 != 0) return true;
    return std::chrono::steady_clock::now() < deadline_;
  }

  double elapsed_secs() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  bool expired() const { return std::chrono::steady_clock::now() >= deadline_; }

 private:
  std::chrono::steady_clock::time_point deadline(double timeout_secs) const {
    if (!(timeout_secs < core::kNeverSecs)) return std::chrono::steady_clock::time_point::max();
    return start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(std::max(timeout_secs, 0.0)));
  }

  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point deadline_;
  long iterations_ = 0;
};

// Waits until arrived(i) holds for every i < count, where i stands for rank rank_of(i). While it
// waits for i it asks left(rank_of(i), poll) whether that rank left (poll counts the polls of this
// wait, for checks too costly to make on every one); when one left, or the timeout expired, the
// ranks that have still not arrived make the error (fail_wait: PeerError when some of them
// departed, by transport.departure(), else TimeoutError). When all arrived after all, it returns.
template <class RankOf, class Arrived, class Left>
void wait_for_arrivals(const Transport& transport, int count, RankOf rank_of, Arrived arrived, Left left,
                       const Wait& wait) {
  Backoff backoff(wait.timeout_secs);
  unsigned polls = 0;
  for (int i = 0; i < count; ++i) {
    while (!arrived(i)) {
      if (left(rank_of(i), ++polls) || !backoff.pause()) {
        std::vector<int> missing;
        for (int j = 0; j < count; ++j)
          if (!arrived(j)) missing.push_back(rank_of(j));
        if (missing.empty()) break;  // everyone arrived after all
        fail_wait(transport.rank(), wait, missing, backoff.elapsed_secs(),
                  [&](int r) { return transport.departure(r); });
      }
    }
  }
}

// The wait of wait_for_arrivals without its failure: waits until every i < count arrived or its
// rank left, or the timeout expired, and returns the ranks that did not arrive (empty when all
// did). For waits that go on without the ranks that stopped (TolerantGather).
template <class RankOf, class Arrived, class Left>
std::vector<int> wait_for_arrivals_or_departures(int count, RankOf rank_of, Arrived arrived, Left left,
                                                 double timeout_secs) {
  Backoff backoff(timeout_secs);
  unsigned polls = 0;
  std::vector<char> out(static_cast<size_t>(count), 0);  // left: not waited for any more
  for (bool expired = false;;) {
    bool waiting = false;
    for (int i = 0; i < count; ++i) {
      if (out[static_cast<size_t>(i)] || arrived(i)) continue;
      if (left(rank_of(i), ++polls)) {
        out[static_cast<size_t>(i)] = 1;
        continue;
      }
      waiting = true;
    }
    if (!waiting || expired) break;
    expired = !backoff.pause();
  }
  std::vector<int> missing;
  for (int i = 0; i < count; ++i)
    if (!arrived(i)) missing.push_back(rank_of(i));
  return missing;
}

}  // namespace moe_ep::comm
