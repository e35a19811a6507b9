// Execution resources of one rank: a serial FIFO worker (the "communication stream") and a pool
// of helper threads for data-parallel copies (the "SMs").
//
// SerialWorker runs submitted tasks one at a time, in submission order, on its own thread, and
// starts that thread on first use. drain() returns once every task submitted before it finished.
// WorkerPool::parallel_for(n, fn) calls fn(i) for every i in [0, n) on the calling thread plus
// up to size()-1 helpers and returns when all calls returned; the first exception is rethrown
// after all calls finished. Effects of the calls are visible to the caller afterwards.
// A thread the system does not start is a ResourceError naming the executor and the thread count
// (core::start_thread): submit() then queues nothing, resize() leaves a pool of size 1 (the
// caller's thread alone) with the helpers it had started joined.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "moe_ep/limits.hpp"  // kMaxWorkers: WorkerPool's limit

namespace moe_ep::core {

class SerialWorker {
 public:
  SerialWorker() = default;
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  void submit(std::function<void()> task);
  void drain();

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> tasks_;
  bool running_task_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

class WorkerPool {
 public:
  explicit WorkerPool(int size = 1);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return size_; }
  // Not while parallel_for runs. Sizes below 1 count as 1; above kMaxWorkers is an
  // InvalidArgument (callers check their arguments against the limit first).
  void resize(int size);
  void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn);

 private:
  void stop_helpers();
  void helper_loop(int index);
  void run_items();

  int size_;
  std::vector<std::thread> helpers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
  // The job in flight.
  const std::function<void(std::int64_t)>* job_ = nullptr;
  std::int64_t job_size_ = 0;
  std::int64_t next_item_ = 0;
  int helpers_busy_ = 0;
  std::exception_ptr error_;
};

}  // namespace moe_ep::core
