// ElasticDevice<Exec>: the V2 ElasticBuffer of the CUDA provider, written once over an executor.
//
// The executor (Exec) runs index-parallel steps in order on the rank's communication stream and
// owns the rank's memory: CudaExec (exec_cuda.cuh) launches them as kernels on a GPU; HostExec
// (tests/cuda) runs the same steps on the rank's host thread, so the whole algorithm is checked
// against the built-in provider on machines without a GPU. Every step is a lambda over an index
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
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/agreement.hh"
#include "comm/transport.hh"
#include "core/checks.hh"
#include "core/timeout.hh"
#include "cuda/device_common.hh"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/provider.hpp"

namespace moe_ep::cuda {

inline constexpr int kMaxTokens = 1 << 22;  // tokens per rank (the error word's token field)

// The base address of every rank's symmetric region, as this rank reaches it.
struct Peers {
  std::byte* base[kMaxRanks];
};

// Every rank's tensors of one call, as this rank reaches them (device addresses).
struct PeerTensors {
  const std::byte* x[kMaxRanks];
  const std::uint32_t* scales[kMaxRanks];
  const float* weights[kMaxRanks];
  const std::int64_t* topk[kMaxRanks];
  const std::int32_t* lanes[kMaxRanks];  // combine: expanded row of each (row, lane) at that rank
  std::int64_t x_row[kMaxRanks];         // bytes between rows
  std::int64_t scale_stride0[kMaxRanks], scale_stride1[kMaxRanks];
  std::int64_t weights_row[kMaxRanks];
  std::int64_t topk_row[kMaxRanks];
};

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
  std::int64_t signals = 0;  // uint64 [kMaxRanks]: signals[p] = barriers rank p has passed
  std::int64_t status = 0;   // uint64 [2]: [0] this rank's top-k error of the current dispatch, [1] its error word
  std::int64_t counts = 0;   // int32 [R]: this rank's tokens bound for each rank
  std::int64_t lists = 0;    // int32 [R * T]: group d at d * T, the tokens bound for d, ascending
  std::int64_t stage = 0;    // staging of the tensors peers read (ranks as processes)
  std::int64_t end = 0;
};

inline std::int64_t round_up(std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; }

inline SymLayout sym_layout(int R, int T) {
  SymLayout l;
  l.signals = 0;
  l.status = round_up(8 * kMaxRanks, 256);
  l.counts = l.status + 256;
  l.lists = l.counts + round_up(4 * std::int64_t{R}, 256);
  l.stage = l.lists + round_up(4 * std::int64_t{R} * T, 256);
  l.end = l.stage;
  return l;
}

// The routing state of one dispatch on the device, kept alive by its EPHandle.
struct DeviceHandleState {
  std::uint64_t buffer_id = 0;
  std::uint64_t dispatch_number = 0;
  bool do_expand = false;
  int num_experts = 0, expert_alignment = 1, num_max_tokens_per_rank = 0, num_tokens = 0, num_topk = 0, hidden = 0;
  std::int64_t num_recv_tokens = 0, num_expanded_tokens = 0;  // as the handle's fields (worst case without sync)
  std::int64_t row_capacity = 0;                              // rows of the arrays below: T * R
  std::shared_ptr<void> memory;                               // every array below, one block
  std::int64_t* topk = nullptr;         // [N, k] this rank's top-k ids, contiguous
  std::int32_t* dst_slot = nullptr;     // [N, R] the token's position among this rank's tokens bound for d, or -1
  std::int32_t* send_base = nullptr;    // [R] first row of this rank's tokens at d
  std::int32_t* sizes = nullptr;        // [2]: real rows M, expanded rows M_exp
  std::int32_t* row_src = nullptr;      // [cap] source rank * T + token
  std::int32_t* row_master = nullptr;   // [cap] the row's master lane at its source
  std::int32_t* local_ids = nullptr;    // [cap, k] local expert of lane j, or -1
  std::int32_t* lane_rows = nullptr;    // [cap, k] expanded row of lane j, or -1 (expanded layout)
  std::int32_t* expert_start = nullptr;  // [El] first expanded row of each local expert
  std::int32_t* expert_count = nullptr;  // [El] unaligned rows of each local expert
};

template <class Exec>
class ElasticDevice final : public provider::ElasticBackend {
 public:
  ElasticDevice(Group& group, const ElasticBufferConfig& config, int device);
  ~ElasticDevice() override;
  DispatchResult dispatch(const DispatchArgs& args) override;
  CombineResult combine(const CombineArgs& args) override;
  std::int64_t num_bytes() const override { return bytes_; }
  void destroy() override;

  // For tests and benches: the executor (device, streams).
  Exec& exec() { return *exec_; }

  // Internal steps, public only because device lambdas may not be defined in private members.
  // Signals every peer and waits for every peer's signal, on the stream (barrier `step` of the call).
  void barrier(int step);
  // The error the device recorded in earlier work of this rank (once), if any: read from the
  // executor's host copy of the error word, without waiting for the device.
  std::exception_ptr take_device_error(const char* op);

 private:
  struct Shape {
    int N = 0, H = 0, k = 0, E = 0, El = 1, T = 0, align = 1, P = 0;
  };
  std::string context(const char* op) const { return fmt::format("[rank {}] {}", rank_, op); }
  comm::Wait wait(const char* phase) const { return {phase, timeout_}; }
  void check_usable(const char* op) const;
  std::exception_ptr error_from(std::uint64_t word, const char* op);
  std::string describe_error(std::uint64_t word, int rank) const;
  // The addresses of every rank's tensors, from the agreement's payloads.
  PeerTensors resolve(const std::vector<std::span<const std::byte>>& payloads) const;
  std::uint64_t publish_address(const void* p) const;
  std::byte* stage_at(std::int64_t offset) const { return peers_.base[rank_] + layout_.stage + offset; }
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
  std::vector<std::shared_ptr<void>> mapped_;  // peers' regions mapped through IPC
  std::uint64_t id_ = 0;
  std::uint64_t barriers_ = 0;  // barriers passed (the signal value)
  std::uint64_t op_number_ = 0;
  bool destroyed_ = false;
  bool failed_ = false;
  std::string failure_;
};

}  // namespace moe_ep::cuda

#include "cuda/elastic_device_impl.hh"
