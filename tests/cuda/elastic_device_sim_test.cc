// The CUDA provider's algorithm (ElasticDevice over HostExec, which runs its device steps on host
// threads in a random order) against the built-in provider: every output of dispatch, cached dispatch
// and combine bit for bit, over random cases of 1 to 8 ranks (every layout, payload dtype, sync
// mode, weights and biases), and its errors. The built-in provider is the independent reference
// here: the two share no routing, planning or reduction code.
#include <gtest/gtest.h>

#include <cstdlib>
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

// Staging on (every rank copies what peers read into its symmetric region, as processes do) and
// off (ranks read each other's tensors in place, as threads of one process do).
class CudaProviderOnHost : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { cuda::testing::HostExec::staging = GetParam(); }
  void TearDown() override { cuda::testing::HostExec::staging = false; }
};
INSTANTIATE_TEST_SUITE_P(Paths, CudaProviderOnHost, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Staged" : "InPlace"; });

TEST_P(CudaProviderOnHost, RandomCasesMatchTheBuiltinProviderBitForBit) {
  expect_random_cases_match<LabelMover>(make_device);
}

}  // namespace
}  // namespace moe_ep::testing

namespace moe_ep::testing {
namespace {

// Tensors on the wrong side are refused by name, before anything moves: the built-in provider
// refuses device tensors, the CUDA provider host tensors.
// Hidden sizes that are not a multiple of 8 (FP32 payloads): combine's rows are then neither
// whole 16-byte groups nor 16-byte aligned, the element-wise path of the sums.
TEST_P(CudaProviderOnHost, HiddenSizesOffTheVectorWidthMatch) {
  for (int c = 0; c < 8; ++c) {
    RunOptions options;
    reference::CaseSpec spec = random_case(0xC0DA1000u + static_cast<std::uint64_t>(c), 2 + c % 3, 1, &options);
    spec.fp8 = false;
    spec.scale_cols = 0;
    spec.payload_element_bytes = 4;
    spec.hidden = c % 2 ? 12 : 20;
    CaseFlags flags;
    flags.cpu_sync = c % 4 != 3;
    const std::vector<std::string> problems = compare_case<LabelMover>(spec, flags, make_device);
    EXPECT_TRUE(problems.empty()) << "case " << c << " (" << describe(spec, options) << "): " << problems.front();
  }
}

TEST_P(CudaProviderOnHost, TensorsOnTheWrongDeviceAreRefusedByName) {
  LocalWorld world(2);
  std::vector<Caught> cpu_errors(2), dev_errors(2);
  world.run([&](Group& group) {
    ElasticBufferConfig config;
    config.num_max_tokens_per_rank = 4;
    config.hidden = 8;
    ElasticBuffer cpu(group, config);
    Device dev(group, config, 0);
    std::vector<std::uint16_t> x(4 * 8, 0);
    std::vector<std::int64_t> ids = {0, 1, 2, 3};
    DispatchArgs args;
    args.x = TensorView(x.data(), DType::kBF16, {4, 8});
    args.topk_idx = TensorView(ids.data(), DType::kInt64, {4, 1});
    args.num_experts = 4;
    DispatchArgs on_device = args;
    on_device.x = args.x.on_device(kCuda0);
    on_device.topk_idx = args.topk_idx.on_device(kCuda0);
    DispatchArgs bad_cpu = group.rank() == 1 ? on_device : args;  // rank 1 passes device tensors to the cpu provider
    cpu_errors[group.rank()] = catch_error([&] { cpu.dispatch(bad_cpu); });
    DispatchArgs bad_dev = on_device;
    if (group.rank() == 0) bad_dev.x = args.x;  // rank 0 passes a host x to the cuda provider
    dev_errors[group.rank()] = catch_error([&] { dev.dispatch(bad_dev); });
    dev.destroy();
  });
  EXPECT_EQ(cpu_errors[1].type, "InvalidArgument");
  EXPECT_NE(cpu_errors[1].message.find("x lives on cuda:0"), std::string::npos) << cpu_errors[1].message;
  EXPECT_EQ(cpu_errors[0].type, "PeerError");
  EXPECT_EQ(dev_errors[0].type, "InvalidArgument");
  EXPECT_NE(dev_errors[0].message.find("x lives on cpu, expected cuda:0"), std::string::npos) << dev_errors[0].message;
  EXPECT_EQ(dev_errors[1].type, "PeerError");
  EXPECT_EQ(dev_errors[1].ranks, std::vector<int>{0});
}

// A rank that fails after the agreement (here: its previous_event failed) leaves: its peers'
// device waits for it end with a PeerError naming it (a wait that ran into the timeout would be a
// TimeoutError instead), and the buffer is unusable on every rank afterwards.
TEST_P(CudaProviderOnHost, ARankFailingAfterTheAgreementReleasesItsPeers) {
  LocalWorld world(3);
  std::vector<Caught> first(3), later(3);
  world.run([&](Group& group) {
    ElasticBufferConfig config;
    config.num_max_tokens_per_rank = 4;
    config.hidden = 8;
    config.num_cpu_timeout_secs = 120;
    Device dev(group, config, 0);
    std::vector<std::uint16_t> x(4 * 8, 1);
    std::vector<std::int64_t> ids = {0, 1, 2, 5};
    DispatchArgs args;
    args.x = TensorView(x.data(), DType::kBF16, {4, 8}).on_device(kCuda0);
    args.topk_idx = TensorView(ids.data(), DType::kInt64, {4, 1}).on_device(kCuda0);
    args.num_experts = 6;
    if (group.rank() == 1) {
      Event failed = Event::pending();
      failed.fail(std::make_exception_ptr(ResourceError("the caller's work failed")));
      args.previous_event = failed;
      args.allocate_on_comm_stream = true;
    }
    first[group.rank()] = catch_error([&] { dev.dispatch(args); });
    args.previous_event.reset();
    later[group.rank()] = catch_error([&] { dev.dispatch(args); });
  });
  EXPECT_EQ(first[1].type, "ResourceError");
  EXPECT_NE(first[1].message.find("the caller's work failed"), std::string::npos) << first[1].message;
  for (int r : {0, 2}) {
    EXPECT_EQ(first[r].type, "PeerError") << first[r].message;
    EXPECT_EQ(first[r].ranks, std::vector<int>{1});
    EXPECT_NE(first[r].message.find("rank 1 failed after the call's agreement"), std::string::npos) << first[r].message;
  }
  for (const Caught& c : later) EXPECT_EQ(c.type, "StateError") << c.message;
}

// An expert id out of range is seen only by the device: with CPU sync the call raises it on the
// rank that passed it (naming the element) and a PeerError naming that rank on the others;
// without, the next call does. The buffer stays usable.
TEST_P(CudaProviderOnHost, BadExpertIdsAreReportedFromTheDevice) {
  for (bool sync : {true, false}) {
    LocalWorld world(3);
    std::vector<Caught> first(3), second(3), event(3);
    std::vector<std::int64_t> recovered(3, -1);
    world.run([&](Group& group) {
      ElasticBufferConfig config;
      config.num_max_tokens_per_rank = 4;
      config.hidden = 8;
      Device dev(group, config, 0);
      std::vector<std::uint16_t> x(4 * 8, 1);
      std::vector<std::int64_t> ids = {0, 1, 2, group.rank() == 2 ? 99 : 5};
      DispatchArgs args;
      args.x = TensorView(x.data(), DType::kBF16, {4, 8}).on_device(kCuda0);
      args.topk_idx = TensorView(ids.data(), DType::kInt64, {4, 1}).on_device(kCuda0);
      args.num_experts = 6;
      args.do_cpu_sync = sync;
      args.async_with_compute_stream = !sync;
      first[group.rank()] = catch_error([&] {
        const DispatchResult r = dev.dispatch(args);
        event[group.rank()] = catch_error([&] { r.event.wait(); });
      });
      args.async_with_compute_stream = false;
      if (!sync) second[group.rank()] = catch_error([&] { dev.dispatch(args); });
      ids[3] = 5;
      const DispatchResult ok = dev.dispatch(args);
      recovered[group.rank()] = sync ? ok.handle->num_recv_tokens : 0;
      dev.destroy();
    });
    const std::vector<Caught>& seen = sync ? first : second;
    if (!sync) {
      for (const Caught& c : first) EXPECT_EQ(c.type, "") << c.message;
      // The asynchronous call's event fails on every rank, naming what the device found.
      for (const Caught& c : event) EXPECT_NE(c.message.find("found on the device"), std::string::npos) << c.message;
      EXPECT_NE(event[2].message.find("topk_idx[3, 0] = 99"), std::string::npos) << event[2].message;
    }
    EXPECT_EQ(seen[2].type, "InvalidArgument");
    EXPECT_NE(seen[2].message.find("topk_idx[3, 0] = 99 is outside [-1, num_experts)"), std::string::npos)
        << seen[2].message;
    for (int r : {0, 1}) {
      EXPECT_EQ(seen[r].type, "PeerError") << seen[r].message;
      EXPECT_EQ(seen[r].ranks, std::vector<int>{2});
    }
    if (sync) {
      // Rank r receives the tokens naming its experts 2r and 2r + 1: ids {0, 1, 2, 5} on every rank.
      EXPECT_EQ(recovered, (std::vector<std::int64_t>{6, 3, 3}));
    }
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
  const char* given = std::getenv("MOE_EP_CUDA_PROVIDER");  // a build carried to another path
  const ProbeReport& report = probe_providers(given && *given ? given : MOE_EP_CUDA_PROVIDER_PATH);
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
