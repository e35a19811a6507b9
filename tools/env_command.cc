// moe-ep env: every environment variable moe-ep reads, its value now and where it came from.
#include <fmt/format.h>

#include "commands.hh"
#include "moe_ep/env.hpp"
#include "report.hh"

namespace moe_ep::tools {

int env_command() {
  Table table({"variable", "type", "default", "value", "source"});
  for (const auto& v : env::registry()) {
    std::string value, source;
    try {
      const auto current = env::current(v.name);
      value = current.value;
      source = std::string(env::source_name(current.source));
    } catch (const std::exception& e) {
      value = "(invalid)";
      source = e.what();
    }
    table.row({std::string(v.name), std::string(env::type_name(v.type)), std::string(v.default_value), value, source});
  }
  table.print();
  fmt::print("\n");
  for (const auto& v : env::registry()) fmt::print("{}: {}\n", v.name, v.doc);
  return 0;
}

}  // namespace moe_ep::tools
