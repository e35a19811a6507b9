// The dispatch operation (private to the engine): its validation (dispatch_validate.cc), its
// sequence of steps around the agreement (dispatch.cc) and its copies into the outputs
// (dispatch_rows.cc). The routing plan itself is computed by routing/handle_plan.hh, the records
// of other nodes move through a DispatchRecordExchange (dispatch_record_exchange.hh); this class
// moves the data.
//
// Guarantees: the phases of engine/operation.hh (a rejection in validate() or prepare() is reported
// through the agreement); run() executes the steps in a fixed order on every rank, so that the
// puts, signals and barriers of all ranks match.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "core/v2_contract.hh"
#include "engine/call_shape.hh"
#include "engine/dispatch_record_exchange.hh"
#include "engine/engine.hh"
#include "engine/receive_window.hh"
#include "routing/handle_plan.hh"

namespace moe_ep::engine::dispatch_detail {

inline constexpr std::int64_t kRowsPerTask = 32;
// The most bytes of worst-case outputs a CPU-synced dispatch allocates before its agreement
// (Dispatch::capacity_outputs_): address space, of which only the received rows are touched.
inline constexpr std::int64_t kCapacityOutputBytes = std::int64_t{1} << 30;

// What a pushing rank adds to its agreement payload: its outputs' window when they exist before
// the agreement, and whether its caller's previous_event_before_epilogue holds back writes into
// them (then the node's ranks publish their windows once every one has passed its event).
struct PushPublication {
  PublishedWindow window{};
  std::uint8_t has_window = 0, holds_writes = 0;
  std::uint8_t unused[6] = {};
};

class Dispatch final : public DispatchOperation {
 public:
  Dispatch(Engine& engine, DispatchRequest request, std::uint64_t sequence);

  bool outputs_known_early() const override { return cached_ || !cpu_sync_; }
  void allocate_outputs_early() override { allocate_outputs(worst_rows(), worst_expanded_rows()); }

 private:
  // The phases (engine/operation.hh).
  void validate() override;  // the checks, then the new handle's known parts
  std::vector<std::byte> prepare() override;
  void describe(comm::Agreement& agreement) const override;
  void run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>& outputs_ready) override;

  // Validation (dispatch_validate.cc).
  void check_arguments();
  void take_sizes();
  void check_payload();
  void check_routing();
  void check_options();
  std::int64_t check_capacity(int tokens_bound) const;
  void check_gathered(const std::vector<PeerTensors>& peers);
  std::int64_t worst_rows() const;
  std::int64_t worst_expanded_rows() const;
  std::int64_t worst_output_bytes() const;

  // Steps of the phases (dispatch.cc).
  void start_handle();
  void prepare_routing();
  std::vector<std::byte> publish();
  std::vector<PeerTensors> unpack_peers(const std::vector<std::span<const std::byte>>& payloads);
  void take_layout(const std::vector<std::span<const std::byte>>& payloads, const std::vector<PeerTensors>& peers);
  void plan_local(const std::vector<PeerTensors>& peers);
  void make_outputs();
  void move_rows(const std::vector<PeerTensors>& peers);
  void finish();
  void allocate_outputs(std::int64_t rows, std::int64_t expanded_rows);
  void narrow_outputs(std::int64_t rows);
  void allocate_outputs_unnamed(std::int64_t rows, std::int64_t expanded_rows);
  PeerTensors my_tensors() const;
  void fill_handle();
  routing::PlanningRank planning_rank() const;

  // The plans read from the records of other nodes (dispatch.cc).
  void plan_forwarding(const DispatchRecordExchange& records);
  void plan_receive_remote(const DispatchRecordExchange& records);

  // Copies into the outputs (dispatch_rows.cc). open_window sets this rank's receive window (its
  // outputs and its plan); then either this rank writes every row it receives into it (pull), or
  // (push_) every source of this node writes its rows into the outputs its node peers published
  // (push_rows), at the rows its own plan derives, and this rank writes only the rows of other
  // nodes.
  WindowOutputs own_outputs() const;
  void open_own_window();
  // With push, outputs allocated before the agreement (a cached dispatch, worst-case shapes, or
  // capacity_outputs_) travel with it (PushPublication). When every rank of the node published
  // its window there and none holds writes back for an event, the push needs no collective of its
  // own; otherwise a node all-gather publishes the windows once every rank of the node has
  // allocated its outputs and passed its previous_event_before_epilogue.
  bool window_in_agreement() const { return push_ && (cached_ || !cpu_sync_ || capacity_outputs_); }
  std::size_t agreed_window_bytes() const { return push_ ? sizeof(PushPublication) : 0; }
  std::vector<WindowOutputs> node_windows();
  void push_rows(const std::vector<PeerTensors>& peers);
  void copy_rows(const std::vector<PeerTensors>& peers, const DispatchRecordExchange& records, bool remote_only);
  RowInput row_input(const PeerTensors& source, std::int64_t token) const;
  void zero_padding();
  void add_expert_stats();

  Engine& engine_;
  DispatchRequest req_;
  std::uint64_t sequence_;
  std::string ctx_;

  bool fp8_ = false, cached_ = false, cpu_sync_ = true, expand_ = false, has_weights_ = false;
  int stride_ = 0;  // DispatchRequest::expert_stride (the handle's, cached)
  CallShape shape_;
  int workers_ = 1;
  int handle_hidden_ = 0;  // the handle's hidden: shape_.hidden, or the request's handle_hidden
  DType x_dtype_ = DType::kBF16, scale_dtype_ = DType::kFP32;
  std::int64_t row_bytes_ = 0;
  std::int64_t pool_need_ = 0;  // bytes of pool this call needs (check_capacity)
  routing::Geometry geo_;
  const HandleState* cached_state_ = nullptr;
  core::v2::CachedCall cached_call_;  // a cached dispatch's arguments, checked against its handle
  std::shared_ptr<HandleState> state_;  // the new handle's state (non-cached)
  const HandleState* plan_ = nullptr;   // state_ or cached_state_
  PeerTensors mine_;                    // this rank's tensors (before sharing)
  routing::LocalCounts counts_;
  Tensor listed_;  // new dispatch: int32 [rows this rank sends, 2], routing::list_by_destination
  ScaleLayout scale_layout_;  // set with the outputs
  WindowShape window_shape_;  // set by open_own_window
  ReceiveWindow window_;      // this rank's outputs and receive plan (open_own_window)
  // The windows the node's ranks published in the agreement (window_in_agreement), by local
  // index, and whether they are all there and no rank holds writes back (agreed_windows_ready_).
  std::vector<PublishedWindow> agreed_windows_;
  bool agreed_windows_ready_ = false;
  // MOE_EP_DISPATCH_PUSH over a transport that offers windows (every transport: threads and
  // processes): sources write their rows into their node peers' windows (each token read once,
  // not once per destination).
  // The same on every rank (agreed).
  bool push_ = false;
  // A pushing new dispatch with exact (CPU-synced) compact outputs: they are allocated before
  // the agreement with room for the worst case (num_max_tokens_per_rank x ranks rows), so that
  // their window travels with it, and narrowed to the received rows after it (narrow_outputs).
  bool capacity_outputs_ = false;
};

}  // namespace moe_ep::engine::dispatch_detail
