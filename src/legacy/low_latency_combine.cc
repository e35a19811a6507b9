// Low-latency combine of the V1 Buffer (docs/legacy.md §4).
//
// Each token's rank reads the expert outputs of its (token, expert) pairs straight from the
// experts' ranks (or from their slots, when staged for a hook or written in place with
// zero_copy) and sums them weighted, in top-k order. Rows for tokens of ranks of other nodes
// travel through one counted exchange (engine/counted_exchange.hh), LogFMT-encoded when asked.
#include <fmt/format.h>

#include <array>
#include <atomic>
#include <cstring>
#include <optional>

#include "comm/wait.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "core/logfmt_rows.hh"
#include "core/reduce.hh"
#include "engine/call_shape.hh"
#include "engine/counted_exchange.hh"
#include "legacy/buffer_core.hh"
#include "legacy/low_latency_steps.hh"
#include "moe_ep/error.hpp"
#include "moe_ep/limits.hpp"

namespace moe_ep::legacy {
namespace {

using std::int32_t;
using std::int64_t;

// Where a rank's combine input slab lives (published in the agreement).
struct Slab {
  const std::byte* data = nullptr;
  std::int64_t expert_bytes = 0;  // between experts
  std::int64_t row_bytes = 0;     // between rows
};

class LowLatencyCombine final : public engine::Operation {
 public:
  LowLatencyCombine(BufferCore& core, const LowLatencyCombineArgs& args, std::uint64_t sequence)
      : Operation(core.engine.facts.context("low_latency_combine"), "low_latency_combine",
                  "low_latency_combine: agreement"),
        core_(core),
        args_(args),
        sequence_(sequence),
        ctx_(context()),
        remote_rows_(core.engine, "low_latency_combine: rows of other nodes") {}

  bool outputs_known_early() const override { return true; }
  void allocate_outputs_early() override {
    result.combined_x = args_.out.defined() ? Tensor().with_view(args_.out)
                                            : Tensor::empty({shape_.tokens, shape_.hidden}, DType::kBF16);
  }
  void receive(bool parallel);

  LowLatencyCombineResult result;
  BufferCore::SlotUse use;

 private:
  int ranks() const { return core_.engine.facts.num_ranks; }
  int64_t slab_rows() const { return static_cast<int64_t>(ranks()) * shape_.max_tokens; }
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
  void check_dispatch_state();
  void check_tensors();
  void check_signals();
  void wait_for_signals() const;
  // zero_copy: the caller wrote the expert outputs into this call's slot
  // (get_next_low_latency_combine_buffer); x gave only the shape, the rows are read from there.
  void read_combine_buffer();
  void take_slabs(const std::vector<std::span<const std::byte>>& payloads);
  void stage_and_publish();
  int32_t rows_from(int expert_rank) const;
  void expect_remote_rows();
  void put_remote_rows();
  std::vector<int64_t> wait_for_experts();
  void combine_token(int64_t t);

  BufferCore& core_;
  LowLatencyCombineArgs args_;
  std::uint64_t sequence_;
  std::string ctx_;
  const LowLatencyState* state_ = nullptr;
  engine::CallShape shape_;
  bool staged_ = false;
  std::vector<char> lane_kept_;  // [tokens * k]: 0 where the caller's topk_idx left a dispatched lane out
  std::optional<SlotLayout> layout_;
  std::vector<Slab> peers_;
  Slab mine_;  // this rank's x (before sharing)
  engine::CountedExchange remote_rows_;  // rows of experts on other nodes, into this rank's receive area
  std::atomic<bool> received_{false};
};

void LowLatencyCombine::check_arguments() {
  auto& e = core_.engine;
  const auto& a = args_;
  if (!a.rejection.empty()) core::fail(ctx_, "{}", a.rejection);
  if (!core_.config.low_latency_mode) core::fail(ctx_, "the buffer was built with low_latency_mode = false");
  if (!a.handle || !a.handle->state || a.handle->state->engine_id != e.facts.id)
    core::fail(ctx_, "handle is missing or was created by another buffer");
  state_ = a.handle->state.get();
  if (a.use_logfmt && a.zero_copy)
    core::fail(ctx_, "use_logfmt = true cannot be combined with zero_copy = true (LogFMT rows are encoded while "
               "they are sent, zero-copy rows are not sent)");
  if (a.async_finish && a.return_recv_hook) core::fail(ctx_, "async_finish and return_recv_hook cannot both be true");
  shape_.max_tokens = state_->max_tokens;
  shape_.hidden = state_->hidden;
  shape_.experts = state_->num_experts;
  shape_.local_experts = shape_.experts / ranks();
  shape_.topk = state_->num_topk;
  shape_.tokens = state_->num_tokens;
  if (a.use_logfmt && shape_.hidden % 128 != 0)
    core::fail(ctx_, "use_logfmt = true needs a hidden size that is a multiple of 128 (128-channel blocks), got {}",
               shape_.hidden);
  layout_.emplace(shape_.max_tokens, shape_.hidden, ranks(), shape_.experts, shape_.topk, RowFormat{});
  check_tensors();
  // Shrink mode stages too: peers then read this rank's slot, never its x, so no exit barrier (which
  // would need every rank) has to keep x alive for them.
  staged_ = a.zero_copy || a.return_recv_hook || shrinks(core_);
}

// What the handle's dispatch left, read on the executing thread (an asynchronous dispatch may still
// run while the combine is validated): its slot, its receive, and the top-k ids it dispatched.
void LowLatencyCombine::check_dispatch_state() {
  const std::string stale = core_.slot_problem(state_->slot, state_->slot_generation, "handle");
  if (!stale.empty()) core::fail(ctx_, "{}", stale);
  if (state_->src_info.empty())
    core::fail(ctx_, "the handle's dispatch has not received its tokens yet: call its receive hook first");
  // -1 may replace a dispatched id (the lane is left out of the sum, as DeepEP's combine skips
  // it); any other difference would read rows of another expert.
  // Which lanes to sum is kept here: the caller's topk_idx may change before a receive hook runs.
  const int n = shape_.tokens, k = shape_.topk;
  const auto* given = args_.topk_idx.data_as<const int64_t>();
  const auto* dispatched = state_->topk.data_as<const int64_t>();
  lane_kept_.assign(static_cast<size_t>(n) * k, 1);
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) {
      const int64_t id = given[t * args_.topk_idx.stride(0) + j];
      if (id == dispatched[t * k + j]) continue;
      if (id != -1)
        core::fail(ctx_, "topk_idx[{}, {}] = {} differs from the dispatched {} (only -1, which leaves the lane out, may "
                   "replace a dispatched id)", t, j, id, dispatched[t * k + j]);
      lane_kept_[static_cast<size_t>(t) * k + j] = 0;
    }
}

// x, topk_idx (its shape), topk_weights, out and the wait statistics.
void LowLatencyCombine::check_tensors() {
  const auto& a = args_;
  const int n = shape_.tokens, k = shape_.topk;
  core::expect_tensor(ctx_, "x", a.x, DType::kBF16, {shape_.local_experts, slab_rows(), shape_.hidden});
  core::expect_rows_contiguous(ctx_, "x", a.x);
  core::expect_tensor(ctx_, "topk_idx", a.topk_idx, DType::kInt64, {n, k});
  core::expect_rows_contiguous(ctx_, "topk_idx", a.topk_idx);
  core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {n, k});
  core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  if (a.out.defined()) {
    core::expect_tensor(ctx_, "out", a.out, DType::kBF16, {n, shape_.hidden});
    core::expect_rows_contiguous(ctx_, "out", a.out);
  }
  if (a.combine_wait_recv_cost_stats.defined()) {
    core::expect_tensor(ctx_, "combine_wait_recv_cost_stats", a.combine_wait_recv_cost_stats, DType::kInt64, {ranks()});
    core::expect_contiguous(ctx_, "combine_wait_recv_cost_stats", a.combine_wait_recv_cost_stats);
  }
  check_signals();
}

// hybrid-ep's signalled combine: one unsigned 32-bit word per local expert.
void LowLatencyCombine::check_signals() {
  const auto& a = args_;
  if (a.overlap && !a.src_signals.defined())
    core::fail(ctx_, "overlap = true needs src_signals (one signal per local expert, {} here)", shape_.local_experts);
  if (!a.src_signals.defined()) return;
  core::expect_tensor(ctx_, "src_signals", a.src_signals, DType::kInt32, {shape_.local_experts});
  core::expect_contiguous(ctx_, "src_signals", a.src_signals);
  constexpr std::int64_t kMaxSignal = 0xffffffffLL;
  if (a.src_signal_expect_value < 0 || a.src_signal_expect_value > kMaxSignal)
    core::fail(ctx_, "src_signal_expect_value = {} is outside [0, {}] (signals are unsigned 32-bit words)",
               a.src_signal_expect_value, kMaxSignal);
}

// Before peers may read this rank's rows: every local expert's signal reached the expected value.
// The wait is bounded by half the buffer's timeout, so that its failure reaches the peers waiting
// in the agreement as this rank's rejection rather than as their own timeout.
void LowLatencyCombine::wait_for_signals() const {
  if (!args_.src_signals.defined()) return;
  auto* words = static_cast<std::uint32_t*>(args_.src_signals.data());
  const auto expect = static_cast<std::uint32_t>(args_.src_signal_expect_value);
  const double timeout = core_.engine.facts.config.timeout_secs / 2;
  comm::Backoff backoff(timeout);
  for (int e = 0; e < shape_.local_experts; ++e) {
    const std::atomic_ref<std::uint32_t> signal(words[e]);
    while (signal.load(std::memory_order_acquire) < expect)
      if (!backoff.pause())
        throw TimeoutError(fmt::format("{}: src_signals[{}] = {} after {:.1f} s, expected at least "
                                       "src_signal_expect_value = {} (the wait is bounded by half the timeout, "
                                       "{:g} s)",
                                       ctx_, e, signal.load(std::memory_order_acquire), backoff.elapsed_secs(),
                                       expect, timeout),
                           {core_.engine.facts.rank});
  }
}

void LowLatencyCombine::read_combine_buffer() {
  if (!args_.zero_copy) return;
  args_.x = core_.combine_buffer(use.slot, *layout_, shape_.local_experts, slab_rows(), shape_.hidden);
}

// This rank's slab: without staging, node peers read x itself, so it is shared (Transport::share).
std::vector<std::byte> LowLatencyCombine::prepare() {
  auto& e = core_.engine;
  use = plan_slot(core_, ctx_, shape_.max_tokens, shape_.hidden, shape_.experts, args_.return_recv_hook);
  check_dispatch_state();
  read_combine_buffer();
  wait_for_signals();
  e.limit_inflight(0);  // num_qps_per_rank
  if (!result.combined_x.defined()) allocate_outputs_early();
  mine_ = {static_cast<const std::byte*>(args_.x.data()), args_.x.stride(0) * 2, args_.x.stride(1) * 2};
  Slab shared = mine_;
  if (!staged_) {
    const comm::Transport::Span span{mine_.data, engine::view_extent(args_.x)};
    shared.data = static_cast<const std::byte*>(e.transport().share({&span, 1})[0]);
  }
  const auto* bytes = reinterpret_cast<const std::byte*>(&shared);
  return {bytes, bytes + sizeof shared};
}

void LowLatencyCombine::describe(comm::Agreement& agreement) const {
  agreement.field("operation number", static_cast<int64_t>(sequence_))
      .field("low-latency call number", static_cast<int64_t>(use.number))
      .field("handle's dispatch", state_ ? static_cast<int64_t>(state_->dispatch_number) : 0)
      .field("zero_copy", args_.zero_copy)
      .field("use_logfmt", args_.use_logfmt)
      .field("return_recv_hook", args_.return_recv_hook);
}

void LowLatencyCombine::run(const std::vector<std::span<const std::byte>>& payloads,
                            const std::function<void()>& outputs_ready) {
  auto& e = core_.engine;
  core_.take_slot(use);  // the agreement let the call proceed (a refused call changes nothing)
  take_slabs(payloads);
  stage_and_publish();
  expect_remote_rows();
  put_remote_rows();
  outputs_ready();
  if (args_.return_recv_hook) return;
  receive(true);
  // Without staging, peers read this rank's x directly: keep it until they are done.
  if (!staged_) e.transport().barrier(comm::Scope::kNode, e.facts.wait("low_latency_combine: exit"));
}

// Every rank's slab (peers_), the node peers' mapped here.
void LowLatencyCombine::take_slabs(const std::vector<std::span<const std::byte>>& payloads) {
  auto& e = core_.engine;
  peers_.assign(payloads.size(), Slab{});
  for (std::size_t r = 0; r < peers_.size(); ++r) {
    if (!member(static_cast<int>(r))) continue;  // shrink mode: took no part, publishes nothing
    if (payloads[r].size() != sizeof(Slab))
      throw StateError(fmt::format("{}: rank {} published {} bytes, expected {}", ctx_, r, payloads[r].size(), sizeof(Slab)));
    std::memcpy(&peers_[r], payloads[r].data(), sizeof(Slab));
    if (static_cast<int>(r) == e.facts.rank) {
      peers_[r] = mine_;
    } else if (!staged_ && e.facts.same_node(static_cast<int>(r))) {
      try {
        peers_[r].data = static_cast<const std::byte*>(e.transport().node_address(static_cast<int>(r), peers_[r].data));
      } catch (const PeerError&) {
        // A node peer whose process is gone: named under this step, as a wait on it names it.
        e.transport().check_peer(static_cast<int>(r), "low_latency_combine: node peers' slabs");
        throw;
      }
    }
  }
}

// Staged (hook or zero_copy): the valid rows of every local expert in this rank's slot, in the
// zero-copy layout (zero_copy wrote them there already), then published.
void LowLatencyCombine::stage_and_publish() {
  if (!staged_) return;
  if (!args_.zero_copy) {
    auto& e = core_.engine;
    const SlotLayout& L = *layout_;
    const int R = ranks();
    std::byte* area = core_.slot_area(e.facts.rank, use.slot);
    const auto* ranges = state_->layout_range.data();
    const int64_t rows = slab_rows();
    e.pool().parallel_for(shape_.local_experts, [&](int64_t i) {
      int64_t valid = 0;
      for (int s = 0; s < R; ++s) valid += ranges[i * R + s] & 0xffffffff;
      for (int64_t row = 0; row < valid; ++row)
        std::memcpy(area + ((i * rows + row) * L.combine_row_elements) * 2,
                    args_.x.data_as<const std::uint16_t>() + i * args_.x.stride(0) + row * args_.x.stride(1),
                    static_cast<size_t>(shape_.hidden) * 2);
    });
  }
  publish(core_, use.slot, use.number);
}

// Rows the experts of `expert_rank` send back for this rank's tokens.
int32_t LowLatencyCombine::rows_from(int expert_rank) const {
  return selections(state_->counts, shape_.experts, shape_.local_experts, core_.engine.facts.rank, expert_rank);
}

// Expectations, in call order: one signal from each rank of another node with rows for this one.
void LowLatencyCombine::expect_remote_rows() {
  expect_other_nodes(core_.engine, remote_rows_, [&](int d) { return member(d) && rows_from(d) > 0; });
}

// Rows for tokens of other nodes' ranks: one put per (token, expert) into the token's rank's
// receive area [global expert][token], then one signal per source.
void LowLatencyCombine::put_remote_rows() {
  auto& e = core_.engine;
  const SlotLayout& L = *layout_;
  const int R = ranks(), El = shape_.local_experts, me = e.facts.rank;
  const auto* ranges = state_->layout_range.data();
  const auto* src_info = state_->src_info.data();
  const int64_t rows = slab_rows();
  for (int src = 0; src < R; ++src) {
    if (e.facts.same_node(src) || !member(src)) continue;
    for (int i = 0; i < El; ++i) {
      const int64_t begin = ranges[i * R + src] >> 32, count = ranges[i * R + src] & 0xffffffff;
      for (int64_t c = 0; c < count; ++c) {
        const int32_t token = src_info[i * rows + begin + c];
        const int64_t offset = core_.slot_offset(use.slot) + L.recv_offset +
                               ((static_cast<int64_t>(me) * El + i) * shape_.max_tokens + token) * L.combine_recv_row_bytes;
        const auto* row = args_.x.data_as<const std::uint16_t>() + i * args_.x.stride(0) + (begin + c) * args_.x.stride(1);
        if (args_.use_logfmt) {
          // Encoded into this row's place in the send area (rows of other nodes' tokens are never
          // read there), then sent.
          std::byte* encoded = core_.slot_area(me, use.slot) +
                               ((i * rows + begin + c) * L.combine_row_elements) * 2;
          const int64_t bytes = core::logfmt_encode_row(row, shape_.hidden, encoded);
          remote_rows_.put(src, static_cast<size_t>(offset), encoded, static_cast<size_t>(bytes));
        } else {
          remote_rows_.put(src, static_cast<size_t>(offset), row, static_cast<size_t>(shape_.hidden) * 2);
        }
      }
    }
    remote_rows_.signal_written();
  }
}

void LowLatencyCombine::receive(bool parallel) {
  if (received_.exchange(true)) throw StateError(fmt::format("{}: the receive hook was already called", ctx_));
  const std::string problem = core_.slot_problem(use.slot, use.generation, "receive hook");
  if (!problem.empty()) throw StateError(fmt::format("{}: {}", ctx_, problem));
  const std::vector<int64_t> waited = wait_for_experts();
  {
    // Without staging, the rows of node peers are read straight from their x. The section opens
    // after the wait: one that held a wait on other ranks would hold up node peers that leave.
    std::optional<comm::PeerReads> reads;
    if (!staged_) reads.emplace(core_.engine.transport(), "low_latency_combine: reduction");
    if (parallel) {
      core_.engine.pool().parallel_for(shape_.tokens, [&](int64_t t) { combine_token(t); });
    } else {
      for (int64_t t = 0; t < shape_.tokens; ++t) combine_token(t);
    }
  }
  if (args_.combine_wait_recv_cost_stats.defined())
    for (int d = 0; d < ranks(); ++d) args_.combine_wait_recv_cost_stats.data_as<int64_t>()[d] += waited[static_cast<size_t>(d)];
  core_.hook_done(use.slot, use.generation);
}

// Waits for every expert rank's rows: the publications of this node's ranks (when staged), the
// signals of the others. Returns the nanoseconds waited for each rank.
std::vector<int64_t> LowLatencyCombine::wait_for_experts() {
  auto& e = core_.engine;
  std::vector<int64_t> waited(static_cast<size_t>(ranks()), 0);
  for (int d = 0; d < ranks() && staged_; ++d)
    if (e.facts.same_node(d) && member(d))
      waited[static_cast<size_t>(d)] = wait_published(core_, d, use.slot, use.number, "low_latency_combine: receive");
  const std::int64_t ns = wait_remote(core_, remote_rows_);
  for (int d : remote_rows_.sources()) waited[static_cast<size_t>(d)] = ns;
  return waited;
}

// Token t's combined row: its experts' rows weighted, in top-k order.
void LowLatencyCombine::combine_token(int64_t t) {
  auto& e = core_.engine;
  const SlotLayout& L = *layout_;
  const int k = shape_.topk, El = shape_.local_experts, H = shape_.hidden;
  const std::byte* recv = core_.slot_base(e.facts.rank, use.slot) + L.recv_offset;
  const auto* ids = state_->topk.data_as<const int64_t>();
  const auto* weights = args_.topk_weights.data_as<const float>();
  auto* out = result.combined_x.data_as<std::uint16_t>();
  const bool logfmt = args_.use_logfmt;
  std::array<const std::uint16_t*, kMaxTopk> rows;
  std::array<float, kMaxTopk> w;
  std::array<bool, kMaxTopk> encoded{};  // LogFMT rows that arrived encoded
  int n = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t id = ids[t * k + j];
    if (id < 0 || !lane_kept_[static_cast<size_t>(t) * k + j]) continue;  // -1 in the caller's topk_idx
    const int d = static_cast<int>(id / El);
    const int64_t local = id % El, row = state_->rows[static_cast<size_t>(t) * k + j];
    if (row < 0 || !member(d)) continue;  // shrink mode: the dispatch kept this token from d, or d failed since
    if (!e.facts.same_node(d)) {
      rows[static_cast<size_t>(n)] = reinterpret_cast<const std::uint16_t*>(recv + (id * shape_.max_tokens + t) * L.combine_recv_row_bytes);
      encoded[static_cast<size_t>(n)] = logfmt;
    } else if (staged_) {
      const std::byte* area = core_.slot_area(d, use.slot);
      rows[static_cast<size_t>(n)] = reinterpret_cast<const std::uint16_t*>(area + ((local * slab_rows() + row) * L.combine_row_elements) * 2);
    } else {
      const Slab& p = peers_[static_cast<size_t>(d)];
      rows[static_cast<size_t>(n)] = reinterpret_cast<const std::uint16_t*>(p.data + local * p.expert_bytes + row * p.row_bytes);
    }
    w[static_cast<size_t>(n++)] = weights[t * args_.topk_weights.stride(0) + j];
  }
  if (!logfmt) {
    core::weighted_sum_bf16_rows({rows.data(), static_cast<size_t>(n)}, {w.data(), static_cast<size_t>(n)},
                                 out + t * result.combined_x.stride(0), H);
    return;
  }
  // LogFMT: every row is what its encoding decodes to, whether it traveled encoded or is read
  // in place from a rank of this node (encoded and decoded here the same way, without packing).
  std::array<core::LogfmtRow, kMaxTopk> coded;
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<size_t>(r);
    coded[i] = encoded[i] ? core::LogfmtRow{.encoded = reinterpret_cast<const std::byte*>(rows[i])}
                          : core::LogfmtRow{.bf16 = rows[i]};
  }
  core::logfmt_weighted_sum({coded.data(), static_cast<size_t>(n)}, {w.data(), static_cast<size_t>(n)},
                            out + t * result.combined_x.stride(0), H);
}

}  // namespace

LowLatencyCombineResult low_latency_combine(BufferCore& core, const LowLatencyCombineArgs& args) {
  return run_low_latency<LowLatencyCombine>(core, "low_latency_combine", args);
}
}  // namespace moe_ep::legacy
