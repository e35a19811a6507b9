#include "core/timeout.hh"

#include <fmt/format.h>

#include <cmath>

#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"

namespace moe_ep::core {

double checked_timeout(std::string_view context, std::string_view name, double value) {
  if (std::isnan(value) || std::isinf(value) || value <= 0) {
    const std::string prefix = context.empty() ? std::string() : fmt::format("{}: ", context);
    throw InvalidArgument(fmt::format("{}{} = {} is not a valid timeout: expected a positive, finite number of seconds "
                                      "(values of {:g} and more never expire)",
                                      prefix, name, value, kNeverSecs));
  }
  return value;
}

double timeout_from_env() {
  const std::string raw = env::current("MOE_EP_TIMEOUT_SECS").value;
  const double value = env::get_float("MOE_EP_TIMEOUT_SECS");
  if (std::isnan(value) || std::isinf(value) || value <= 0)
    throw InvalidArgument(fmt::format("environment variable MOE_EP_TIMEOUT_SECS={:?} is not a valid timeout: expected a "
                                      "positive, finite number of seconds (values of {:g} and more never expire)",
                                      raw, kNeverSecs));
  return value;
}

}  // namespace moe_ep::core
