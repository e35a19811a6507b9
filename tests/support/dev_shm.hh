// The /dev/shm leak check: a test fixture that lists /dev/shm's entries under moe-ep's names
// (moe-ep*, moe_ep*) before each test and fails the test for every such entry found there
// afterwards that was not there before (shared-memory segments the test's transports left
// behind). Only moe-ep's names are looked at, so tests using it may run beside other programs
// that create and remove entries of their own there.
#pragma once

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace moe_ep::testing {

// The names under moe-ep's prefixes in /dev/shm now (empty when it cannot be read).
std::set<std::string> dev_shm_entries();

class DevShmUnchanged : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  std::set<std::string> before_;
};

}  // namespace moe_ep::testing
