// The types both buffer generations and the engine share: EPHandle (the routing state of one
// dispatch, reused by cached dispatch and by combine), DispatchArgs / DispatchResult and
// CombineArgs / CombineResult (the arguments and results of V2 dispatch and combine, whose
// result types V1 returns too).
//
// Plain structs without behaviour: layouts, names and namespace are part of the provider ABI
// (moe_ep/provider.hpp), so any change to them bumps provider::kAbiVersion. Tensors in them live
// where the provider that made them works: host memory for the built-in provider, the device for
// the CUDA provider (docs/cuda.md); views are read only for the duration of a call. ElasticBuffer
// (moe_ep/elastic_buffer.hpp) and Buffer (moe_ep/legacy_buffer.hpp) include this header, so
// their users get these types as before.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/event.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {

namespace engine {
struct HandleState;
}  // namespace engine

// Routing state of one non-cached dispatch, reusable for cached dispatch and needed by combine.
// Fields follow DeepEP's EPHandle; tensors live where the provider works (host or device).
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
  std::shared_ptr<const engine::HandleState> state;  // internal (built-in provider)
  std::shared_ptr<const void> provider_state;        // internal (other providers' routing state)
};

struct DispatchArgs {
  TensorView x;             // [N, H] of a payload dtype (docs/semantics.md), or float8_e4m3fn with x_scales
  TensorView x_scales;      // float32 or int32 [N, P], any strides; FP8 only
  TensorView topk_idx;      // int64 [N, k], -1 = no selection; not with a handle
  TensorView topk_weights;  // optional float32 [N, k]
  TensorView cumulative_local_expert_recv_stats;  // optional int32 [local experts]; not with a handle
  // With a handle (cached dispatch), the shape is the handle's: these may be left at their
  // defaults (0; do_expand false) or must equal it.
  int num_experts = 0;                            // required unless handle
  int num_max_tokens_per_rank = 0;                // 0: the buffer's (the handle's, cached)
  int expert_alignment = 0;                       // 0: 1 (the handle's, cached)
  int num_sms = 0;  // worker threads; 0: get_theoretical_num_sms
  int num_qps = 0;  // in-flight scale-out transfers per peer; 0: get_theoretical_num_qps
  std::optional<Event> previous_event;
  std::optional<Event> previous_event_before_epilogue;
  bool async_with_compute_stream = false;
  bool allocate_on_comm_stream = false;  // accepted; async outputs are always allocated by the worker
  std::shared_ptr<const EPHandle> handle;  // cached dispatch
  bool do_handle_copy = true;
  std::optional<bool> do_cpu_sync;  // default: true, false with a handle
  bool do_expand = false;  // cached: the handle's (true with a compact handle is an error)
  bool do_zero_padding = false;
  bool use_tma_aligned_col_major_sf = false;  // recv scales column-major, strides (1, align(M, 4))
  // Device providers: the caller's stream (a cudaStream_t; 0 = the legacy default stream), which
  // the call orders its work after and its outputs before (docs/cuda.md). Ignored on the host.
  std::uintptr_t stream = 0;
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
  std::uintptr_t stream = 0;  // as DispatchArgs::stream
  std::string rejection;  // as DispatchArgs::rejection
};

struct CombineResult {
  Tensor combined_x;             // bfloat16 [N, H]
  Tensor combined_topk_weights;  // float32 [N, k]; undefined without topk_weights
  Event event;
};

}  // namespace moe_ep
