// Checks on text (error messages, log lines, reports) shared by the test suites.
#pragma once

#include <string_view>

namespace moe_ep::testing {

// Whether `part` occurs in `text`.
inline bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

}  // namespace moe_ep::testing
