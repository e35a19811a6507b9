// Typed environment configuration.
//
// Every environment variable moe-ep reads is declared once in a registry (name, type, default,
// accepted values, one-line doc). Integer and float variables declare the range they accept;
// it is the one limit of the quantity (a call argument that sets the same quantity is checked
// against it too). A string variable with a syntax of its own (a list of names or indexes)
// declares it too, and its reader parses with the same rule: what the registry (and `moe-ep env`)
// accepts is what the readers accept. Reads go through the typed getters below, which parse and
// validate the current value on every read; a bad value raises InvalidArgument naming the
// variable, the value exactly as given and the accepted values (the range for numbers).
// ScopedOverride replaces a value for the lifetime of the object (process-wide, restored on
// destruction) so tests can change configuration without touching the process environment; it
// validates the value when it is made, as the reads do. Reading an undeclared name is a
// programming error (StateError). A kChoice variable accepts the empty value only where its
// choices include it.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace moe_ep::env {

enum class Type { kBool, kInt, kFloat, kChoice, kString };

// Accepted values of a kInt variable, inclusive.
struct IntRange {
  std::int64_t min = 0;
  std::int64_t max = std::numeric_limits<std::int64_t>::max();
};
// Accepted values of a kFloat variable: from min (above it when min_exclusive) to max inclusive.
// NaN is never accepted; infinity only where max is infinity (a max of the largest double
// accepts the finite numbers).
struct FloatRange {
  double min = 0;
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  bool contains(double x) const { return (min_exclusive ? x > min : x >= min) && x <= max; }
};

// The syntax of a kString variable, where it has one beyond "no NUL byte": `accepts` says in words
// what it accepts; `problem` returns what is wrong with a value, "" when nothing is. A refusal reads
// "environment variable NAME="value" is invalid: <problem>; accepted values are <accepts>".
struct Syntax {
  std::string_view accepts;
  std::string (*problem)(std::string_view value) = nullptr;
};

struct Variable {
  std::string_view name;
  Type type;
  std::string_view default_value;
  std::vector<std::string_view> choices;  // accepted values for kChoice
  std::string_view doc;
  IntRange int_range{};      // kInt
  FloatRange float_range{};  // kFloat
  Syntax syntax{};           // kString (none: any text without NUL bytes)
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
// What a variable accepts, in words: "integers from 0 to 1024", "a positive, finite number",
// "normal | low_latency | auto"...
std::string accepted_values(const Variable& v);
std::string_view source_name(Source s);

// Changes whenever a ScopedOverride is made or restored: readers that keep a parsed value
// (the log settings) read again when it changed.
std::uint64_t override_generation();

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
