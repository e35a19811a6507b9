#include "core/timeout.hh"

#include <fmt/format.h>

#include <string>

#include "core/env_vars.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::core {

namespace {

// The one rule: MOE_EP_TIMEOUT_SECS's range in the registry (positive, finite).
bool valid(double secs) { return env::lookup(env::kTimeoutSecs).float_range.contains(secs); }

// What a refused argument's message says after the value.
std::string rule() {
  return fmt::format("is not a valid timeout: expected a positive, finite number of seconds (values of {:g} and more "
                     "never expire)",
                     kNeverSecs);
}

}  // namespace

double checked_timeout(std::string_view context, std::string_view name, double value) {
  if (!valid(value))
    throw InvalidArgument(
        fmt::format("{}{} = {} {}", context.empty() ? std::string() : fmt::format("{}: ", context), name, value, rule()));
  return value;
}

double timeout_from_env() { return env::get(env::kTimeoutSecs); }  // the registry refuses what valid() refuses

double timeout_or_env(std::string_view context, double timeout_secs) {
  return timeout_secs == 0 ? timeout_from_env() : checked_timeout(context, "timeout_secs", timeout_secs);
}

}  // namespace moe_ep::core
