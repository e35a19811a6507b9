// What the low-latency operations of the V1 Buffer share (private to src/legacy/): the slot
// header that publishes a call number, the wait for a peer's publication, and the taking of a
// call's slot. Guarantees: a published number is seen with every byte staged before it
// (release/acquire); a failed wait leaves the buffer's channel (the ranks are out of step).
#pragma once

#include <atomic>
#include <cstdint>

#include "core/checks.hh"
#include "core/failure.hh"
#include "legacy/buffer_core.hh"

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
  header(core.slot_base(core.engine.rank, slot))->store(number, std::memory_order_release);
}

// Takes the call's slot once the arguments were checked (the slot is taken either way).
template <class Op>
void take_slot(BufferCore& core, Op& op, int max_tokens, int hidden, int num_experts, bool hook) {
  op.use = core.take_slot(max_tokens, hidden, num_experts, hook, op.local_error == nullptr);
  if (op.local_error || op.use.problem.empty()) return;
  op.local_error = core::attempt(op.context(), [&] { core::fail(op.context(), "{}", op.use.problem); });
}

}  // namespace moe_ep::legacy
