// Internals of ElasticBuffer: one rank's channel, symmetric memory, workers and routing state.
//
// Data paths (docs/architecture.md):
//  - same physical node: the receiver copies straight from the sender's tensors (published
//    addresses) into its outputs: one copy per (token, destination);
//  - direct mode across nodes: the sender puts records into the receiver's region [sender][slot];
//  - hybrid mode (logical scale-out > 1): the sender puts one record per destination node to the
//    rank of that node with its own scale-up index (the forwarder); receivers of that node copy
//    from the forwarder's region. Combine reverses the paths; the forwarder reduces its node's
//    rows first when multiple reduction is allowed.
// Every operation starts with an Agreement (arguments, signature, counts), and ends with a node
// barrier: after it, no peer reads this rank's inputs or regions any more.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/transport.hh"
#include "core/executor.hh"
#include "elastic/sizing.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "routing/plan.hh"

namespace moe_ep::elastic {

struct RowSource {
  std::int32_t source;  // source rank
  std::int32_t index;   // token index (same node) or record slot (remote)
};

// Tokens of one source that a forwarder holds for its node.
struct ForwardPlan {
  int source = -1;
  std::int32_t count = 0;
  std::vector<std::int32_t> token;     // [count]
  std::vector<std::int64_t> ids;       // [count * k] global expert ids
  std::vector<std::int32_t> rows;      // [count * k] row at the lane's rank if master lane, else -1
  std::vector<std::int32_t> expanded;  // [count * k] expanded row of the lane, or -1
};

struct HandleState {
  std::uint64_t buffer_id = 0;
  std::uint64_t dispatch_sequence = 0;  // the creating dispatch's operation number (same on all ranks)
  routing::GlobalLayout layout;
  // As destination.
  std::vector<RowSource> rows;              // [real rows]
  std::vector<std::int32_t> row_token;      // [real rows] token index at the source
  std::vector<std::int32_t> master_lane;    // [real rows]
  std::vector<std::int32_t> local_ids;      // [real rows * k]
  std::vector<std::int32_t> expanded_rows;  // [real rows * k], expand only
  // As source.
  Tensor topk;                              // [N, k] int64
  std::vector<std::int32_t> dst_row;        // [N * k]
  std::vector<std::int32_t> dst_expanded;   // [N * k]
  std::vector<std::int32_t> node_slot;      // [N * k] hybrid: forwarder slot at node master lanes
  // As forwarder (hybrid): one plan per source node (index = node; own node unused).
  std::vector<ForwardPlan> forward;
};

// What each rank publishes in a dispatch or combine agreement.
struct PeerTensors {
  const std::byte* x = nullptr;
  std::int64_t x_row_bytes = 0;
  const std::byte* scales = nullptr;
  std::int64_t scale_stride[2] = {0, 0};  // elements
  const float* weights = nullptr;
  std::int64_t weights_row = 0;  // elements between rows (1-D expanded weights: 1)
  const std::int64_t* topk = nullptr;
  std::int64_t topk_row = 0;
  std::int32_t num_tokens = 0;
};

// One collective call. validate() and allocate_outputs_early() run on the calling thread;
// run() runs inline (sync) or on the communication worker (async) and must perform the
// agreement even when the arguments were rejected, so that peers never wait in vain.
class Operation {
 public:
  virtual ~Operation() = default;
  // Shapes of the outputs are known without the count exchange (cached, or no CPU sync).
  virtual bool outputs_known_early() const = 0;
  virtual void allocate_outputs_early() = 0;
  // Calls outputs_ready() once the outputs exist (at most once; not on failure).
  virtual void run(const std::function<void()>& outputs_ready) = 0;

  std::exception_ptr local_error;  // this rank's arguments were rejected
  std::optional<Event> previous_event;
  // A failure leaves the ranks out of step (and the buffer unusable) unless it came from the
  // agreement's checks, which fail on every rank alike.
  bool in_step_failure = false;
};

class BufferCore {
 public:
  BufferCore(Group& group, const ElasticBufferConfig& config);
  ~BufferCore();

  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);
  void barrier();
  void destroy();
  int theoretical_num_sms(int num_experts, int num_topk, int num_scaleout_topk, double rdma_gbs, double nvlink_gbs,
                          double sm_read_gbs, double sm_write_gbs) const;

  // Fixed facts.
  ElasticBufferConfig config;
  int rank = 0, num_ranks = 1;
  Topology physical;  // nodes x ranks per node
  int logical_scaleout = 1, logical_scaleup = 1;
  Paths paths;
  std::uint64_t id = 0;
  std::int64_t num_bytes = 0;
  int num_allocated_qps = 0;

  // Shared by the operations (dispatch.cc, combine.cc).
  std::string context(const char* operation) const;
  comm::Wait wait(const char* phase) const { return {phase, config.num_cpu_timeout_secs}; }
  comm::Transport& transport() { return *transport_; }
  comm::SymmetricMemory& memory() { return *memory_; }
  core::WorkerPool& pool() { return pool_; }
  int node_of(int r) const { return r / physical.num_scaleup; }
  bool same_node(int r) const { return node_of(r) == node_of(rank); }
  int routing_node_of(int r) const { return r / logical_scaleup; }
  // Counts one more signal expected from `source`; returns the cumulative target.
  std::uint64_t expect_signal(int source) { return ++signals_expected_[static_cast<size_t>(source)]; }
  int resolve_workers(int num_sms, int num_experts, int num_topk);
  void check_num_qps(const std::string& context, int num_qps) const;
  // Waits for a caller's event (previous_event, previous_event_before_epilogue) up to the timeout.
  void wait_for_event(const std::optional<Event>& event, const std::string& context, const char* argument) const;

 private:
  void check_usable(const char* operation) const;
  void simple_collective(const char* operation);
  void mark_broken(const std::string& reason);
  // Runs the operation inline (sync) or on the communication worker (async).
  Event submit(const std::shared_ptr<Operation>& op, bool async);
  // submit, then the operation's result with its event.
  template <class Op>
  auto execute(const std::shared_ptr<Op>& op, bool async);
  void run_guarded(Operation& op, const std::function<void()>& outputs_ready);
  std::string broken_reason() const;
  std::uint64_t next_sequence() { return ++sequence_; }

  std::unique_ptr<comm::Transport> transport_;
  std::unique_ptr<comm::SymmetricMemory> memory_;
  core::SerialWorker comm_worker_;
  core::WorkerPool pool_;
  std::vector<std::uint64_t> signals_expected_;
  std::uint64_t sequence_ = 0;
  mutable std::mutex state_mutex_;
  std::string broken_;
  bool destroyed_ = false;

  friend class DispatchOp;
  friend class CombineOp;
};

// The two operations (dispatch.cc, combine.cc). `result` is complete once the outputs exist;
// with async calls its tensors hold data only after the event completes.
class DispatchOperation : public Operation {
 public:
  DispatchResult result;
};
class CombineOperation : public Operation {
 public:
  CombineResult result;
};
std::shared_ptr<DispatchOperation> make_dispatch(BufferCore& core, const DispatchArgs& args, std::uint64_t sequence);
std::shared_ptr<CombineOperation> make_combine(BufferCore& core, const CombineArgs& args, std::uint64_t sequence);

}  // namespace moe_ep::elastic
