// Low-latency slots of the V1 Buffer (docs/legacy.md §4): the slot geometry, the bookkeeping of
// the two slots (buffer_core.hh states the rules), the wait for a peer's published call number,
// the clean operation and the combine buffer of the next call. The dispatch and the combine live
// in low_latency_dispatch.cc and low_latency_combine.cc.

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "comm/wait.hh"
#include "core/arith.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "engine/call_shape.hh"
#include "legacy/buffer_core.hh"
#include "legacy/low_latency_steps.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::legacy {

std::int64_t wait_published(BufferCore& core, int rank, int slot, std::uint64_t number, const char* phase) {
  auto* h = header(core.slot_base(rank, slot));
  if (h->load(std::memory_order_acquire) >= number) return 0;
  comm::Backoff backoff(core.engine.facts.config.timeout_secs);
  const auto start = std::chrono::steady_clock::now();
  const std::string context = core.engine.facts.context(phase);
  long polls = 0;
  const std::exception_ptr error = core::attempt(context, [&] {
    while (h->load(std::memory_order_acquire) < number) {
      if (++polls % 256 == 0) core.engine.transport().check_peer(rank, phase);
      if (!backoff.pause())
        throw TimeoutError(fmt::format("{}: timed out after {:.1f} s (timeout {:g} s) waiting for rank {} to publish "
                                       "its data",
                                       context, backoff.elapsed_secs(), core.engine.facts.config.timeout_secs, rank),
                           {rank});
    }
  });
  if (error) core.fail_wait(error);  // shrink mode: the rank is masked; else the ranks are out of step
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

namespace {

using std::int64_t;

class CleanLowLatency final : public engine::Operation {
 public:
  CleanLowLatency(BufferCore& core, int N, int H, int E, std::string rejection, std::uint64_t sequence)
      : Operation(core.engine.facts.context("clean_low_latency_buffer"), "clean_low_latency_buffer",
                  "clean_low_latency_buffer: agreement"),
        core_(core),
        rejection_(std::move(rejection)),
        sequence_(sequence),
        ctx_(context()) {
    shape_.max_tokens = N;
    shape_.hidden = H;
    shape_.experts = E;
  }
  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {}
  std::vector<char> counted_on() const override { return core_.counted_on(); }
  void dropped(const std::vector<std::string>& why) override { mark_dropped(core_, why); }

 private:
  void validate() override {
    if (!rejection_.empty()) core::fail(ctx_, "{}", rejection_);
    const int N = shape_.max_tokens, H = shape_.hidden, E = shape_.experts, R = core_.engine.facts.num_ranks;
    if (!core_.config.low_latency_mode) core::fail(ctx_, "the buffer was built with low_latency_mode = false");
    if (N <= 0 || H <= 0 || E <= 0 || E % R != 0)
      core::fail(ctx_, "needs N > 0 (got {}), hidden > 0 (got {}) and num_experts a positive multiple of {} (got {})", N,
                 H, R, E);
    const std::int64_t need = SlotLayout::pool_bytes(N, H, R, E);
    if (need > core_.config.num_rdma_bytes)
      throw CapacityError(fmt::format("{}: low-latency calls with N = {}, hidden = {}, {} experts need num_rdma_bytes "
                                      ">= {} (the buffer has {})", ctx_, N, H, E, need, core_.config.num_rdma_bytes),
                          need, core_.config.num_rdma_bytes);
  }
  void describe(comm::Agreement& agreement) const override {
    agreement.field("operation number", static_cast<int64_t>(sequence_))
        .field("N", shape_.max_tokens)
        .field("hidden", shape_.hidden)
        .field("num_experts", shape_.experts);
  }
  void run(const std::vector<std::span<const std::byte>>&, const std::function<void()>&) override {
    auto& e = core_.engine;
    core_.cleaned(shape_.max_tokens, shape_.hidden, shape_.experts);
    for (int slot = 0; slot < 2; ++slot) header(core_.slot_base(e.facts.rank, slot))->store(0, std::memory_order_release);
    if (members().empty()) {
      e.transport().barrier(comm::Scope::kWorld, e.facts.wait("clean_low_latency_buffer: exit"));
      return;
    }
    // Shrink mode: the exit barrier of the ranks that took part, which goes on without those that fail.
    mark_dropped(core_, e.tolerant()->barrier("clean_low_latency_buffer: exit", members(), e.facts.config.timeout_secs).dropped);
  }

 private:
  BufferCore& core_;
  std::string rejection_;
  engine::CallShape shape_;  // max_tokens, hidden and experts of the slots to clean
  std::uint64_t sequence_;
  std::string ctx_;
};

}  // namespace

// ---- SlotLayout and bookkeeping ------------------------------------------------------------------

SlotLayout::SlotLayout(int max_tokens, int hidden, int num_ranks, int num_experts, int k, RowFormat format) {
  const std::int64_t N = max_tokens, H = hidden, E = num_experts, blocks = core::ceil_div(H, 128);
  if (format.nvfp4) {
    payload_bytes = H / 2;
    scales_bytes = H / 16;
  } else {
    payload_bytes = format.fp8 ? H : 2 * H;
    scales_bytes = format.fp8 ? (format.ue8m0 ? 4 * core::ceil_div(blocks, 4) : 4 * blocks) : 0;
  }
  token_offset = payload_bytes + scales_bytes;
  weight_offset = token_offset + 4;
  row_bytes = core::round_up<std::int64_t>(token_offset + (format.weights ? 8 : 4), 16);
  combine_row_elements = H + 2 * blocks;
  combine_recv_row_bytes = 2 * H + 4 * blocks;
  (void)k;
  // Fixed per shape: the widest row (BF16 with a weight) and the largest id and weight tables
  // (k <= min(32, E)).
  const std::int64_t widest_row = core::round_up<std::int64_t>(2 * H + 8, 16);
  const std::int64_t table = N * std::min<std::int64_t>(kMaxTopk, E) * 4;
  ids_offset = N * widest_row;
  weights_offset = ids_offset + table;
  const std::int64_t send = std::max(N * widest_row + 2 * table, E * N * combine_row_elements * 2);
  const std::int64_t recv = std::max(E * N * widest_row, E * N * combine_recv_row_bytes);
  recv_offset = core::round_up<std::int64_t>(kHeaderBytes + send, 64);
  slot_bytes = core::round_up<std::int64_t>(recv_offset + recv, 64);
  (void)num_ranks;
}

std::int64_t SlotLayout::pool_bytes(int max_tokens, int hidden, int num_ranks, int num_experts) {
  return 2 * SlotLayout(max_tokens, hidden, num_ranks, num_experts, kMaxTopk, RowFormat{}).slot_bytes;
}

std::int64_t BufferCore::slot_offset(int slot) const {
  // Slots sit at fixed offsets for the shape, whatever the call's k and dtype.
  return slot * slot_stride_.load(std::memory_order_relaxed);
}

std::byte* BufferCore::slot_base(int rank, int slot) { return engine.memory().node_peer(rank) + slot_offset(slot); }

TensorView BufferCore::combine_buffer(int slot, const SlotLayout& layout, std::int64_t local_experts,
                                      std::int64_t slab_rows, std::int64_t hidden) {
  const std::int64_t shape[] = {local_experts, slab_rows, hidden};
  const std::int64_t strides[] = {slab_rows * layout.combine_row_elements, layout.combine_row_elements, 1};
  return TensorView(slot_area(engine.facts.rank, slot), DType::kBF16, shape, strides);
}

BufferCore::SlotUse BufferCore::plan_slot(int max_tokens, int hidden, int num_experts, bool hook_pending) const {
  std::lock_guard lock(mutex_);
  const int slot = static_cast<int>(calls_ % 2);
  const Slot& s = slots_[slot];
  SlotUse use{slot, s.generation + 1, calls_ + 1, {}, max_tokens, hidden, num_experts, hook_pending};
  if (pool_dirty_)
    use.problem = "a normal-mode call used the scale-out pool since the last low-latency call: call "
                  "clean_low_latency_buffer first";
  else if (shape_ && ((*shape_)[0] != max_tokens || (*shape_)[1] != hidden || (*shape_)[2] != num_experts))
    use.problem = fmt::format("N, hidden or num_experts changed from ({}, {}, {}) to ({}, {}, {}): call "
                              "clean_low_latency_buffer({}, {}, {}) first",
                              (*shape_)[0], (*shape_)[1], (*shape_)[2], max_tokens, hidden, num_experts, max_tokens,
                              hidden, num_experts);
  else if (s.hook_pending)
    use.problem = fmt::format("slot {} still holds the result of low-latency call {}, whose receive hook has not run; at "
                              "most two low-latency results can be live", slot, s.owner);
  return use;
}

void BufferCore::take_slot(const SlotUse& use) {
  std::lock_guard lock(mutex_);
  Slot& s = slots_[use.slot];
  calls_ = use.number;
  s.generation = use.generation;
  s.hook_pending = use.hook_pending;
  s.owner = use.number;
  if (!shape_) {
    shape_ = std::array<int, 3>{use.max_tokens, use.hidden, use.num_experts};
    slot_stride_ = SlotLayout::pool_bytes(use.max_tokens, use.hidden, engine.facts.num_ranks, use.num_experts) / 2;
  }
}

int BufferCore::next_slot() const {
  std::lock_guard lock(mutex_);
  return static_cast<int>(calls_ % 2);
}

std::string BufferCore::next_slot_problem() const {
  std::lock_guard lock(mutex_);
  const Slot& s = slots_[calls_ % 2];
  if (s.hook_pending)
    return fmt::format("the next slot ({}) still holds the result of low-latency call {}, whose receive hook has not "
                       "run", calls_ % 2, s.owner);
  return {};
}

void BufferCore::hook_done(int slot, std::uint64_t generation) {
  std::lock_guard lock(mutex_);
  if (slots_[slot].generation == generation) slots_[slot].hook_pending = false;
}

std::string BufferCore::slot_problem(int slot, std::uint64_t generation, const char* what) const {
  std::lock_guard lock(mutex_);
  if (slots_[slot].generation != generation)
    return fmt::format("the {}'s slot {} was used again by low-latency call {} (or cleaned, or used by normal mode); "
                       "its data is gone", what, slot, slots_[slot].owner);
  return {};
}

void BufferCore::normal_call_used_pool() {
  std::lock_guard lock(mutex_);
  if (!config.low_latency_mode) return;
  pool_dirty_ = true;
  for (auto& s : slots_) {
    ++s.generation;
    s.hook_pending = false;
  }
}

void BufferCore::cleaned(int max_tokens, int hidden, int num_experts) {
  std::lock_guard lock(mutex_);
  pool_dirty_ = false;
  shape_ = std::array<int, 3>{max_tokens, hidden, num_experts};
  slot_stride_ = SlotLayout::pool_bytes(max_tokens, hidden, engine.facts.num_ranks, num_experts) / 2;
  calls_ = 0;
  for (auto& s : slots_) {
    ++s.generation;
    s.hook_pending = false;
  }
}

// ---- Entry points ------------------------------------------------------------------------------------

TensorView next_combine_buffer(BufferCore& core, const LowLatencyHandle& handle) {
  auto& e = core.engine;
  e.check_usable("get_next_low_latency_combine_buffer");
  e.drain();  // the slots as the low-latency calls queued so far left them
  const std::string ctx = e.facts.context("get_next_low_latency_combine_buffer");
  if (!handle.state || handle.state->engine_id != e.facts.id) core::fail(ctx, "handle was created by another buffer");
  const LowLatencyState& s = *handle.state;
  const std::string problem = core.next_slot_problem();
  if (!problem.empty()) throw StateError(fmt::format("{}: {}", ctx, problem));
  const std::string stale = core.slot_problem(s.slot, s.slot_generation, "handle");
  if (!stale.empty()) throw StateError(fmt::format("{}: {}", ctx, stale));
  const SlotLayout layout(s.max_tokens, s.hidden, e.facts.num_ranks, s.num_experts, s.num_topk, RowFormat{});
  return core.combine_buffer(core.next_slot(), layout, s.num_experts / e.facts.num_ranks,
                             static_cast<std::int64_t>(e.facts.num_ranks) * s.max_tokens, s.hidden);
}

void clean_low_latency_buffer(BufferCore& core, int max_tokens, int hidden, int num_experts, const std::string& rejection) {
  auto& e = core.engine;
  e.check_usable("clean_low_latency_buffer");
  e.run_sync(std::make_shared<CleanLowLatency>(core, max_tokens, hidden, num_experts, rejection, e.next_sequence()));
}

}  // namespace moe_ep::legacy
