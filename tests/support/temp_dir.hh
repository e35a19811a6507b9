// A fresh temporary directory for one test (mkdtemp under the system's temporary directory, the
// prefix naming the test), removed with everything in it when the object goes.
#pragma once

#include <filesystem>
#include <string>

namespace moe_ep::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "moe-ep-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // path() / name, as a string.
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace moe_ep::testing
