// Low-latency mode of the V1 Buffer (docs/legacy.md §4).
//
// Dispatch: after the agreement (per-expert counts), each rank stages its tokens once (cast to FP8
// when asked) into its current slot and publishes the call number in the slot header; receivers
// copy each (token, expert) row from the sources' slots into the per-expert slab, sources in rank
// order, tokens in token order, so the layout is deterministic. With a receive hook the copy waits
// for the hook. Combine: each token's rank reads the expert outputs of its (token, expert) pairs
// straight from the experts' ranks (or from their slots, when staged for a hook or written in
// place with zero_copy) and sums them weighted, in top-k order.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "comm/wait.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "core/fp8_rows.hh"
#include "core/logfmt_rows.hh"
#include "core/nvfp4_rows.hh"
#include "core/reduce.hh"
#include "legacy/buffer_core.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/error.hpp"
#include "routing/plan.hh"

namespace moe_ep::legacy {
namespace {

using engine::Engine;
using std::int32_t;
using std::int64_t;

std::int64_t align(std::int64_t x, std::int64_t a) { return (x + a - 1) / a * a; }

std::atomic<std::uint64_t>* header(std::byte* slot) { return reinterpret_cast<std::atomic<std::uint64_t>*>(slot); }

// Waits until `rank`'s slot header shows call `number`; returns the nanoseconds waited. A rank
// that left or gave up is reported at once; a failed wait leaves the ranks out of step (also in a
// receive hook, outside any operation), so the buffer leaves its channel.
std::int64_t wait_published(BufferCore& core, int rank, int slot, std::uint64_t number, const char* phase) {
  auto* h = header(core.slot_base(rank, slot));
  if (h->load(std::memory_order_acquire) >= number) return 0;
  comm::Backoff backoff(core.engine.config.timeout_secs);
  const auto start = std::chrono::steady_clock::now();
  const std::string context = core.engine.context("low-latency");
  long polls = 0;
  const std::exception_ptr error = core::attempt(context, [&] {
    while (h->load(std::memory_order_acquire) < number) {
      if (++polls % 256 == 0) core.engine.transport().check_peer(rank, phase);
      if (!backoff.pause())
        throw TimeoutError(fmt::format("{}: {}: timed out after {:.1f} s (timeout {:g} s) waiting for rank {} to "
                                       "publish its data",
                                       context, phase, backoff.elapsed_secs(), core.engine.config.timeout_secs, rank),
                           {rank});
    }
  });
  if (error) core.engine.leave(error);
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

void publish(BufferCore& core, int slot, std::uint64_t number) {
  header(core.slot_base(core.engine.rank, slot))->store(number, std::memory_order_release);
}

// Takes the call's slot once the arguments were checked (the slot is taken either way).
template <class Op>
void take_slot(BufferCore& core, Op& op, int max_tokens, int hidden, int num_experts, bool hook) {
  op.use = core.take_slot(max_tokens, hidden, num_experts, hook, op.local_error == nullptr);
  if (op.local_error || op.use.problem.empty()) return;
  op.local_error = core::attempt(op.context(), [&] { core::fail(op.context(), "{}", op.use.problem); });
}

class LowLatencyDispatch final : public engine::Operation {
 public:
  LowLatencyDispatch(BufferCore& core, const LowLatencyDispatchArgs& args, std::uint64_t sequence)
      : core_(core), args_(args), sequence_(sequence), ctx_(core.engine.context("low_latency_dispatch")) {
    error_context = ctx_;
    local_error = core::attempt(ctx_, [&] { validate(); });
  }
  const std::string& context() const { return ctx_; }

  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override;
  void run(const std::function<void()>& outputs_ready) override;
  void receive(bool parallel);

  LowLatencyDispatchResult result;
  BufferCore::SlotUse use;

 private:
  void validate();

  BufferCore& core_;
  LowLatencyDispatchArgs args_;
  std::uint64_t sequence_;
  std::string ctx_;
  int N_ = 0, H_ = 0, E_ = 0, El_ = 1, R_ = 1, k_ = 0, n_ = 0, S_ = 0;
  std::optional<SlotLayout> layout_;
  core::Nvfp4Cast nvfp4_;
  std::vector<int32_t> counts_;       // [R * E] tokens of each source selecting each expert
  std::vector<int32_t> tokens_;       // [R] tokens of each source
  std::shared_ptr<LowLatencyState> state_;
  std::vector<int> remote_sources_;           // ranks of other nodes sending here
  std::vector<std::uint64_t> remote_targets_;  // their signal counts to wait for
  std::atomic<bool> received_{false};
};

void LowLatencyDispatch::validate() {
  auto& e = core_.engine;
  const auto& a = args_;
  R_ = e.num_ranks;
  if (!a.rejection.empty()) core::fail(ctx_, "{}", a.rejection);
  if (!core_.config.low_latency_mode) core::fail(ctx_, "the buffer was built with low_latency_mode = false");
  N_ = a.num_max_dispatch_tokens_per_rank;
  if (N_ <= 0) core::fail(ctx_, "num_max_dispatch_tokens_per_rank = {} must be positive", N_);
  core::expect_tensor(ctx_, "x", a.x, DType::kBF16, {-1, -1});
  core::expect_rows_contiguous(ctx_, "x", a.x);
  n_ = core::int_size(ctx_, "x", a.x, 0);
  H_ = core::int_size(ctx_, "x", a.x, 1);
  if (n_ > N_) core::fail(ctx_, "x has {} tokens, more than num_max_dispatch_tokens_per_rank = {}", n_, N_);
  if (H_ <= 0) core::fail(ctx_, "x has hidden size {}, expected a positive size", H_);
  if (a.use_fp8 && a.use_nvfp4)
    core::fail(ctx_, "use_fp8 = true and use_nvfp4 = true: pick one wire format (pass use_fp8 = false with NVFP4)");
  if (a.use_fp8 && H_ % 128 != 0) core::fail(ctx_, "FP8 hidden size {} is not a multiple of 128", H_);
  if (a.use_ue8m0 && !a.round_scale) core::fail(ctx_, "use_ue8m0 = true requires round_scale = true");
  if (a.round_scale && !a.use_fp8) core::fail(ctx_, "round_scale = true requires use_fp8 = true");
  if (a.use_ue8m0_for_sf && !a.use_nvfp4) core::fail(ctx_, "use_ue8m0_for_sf = true requires use_nvfp4 = true");
  if (a.use_nvfp4) {
    if (H_ % 128 != 0)
      core::fail(ctx_, "NVFP4 hidden size {} is not a multiple of 128 (16-element blocks, 64-element groups of the "
                 "swizzled scale layout)", H_);
    nvfp4_.ue8m0 = a.use_ue8m0_for_sf;
    nvfp4_.rounding = core::nvfp4_rounding(a.nvfp4_rounding);
    if (!a.x_global_scale.defined() && !a.use_ue8m0_for_sf)
      core::fail(ctx_, "use_nvfp4 = true requires x_global_scale (a float32 scalar) unless use_ue8m0_for_sf = true");
    if (a.x_global_scale.defined()) {
      if (a.x_global_scale.dtype() != DType::kFP32 || a.x_global_scale.ndim() != 0)
        core::fail(ctx_, "x_global_scale must be a float32 scalar (0-d tensor), got {} with {} dimensions",
                   dtype_name(a.x_global_scale.dtype()), a.x_global_scale.ndim());
      const float gs = *a.x_global_scale.data_as<const float>();
      if (!a.use_ue8m0_for_sf && !(std::isfinite(gs) && gs > 0.0f))
        core::fail(ctx_, "x_global_scale = {} must be a positive finite number", gs);
      nvfp4_.global_scale = gs;
    }
  } else if (a.x_global_scale.defined()) {
    core::fail(ctx_, "x_global_scale is given but use_nvfp4 = false (it is the NVFP4 global scale)");
  }
  if (a.async_finish && a.return_recv_hook) core::fail(ctx_, "async_finish and return_recv_hook cannot both be true");
  core::expect_tensor(ctx_, "topk_idx", a.topk_idx, DType::kInt64, {n_, -1});
  core::expect_rows_contiguous(ctx_, "topk_idx", a.topk_idx);
  k_ = core::int_size(ctx_, "topk_idx", a.topk_idx, 1);
  if (k_ < 1 || k_ > engine::kMaxTopk) core::fail(ctx_, "topk_idx has {} columns (k), expected 1 to {}", k_, engine::kMaxTopk);
  if (a.topk_weights.defined()) {
    core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {n_, k_});
    core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  }
  E_ = a.num_experts;
  if (E_ <= 0 || E_ % R_ != 0) core::fail(ctx_, "num_experts = {} must be a positive multiple of the {} ranks", E_, R_);
  El_ = E_ / R_;
  if (a.cumulative_local_expert_recv_stats.defined()) {
    core::expect_tensor(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats, DType::kInt32, {El_});
    core::expect_contiguous(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats);
  }
  if (a.dispatch_wait_recv_cost_stats.defined()) {
    core::expect_tensor(ctx_, "dispatch_wait_recv_cost_stats", a.dispatch_wait_recv_cost_stats, DType::kInt64, {R_});
    core::expect_contiguous(ctx_, "dispatch_wait_recv_cost_stats", a.dispatch_wait_recv_cost_stats);
  }
  const std::int64_t need = SlotLayout::pool_bytes(N_, H_, R_, E_);
  if (need > core_.config.num_rdma_bytes)
    throw CapacityError(fmt::format("{}: low-latency calls with N = {}, hidden = {}, {} experts need num_rdma_bytes >= {} "
                                    "(the buffer has {})", ctx_, N_, H_, E_, need, core_.config.num_rdma_bytes),
                        need, core_.config.num_rdma_bytes);
  routing::validate_topk(ctx_, {a.topk_idx.data_as<const int64_t>(), a.topk_idx.stride(0), n_, k_}, E_);
  S_ = a.use_fp8 ? (a.use_ue8m0 ? (H_ / 128 + 3) / 4 : H_ / 128) : 0;
  layout_.emplace(N_, H_, R_, E_, k_,
                  RowFormat{.fp8 = a.use_fp8, .ue8m0 = a.use_ue8m0, .nvfp4 = a.use_nvfp4, .weights = a.topk_weights.defined()});
}

// Byte of NVFP4 block scale j of token row t in one expert's swizzled scale storage
// [rm, rk, 32, 4, 4] (the 128 x 4 block-scale layout of block-scaled GEMMs).
std::int64_t nvfp4_scale_offset(std::int64_t t, std::int64_t j, std::int64_t rk) {
  return ((t / 128) * rk + j / 4) * 512 + (t % 32) * 16 + ((t % 128) / 32) * 4 + (j % 4);
}

void LowLatencyDispatch::allocate_outputs_early() {
  const int64_t rows = static_cast<int64_t>(R_) * N_;
  if (args_.use_nvfp4) {
    // Storage [El, R*N, H/2] viewed as [R*N, H/2, El]; scales [El, rm, rk, 32, 4, 4] viewed as
    // [32, 4, rm, 4, rk, El] (DeepEP's permutes (1, 2, 0) and (3, 4, 1, 5, 2, 0)).
    Tensor x = Tensor::empty({El_, rows, H_ / 2}, DType::kUInt8);
    const std::int64_t xs[] = {rows, H_ / 2, El_}, xt[] = {H_ / 2, 1, rows * (H_ / 2)};
    result.recv_x = x.with_view(TensorView(x.data(), DType::kUInt8, xs, xt));
    const int64_t rm = (rows + 127) / 128, rk = H_ / 64;
    const DType sdtype = args_.use_ue8m0_for_sf ? DType::kInt32 : DType::kFP8E4M3;
    Tensor sf = Tensor::zeros({El_, rm, rk, 32, 4, 4}, sdtype);
    const std::int64_t per = rm * rk * 512;  // elements per expert
    const std::int64_t ss[] = {32, 4, rm, 4, rk, El_}, st[] = {16, 4, rk * 512, 1, 512, per};
    result.recv_x_scales = sf.with_view(TensorView(sf.data(), sdtype, ss, st));
  } else {
    result.recv_x = Tensor::empty({El_, rows, H_}, args_.use_fp8 ? DType::kFP8E4M3 : DType::kBF16);
  }
  if (args_.topk_weights.defined()) {
    result.recv_topk_weights = Tensor::zeros({El_, rows}, DType::kFP32);
    result.recv_rank_info = Tensor::empty({El_, rows}, DType::kInt32);
    std::fill(result.recv_rank_info.data_as<int32_t>(), result.recv_rank_info.data_as<int32_t>() + El_ * rows, -1);
  }
  if (args_.use_fp8) {
    // Token dimension with stride 1: storage [El, S, R*N], viewed as [El, R*N, S].
    const DType dtype = args_.use_ue8m0 ? DType::kInt32 : DType::kFP32;
    Tensor storage = Tensor::empty({El_, S_, rows}, dtype);
    result.recv_x_scales = storage.with_view(storage.transposed(1, 2));
  }
  result.packed_recv_count = Tensor::zeros({El_}, DType::kInt32);
  result.handle = std::make_shared<LowLatencyHandle>();
  LowLatencyHandle& h = *result.handle;
  h.packed_recv_src_info = Tensor::empty({El_, rows}, DType::kInt32);
  std::fill(h.packed_recv_src_info.data_as<int32_t>(), h.packed_recv_src_info.data_as<int32_t>() + El_ * rows, -1);
  h.packed_recv_layout_range = Tensor::zeros({El_, R_}, DType::kInt64);
  h.num_max_dispatch_tokens_per_rank = N_;
  h.hidden = H_;
  h.num_experts = E_;
  state_ = std::make_shared<LowLatencyState>();
  state_->engine_id = core_.engine.id;
  state_->dispatch_number = use.number;
  state_->slot = use.slot;
  state_->slot_generation = use.generation;
  state_->max_tokens = N_;
  state_->hidden = H_;
  state_->num_experts = E_;
  state_->num_topk = k_;
  state_->num_tokens = n_;
  h.state = state_;
}

void LowLatencyDispatch::run(const std::function<void()>& outputs_ready) {
  auto& e = core_.engine;
  std::vector<int32_t> mine;
  std::exception_ptr error = local_error;
  if (!error) {
    error = core::attempt(ctx_, [&] {
      e.limit_inflight(0);  // num_qps_per_rank
      if (!result.recv_x.defined()) allocate_outputs_early();
      mine.assign(static_cast<size_t>(E_) + 1, 0);
      mine[static_cast<size_t>(E_)] = n_;
      const auto* topk = args_.topk_idx.data_as<const int64_t>();
      for (int t = 0; t < n_; ++t)
        for (int j = 0; j < k_; ++j)
          if (topk[t * args_.topk_idx.stride(0) + j] >= 0) ++mine[static_cast<size_t>(topk[t * args_.topk_idx.stride(0) + j])];
    });
  }
  comm::Agreement agreement(ctx_, "low_latency_dispatch");
  agreement.local_error(error)
      .field("operation number", static_cast<int64_t>(sequence_))
      .field("low-latency call number", static_cast<int64_t>(use.number))
      .field("num_max_dispatch_tokens_per_rank", N_)
      .field("hidden", H_)
      .field("num_experts", E_)
      .field("num_topk", k_)
      .field("use_fp8", args_.use_fp8)
      .field("round_scale", args_.round_scale)
      .field("use_ue8m0", args_.use_ue8m0)
      .field("use_nvfp4", args_.use_nvfp4)
      .field("use_ue8m0_for_sf", args_.use_ue8m0_for_sf)
      .field("topk_weights given", args_.topk_weights.defined());
  std::vector<std::span<const std::byte>> payloads;
  try {
    payloads = agreement.exchange(e.transport(), comm::Scope::kWorld, e.wait("low_latency_dispatch: agreement"),
                                  std::as_bytes(std::span(mine)));
  } catch (...) {
    in_step_failure = agreement.gathered();
    throw;
  }
  counts_.resize(static_cast<size_t>(R_) * E_);
  tokens_.resize(static_cast<size_t>(R_));
  for (int s = 0; s < R_; ++s) {
    if (payloads[static_cast<size_t>(s)].size() != sizeof(int32_t) * (E_ + 1))
      throw StateError(fmt::format("{}: rank {} published {} bytes of counts", ctx_, s, payloads[static_cast<size_t>(s)].size()));
    std::memcpy(&counts_[static_cast<size_t>(s) * E_], payloads[static_cast<size_t>(s)].data(), sizeof(int32_t) * E_);
    std::memcpy(&tokens_[static_cast<size_t>(s)], payloads[static_cast<size_t>(s)].data() + sizeof(int32_t) * E_, sizeof(int32_t));
  }

  // Layout: per local expert, one block per source in rank order.
  const int me = e.rank;
  auto* range = result.handle->packed_recv_layout_range.data_as<int64_t>();
  for (int i = 0; i < El_; ++i) {
    int64_t begin = 0;
    for (int s = 0; s < R_; ++s) {
      const int64_t count = counts_[static_cast<size_t>(s) * E_ + me * El_ + i];
      range[i * R_ + s] = (begin << 32) | count;
      begin += count;
    }
    result.packed_recv_count.data_as<int32_t>()[i] = static_cast<int32_t>(begin);
  }
  // Rows of this rank's (token, lane) pairs in their experts' slabs (for combine).
  state_->topk = Tensor::empty({n_, k_}, DType::kInt64);
  state_->rows.assign(static_cast<size_t>(n_) * k_, -1);
  std::vector<int32_t> next(static_cast<size_t>(E_), 0);
  for (int ex = 0; ex < E_; ++ex)
    for (int s = 0; s < me; ++s) next[static_cast<size_t>(ex)] += counts_[static_cast<size_t>(s) * E_ + ex];
  const auto* topk = args_.topk_idx.data_as<const int64_t>();
  for (int t = 0; t < n_; ++t)
    for (int j = 0; j < k_; ++j) {
      const int64_t id = topk[t * args_.topk_idx.stride(0) + j];
      state_->topk.data_as<int64_t>()[t * k_ + j] = id;
      if (id >= 0) state_->rows[static_cast<size_t>(t) * k_ + j] = next[static_cast<size_t>(id)]++;
    }

  // Stage this rank's tokens once, then publish.
  const SlotLayout& L = *layout_;
  std::byte* area = core_.slot_base(me, use.slot) + SlotLayout::kHeaderBytes;
  auto* ids = reinterpret_cast<int32_t*>(area + L.ids_offset);
  auto* weights = reinterpret_cast<float*>(area + L.weights_offset);
  const float* topk_weights = args_.topk_weights.defined() ? args_.topk_weights.data_as<const float>() : nullptr;
  e.pool().parallel_for(n_, [&](int64_t t) {
    std::byte* row = area + t * L.row_bytes;
    const auto* x = args_.x.data_as<const std::uint16_t>() + t * args_.x.stride(0);
    if (args_.use_nvfp4) {
      core::cast_row_nvfp4(x, H_, nvfp4_, reinterpret_cast<std::uint8_t*>(row), reinterpret_cast<std::uint8_t*>(row + L.payload_bytes));
    } else if (args_.use_fp8) {
      core::cast_row_fp8(x, H_, args_.round_scale, args_.use_ue8m0, reinterpret_cast<std::uint8_t*>(row), row + L.payload_bytes);
    } else {
      std::memcpy(row, x, static_cast<size_t>(L.payload_bytes));
    }
    const auto token = static_cast<int32_t>(t);
    std::memcpy(row + L.token_offset, &token, sizeof token);
    for (int j = 0; j < k_; ++j) {
      ids[t * k_ + j] = static_cast<int32_t>(topk[t * args_.topk_idx.stride(0) + j]);
      if (topk_weights) weights[t * k_ + j] = topk_weights[t * args_.topk_weights.stride(0) + j];
    }
  });
  publish(core_, use.slot, use.number);
  state_->counts = counts_;
  state_->layout_range.assign(range, range + static_cast<std::ptrdiff_t>(El_) * R_);

  // Ranks of other nodes: one put per (token, expert) into the expert's rank's receive area
  // [local expert][source][ordinal], then one signal per destination.
  for (int s = 0; s < R_; ++s) {
    if (e.same_node(s)) continue;
    int32_t incoming = 0;
    for (int i = 0; i < El_; ++i) incoming += counts_[static_cast<size_t>(s) * E_ + me * El_ + i];
    if (incoming > 0) {
      remote_sources_.push_back(s);
      remote_targets_.push_back(e.expect_signal(s));
    }
  }
  std::vector<int32_t> ordinal(static_cast<size_t>(E_), 0);
  std::vector<bool> sent(static_cast<size_t>(R_), false);
  for (int t = 0; t < n_; ++t)
    for (int j = 0; j < k_; ++j) {
      const int64_t id = topk[t * args_.topk_idx.stride(0) + j];
      if (id < 0) continue;
      const int d = static_cast<int>(id / El_);
      const int32_t slot_row = ordinal[static_cast<size_t>(id)]++;
      if (e.same_node(d)) continue;
      const int64_t offset = core_.slot_offset(use.slot) + L.recv_offset +
                             ((id % El_ * R_ + me) * static_cast<int64_t>(N_) + slot_row) * L.row_bytes;
      if (topk_weights) {
        // The row up to its token index, then this lane's weight in the row's weight field.
        e.transport().put(d, e.memory(), static_cast<size_t>(offset), area + t * L.row_bytes, static_cast<size_t>(L.weight_offset));
        e.transport().put(d, e.memory(), static_cast<size_t>(offset + L.weight_offset), weights + t * k_ + j, sizeof(float));
      } else {
        e.transport().put(d, e.memory(), static_cast<size_t>(offset), area + t * L.row_bytes, static_cast<size_t>(L.row_bytes));
      }
      sent[static_cast<size_t>(d)] = true;
    }
  for (int d = 0; d < R_; ++d)
    if (sent[static_cast<size_t>(d)]) e.transport().signal(d);
  outputs_ready();
  if (!args_.return_recv_hook) receive(true);
}

// Copies this rank's rows from every source's slot into the slab.
void LowLatencyDispatch::receive(bool parallel) {
  if (received_.exchange(true)) throw StateError(fmt::format("{}: the receive hook was already called", ctx_));
  const std::string problem = core_.slot_problem(use.slot, use.generation, "receive hook");
  if (!problem.empty()) throw StateError(fmt::format("{}: {}", ctx_, problem));
  auto& e = core_.engine;
  const SlotLayout& L = *layout_;
  const int me = e.rank;
  const int64_t slab_rows = static_cast<int64_t>(R_) * N_;
  std::vector<int64_t> waited(static_cast<size_t>(R_), 0);
  for (int s = 0; s < R_; ++s)
    if (e.same_node(s)) waited[static_cast<size_t>(s)] = wait_published(core_, s, use.slot, use.number, "dispatch receive");
  if (!remote_sources_.empty()) {
    const auto start = std::chrono::steady_clock::now();
    e.transport().wait_signals(remote_sources_, remote_targets_, e.wait("low_latency_dispatch: records of other nodes"));
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    for (int s : remote_sources_) waited[static_cast<size_t>(s)] = ns;
  }
  auto* out = static_cast<std::byte*>(result.recv_x.data());
  auto* src_info = result.handle->packed_recv_src_info.data_as<int32_t>();
  const auto* range = result.handle->packed_recv_layout_range.data_as<const int64_t>();
  const int64_t rk = H_ / 64;
  auto* recv_weights = result.recv_topk_weights.defined() ? result.recv_topk_weights.data_as<float>() : nullptr;
  auto* recv_ranks = result.recv_rank_info.defined() ? result.recv_rank_info.data_as<int32_t>() : nullptr;
  // Copies one staged row (payload | scales | token) to slab row `row` of local expert i; `weight`
  // is its weight for that expert, from source s.
  auto place = [&](int64_t i, int64_t row, const std::byte* staged, float weight, int s) {
    const int64_t slab_row = i * slab_rows + row;
    std::memcpy(out + slab_row * L.payload_bytes, staged, static_cast<size_t>(L.payload_bytes));
    if (recv_weights) {
      recv_weights[slab_row] = weight;
      recv_ranks[slab_row] = s;
    }
    if (args_.use_nvfp4) {
      // Expert i's scale storage starts at i * rm * rk * 512 elements (of 1 or 4 bytes).
      auto* sf = static_cast<std::byte*>(result.recv_x_scales.data()) + i * result.recv_x_scales.stride(5) *
                                                                           static_cast<int64_t>(element_size(result.recv_x_scales.dtype()));
      for (int64_t j = 0; j < L.scales_bytes; ++j) sf[nvfp4_scale_offset(row, j, rk)] = staged[L.payload_bytes + j];
    } else if (args_.use_fp8) {
      const auto* scales = reinterpret_cast<const std::uint32_t*>(staged + L.payload_bytes);
      auto* dst = result.recv_x_scales.data_as<std::uint32_t>();
      for (int p = 0; p < S_; ++p)
        dst[i * result.recv_x_scales.stride(0) + row * result.recv_x_scales.stride(1) + p * result.recv_x_scales.stride(2)] = scales[p];
    }
    std::memcpy(&src_info[slab_row], staged + L.token_offset, sizeof(int32_t));
  };
  auto expert = [&](int64_t i) {
    const int target = me * El_ + static_cast<int>(i);
    for (int s = 0; s < R_; ++s) {
      int64_t row = range[i * R_ + s] >> 32;
      if (!e.same_node(s)) {  // arrived in this rank's receive area, in token order
        const int64_t count = range[i * R_ + s] & 0xffffffff;
        const std::byte* recv = core_.slot_base(me, use.slot) + L.recv_offset;
        for (int64_t c = 0; c < count; ++c) {
          const std::byte* staged = recv + ((i * R_ + s) * static_cast<int64_t>(N_) + c) * L.row_bytes;
          float weight = 0.0f;
          if (recv_weights) std::memcpy(&weight, staged + L.weight_offset, sizeof weight);
          place(i, row + c, staged, weight, s);
        }
        continue;
      }
      const std::byte* area = core_.slot_base(s, use.slot) + SlotLayout::kHeaderBytes;
      const auto* ids = reinterpret_cast<const int32_t*>(area + L.ids_offset);
      const auto* weights = reinterpret_cast<const float*>(area + L.weights_offset);
      for (int t = 0; t < tokens_[static_cast<size_t>(s)]; ++t) {
        int lane = -1;
        for (int j = 0; j < k_ && lane < 0; ++j)
          if (ids[t * k_ + j] == target) lane = j;
        if (lane >= 0) place(i, row++, area + t * L.row_bytes, recv_weights ? weights[t * k_ + lane] : 0.0f, s);
      }
    }
  };
  if (parallel) {
    e.pool().parallel_for(El_, expert);
  } else {
    for (int64_t i = 0; i < El_; ++i) expert(i);
  }
  if (args_.cumulative_local_expert_recv_stats.defined())
    for (int i = 0; i < El_; ++i)
      args_.cumulative_local_expert_recv_stats.data_as<int32_t>()[i] += result.packed_recv_count.data_as<int32_t>()[i];
  if (args_.dispatch_wait_recv_cost_stats.defined())
    for (int s = 0; s < R_; ++s) args_.dispatch_wait_recv_cost_stats.data_as<int64_t>()[s] += waited[static_cast<size_t>(s)];
  state_->src_info.assign(src_info, src_info + El_ * slab_rows);
  core_.hook_done(use.slot, use.generation);
}

// Where a rank's combine input slab lives (published in the agreement).
struct Slab {
  const std::byte* data = nullptr;
  std::int64_t expert_bytes = 0;  // between experts
  std::int64_t row_bytes = 0;     // between rows
};

class LowLatencyCombine final : public engine::Operation {
 public:
  LowLatencyCombine(BufferCore& core, const LowLatencyCombineArgs& args, std::uint64_t sequence)
      : core_(core), args_(args), sequence_(sequence), ctx_(core.engine.context("low_latency_combine")) {
    error_context = ctx_;
    local_error = core::attempt(ctx_, [&] { validate(); });
  }
  const std::string& context() const { return ctx_; }
  // Checks that need the slot: a zero-copy slab must be the buffer of this call's slot.
  void check_zero_copy();

  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {
    result.combined_x = args_.out.defined() ? Tensor().with_view(args_.out) : Tensor::empty({n_, H_}, DType::kBF16);
  }
  void run(const std::function<void()>& outputs_ready) override;
  void receive(bool parallel);

  LowLatencyCombineResult result;
  BufferCore::SlotUse use;

 private:
  void validate();

  BufferCore& core_;
  LowLatencyCombineArgs args_;
  std::uint64_t sequence_;
  std::string ctx_;
  const LowLatencyState* state_ = nullptr;
  int N_ = 0, H_ = 0, E_ = 0, El_ = 1, R_ = 1, k_ = 0, n_ = 0;
  bool staged_ = false;
  std::optional<SlotLayout> layout_;
  std::vector<Slab> peers_;
  std::vector<int> remote_experts_;            // ranks of other nodes sending rows here
  std::vector<std::uint64_t> remote_targets_;  // their signal counts to wait for
  std::atomic<bool> received_{false};
};

void LowLatencyCombine::validate() {
  auto& e = core_.engine;
  const auto& a = args_;
  R_ = e.num_ranks;
  if (!a.rejection.empty()) core::fail(ctx_, "{}", a.rejection);
  if (!core_.config.low_latency_mode) core::fail(ctx_, "the buffer was built with low_latency_mode = false");
  if (!a.handle || !a.handle->state || a.handle->state->engine_id != e.id)
    core::fail(ctx_, "handle is missing or was created by another buffer");
  state_ = a.handle->state.get();
  const std::string stale = core_.slot_problem(state_->slot, state_->slot_generation, "handle");
  if (!stale.empty()) core::fail(ctx_, "{}", stale);
  if (state_->src_info.empty())
    core::fail(ctx_, "the handle's dispatch has not received its tokens yet: call its receive hook first");
  if (a.use_logfmt && a.zero_copy)
    core::fail(ctx_, "use_logfmt = true cannot be combined with zero_copy = true (LogFMT rows are encoded while "
               "they are sent, zero-copy rows are not sent)");
  if (a.async_finish && a.return_recv_hook) core::fail(ctx_, "async_finish and return_recv_hook cannot both be true");
  N_ = state_->max_tokens;
  H_ = state_->hidden;
  E_ = state_->num_experts;
  El_ = E_ / R_;
  k_ = state_->num_topk;
  n_ = state_->num_tokens;
  if (a.use_logfmt && H_ % 128 != 0)
    core::fail(ctx_, "use_logfmt = true needs a hidden size that is a multiple of 128 (128-channel blocks), got {}", H_);
  layout_.emplace(N_, H_, R_, E_, k_, RowFormat{});
  const int64_t slab_rows = static_cast<int64_t>(R_) * N_;
  core::expect_tensor(ctx_, "x", a.x, DType::kBF16, {El_, slab_rows, H_});
  core::expect_rows_contiguous(ctx_, "x", a.x);
  core::expect_tensor(ctx_, "topk_idx", a.topk_idx, DType::kInt64, {n_, k_});
  core::expect_rows_contiguous(ctx_, "topk_idx", a.topk_idx);
  for (int t = 0; t < n_; ++t)
    for (int j = 0; j < k_; ++j)
      if (a.topk_idx.data_as<const int64_t>()[t * a.topk_idx.stride(0) + j] != state_->topk.data_as<const int64_t>()[t * k_ + j])
        core::fail(ctx_, "topk_idx[{}, {}] = {} differs from the dispatched {}", t, j,
                   a.topk_idx.data_as<const int64_t>()[t * a.topk_idx.stride(0) + j], state_->topk.data_as<const int64_t>()[t * k_ + j]);
  core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {n_, k_});
  core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  if (a.out.defined()) {
    core::expect_tensor(ctx_, "out", a.out, DType::kBF16, {n_, H_});
    core::expect_rows_contiguous(ctx_, "out", a.out);
  }
  if (a.combine_wait_recv_cost_stats.defined()) {
    core::expect_tensor(ctx_, "combine_wait_recv_cost_stats", a.combine_wait_recv_cost_stats, DType::kInt64, {R_});
    core::expect_contiguous(ctx_, "combine_wait_recv_cost_stats", a.combine_wait_recv_cost_stats);
  }
  staged_ = a.zero_copy || a.return_recv_hook;
}

void LowLatencyCombine::check_zero_copy() {
  if (local_error || !args_.zero_copy) return;
  try {
    const auto* expected = core_.slot_base(core_.engine.rank, use.slot) + SlotLayout::kHeaderBytes;
    if (args_.x.data() != static_cast<const void*>(expected))
      core::fail(ctx_, "zero_copy = true but x is not get_next_low_latency_combine_buffer(handle) for this call");
  } catch (...) {
    local_error = std::current_exception();
  }
}

void LowLatencyCombine::run(const std::function<void()>& outputs_ready) {
  auto& e = core_.engine;
  Slab mine;
  std::exception_ptr error = local_error;
  if (!error) {
    error = core::attempt(ctx_, [&] {
      e.limit_inflight(0);  // num_qps_per_rank
      if (!result.combined_x.defined()) allocate_outputs_early();
      mine = {static_cast<const std::byte*>(args_.x.data()), args_.x.stride(0) * 2, args_.x.stride(1) * 2};
    });
  }
  // Without staging, node peers read x itself: share it (Transport::share).
  Slab shared = mine;
  if (!error && !staged_) {
    error = core::attempt(ctx_, [&] {
      const comm::Transport::Span span{mine.data, engine::view_extent(args_.x)};
      shared.data = static_cast<const std::byte*>(e.transport().share({&span, 1})[0]);
    });
  }
  comm::Agreement agreement(ctx_, "low_latency_combine");
  agreement.local_error(error)
      .field("operation number", static_cast<int64_t>(sequence_))
      .field("low-latency call number", static_cast<int64_t>(use.number))
      .field("handle's dispatch", state_ ? static_cast<int64_t>(state_->dispatch_number) : 0)
      .field("zero_copy", args_.zero_copy)
      .field("use_logfmt", args_.use_logfmt)
      .field("return_recv_hook", args_.return_recv_hook);
  peers_ = engine::agree_on(*this, agreement, e, "low_latency_combine: agreement", shared, ctx_);
  for (std::size_t r = 0; r < peers_.size(); ++r) {
    if (static_cast<int>(r) == e.rank)
      peers_[r] = mine;
    else if (!staged_ && e.same_node(static_cast<int>(r)))
      peers_[r].data = static_cast<const std::byte*>(e.transport().node_address(static_cast<int>(r), peers_[r].data));
  }
  const SlotLayout& L = *layout_;
  if (staged_ && !args_.zero_copy) {
    // Stage the valid rows of every local expert into this rank's slot, in the zero-copy layout.
    std::byte* area = core_.slot_base(e.rank, use.slot) + SlotLayout::kHeaderBytes;
    const auto* ranges = state_->layout_range.data();
    const int64_t slab_rows = static_cast<int64_t>(R_) * N_;
    e.pool().parallel_for(El_, [&](int64_t i) {
      int64_t valid = 0;
      for (int s = 0; s < R_; ++s) valid += ranges[i * R_ + s] & 0xffffffff;
      for (int64_t row = 0; row < valid; ++row)
        std::memcpy(area + ((i * slab_rows + row) * L.combine_row_elements) * 2,
                    args_.x.data_as<const std::uint16_t>() + i * args_.x.stride(0) + row * args_.x.stride(1),
                    static_cast<size_t>(H_) * 2);
    });
  }
  if (staged_) publish(core_, use.slot, use.number);

  // Rows for tokens of other nodes' ranks: one put per (token, expert) into the token's rank's
  // receive area [global expert][token], then one signal per source. Expectations, in call order.
  const int me = e.rank;
  const auto& counts = state_->counts;
  for (int d = 0; d < R_; ++d) {
    if (e.same_node(d)) continue;
    int32_t outgoing = 0;
    for (int i = 0; i < El_; ++i) outgoing += counts[static_cast<size_t>(me) * E_ + d * El_ + i];
    if (outgoing > 0) {
      remote_experts_.push_back(d);
      remote_targets_.push_back(e.expect_signal(d));
    }
  }
  const auto* ranges = state_->layout_range.data();
  const auto* src_info = state_->src_info.data();
  const int64_t slab_rows = static_cast<int64_t>(R_) * N_;
  for (int src = 0; src < R_; ++src) {
    if (e.same_node(src)) continue;
    bool sent = false;
    for (int i = 0; i < El_; ++i) {
      const int64_t begin = ranges[i * R_ + src] >> 32, count = ranges[i * R_ + src] & 0xffffffff;
      for (int64_t c = 0; c < count; ++c) {
        const int32_t token = src_info[i * slab_rows + begin + c];
        const int64_t offset = core_.slot_offset(use.slot) + L.recv_offset +
                               ((static_cast<int64_t>(me) * El_ + i) * N_ + token) * L.combine_recv_row_bytes;
        const auto* row = args_.x.data_as<const std::uint16_t>() + i * args_.x.stride(0) + (begin + c) * args_.x.stride(1);
        if (args_.use_logfmt) {
          // Encoded into this row's place in the send area (rows of other nodes' tokens are never
          // read there), then sent.
          std::byte* encoded = core_.slot_base(me, use.slot) + SlotLayout::kHeaderBytes +
                               ((i * slab_rows + begin + c) * L.combine_row_elements) * 2;
          const int64_t bytes = core::logfmt_encode_row(row, H_, encoded);
          e.transport().put(src, e.memory(), static_cast<size_t>(offset), encoded, static_cast<size_t>(bytes));
        } else {
          e.transport().put(src, e.memory(), static_cast<size_t>(offset), row, static_cast<size_t>(H_) * 2);
        }
        sent = true;
      }
    }
    if (sent) e.transport().signal(src);
  }
  outputs_ready();
  if (args_.return_recv_hook) return;
  {
    // Without staging, the rows of node peers are read straight from their x.
    std::optional<comm::PeerReads> reads;
    if (!staged_) reads.emplace(e.transport(), "low_latency_combine: reduction");
    receive(true);
  }
  // Without staging, peers read this rank's x directly: keep it until they are done.
  if (!staged_) e.transport().barrier(comm::Scope::kNode, e.wait("low_latency_combine: exit"));
}

void LowLatencyCombine::receive(bool parallel) {
  if (received_.exchange(true)) throw StateError(fmt::format("{}: the receive hook was already called", ctx_));
  const std::string problem = core_.slot_problem(use.slot, use.generation, "receive hook");
  if (!problem.empty()) throw StateError(fmt::format("{}: {}", ctx_, problem));
  const SlotLayout& L = *layout_;
  auto& e = core_.engine;
  const int64_t slab_rows = static_cast<int64_t>(R_) * N_;
  std::vector<int64_t> waited(static_cast<size_t>(R_), 0);
  for (int d = 0; d < R_ && staged_; ++d)
    if (e.same_node(d)) waited[static_cast<size_t>(d)] = wait_published(core_, d, use.slot, use.number, "combine receive");
  if (!remote_experts_.empty()) {
    const auto start = std::chrono::steady_clock::now();
    e.transport().wait_signals(remote_experts_, remote_targets_, e.wait("low_latency_combine: rows of other nodes"));
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    for (int d : remote_experts_) waited[static_cast<size_t>(d)] = ns;
  }
  const std::byte* recv = core_.slot_base(e.rank, use.slot) + L.recv_offset;
  const auto* ids = state_->topk.data_as<const int64_t>();
  const auto* weights = args_.topk_weights.data_as<const float>();
  auto* out = result.combined_x.data_as<std::uint16_t>();
  const bool logfmt = args_.use_logfmt;
  auto token = [&](int64_t t) {
    std::array<const std::uint16_t*, engine::kMaxTopk> rows;
    std::array<float, engine::kMaxTopk> w;
    std::array<bool, engine::kMaxTopk> encoded{};  // LogFMT rows that arrived encoded
    int n = 0;
    for (int j = 0; j < k_; ++j) {
      const int64_t id = ids[t * k_ + j];
      if (id < 0) continue;
      const int d = static_cast<int>(id / El_);
      const int64_t local = id % El_, row = state_->rows[static_cast<size_t>(t) * k_ + j];
      if (!e.same_node(d)) {
        rows[static_cast<size_t>(n)] = reinterpret_cast<const std::uint16_t*>(recv + (id * N_ + t) * L.combine_recv_row_bytes);
        encoded[static_cast<size_t>(n)] = logfmt;
      } else if (staged_) {
        const std::byte* area = core_.slot_base(d, use.slot) + SlotLayout::kHeaderBytes;
        rows[static_cast<size_t>(n)] = reinterpret_cast<const std::uint16_t*>(area + ((local * slab_rows + row) * L.combine_row_elements) * 2);
      } else {
        const Slab& p = peers_[static_cast<size_t>(d)];
        rows[static_cast<size_t>(n)] = reinterpret_cast<const std::uint16_t*>(p.data + local * p.expert_bytes + row * p.row_bytes);
      }
      w[static_cast<size_t>(n++)] = weights[t * args_.topk_weights.stride(0) + j];
    }
    if (!logfmt) {
      core::weighted_sum_bf16_rows({rows.data(), static_cast<size_t>(n)}, {w.data(), static_cast<size_t>(n)},
                                   out + t * result.combined_x.stride(0), H_);
      return;
    }
    // LogFMT: every row is what its encoding decodes to, whether it traveled encoded or is read
    // in place from a rank of this node (encoded here the same way).
    thread_local std::vector<float> decoded;
    thread_local std::vector<std::byte> scratch;
    decoded.resize(static_cast<size_t>(n) * H_);
    scratch.resize(static_cast<size_t>(core::logfmt_max_row_bytes(H_)));
    std::array<const float*, engine::kMaxTopk> values;
    for (int r = 0; r < n; ++r) {
      float* dst = decoded.data() + static_cast<size_t>(r) * H_;
      const std::byte* bytes = reinterpret_cast<const std::byte*>(rows[static_cast<size_t>(r)]);
      if (!encoded[static_cast<size_t>(r)]) {
        core::logfmt_encode_row(rows[static_cast<size_t>(r)], H_, scratch.data());
        bytes = scratch.data();
      }
      core::logfmt_decode_row(bytes, H_, dst);
      values[static_cast<size_t>(r)] = dst;
    }
    core::weighted_sum_fp32_rows({values.data(), static_cast<size_t>(n)}, {w.data(), static_cast<size_t>(n)},
                                 out + t * result.combined_x.stride(0), H_);
  };
  if (parallel) {
    e.pool().parallel_for(n_, token);
  } else {
    for (int64_t t = 0; t < n_; ++t) token(t);
  }
  if (args_.combine_wait_recv_cost_stats.defined())
    for (int d = 0; d < R_; ++d) args_.combine_wait_recv_cost_stats.data_as<int64_t>()[d] += waited[static_cast<size_t>(d)];
  core_.hook_done(use.slot, use.generation);
}

class CleanLowLatency final : public engine::Operation {
 public:
  CleanLowLatency(BufferCore& core, int N, int H, int E, std::uint64_t sequence)
      : core_(core), N_(N), H_(H), E_(E), sequence_(sequence), ctx_(core.engine.context("clean_low_latency_buffer")) {
    error_context = ctx_;
    local_error = core::attempt(ctx_, [&] {
      if (!core.config.low_latency_mode) core::fail(ctx_, "the buffer was built with low_latency_mode = false");
      if (N <= 0 || H <= 0 || E <= 0 || E % core.engine.num_ranks != 0)
        core::fail(ctx_, "needs N > 0 (got {}), hidden > 0 (got {}) and num_experts a positive multiple of {} (got {})", N,
                   H, core.engine.num_ranks, E);
      const std::int64_t need = SlotLayout::pool_bytes(N, H, core.engine.num_ranks, E);
      if (need > core.config.num_rdma_bytes)
        throw CapacityError(fmt::format("{}: low-latency calls with N = {}, hidden = {}, {} experts need num_rdma_bytes "
                                        ">= {} (the buffer has {})", ctx_, N, H, E, need, core.config.num_rdma_bytes),
                            need, core.config.num_rdma_bytes);
    });
  }
  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {}
  void run(const std::function<void()>&) override {
    auto& e = core_.engine;
    comm::Agreement agreement(ctx_, "clean_low_latency_buffer");
    agreement.local_error(local_error)
        .field("operation number", static_cast<int64_t>(sequence_))
        .field("N", N_)
        .field("hidden", H_)
        .field("num_experts", E_);
    try {
      agreement.exchange(e.transport(), comm::Scope::kWorld, e.wait("clean_low_latency_buffer: agreement"), {});
    } catch (...) {
      in_step_failure = agreement.gathered();
      throw;
    }
    core_.cleaned(N_, H_, E_);
    for (int slot = 0; slot < 2; ++slot) header(core_.slot_base(e.rank, slot))->store(0, std::memory_order_release);
    e.transport().barrier(comm::Scope::kWorld, e.wait("clean_low_latency_buffer: exit"));
  }

 private:
  BufferCore& core_;
  int N_, H_, E_;
  std::uint64_t sequence_;
  std::string ctx_;
};

}  // namespace

// ---- SlotLayout and bookkeeping ------------------------------------------------------------------

SlotLayout::SlotLayout(int max_tokens, int hidden, int num_ranks, int num_experts, int k, RowFormat format) {
  const std::int64_t N = max_tokens, H = hidden, E = num_experts, blocks = (H + 127) / 128;
  if (format.nvfp4) {
    payload_bytes = H / 2;
    scales_bytes = H / 16;
  } else {
    payload_bytes = format.fp8 ? H : 2 * H;
    scales_bytes = format.fp8 ? (format.ue8m0 ? 4 * ((blocks + 3) / 4) : 4 * blocks) : 0;
  }
  token_offset = payload_bytes + scales_bytes;
  weight_offset = token_offset + 4;
  row_bytes = align(token_offset + (format.weights ? 8 : 4), 16);
  combine_row_elements = H + 2 * blocks;
  combine_recv_row_bytes = 2 * H + 4 * blocks;
  (void)k;
  // Fixed per shape: the widest row (BF16 with a weight) and the largest id and weight tables
  // (k <= min(32, E)).
  const std::int64_t widest_row = align(2 * H + 8, 16);
  const std::int64_t table = N * std::min<std::int64_t>(engine::kMaxTopk, E) * 4;
  ids_offset = N * widest_row;
  weights_offset = ids_offset + table;
  const std::int64_t send = std::max(N * widest_row + 2 * table, E * N * combine_row_elements * 2);
  const std::int64_t recv = std::max(E * N * widest_row, E * N * combine_recv_row_bytes);
  recv_offset = align(kHeaderBytes + send, 64);
  slot_bytes = align(recv_offset + recv, 64);
  (void)num_ranks;
}

std::int64_t SlotLayout::pool_bytes(int max_tokens, int hidden, int num_ranks, int num_experts) {
  return 2 * SlotLayout(max_tokens, hidden, num_ranks, num_experts, engine::kMaxTopk, RowFormat{}).slot_bytes;
}

std::int64_t BufferCore::slot_offset(int slot) const {
  // Slots sit at fixed offsets for the shape, whatever the call's k and dtype.
  return slot * slot_stride_.load(std::memory_order_relaxed);
}

std::byte* BufferCore::slot_base(int rank, int slot) { return engine.memory().node_peer(rank) + slot_offset(slot); }

BufferCore::SlotUse BufferCore::take_slot(int max_tokens, int hidden, int num_experts, bool hook_pending,
                                          bool arguments_valid) {
  std::lock_guard lock(mutex_);
  const int slot = static_cast<int>(calls_ % 2);
  SlotUse use{slot, 0, ++calls_, {}};
  Slot& s = slots_[slot];
  if (!arguments_valid) {
    // The arguments were rejected: nothing more to say about the slot.
  } else if (pool_dirty_)
    use.problem = "a normal-mode call used the scale-out pool since the last low-latency call: call "
                  "clean_low_latency_buffer first";
  else if (shape_ && (*shape_)[0] == max_tokens && (*shape_)[1] == hidden && (*shape_)[2] == num_experts)
    ;
  else if (shape_)
    use.problem = fmt::format("N, hidden or num_experts changed from ({}, {}, {}) to ({}, {}, {}): call "
                              "clean_low_latency_buffer({}, {}, {}) first",
                              (*shape_)[0], (*shape_)[1], (*shape_)[2], max_tokens, hidden, num_experts, max_tokens,
                              hidden, num_experts);
  if (use.problem.empty() && s.hook_pending)
    use.problem = fmt::format("slot {} still holds the result of low-latency call {}, whose receive hook has not run; at "
                              "most two low-latency results can be live", slot, s.owner);
  // The call takes the slot whatever happens to it (every rank does the same).
  ++s.generation;
  s.hook_pending = use.problem.empty() && arguments_valid && hook_pending;
  s.owner = use.number;
  use.generation = s.generation;
  if (use.problem.empty() && arguments_valid && !shape_) {
    shape_ = std::array<int, 3>{max_tokens, hidden, num_experts};
    slot_stride_ = SlotLayout::pool_bytes(max_tokens, hidden, engine.num_ranks, num_experts) / 2;
  }
  return use;
}

int BufferCore::next_slot() const {
  std::lock_guard lock(mutex_);
  return static_cast<int>(calls_ % 2);
}

std::string BufferCore::next_slot_problem() const {
  std::lock_guard lock(mutex_);
  const Slot& s = slots_[calls_ % 2];
  if (s.hook_pending)
    return fmt::format("the next slot ({}) still holds the result of low-latency call {}, whose receive hook has not "
                       "run", calls_ % 2, s.owner);
  return {};
}

void BufferCore::hook_done(int slot, std::uint64_t generation) {
  std::lock_guard lock(mutex_);
  if (slots_[slot].generation == generation) slots_[slot].hook_pending = false;
}

std::string BufferCore::slot_problem(int slot, std::uint64_t generation, const char* what) const {
  std::lock_guard lock(mutex_);
  if (slots_[slot].generation != generation)
    return fmt::format("the {}'s slot {} was used again by low-latency call {} (or cleaned, or used by normal mode); "
                       "its data is gone", what, slot, slots_[slot].owner);
  return {};
}

void BufferCore::normal_call_used_pool() {
  std::lock_guard lock(mutex_);
  if (!config.low_latency_mode) return;
  pool_dirty_ = true;
  for (auto& s : slots_) {
    ++s.generation;
    s.hook_pending = false;
  }
}

void BufferCore::cleaned(int max_tokens, int hidden, int num_experts) {
  std::lock_guard lock(mutex_);
  pool_dirty_ = false;
  shape_ = std::array<int, 3>{max_tokens, hidden, num_experts};
  slot_stride_ = SlotLayout::pool_bytes(max_tokens, hidden, engine.num_ranks, num_experts) / 2;
  calls_ = 0;
  for (auto& s : slots_) {
    ++s.generation;
    s.hook_pending = false;
  }
}

// ---- Entry points ------------------------------------------------------------------------------------

TensorView next_combine_buffer(BufferCore& core, const LowLatencyHandle& handle) {
  auto& e = core.engine;
  e.check_usable("get_next_low_latency_combine_buffer");
  const std::string ctx = e.context("get_next_low_latency_combine_buffer");
  if (!handle.state || handle.state->engine_id != e.id) core::fail(ctx, "handle was created by another buffer");
  const LowLatencyState& s = *handle.state;
  const std::string problem = core.next_slot_problem();
  if (!problem.empty()) throw StateError(fmt::format("{}: {}", ctx, problem));
  const std::string stale = core.slot_problem(s.slot, s.slot_generation, "handle");
  if (!stale.empty()) throw StateError(fmt::format("{}: {}", ctx, stale));
  const SlotLayout layout(s.max_tokens, s.hidden, e.num_ranks, s.num_experts, s.num_topk, RowFormat{});
  const std::int64_t El = s.num_experts / e.num_ranks, rows = static_cast<std::int64_t>(e.num_ranks) * s.max_tokens;
  const std::int64_t shape[] = {El, rows, s.hidden};
  const std::int64_t strides[] = {rows * layout.combine_row_elements, layout.combine_row_elements, 1};
  return TensorView(core.slot_base(e.rank, core.next_slot()) + SlotLayout::kHeaderBytes, DType::kBF16, shape, strides);
}

LowLatencyDispatchResult low_latency_dispatch(BufferCore& core, const LowLatencyDispatchArgs& args) {
  auto& e = core.engine;
  e.check_usable("low_latency_dispatch");
  auto op = std::make_shared<LowLatencyDispatch>(core, args, e.next_sequence());
  take_slot(core, *op, args.num_max_dispatch_tokens_per_rank,
            args.x.ndim() == 2 ? static_cast<int>(args.x.size(1)) : 0, args.num_experts, args.return_recv_hook);
  auto result = e.execute(op, args.async_finish);
  if (args.return_recv_hook) result.hook = ReceiveHook([op, alive = core.alive] {
    if (!*alive) throw StateError("low_latency_dispatch: the receive hook was called after its buffer was destroyed");
    op->receive(false);
  });
  return result;
}

LowLatencyCombineResult low_latency_combine(BufferCore& core, const LowLatencyCombineArgs& args) {
  auto& e = core.engine;
  e.check_usable("low_latency_combine");
  const auto* state = args.handle ? args.handle->state.get() : nullptr;
  auto op = std::make_shared<LowLatencyCombine>(core, args, e.next_sequence());
  take_slot(core, *op, state ? state->max_tokens : 0, state ? state->hidden : 0, state ? state->num_experts : 0,
            args.return_recv_hook);
  op->check_zero_copy();
  auto result = e.execute(op, args.async_finish);
  if (args.return_recv_hook) result.hook = ReceiveHook([op, alive = core.alive] {
    if (!*alive) throw StateError("low_latency_combine: the receive hook was called after its buffer was destroyed");
    op->receive(false);
  });
  return result;
}

void clean_low_latency_buffer(BufferCore& core, int max_tokens, int hidden, int num_experts) {
  auto& e = core.engine;
  e.check_usable("clean_low_latency_buffer");
  e.run_sync(std::make_shared<CleanLowLatency>(core, max_tokens, hidden, num_experts, e.next_sequence()));
}

}  // namespace moe_ep::legacy
