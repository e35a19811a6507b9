#include "core/host_name.hh"

#include <unistd.h>

namespace moe_ep::core {

const std::string& host_name() {
  static const std::string name = [] {
    char buffer[256] = {};
    if (gethostname(buffer, sizeof(buffer) - 1) != 0) return std::string("unknown-host");
    return std::string(buffer);
  }();
  return name;
}

}  // namespace moe_ep::core
