// Threads the system does not start (core::start_thread and its users): a bandwidth probe, a
// worker pool, a serial worker and LocalWorld's rank threads each raise ResourceError naming what
// they were starting and how many threads, after joining the threads already started, and stay
// usable; nothing aborts.
//
// Each case runs in a child process (a gtest exit test, re-executed: single-threaded when it
// starts) whose address space is limited to its size plus a little: thread stacks are address
// space, so only the first few threads (or none) can start. The child reports what it caught on
// stderr and exits 0; an abort (std::terminate) or a hang (alarm) fails the expectation.
// Not under the sanitizers: their run-time maps memory as it goes and reports the limit as an error.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "core/bandwidth.hh"
#include "core/executor.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/group.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MOE_EP_THREAD_START_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define MOE_EP_THREAD_START_SANITIZED 1
#endif
#endif

#ifndef MOE_EP_THREAD_START_SANITIZED
namespace moe_ep::core {
namespace thread_start_test {

// The default stack of a new thread (address space it reserves).
std::uint64_t default_stack_bytes() {
  pthread_attr_t attr;
  std::size_t bytes = 0;
  if (pthread_getattr_default_np(&attr) == 0) {
    pthread_attr_getstacksize(&attr, &bytes);
    pthread_attr_destroy(&attr);
  }
  return bytes;
}

std::uint64_t address_space_now() {
  unsigned long long pages = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%llu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return pages * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
}

// In the child: limits the address space to its size now plus `stacks` default thread stacks
// (and 1 MiB), runs `body`, writes "caught <type>: <message>" (or what went wrong) to stderr and
// exits 0.
[[noreturn]] void run_limited(double stacks, const std::function<void()>& body) {
  alarm(60);
  const std::uint64_t limit = address_space_now() + std::uint64_t(stacks * double(default_stack_bytes())) + (1u << 20);
  const rlimit r{limit, limit};
  if (setrlimit(RLIMIT_AS, &r) != 0) {
    std::fprintf(stderr, "setrlimit failed\n");
    std::_Exit(3);
  }
  std::string said = "nothing thrown";
  try {
    body();
  } catch (const ResourceError& e) {
    said = std::string("caught ResourceError: ") + e.what();
  } catch (const std::exception& e) {
    said = std::string("caught another error: ") + e.what();
  }
  std::fprintf(stderr, "%s\n", said.c_str());
  std::fflush(stderr);
  std::_Exit(0);
}

class ThreadStart : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(ThreadStart, ABandwidthProbeJoinsItsThreadsAndRaisesResourceError) {
  // Room for about three stacks: the first threads start (thread 2 or later fails) and wait for
  // the others, which cannot start.
  EXPECT_EXIT(run_limited(3.5, [] { measure_copy_bandwidth(64, 4096, 1); }), ::testing::ExitedWithCode(0),
              "caught ResourceError: memcpy bandwidth probe: thread ([2-9]|[1-9][0-9]+) of 64 could not be started: ");
  EXPECT_EXIT(run_limited(3.5, [] { measure_read_bandwidth(64, 4096, 1); }), ::testing::ExitedWithCode(0),
              "caught ResourceError: read bandwidth probe: thread ([2-9]|[1-9][0-9]+) of 64 could not be started: ");
}

TEST_F(ThreadStart, AWorkerPoolRaisesResourceErrorAndKeepsTheCallersThread) {
  EXPECT_EXIT(run_limited(3.5, [] { WorkerPool pool(64); }), ::testing::ExitedWithCode(0),
              "caught ResourceError: worker pool: thread ([2-9]|[1-9][0-9]+) of 63 could not be started: ");
  // A pool that fails to grow is left with the caller's thread alone, and runs every item on it.
  EXPECT_EXIT(run_limited(3.5,
                          [] {
                            WorkerPool pool(1);
                            std::string error;
                            try {
                              pool.resize(64);
                            } catch (const ResourceError& e) {
                              error = e.what();
                            }
                            std::int64_t sum = 0;
                            pool.parallel_for(100, [&](std::int64_t i) { sum += i; });
                            throw ResourceError("size " + std::to_string(pool.size()) + ", sum " +
                                                std::to_string(sum) + " after: " + error);
                          }),
              ::testing::ExitedWithCode(0),
              "caught ResourceError: size 1, sum 4950 after: worker pool: thread [0-9]+ of 63 could not be started");
}

TEST_F(ThreadStart, ALocalWorldWhoseRankThreadsCannotStartRaisesResourceError) {
  // The ranks that started wait in a barrier for those that could not: they fail at once, are
  // joined, and the world raises the ResourceError. A world of one rank first loads the host's
  // topology (hwloc, once per process), as any earlier use of the library does: hwloc itself does
  // not survive running out of address space while it loads.
  EXPECT_EXIT(
      {
        LocalWorld(1).run([](Group&) {});
        run_limited(3.5, [] { LocalWorld(64).run([](Group& g) { g.barrier(30); }); });
      },
      ::testing::ExitedWithCode(0),
      "caught ResourceError: LocalWorld \\(rank threads\\): thread ([2-9]|[1-9][0-9]+) of 64 could not be started: ");
}

TEST_F(ThreadStart, ASerialWorkerThatCannotStartQueuesNothing) {
  // No room for one stack: submit raises, and drain returns (no task was left queued).
  EXPECT_EXIT(run_limited(0.5,
                          [] {
                            SerialWorker worker;
                            std::string error;
                            try {
                              worker.submit([] {});
                            } catch (const ResourceError& e) {
                              error = e.what();
                            }
                            worker.drain();
                            throw ResourceError("drained after: " + error);
                          }),
              ::testing::ExitedWithCode(0),
              "caught ResourceError: drained after: serial worker: thread 1 of 1 could not be started: ");
}

}  // namespace thread_start_test
}  // namespace moe_ep::core
#endif
