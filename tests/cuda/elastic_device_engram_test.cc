// The CUDA provider's algorithm on host threads (ElasticDevice over HostExec) has no Engram
// storage: num_cpu_bytes > 0 is refused on every rank at construction, naming the value
// (docs/cuda.md, docs/engram-pp.md).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/elastic_device.hh"
#include "cuda/host_exec.hh"
#include "moe_ep/group.hpp"
#include "support/errors.hh"

namespace moe_ep::testing {
namespace elastic_device_engram_test {

TEST(CudaProviderRules, NumCpuBytesIsRefusedOnEveryRank) {
  ElasticBufferConfig config;
  config.num_bytes = std::int64_t{4} << 20;
  config.num_cpu_bytes = std::int64_t{2} << 20;
  config.num_max_tokens_per_rank = 4;
  config.hidden = 8;
  std::vector<Caught> errors(2);
  LocalWorld(2).run([&](Group& group) {
    errors[static_cast<size_t>(group.rank())] =
        catch_error([&] { cuda::ElasticDevice<cuda::testing::HostExec>(group, config, group.rank()).destroy(); });
  });
  EXPECT_EQ(errors[0].type, "InvalidArgument") << errors[0].message;
  EXPECT_NE(errors[0].message.find("num_cpu_bytes = 2097152: the cuda provider has no Engram storage"),
            std::string::npos)
      << errors[0].message;
  EXPECT_EQ(errors[1].type, "InvalidArgument") << errors[1].message;
}

}  // namespace elastic_device_engram_test
}  // namespace moe_ep::testing
