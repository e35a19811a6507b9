// ElasticBuffer: expert-parallel dispatch and combine with the semantics of DeepEP V2.
//
// One buffer per group, sized from the MoE shape (or given a byte count). dispatch() sends every
// token once to each rank that owns one of its top-k experts and returns the received tokens in
// a fixed order: by source rank, then source token index (DeepEP's deterministic order, always).
// combine() sums, for every token, the rows the destination ranks return, in FP32 with a fixed
// order and BF16 rounding (docs/semantics.md), so results are reproducible bit for bit on any
// topology, transport and thread count. Every call is collective (all ranks of the group call
// the same operations in the same order) except engram_fetch, pp_send and pp_recv, which involve
// only this rank and the peers they name (Engram storage and PP send/receive: docs/engram-pp.md).
// Arguments are validated on every rank before anything moves; a rank with bad arguments raises
// InvalidArgument and its peers raise PeerError naming it. Inputs are only read; outputs are new
// tensors (the all-gather sessions' results are views of their session region instead: agrs.hpp,
// docs/agrs.md). With async_with_compute_stream the call returns at once with an Event; inputs must
// stay unchanged and outputs must not be read until the event completes.
// Threads: the calls of one buffer are serialised, like kernels on one CUDA stream. Every method
// that can change or use the buffer's state holds the buffer's call lock for its whole duration
// (an asynchronous call: its validation and queueing, so the communication worker runs calls in
// the order the threads got the lock); the getters of facts fixed at construction (rank(),
// num_ranks(), the domain sizes, num_bytes(), ...) take no lock. Any thread may call at any time;
// ranks pair their calls in the order each rank's threads got its buffer, so every rank must still
// make the same sequence of collective calls (docs/semantics.md, "Concurrent calls").
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe_ep/agrs.hpp"
#include "moe_ep/dispatch_types.hpp"
#include "moe_ep/event.hpp"
#include "moe_ep/group.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep {

namespace engine {
class Engine;
}  // namespace engine

struct ElasticBufferConfig {
  std::int64_t num_bytes = 0;  // 0: derived from the MoE shape below (get_buffer_size_hint)
  // Engram storage per rank (docs/engram-pp.md): with num_cpu_bytes > 0, num_bytes is required
  // and is the total, of which num_bytes - num_cpu_bytes is the dispatch pool. 2 MiB multiples.
  std::int64_t num_cpu_bytes = 0;
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

namespace elastic {
class EngramStore;
class PpChannels;
}  // namespace elastic

// Options of dispatch and combine that DeepEP's API (DispatchArgs, CombineArgs) has no argument
// for: the token dispatcher's one-copy low-latency path (docs/dispatcher.md) and HybridEPBuffer's
// combine (docs/hybrid-ep.md). The defaults are the plain calls: dispatch(args) is
// dispatch(args, DispatchExtras{}), combine(args) is combine(args, CombineExtras{}).
struct DispatchExtras {
  // With do_expand: local expert i's rows start at row i x expert_stride and are at most
  // expert_stride (more is InvalidArgument on every rank); recv_x has El x expert_stride rows, rows
  // past an expert's count are padding. With use_tma_aligned_col_major_sf the scales are
  // column-major per expert block: storage [El, S, expert_stride] viewed [El, expert_stride, S].
  // 0: expert groups packed at expert_alignment.
  int expert_stride = 0;
};

struct CombineExtras {
  // Expanded layout only: float32 [expanded rows]; row r of x counts as
  // bf16(row_weights[r] * float(x[r])) element-wise (FP32 product, one rounding).
  TensorView row_weights;
  // combined_topk_weights: false = the weight each lane's rank returned for that lane; true = the
  // sum, over the token's ranks in unit order, of their whole weight rows (compact layout).
  bool sum_weights_over_ranks = false;
  // Hybrid mode with multiple reduction: this node's rank units are terms of the final sum, one by
  // one, instead of one BF16-rounded node unit.
  bool own_node_rank_terms = false;
};

// What engram_fetch returns (docs/engram-pp.md): data [T, K*hidden] (float8_e4m3fn when the write
// had scales, else bfloat16); sf [T, K*P] in the scales' dtype, strides (K*P, 1) or, column-major,
// (1, T rounded up to 4); undefined without scales. New tensors, not views of the buffer.
struct EngramFetchResult {
  Tensor data;
  Tensor sf;
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
  // The same calls with the options above (the arguments are translated and checked as above).
  DispatchResult dispatch(const DispatchArgs& args, const DispatchExtras& extras);
  CombineResult combine(const CombineArgs& args, const CombineExtras& extras);

  // Worker threads per rank from DeepEP's bandwidth model, fed with this machine's measured
  // bandwidths (0 arguments = measured); capped by the cores available to each rank.
  int get_theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk = 0, double rdma_gbs = 0,
                              double nvlink_gbs = 0, double sm_read_gbs = 0, double sm_write_gbs = 0) const;
  int get_theoretical_num_qps(int num_sms) const;

  // `rejection` (here and in the other collective calls below that take one): as
  // DispatchArgs::rejection. Non-empty: the caller refused this rank's arguments before the call;
  // the call takes part in the collective only to report it (this rank raises InvalidArgument with
  // this message, every other rank a PeerError naming this rank).

  // Collective barrier over every rank, ordered after this rank's queued async work. Every flag
  // combination is the same full host-blocking barrier (docs/engram-pp.md).
  void barrier(bool use_comm_stream = true, bool with_cpu_sync = false, bool sequential = true,
               const std::string& rejection = {});

  // Engram storage and pipeline-parallel send/receive (docs/engram-pp.md). Collective:
  // engram_write, pp_set_config. engram_write keeps `sf` by reference: a Tensor with storage keeps
  // it alive, one wrapping caller memory must stay valid; fetches read its current contents.
  static std::pair<std::int64_t, std::int64_t> get_engram_storage_size_hint(std::int64_t num_entries,
                                                                            std::int64_t hidden,
                                                                            std::int64_t num_max_tokens_per_rank,
                                                                            DType dtype = DType::kBF16);
  void engram_write(const TensorView& storage, const Tensor& sf = {}, const std::string& rejection = {});
  EngramFetchResult engram_fetch(const TensorView& indices, int num_qps = 0, bool use_tma_aligned_col_major_sf = false);
  static std::int64_t get_pp_buffer_size_hint(std::int64_t num_max_tensor_bytes, std::int64_t num_max_inflight_tensors);
  void pp_set_config(std::int64_t num_max_tensor_bytes, std::int64_t num_max_inflight_tensors,
                     const std::string& rejection = {});
  void pp_send(const TensorView& t, int dst_rank_idx, int num_sms = 0);
  void pp_recv(const TensorView& t, int src_rank_idx, int num_sms = 0);

  std::pair<int, int> get_physical_domain_size() const;  // (scale-out, scale-up)
  std::pair<int, int> get_logical_domain_size() const;
  // Collective: frees the buffer (required when explicitly_destroy). Later calls raise StateError.
  void destroy();

  // All-gather sessions (docs/agrs.md). Session bytes: the sum over shapes of
  // a(R * numel * itemsize, 32); the hint: those bytes rounded up to 2 MiB.
  static std::int64_t get_agrs_num_max_session_bytes(const Group& group, std::span<const AgrsShape> shapes,
                                                     DType dtype);
  static std::int64_t get_agrs_buffer_size_hint(const Group& group, std::int64_t num_max_session_bytes);
  // Collective: allocates the session region (a(bytes, 32) bytes per rank, beside num_bytes).
  void agrs_set_config(std::int64_t num_max_session_bytes, int num_max_all_gathers_per_session,
                       const std::string& rejection = {});
  void create_agrs_session();   // this rank only
  void destroy_agrs_session();  // collective: ends the session on every rank
  // Views of this rank's session region where the next all_gather calls put this rank's inputs.
  std::vector<Tensor> agrs_get_inplace_tensor(std::span<const AgrsShape> shapes, DType dtype);
  // Collective: every rank's inputs, gathered in this rank's session region.
  AllGatherResult all_gather(std::span<const TensorView> tensors, const std::string& rejection = {});

  int rank() const;
  int num_ranks() const;
  std::int64_t num_bytes() const;  // the pool plus num_cpu_bytes
  std::int64_t num_cpu_bytes() const;
  int num_max_tokens_per_rank() const;
  int num_allocated_qps() const;
  int num_scaleout_ranks() const;
  int num_scaleup_ranks() const;
  int scaleout_rank_idx() const;
  int scaleup_rank_idx() const;
  bool is_hybrid() const;  // the two-hop (scale-out then scale-up) data path is in use

 private:
  // Frees (or, when peers may still read them, keeps) the Engram and PP memory.
  void release_extras() noexcept;
  // The all-gather session state, made on first use (the caller holds calls_).
  elastic::AgrsState& agrs_state();
  // Ends the session and releases its region (agrs_sessions.cc): collectively when `collective`,
  // else alone (destroy and destruction, before the engine's).
  void release_agrs(bool collective, const char* operation);
  // Serialises the calls of this buffer (held by every method that uses its state); first, so it
  // goes last.
  std::recursive_mutex calls_;
  ElasticBufferConfig config_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<elastic::EngramStore> engram_;  // always; memory only with num_cpu_bytes > 0
  std::unique_ptr<elastic::PpChannels> pp_;       // always; channels once pp_set_config ran
  // Made by the first AGRS call; declared after engine_, so released before it.
  std::shared_ptr<elastic::AgrsState> agrs_;
};

}  // namespace moe_ep
