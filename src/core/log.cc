#include "core/log.hh"

#include <cstdio>
#include <mutex>

#include "moe_ep/env.hpp"
#include "moe_ep/version.hpp"

namespace moe_ep::core {

bool debug_enabled() { return env::get_bool("MOE_EP_DEBUG"); }

void debug_line(std::string_view line) {
  static std::mutex mutex;
  static bool first = true;
  std::lock_guard lock(mutex);
  if (first) {  // the version opens every log
    std::fprintf(stderr, "[moe-ep] moe-ep %s\n", version());
    first = false;
  }
  std::fprintf(stderr, "[moe-ep] %.*s\n", static_cast<int>(line.size()), line.data());
}

}  // namespace moe_ep::core
