// The dispatch/combine engine shared by both buffer generations: one rank's channel, symmetric
// memory, workers and collective operations.
//
// Data paths (docs/architecture.md):
//  - same physical node: one copy per (token, destination) from the sender's tensors into the
//    receiver's outputs, made by the receiver (ranks in processes: published addresses) or, with
//    ranks as threads, by the sender (push: each token read once for all its destinations);
//  - direct mode across nodes: the sender puts records into the receiver's region [sender][slot];
//  - hybrid mode (logical scale-out > 1): the sender puts one record per destination node to the
//    rank of that node with its own scale-up index (the forwarder); receivers of that node copy
//    from the forwarder's region. Combine reverses the paths; the forwarder reduces its node's
//    rows first when multiple reduction is allowed.
// Every operation starts with an Agreement (arguments, signature, counts), and ends with a node
// barrier: after it, no peer reads this rank's inputs or regions any more. Operations run inline
// (sync) or on the rank's communication worker (async), always in call order.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <array>
#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "comm/tolerant_gather.hh"
#include "comm/transport.hh"
#include "core/executor.hh"
#include "core/v2_contract.hh"
#include "engine/operation.hh"
#include "engine/sizing.hh"
#include "moe_ep/dispatch_types.hpp"
#include "moe_ep/error.hpp"
#include "routing/handle_plan.hh"
#include "routing/plan.hh"

namespace moe_ep::engine {

// Symmetric pools up to this size are faulted in at construction (docs/architecture.md).
inline constexpr std::int64_t kPrefaultLimit = std::int64_t{256} << 20;

// Facts every rank of a buffer shares (agreed at construction).
struct EngineConfig {
  std::string name;              // "ElasticBuffer", "Buffer": names the buffer in messages
  std::int64_t pool_bytes = 0;   // symmetric memory per rank, at construction
  // A dispatch or combine that needs more symmetric memory than the pool holds grows it after its
  // agreement (Engine::grow_pool) instead of raising CapacityError.
  bool grow_pool = false;
  std::int64_t pool_alignment = 1;  // sizes in capacity errors are rounded up to this
  int fixed_hidden = 0;          // 0: any hidden size per call
  bool allow_hybrid_mode = true;
  bool allow_multiple_reduction = true;
  bool prefer_overlap_with_compute = true;
  int num_allocated_qps = 0;
  double timeout_secs = 300;
  bool explicitly_destroy = false;
};

// What an engine is, fixed at construction and the same for every call: the configuration, this
// rank, the topology and the data paths they imply.
struct EngineFacts {
  EngineFacts(const Group& group, EngineConfig config);

  EngineConfig config;
  int rank = 0, num_ranks = 1;
  Topology physical;
  int logical_scaleout = 1, logical_scaleup = 1;
  Paths paths;
  std::uint64_t id = 0;

  std::string context(const std::string& operation) const;  // "[rank 2] dispatch"
  comm::Wait wait(const char* phase) const { return {phase, config.timeout_secs}; }
  int node_of(int r) const { return r / physical.num_scaleup; }
  bool same_node(int r) const { return node_of(r) == node_of(rank); }
  int routing_node_of(int r) const { return r / logical_scaleup; }
  void check_num_qps(const std::string& context, int num_qps) const;
};

// One rank's engine: its facts, and the services its operations use (the channel, symmetric
// memory, workers, signal counts). Operations run in call order (engine/operation.hh).
class Engine {
 public:
  // Collective. `fields` adds the generation's configuration to the construction agreement;
  // `config_error` is this rank's rejection of its configuration (reported through it).
  Engine(Group& group, EngineConfig config, std::exception_ptr config_error,
         const std::function<void(comm::Agreement&)>& fields);
  ~Engine();

  const EngineFacts facts;

  // Runs an operation (engine/operation.hh), then returns its result with the event.
  template <class Op>
  auto execute(const std::shared_ptr<Op>& op, bool async) {
    Event event = submit(op, async);
    auto result = op->result;
    result.event = event;
    return result;
  }
  // Runs an operation without a result, synchronously.
  void run_sync(const std::shared_ptr<Operation>& op) { submit(op, false); }
  void barrier() { simple_collective("barrier"); }
  // Collective (every rank, all present): the exchange of the operations that count on some ranks
  // only (Operation::counted_on, shrink mode), for agreement blocks of up to block_capacity bytes.
  // With it, destroy() and the destructor leave that exchange instead of running a collective: they
  // wait (at most the timeout) until every rank that is not gone left too, and keep the memory
  // mapped if one did not.
  void make_tolerant(std::size_t block_capacity);
  comm::TolerantGather* tolerant() { return tolerant_.get(); }
  void destroy();

  // Checks before a call: the engine is neither destroyed nor out of step.
  void check_usable(const char* operation) const;
  // Waits until every operation queued on the communication worker has run (what the calling
  // thread reads next is then what those operations left).
  void drain() { comm_worker_.drain(); }
  std::uint64_t next_sequence() { return ++sequence_; }

  // Services of the operations.
  comm::Transport& transport() { return *transport_; }
  comm::SymmetricMemory& memory() { return *memory_; }
  // The pool itself, for views that must keep it mapped after destroy(); null once destroyed.
  std::shared_ptr<comm::SymmetricMemory> memory_owner() const;
  // The pool's size: config.pool_bytes, or what grow_pool made it.
  std::int64_t pool_bytes() const { return pool_bytes_.load(std::memory_order_acquire); }
  // Collective, with the same `need` on every rank (after an operation's agreement): replaces the
  // pool by a new one of a(max(need, 2 x pool_bytes()), kBufferAlignment) bytes (engine_pool.cc).
  void grow_pool(std::int64_t need, const std::string& context);
  core::WorkerPool& pool() { return pool_; }
  // Counts one more signal expected from `source`; returns the cumulative target.
  std::uint64_t expect_signal(int source) { return ++signals_expected_[static_cast<size_t>(source)]; }
  void set_workers(int workers);  // logs changes of the count
  int ranks_on_host() const;  // ranks sharing this host's cores
  int cores_per_rank() const;
  // Scale-out transfers in flight per peer: num_qps, or num_allocated_qps when 0.
  void limit_inflight(int num_qps);
  void wait_for_event(const std::optional<Event>& event, const std::string& context, const char* argument) const;
  // After a failure that left the ranks out of step: marks the engine broken, abandons its channel
  // (comm/transport.hh), then rethrows.
  [[noreturn]] void leave(const std::exception_ptr& error);

 private:
  Event submit(const std::shared_ptr<Operation>& op, bool async);
  // The phases of an operation around its agreement, and what a failure of them means.
  void run_guarded(Operation& op, const std::function<void()>& outputs_ready);
  void run_phases(Operation& op, const std::function<void()>& outputs_ready);
  void mark_broken(const std::string& reason);
  std::string broken_reason() const;
  void simple_collective(const char* operation);
  // Shrink mode's end of the buffer (destroy and the destructor): leaves the TolerantGather;
  // returns whether the memory may be freed.
  bool leave_tolerant();

  std::unique_ptr<comm::Transport> transport_;
  std::unique_ptr<comm::TolerantGather> tolerant_;  // shrink mode (make_tolerant)
  std::shared_ptr<comm::SymmetricMemory> memory_;  // shared with views of it (memory_owner)
  std::atomic<std::int64_t> pool_bytes_{facts.config.pool_bytes};
  core::SerialWorker comm_worker_;
  core::WorkerPool pool_;
  int last_workers_ = 0;  // the count last logged; 0 = none yet
  std::vector<std::uint64_t> signals_expected_;
  std::uint64_t sequence_ = 0;
  mutable std::mutex state_mutex_;
  std::string broken_;
  bool destroyed_ = false;
};

// Worker threads from DeepEP's bandwidth model (docs/semantics.md §6).
int theoretical_num_workers(const Engine& engine, int num_experts, int num_topk, int num_scaleout_topk,
                            double rdma_gbs, double nvlink_gbs, double sm_read_gbs, double sm_write_gbs);

using routing::ForwardPlan;
using routing::RowSource;

// EPHandle's scalar fields as the dispatch produced them (core/v2_contract.hh). EPHandle's public
// fields are copies that callers can change; cached dispatch and combine check them against these.
struct HandleFacts : core::v2::HandleFields {
  int expert_stride = 0;  // DispatchRequest::expert_stride
};

// Routing state of a dispatch: everything cached dispatch and combine need. The rows, counts and
// forwarding plans are the routing plan (routing/handle_plan.hh); the rest identifies the call.
struct HandleState : routing::RoutingPlan {
  std::uint64_t engine_id = 0;
  std::uint64_t dispatch_sequence = 0;  // the creating dispatch's operation number (same on all ranks)
  HandleFacts facts;
  int max_tokens = 0;                   // T of the call
  Tensor topk;                          // [N, k] int64: this rank's top-k ids (as source)
};

// The state of a handle given to this engine: made by it (not another buffer), its public fields
// unchanged since its dispatch. Throws InvalidArgument naming the field otherwise.
const HandleState& checked_handle(const Engine& engine, const std::string& context, const EPHandle& handle);

// What each rank publishes in a dispatch or combine agreement.
struct PeerTensors {
  const std::byte* x = nullptr;
  std::int64_t x_row_bytes = 0;
  const std::byte* scales = nullptr;
  std::int64_t scale_stride[2] = {0, 0};  // elements
  const float* weights = nullptr;
  std::int64_t weights_row = 0;  // elements between rows (1-D expanded weights: 1)
  const float* row_weights = nullptr;  // combine: CombineRequest::row_weights
  const std::int64_t* topk = nullptr;
  std::int64_t topk_row = 0;
  const routing::ListedToken* listed = nullptr;  // dispatch: routing::list_by_destination of topk
  std::int32_t num_tokens = 0;
};

// Bytes from data() to one past the last element of a view (validated views have non-negative
// strides); 0 if empty.
std::size_t view_extent(const TensorView& view);

// Makes this rank's tensors readable by its node peers (Transport::share); returns what to
// publish. Extents are in bytes (view_extent).
struct TensorExtents {
  std::size_t x = 0, scales = 0, weights = 0, topk = 0, row_weights = 0, listed = 0;
};
PeerTensors share_tensors(Engine& engine, const PeerTensors& mine, const TensorExtents& extents);
// Turns what ranks of this node published into addresses here; this rank's entry becomes `mine`.
// Entries of other nodes are left as published (never dereferenced).
void resolve_tensors(Engine& engine, std::vector<PeerTensors>& peers, const PeerTensors& mine);

// A dispatch, as both generations ask for it. Argument names in messages are the fields' names.
// What a buffer generation asks of a dispatch beyond the semantics both share (the defaults are
// V2's ElasticBuffer without extras).
struct GenerationRules {
  // V2 (ElasticBuffer and its extras).
  // Expanded layout with a fixed expert stride: local expert i's rows start at row i x
  // expert_stride and are at most expert_stride (routing::GlobalLayout; more is InvalidArgument on
  // every rank); the output has El x expert_stride rows, rows past a count are padding. 0: expert
  // groups packed at expert_alignment.
  int expert_stride = 0;
  // FP8 scales column-major within blocks of B rows: row r, column p of recv_x_scales lives at
  // (r / B) * (B * S) + r % B + p * B of its storage. Off: B = 1 (row-major [rows, S]); on without
  // an expert stride: B = the rows padded to 4 (storage [S, padded], viewed [rows, S]); on with an
  // expert stride: B = expert_stride (storage [El, S, stride], viewed [El, stride, S], token stride 1).
  bool col_major_scales = false;
  // V1 (Buffer).
  std::int64_t worst_rows = 0;          // compact rows of worst-case outputs; 0: T * R
  bool zero_nonlocal_weights = false;   // received weights are 0 where the expert is not local
  std::vector<std::int32_t> expert_counts;  // announce these per-expert counts instead of counting ids
  // The hidden size the handle records (what combine and cached dispatch compare with) when x's
  // width is not it: packed rows (NVFP4 token triples) travel as bytes. 0: x's width.
  int handle_hidden = 0;
};

// A dispatch, as both generations ask for it. Argument names in messages are the fields' names.
struct DispatchRequest {
  std::string operation = "dispatch";
  std::string rejection;  // the caller refused the arguments (DispatchArgs::rejection)
  TensorView x, x_scales, topk_idx, topk_weights, cumulative_local_expert_recv_stats;
  std::shared_ptr<const EPHandle> handle;  // cached dispatch
  int num_experts = 0;
  int max_tokens = 0;  // T; 0: the largest token count of any rank in this call
  int expert_alignment = 0;  // 0: 1, or the handle's (cached dispatch)
  // Worker threads, given the validated (num_experts, num_topk).
  std::function<int(int, int)> workers = [](int, int) { return 1; };
  int num_qps = 0;
  std::optional<Event> previous_event, previous_event_before_epilogue;
  bool async = false;
  bool do_handle_copy = true;
  bool cpu_sync = true;
  bool expand = false, zero_padding = false;
  GenerationRules generation;
  // The generation's hooks, each run on the executing thread.
  // Its own argument rules, run first (they see unvalidated arguments).
  std::function<void(const std::string& context)> check_generation_arguments;
  // Fills the generation's own handle from the complete EPHandle (new dispatches only).
  std::function<void(const EPHandle& handle)> fill_generation_handle;
  // Every dispatch, cached too: allocates the outputs that received rows unpack into, once the
  // engine's outputs are allocated; unpacks this rank's received rows into them once they are all
  // in the engine's outputs, before the call completes (V1's NVFP4 token triples).
  std::function<void(const DispatchResult& result)> allocate_unpacked_outputs, unpack_received_rows;
};

struct CombineRequest {
  std::string operation = "combine";
  std::string rejection;  // the caller refused the arguments (CombineArgs::rejection)
  TensorView x;
  std::shared_ptr<const EPHandle> handle;
  TensorView topk_weights;
  // Expanded layout only: weights of the input rows, float32 [rows]. Input row r then counts as
  // bf16(row_weights[r] * float(x[r])) element-wise (FP32 product, one rounding), formed in scratch.
  TensorView row_weights;
  std::vector<TensorView> bias;
  std::function<int(int, int)> workers = [](int, int) { return 1; };  // as DispatchRequest::workers
  int num_qps = 0;
  std::optional<Event> previous_event, previous_event_before_epilogue;
  bool async = false;
  // combined_topk_weights: false = the weight each lane's rank returned for that lane (V2);
  // true = the sum, over the token's ranks in unit order, of their whole weight rows (V1).
  bool sum_weights_over_ranks = false;
  // Hybrid with multiple reduction: this node's rank units are summed into the result one by one
  // instead of as one BF16-rounded node unit (routing::ReductionScheme::own_node_rank_terms).
  bool own_node_rank_terms = false;
  // The generation's own argument rules, run first (they see unvalidated arguments).
  std::function<void(const std::string& context)> check_generation_arguments;
};

class DispatchOperation : public Operation {
 public:
  using Operation::Operation;
  DispatchResult result;
};
class CombineOperation : public Operation {
 public:
  using Operation::Operation;
  CombineResult result;
};
std::shared_ptr<DispatchOperation> make_dispatch(Engine& engine, DispatchRequest request, std::uint64_t sequence);
std::shared_ptr<CombineOperation> make_combine(Engine& engine, CombineRequest request, std::uint64_t sequence);

}  // namespace moe_ep::engine
