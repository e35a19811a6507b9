// Typed constants of moe-ep's environment variables, for the library's own reads.
//
// Each variable of the registry (src/core/env_table.inc, the one place of declaration) has one
// constant here, generated from the same table entry: env::kNumWorkers is an IntVar naming
// "MOE_EP_NUM_WORKERS". A misspelt constant is a compile error, and env::get(constant) returns the
// variable's type (BoolVar -> bool, IntVar -> int64, FloatVar -> double, ChoiceVar and StringVar ->
// std::string) with the validation of the string getters of moe_ep/env.hpp. kDeclared lists every
// constant's name and type in registry order; the env tests compare it with env::registry().
// The string variables with a syntax of their own name it here (core::k...Syntax), defined beside
// the parser that reads the variable, which applies the same rule.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "moe_ep/env.hpp"
#include "moe_ep/limits.hpp"  // the ranges of env_table.inc

namespace moe_ep::core {

// MOE_EP_DEBUG_SUBSYS (log.cc, parse_subsys) and MOE_EP_NUMA_NODES (placement.cc, parse_numa_nodes).
extern const env::Syntax kDebugSubsysSyntax;
extern const env::Syntax kNumaNodesSyntax;

}  // namespace moe_ep::core

namespace moe_ep::env {

// A declared variable of type T, named by its constant.
template <Type T>
struct Var {
  std::string_view name;
  static constexpr Type type = T;
};
using BoolVar = Var<Type::kBool>;
using IntVar = Var<Type::kInt>;
using FloatVar = Var<Type::kFloat>;
using ChoiceVar = Var<Type::kChoice>;
using StringVar = Var<Type::kString>;

inline bool get(BoolVar v) { return get_bool(v.name); }
inline std::int64_t get(IntVar v) { return get_int(v.name); }
inline double get(FloatVar v) { return get_float(v.name); }
inline std::string get(ChoiceVar v) { return get_string(v.name); }
inline std::string get(StringVar v) { return get_string(v.name); }
template <Type T>
Current current(Var<T> v) {
  return current(v.name);
}
template <Type T>
const Variable& lookup(Var<T> v) {
  return lookup(v.name);
}

#define MOE_EP_ENV_BOOL(constant, name, ...) inline constexpr BoolVar constant{name};
#define MOE_EP_ENV_INT(constant, name, ...) inline constexpr IntVar constant{name};
#define MOE_EP_ENV_FLOAT(constant, name, ...) inline constexpr FloatVar constant{name};
#define MOE_EP_ENV_CHOICE(constant, name, ...) inline constexpr ChoiceVar constant{name};
#define MOE_EP_ENV_STRING(constant, name, ...) inline constexpr StringVar constant{name};
#include "core/env_table.inc"
#undef MOE_EP_ENV_BOOL
#undef MOE_EP_ENV_INT
#undef MOE_EP_ENV_FLOAT
#undef MOE_EP_ENV_CHOICE
#undef MOE_EP_ENV_STRING

// Every constant's name and type, in the order of the table.
struct Declared {
  std::string_view name;
  Type type;
};
#define MOE_EP_ENV_ENTRY(constant, ...) Declared{constant.name, constant.type},
#define MOE_EP_ENV_BOOL MOE_EP_ENV_ENTRY
#define MOE_EP_ENV_INT MOE_EP_ENV_ENTRY
#define MOE_EP_ENV_FLOAT MOE_EP_ENV_ENTRY
#define MOE_EP_ENV_CHOICE MOE_EP_ENV_ENTRY
#define MOE_EP_ENV_STRING MOE_EP_ENV_ENTRY
inline constexpr std::array kDeclared = {
#include "core/env_table.inc"
};
#undef MOE_EP_ENV_BOOL
#undef MOE_EP_ENV_INT
#undef MOE_EP_ENV_FLOAT
#undef MOE_EP_ENV_CHOICE
#undef MOE_EP_ENV_STRING
#undef MOE_EP_ENV_ENTRY

// Two constants never name one variable.
constexpr bool names_are_unique() {
  for (std::size_t i = 0; i < kDeclared.size(); ++i)
    for (std::size_t j = i + 1; j < kDeclared.size(); ++j)
      if (kDeclared[i].name == kDeclared[j].name) return false;
  return true;
}
static_assert(names_are_unique(), "src/core/env_table.inc declares a variable twice");

}  // namespace moe_ep::env
