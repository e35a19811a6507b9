#include "core/log.hh"

#include <cstdio>
#include <mutex>

#include "moe_ep/env.hpp"

namespace moe_ep::core {

bool debug_enabled() { return env::get_bool("MOE_EP_DEBUG"); }

void debug_line(std::string_view line) {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  std::fprintf(stderr, "[moe-ep] %.*s\n", static_cast<int>(line.size()), line.data());
}

}  // namespace moe_ep::core
