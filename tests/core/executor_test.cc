#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/executor.hh"
#include "moe_ep/event.hpp"

namespace moe_ep {
namespace {

TEST(Event, CompletesFailsAndTimesOut) {
  Event done;
  EXPECT_TRUE(done.query());
  done.wait();
  Event e = Event::pending();
  EXPECT_FALSE(e.query());
  EXPECT_FALSE(e.wait_for(0.01));
  std::thread t([e] { e.complete(); });
  e.wait();
  t.join();
  Event f = Event::pending();
  f.fail(std::make_exception_ptr(std::runtime_error("boom")));
  EXPECT_THROW(f.wait(), std::runtime_error);
}

TEST(SerialWorker, RunsTasksInOrder) {
  core::SerialWorker w;
  std::vector<int> order;
  for (int i = 0; i < 100; ++i) w.submit([&, i] { order.push_back(i); });
  w.drain();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[static_cast<size_t>(i)], i);
}

TEST(WorkerPool, CoversEveryItemOnceAndPropagatesErrors) {
  for (int size : {1, 2, 4}) {
    core::WorkerPool pool(size);
    for (int round = 0; round < 50; ++round) {
      std::vector<std::atomic<int>> hits(97);
      pool.parallel_for(97, [&](std::int64_t i) { hits[static_cast<size_t>(i)]++; });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    }
    EXPECT_THROW(pool.parallel_for(10, [](std::int64_t i) { if (i == 3) throw std::runtime_error("x"); }),
                 std::runtime_error);
    pool.resize(3);
    std::atomic<int> n{0};
    pool.parallel_for(10, [&](std::int64_t) { n++; });
    EXPECT_EQ(n, 10);
  }
}

}  // namespace
}  // namespace moe_ep
