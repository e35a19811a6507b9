// Internals of the V1 Buffer: the engine, the low-latency slots and their bookkeeping.
//
// Low-latency slot rules (all kept on the executing thread, in call order, so every rank applies
// them identically): a low-latency call plans the next of the two slots before its agreement and
// takes it only once the agreement let it proceed, so a refused call (its own arguments, a peer's,
// or ranks that disagree) changes no slot state; a call that finds its slot still holding a result
// whose receive hook has not run is refused. A normal-mode call that uses the scale-out pool, or a
// low-latency call with another (N, hidden, experts) than the last one, requires
// clean_low_latency_buffer first; otherwise the next low-latency call is refused with an error
// that says so.
#pragma once

#include <array>
#include <atomic>
#include <exception>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.hh"
#include "moe_ep/legacy_buffer.hpp"

namespace moe_ep::legacy {

// Geometry of one low-latency slot in the scale-out pool (docs/legacy.md). Offsets of the areas
// depend only on (N, hidden, ranks, experts), so every call of a shape finds them in place:
//   [64 B header: number of the last low-latency call that published here]
//   [send area: N staged rows (payload | scales | token index | weight, 16-byte aligned) + N x k
//    int32 expert ids + N x k float32 weights; or, for combine, the zero-copy slab
//    [El, R*N, H + 2S] bfloat16]
//   [receive area, for ranks of other nodes: dispatch rows [El][R][N], or combine rows [E][N] of
//    H bfloat16 + 4 B per 128 channels (room for LogFMT's block metadata)]
struct RowFormat {
  bool fp8 = false;
  bool ue8m0 = false;    // FP8 scales as packed UE8M0 exponents
  bool nvfp4 = false;    // H/2 bytes of E2M1 pairs + H/16 block-scale bytes
  bool weights = false;  // the row carries the top-k weight of the expert it is sent to
};

struct SlotLayout {
  SlotLayout(int max_tokens, int hidden, int num_ranks, int num_experts, int k, RowFormat format);
  std::int64_t payload_bytes, scales_bytes, row_bytes;  // one staged token of this call
  std::int64_t token_offset, weight_offset;             // in a row: int32 token index, float32 weight
  std::int64_t ids_offset;                              // of the id table in the send area
  std::int64_t weights_offset;                          // of the weight table in the send area
  std::int64_t combine_row_elements;                    // H + 2S
  std::int64_t combine_recv_row_bytes;                  // 2H + 4 B per 128 channels
  std::int64_t recv_offset;                             // of the receive area, from the slot start
  std::int64_t slot_bytes;                              // 64-byte aligned
  static constexpr std::int64_t kHeaderBytes = 64;
  // Bytes both slots need for (N, H, R, E).
  static std::int64_t pool_bytes(int max_tokens, int hidden, int num_ranks, int num_experts);
};

struct LowLatencyState {
  std::uint64_t engine_id = 0;
  std::uint64_t dispatch_number = 0;  // per-buffer count of low-latency calls (identifies the slot use)
  int slot = 0;
  std::uint64_t slot_generation = 0;
  int max_tokens = 0, hidden = 0, num_experts = 0, num_topk = 0, num_tokens = 0;
  Tensor topk;                       // [num_tokens, k] int64, a copy
  std::vector<std::int32_t> rows;    // [num_tokens * k]: row of (token, lane) in its expert's slab, or -1
  std::vector<std::int32_t> counts;  // [R * E]: tokens of each source selecting each expert
  // The receive layout, as the dispatch computed it. The handle's packed_recv_* tensors are the
  // caller's (they can be written); combine reads these copies instead.
  std::vector<std::int64_t> layout_range;  // [El * R]
  std::vector<std::int32_t> src_info;      // [El * R*N]; empty until the dispatch received
};

class BufferCore {
 public:
  BufferCore(Group& group, const BufferConfig& config);

  // Slot bookkeeping. plan_slot returns the slot the next low-latency call would take and the
  // reason to refuse it (empty when fine), and changes nothing; take_slot takes it (after the
  // call's agreement), with the (N, hidden, experts) it was planned for.
  struct SlotUse {
    int slot = 0;
    std::uint64_t generation = 0;
    std::uint64_t number = 0;  // low-latency call number
    std::string problem;
    int max_tokens = 0, hidden = 0, num_experts = 0;
    bool hook_pending = false;
  };
  SlotUse plan_slot(int max_tokens, int hidden, int num_experts, bool hook_pending) const;
  void take_slot(const SlotUse& use);
  int next_slot() const;
  void hook_done(int slot, std::uint64_t generation);
  // Problem with calling a hook / using a handle of (slot, generation): empty when fine.
  std::string slot_problem(int slot, std::uint64_t generation, const char* what) const;
  void normal_call_used_pool();
  void cleaned(int max_tokens, int hidden, int num_experts);

  // Start of `slot` in `rank`'s pool (a rank of this node), and its offset in any rank's pool.
  std::byte* slot_base(int rank, int slot);
  // Where the slot's send area starts, after its header (ids_offset and weights_offset count from
  // here; recv_offset from slot_base).
  std::byte* slot_area(int rank, int slot) { return slot_base(rank, slot) + SlotLayout::kHeaderBytes; }
  std::int64_t slot_offset(int slot) const;
  // This rank's zero-copy combine buffer in `slot`: bfloat16 [El, slab_rows = R*N, H], rows
  // combine_row_elements apart (what get_next_low_latency_combine_buffer returns and a zero_copy
  // combine reads).
  TensorView combine_buffer(int slot, const SlotLayout& layout, std::int64_t local_experts, std::int64_t slab_rows,
                            std::int64_t hidden);
  // The problem with writing into the next slot now (a result still pending there), or empty.
  std::string next_slot_problem() const;

  // This rank's whole scale-out pool as uint8 storage that keeps it mapped (views of it outlive
  // destroy()).
  Tensor pool_storage();
  // The scale-up buffer of get_local_buffer_tensor: num_nvl_bytes, zero-filled, made on first use
  // (null when num_nvl_bytes is 0).
  std::shared_ptr<void> nvl_buffer();

  const BufferConfig config;
  engine::Engine engine;
  // Shrink mode: this rank's mask, one flag per rank (1: masked). Written by the mask calls and
  // by low-latency dispatches (the ranks that masked this one); all zero without enable_shrink.
  std::unique_ptr<std::atomic<std::int32_t>[]> masked;
  // Shrink mode: the ranks found failed (gone, silent past the timeout, or in another call; every
  // one is masked too). Low-latency calls no longer count on them; unmasking a rank (the mask
  // calls) counts on it again.
  std::unique_ptr<std::atomic<std::int32_t>[]> failed;
  // The ranks a low-latency call counts on in shrink mode (1 each: the ranks not failed); empty
  // without shrink mode (every rank takes part in every call).
  std::vector<char> counted_on() const;
  // Masks `rank` as failed; `why` goes to the log.
  void mark_failed(int rank, const std::string& why);
  // Shrink mode: marks the ranks a failed wait names (`error`: its PeerError or TimeoutError) as
  // failed; without shrink mode, leaves the buffer's channel. Then rethrows.
  [[noreturn]] void fail_wait(const std::exception_ptr& error);
  // Cleared when the buffer goes away: receive hooks outliving it check it first.
  std::shared_ptr<std::atomic<bool>> alive = std::make_shared<std::atomic<bool>>(true);
  // Serialises the calls of the Buffer and of its receive hooks (docs/semantics.md, "Concurrent
  // calls"); shared with the hooks, which may outlive the buffer.
  const std::shared_ptr<std::recursive_mutex> calls = std::make_shared<std::recursive_mutex>();
  ~BufferCore() { *alive = false; }

 private:
  struct Slot {
    std::uint64_t generation = 0;
    bool hook_pending = false;
    std::uint64_t owner = 0;  // low-latency call number that holds it
  };
  mutable std::mutex mutex_;
  Slot slots_[2];
  std::uint64_t calls_ = 0;
  bool pool_dirty_ = false;
  std::optional<std::array<int, 3>> shape_;  // (N, hidden, experts) since the last clean
  std::atomic<std::int64_t> slot_stride_{0};  // bytes per slot for shape_
  std::shared_ptr<void> nvl_buffer_;
};

// Worker threads of a normal-mode call: num_sms / 2 channels, capped by the cores per rank
// (legacy_buffer.cc).
std::function<int(int, int)> normal_mode_workers(const engine::Engine& e, const Config& config);

// DeepEP's rule of the normal-mode calls: allocate_on_comm_stream = true needs previous_event and
// async_finish = true (InvalidArgument otherwise).
void check_comm_stream_flags(const std::string& ctx, bool allocate_on_comm_stream, bool has_previous_event,
                             bool async_finish);

// Low-latency operations (low_latency_dispatch.cc, low_latency_combine.cc; the slots and the
// clean in low_latency.cc).
LowLatencyDispatchResult low_latency_dispatch(BufferCore& core, const LowLatencyDispatchArgs& args);
LowLatencyCombineResult low_latency_combine(BufferCore& core, const LowLatencyCombineArgs& args);
void clean_low_latency_buffer(BufferCore& core, int max_tokens, int hidden, int num_experts, const std::string& rejection);
TensorView next_combine_buffer(BufferCore& core, const LowLatencyHandle& handle);

}  // namespace moe_ep::legacy
