// The CUDA provider's algorithm (ElasticDevice over HostExec, which runs its device steps on the
// rank's host thread) against the built-in provider: every output of dispatch, cached dispatch
// and combine bit for bit, over random cases of 1 to 8 ranks (every layout, payload dtype, sync
// mode, weights and biases), and its errors. The built-in provider is the independent reference
// here: the two share no routing, planning or reduction code.
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>

#include "cuda/compare_case.hh"
#include "cuda/elastic_device.hh"
#include "cuda/host_exec.hh"
#include "moe_ep/dispatcher.hpp"
#include "support/errors.hh"

namespace moe_ep::testing {
namespace {

using Device = cuda::ElasticDevice<cuda::testing::HostExec>;
constexpr DLDevice kCuda0{kDLCUDA, 0};

// HostExec's "device" memory is host memory: moving a view only changes its device label.
struct LabelMover {
  TensorView in(const TensorView& v) { return v.on_device(kCuda0); }
  void read_back(const TensorView&, void*) {}  // written in place
  template <class R>
  R out(R r) {
    return r;
  }
};

std::unique_ptr<Device> make_device(Group& group, const ElasticBufferConfig& config) {
  return std::make_unique<Device>(group, config, 0);
}

TEST(CudaProviderOnHost, RandomCasesMatchTheBuiltinProviderBitForBit) {
  const int cases = 60;
  for (int c = 0; c < cases; ++c) {
    RunOptions options;
    const int ranks = 1 + c % 8;
    reference::CaseSpec spec = random_case(0xC0DA0000u + static_cast<std::uint64_t>(c), ranks, 1, &options);
    CaseFlags flags;
    flags.cpu_sync = c % 3 != 2;
    flags.zero_padding = spec.expand && c % 4 == 1;
    flags.col_major = spec.fp8 && c % 5 == 3;
    flags.handle_copy = c % 6 != 4;
    const std::vector<std::string> problems = compare_case<LabelMover>(spec, flags, make_device);
    std::string all;
    for (std::size_t i = 0; i < problems.size() && i < 12; ++i) all += problems[i] + "\n";
    EXPECT_TRUE(problems.empty()) << "case " << c << " (" << describe(spec, options) << ", cpu_sync " << flags.cpu_sync
                                  << ", zero_padding " << flags.zero_padding << ", col_major " << flags.col_major
                                  << "):\n"
                                  << all;
  }
}

}  // namespace
}  // namespace moe_ep::testing

#ifdef MOE_EP_CUDA_PROVIDER_PATH
namespace moe_ep::testing {
namespace {

// The built provider library, probed through the provider ABI as the dispatcher loads it: it
// offers V2 only, and on a machine without a GPU it says so instead of offering anything.
TEST(CudaProviderLibrary, ProbesThroughTheProviderAbi) {
  const ProbeReport& report = probe_providers(MOE_EP_CUDA_PROVIDER_PATH);
  ASSERT_EQ(report.providers.size(), 1u);
  const ProviderProbe& p = report.providers[0];
  if (std::getenv("MOE_EP_EXPECT_GPU") == nullptr) {
    // No device here (CI): the library loads, and init() names the reason.
    EXPECT_FALSE(report.v2.available) << report.v2.reason;
    EXPECT_NE(p.error.find("no CUDA device"), std::string::npos) << p.error;
  } else {
    EXPECT_TRUE(report.v2.available) << report.v2.reason;
    EXPECT_EQ(p.name, "cuda");
    EXPECT_FALSE(report.v1.available);
  }
}

}  // namespace
}  // namespace moe_ep::testing
#endif
