// The CUDA provider's algorithm on host threads (ElasticDevice over HostExec): the rules a GPU
// makes necessary, checked where they can be without one. A call orders itself after its caller's
// stream before its agreement; ranks of one process sharing a device need two hardware queues
// each; memory that ranks on other devices cannot read in place is refused by name; a synchronous
// call whose device wait timed out fails in the call, not at the next one. Expected values are
// written from the rules in docs/cuda.md.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cstdint>
#include <vector>

#include "cuda/elastic_device.hh"
#include "cuda/host_exec.hh"
#include "moe_ep/group.hpp"
#include "support/errors.hh"

namespace moe_ep::testing {
namespace {

using Device = cuda::ElasticDevice<cuda::testing::HostExec>;
using cuda::testing::HostExec;

ElasticBufferConfig small_config(double timeout = 60) {
  ElasticBufferConfig config;
  config.num_max_tokens_per_rank = 4;
  config.hidden = 8;
  config.num_cpu_timeout_secs = timeout;
  return config;
}

// Four tokens of 8 BF16 values for experts {0, 1, 2, 5} of 6, on CUDA device `device`.
struct SmallCall {
  std::vector<std::uint16_t> x = std::vector<std::uint16_t>(4 * 8, 1);
  std::vector<std::int64_t> ids = {0, 1, 2, 5};
  DispatchArgs args(int device) {
    DispatchArgs a;
    a.x = TensorView(x.data(), DType::kBF16, {4, 8}).on_device({kDLCUDA, device});
    a.topk_idx = TensorView(ids.data(), DType::kInt64, {4, 1}).on_device({kDLCUDA, device});
    a.num_experts = 6;
    return a;
  }
};

// Rank 1 starts its call only once rank 0's call has ordered itself after its caller's stream:
// that happens before the agreement (which needs rank 1), so both calls complete. Ordered after
// the agreement, rank 0 would wait there for rank 1 and the agreement would time out (rank 1 gives
// up waiting after 30 s and fails too).
TEST(CudaProviderRules, ACallOrdersItselfAfterItsCallerBeforeTheAgreement) {
  std::atomic<bool> rank0_ordered{false};
  HostExec::on_after_caller = [&](int device) {
    if (device == 0) rank0_ordered.store(true);
  };
  LocalWorld world(2);
  std::vector<Caught> errors(2);
  world.run([&](Group& group) {
    Device dev(group, small_config(5), group.rank());  // rank r on device r: its hook is told apart
    SmallCall call;
    if (group.rank() == 1) {  // bounded, so that a call ordered after its agreement fails instead of hanging
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!rank0_ordered.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    }
    errors[group.rank()] = catch_error([&] { dev.dispatch(call.args(group.rank())); });
    dev.destroy();
  });
  HostExec::on_after_caller = nullptr;
  for (const Caught& c : errors) EXPECT_EQ(c.type, "") << c.message;
}

TEST(CudaProviderRules, RanksSharingADeviceNeedTwoHardwareQueuesEach) {
  HostExec::queues = 4;  // as CUDA_DEVICE_MAX_CONNECTIONS=4
  LocalWorld world(3);
  std::vector<Caught> shared(3), spread(3);
  world.run([&](Group& group) {
    shared[group.rank()] = catch_error([&] { Device(group, small_config(), 0).destroy(); });   // 3 ranks on cuda:0
    spread[group.rank()] = catch_error([&] { Device(group, small_config(), group.rank()).destroy(); });  // 1 each
  });
  HostExec::queues = 0;
  for (const Caught& c : shared) {
    EXPECT_EQ(c.type, "ResourceError") << c.message;
    EXPECT_NE(c.message.find("3 ranks of one process share cuda:0"), std::string::npos) << c.message;
    EXPECT_NE(c.message.find("CUDA_DEVICE_MAX_CONNECTIONS = 4 allows 2"), std::string::npos) << c.message;
    EXPECT_NE(c.message.find("set CUDA_DEVICE_MAX_CONNECTIONS=6"), std::string::npos) << c.message;
  }
  for (const Caught& c : spread) EXPECT_EQ(c.type, "") << c.message;
}

// Ranks of one process on two devices read each other's x in place: an x they cannot read is
// refused on the rank that passed it, naming it, and as a PeerError on the other, before anything
// moves; on one device the same memory is fine.
TEST(CudaProviderRules, MemoryOtherDevicesCannotReadIsRefusedByName) {
  for (const bool two_devices : {true, false}) {
    LocalWorld world(2);
    std::vector<Caught> errors(2), after(2);
    std::vector<SmallCall> calls(2);
    HostExec::unreadable = calls[0].x.data();
    world.run([&](Group& group) {
      const int device = two_devices ? group.rank() : 0;
      Device dev(group, small_config(), device);
      errors[group.rank()] = catch_error([&] { dev.dispatch(calls[group.rank()].args(device)); });
      HostExec::unreadable = nullptr;  // both ranks passed the check or failed it already: the agreement
      after[group.rank()] = catch_error([&] { dev.dispatch(calls[group.rank()].args(device)); });
      dev.destroy();
    });
    HostExec::unreadable = nullptr;
    if (two_devices) {
      EXPECT_EQ(errors[0].type, "InvalidArgument");
      EXPECT_NE(errors[0].message.find("x (") , std::string::npos) << errors[0].message;
      EXPECT_NE(errors[0].message.find("expandable_segments"), std::string::npos) << errors[0].message;
      EXPECT_EQ(errors[1].type, "PeerError") << errors[1].message;
      EXPECT_EQ(errors[1].ranks, std::vector<int>{0});
    } else {
      for (const Caught& c : errors) EXPECT_EQ(c.type, "") << c.message;
    }
    for (const Caught& c : after) EXPECT_EQ(c.type, "") << c.message;  // the buffer stays usable
  }
}

// Rank 1 reaches the call's first device barrier only after rank 0's call has returned (its
// previous_event is completed by rank 0 then): ranks 0 and 2 time out waiting for it there, and
// their synchronous calls raise the TimeoutError naming rank 1 in the call itself. Rank 1 then
// finds they left and raises a PeerError, also in its call.
TEST(CudaProviderRules, ASynchronousCallWhoseDeviceWaitTimedOutFailsInTheCall) {
  LocalWorld world(3);
  std::vector<Caught> errors(3);
  Event release = Event::pending();
  world.run([&](Group& group) {
    Device dev(group, small_config(1), 0);
    SmallCall call;
    DispatchArgs args = call.args(0);
    args.do_cpu_sync = false;  // no host wait in the middle: only the call's end can see the timeout
    if (group.rank() == 1) {
      args.previous_event = release;
      args.allocate_on_comm_stream = true;
    }
    errors[group.rank()] = catch_error([&] { dev.dispatch(args); });
    if (group.rank() == 0) release.complete();
  });
  for (int r : {0, 2}) {
    EXPECT_EQ(errors[r].type, "TimeoutError") << errors[r].message;
    EXPECT_EQ(errors[r].ranks, std::vector<int>{1});
    EXPECT_NE(errors[r].message.find("rank 1 did not arrive at barrier 0"), std::string::npos) << errors[r].message;
  }
  EXPECT_EQ(errors[1].type, "PeerError") << errors[1].message;
}

}  // namespace
}  // namespace moe_ep::testing
