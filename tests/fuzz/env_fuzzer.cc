// Fuzzes the environment registry: the first byte picks a declared variable, the rest is its
// value. An override and the process environment must accept and refuse the same values; a
// refusal names the variable and what it accepts; an accepted value reads back as an
// independent parse of it says, inside the declared range.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace {

using moe_ep::InvalidArgument;
namespace env = moe_ep::env;

[[noreturn]] void violated(const char* what, const env::Variable& v, const std::string& value) {
  fmt::print(stderr, "env fuzzer: {} for {}={:?}\n", what, v.name, value);
  std::abort();
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// The typed read of a variable, as a string (throws what the getter throws).
std::string read(const env::Variable& v) {
  switch (v.type) {
    case env::Type::kBool:
      return env::get_bool(v.name) ? "1" : "0";
    case env::Type::kInt:
      return fmt::format("{}", env::get_int(v.name));
    case env::Type::kFloat:
      return fmt::format("{}", env::get_float(v.name));
    case env::Type::kChoice:
    case env::Type::kString:
      return env::get_string(v.name);
  }
  return "";
}

// strtoll's syntax, parsed here without it: white space, an optional sign, decimal digits.
std::optional<__int128> decimal(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (i == s.size()) return std::nullopt;
  __int128 x = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return std::nullopt;
    x = x * 10 + (s[i] - '0');
    if (x > (static_cast<__int128>(1) << 64)) return x;  // far out of any range; stop growing
  }
  return negative ? -x : x;
}

// Checks an accepted value against what the variable declares.
void check_accepted(const env::Variable& v, const std::string& value, const std::string& got) {
  if (value.find('\0') != std::string::npos) violated("a NUL byte was accepted", v, value);
  switch (v.type) {
    case env::Type::kBool: {
      const std::string s = lower(value);
      const bool yes = s == "1" || s == "true" || s == "on" || s == "yes";
      const bool no = s == "0" || s == "false" || s == "off" || s == "no" || s.empty();
      if (!(yes || no) || got != (yes ? "1" : "0")) violated("bool read differs", v, value);
      break;
    }
    case env::Type::kInt: {
      const auto x = decimal(value);
      if (!x || *x < v.int_range.min || *x > v.int_range.max || fmt::format("{}", static_cast<std::int64_t>(*x)) != got)
        violated("int read differs or is out of range", v, value);
      break;
    }
    case env::Type::kFloat: {
      const double x = std::strtod(got.c_str(), nullptr);
      if (std::isnan(x) || x < v.float_range.min || x > v.float_range.max) violated("float out of range", v, value);
      break;
    }
    case env::Type::kChoice:
      if (std::find(v.choices.begin(), v.choices.end(), got) == v.choices.end() || got != lower(value))
        violated("choice read differs", v, value);
      break;
    case env::Type::kString:
      if (got != value) violated("string read differs", v, value);
      break;
  }
}

void check_refusal(const env::Variable& v, const std::string& value, const InvalidArgument& e) {
  const std::string m = e.what();
  if (m.find(std::string(v.name)) == std::string::npos ||
      m.find("accepted values are " + env::accepted_values(v)) == std::string::npos)
    violated("a refusal does not name the variable and its accepted values", v, value);
  if (v.type == env::Type::kInt && value.find('\0') == std::string::npos) {
    const auto x = decimal(value);
    if (x && *x >= v.int_range.min && *x <= v.int_range.max) violated("an int in range was refused", v, value);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto& vars = env::registry();
  const env::Variable& v = vars[data[0] % vars.size()];
  const std::string value(reinterpret_cast<const char*>(data + 1), size - 1);

  std::optional<std::string> through_override;  // the read, when the override was accepted
  bool accepted = false;
  try {
    env::ScopedOverride set(v.name, value);
    accepted = true;
    if (env::current(v.name).source != env::Source::kOverride) violated("override not in effect", v, value);
    through_override = read(v);
    check_accepted(v, value, *through_override);
  } catch (const InvalidArgument& e) {
    if (accepted) violated("an accepted override fails to read", v, value);
    check_refusal(v, value, e);
  }
  if (env::current(v.name).source != env::Source::kDefault) violated("override not restored", v, value);

  // The process environment (which cannot hold a NUL byte) must agree with the override.
  if (value.find('\0') == std::string::npos) {
    const std::string name(v.name);
    setenv(name.c_str(), value.c_str(), 1);
    std::optional<std::string> through_environment;
    try {
      through_environment = read(v);
    } catch (const InvalidArgument& e) {
      check_refusal(v, value, e);
    }
    unsetenv(name.c_str());
    if (through_environment != through_override) violated("environment and override disagree", v, value);
  }
  return 0;
}
