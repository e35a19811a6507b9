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

inline std::int64_t align(std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; }

inline std::atomic<std::uint64_t>* header(std::byte* slot) {
  return reinterpret_cast<std::atomic<std::uint64_t>*>(slot);
}

// Waits until `rank`'s slot header shows call `number`; returns the nanoseconds waited. A rank
// that left or gave up is reported at once; a failed wait leaves the ranks out of step (also in a
// receive hook, outside any operation), so the buffer leaves its channel.
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

// A low-latency operation's validation: runs `check` (the arguments), then takes the call's slot
// into `use` whether or not the arguments passed (every rank's slots stay in step), then throws the
// first failure: the arguments', or the slot's.
template <class Check>
void take_slot(BufferCore& core, const std::string& context, int max_tokens, int hidden, int num_experts, bool hook,
               BufferCore::SlotUse& use, Check&& check) {
  const std::exception_ptr rejected = core::attempt(context, check);
  use = core.take_slot(max_tokens, hidden, num_experts, hook, rejected == nullptr);
  if (rejected) std::rethrow_exception(rejected);
  if (!use.problem.empty()) core::fail(context, "{}", use.problem);
}

}  // namespace moe_ep::legacy
