// Typed environment configuration.
//
// Every environment variable moe-ep reads is declared once in a registry (name, type, default,
// accepted values, one-line doc). Reads go through the typed getters below, which parse and
// validate the current value; a bad value raises InvalidArgument naming the variable and the
// accepted values. ScopedOverride replaces a value for the lifetime of the object (process-wide,
// restored on destruction) so tests can change configuration without touching the process
// environment. Reading an undeclared name is a programming error (StateError).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moe_ep::env {

enum class Type { kBool, kInt, kFloat, kChoice, kString };

struct Variable {
  std::string_view name;
  Type type;
  std::string_view default_value;
  std::vector<std::string_view> choices;  // accepted values for kChoice
  std::string_view doc;
};

enum class Source { kDefault, kEnvironment, kOverride };

struct Current {
  std::string value;
  Source source;
};

const std::vector<Variable>& registry();
const Variable& lookup(std::string_view name);
// The raw current value and where it came from (validated).
Current current(std::string_view name);

bool get_bool(std::string_view name);
std::int64_t get_int(std::string_view name);
double get_float(std::string_view name);
std::string get_string(std::string_view name);  // kChoice and kString

std::string_view type_name(Type t);
std::string_view source_name(Source s);

class ScopedOverride {
 public:
  ScopedOverride(std::string_view name, std::string value);
  ~ScopedOverride();
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  std::string name_;
  bool had_previous_;
  std::string previous_;
};

}  // namespace moe_ep::env
