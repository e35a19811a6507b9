#include "core/fabric.hh"

#include <glob.h>

#include <algorithm>
#include <climits>
#include <string>

#include "core/log.hh"
#include "core/env_vars.hh"

namespace moe_ep::core {

bool fabric_is_efa() {
  std::string provider;
  try {
    provider = env::get(env::kFiProvider);
  } catch (const std::exception& e) {  // a NUL byte cannot come from the environment; an override is checked
    warn(Subsys::kNet, "{}; FI_PROVIDER ignored", e.what());
  }
  if (provider == "efa") {
    trace(Subsys::kNet, "fabric: EFA (FI_PROVIDER=efa)");
    return true;
  }
  glob_t found{};
  const bool any = glob("/sys/class/infiniband/rdmap*", GLOB_NOSORT, nullptr, &found) == 0 && found.gl_pathc > 0;
  globfree(&found);
  if (any) trace(Subsys::kNet, "fabric: EFA (an rdmap* device in /sys/class/infiniband)");
  return any;
}

int fabric_inflight_cap() { return fabric_is_efa() ? 128 : INT_MAX; }

int cap_inflight(int requested) {
  const int cap = fabric_inflight_cap();
  if (requested > cap)
    warn(Subsys::kNet, "fabric: EFA allows {} in-flight requests per peer: {} queue pairs requested, {} used", cap,
         requested, cap);
  return std::min(requested, cap);
}

}  // namespace moe_ep::core
