// The /dev/shm leak check: a test fixture that lists /dev/shm before each test and fails the test
// for every entry found there afterwards that was not there before (shared-memory segments of
// processes or transports the test left behind). Tests using it must not run concurrently with
// others that create entries there (CTest RUN_SERIAL, or one test binary at a time).
#pragma once

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace moe_ep::testing {

// The names in /dev/shm now (empty when it cannot be read).
std::set<std::string> dev_shm_entries();

class DevShmUnchanged : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  std::set<std::string> before_;
};

}  // namespace moe_ep::testing
