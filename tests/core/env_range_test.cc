// Environment values outside the declared range of their variable: every read refuses them with
// an InvalidArgument naming the variable, the value exactly as given and the accepted range. The
// registry (what `moe-ep env` shows) and the variables' own readers accept the same values.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "core/host_allocator.hh"
#include "core/log.hh"
#include "core/placement.hh"
#include "core/timeout.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"
#include "support/env_scope.hh"
#include "support/errors.hh"
#include "support/text.hh"

namespace moe_ep {
namespace {

using testing::contains;

std::string int_error(const char* name) {
  try {
    env::get_int(name);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(EnvRange, WorkerCountsBeyondTheLimitAreRefusedAsGiven) {
  // 2^32 + 1 and 2^31 would wrap in an int; 100000 threads per rank cannot start.
  for (const char* value : {"4294967297", "2147483648", "100000", "1025", "99999999999999999999"}) {
    testing::ScopedEnvironment set("MOE_EP_NUM_WORKERS", value);
    const std::string message = int_error("MOE_EP_NUM_WORKERS");
    ASSERT_FALSE(message.empty()) << value << " was accepted";
    EXPECT_TRUE(contains(message, "MOE_EP_NUM_WORKERS")) << message;
    EXPECT_TRUE(contains(message, std::string("\"") + value + "\"")) << message;
    EXPECT_TRUE(contains(message, "1024")) << message;
  }
  for (const char* value : {"0", "1", "1024"}) {
    testing::ScopedEnvironment set("MOE_EP_NUM_WORKERS", value);
    EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), std::strtoll(value, nullptr, 10));
  }
}

TEST(EnvRange, TokenCapsAndByteCountsHaveLimits) {
  for (const char* name : {"MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "MOE_EP_NUM_MAX_PREFILL_TOKENS_PER_RANK",
                           "MOE_EP_RANKS_PER_NODE", "MOE_EP_MPI_CHUNK_BYTES", "MOE_EP_ALLOCATOR_CACHE_BYTES"}) {
    testing::ScopedEnvironment set(name, "9223372036854775807");  // INT64_MAX: no sensible limit is that large
    const std::string message = int_error(name);
    EXPECT_TRUE(contains(message, name)) << name << ": " << message;
    EXPECT_TRUE(contains(message, "\"9223372036854775807\"")) << message;
  }
  testing::ScopedEnvironment tokens("MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "1099511627776");
  EXPECT_TRUE(contains(int_error("MOE_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"), "\"1099511627776\""));
}

TEST(EnvRange, TheTimeoutStaysUnboundedAbove) {
  testing::ScopedEnvironment set("MOE_EP_TIMEOUT_SECS", "1e300");
  EXPECT_EQ(env::get_float("MOE_EP_TIMEOUT_SECS"), 1e300);
}

TEST(EnvRange, TheTimeoutIsPositiveAndFiniteForTheRegistryAsForItsReaders) {
  using testing::error_of;
  for (const char* value : {"0", "-0", "inf", "INF", "-inf", "nan", "-1", "1e400"}) {
    testing::ScopedEnvironment set("MOE_EP_TIMEOUT_SECS", value);
    const std::string expected = std::string("environment variable MOE_EP_TIMEOUT_SECS=\"") + value +
                                 "\" is invalid: accepted values are a positive, finite number";
    // The registry (moe-ep env reads env::current) and every reader of the timeout say the same.
    EXPECT_EQ(error_of([] { env::current("MOE_EP_TIMEOUT_SECS"); }), expected);
    EXPECT_EQ(error_of([] { env::get_float("MOE_EP_TIMEOUT_SECS"); }), expected);
    EXPECT_EQ(error_of([] { core::timeout_from_env(); }), expected);
    EXPECT_EQ(error_of([] { core::timeout_or_env("barrier", 0); }), expected);
    EXPECT_THROW(env::ScopedOverride("MOE_EP_TIMEOUT_SECS", value), InvalidArgument) << value;
  }
  for (const char* value : {"1e-300", "0.5", "300", "1e9", "1e300"}) {
    testing::ScopedEnvironment set("MOE_EP_TIMEOUT_SECS", value);
    EXPECT_EQ(core::timeout_from_env(), std::strtod(value, nullptr)) << value;
  }
  EXPECT_EQ(env::accepted_values(env::lookup("MOE_EP_TIMEOUT_SECS")), "a positive, finite number");
  // Arguments follow the same rule.
  EXPECT_TRUE(contains(error_of([] { core::checked_timeout("call", "timeout_secs", 0.0); }),
                       "call: timeout_secs = 0 is not a valid timeout"));
  EXPECT_FALSE(error_of([] { core::checked_timeout("call", "timeout_secs", 1 / 0.0); }).empty());
  EXPECT_EQ(core::checked_timeout("call", "timeout_secs", 1e-300), 1e-300);
}

TEST(EnvRange, ListsAreCheckedByTheRegistryAsByTheirParsers) {
  using testing::error_of;
  const std::string subsys_error =
      "environment variable MOE_EP_DEBUG_SUBSYS=\"INIT,BOGUS\" is invalid: \"BOGUS\" is not a subsystem; accepted "
      "values are a comma-separated list of INIT, COLL, P2P, NET, ALLOC, ENV, ALL, optionally after ^ (all but those)";
  {
    testing::ScopedEnvironment set("MOE_EP_DEBUG_SUBSYS", "INIT,BOGUS");
    EXPECT_EQ(error_of([] { env::current("MOE_EP_DEBUG_SUBSYS"); }), subsys_error);
  }
  EXPECT_EQ(error_of([] { core::parse_subsys("INIT,BOGUS"); }), subsys_error);
  EXPECT_THROW(env::ScopedOverride("MOE_EP_DEBUG_SUBSYS", "INIT,BOGUS"), InvalidArgument);
  for (const char* value : {"x", "0,x", "0,-1", "0,,1", "0, 1", "+1", "99999999999"}) {
    testing::ScopedEnvironment set("MOE_EP_NUMA_NODES", value);
    const std::string m = error_of([] { env::current("MOE_EP_NUMA_NODES"); });
    EXPECT_TRUE(contains(m, std::string("environment variable MOE_EP_NUMA_NODES=\"") + value + "\" is invalid: "))
        << m;
    EXPECT_TRUE(contains(m, "is not a NUMA node index; accepted values are a comma-separated list")) << m;
    // The parser refuses it too, whatever the host.
    EXPECT_TRUE(contains(error_of([&] { core::parse_numa_nodes(value, 2, 4); }), "is not a NUMA node index")) << value;
  }
  for (const char* value : {"", "0", "1,0", "3,3,2"}) {
    testing::ScopedEnvironment subsys("MOE_EP_DEBUG_SUBSYS", "^init, coll");
    testing::ScopedEnvironment nodes("MOE_EP_NUMA_NODES", value);
    EXPECT_EQ(env::get_string("MOE_EP_DEBUG_SUBSYS"), "^init, coll");
    EXPECT_EQ(env::get_string("MOE_EP_NUMA_NODES"), value);
  }
}

TEST(EnvRange, OverridesAreCheckedWhenMade) {
  EXPECT_THROW(env::ScopedOverride("MOE_EP_NUM_WORKERS", "4294967297"), InvalidArgument);
  EXPECT_THROW(env::ScopedOverride("MOE_EP_NUM_WORKERS", "1025"), InvalidArgument);
  // A NUL byte cannot come from the environment; an override holding one is not a number.
  EXPECT_THROW(env::ScopedOverride("MOE_EP_NUM_WORKERS", std::string("12\0" "9", 4)), InvalidArgument);
  env::ScopedOverride ok("MOE_EP_NUM_WORKERS", "1024");
  EXPECT_EQ(env::get_int("MOE_EP_NUM_WORKERS"), 1024);
}

// Freed blocks consult MOE_EP_ALLOCATOR_CACHE_BYTES from a deleter, which must not throw: a value
// made invalid after the allocation is reported by the next allocation instead.
TEST(EnvRange, AllocatorCacheLimitErrorsReachTheAllocatingCaller) {
  const std::int64_t large[] = {4 << 20};
  std::optional<Tensor> block(Tensor::empty(large, DType::kUInt8));
  {
    testing::ScopedEnvironment set("MOE_EP_ALLOCATOR_CACHE_BYTES", "lots");
    block.reset();  // returns the block to the cache: must not terminate
    try {
      Tensor::empty(large, DType::kUInt8);
      ADD_FAILURE() << "an invalid MOE_EP_ALLOCATOR_CACHE_BYTES was not reported";
    } catch (const InvalidArgument& e) {
      EXPECT_TRUE(contains(e.what(), "MOE_EP_ALLOCATOR_CACHE_BYTES=\"lots\"")) << e.what();
    }
  }
  EXPECT_NO_THROW(Tensor::empty(large, DType::kUInt8));
  core::host_allocator_trim();  // leave no cached block behind for other tests of this process
}

}  // namespace
}  // namespace moe_ep
