#include "progress.hh"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

namespace moe_ep::tools::progress {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<bool> on{false};
std::mutex mutex;
Clock::time_point started, last_written;
std::string last_phase;
bool shown = false;

}  // namespace

void start(bool wanted) {
  std::lock_guard lock(mutex);
  on = wanted && isatty(STDERR_FILENO) == 1;
  started = Clock::now();
  last_phase.clear();
  shown = false;
}

bool enabled() { return on; }

void show(std::string_view phase, int step, int steps) {
  if (!on) return;
  std::lock_guard lock(mutex);
  const auto now = Clock::now();
  if (shown && phase == last_phase && step != steps && now - last_written < std::chrono::milliseconds(100)) return;
  const double elapsed = std::chrono::duration<double>(now - started).count();
  const std::string line = steps > 0 ? fmt::format("{} {}/{} ({:.1f} s)", phase, step, steps, elapsed)
                                     : fmt::format("{} ({:.1f} s)", phase, elapsed);
  std::fprintf(stderr, "\r\033[K%s", line.c_str());
  std::fflush(stderr);
  last_phase = phase;
  last_written = now;
  shown = true;
}

void clear() {
  if (!on) return;
  std::lock_guard lock(mutex);
  if (!shown) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  shown = false;
}

}  // namespace moe_ep::tools::progress
