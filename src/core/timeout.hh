// Timeouts: one rule for every timeout moe-ep accepts (MOE_EP_TIMEOUT_SECS, num_cpu_timeout_secs,
// DispatcherOptions.timeout_secs, mpi::GroupOptions.timeout_secs, Group::barrier).
//
// A timeout is a positive, finite number of seconds: the range of MOE_EP_TIMEOUT_SECS in the
// registry (src/core/env_table.inc), so that `moe-ep env` and every reader accept the same values.
// Values of kNeverSecs (1e9 s, about 31 years) and more never expire: deadlines saturate instead of
// overflowing the clock. Infinity and NaN are refused (InvalidArgument naming the argument or the
// variable and the value): a wait without any deadline is spelled as a large number, so that no
// value is silently read as "expire at once".
#pragma once

#include <string_view>

namespace moe_ep::core {

inline constexpr double kNeverSecs = 1e9;

// Returns `value` if it is a valid timeout; throws InvalidArgument "<context>: <name> = <value> ...".
double checked_timeout(std::string_view context, std::string_view name, double value);

// MOE_EP_TIMEOUT_SECS, checked by the registry ("environment variable MOE_EP_TIMEOUT_SECS="0" is
// invalid: accepted values are a positive, finite number").
double timeout_from_env();

// An argument `timeout_secs` where 0 means MOE_EP_TIMEOUT_SECS: that, or the checked value.
double timeout_or_env(std::string_view context, double timeout_secs);

}  // namespace moe_ep::core
