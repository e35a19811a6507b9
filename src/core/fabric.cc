#include "core/fabric.hh"

#include <glob.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string_view>

namespace moe_ep::core {

bool fabric_is_efa() {
  if (const char* provider = std::getenv("FI_PROVIDER"); provider && std::string_view(provider) == "efa") return true;
  glob_t found{};
  const bool any = glob("/sys/class/infiniband/rdmap*", GLOB_NOSORT, nullptr, &found) == 0 && found.gl_pathc > 0;
  globfree(&found);
  return any;
}

int fabric_inflight_cap() { return fabric_is_efa() ? 128 : INT_MAX; }

int cap_inflight(int requested) { return std::min(requested, fabric_inflight_cap()); }

}  // namespace moe_ep::core
