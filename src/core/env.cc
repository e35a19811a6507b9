#include "moe_ep/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "core/env_vars.hh"
#include "core/executor.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::env {
namespace {

// The registry, built from the table of src/core/env_table.inc (its one place of declaration).
#define MOE_EP_ENV_BOOL(constant, name, default_value, doc) {name, Type::kBool, default_value, {}, doc},
#define MOE_EP_ENV_INT(constant, name, default_value, min, max, doc) \
  {name, Type::kInt, default_value, {}, doc, IntRange{min, max}},
#define MOE_EP_ENV_FLOAT(constant, name, default_value, min, max, min_exclusive, doc) \
  {name, Type::kFloat, default_value, {}, doc, {}, FloatRange{min, max, min_exclusive}},
#define MOE_EP_ENV_CHOICE(constant, name, default_value, doc, ...) \
  {name, Type::kChoice, default_value, {__VA_ARGS__}, doc},
#define MOE_EP_ENV_STRING(constant, name, default_value, syntax, doc) \
  {name, Type::kString, default_value, {}, doc, {}, {}, syntax},
const std::vector<Variable>& variables() {
  static const std::vector<Variable> vars = {
#include "core/env_table.inc"
  };
  return vars;
}
#undef MOE_EP_ENV_BOOL
#undef MOE_EP_ENV_INT
#undef MOE_EP_ENV_FLOAT
#undef MOE_EP_ENV_CHOICE
#undef MOE_EP_ENV_STRING

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

// A value that breaks the variable's syntax: what is wrong with it, then what it accepts.
[[noreturn]] void bad_syntax(const Variable& v, std::string_view value, const std::string& problem) {
  throw InvalidArgument(fmt::format("environment variable {}={:?} is invalid: {}; accepted values are {}", v.name, value,
                                    problem, accepted_values(v)));
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
  if (end != s.c_str() + s.size() || errno != 0 || !v.float_range.contains(x)) bad_value(v, value);
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
      if (v.syntax.problem != nullptr)
        if (const std::string problem = v.syntax.problem(value); !problem.empty()) bad_syntax(v, value, problem);
      break;
  }
}

// "a positive, finite number", "numbers from 2 up", "numbers above 0 to 1"...
std::string float_values(const FloatRange& r) {
  const bool finite = r.max == std::numeric_limits<double>::max();
  if (r.min == 0 && (finite || std::isinf(r.max)))
    return fmt::format("a {}{} number", r.min_exclusive ? "positive" : "non-negative", finite ? ", finite" : "");
  const std::string from = fmt::format("{} {}", r.min_exclusive ? "above" : "from", r.min);
  if (finite) return fmt::format("finite numbers {}", from);
  return std::isinf(r.max) ? fmt::format("numbers {} up", from) : fmt::format("numbers {} to {}", from, r.max);
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
      return float_values(v.float_range);
    case Type::kChoice: {
      std::vector<std::string> shown;
      for (const auto c : v.choices) shown.push_back(c.empty() ? std::string("(empty)") : std::string(c));
      return fmt::format("{}", fmt::join(shown, " | "));
    }
    case Type::kString:
      return v.syntax.accepts.empty() ? std::string("any text without NUL bytes") : std::string(v.syntax.accepts);
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
