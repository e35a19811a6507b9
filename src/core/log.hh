// Debug logging, enabled with MOE_EP_DEBUG=1: one line per message on stderr.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace moe_ep::core {

bool debug_enabled();
void debug_line(std::string_view line);

template <class... Args>
void debug(fmt::format_string<Args...> format, Args&&... args) {
  if (debug_enabled()) debug_line(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace moe_ep::core
