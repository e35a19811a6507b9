// What the low-latency operations of the V1 Buffer share (private to src/legacy/): the slot
// header that publishes a call number, the wait for a peer's publication, and the taking of a
// call's slot. Guarantees: a published number is seen with every byte staged before it
// (release/acquire); a failed wait leaves the buffer's channel (the ranks are out of step).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "core/checks.hh"
#include "core/failure.hh"
#include "engine/counted_exchange.hh"
#include "engine/engine.hh"
#include "legacy/buffer_core.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"

namespace moe_ep::legacy {

inline std::atomic<std::uint64_t>* header(std::byte* slot) {
  return reinterpret_cast<std::atomic<std::uint64_t>*>(slot);
}

// Waits until `rank`'s slot header shows call `number`; returns the nanoseconds waited. A rank
// that left or gave up is reported at once; a failed wait leaves the ranks out of step (also in a
// receive hook, outside any operation), so the buffer leaves its channel, except in shrink mode,
// where the rank is masked as failed and the buffer stays usable (BufferCore::fail_wait).
std::int64_t wait_published(BufferCore& core, int rank, int slot, std::uint64_t number, const char* phase);

inline void publish(BufferCore& core, int slot, std::uint64_t number) {
  header(core.slot_base(core.engine.facts.rank, slot))->store(number, std::memory_order_release);
}

// Tokens of `source` selecting the local experts of `expert_rank`, from per-(source, expert)
// counts [R * E] with El local experts per rank.
inline std::int32_t selections(const std::vector<std::int32_t>& counts, int num_experts, int local_experts, int source,
                               int expert_rank) {
  std::int32_t n = 0;
  for (int i = 0; i < local_experts; ++i)
    n += counts[static_cast<std::size_t>(source) * num_experts + expert_rank * local_experts + i];
  return n;
}

// Expects one signal in `exchange` from each rank of another node that sends here (`sends(r)`), in
// rank order.
template <class Sends>
void expect_other_nodes(const engine::Engine& engine, engine::CountedExchange& exchange, Sends&& sends) {
  for (int r = 0; r < engine.facts.num_ranks; ++r)
    if (!engine.facts.same_node(r) && sends(r)) exchange.expect(r);
}

// Runs low-latency operation Op (`name` names it in messages) on `args`; with return_recv_hook the
// result's hook does the receiving later, and refuses to once the buffer is gone.
template <class Op, class Args>
auto run_low_latency(BufferCore& core, const char* name, const Args& args) {
  auto& e = core.engine;
  e.check_usable(name);
  auto op = std::make_shared<Op>(core, args, e.next_sequence());
  auto result = e.execute(op, args.async_finish);
  if (args.return_recv_hook) result.hook = ReceiveHook([op, alive = core.alive, calls = core.calls, name] {
    std::lock_guard lock(*calls);
    if (!*alive) throw StateError(std::string(name) + ": the receive hook was called after its buffer was destroyed");
    op->receive(false);
  });
  return result;
}

// Shrink mode (docs/legacy.md §4): whether the buffer's low-latency calls go on without the
// ranks that fail.
inline bool shrinks(const BufferCore& core) { return core.config.enable_shrink && core.config.low_latency_mode; }

// Shrink mode: the ranks the tolerant exchange of a call dropped ([rank]: why, "" for the others)
// are masked as failed.
inline void mark_dropped(BufferCore& core, const std::vector<std::string>& why) {
  for (int r = 0; r < static_cast<int>(why.size()); ++r)
    if (!why[static_cast<std::size_t>(r)].empty()) core.mark_failed(r, why[static_cast<std::size_t>(r)]);
}

// Waits for the signals of `exchange`; in shrink mode a source that failed is masked as failed and
// named by the error, and the buffer stays usable (BufferCore::fail_wait).
inline std::int64_t wait_remote(BufferCore& core, engine::CountedExchange& exchange) {
  if (!shrinks(core)) return exchange.wait();
  std::int64_t ns = 0;
  const std::exception_ptr error =
      core::attempt(core.engine.facts.context("low-latency"), [&] { ns = exchange.wait(true); });
  if (error) core.fail_wait(error);
  return ns;
}

// A low-latency operation's slot, planned before its agreement (on the executing thread, in call
// order): refuses the call, on this rank, if the slot cannot be used now. The slot is taken only
// after the agreement (BufferCore::take_slot), so a refused call changes nothing.
inline BufferCore::SlotUse plan_slot(const BufferCore& core, const std::string& context, int max_tokens, int hidden,
                                     int num_experts, bool hook) {
  BufferCore::SlotUse use = core.plan_slot(max_tokens, hidden, num_experts, hook);
  if (!use.problem.empty()) core::fail(context, "{}", use.problem);
  return use;
}

}  // namespace moe_ep::legacy
