// Low-latency dispatch of the V1 Buffer (docs/legacy.md §4).
//
// After the agreement (per-expert counts), each rank stages its tokens once (cast to FP8 or NVFP4
// when asked) into its current slot and publishes the call number in the slot header; receivers
// copy each (token, expert) row from the sources' slots into the per-expert slab, sources in rank
// order, tokens in token order, so the layout is deterministic. Ranks of other nodes receive the
// rows through one counted exchange (engine/counted_exchange.hh). With a receive hook the copy
// waits for the hook.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>

#include "comm/wait.hh"
#include "core/arith.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "core/fp8_rows.hh"
#include "core/host_allocator.hh"
#include "core/nvfp4_rows.hh"
#include "core/reduce.hh"
#include "engine/call_shape.hh"
#include "engine/counted_exchange.hh"
#include "legacy/buffer_core.hh"
#include "legacy/low_latency_steps.hh"
#include "moe_ep/convert.hpp"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"
#include "routing/plan.hh"

namespace moe_ep::legacy {
namespace {

using std::int32_t;
using std::int64_t;

// Byte of NVFP4 block scale j of token row t in one expert's swizzled scale storage
// [rm, rk, 32, 4, 4] (the 128 x 4 block-scale layout of block-scaled GEMMs).
std::int64_t nvfp4_scale_offset(std::int64_t t, std::int64_t j, std::int64_t rk) {
  return ((t / 128) * rk + j / 4) * 512 + (t % 32) * 16 + ((t % 128) / 32) * 4 + (j % 4);
}

class LowLatencyDispatch final : public engine::Operation {
 public:
  LowLatencyDispatch(BufferCore& core, const LowLatencyDispatchArgs& args, std::uint64_t sequence)
      : Operation(core.engine.facts.context("low_latency_dispatch"), "low_latency_dispatch",
                  "low_latency_dispatch: agreement"),
        core_(core),
        args_(args),
        sequence_(sequence),
        ctx_(context()),
        remote_records_(core.engine, "low_latency_dispatch: records of other nodes") {}

  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override;
  void receive(bool parallel);

  LowLatencyDispatchResult result;
  BufferCore::SlotUse use;

 private:
  int ranks() const { return core_.engine.facts.num_ranks; }
  // The phases (engine/operation.hh).
  std::vector<char> counted_on() const override { return core_.counted_on(); }
  void dropped(const std::vector<std::string>& why) override { mark_dropped(core_, why); }
  void validate() override { check_arguments(); }
  // Shrink mode: whether rank r takes part in this call (every rank otherwise).
  bool member(int r) const { return members().empty() || members()[static_cast<size_t>(r)] != 0; }
  std::vector<std::byte> prepare() override;
  void describe(comm::Agreement& agreement) const override;
  void run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>& outputs_ready) override;

  void check_arguments();
  void validate_nvfp4();
  void allocate_received_rows();
  void allocate_handle();
  void take_counts(const std::vector<std::span<const std::byte>>& payloads);
  void apply_masks(const std::vector<std::span<const std::byte>>& payloads);
  // Shrink mode: tokens of rank s and experts of rank d are kept apart (either masks the other).
  bool apart(int s, int d) const { return apart_[static_cast<size_t>(s) * ranks() + d] != 0; }
  void lay_out_slab();
  void assign_combine_rows();
  void stage_and_publish();
  void expect_remote_records();
  void put_remote_records();
  int32_t records_from(int source) const;
  std::vector<int64_t> wait_for_sources();
  void receive_expert(int64_t i);
  void place_row(int64_t i, int64_t row, const std::byte* staged, float weight, int source);
  void place_fp8_scales(int64_t i, std::span<const std::byte* const> scales);
  void add_receive_stats(const std::vector<int64_t>& waited);

  BufferCore& core_;
  LowLatencyDispatchArgs args_;
  std::uint64_t sequence_;
  std::string ctx_;
  engine::CallShape shape_;
  std::optional<SlotLayout> layout_;
  core::Nvfp4Cast nvfp4_;
  std::vector<int32_t> counts_;  // [R * E] tokens of each source selecting each expert
  std::vector<int32_t> tokens_;  // [R] tokens of each source
  std::vector<char> apart_;      // [R * R] (apart(s, d))
  ExpertRows expert_rows_;       // what each local expert takes from each source of this node
  std::shared_ptr<LowLatencyState> state_;
  engine::CountedExchange remote_records_;  // rows of ranks of other nodes, into this rank's receive area
  std::atomic<bool> received_{false};
};

void LowLatencyDispatch::check_arguments() {
  const auto& a = args_;
  const int R = ranks();
  auto& s = shape_;
  if (!a.rejection.empty()) core::fail(ctx_, "{}", a.rejection);
  if (!core_.config.low_latency_mode) core::fail(ctx_, "the buffer was built with low_latency_mode = false");
  s.max_tokens = a.num_max_dispatch_tokens_per_rank;
  if (s.max_tokens <= 0) core::fail(ctx_, "num_max_dispatch_tokens_per_rank = {} must be positive", s.max_tokens);
  core::expect_tensor(ctx_, "x", a.x, DType::kBF16, {-1, -1});
  core::expect_rows_contiguous(ctx_, "x", a.x);
  s.tokens = core::int_size(ctx_, "x", a.x, 0);
  s.hidden = core::int_size(ctx_, "x", a.x, 1);
  if (s.tokens > s.max_tokens)
    core::fail(ctx_, "x has {} tokens, more than num_max_dispatch_tokens_per_rank = {}", s.tokens, s.max_tokens);
  if (s.hidden <= 0) core::fail(ctx_, "x has hidden size {}, expected a positive size", s.hidden);
  if (a.use_fp8 && a.use_nvfp4)
    core::fail(ctx_, "use_fp8 = true and use_nvfp4 = true: pick one wire format (pass use_fp8 = false with NVFP4)");
  if (a.use_fp8 && s.hidden % 128 != 0) core::fail(ctx_, "FP8 hidden size {} is not a multiple of 128", s.hidden);
  if (a.use_ue8m0 && !a.round_scale) core::fail(ctx_, "use_ue8m0 = true requires round_scale = true");
  if (a.round_scale && !a.use_fp8) core::fail(ctx_, "round_scale = true requires use_fp8 = true");
  if (a.use_ue8m0_for_sf && !a.use_nvfp4) core::fail(ctx_, "use_ue8m0_for_sf = true requires use_nvfp4 = true");
  validate_nvfp4();
  if (a.async_finish && a.return_recv_hook) core::fail(ctx_, "async_finish and return_recv_hook cannot both be true");
  core::expect_tensor(ctx_, "topk_idx", a.topk_idx, DType::kInt64, {s.tokens, -1});
  core::expect_rows_contiguous(ctx_, "topk_idx", a.topk_idx);
  s.topk = core::int_size(ctx_, "topk_idx", a.topk_idx, 1);
  if (s.topk < 1 || s.topk > kMaxTopk)
    core::fail(ctx_, "topk_idx has {} columns (k), expected 1 to {}", s.topk, kMaxTopk);
  if (a.topk_weights.defined()) {
    core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {s.tokens, s.topk});
    core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  }
  s.experts = a.num_experts;
  if (s.experts <= 0 || s.experts % R != 0)
    core::fail(ctx_, "num_experts = {} must be a positive multiple of the {} ranks", s.experts, R);
  s.local_experts = s.experts / R;
  if (shrinks(core_) && s.experts > kMaxShrinkExperts)
    core::fail(ctx_, "num_experts = {} is above {}, the most a shrink-mode buffer's exchange carries", s.experts,
               kMaxShrinkExperts);
  if (a.cumulative_local_expert_recv_stats.defined()) {
    core::expect_tensor(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats, DType::kInt32,
                        {s.local_experts});
    core::expect_contiguous(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats);
  }
  if (a.dispatch_wait_recv_cost_stats.defined()) {
    core::expect_tensor(ctx_, "dispatch_wait_recv_cost_stats", a.dispatch_wait_recv_cost_stats, DType::kInt64, {R});
    core::expect_contiguous(ctx_, "dispatch_wait_recv_cost_stats", a.dispatch_wait_recv_cost_stats);
  }
  const std::int64_t need = SlotLayout::pool_bytes(s.max_tokens, s.hidden, R, s.experts);
  if (need > core_.config.num_rdma_bytes)
    throw CapacityError(fmt::format("{}: low-latency calls with N = {}, hidden = {}, {} experts need num_rdma_bytes >= {} "
                                    "(the buffer has {})", ctx_, s.max_tokens, s.hidden, s.experts, need,
                                    core_.config.num_rdma_bytes),
                        need, core_.config.num_rdma_bytes);
  routing::validate_topk(ctx_, {a.topk_idx.data_as<const int64_t>(), a.topk_idx.stride(0), s.tokens, s.topk}, s.experts);
  s.scale_columns = a.use_fp8 ? (a.use_ue8m0 ? core::ceil_div(s.hidden / 128, 4) : s.hidden / 128) : 0;
  layout_.emplace(s.max_tokens, s.hidden, R, s.experts, s.topk,
                  RowFormat{.fp8 = a.use_fp8, .ue8m0 = a.use_ue8m0, .nvfp4 = a.use_nvfp4, .weights = a.topk_weights.defined()});
}

// The NVFP4 cast's settings, or the refusal of an x_global_scale without NVFP4.
void LowLatencyDispatch::validate_nvfp4() {
  const auto& a = args_;
  if (!a.use_nvfp4) {
    if (a.x_global_scale.defined())
      core::fail(ctx_, "x_global_scale is given but use_nvfp4 = false (it is the NVFP4 global scale)");
    return;
  }
  if (shape_.hidden % 128 != 0)
    core::fail(ctx_, "NVFP4 hidden size {} is not a multiple of 128 (16-element blocks, 64-element groups of the "
               "swizzled scale layout)", shape_.hidden);
  nvfp4_.ue8m0 = a.use_ue8m0_for_sf;
  nvfp4_.rounding = core::nvfp4_rounding(a.nvfp4_rounding);
  if (!a.x_global_scale.defined() && !a.use_ue8m0_for_sf)
    core::fail(ctx_, "use_nvfp4 = true requires x_global_scale (a float32 scalar) unless use_ue8m0_for_sf = true");
  if (!a.x_global_scale.defined()) return;
  if (a.x_global_scale.dtype() != DType::kFP32 || a.x_global_scale.ndim() != 0)
    core::fail(ctx_, "x_global_scale must be a float32 scalar (0-d tensor), got {} with {} dimensions",
               dtype_name(a.x_global_scale.dtype()), a.x_global_scale.ndim());
  const float gs = *a.x_global_scale.data_as<const float>();
  if (!a.use_ue8m0_for_sf && !(std::isfinite(gs) && gs > 0.0f))
    core::fail(ctx_, "x_global_scale = {} must be a positive finite number", gs);
  nvfp4_.global_scale = gs;
}

void LowLatencyDispatch::allocate_outputs_early() {
  allocate_received_rows();
  allocate_handle();
}

// recv_x, its scales, the weights and their source ranks.
void LowLatencyDispatch::allocate_received_rows() {
  const int64_t El = shape_.local_experts, H = shape_.hidden, rows = static_cast<int64_t>(ranks()) * shape_.max_tokens;
  if (args_.use_nvfp4) {
    // Storage [El, R*N, H/2] viewed as [R*N, H/2, El]; scales [El, rm, rk, 32, 4, 4] viewed as
    // [32, 4, rm, 4, rk, El] (DeepEP's permutes (1, 2, 0) and (3, 4, 1, 5, 2, 0)).
    Tensor x = Tensor::empty({El, rows, H / 2}, DType::kUInt8);
    const std::int64_t xs[] = {rows, H / 2, El}, xt[] = {H / 2, 1, rows * (H / 2)};
    result.recv_x = x.with_view(TensorView(x.data(), DType::kUInt8, xs, xt));
    const int64_t rm = core::ceil_div(rows, 128), rk = H / 64;
    const DType sdtype = args_.use_ue8m0_for_sf ? DType::kInt32 : DType::kFP8E4M3;
    // Zero outside the received rows: mostly untouched tiles, zeroed lazily (zero_host_sparse).
    Tensor sf = Tensor::empty({El, rm, rk, 32, 4, 4}, sdtype);
    core::zero_host_sparse(sf.data(), static_cast<std::size_t>(sf.nbytes()));
    const std::int64_t per = rm * rk * 512;  // elements per expert
    const std::int64_t ss[] = {32, 4, rm, 4, rk, El}, st[] = {16, 4, rk * 512, 1, 512, per};
    result.recv_x_scales = sf.with_view(TensorView(sf.data(), sdtype, ss, st));
  } else {
    result.recv_x = Tensor::empty({El, rows, H}, args_.use_fp8 ? DType::kFP8E4M3 : DType::kBF16);
  }
  if (args_.topk_weights.defined()) {
    result.recv_topk_weights = Tensor::zeros({El, rows}, DType::kFP32);
    result.recv_rank_info = Tensor::empty({El, rows}, DType::kInt32);
    std::fill(result.recv_rank_info.data_as<int32_t>(), result.recv_rank_info.data_as<int32_t>() + El * rows, -1);
  }
  if (args_.use_fp8) {
    // Token dimension with stride 1: storage [El, S, R*N], viewed as [El, R*N, S].
    const DType dtype = args_.use_ue8m0 ? DType::kInt32 : DType::kFP32;
    Tensor storage = Tensor::empty({El, shape_.scale_columns, rows}, dtype);
    result.recv_x_scales = storage.with_view(storage.transposed(1, 2));
  }
  result.packed_recv_count = Tensor::zeros({El}, DType::kInt32);
}

// The handle and the state the combine of this dispatch reads.
void LowLatencyDispatch::allocate_handle() {
  const int64_t El = shape_.local_experts, rows = static_cast<int64_t>(ranks()) * shape_.max_tokens;
  result.handle = std::make_shared<LowLatencyHandle>();
  LowLatencyHandle& h = *result.handle;
  h.packed_recv_src_info = Tensor::empty({El, rows}, DType::kInt32);
  std::fill(h.packed_recv_src_info.data_as<int32_t>(), h.packed_recv_src_info.data_as<int32_t>() + El * rows, -1);
  h.packed_recv_layout_range = Tensor::zeros({El, ranks()}, DType::kInt64);
  h.num_max_dispatch_tokens_per_rank = shape_.max_tokens;
  h.hidden = shape_.hidden;
  h.num_experts = shape_.experts;
  state_ = std::make_shared<LowLatencyState>();
  state_->engine_id = core_.engine.facts.id;
  state_->max_tokens = shape_.max_tokens;
  state_->hidden = shape_.hidden;
  state_->num_experts = shape_.experts;
  state_->num_topk = shape_.topk;
  state_->num_tokens = shape_.tokens;
  h.state = state_;
}

// [E + 1 + R]: the tokens selecting each expert, this rank's token count, then its mask.
std::vector<std::byte> LowLatencyDispatch::prepare() {
  use = plan_slot(core_, ctx_, shape_.max_tokens, shape_.hidden, shape_.experts, args_.return_recv_hook);
  core_.engine.limit_inflight(0);  // num_qps_per_rank
  if (!result.recv_x.defined()) allocate_outputs_early();
  std::vector<int32_t> mine(static_cast<size_t>(shape_.experts) + 1 + ranks(), 0);
  mine[static_cast<size_t>(shape_.experts)] = shape_.tokens;
  for (int r = 0; r < ranks(); ++r)
    mine[static_cast<size_t>(shape_.experts + 1 + r)] = core_.masked[static_cast<size_t>(r)].load(std::memory_order_relaxed);
  const auto* topk = args_.topk_idx.data_as<const int64_t>();
  for (int t = 0; t < shape_.tokens; ++t)
    for (int j = 0; j < shape_.topk; ++j)
      if (topk[t * args_.topk_idx.stride(0) + j] >= 0) ++mine[static_cast<size_t>(topk[t * args_.topk_idx.stride(0) + j])];
  const auto bytes = std::as_bytes(std::span(mine));
  return {bytes.begin(), bytes.end()};
}

// The agreement: every rank's arguments and per-expert counts.
void LowLatencyDispatch::describe(comm::Agreement& agreement) const {
  agreement.field("operation number", static_cast<int64_t>(sequence_))
      .field("low-latency call number", static_cast<int64_t>(use.number))
      .field("num_max_dispatch_tokens_per_rank", shape_.max_tokens)
      .field("hidden", shape_.hidden)
      .field("num_experts", shape_.experts)
      .field("num_topk", shape_.topk)
      .field("use_fp8", args_.use_fp8)
      .field("round_scale", args_.round_scale)
      .field("use_ue8m0", args_.use_ue8m0)
      .field("use_nvfp4", args_.use_nvfp4)
      .field("use_ue8m0_for_sf", args_.use_ue8m0_for_sf)
      .field("topk_weights given", args_.topk_weights.defined());
}

void LowLatencyDispatch::run(const std::vector<std::span<const std::byte>>& payloads,
                             const std::function<void()>& outputs_ready) {
  // The agreement let the call proceed: now it takes its slot (a refused call changes nothing).
  core_.take_slot(use);
  state_->dispatch_number = use.number;
  state_->slot = use.slot;
  state_->slot_generation = use.generation;
  take_counts(payloads);
  apply_masks(payloads);
  lay_out_slab();
  assign_combine_rows();
  stage_and_publish();
  expect_remote_records();
  put_remote_records();
  outputs_ready();
  if (!args_.return_recv_hook) receive(true);
}

// Every rank's per-expert counts (counts_) and token count (tokens_).
void LowLatencyDispatch::take_counts(const std::vector<std::span<const std::byte>>& payloads) {
  const int R = ranks(), E = shape_.experts;
  counts_.resize(static_cast<size_t>(R) * E);
  tokens_.resize(static_cast<size_t>(R));
  for (int s = 0; s < R; ++s) {
    if (!member(s)) continue;  // shrink mode: a rank that did not take part sends nothing
    if (payloads[static_cast<size_t>(s)].size() != sizeof(int32_t) * (E + 1 + R))
      throw StateError(fmt::format("{}: rank {} published {} bytes of counts", ctx_, s, payloads[static_cast<size_t>(s)].size()));
    std::memcpy(&counts_[static_cast<size_t>(s) * E], payloads[static_cast<size_t>(s)].data(), sizeof(int32_t) * E);
    std::memcpy(&tokens_[static_cast<size_t>(s)], payloads[static_cast<size_t>(s)].data() + sizeof(int32_t) * E, sizeof(int32_t));
  }
}

// Shrink mode: every rank's mask decides which (source, expert rank) pairs are kept apart; their
// counts become 0, and this rank masks the ranks that masked it (what DeepEP's timeout on a
// masking peer does). Without masks nothing changes.
void LowLatencyDispatch::apply_masks(const std::vector<std::span<const std::byte>>& payloads) {
  const int R = ranks(), E = shape_.experts, El = shape_.local_experts, me = core_.engine.facts.rank;
  // A rank that did not take part (shrink mode) is apart from every rank, as if it masked them all.
  std::vector<int32_t> masks(static_cast<size_t>(R) * R, 1);
  for (int s = 0; s < R; ++s)
    if (member(s))
      std::memcpy(&masks[static_cast<size_t>(s) * R], payloads[static_cast<size_t>(s)].data() + sizeof(int32_t) * (E + 1),
                  sizeof(int32_t) * R);
  apart_.assign(static_cast<size_t>(R) * R, 0);
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) {
      if (member(s) && member(d) && masks[static_cast<size_t>(s) * R + d] == 0 && masks[static_cast<size_t>(d) * R + s] == 0)
        continue;
      apart_[static_cast<size_t>(s) * R + d] = 1;
      std::fill_n(counts_.begin() + static_cast<std::ptrdiff_t>(s) * E + static_cast<std::ptrdiff_t>(d) * El, El, 0);
    }
  for (int s = 0; s < R; ++s)
    if (member(s) && masks[static_cast<size_t>(s) * R + me] != 0)
      core_.masked[static_cast<size_t>(s)].store(1, std::memory_order_relaxed);
}

// Layout: per local expert, one block per source in rank order.
void LowLatencyDispatch::lay_out_slab() {
  const int R = ranks(), El = shape_.local_experts, me = core_.engine.facts.rank;
  auto* range = result.handle->packed_recv_layout_range.data_as<int64_t>();
  for (int i = 0; i < El; ++i) {
    int64_t begin = 0;
    for (int s = 0; s < R; ++s) {
      const int64_t count = counts_[static_cast<size_t>(s) * shape_.experts + me * El + i];
      range[i * R + s] = (begin << 32) | count;
      begin += count;
    }
    result.packed_recv_count.data_as<int32_t>()[i] = static_cast<int32_t>(begin);
  }
}

// Rows of this rank's (token, lane) pairs in their experts' slabs (for combine).
void LowLatencyDispatch::assign_combine_rows() {
  const int n = shape_.tokens, k = shape_.topk, E = shape_.experts, me = core_.engine.facts.rank;
  state_->topk = Tensor::empty({n, k}, DType::kInt64);
  state_->rows.assign(static_cast<size_t>(n) * k, -1);
  std::vector<int32_t> next(static_cast<size_t>(E), 0);
  for (int ex = 0; ex < E; ++ex)
    for (int s = 0; s < me; ++s) next[static_cast<size_t>(ex)] += counts_[static_cast<size_t>(s) * E + ex];
  const auto* topk = args_.topk_idx.data_as<const int64_t>();
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const int64_t id = topk[t * args_.topk_idx.stride(0) + j];
      state_->topk.data_as<int64_t>()[t * k + j] = id;
      if (id >= 0 && !apart(me, static_cast<int>(id / shape_.local_experts)))
        state_->rows[static_cast<size_t>(t) * k + j] = next[static_cast<size_t>(id)]++;
    }
}

// Stage this rank's tokens once, then publish.
void LowLatencyDispatch::stage_and_publish() {
  auto& e = core_.engine;
  const SlotLayout& L = *layout_;
  const int k = shape_.topk, H = shape_.hidden;
  std::byte* area = core_.slot_area(e.facts.rank, use.slot);
  auto* ids = reinterpret_cast<int32_t*>(area + L.ids_offset);
  auto* weights = reinterpret_cast<float*>(area + L.weights_offset);
  const auto* topk = args_.topk_idx.data_as<const int64_t>();
  const float* topk_weights = args_.topk_weights.defined() ? args_.topk_weights.data_as<const float>() : nullptr;
  e.pool().parallel_for(shape_.tokens, [&](int64_t t) {
    std::byte* row = area + t * L.row_bytes;
    const auto* x = args_.x.data_as<const std::uint16_t>() + t * args_.x.stride(0);
    if (args_.use_nvfp4) {
      core::cast_row_nvfp4(x, H, nvfp4_, reinterpret_cast<std::uint8_t*>(row), reinterpret_cast<std::uint8_t*>(row + L.payload_bytes));
    } else if (args_.use_fp8) {
      // Packed UE8M0 words past the last block (H not a multiple of 512) hold zero bytes.
      if (args_.use_ue8m0) std::memset(row + L.payload_bytes, 0, static_cast<size_t>(L.scales_bytes));
      core::cast_row_fp8(x, H, args_.round_scale, args_.use_ue8m0, reinterpret_cast<std::uint8_t*>(row), row + L.payload_bytes);
    } else {
      std::memcpy(row, x, static_cast<size_t>(L.payload_bytes));
    }
    const auto token = static_cast<int32_t>(t);
    std::memcpy(row + L.token_offset, &token, sizeof token);
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = static_cast<int32_t>(topk[t * args_.topk_idx.stride(0) + j]);
      if (topk_weights) weights[t * k + j] = topk_weights[t * args_.topk_weights.stride(0) + j];
    }
  });
  publish(core_, use.slot, use.number);
  state_->counts = counts_;
  const auto* range = result.handle->packed_recv_layout_range.data_as<const int64_t>();
  state_->layout_range.assign(range, range + static_cast<std::ptrdiff_t>(shape_.local_experts) * ranks());
}

// Records `source` puts into this rank's receive area.
int32_t LowLatencyDispatch::records_from(int source) const {
  return selections(counts_, shape_.experts, shape_.local_experts, source, core_.engine.facts.rank);
}

// Expectations, in call order: one signal from each rank of another node that sends here.
void LowLatencyDispatch::expect_remote_records() {
  expect_other_nodes(core_.engine, remote_records_, [&](int s) { return records_from(s) > 0; });
}

// Ranks of other nodes: one put per (token, expert) into the expert's rank's receive area
// [local expert][source][ordinal], then one signal per destination.
void LowLatencyDispatch::put_remote_records() {
  auto& e = core_.engine;
  const SlotLayout& L = *layout_;
  const int R = ranks(), El = shape_.local_experts, k = shape_.topk, me = e.facts.rank;
  const std::byte* area = core_.slot_area(me, use.slot);
  const auto* weights = reinterpret_cast<const float*>(area + L.weights_offset);
  const auto* topk = args_.topk_idx.data_as<const int64_t>();
  const bool with_weights = args_.topk_weights.defined();
  std::vector<int32_t> ordinal(static_cast<size_t>(shape_.experts), 0);
  for (int t = 0; t < shape_.tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int64_t id = topk[t * args_.topk_idx.stride(0) + j];
      if (id < 0 || apart(me, static_cast<int>(id / El))) continue;
      const int d = static_cast<int>(id / El);
      const int32_t slot_row = ordinal[static_cast<size_t>(id)]++;
      if (e.facts.same_node(d)) continue;
      const int64_t offset = core_.slot_offset(use.slot) + L.recv_offset +
                             ((id % El * R + me) * static_cast<int64_t>(shape_.max_tokens) + slot_row) * L.row_bytes;
      if (with_weights) {
        // The row up to its token index, then this lane's weight in the row's weight field.
        remote_records_.put(d, static_cast<size_t>(offset), area + t * L.row_bytes, static_cast<size_t>(L.weight_offset));
        remote_records_.put(d, static_cast<size_t>(offset + L.weight_offset), weights + t * k + j, sizeof(float));
      } else {
        remote_records_.put(d, static_cast<size_t>(offset), area + t * L.row_bytes, static_cast<size_t>(L.row_bytes));
      }
    }
  remote_records_.signal_written();
}

// Copies this rank's rows from every source's slot into the slab.
void LowLatencyDispatch::receive(bool parallel) {
  if (received_.exchange(true)) throw StateError(fmt::format("{}: the receive hook was already called", ctx_));
  const std::string problem = core_.slot_problem(use.slot, use.generation, "receive hook");
  if (!problem.empty()) throw StateError(fmt::format("{}: {}", ctx_, problem));
  const std::vector<int64_t> waited = wait_for_sources();
  const int me = core_.engine.facts.rank, El = static_cast<int>(shape_.local_experts);
  expert_rows_.build(El, ranks(), shape_.topk, std::int64_t{me} * El, [&](int s) {
    if (apart(s, me) || !core_.engine.facts.same_node(s)) return std::pair<const int32_t*, int32_t>{nullptr, 0};
    const std::byte* area = core_.slot_area(s, use.slot);
    return std::pair{reinterpret_cast<const int32_t*>(area + layout_->ids_offset), tokens_[static_cast<size_t>(s)]};
  });
  if (parallel) {
    core_.engine.pool().parallel_for(shape_.local_experts, [&](int64_t i) { receive_expert(i); });
  } else {
    for (int64_t i = 0; i < shape_.local_experts; ++i) receive_expert(i);
  }
  add_receive_stats(waited);
  const auto* src_info = result.handle->packed_recv_src_info.data_as<const int32_t>();
  state_->src_info.assign(src_info, src_info + shape_.local_experts * static_cast<int64_t>(ranks()) * shape_.max_tokens);
  core_.hook_done(use.slot, use.generation);
}

// Waits for every source's rows: the publications of this node's ranks, the signals of the
// others. Returns the nanoseconds waited for each source.
std::vector<int64_t> LowLatencyDispatch::wait_for_sources() {
  auto& e = core_.engine;
  std::vector<int64_t> waited(static_cast<size_t>(ranks()), 0);
  for (int s = 0; s < ranks(); ++s)
    if (e.facts.same_node(s) && member(s))
      waited[static_cast<size_t>(s)] = wait_published(core_, s, use.slot, use.number, "low_latency_dispatch: receive");
  const std::int64_t ns = wait_remote(core_, remote_records_);
  for (int s : remote_records_.sources()) waited[static_cast<size_t>(s)] = ns;
  return waited;
}

// Local expert i's rows, sources in rank order: from this rank's receive area (other nodes, in
// token order) or from the source's staged rows (this node, tokens in token order).
void LowLatencyDispatch::receive_expert(int64_t i) {
  auto& e = core_.engine;
  const SlotLayout& L = *layout_;
  const int R = ranks(), k = shape_.topk, me = e.facts.rank;
  const auto* range = result.handle->packed_recv_layout_range.data_as<const int64_t>();
  const bool with_weights = result.recv_topk_weights.defined();
  // FP8 scales are written once all of the expert's rows are known (place_fp8_scales): [slab row]
  // the row's staged scales. lay_out_slab packs an expert's rows from row 0, sources in rank order.
  const bool gather_scales = args_.use_fp8 && !args_.use_nvfp4;
  thread_local std::vector<const std::byte*> scales;
  scales.clear();
  const auto gather = [&](int64_t row, const std::byte* staged) {
    if (row != static_cast<int64_t>(scales.size()))
      throw StateError(fmt::format("{}: expert {}'s row {} follows {} rows: the slab is not packed", ctx_, i, row,
                                   scales.size()));
    scales.push_back(staged + L.payload_bytes);
  };
  for (int s = 0; s < R; ++s) {
    if (apart(s, me)) continue;  // shrink mode: nothing from s
    int64_t row = range[i * R + s] >> 32;
    if (!e.facts.same_node(s)) {  // arrived in this rank's receive area, in token order
      const int64_t count = range[i * R + s] & 0xffffffff;
      const std::byte* recv = core_.slot_base(me, use.slot) + L.recv_offset;
      for (int64_t c = 0; c < count; ++c) {
        const std::byte* staged = recv + ((i * R + s) * static_cast<int64_t>(shape_.max_tokens) + c) * L.row_bytes;
        float weight = 0.0f;
        if (with_weights) std::memcpy(&weight, staged + L.weight_offset, sizeof weight);
        place_row(i, row + c, staged, weight, s);
        if (gather_scales) gather(row + c, staged);
      }
      continue;
    }
    const std::byte* area = core_.slot_area(s, use.slot);
    const auto* weights = reinterpret_cast<const float*>(area + L.weights_offset);
    for (const int32_t at : expert_rows_.of(i, s)) {  // token * k + its lane for expert i
      const std::byte* staged = area + static_cast<int64_t>(at / k) * L.row_bytes;
      if (gather_scales) gather(row, staged);
      place_row(i, row++, staged, with_weights ? weights[at] : 0.0f, s);
    }
  }
  if (gather_scales) place_fp8_scales(i, scales);
  core::streaming_fence();  // the rows' stores, before the call (or the hook) returns
}

// Copies one staged row (payload | scales | token) to slab row `row` of local expert i; `weight`
// is its weight for that expert, from `source`.
void LowLatencyDispatch::place_row(int64_t i, int64_t row, const std::byte* staged, float weight, int source) {
  const SlotLayout& L = *layout_;
  const int64_t slab_row = i * static_cast<int64_t>(ranks()) * shape_.max_tokens + row;
  auto* out = static_cast<std::byte*>(result.recv_x.data());
  // Non-temporal: the slab is far larger than the caches (receive_expert fences).
  core::copy_bytes_streaming(out + slab_row * L.payload_bytes, staged, static_cast<size_t>(L.payload_bytes));
  if (result.recv_topk_weights.defined()) {
    result.recv_topk_weights.data_as<float>()[slab_row] = weight;
    result.recv_rank_info.data_as<int32_t>()[slab_row] = source;
  }
  if (args_.use_nvfp4) {
    // Expert i's scale storage starts at i * rm * rk * 512 elements (of 1 or 4 bytes).
    const int64_t rk = shape_.hidden / 64;
    auto* sf = static_cast<std::byte*>(result.recv_x_scales.data()) +
               i * result.recv_x_scales.stride(5) * static_cast<int64_t>(element_size(result.recv_x_scales.dtype()));
    // Scales 4g .. 4g + 3 of a row are contiguous (nvfp4_scale_offset), groups 512 bytes apart.
    const int64_t base = nvfp4_scale_offset(row, 0, rk);
    for (int64_t g = 0; g < L.scales_bytes / 4; ++g)
      std::memcpy(sf + base + g * 512, staged + L.payload_bytes + 4 * g, 4);
  }  // FP8 scales: place_fp8_scales, once per expert
  std::memcpy(&result.handle->packed_recv_src_info.data_as<int32_t>()[slab_row], staged + L.token_offset, sizeof(int32_t));
}

// The FP8 scales of local expert i's rows, scales[r] those of slab row r. The storage is
// column-major: a row's scale p lies a column of R*N elements after its scale p - 1, so a row at a
// time wrote one 4-byte value into each of scale_columns lines, every line read from memory first.
// Here the columns are written whole (core::place_columns_streaming): lines of 16 rows, with
// non-temporal stores, the last padded with zeros (rows past packed_recv_count, whose values are
// unspecified).
void LowLatencyDispatch::place_fp8_scales(int64_t i, std::span<const std::byte* const> scales) {
  const Tensor& sf = result.recv_x_scales;  // [El, R*N, S], token stride 1; FP32 or packed UE8M0: 4 bytes
  core::place_columns_streaming(scales, shape_.scale_columns, sf.data_as<std::uint32_t>() + i * sf.stride(0),
                                sf.stride(2), sf.size(1));
}

void LowLatencyDispatch::add_receive_stats(const std::vector<int64_t>& waited) {
  if (args_.cumulative_local_expert_recv_stats.defined())
    for (int i = 0; i < shape_.local_experts; ++i)
      args_.cumulative_local_expert_recv_stats.data_as<int32_t>()[i] += result.packed_recv_count.data_as<int32_t>()[i];
  if (args_.dispatch_wait_recv_cost_stats.defined())
    for (int s = 0; s < ranks(); ++s) args_.dispatch_wait_recv_cost_stats.data_as<int64_t>()[s] += waited[static_cast<size_t>(s)];
}

}  // namespace

LowLatencyDispatchResult low_latency_dispatch(BufferCore& core, const LowLatencyDispatchArgs& args) {
  return run_low_latency<LowLatencyDispatch>(core, "low_latency_dispatch", args);
}
}  // namespace moe_ep::legacy
