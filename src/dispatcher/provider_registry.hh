// Providers as probed, per path list (dispatcher-internal; the public view is ProbeReport).
#pragma once

#include <string>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::dispatcher {

inline constexpr const char* kBuiltinEntry = "cpu";

// The table that serves `generation` for `path_list` (null when unavailable; the reason is in
// probe_providers(path_list)[generation]).
const provider::Table* provider_for(const std::string& path_list, Generation generation);

}  // namespace moe_ep::dispatcher
