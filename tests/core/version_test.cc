// The version: the macros, moe_ep::version() of the loaded library and the project version
// CMake passes to this test (MOE_EP_EXPECTED_VERSION, from the top-level project()) agree.
#include <gtest/gtest.h>

#include <string>

#include "moe_ep/version.hpp"

namespace moe_ep {
namespace {

TEST(Version, MacrosFunctionAndProjectAgree) {
  EXPECT_EQ(std::string(version()), MOE_EP_EXPECTED_VERSION);
  EXPECT_EQ(std::string(MOE_EP_VERSION_STRING), MOE_EP_EXPECTED_VERSION);
  EXPECT_EQ(std::to_string(MOE_EP_VERSION_MAJOR) + "." + std::to_string(MOE_EP_VERSION_MINOR) + "." +
                std::to_string(MOE_EP_VERSION_PATCH),
            MOE_EP_EXPECTED_VERSION);
  EXPECT_EQ(MOE_EP_VERSION_NUMBER, MOE_EP_VERSION_MAJOR * 10000 + MOE_EP_VERSION_MINOR * 100 + MOE_EP_VERSION_PATCH);
}

}  // namespace
}  // namespace moe_ep
