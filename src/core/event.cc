#include "moe_ep/event.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "core/timeout.hh"

namespace moe_ep {

struct Event::State {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::exception_ptr error;
};

Event::Event() : state_(std::make_shared<State>()) { state_->done = true; }

Event Event::pending() {
  Event e;
  e.state_->done = false;
  return e;
}

bool Event::query() const {
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

void Event::wait() const {
  std::unique_lock lock(state_->mutex);
  state_->done_cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Event::wait_for(double seconds) const {
  std::unique_lock lock(state_->mutex);
  if (!(seconds < core::kNeverSecs)) {
    state_->done_cv.wait(lock, [&] { return state_->done; });  // a deadline that far would overflow the clock
  } else if (!state_->done_cv.wait_for(lock, std::chrono::duration<double>(std::max(seconds, 0.0)),
                                       [&] { return state_->done; })) {
    return false;
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return true;
}

void Event::complete() const {
  {
    std::lock_guard lock(state_->mutex);
    state_->done = true;
  }
  state_->done_cv.notify_all();
}

void Event::fail(std::exception_ptr error) const {
  {
    std::lock_guard lock(state_->mutex);
    state_->error = std::move(error);
    state_->done = true;
  }
  state_->done_cv.notify_all();
}

}  // namespace moe_ep
