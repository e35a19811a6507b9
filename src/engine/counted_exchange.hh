// A counted exchange: this rank puts records into peers' symmetric regions, signals each peer it
// wrote to once, and waits for the signals of the peers that write to it, under a phase name.
//
// The completion rules live here once:
//  - a peer is signalled once per exchange, after every put to it (signal() orders them: the peer
//    that sees the signal sees every byte put before it);
//  - a peer that writes nothing is not signalled, and a source expected to write nothing is not
//    waited for: both sides derive "writes to me" from the same agreed counts;
//  - expectations are cumulative per source over the engine's life (Engine::expect_signal), so
//    they must be counted in call order on every rank: expect() at the point of the operation
//    where its peers signal, never later;
//  - wait() may run later than the puts (a receive hook), but at most once;
//  - put_retained() sources are read until wait() returns (or the exchange is destroyed): the
//    caller keeps them valid and unchanged for the exchange's life.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace moe_ep::engine {

class Engine;

class CountedExchange {
 public:
  // `phase` names the wait in timeouts and peer errors ("dispatch: scale-out records").
  CountedExchange(Engine& engine, std::string phase);
  // Waits (best effort, as long as a wait may) for sends still reading retained sources.
  ~CountedExchange();
  CountedExchange(const CountedExchange&) = delete;
  CountedExchange& operator=(const CountedExchange&) = delete;

  // This rank receives from `source` in this exchange: one more signal expected from it.
  void expect(int source);
  // Copies `bytes` from `src` into `peer`'s symmetric memory at `offset`; the peer is signalled
  // by signal_written().
  void put(int peer, std::size_t offset, const void* src, std::size_t bytes);
  // Like put(), but the transport may send the bytes from `src` without copying them first
  // (comm::Transport::put_retained): `src` stays valid and unchanged until wait() returns.
  void put_retained(int peer, std::size_t offset, const void* src, std::size_t bytes);
  // Like put(), but form(dst) writes the `bytes` bytes where they go (comm::Transport::put_formed):
  // a row computed for the peer is written once.
  void put_formed(int peer, std::size_t offset, std::size_t bytes, const std::function<void(std::byte*)>& form);
  // Signals every peer put() wrote to since the last call, once each, in rank order.
  void signal_written();
  // Waits until every expected signal arrived; returns the nanoseconds it waited. At most once;
  // nothing to do (0) without expectations. tolerant (shrink mode): a source that left or did not
  // arrive is a PeerError or TimeoutError naming it, and this rank stays on the channel.
  std::int64_t wait(bool tolerant = false);

  bool expects_any() const { return !sources_.empty(); }
  // The sources expected so far, in the order expect() counted them.
  const std::vector<int>& sources() const { return sources_; }

 private:
  Engine& engine_;
  std::string phase_;
  std::vector<int> sources_;
  std::vector<std::uint64_t> targets_;
  // Sends of retained sources are waited for (comm::Transport::finish_retained).
  void finish_retained();

  std::vector<bool> written_;  // [ranks]
  bool waited_ = false;
  bool retained_ = false;  // put_retained() was called and its sends were not waited for
};

}  // namespace moe_ep::engine
