// Environment values outside the declared range of their variable: every read refuses them with
// an InvalidArgument naming the variable, the value exactly as given and the accepted range.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "core/host_allocator.hh"
#include "moe_ep/env.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/tensor.hpp"
#include "support/env_scope.hh"
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
