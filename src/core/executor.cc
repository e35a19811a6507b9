#include "core/executor.hh"

#include <fmt/format.h>

#include "core/failure.hh"
#include "core/log.hh"
#include "core/placement.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::core {

SerialWorker::~SerialWorker() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SerialWorker::submit(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable())
      thread_ = start_thread("serial worker", 0, 1, [this, rank = thread_rank(), placement = thread_placement()] {
        set_thread_rank(rank);  // the lines of the rank's worker show its rank
        place_worker_thread(placement, 0);  // the rank's first worker core (or its share)
        loop();
      });  // not started: nothing was queued
    tasks_.push_back(std::move(task));
  }
  wake_.notify_one();
}

void SerialWorker::drain() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return tasks_.empty() && !running_task_; });
}

void SerialWorker::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping and nothing left
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    running_task_ = true;
    lock.unlock();
    task();  // tasks report their own errors (through their Event)
    lock.lock();
    running_task_ = false;
    if (tasks_.empty()) idle_.notify_all();
  }
}

WorkerPool::WorkerPool(int size) : size_(1) { resize(size); }

WorkerPool::~WorkerPool() { stop_helpers(); }

void WorkerPool::stop_helpers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
  helpers_.clear();
  stopping_ = false;
}

void WorkerPool::resize(int size) {
  if (size < 1) size = 1;
  if (size > kMaxWorkers)
    throw InvalidArgument(fmt::format("worker pool: {} workers requested, the limit is {}", size, kMaxWorkers));
  if (size == size_ && static_cast<int>(helpers_.size()) == size - 1) return;
  stop_helpers();
  size_ = 1;
  try {
    helpers_.reserve(static_cast<std::size_t>(size - 1));
    for (int i = 1; i < size; ++i)
      helpers_.push_back(
          start_thread("worker pool", i - 1, size - 1, [this, i, rank = thread_rank(), placement = thread_placement()] {
            set_thread_rank(rank);
            place_worker_thread(placement, i - 1);  // helper i on worker core i - 1 (or the rank's share)
            helper_loop(i);
          }));
  } catch (...) {
    stop_helpers();  // joins the helpers that started; the pool is left with its caller's thread alone
    throw;
  }
  size_ = size;
}

void WorkerPool::run_items() {
  for (;;) {
    std::int64_t item;
    const std::function<void(std::int64_t)>* job;
    {
      std::lock_guard lock(mutex_);
      if (next_item_ >= job_size_ || error_) return;
      item = next_item_++;
      job = job_;
    }
    if (std::exception_ptr error = capture([&] { (*job)(item); })) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::move(error);
    }
  }
}

void WorkerPool::helper_loop(int) {
  std::uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
    if (stopping_) return;
    seen = generation_;
    ++helpers_busy_;
    lock.unlock();
    run_items();
    lock.lock();
    if (--helpers_busy_ == 0) done_.notify_all();
  }
}

void WorkerPool::parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn) {
  if (n <= 0) return;
  if (size_ == 1 || n == 1) {
    for (std::int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    job_ = &fn;
    job_size_ = n;
    next_item_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  run_items();
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    // Helpers that woke late find no items left and return at once.
    done_.wait(lock, [&] { return helpers_busy_ == 0 && (next_item_ >= job_size_ || error_); });
    job_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace moe_ep::core
