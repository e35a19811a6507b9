// Logging in the manner of NCCL_DEBUG: a level, subsystems, a destination, and a prefix that
// names the host, process, thread and rank of every line.
//
// MOE_EP_DEBUG sets the level: VERSION (the version line only), WARN, INFO, TRACE, each printing
// what the one before prints and more (case-insensitive; 0, empty or unset = off, 1 = INFO).
// MOE_EP_DEBUG_SUBSYS selects the subsystems of INFO and TRACE lines (comma list of INIT, COLL,
// P2P, NET, ALLOC, ENV, ALL; a leading ^ selects all but the listed ones; default INIT,ENV); WARN
// lines are never filtered. MOE_EP_DEBUG_FILE sends the lines to a file (%h = host name, %p =
// process id, %% = %), appended to; stderr when unset, and when the file cannot be opened (with a
// warning on stderr). The settings are read at the first log call and again after an
// env::ScopedOverride was made or restored; an invalid value prints one warning on stderr that
// names it and the accepted values, and counts as its default.
//
// Every line is "host:pid:tid [rank] moe-ep LEVEL SUBSYS message" and is written whole; lines of
// concurrent threads never interleave. The first line of every log (stderr or a file) is the
// version line "host:pid:tid [rank] moe-ep version X.Y.Z". The rank is the calling thread's
// (set_thread_rank: the in-process ranks' threads; worker threads inherit their creator's), else
// the process's (set_process_rank: processes of the host and MPI transports), else "-".
// While the settings are unchanged, enabled() costs a few relaxed or acquire atomic loads and
// comparisons, and a disabled line is never formatted. Logging never throws.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/failure.hh"

namespace moe_ep::core {

enum class Level : int { kOff = 0, kVersion = 1, kWarn = 2, kInfo = 3, kTrace = 4 };

enum class Subsys : unsigned {
  kInit = 1u << 0,
  kColl = 1u << 1,
  kP2P = 1u << 2,
  kNet = 1u << 3,
  kAlloc = 1u << 4,
  kEnv = 1u << 5,
};
inline constexpr unsigned kAllSubsys = (1u << 6) - 1;
inline constexpr unsigned kDefaultSubsys = static_cast<unsigned>(Subsys::kInit) | static_cast<unsigned>(Subsys::kEnv);

std::string_view level_name(Level level);    // "WARN", "INFO", ...
std::string_view subsys_name(Subsys subsys);  // "INIT", "COLL", ...

// The parsers of the three variables (the values as given; InvalidArgument names the variable,
// the value and what it accepts).
Level parse_level(std::string_view value);
unsigned parse_subsys(std::string_view value);  // a mask of Subsys bits
std::string expand_file_name(std::string_view pattern);

// The rank shown in this thread's lines; -1 = unknown (then the process's rank, if set).
void set_thread_rank(int rank);
int thread_rank();
void set_process_rank(int rank);
// The rank a line of this thread shows: the thread's, else the process's, else -1.
int current_rank();

// Sets the calling thread's rank for its lifetime and restores the previous one.
class ScopedThreadRank {
 public:
  explicit ScopedThreadRank(int rank) : previous_(thread_rank()) { set_thread_rank(rank); }
  ~ScopedThreadRank() { set_thread_rank(previous_); }
  ScopedThreadRank(const ScopedThreadRank&) = delete;
  ScopedThreadRank& operator=(const ScopedThreadRank&) = delete;

 private:
  int previous_;
};

// "host:pid:tid [rank] moe-ep" for the calling thread.
std::string line_prefix();

namespace detail {
inline constexpr std::uint64_t kNeverLoaded = ~std::uint64_t{0};
extern std::atomic<std::uint64_t> loaded_generation;
extern std::atomic<int> level;
extern std::atomic<unsigned> mask;
std::uint64_t settings_generation();
void load();
void write(Level level, Subsys subsys, std::string_view message);
void write_always(Subsys subsys, std::string_view message);
}  // namespace detail

inline bool enabled(Level level, Subsys subsys) {
  if (detail::loaded_generation.load(std::memory_order_acquire) != detail::settings_generation()) detail::load();
  if (static_cast<int>(level) > detail::level.load(std::memory_order_relaxed)) return false;
  return level == Level::kWarn || (detail::mask.load(std::memory_order_relaxed) & static_cast<unsigned>(subsys)) != 0;
}

// Formats and writes one line when (level, subsys) is enabled; never throws.
template <class... Args>
void log(Level level, Subsys subsys, fmt::format_string<Args...> format, Args&&... args) noexcept {
  if (!enabled(level, subsys)) return;
  // Out of memory while logging: the line is lost, nothing else.
  (void)capture([&] { detail::write(level, subsys, fmt::format(format, std::forward<Args>(args)...)); });
}

template <class... Args>
void warn(Subsys subsys, fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kWarn, subsys, format, std::forward<Args>(args)...);
}
// A warning about a misuse the caller must hear of: a WARN line in the log when WARN is
// enabled, else the same line on stderr.
template <class... Args>
void warn_always(Subsys subsys, fmt::format_string<Args...> format, Args&&... args) noexcept {
  (void)capture([&] { detail::write_always(subsys, fmt::format(format, std::forward<Args>(args)...)); });
}
template <class... Args>
void info(Subsys subsys, fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kInfo, subsys, format, std::forward<Args>(args)...);
}
template <class... Args>
void trace(Subsys subsys, fmt::format_string<Args...> format, Args&&... args) noexcept {
  log(Level::kTrace, subsys, format, std::forward<Args>(args)...);
}

}  // namespace moe_ep::core
