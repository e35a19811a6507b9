// Events: completion of work that runs on a rank's communication worker.
//
// An Event is a shared handle on one unit of work. wait() blocks until the work finished and
// rethrows its error, if any; everything the work wrote is visible to the waiting thread after
// wait() returns. A default-constructed Event is already complete (what synchronous calls
// return). Callers create their own events with Event::pending() and complete them with
// complete(), to order library work after their own (the previous_event argument).
#pragma once

#include <exception>
#include <memory>

namespace moe_ep {

class Event {
 public:
  Event();  // already complete
  static Event pending();

  bool query() const;  // true once complete (successfully or not)
  void wait() const;   // blocks; rethrows the work's error
  // Blocks at most `seconds`; returns false on timeout. Rethrows the work's error.
  bool wait_for(double seconds) const;

  void complete() const;
  void fail(std::exception_ptr error) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace moe_ep
