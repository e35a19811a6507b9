// ElasticDevice<Exec>: the V2 ElasticBuffer of the CUDA provider, written once over an executor.
//
// The executor (Exec) runs index-parallel steps in order on the rank's communication stream and
// owns the rank's memory: CudaExec (exec_cuda.cuh) launches them as kernels on a GPU; HostExec
// (tests/cuda) runs the same steps on host threads, each step's indices on several threads in a
// seeded random order, so the whole algorithm, races and step order included, is checked against
// the built-in provider on machines without a GPU. Every step is a lambda over an index
// that captures only values and device pointers.
//
// Guarantees (docs/cuda.md): the results are bit-identical to the built-in provider's on the same
// inputs (receive order by source rank then token; FP32 sums in the documented unit order, one
// BF16 rounding per level). Receivers pull rows straight from the sources' tensors (ranks as
// threads of one process: the tensors themselves; processes: a staging copy in the source's
// symmetric memory, reached through CUDA IPC), so each (token, destination) row is copied once
// across ranks. Shapes are validated on the host and agreed by every rank before anything moves;
// what only the device can see (bad expert ids) is reported through an error word read at the next
// host synchronization, and every device wait is bounded by num_cpu_timeout_secs, naming the rank.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "comm/transport.hh"
#include "comm/wait.hh"
#include "core/arith.hh"
#include "core/checks.hh"
#include "core/v2_contract.hh"
#include "elastic/v2_config.hh"
#include "core/timeout.hh"
#include "cuda/device_common.hh"
#include "cuda/elastic_steps.hh"
#include "cuda/executor.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::cuda {

// What one rank publishes in a call's agreement: its tensors (addresses in its own address space,
// or offsets into its staging area when ranks are processes).
struct Published {
  std::uint64_t x, scales, weights, topk, lanes;
  std::int64_t x_row, scale_stride0, scale_stride1, weights_row, topk_row;
  std::int32_t num_tokens;
  std::int32_t pad;
};

// Offsets of one rank's symmetric region (the same on every rank).
struct SymLayout {
  std::int64_t signals = 0;  // uint64 [kMaxCudaRanks]: signals[p] = barriers rank p has passed
  std::int64_t status = 0;   // uint64 [2]: [0] this rank's top-k error of the current dispatch, [1] its error word
  std::int64_t counts = 0;   // int32 [R]: this rank's tokens bound for each rank
  std::int64_t lists = 0;    // int32 [R * T]: group d at d * T, the tokens bound for d, ascending
  std::int64_t stage = 0;    // staging of the tensors peers read (ranks as processes)
  std::int64_t end = 0;
};


inline SymLayout sym_layout(int R, int T) {
  SymLayout l;
  l.signals = 0;
  l.status = core::round_up<std::int64_t>(8 * kMaxCudaRanks, 256);
  l.counts = l.status + 256;
  l.lists = l.counts + core::round_up<std::int64_t>(4 * std::int64_t{R}, 256);
  l.stage = l.lists + core::round_up<std::int64_t>(4 * std::int64_t{R} * T, 256);
  l.end = l.stage;
  return l;
}

// The routing state of one dispatch on the device, kept alive by its EPHandle.
// Its core::v2::HandleFields are the handle's fields as the dispatch produced them (worst-case
// row counts without CPU sync).
struct DeviceHandleState : core::v2::HandleFields {
  std::uint64_t buffer_id = 0;
  std::uint64_t dispatch_number = 0;
  std::shared_ptr<void> memory;                               // every array of `arrays`, one block
  RoutingArrays arrays{};
};

// One dispatch call as the host sees it: what validation settled and what the steps share.
struct DispatchCall {
  DeviceGeometry g;
  bool cached = false, fp8 = false, has_weights = false, cpu_sync = true;
  DType x_dtype = DType::kUInt8, scale_dtype = DType::kFP32;
  std::shared_ptr<const DeviceHandleState> cached_state;
  std::shared_ptr<DeviceHandleState> state;  // new dispatches
  const DeviceHandleState* plan = nullptr;    // the routing the rows follow
  std::int64_t off_topk = 0, off_weights = 0, off_x = 0, off_scales = 0, stage_end = 0;  // staging offsets
};

template <Executor Exec>
class ElasticDevice final : public provider::ElasticBackend {
 public:
  ElasticDevice(Group& group, const ElasticBufferConfig& config, int device);
  ~ElasticDevice() override;
  DispatchResult dispatch(const DispatchArgs& args) override;
  CombineResult combine(const CombineArgs& args) override;
  std::int64_t num_bytes() const override { return bytes_; }
  void destroy() override;
  // A host barrier of the group (not ordered after queued device work).
  void barrier() override { group_.barrier(config_.num_cpu_timeout_secs); }
  // The direct path only (one node, no hybrid forwarding); launches sized by the provider (0).
  std::pair<int, int> get_logical_domain_size() const override { return {1, R_}; }
  int num_allocated_qps() const override { return config_.num_allocated_qps; }
  int get_theoretical_num_sms(int, int, int, double, double, double, double) const override { return 0; }
  int get_theoretical_num_qps(int) const override { return 0; }

  // For tests and benches: the executor (device, streams).
  Exec& exec() { return *exec_; }

 private:
  // Signals every peer and waits for every peer's signal, on the stream (barrier `step` of the call).
  void barrier(int step);
  // The error the device recorded in earlier work of this rank (once), if any: read from the
  // executor's host copy of the error word, without waiting for the device.
  std::exception_ptr take_device_error(const char* op);
  std::string context(const char* op) const { return fmt::format("[rank {}] {}", rank_, op); }
  std::int64_t default_bytes() const;  // num_bytes = 0: counts and lists, and staging for processes
  void map_peers();                    // allocates the region and reaches every peer's
  // Dispatch, in steps (elastic_dispatch.hh).
  void check_dispatch(const DispatchArgs& a, DispatchCall& c, const std::string& ctx);
  void check_handle(const DispatchArgs& a, DispatchCall& c, const std::string& ctx, int hidden);
  void new_routing_state(DispatchCall& c);
  Published publish_dispatch(const DispatchArgs& a, const DispatchCall& c) const;
  void stage_dispatch(const DispatchArgs& a, const DispatchCall& c);
  std::shared_ptr<EPHandle> plan_receive(const DispatchArgs& a, DispatchCall& c, const DevicePeerTensors& pt);
  void make_outputs(const DispatchArgs& a, DispatchCall& c, EPHandle* handle, DispatchResult& result);
  DispatchResult move_rows(const DispatchArgs& a, DispatchCall& c, const DevicePeerTensors& pt);
  // Combine (elastic_combine.hh).
  CombineResult reduce_rows(const CombineArgs& a, const DeviceHandleState& handle, const DeviceGeometry& g, std::int64_t rows,
                            std::int64_t off_w, std::int64_t off_x, const DevicePeerTensors& pt);
  // Runs the part of a call after its agreement. A failure every rank shares (bad ids found on
  // the device: InvalidArgument, PeerError) leaves the buffer usable; any other leaves the ranks
  // out of step (peers time out at the next barrier, naming this rank): the buffer becomes unusable.
  template <class F>
  auto after_agreement(const char* op, F f) -> decltype(f());
  // Marks the buffer unusable and releases the peers' waits, naming `culprit` as the root cause;
  // returns once no peer can still read this rank's tensors (wait_for_readers).
  void leave(const std::string& reason, int culprit) noexcept;
  void wait_for_readers() noexcept;
  // Combine's arguments; `shape` is set to the rows and hidden size core::v2::check_combine found.
  std::shared_ptr<const DeviceHandleState> check_combine(const CombineArgs& a, const std::string& ctx,
                                                         core::v2::CombineShape& shape);
  comm::Wait wait(const char* phase) const { return {phase, timeout_}; }
  void check_usable(const char* op) const;
  std::exception_ptr error_from(std::uint64_t word, const char* op);
  std::uint64_t* status() const { return reinterpret_cast<std::uint64_t*>(peers_.base[rank_] + layout_.status); }
  // The addresses of every rank's tensors, from the agreement's payloads.
  DevicePeerTensors resolve(const std::vector<std::span<const std::byte>>& payloads) const;
  std::uint64_t publish_address(const void* p) const;
  // Refuses a tensor that ranks on other devices would read in place but cannot (Exec::peer_readable).
  void check_peer_readable(const std::string& ctx, const char* name, const TensorView& t) const;
  std::byte* stage_at(std::int64_t offset) const { return peers_.base[rank_] + layout_.stage + offset; }
  // The call's end: barrier 1, the error word's host copy, the scratch released, and the
  // caller's stream ordered after the work (or an Event for asynchronous calls).
  void finish(std::uintptr_t stream, bool async, Event& event, const char* op);
  std::int64_t staging_bytes(std::int64_t need, const char* op) const;

  Group& group_;
  ElasticBufferConfig config_;
  int rank_ = 0, R_ = 1;
  double timeout_ = 300;
  std::unique_ptr<comm::Transport> channel_;
  std::unique_ptr<Exec> exec_;
  std::shared_ptr<void> sym_;
  std::int64_t bytes_ = 0;
  SymLayout layout_;
  Peers peers_{};
  bool direct_ = true;  // every rank in this process: tensors are published as they are
  bool other_devices_ = false;  // ranks of this process use other devices (they read across devices)
  std::vector<std::shared_ptr<void>> mapped_;  // peers' regions mapped through IPC
  std::uint64_t id_ = 0;
  std::uint64_t barriers_ = 0;  // barriers passed (the signal value)
  std::uint64_t call_first_barrier_ = 0;  // the signal value of the current call's first barrier
  std::uint64_t op_number_ = 0;
  bool destroyed_ = false;
  bool failed_ = false;
  std::string failure_;
};

}  // namespace moe_ep::cuda

#include "cuda/elastic_device_impl.hh"
