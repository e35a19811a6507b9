#include "support/dev_shm.hh"

#include <dirent.h>

namespace moe_ep::testing {

std::set<std::string> dev_shm_entries() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* entry = readdir(d)) {
      const std::string name = entry->d_name;
      if (name.starts_with("moe-ep") || name.starts_with("moe_ep")) names.insert(name);
    }
    closedir(d);
  }
  return names;
}

void DevShmUnchanged::SetUp() { before_ = dev_shm_entries(); }

void DevShmUnchanged::TearDown() {
  for (const auto& name : dev_shm_entries()) EXPECT_TRUE(before_.count(name)) << "left in /dev/shm: " << name;
}

}  // namespace moe_ep::testing
