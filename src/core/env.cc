#include "moe_ep/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "core/executor.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::env {
namespace {

// The one place where moe-ep's environment variables are declared.
const std::vector<Variable>& variables() {
  constexpr std::int64_t kKiB = 1024, kGiB = kKiB * kKiB * kKiB;
  static const std::vector<Variable> vars = {
      {"MOE_EP_DEBUG", Type::kChoice, "0", {"version", "warn", "info", "trace", "0", "1", ""},
       "Log level (docs/logging.md), case-insensitive: VERSION (the version line only), WARN (fallbacks and ignored "
       "settings), INFO (set-up: version, topology, transport, buffer sizes, workers), TRACE (every operation); "
       "0 or empty = off, 1 = INFO."},
      {"MOE_EP_TIMEOUT_SECS", Type::kFloat, "300", {},
       "Timeout in seconds of every wait: Group::barrier when none is given, MPI group creation, the buffers the "
       "dispatcher and the moe-ep tool build (buffers built directly use their num_cpu_timeout_secs). Positive and "
       "finite; 1e9 and more never expire.", {}, {}},
      {"MOE_EP_NUM_WORKERS", Type::kInt, "0", {},
       "Worker threads per rank for dispatch/combine copies; 0 = the theoretical model. The limit is that of num_sms.",
       {0, core::kMaxWorkers}},
      {"MOE_EP_USE_V2", Type::kBool, "0", {},
       "Dispatcher: use the V2 ElasticBuffer instead of the V1 Buffer (opt-in)."},
      {"MOE_EP_MODE", Type::kChoice, "auto", {"normal", "low_latency", "auto"},
       "Dispatcher mode: normal, low_latency, or auto (prefill batches normal, decode batches low_latency)."},
      {"MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", Type::kInt, "128", {},
       "Dispatcher: token cap per rank of low-latency batches (the slab height per source rank).",
       {1, std::int64_t{1} << 20}},
      {"MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK", Type::kInt, "4096", {},
       "Dispatcher: largest normal-mode batch per rank that its buffers are sized for.", {1, std::int64_t{1} << 24}},
      {"MOE_EP_DISPATCH_DTYPE", Type::kChoice, "bf16", {"bf16", "fp8", "nvfp4"},
       "Dispatcher: wire format of dispatched tokens (fp8 = E4M3 with per-128 scales, nvfp4 = E2M1 with per-16 "
       "E4M3 scales; cast before sending)."},
      {"MOE_EP_NVFP4_ROUNDING", Type::kChoice, "nearest_even", {"nearest_even", "sm90"},
       "NVFP4 casts: E2M1 rounding, nearest_even (round to nearest, ties to even, as SM100 hardware) or sm90 "
       "(the software fallback of GPUs before SM100: thresholds at the geometric midpoints)."},
      {"MOE_EP_V2_ALLOW_HYBRID_MODE", Type::kBool, "1", {},
       "Dispatcher, V2: send a token once per destination node and forward it inside the node."},
      {"MOE_EP_V2_ALLOW_MULTIPLE_REDUCTION", Type::kBool, "1", {},
       "Dispatcher, V2: reduce partial sums on the way back (per rank, per node) before the final sum."},
      {"MOE_EP_V2_NORMAL_LAYOUT", Type::kChoice, "compact", {"compact", "expanded"},
       "Dispatcher, V2 normal mode: compact rows (one per token and rank) or expanded (one per token and expert)."},
      {"MOE_EP_PROVIDER_PATH", Type::kString, "", {},
       "Dispatcher: provider libraries to probe, colon-separated; 'cpu' is the built-in provider; empty = cpu."},
      {"MOE_EP_RANKS_PER_NODE", Type::kInt, "0", {},
       "MPI groups: ranks per logical node (scale-up domain over shared memory); 0 = the ranks of each host. "
       "Smaller values make processes of one host talk through MPI as if on different nodes.",
       {0, std::int64_t{1} << 16}},
      {"MOE_EP_MPI_CHUNK_BYTES", Type::kInt, "262144", {},
       "MPI transport: bytes of scale-out records aggregated into one message per peer (values below 4096 count "
       "as 4096).",
       {0, kGiB}},
      {"MOE_EP_ALLOCATOR_CACHE_BYTES", Type::kInt, "68719476736", {},
       "Bytes of freed tensor storage (address space) kept mapped for reuse by the caching host allocator.",
       {0, std::int64_t{1} << 47}},
      {"MOE_EP_DEBUG_SUBSYS", Type::kString, "INIT,ENV", {},
       "Subsystems of INFO and TRACE log lines: a comma list of INIT, COLL, P2P, NET, ALLOC, ENV, ALL; a leading ^ "
       "selects all but the listed ones; empty = INIT,ENV. WARN lines are never filtered."},
      {"MOE_EP_DEBUG_FILE", Type::kString, "", {},
       "File the log lines are appended to (%h = host name, %p = process id, %% = %); empty = stderr, also when the "
       "file cannot be opened (with a warning)."},
      {"FI_PROVIDER", Type::kString, "", {},
       "Libfabric's provider selection, read (not set) by moe-ep: efa means an EFA fabric (as does an rdmap* device in "
       "/sys/class/infiniband), which caps num_allocated_qps and in-flight scale-out requests per peer at 128."},
      {"OMPI_COMM_WORLD_SIZE", Type::kInt, "0", {},
       "Set by Open MPI's launcher (mpirun): read by the moe-ep tool to detect that an MPI launcher started it; "
       "0 = not set.",
       {0, std::numeric_limits<std::int32_t>::max()}},
      {"PMI_SIZE", Type::kInt, "0", {},
       "Set by MPICH's and other PMI launchers (mpiexec, srun): read by the moe-ep tool to detect that an MPI "
       "launcher started it; 0 = not set.",
       {0, std::numeric_limits<std::int32_t>::max()}},
  };
  return vars;
}

std::atomic<std::uint64_t> g_override_generation{0};

std::mutex& override_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::string, std::less<>>& overrides() {
  static std::map<std::string, std::string, std::less<>> m;
  return m;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

[[noreturn]] void bad_value(const Variable& v, std::string_view value) {
  throw InvalidArgument(fmt::format("environment variable {}={:?} is invalid: accepted values are {}", v.name, value,
                                    accepted_values(v)));
}

// The environment cannot hold a NUL byte; an override that holds one is refused, not cut short.
bool has_nul(std::string_view value) { return value.find('\0') != std::string_view::npos; }

bool parse_bool(const Variable& v, std::string_view value) {
  const std::string s = lower(value);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "off" || s == "no" || s.empty()) return false;
  bad_value(v, value);
}

// Decimal, optionally after leading white space and a sign (strtoll's syntax); a value that
// does not fit in 64 bits is out of range like any other.
std::int64_t parse_int(const Variable& v, std::string_view value) {
  const std::string s(value);
  if (s.empty() || has_nul(value)) bad_value(v, value);
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (end != s.c_str() + s.size() || errno != 0 || x < v.int_range.min || x > v.int_range.max) bad_value(v, value);
  return x;
}

double parse_float(const Variable& v, std::string_view value) {
  const std::string s(value);
  if (s.empty() || has_nul(value)) bad_value(v, value);
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || errno != 0 || !(x >= v.float_range.min && x <= v.float_range.max))
    bad_value(v, value);
  return x;
}

void validate(const Variable& v, std::string_view value) {
  switch (v.type) {
    case Type::kBool:
      parse_bool(v, value);
      break;
    case Type::kInt:
      parse_int(v, value);
      break;
    case Type::kFloat:
      parse_float(v, value);
      break;
    case Type::kChoice:
      if (std::find(v.choices.begin(), v.choices.end(), lower(value)) == v.choices.end()) bad_value(v, value);
      break;
    case Type::kString:
      if (has_nul(value)) bad_value(v, value);
      break;
  }
}

}  // namespace

const std::vector<Variable>& registry() { return variables(); }

const Variable& lookup(std::string_view name) {
  for (const auto& v : variables())
    if (v.name == name) return v;
  throw StateError(fmt::format("environment variable {} is not declared in the moe-ep registry", name));
}

Current current(std::string_view name) {
  const Variable& v = lookup(name);
  Current c{std::string(v.default_value), Source::kDefault};
  {
    std::lock_guard lock(override_mutex());
    auto it = overrides().find(name);
    if (it != overrides().end()) {
      c = {it->second, Source::kOverride};
    } else if (const char* e = std::getenv(std::string(name).c_str()); e != nullptr) {
      c = {e, Source::kEnvironment};
    }
  }
  if (c.source != Source::kDefault) validate(v, c.value);
  if (v.type == Type::kChoice) c.value = lower(c.value);
  return c;
}

bool get_bool(std::string_view name) { return parse_bool(lookup(name), current(name).value); }
std::int64_t get_int(std::string_view name) { return parse_int(lookup(name), current(name).value); }
double get_float(std::string_view name) { return parse_float(lookup(name), current(name).value); }
std::string get_string(std::string_view name) { return current(name).value; }

std::string_view type_name(Type t) {
  switch (t) {
    case Type::kBool:
      return "bool";
    case Type::kInt:
      return "int";
    case Type::kFloat:
      return "float";
    case Type::kChoice:
      return "choice";
    case Type::kString:
      return "string";
  }
  return "?";
}

std::string accepted_values(const Variable& v) {
  switch (v.type) {
    case Type::kBool:
      return "1/true/on/yes or 0/false/off/no";
    case Type::kInt:
      if (v.int_range.max == std::numeric_limits<std::int64_t>::max())
        return v.int_range.min == 0 ? std::string("a non-negative integer")
                                    : fmt::format("integers from {} up", v.int_range.min);
      return fmt::format("integers from {} to {}", v.int_range.min, v.int_range.max);
    case Type::kFloat:
      if (std::isinf(v.float_range.max))
        return v.float_range.min == 0 ? std::string("a non-negative number")
                                      : fmt::format("numbers from {} up", v.float_range.min);
      return fmt::format("numbers from {} to {}", v.float_range.min, v.float_range.max);
    case Type::kChoice: {
      std::vector<std::string> shown;
      for (const auto c : v.choices) shown.push_back(c.empty() ? std::string("(empty)") : std::string(c));
      return fmt::format("{}", fmt::join(shown, " | "));
    }
    case Type::kString:
      return "any text without NUL bytes";
  }
  return "?";
}

std::string_view source_name(Source s) {
  switch (s) {
    case Source::kDefault:
      return "default";
    case Source::kEnvironment:
      return "environment";
    case Source::kOverride:
      return "override";
  }
  return "?";
}

ScopedOverride::ScopedOverride(std::string_view name, std::string value) : name_(name) {
  validate(lookup(name), value);
  std::lock_guard lock(override_mutex());
  auto it = overrides().find(name);
  had_previous_ = it != overrides().end();
  if (had_previous_) previous_ = it->second;
  overrides()[name_] = std::move(value);
  g_override_generation.fetch_add(1, std::memory_order_release);
}

ScopedOverride::~ScopedOverride() {
  std::lock_guard lock(override_mutex());
  if (had_previous_) {
    overrides()[name_] = previous_;
  } else {
    overrides().erase(name_);
  }
  g_override_generation.fetch_add(1, std::memory_order_release);
}

std::uint64_t override_generation() { return g_override_generation.load(std::memory_order_acquire); }

}  // namespace moe_ep::env
