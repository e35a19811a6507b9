// What the low-latency operations of the V1 Buffer share (private to src/legacy/): the slot
// header that publishes a call number, the wait for a peer's publication, and the taking of a
// call's slot. Guarantees: a published number is seen with every byte staged before it
// (release/acquire); a failed wait leaves the buffer's channel (the ranks are out of step).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
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

// The staged rows each local expert takes from each source read in place, found in one pass over
// the sources' top-k ids instead of one pass per expert: for local expert i (global id first + i)
// and source s, of(i, s) lists token * k + lane for every token of s that selects it, in token
// order (a token names an expert at most once: the dispatch's checks refuse repeats).
class ExpertRows {
 public:
  // ids_of(s): source s's ids ([tokens, k] int32) and token count, or {nullptr, 0} for a source
  // not read in place.
  template <class IdsOf>
  void build(int local_experts, int ranks, int k, std::int64_t first, IdsOf&& ids_of) {
    start_.assign(static_cast<std::size_t>(local_experts) * ranks + 1, 0);
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1) {  // counts to starts, then fill from each start
        for (std::size_t c = 1; c < start_.size(); ++c) start_[c] += start_[c - 1];
        entry_.resize(static_cast<std::size_t>(start_.back()));
        cursor_.assign(start_.begin(), start_.end() - 1);
      }
      for (int s = 0; s < ranks; ++s) {
        const auto [ids, tokens] = ids_of(s);
        for (std::int32_t t = 0; t < tokens; ++t)
          for (int j = 0; j < k; ++j) {
            const std::int64_t i = ids[t * k + j] - first;
            if (i < 0 || i >= local_experts) continue;
            const std::size_t at = static_cast<std::size_t>(i) * ranks + s;
            if (pass == 0) ++start_[at + 1];
            else entry_[static_cast<std::size_t>(cursor_[at]++)] = t * k + j;
          }
      }
    }
    ranks_ = ranks;
  }
  std::span<const std::int32_t> of(std::int64_t i, int s) const {
    const std::size_t at = static_cast<std::size_t>(i) * ranks_ + s;
    return {entry_.data() + start_[at], static_cast<std::size_t>(start_[at + 1] - start_[at])};
  }

 private:
  std::vector<std::int32_t> start_, cursor_, entry_;
  int ranks_ = 0;
};

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
