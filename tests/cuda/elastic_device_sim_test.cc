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
