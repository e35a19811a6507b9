// ElasticBuffer: expert-parallel dispatch and combine with the semantics of DeepEP V2.
//
// One buffer per group, sized from the MoE shape (or given a byte count). dispatch() sends every
// token once to each rank that owns one of its top-k experts and returns the received tokens in
// a fixed order: by source rank, then source token index (DeepEP's deterministic order, always).
// combine() sums, for every token, the rows the destination ranks return, in FP32 with a fixed
// order and BF16 rounding (docs/semantics.md), so results are reproducible bit for bit on any
// topology, transport and thread count. Every call is collective: all ranks of the group call
// the same operations in the same order. Arguments are validated on every rank before anything
// moves; a rank with bad arguments raises InvalidArgument and its peers raise PeerError naming
// it. Inputs are only read; outputs are new tensors. With async_with_compute_stream the call
// returns at once with an Event; inputs must stay unchanged and outputs must not be read until
// the event completes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moe_ep/event.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {

namespace engine {
struct HandleState;
class Engine;
}  // namespace engine

struct ElasticBufferConfig {
  std::int64_t num_bytes = 0;  // 0: derived from the MoE shape below (get_buffer_size_hint)
  int num_max_tokens_per_rank = 0;
  int hidden = 0;
  int num_topk = 0;  // 0: size for the largest top-k (32)
  bool use_fp8_dispatch = false;
  bool deterministic = false;  // accepted for compatibility: the order is always deterministic
  bool allow_hybrid_mode = true;
  bool allow_multiple_reduction = true;
  bool prefer_overlap_with_compute = true;
  int num_allocated_qps = 0;  // 0: auto
  double num_cpu_timeout_secs = 300;
  bool explicitly_destroy = false;
};

// Routing state of one non-cached dispatch, reusable for cached dispatch and needed by combine.
// Fields follow DeepEP's EPHandle; tensors are host tensors.
struct EPHandle {
  bool do_expand = false;
  int num_experts = 0;
  int expert_alignment = 1;
  int num_max_tokens_per_rank = 0;
  int num_sms = 0;  // worker threads the dispatch used
  int num_tokens = 0;
  int num_topk = 0;
  int hidden = 0;
  Tensor topk_idx;  // int64 [N, k]: a copy, or the caller's tensor when do_handle_copy = false
  std::int64_t num_recv_tokens = 0;      // rows of the compact layout (T*R without CPU sync)
  std::int64_t num_expanded_tokens = 0;  // rows of the expanded layout (worst case without CPU sync)
  std::vector<int> num_recv_tokens_per_expert_list;  // aligned counts; empty without CPU sync
  Tensor psum_num_recv_tokens_per_scaleup_rank;      // int32 [scale-up ranks], inclusive
  Tensor psum_num_recv_tokens_per_expert;            // int32 [local experts] (docs/semantics.md)
  Tensor num_unaligned_recv_tokens_per_expert;       // int32 [local experts]
  Tensor recv_src_metadata;                          // int32 [rows, k + 2]
  Tensor dst_buffer_slot_idx;                        // int32 [N, k]
  std::shared_ptr<const engine::HandleState> state;  // internal
};

struct DispatchArgs {
  TensorView x;             // [N, H] of a payload dtype (docs/semantics.md), or float8_e4m3fn with x_scales
  TensorView x_scales;      // float32 or int32 [N, P], any strides; FP8 only
  TensorView topk_idx;      // int64 [N, k], -1 = no selection; not with a handle
  TensorView topk_weights;  // optional float32 [N, k]
  TensorView cumulative_local_expert_recv_stats;  // optional int32 [local experts]; not with a handle
  int num_experts = 0;                            // required unless handle
  int num_max_tokens_per_rank = 0;                // 0: the buffer's
  int expert_alignment = 1;
  int num_sms = 0;  // worker threads; 0: get_theoretical_num_sms
  int num_qps = 0;  // in-flight scale-out transfers per peer; 0: get_theoretical_num_qps
  std::optional<Event> previous_event;
  std::optional<Event> previous_event_before_epilogue;
  bool async_with_compute_stream = false;
  bool allocate_on_comm_stream = false;  // accepted; async outputs are always allocated by the worker
  std::shared_ptr<const EPHandle> handle;  // cached dispatch
  bool do_handle_copy = true;
  std::optional<bool> do_cpu_sync;  // default: true, false with a handle
  bool do_expand = false;
  bool do_zero_padding = false;
  bool use_tma_aligned_col_major_sf = false;  // recv scales column-major, strides (1, align(M, 4))
  // Non-empty: the caller refused this rank's arguments before the call (a binding that could not
  // convert one). The call then takes part in the collective only to report it: this rank raises
  // InvalidArgument with this message, every other rank a PeerError naming this rank.
  std::string rejection;
};

struct DispatchResult {
  Tensor recv_x;               // [M, H] (expanded: [M_exp, H]), dtype of x
  Tensor recv_x_scales;        // [M, P] (FP8 only)
  Tensor recv_topk_idx;        // int64 [M, k] local expert ids or -1 (undefined when expanded)
  Tensor recv_topk_weights;    // float32 [M, k] (expanded: [M_exp]); undefined without weights
  std::shared_ptr<EPHandle> handle;
  Event event;
};

struct CombineArgs {
  TensorView x;  // bfloat16 [rows of the handle's layout, H]
  std::shared_ptr<const EPHandle> handle;
  TensorView topk_weights;  // optional float32 [M, k] (expanded handle: [M_exp])
  std::vector<TensorView> bias;  // 0-2 bfloat16 [N, H]
  int num_sms = 0;
  int num_qps = 0;
  std::optional<Event> previous_event;
  std::optional<Event> previous_event_before_epilogue;
  bool async_with_compute_stream = false;
  bool allocate_on_comm_stream = false;
  std::string rejection;  // as DispatchArgs::rejection
};

struct CombineResult {
  Tensor combined_x;             // bfloat16 [N, H]
  Tensor combined_topk_weights;  // float32 [N, k]; undefined without topk_weights
  Event event;
};

class ElasticBuffer {
 public:
  ElasticBuffer(Group& group, const ElasticBufferConfig& config);
  ~ElasticBuffer();
  ElasticBuffer(const ElasticBuffer&) = delete;
  ElasticBuffer& operator=(const ElasticBuffer&) = delete;

  // Bytes of symmetric memory the buffer needs for this shape, 2 MiB aligned (docs/sizing.md).
  static std::int64_t get_buffer_size_hint(const Group& group, int num_max_tokens_per_rank, int hidden,
                                           int num_topk = 0, bool use_fp8_dispatch = false,
                                           bool allow_hybrid_mode = true, bool allow_multiple_reduction = true);

  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);

  // Worker threads per rank from DeepEP's bandwidth model, fed with this machine's measured
  // bandwidths (0 arguments = measured); capped by the cores available to each rank.
  int get_theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk = 0, double rdma_gbs = 0,
                              double nvlink_gbs = 0, double sm_read_gbs = 0, double sm_write_gbs = 0) const;
  int get_theoretical_num_qps(int num_sms) const;

  // Collective barrier on the buffer's channel, ordered after this rank's queued async work.
  void barrier();
  std::pair<int, int> get_physical_domain_size() const;  // (scale-out, scale-up)
  std::pair<int, int> get_logical_domain_size() const;
  // Collective: frees the buffer (required when explicitly_destroy). Later calls raise StateError.
  void destroy();

  int rank() const;
  int num_ranks() const;
  std::int64_t num_bytes() const;
  int num_max_tokens_per_rank() const;
  int num_allocated_qps() const;
  int num_scaleout_ranks() const;
  int num_scaleup_ranks() const;
  int scaleout_rank_idx() const;
  int scaleup_rank_idx() const;
  bool is_hybrid() const;  // the two-hop (scale-out then scale-up) data path is in use

 private:
  ElasticBufferConfig config_;
  std::unique_ptr<engine::Engine> engine_;
};

}  // namespace moe_ep
