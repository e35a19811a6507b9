#include "engine/counted_exchange.hh"

#include <chrono>
#include <utility>

#include "engine/engine.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine {

CountedExchange::CountedExchange(Engine& engine, std::string phase)
    : engine_(engine), phase_(std::move(phase)), written_(static_cast<std::size_t>(engine.facts.num_ranks), false) {}

void CountedExchange::expect(int source) {
  if (waited_) throw StateError(phase_ + ": expectation added after the wait");
  sources_.push_back(source);
  targets_.push_back(engine_.expect_signal(source));
}

void CountedExchange::put(int peer, std::size_t offset, const void* src, std::size_t bytes) {
  engine_.transport().put(peer, engine_.memory(), offset, src, bytes);
  written_[static_cast<std::size_t>(peer)] = true;
}

void CountedExchange::signal_written() {
  for (std::size_t peer = 0; peer < written_.size(); ++peer) {
    if (!written_[peer]) continue;
    engine_.transport().signal(static_cast<int>(peer));
    written_[peer] = false;
  }
}

std::int64_t CountedExchange::wait() {
  if (waited_) throw StateError(phase_ + ": waited twice");
  waited_ = true;
  if (sources_.empty()) return 0;
  const auto start = std::chrono::steady_clock::now();
  engine_.transport().wait_signals(sources_, targets_, engine_.facts.wait(phase_.c_str()));
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace moe_ep::engine
