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

#include "core/v2_contract.hh"
#include "comm/agreement.hh"
#include "engine/call_shape.hh"
#include "engine/dispatch_record_exchange.hh"
#include "engine/engine.hh"
#include "routing/handle_plan.hh"

namespace moe_ep::engine::dispatch_detail {

inline constexpr std::int64_t kRowsPerTask = 32;

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
  void allocate_outputs_unnamed(std::int64_t rows, std::int64_t expanded_rows);
  PeerTensors my_tensors() const;
  void fill_handle();
  routing::PlanningRank planning_rank() const;

  // The plans read from the records of other nodes (dispatch.cc).
  void plan_forwarding(const DispatchRecordExchange& records);
  void plan_receive_remote(const DispatchRecordExchange& records);

  // Copies into the outputs (dispatch_rows.cc). prepare_copies sets the outputs and what copy_row
  // reads; then either this rank copies every row it receives (pull), or (push_) every source of
  // this node writes its rows here (push_rows, run by the source) and this rank copies only the
  // rows of other nodes.
  void prepare_copies(const std::vector<PeerTensors>& peers, const DispatchRecordExchange& records);
  void push_rows(const std::vector<PeerTensors>& peers);
  void copy_rows(bool remote_only);
  void copy_row(const std::vector<PeerTensors>& peers, const DispatchRecordExchange& records, std::int64_t row,
                std::int32_t* metadata);
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
  // Where row r, column p of the output scales lives (DispatchRequest::col_major_scales): blocks
  // of `block` rows, column-major within a block; block 1 is row-major.
  struct ScaleLayout {
    std::int64_t block = 1, columns = 0;
    std::int64_t at(std::int64_t r, std::int64_t p) const {
      return (r / block) * (block * columns) + r % block + p * block;
    }
  };
  ScaleLayout scale_layout_;  // set with the outputs
  // copy_row's output pointers and inputs, set by prepare_copies (a node peer pushing rows here
  // uses them too).
  struct Outputs {
    std::byte* x = nullptr;
    std::uint32_t* scales = nullptr;
    std::int64_t* ids = nullptr;
    float* weights = nullptr;
    std::int32_t* metadata = nullptr;  // null for a cached dispatch
  } out_;
  const std::vector<PeerTensors>* copy_peers_ = nullptr;
  const DispatchRecordExchange* copy_records_ = nullptr;
  // Ranks as threads and MOE_EP_DISPATCH_PUSH: sources write their rows into their node peers'
  // outputs (each token read once, not once per destination). The same on every rank (agreed).
  bool push_ = false;
};

}  // namespace moe_ep::engine::dispatch_detail
