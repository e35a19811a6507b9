// HostExec, the executor the CUDA provider's algorithm runs on without a GPU (host_exec.hh): every
// index of a step runs once, steps are ordered, a step runs on several threads in an order that
// is not the index order and changes from call to call (so that a step depending on index order
// fails, as on a GPU), and the symmetric regions of ranks as processes are shared memory that
// peers reach through mappings of their own. The expected values are computed here, index by index.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cuda/host_exec.hh"

namespace moe_ep::testing {
namespace host_exec_test {

using cuda::testing::HostExec;

TEST(HostExec, EveryIndexRunsOnceAndEachStepEndsBeforeTheNext) {
  HostExec exec(0);
  for (const std::int64_t n : {0, 1, 2, 3, 7, 255, 256, 257, 1000, 100003}) {
    std::vector<std::int32_t> runs(static_cast<std::size_t>(n), 0), a(runs.size(), -1), b(runs.size(), -1);
    std::int32_t* const r = runs.data();
    std::int32_t* const pa = a.data();
    std::int32_t* const pb = b.data();
    exec.each(n, [=](std::int64_t i) {
      std::atomic_ref<std::int32_t>(r[i]).fetch_add(1);
      pa[i] = static_cast<std::int32_t>(3 * i);
    });
    exec.each(n, [=](std::int64_t i) { pb[i] = pa[n - 1 - i] + 1; });  // reads the other end of the last step
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(runs[static_cast<std::size_t>(i)], 1) << "n " << n << ", index " << i;
      ASSERT_EQ(b[static_cast<std::size_t>(i)], 3 * (n - 1 - i) + 1) << "n " << n << ", index " << i;
    }
  }
}

// Index i + 1 takes index i's value plus one, within one step: right only when the indices run
// one after another in ascending order (as a plain loop does), wrong here as on a GPU.
TEST(HostExec, AStepThatReadsAnotherIndexsWriteGivesWrongResults) {
  constexpr std::int64_t n = 1000;
  std::vector<std::int64_t> expected(n + 1);
  for (std::int64_t i = 0; i <= n; ++i) expected[static_cast<std::size_t>(i)] = i;
  auto chain = [](std::int64_t* a) {
    return [a](std::int64_t i) {  // atomic accesses: an order dependence, not a data race
      const std::int64_t before = std::atomic_ref<std::int64_t>(a[i]).load(std::memory_order_relaxed);
      std::atomic_ref<std::int64_t>(a[i + 1]).store(before + 1, std::memory_order_relaxed);
    };
  };
  std::vector<std::int64_t> in_order(n + 1, -1);
  in_order[0] = 0;
  const auto step = chain(in_order.data());
  for (std::int64_t i = 0; i < n; ++i) step(i);
  EXPECT_EQ(in_order, expected);  // the step is right in index order
  for (int e = 0; e < 3; ++e) {
    HostExec exec(0);
    for (int call = 0; call < 3; ++call) {
      std::vector<std::int64_t> a(n + 1, -1);
      a[0] = 0;
      exec.each(n, chain(a.data()));
      EXPECT_NE(a, expected) << "executor " << e << ", call " << call << " ran the indices in ascending order";
    }
  }
}

TEST(HostExec, TheOrderIsNotTheIndexOrderAndChangesFromCallToCall) {
  constexpr std::int64_t n = 1000;
  HostExec exec(0);
  std::vector<std::int64_t> identity(n);
  std::iota(identity.begin(), identity.end(), 0);
  std::vector<std::vector<std::int64_t>> orders;
  for (int call = 0; call < 3; ++call) {
    std::vector<std::int64_t> ticket_of(n, -1);
    std::int64_t next = 0;
    std::int64_t* const t = ticket_of.data();
    std::int64_t* const counter = &next;
    exec.each(n, [=](std::int64_t i) { t[i] = std::atomic_ref<std::int64_t>(*counter).fetch_add(1); });
    std::vector<std::int64_t> sorted = ticket_of;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, identity) << "every index takes one ticket";
    EXPECT_NE(ticket_of, identity) << "call " << call << " ran in index order";
    orders.push_back(ticket_of);
  }
  EXPECT_NE(orders[0], orders[1]);
  EXPECT_NE(orders[1], orders[2]);
}

TEST(HostExec, AStepRunsOnSeveralThreads) {
  HostExec exec(0);
  for (const std::int64_t n : {2, 3, 4, 64, 5000}) {
    std::vector<std::thread::id> ran_on(static_cast<std::size_t>(n));
    std::thread::id* const out = ran_on.data();
    exec.each(n, [=](std::int64_t i) { out[i] = std::this_thread::get_id(); });
    const std::set<std::thread::id> threads(ran_on.begin(), ran_on.end());
    EXPECT_EQ(threads.size(), static_cast<std::size_t>(std::min<std::int64_t>(n, HostExec::kThreads))) << "n " << n;
  }
}

TEST(HostExec, AnExceptionIsRethrownAfterEveryIndexRan) {
  HostExec exec(0);
  std::vector<std::int32_t> runs(100, 0);
  std::int32_t* const r = runs.data();
  EXPECT_THROW(exec.each(100,
                         [=](std::int64_t i) {
                           std::atomic_ref<std::int32_t>(r[i]).fetch_add(1);
                           if (i == 17 || i == 60) throw std::runtime_error("step failed");
                         }),
               std::runtime_error);
  for (std::int32_t c : runs) EXPECT_EQ(c, 1);
  exec.each(3, [=](std::int64_t i) { r[i] = 7; });  // usable afterwards
  EXPECT_EQ(runs[2], 7);
}

// A region of alloc_symmetric opened by another executor: the same pages at another address,
// plain writes and atomics seen through both.
TEST(HostExec, SymmetricRegionsAreSharedMemoryMappedAgainByPeers) {
  HostExec owner(0), peer(0);
  constexpr std::size_t bytes = 1 << 16;
  std::shared_ptr<void> region = owner.alloc_symmetric(bytes);
  char handle[64] = {};
  owner.ipc_handle(region.get(), handle);
  std::shared_ptr<void> mapped = peer.open_ipc(handle);
  ASSERT_NE(mapped.get(), region.get());
  auto* const mine = static_cast<std::uint64_t*>(region.get());
  auto* const theirs = static_cast<std::uint64_t*>(mapped.get());
  for (std::size_t i = 0; i < bytes / 8; ++i) mine[i] = i * 5;
  for (std::size_t i = 0; i < bytes / 8; ++i) ASSERT_EQ(theirs[i], i * 5) << i;
  theirs[3] = 42;
  EXPECT_EQ(mine[3], 42u);
  mine[0] = 0;
  constexpr int kAdds = 20000;
  std::thread a([&] {
    for (int i = 0; i < kAdds; ++i) std::atomic_ref<std::uint64_t>(mine[0]).fetch_add(1);
  });
  std::thread b([&] {
    for (int i = 0; i < kAdds; ++i) std::atomic_ref<std::uint64_t>(theirs[0]).fetch_add(1);
  });
  a.join();
  b.join();
  EXPECT_EQ(std::atomic_ref<std::uint64_t>(mine[0]).load(), 2u * kAdds);
  mapped.reset();
  EXPECT_EQ(mine[3], 42u);  // the owner's mapping outlives the peer's
}

}  // namespace host_exec_test
}  // namespace moe_ep::testing
