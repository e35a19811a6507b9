#include "support/temp_dir.hh"

#include <gtest/gtest.h>
#include <stdlib.h>

namespace moe_ep::testing {

TempDir::TempDir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  EXPECT_NE(mkdtemp(pattern.data()), nullptr) << "mkdtemp " << pattern;
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace moe_ep::testing
