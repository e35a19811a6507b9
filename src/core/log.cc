#include "core/log.hh"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <vector>

#include "core/host_name.hh"
#include "core/env_vars.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/version.hpp"

namespace moe_ep::core {
namespace {

constexpr std::string_view kSubsysNames[] = {"INIT", "COLL", "P2P", "NET", "ALLOC", "ENV"};

std::string upper(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::toupper(c); });
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

thread_local int t_rank = -1;
std::atomic<int> g_process_rank{-1};

// The destination and what was already said: guarded by state_mutex().
struct State {
  std::FILE* sink = stderr;
  std::string file_name;          // expanded; empty = stderr
  bool stderr_versioned = false;  // the version line went to stderr
  bool sink_versioned = false;    // ... to the current file
  std::set<std::string> warned;   // settings warnings already printed
};

std::mutex& state_mutex() {
  static auto* m = new std::mutex();  // never destroyed: threads may log during exit
  return *m;
}
State& state() {
  static auto* s = new State();
  return *s;
}

void put(std::FILE* f, const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), f);
  std::fflush(f);
}

std::string version_line() { return fmt::format("{} version {}\n", line_prefix(), version()); }

// The version opens every log.
void ensure_version(State& s) {
  if (s.sink == stderr) {
    if (!s.stderr_versioned) put(stderr, version_line());
    s.stderr_versioned = true;
  } else if (!s.sink_versioned) {
    put(s.sink, version_line());
    s.sink_versioned = true;
  }
}

std::string format_line(Level level, Subsys subsys, std::string_view message) {
  return fmt::format("{} {} {} {}\n", line_prefix(), level_name(level), subsys_name(subsys), message);
}

void write_locked(State& s, Level level, Subsys subsys, std::string_view message) {
  ensure_version(s);
  put(s.sink, format_line(level, subsys, message));
}

// A problem with the logging settings themselves: always on stderr (once per message), and in
// the log when there is one elsewhere.
void settings_warning(State& s, Level level, const std::string& message) {
  if (!s.warned.insert(message).second) return;
  if (level >= Level::kVersion && s.sink == stderr) ensure_version(s);
  put(stderr, format_line(Level::kWarn, Subsys::kEnv, message));
  if (level >= Level::kWarn && s.sink != stderr) write_locked(s, Level::kWarn, Subsys::kEnv, message);
}

void open_sink(State& s, Level level, const std::string& pattern) {
  const std::string name = pattern.empty() ? std::string() : expand_file_name(pattern);
  if (name == s.file_name) return;
  if (s.sink != stderr) std::fclose(s.sink);
  s.sink = stderr;
  s.file_name.clear();
  s.sink_versioned = false;
  if (name.empty()) return;
  std::FILE* f = std::fopen(name.c_str(), "a");
  if (f == nullptr) {
    settings_warning(s, level, fmt::format("MOE_EP_DEBUG_FILE={:?}: cannot open {:?} ({}); logging to stderr",
                                           pattern, name, std::strerror(errno)));
    return;
  }
  s.sink = f;
  s.file_name = name;
}

}  // namespace

std::string_view level_name(Level level) {
  switch (level) {
    case Level::kOff:
      return "OFF";
    case Level::kVersion:
      return "VERSION";
    case Level::kWarn:
      return "WARN";
    case Level::kInfo:
      return "INFO";
    case Level::kTrace:
      return "TRACE";
  }
  return "?";
}

std::string_view subsys_name(Subsys subsys) {
  const auto bit = static_cast<unsigned>(subsys);
  for (std::size_t i = 0; i < std::size(kSubsysNames); ++i)
    if (bit == 1u << i) return kSubsysNames[i];
  return "?";
}

Level parse_level(std::string_view value) {
  const std::string s = upper(value);
  if (s.empty() || s == "0") return Level::kOff;
  if (s == "1" || s == "INFO") return Level::kInfo;
  if (s == "VERSION") return Level::kVersion;
  if (s == "WARN") return Level::kWarn;
  if (s == "TRACE") return Level::kTrace;
  throw InvalidArgument(fmt::format("environment variable MOE_EP_DEBUG={:?} is invalid: accepted values are {}", value,
                                    env::accepted_values(env::lookup(env::kDebug))));
}

namespace {

// Reads the subsystem list `value` into `mask`; returns what is wrong with it ("" when nothing is).
std::string read_subsys(std::string_view value, unsigned& mask) {
  std::string_view list = trim(value);
  mask = kDefaultSubsys;
  if (list.empty()) return "";
  const bool exclude = list.front() == '^';
  if (exclude) list.remove_prefix(1);
  unsigned named = 0;
  for (;;) {
    const std::size_t comma = std::min(list.find(','), list.size());
    const std::string name = upper(trim(list.substr(0, comma)));
    if (name == "ALL") {
      named |= kAllSubsys;
    } else if (!name.empty()) {
      const auto* it = std::find(std::begin(kSubsysNames), std::end(kSubsysNames), name);
      if (it == std::end(kSubsysNames)) return fmt::format("{:?} is not a subsystem", name);
      named |= 1u << (it - std::begin(kSubsysNames));
    }
    if (comma >= list.size()) break;
    list.remove_prefix(comma + 1);
  }
  mask = exclude ? kAllSubsys & ~named : named;
  return "";
}

std::string subsys_problem(std::string_view value) {
  unsigned mask = 0;
  return read_subsys(value, mask);
}

}  // namespace

// The registry's rule of MOE_EP_DEBUG_SUBSYS: the parse below.
constinit const env::Syntax kDebugSubsysSyntax{
    "a comma-separated list of INIT, COLL, P2P, NET, ALLOC, ENV, ALL, optionally after ^ (all but those)",
    &subsys_problem};

unsigned parse_subsys(std::string_view value) {
  unsigned mask = 0;
  if (const std::string problem = read_subsys(value, mask); !problem.empty())
    throw InvalidArgument(fmt::format("environment variable MOE_EP_DEBUG_SUBSYS={:?} is invalid: {}; accepted values are {}",
                                      value, problem, kDebugSubsysSyntax.accepts));
  return mask;
}

std::string expand_file_name(std::string_view pattern) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '%' && i + 1 < pattern.size()) {
      const char c = pattern[i + 1];
      if (c == 'h' || c == 'p' || c == '%') {
        out += c == 'h' ? host_name() : c == 'p' ? std::to_string(getpid()) : std::string("%");
        ++i;
        continue;
      }
    }
    out += pattern[i];
  }
  return out;
}

void set_thread_rank(int rank) { t_rank = rank; }
int thread_rank() { return t_rank; }
void set_process_rank(int rank) { g_process_rank.store(rank, std::memory_order_relaxed); }
int current_rank() { return t_rank >= 0 ? t_rank : g_process_rank.load(std::memory_order_relaxed); }

std::string line_prefix() {
  const int rank = current_rank();
  return fmt::format("{}:{}:{} [{}] moe-ep", host_name(), getpid(), static_cast<long>(syscall(SYS_gettid)),
                     rank >= 0 ? std::to_string(rank) : std::string("-"));
}

namespace detail {

std::atomic<std::uint64_t> loaded_generation{kNeverLoaded};
std::atomic<int> level{0};
std::atomic<unsigned> mask{kDefaultSubsys};

std::uint64_t settings_generation() { return env::override_generation(); }

void load() {
  try {
    std::lock_guard lock(state_mutex());
    State& s = state();
    const std::uint64_t generation = settings_generation();
    if (loaded_generation.load(std::memory_order_relaxed) == generation) return;
    std::vector<std::string> problems;
    Level lv = Level::kOff;
    try {
      lv = parse_level(env::current(env::kDebug).value);
    } catch (const std::exception& e) {
      problems.push_back(fmt::format("{}; logging is off", e.what()));
    }
    unsigned m = kDefaultSubsys;
    try {
      m = parse_subsys(env::get(env::kDebugSubsys));
    } catch (const std::exception& e) {
      problems.push_back(fmt::format("{}; the default INIT,ENV applies", e.what()));
    }
    std::string pattern;
    try {
      pattern = env::get(env::kDebugFile);
    } catch (const std::exception& e) {
      problems.push_back(fmt::format("{}; logging to stderr", e.what()));
    }
    if (lv > Level::kOff) open_sink(s, lv, pattern);
    if (lv >= Level::kVersion) ensure_version(s);
    for (const auto& p : problems) settings_warning(s, lv, p);
    // What the environment sets, once per (re)load: NCCL's "set by environment" lines.
    if (lv >= Level::kInfo && (m & static_cast<unsigned>(Subsys::kEnv)) != 0) {
      for (const auto& v : env::registry()) {
        try {
          const env::Current c = env::current(v.name);
          if (c.source != env::Source::kDefault)
            write_locked(s, Level::kInfo, Subsys::kEnv,
                         fmt::format("{} set by {} to {:?}", v.name, env::source_name(c.source), c.value));
        } catch (const std::exception& e) {
          write_locked(s, Level::kWarn, Subsys::kEnv, e.what());
        }
      }
    }
    level.store(static_cast<int>(lv), std::memory_order_relaxed);
    mask.store(m, std::memory_order_relaxed);
    loaded_generation.store(generation, std::memory_order_release);
  } catch (...) {  // out of memory while reading the settings: keep the previous ones
  }
}

void write(Level lv, Subsys subsys, std::string_view message) {
  std::lock_guard lock(state_mutex());
  write_locked(state(), lv, subsys, message);
}

void write_always(Subsys subsys, std::string_view message) {
  const bool logged = enabled(Level::kWarn, subsys);
  std::lock_guard lock(state_mutex());
  if (logged) {
    write_locked(state(), Level::kWarn, subsys, message);
  } else {
    put(stderr, format_line(Level::kWarn, subsys, message));
  }
}

}  // namespace detail

}  // namespace moe_ep::core
