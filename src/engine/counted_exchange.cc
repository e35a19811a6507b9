#include "engine/counted_exchange.hh"

#include <chrono>
#include <utility>

#include "core/failure.hh"
#include "engine/engine.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine {

CountedExchange::CountedExchange(Engine& engine, std::string phase)
    : engine_(engine), phase_(std::move(phase)), written_(static_cast<std::size_t>(engine.facts.num_ranks), false) {}

CountedExchange::~CountedExchange() {
  // After a failure: the sources must not be read once the operation returns.
  if (retained_) (void)core::capture([&] { finish_retained(); });
}

void CountedExchange::finish_retained() {
  retained_ = false;
  engine_.transport().finish_retained(engine_.facts.wait(phase_.c_str()));
}

void CountedExchange::expect(int source) {
  if (waited_) throw StateError(phase_ + ": expectation added after the wait");
  sources_.push_back(source);
  targets_.push_back(engine_.expect_signal(source));
}

void CountedExchange::put(int peer, std::size_t offset, const void* src, std::size_t bytes) {
  engine_.transport().put(peer, engine_.memory(), offset, src, bytes);
  written_[static_cast<std::size_t>(peer)] = true;
}

void CountedExchange::put_formed(int peer, std::size_t offset, std::size_t bytes,
                                 const std::function<void(std::byte*)>& form) {
  engine_.transport().put_formed(peer, engine_.memory(), offset, bytes, form);
  written_[static_cast<std::size_t>(peer)] = true;
}

void CountedExchange::put_retained(int peer, std::size_t offset, const void* src, std::size_t bytes) {
  retained_ = true;
  engine_.transport().put_retained(peer, engine_.memory(), offset, src, bytes);
  written_[static_cast<std::size_t>(peer)] = true;
}

void CountedExchange::signal_written() {
  for (std::size_t peer = 0; peer < written_.size(); ++peer) {
    if (!written_[peer]) continue;
    engine_.transport().signal(static_cast<int>(peer));
    written_[peer] = false;
  }
}

std::int64_t CountedExchange::wait(bool tolerant) {
  if (waited_) throw StateError(phase_ + ": waited twice");
  waited_ = true;
  const auto start = std::chrono::steady_clock::now();
  const comm::Wait w = engine_.facts.wait(phase_.c_str());
  if (!sources_.empty() && tolerant) {
    comm::Transport& t = engine_.transport();
    const std::vector<int> missing = t.wait_signals_tolerant(sources_, targets_, w);
    if (!missing.empty())
      comm::fail_wait(engine_.facts.rank, w, missing,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                      [&](int r) { return t.departure(r); });
  } else if (!sources_.empty()) {
    engine_.transport().wait_signals(sources_, targets_, w);
  }
  if (retained_) finish_retained();
  if (sources_.empty()) return 0;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace moe_ep::engine
