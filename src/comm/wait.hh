// Polling with backoff and a deadline, for waits on peers.
//
// Spins briefly with a pause instruction, then yields the core, then sleeps in short steps so
// that oversubscribed ranks (more ranks than cores) leave the CPU to the rank being waited for.
// The clock is read only every few iterations.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

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

}  // namespace moe_ep::comm
