// Buffer: expert-parallel dispatch and combine with the semantics of DeepEP V1 ("legacy").
//
// Two families of calls on one buffer:
//  - normal mode: get_dispatch_layout (routing counts), dispatch (one row per (token, rank), in
//    source-rank then token order) and combine (unweighted sum plus biases); cached dispatch
//    with the returned handle; num_worst_tokens for fixed-size outputs;
//  - low-latency mode (low_latency_mode = true): low_latency_dispatch into a per-expert 3-D slab
//    [local experts, ranks x N, H], optionally FP8-cast with per-128 scales or NVFP4-cast with
//    per-16 scales in the swizzled block-scale layout (docs/quantized-formats.md), with an
//    optional receive hook and the received top-k weights; low_latency_combine (weighted sum over
//    the token's top-k, optionally LogFMT-compressed on the wire). Two buffer slots alternate: at
//    most two low-latency results are live, and using a live slot again is an error.
// Normal mode runs on the same engine as ElasticBuffer (docs/legacy.md lists the differences):
// any 1-, 2- or 4-byte payload dtype travels bit for bit, as do NVFP4 token triples (one node
// only); combine reduces bfloat16.
// Every call is collective; bad arguments are typed errors on the rank that made them and
// PeerErrors naming that rank on the others.
// Threads: the calls of one buffer are serialised, like kernels on one CUDA stream. Every method
// that uses the buffer's state, and every call of one of its receive hooks (from any thread), holds
// the buffer's call lock for its whole duration (an asynchronous call: its validation and
// queueing); rank(), num_ranks(), get_physical_domain_size() and config() read facts fixed at
// construction and take no lock. Ranks pair their calls in the order each rank's threads got its
// buffer, so every rank must still make the same sequence of collective calls (docs/semantics.md,
// "Concurrent calls").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/dtype.hpp"
#include "moe_ep/dispatch_types.hpp"
#include "moe_ep/event.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {

namespace legacy {
class BufferCore;
struct LowLatencyState;
}  // namespace legacy

// Worker and chunk configuration of normal-mode calls. num_sms maps to worker threads per
// rank: num_sms / 2 channels, capped by the cores available to each rank. The chunk sizes feed
// the size hints (the data path itself needs no rings).
struct Config {
  int num_sms = 20;
  int num_max_nvl_chunked_send_tokens = 6;
  int num_max_nvl_chunked_recv_tokens = 256;
  int num_max_rdma_chunked_send_tokens = 6;
  int num_max_rdma_chunked_recv_tokens = 256;

  // Validated config (InvalidArgument naming the field); the RDMA receive size is rounded up to a
  // multiple of the RDMA send size, as DeepEP does.
  static Config make(int num_sms, int nvl_send, int nvl_recv, int rdma_send, int rdma_recv);
  void validate(const std::string& context) const;
  // DeepEP's formulas (docs/legacy.md). The RDMA hint is 0 for up to 8 ranks, which DeepEP runs in
  // one node; where moe-ep's topology makes several nodes of them, the Buffer provides the pool
  // normal mode needs itself.
  std::int64_t get_nvl_buffer_size_hint(std::int64_t hidden_bytes, int num_ranks) const;
  std::int64_t get_rdma_buffer_size_hint(std::int64_t hidden_bytes, int num_ranks) const;
};

struct BufferConfig {
  std::int64_t num_nvl_bytes = 0;   // scale-up pool (multiple of 128)
  // Scale-out and low-latency pool (multiple of 128). Across nodes on up to 8 ranks a normal-mode
  // call that needs more grows it (docs/legacy.md §1); elsewhere it is a CapacityError.
  std::int64_t num_rdma_bytes = 0;
  bool low_latency_mode = false;
  int num_qps_per_rank = 24;
  bool allow_nvlink_for_low_latency_mode = true;  // accepted
  bool allow_mnnvl = false;                       // accepted
  bool explicitly_destroy = false;
  // Shrink mode (docs/legacy.md §4): each rank keeps a mask of peers its low-latency calls skip.
  bool enable_shrink = false;
  double num_cpu_timeout_secs = 100;
};

struct DispatchLayout {
  Tensor num_tokens_per_rank;       // int32 [R]: tokens with >= 1 expert on the rank
  Tensor num_tokens_per_rdma_rank;  // int32 [nodes]; undefined on one node
  Tensor num_tokens_per_expert;     // int32 [E]: (token, lane) pairs naming the expert
  Tensor is_token_in_rank;          // bool [N, R]
  Event event;
};

// Routing state of a normal dispatch (DeepEP's handle tuple, as named fields).
struct LegacyHandle {
  int num_channels = 0;
  Tensor rank_prefix_matrix;          // int32 [R, R]: [s][r] = tokens sources 0..s sent to rank r
  Tensor channel_prefix_matrix;       // int32 [R, C]: this rank's tokens to d in channels 0..c
  Tensor recv_channel_prefix_matrix;  // int32 [R, C]: offset in source s's block where channel c starts
  Tensor recv_src_idx;                // int32 [M]: token index at the source
  Tensor is_token_in_rank;            // bool [N, R]
  Tensor send_head;                   // int32 [N, R]: position among this rank's tokens to r, or -1
  Tensor recv_rdma_rank_prefix_sum;   // int32 [nodes]: tokens this rank forwarded per source node (inclusive)
  Tensor recv_gbl_rank_prefix_sum;    // int32 [R]: tokens received per source rank (inclusive)
  std::shared_ptr<const EPHandle> routing;  // internal
};

// NVFP4 tokens of normal dispatch (DeepEP hybrid-ep's x = (packed, sf, sf_scale)): per token
// H/2 bytes of E2M1 codes, H/16 E4M3 block scales and S float32 per-token scales. Never
// interpreted: each token's three rows travel together, as one row of 4*(H/8 + H/64 + S) bytes.
struct Nvfp4Tokens {
  TensorView packed;    // int32 [N, H/8]: H/8 = packed columns, a multiple of 8 (H a multiple of 64)
  TensorView sf;        // int32 [N, H/64]
  TensorView sf_scale;  // float32 [N, S], S >= 1
};
struct Nvfp4Rows {  // received: the same three tensors, [M, ...] each, contiguous
  Tensor packed, sf, sf_scale;
};

struct LegacyDispatchArgs {
  // bfloat16 [N, H] or any other 1-, 2- or 4-byte payload dtype with rows of a multiple of 16
  // bytes, or float8_e4m3fn [N, H] with x_scales (docs/semantics.md, "Payload dtypes").
  TensorView x;
  TensorView x_scales;  // float32 or int32 [N, S], any strides
  // Instead of x: NVFP4 tokens (x and x_scales then stay empty). All ranks on one node only.
  std::optional<Nvfp4Tokens> x_nvfp4;
  std::shared_ptr<const LegacyHandle> handle;  // cached dispatch
  TensorView num_tokens_per_rank;       // int32 [R]      } from get_dispatch_layout;
  TensorView num_tokens_per_rdma_rank;  // int32 [nodes]  } required without a handle
  TensorView is_token_in_rank;          // bool [N, R]    } (per-rdma-rank only across nodes)
  TensorView num_tokens_per_expert;     // int32 [E]      }
  TensorView topk_idx;                  // int64 [N, k]; optional (routing then comes from is_token_in_rank)
  TensorView topk_weights;              // float32 [N, k]; only with topk_idx
  int expert_alignment = 1;
  int num_worst_tokens = 0;  // > 0: outputs with this many rows, no wait for counts
  std::optional<Config> config;
  std::optional<Event> previous_event;
  bool async_finish = false;
  bool allocate_on_comm_stream = false;  // accepted
  std::string rejection;  // as DispatchArgs::rejection
};

struct LegacyDispatchResult {
  Tensor recv_x;  // x's dtype; undefined with x_nvfp4
  Tensor recv_x_scales;
  std::optional<Nvfp4Rows> recv_x_nvfp4;  // with x_nvfp4: the rows in recv_x's order
  Tensor recv_topk_idx;      // int64 [M, k]: local ids, -1 elsewhere; undefined without topk_idx
  Tensor recv_topk_weights;  // float32 [M, k]: 0 where recv_topk_idx is -1
  std::vector<int> num_recv_tokens_per_expert_list;  // aligned; empty with num_worst_tokens or a handle
  std::shared_ptr<LegacyHandle> handle;              // null for cached dispatch
  Event event;
};

struct LegacyCombineArgs {
  TensorView x;  // bfloat16 [M, H]
  std::shared_ptr<const LegacyHandle> handle;
  TensorView topk_weights;       // float32 [M, k]
  std::vector<TensorView> bias;  // 0-2 bfloat16 [N, H]
  std::optional<Config> config;
  std::optional<Event> previous_event;
  bool async_finish = false;
  bool allocate_on_comm_stream = false;
  std::string rejection;  // as DispatchArgs::rejection
};

// A receive hook: call it exactly once, before its slot is used again, from any thread (it takes its
// buffer's call lock; after the buffer is gone it raises StateError).
class ReceiveHook {
 public:
  ReceiveHook() = default;
  explicit ReceiveHook(std::function<void()> receive) : receive_(std::make_shared<std::function<void()>>(std::move(receive))) {}
  explicit operator bool() const { return receive_ != nullptr; }
  void operator()() const;

 private:
  std::shared_ptr<std::function<void()>> receive_;
};

struct LowLatencyHandle {
  Tensor packed_recv_src_info;      // int32 [El, R*N]: token index at the source (-1 past the count)
  Tensor packed_recv_layout_range;  // int64 [El, R]: (begin << 32) | count per source rank
  int num_max_dispatch_tokens_per_rank = 0;
  int hidden = 0;
  int num_experts = 0;
  std::shared_ptr<const legacy::LowLatencyState> state;  // internal
};

struct LowLatencyDispatchArgs {
  TensorView x;         // bfloat16 [N_tokens, H], N_tokens <= num_max_dispatch_tokens_per_rank
  TensorView topk_idx;  // int64 [N_tokens, k]
  int num_max_dispatch_tokens_per_rank = 0;
  int num_experts = 0;
  TensorView topk_weights;  // optional float32 [N_tokens, k]: received as recv_topk_weights
  TensorView cumulative_local_expert_recv_stats;  // optional int32 [El]
  TensorView dispatch_wait_recv_cost_stats;       // optional int64 [R]: nanoseconds waited per source
  TensorView x_global_scale;  // float32 scalar (0-d): the NVFP4 global scale; required with
                              // use_nvfp4 unless use_ue8m0_for_sf
  bool use_fp8 = true;
  bool round_scale = false;
  bool use_ue8m0 = false;  // requires round_scale
  bool use_nvfp4 = false;  // not with use_fp8; H a multiple of 128
  bool use_ue8m0_for_sf = false;  // NVFP4 block scales as UE8M0 (power of two, rounded up)
  // E2M1 rounding of NVFP4 values; unset: MOE_EP_NVFP4_ROUNDING (nearest_even or sm90).
  std::optional<E2M1Rounding> nvfp4_rounding;
  bool async_finish = false;
  bool return_recv_hook = false;  // not with async_finish
  std::string rejection;          // as DispatchArgs::rejection
};

struct LowLatencyDispatchResult {
  // bfloat16 or float8_e4m3fn [El, R*N, H]; with NVFP4 the view [R*N, H/2, El] (uint8, two E2M1
  // values per byte) of storage [El, R*N, H/2].
  Tensor recv_x;
  // FP8: float32 [El, R*N, H/128] or int32 UE8M0 [El, R*N, H/512]; token stride 1.
  // NVFP4: the view [32, 4, rm, 4, rk, El] of storage [El, rm, rk, 32, 4, 4] (rm = ceil(R*N/128),
  // rk = H/64), float8_e4m3fn codes, or int32 holding UE8M0 bytes in the first quarter of each
  // expert's storage (the rest zero).
  Tensor recv_x_scales;
  Tensor packed_recv_count;  // int32 [El]
  Tensor recv_topk_weights;  // float32 [El, R*N]: the row's weight for this expert (0 past the count); with topk_weights
  Tensor recv_rank_info;     // int32 [El, R*N]: the row's source rank (-1 past the count); with topk_weights
  std::shared_ptr<LowLatencyHandle> handle;
  Event event;
  ReceiveHook hook;  // with return_recv_hook: completes the receive
};

struct LowLatencyCombineArgs {
  TensorView x;             // bfloat16 [El, R*N, H] (the dispatch slab layout)
  TensorView topk_idx;      // int64 [N_tokens, k]: as dispatched
  TensorView topk_weights;  // float32 [N_tokens, k]
  std::shared_ptr<const LowLatencyHandle> handle;
  bool use_logfmt = false;  // LogFMT-10 on the wire (docs/quantized-formats.md); not with zero_copy
  bool zero_copy = false;   // the rows are already in get_next_low_latency_combine_buffer(handle); x gives the shape
  bool async_finish = false;
  bool return_recv_hook = false;
  TensorView out;                              // optional bfloat16 [N_tokens, H] to write into
  TensorView combine_wait_recv_cost_stats;     // optional int64 [R]
  // The signalled combine of the hybrid-ep branch (docs/legacy.md §4): with src_signals, the
  // rows of local expert e are handed to the ranks that read them only once src_signals[e], read
  // as an unsigned 32-bit word, is at least src_signal_expect_value (a producer of x, another
  // thread, raises it); overlap = true requires src_signals. The signals are only read.
  bool overlap = false;
  TensorView src_signals;                      // optional int32 [El] (torch's uint32 viewed as int32)
  std::int64_t src_signal_expect_value = 0;    // in [0, 2^32 - 1]
  std::string rejection;                       // as DispatchArgs::rejection
};

struct LowLatencyCombineResult {
  Tensor combined_x;  // bfloat16 [N_tokens, H] (the `out` tensor's storage when given)
  Event event;
  ReceiveHook hook;
};

class Buffer {
 public:
  Buffer(Group& group, const BufferConfig& config);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Process-wide number of SMs (workers x 2) for default configs; must be even, 2..1024.
  static void set_num_sms(int num_sms);
  static int num_sms();
  // Default configs per rank count (DeepEP's table; other counts use the next larger entry).
  static Config get_dispatch_config(int num_ranks);
  static Config get_combine_config(int num_ranks);
  // DeepEP's formula for the low-latency pool (ours needs at most this much), or our own need
  // where that is larger (only with very few experts).
  static std::int64_t get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks,
                                                     int num_experts);

  DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts,
                                     std::optional<Event> previous_event = std::nullopt, bool async_finish = false,
                                     bool allocate_on_comm_stream = false);
  LegacyDispatchResult dispatch(const LegacyDispatchArgs& args);
  CombineResult combine(const LegacyCombineArgs& args);

  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args);
  // A BF16 view [El, R*N, H] (row stride H + 2*H/128) into the slot the next low-latency call
  // uses; write expert outputs there and pass it to low_latency_combine with zero_copy. The tensor
  // keeps the pool mapped, after destroy() too.
  Tensor get_next_low_latency_combine_buffer(const LowLatencyHandle& handle);
  // Collective: resets both slots for (N, hidden, experts). Required after normal-mode use of the
  // scale-out pool, or before low-latency calls with another N, hidden or expert count.
  // `rejection`: as DispatchArgs::rejection (the caller refused the arguments; the call still takes
  // part, so that every rank refuses it).
  void clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts,
                                const std::string& rejection = {});
  // A raw view of this rank's own buffer, a 1-D `dtype` tensor of its bytes from `offset` on:
  // with use_rdma_buffer the scale-out pool (num_rdma_bytes, where the low-latency slots live:
  // writing there races with low-latency calls; a view taken before the pool grew shows the pool
  // it replaced), else the scale-up buffer (num_nvl_bytes of host memory, zero-filled when first
  // asked for and used by nothing else). The tensor keeps the memory alive, after destroy() too. InvalidArgument for an offset outside [0, bytes] or not a
  // multiple of the element size; StateError after destroy().
  Tensor get_local_buffer_tensor(DType dtype, std::int64_t offset = 0, bool use_rdma_buffer = false);
  // Shrink mode (requires enable_shrink, else StateError): this rank's mask of peers. A
  // low-latency dispatch exchanges every rank's mask; a token of rank s and an expert of rank d
  // are kept apart when either masks the other (s sends nothing to d, d counts 0 rows from s,
  // s's combine leaves out d's experts), and each rank then masks the ranks that masked it too.
  // These calls are local; rank_to_mask outside [0, R) is InvalidArgument.
  void low_latency_update_mask_buffer(int rank_to_mask, bool mask);
  void low_latency_query_mask_buffer(const TensorView& mask_status);  // int32 [R], 1 where masked
  void low_latency_clean_mask_buffer();                               // unmasks every rank

  void barrier();
  void destroy();  // requires explicitly_destroy
  int rank() const;
  int num_ranks() const;
  std::pair<int, int> get_physical_domain_size() const;  // (nodes, ranks per node)
  const BufferConfig& config() const;

 private:
  std::unique_ptr<legacy::BufferCore> core_;
};

}  // namespace moe_ep
