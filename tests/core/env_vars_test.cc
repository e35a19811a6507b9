// The typed constants of src/core/env_vars.hh against the registry: one constant per registered
// variable with its name and type, and env::get(constant) reads the variable as its type.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <type_traits>

#include "core/env_vars.hh"
#include "moe_ep/error.hpp"

namespace moe_ep {
namespace {

static_assert(std::is_same_v<decltype(env::get(env::kUseV2)), bool>);
static_assert(std::is_same_v<decltype(env::get(env::kNumWorkers)), std::int64_t>);
static_assert(std::is_same_v<decltype(env::get(env::kTimeoutSecs)), double>);
static_assert(std::is_same_v<decltype(env::get(env::kMode)), std::string>);
static_assert(std::is_same_v<decltype(env::get(env::kProviderPath)), std::string>);

TEST(EnvVars, EveryRegisteredVariableHasOneConstantOfItsType) {
  const auto& registry = env::registry();
  ASSERT_EQ(env::kDeclared.size(), registry.size());
  std::set<std::string_view> names;
  for (std::size_t i = 0; i < registry.size(); ++i) {
    EXPECT_EQ(env::kDeclared[i].name, registry[i].name) << "entry " << i;
    EXPECT_EQ(env::kDeclared[i].type, registry[i].type) << registry[i].name;
    // The constant's name is a registered variable (lookup refuses any other name).
    EXPECT_EQ(&env::lookup(env::kDeclared[i].name), &registry[i]);
    names.insert(registry[i].name);
  }
  EXPECT_EQ(names.size(), registry.size()) << "a variable is registered twice";
}

TEST(EnvVars, ConstantsNameTheirVariables) {
  EXPECT_EQ(env::kNumWorkers.name, "MOE_EP_NUM_WORKERS");
  EXPECT_EQ(env::kTimeoutSecs.name, "MOE_EP_TIMEOUT_SECS");
  EXPECT_EQ(env::kDebug.name, "MOE_EP_DEBUG");
  EXPECT_EQ(env::kFiProvider.name, "FI_PROVIDER");
  EXPECT_EQ(env::kPmiSize.name, "PMI_SIZE");
  EXPECT_EQ(env::lookup(env::kNumWorkers).type, env::Type::kInt);
  EXPECT_EQ(env::lookup(env::kV2NormalLayout).choices.size(), 3u);
}

TEST(EnvVars, EveryDefaultIsAnAcceptedValue) {
  for (const auto& v : env::registry()) {
    env::ScopedOverride same(v.name, std::string(v.default_value));
    EXPECT_NO_THROW(env::current(v.name)) << v.name;
  }
}

TEST(EnvVars, TypedReadsParseTheCurrentValue) {
  {
    env::ScopedOverride workers(env::kNumWorkers.name, "7");
    EXPECT_EQ(env::get(env::kNumWorkers), 7);
    EXPECT_EQ(env::current(env::kNumWorkers).source, env::Source::kOverride);
  }
  {
    env::ScopedOverride v2(env::kUseV2.name, "on");
    EXPECT_TRUE(env::get(env::kUseV2));
  }
  {
    env::ScopedOverride timeout(env::kTimeoutSecs.name, "2.5");
    EXPECT_DOUBLE_EQ(env::get(env::kTimeoutSecs), 2.5);
  }
  {
    env::ScopedOverride mode(env::kMode.name, "LOW_LATENCY");
    EXPECT_EQ(env::get(env::kMode), "low_latency");  // choices read case-insensitively
  }
  {
    env::ScopedOverride path(env::kProviderPath.name, "cpu:/opt/p.so");
    EXPECT_EQ(env::get(env::kProviderPath), "cpu:/opt/p.so");
  }
  EXPECT_THROW(env::ScopedOverride(env::kNumWorkers.name, "-1"), InvalidArgument);
}

TEST(EnvVars, TheStringInterfaceReadsTheSameVariables) {
  env::ScopedOverride workers("MOE_EP_NUM_WORKERS", "3");
  EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), env::get(env::kNumWorkers));
  EXPECT_THROW(env::get_int("MOE_EP_NUM_WORKER"), StateError);
}

}  // namespace
}  // namespace moe_ep
