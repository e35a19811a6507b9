// One collective call of an engine, declared as four phases that the engine runs in this order on
// every rank (Engine::execute, Engine::run_sync):
//  1. validate()  on the calling thread, when the engine takes the call: checks this rank's
//                 arguments and sets up what must exist before the call returns (a new handle).
//  2. prepare()   on the executing thread (inline, or the communication worker): the work before
//                 the agreement; returns what this rank publishes in it.
//  3. describe()  the agreement's signature fields. The engine exchanges the agreement, carrying
//                 the first failure of phases 1-2 as this rank's rejection, so that peers never
//                 wait for a rank that threw: either every rank proceeds or every rank throws.
//  4. run()       the steps after the agreement, given every rank's payload.
// Guarantees: a failure in phases 1-3 is reported on every rank alike and leaves the engine usable.
// A failure in run() leaves the ranks out of step, so the engine marks itself broken and leaves
// its channel, unless it was raised inside in_step(): checks of what the agreement gathered, which
// every rank makes alike.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe_ep/error.hpp"

namespace moe_ep::comm {
class Agreement;
}

namespace moe_ep::engine {

class Engine;

class Operation {
 public:
  // `context` prefixes messages ("[rank 2] dispatch"); `name` is the agreement's operation and
  // `agreement_phase` the phase its wait reports ("dispatch: agreement").
  Operation(std::string context, std::string name, std::string agreement_phase)
      : context_(std::move(context)), name_(std::move(name)), agreement_phase_(std::move(agreement_phase)) {}
  virtual ~Operation() = default;
  Operation(const Operation&) = delete;
  Operation& operator=(const Operation&) = delete;

  const std::string& context() const { return context_; }
  // Shrink mode: the ranks this call counts on (1 each, this rank included), or empty for a call of
  // every rank. Such a call's agreement runs over the engine's TolerantGather among those ranks
  // (Engine::make_tolerant): the ranks that stopped are left out of it, members() says who took
  // part, and no failure of the call leaves the channel (they are reported as in-step failures).
  virtual std::vector<char> counted_on() const { return {}; }
  const std::vector<char>& members() const { return members_; }
  // Shapes of the outputs are known without the count exchange (cached, or no CPU sync).
  virtual bool outputs_known_early() const = 0;
  virtual void allocate_outputs_early() = 0;

 protected:
  virtual void validate() {}
  virtual std::vector<std::byte> prepare() { return {}; }
  // Called after a rejection too (the values are then not compared): never reads state that only
  // a successful validate() or prepare() sets without checking it.
  virtual void describe(comm::Agreement& agreement) const = 0;
  // Calls outputs_ready() once the outputs exist (at most once; not on failure).
  virtual void run(const std::vector<std::span<const std::byte>>& payloads,
                   const std::function<void()>& outputs_ready) = 0;

  // Runs checks of what the agreement gathered: a failure inside is raised by every rank alike.
  template <class Fn>
  void in_step(Fn&& fn) {
    in_step_failure_ = true;
    fn();
    in_step_failure_ = false;
  }
  bool rejected() const { return rejection_ != nullptr; }
  // Shrink mode: called once the tolerant exchange decided who takes part, before its checks, with
  // the ranks counted on that did not and why ([rank]: "" for the others).
  virtual void dropped(const std::vector<std::string>& why) {}

 private:
  friend class Engine;
  std::string context_, name_, agreement_phase_;
  std::exception_ptr rejection_;  // the first failure of validate() or prepare()
  bool in_step_failure_ = false;
  bool tolerant_ = false;         // its agreement ran over the TolerantGather
  std::vector<char> members_;     // [rank]: took part (shrink mode); empty otherwise
};

// Every rank's payload read as one T each: throws StateError naming a rank whose block has another size.
template <class T>
std::vector<T> payload_per_rank(const std::vector<std::span<const std::byte>>& payloads, const std::string& context) {
  std::vector<T> all(payloads.size());
  for (std::size_t r = 0; r < payloads.size(); ++r) {
    if (payloads[r].size() != sizeof(T))
      throw StateError(context + ": rank " + std::to_string(r) + " published " + std::to_string(payloads[r].size()) +
                       " bytes, expected " + std::to_string(sizeof(T)));
    std::memcpy(&all[r], payloads[r].data(), sizeof(T));
  }
  return all;
}

}  // namespace moe_ep::engine
