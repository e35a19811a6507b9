// The dispatch operation of both buffer generations. See engine.hh for the data paths and
// docs/semantics.md for the shapes and order of the outputs.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "comm/agreement.hh"
#include "core/checks.hh"
#include "core/failure.hh"
#include "core/log.hh"
#include "core/reduce.hh"
#include "engine/engine.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine {
namespace {

constexpr std::int64_t kRowsPerTask = 32;

class Dispatch final : public DispatchOperation {
 public:
  Dispatch(Engine& engine, DispatchRequest request, std::uint64_t sequence)
      : engine_(engine), req_(std::move(request)), sequence_(sequence), ctx_(engine.context(req_.operation)) {
    error_context = ctx_;
    previous_event = req_.previous_event;
    local_error = core::attempt(ctx_, [&] {
      validate();
      if (!cached_) start_handle();
    });
  }

  bool outputs_known_early() const override { return cached_ || !cpu_sync_; }
  void allocate_outputs_early() override { allocate_outputs(worst_rows(), worst_expanded_rows()); }
  void run(const std::function<void()>& outputs_ready) override;

 private:
  void validate();
  void check_capacity(int tokens_bound) const;
  void check_gathered(const std::vector<PeerTensors>& peers);
  void start_handle();
  std::int64_t worst_rows() const;
  std::int64_t worst_expanded_rows() const;
  void allocate_outputs(std::int64_t rows, std::int64_t expanded_rows);
  void allocate_outputs_unnamed(std::int64_t rows, std::int64_t expanded_rows);
  PeerTensors my_tensors() const;
  void plan_sources();
  void plan_receive_local(const std::vector<PeerTensors>& peers);
  void plan_receive_remote();
  void accept_token(routing::RowAssigner& assigner, int source, std::int32_t index, std::int32_t token,
                    const std::int64_t* ids);
  void fill_handle();
  void put_records(const std::vector<PeerTensors>& peers);
  void wait_records();
  void plan_forwarding();
  void copy_rows(const std::vector<PeerTensors>& peers);
  void zero_padding();

  std::byte* region_record(int source, std::int32_t slot);
  std::int64_t region_offset(int source, std::int32_t slot) const {
    const int region = engine_.paths.hybrid() ? engine_.routing_node_of(source) : source;
    return (static_cast<std::int64_t>(region) * T_ + slot) * record_.bytes;
  }

  Engine& engine_;
  DispatchRequest req_;
  std::uint64_t sequence_;
  std::string ctx_;

  bool fp8_ = false, cached_ = false, cpu_sync_ = true, expand_ = false, has_weights_ = false;
  int N_ = 0, H_ = 0, k_ = 0, E_ = 0, El_ = 1, T_ = 0, A_ = 1, P_ = 0, workers_ = 1;
  int handle_hidden_ = 0;  // the handle's hidden: H_, or the request's handle_hidden
  DType x_dtype_ = DType::kBF16, scale_dtype_ = DType::kFP32;
  std::int64_t row_bytes_ = 0;
  DispatchRecord record_{0, 0, 1};
  routing::Geometry geo_;
  const HandleState* cached_state_ = nullptr;
  std::shared_ptr<HandleState> state_;  // the new handle's state (non-cached)
  const HandleState* plan_ = nullptr;   // state_ or cached_state_
  routing::LocalCounts counts_;
  std::vector<std::byte> record_scratch_;
};

void Dispatch::validate() {
  const auto& a = req_;
  if (!a.rejection.empty()) core::fail(ctx_, "{}", a.rejection);
  if (a.validate_more) a.validate_more(ctx_);
  cached_ = a.handle != nullptr;
  if (a.max_tokens < 0) core::fail(ctx_, "num_max_tokens_per_rank = {} is negative", a.max_tokens);
  if (cached_) {
    cached_state_ = &checked_handle(engine_, ctx_, *a.handle);
    const HandleFacts& h = cached_state_->facts;
    if (a.topk_idx.defined()) core::fail(ctx_, "topk_idx must not be given with a cached handle");
    if (a.cpu_sync) core::fail(ctx_, "do_cpu_sync = true is not allowed with a cached handle");
    if (a.cumulative_local_expert_recv_stats.defined())
      core::fail(ctx_, "cumulative_local_expert_recv_stats is not allowed with a cached handle");
    if (a.num_experts != 0 && a.num_experts != h.num_experts)
      core::fail(ctx_, "num_experts = {} differs from the handle's {}", a.num_experts, h.num_experts);
    if (a.expert_alignment != h.expert_alignment)
      core::fail(ctx_, "expert_alignment = {} differs from the handle's {}", a.expert_alignment, h.expert_alignment);
    if (a.max_tokens != 0 && a.max_tokens != h.num_max_tokens_per_rank)
      core::fail(ctx_, "num_max_tokens_per_rank = {} differs from the handle's {}", a.max_tokens,
                 h.num_max_tokens_per_rank);
    if (a.expand != h.do_expand) core::fail(ctx_, "do_expand = {} differs from the handle's {}", a.expand, h.do_expand);
    E_ = h.num_experts;
    k_ = h.num_topk;
    A_ = h.expert_alignment;
    T_ = h.num_max_tokens_per_rank;
    cpu_sync_ = false;
  } else {
    E_ = a.num_experts;
    A_ = a.expert_alignment;
    T_ = a.max_tokens;
    cpu_sync_ = a.cpu_sync;
  }
  expand_ = a.expand;

  // x and its scales.
  const TensorView& x = a.x;
  if (!x.defined()) core::fail(ctx_, "x is missing");
  x_dtype_ = x.dtype();
  fp8_ = x_dtype_ == DType::kFP8E4M3;
  // Rows travel as bytes: any 1-, 2- or 4-byte element type (bool and int64 are not payloads).
  if (x_dtype_ == DType::kBool || x_dtype_ == DType::kInt64)
    core::fail(ctx_, "x has dtype {}; the payload must have 1-, 2- or 4-byte elements (bfloat16, float16, float32, "
               "int8, int16, int32, uint8, or float8_e4m3fn with x_scales)", dtype_name(x_dtype_));
  core::expect_tensor(ctx_, "x", x, x_dtype_, {-1, -1});
  core::expect_rows_contiguous(ctx_, "x", x);
  N_ = core::int_size(ctx_, "x", x, 0);
  H_ = core::int_size(ctx_, "x", x, 1);
  if (T_ > 0 && x.size(0) > T_)
    core::fail(ctx_, "x has {} tokens, more than num_max_tokens_per_rank = {}", x.size(0), T_);
  if (engine_.config.fixed_hidden > 0 && H_ != engine_.config.fixed_hidden)
    core::fail(ctx_, "x has hidden size {}, the buffer was built for hidden = {}", H_, engine_.config.fixed_hidden);
  if (x.size(1) <= 0 || x.size(1) > kMaxHidden)
    core::fail(ctx_, "x has hidden size {}, expected 1 to {}", x.size(1), kMaxHidden);
  row_bytes_ = static_cast<std::int64_t>(H_) * static_cast<std::int64_t>(element_size(x_dtype_));
  if (row_bytes_ % kRowByteMultiple != 0)
    core::fail(ctx_, "x is {} [{}, {}]: a row is {} bytes, which must be a multiple of {} (hidden x element size, "
               "here hidden must be a multiple of {})", dtype_name(x_dtype_), N_, H_, row_bytes_, kRowByteMultiple,
               kRowByteMultiple / static_cast<std::int64_t>(element_size(x_dtype_)));
  if (fp8_) {
    if (!a.x_scales.defined()) core::fail(ctx_, "x is float8_e4m3fn but x_scales is missing");
    scale_dtype_ = a.x_scales.dtype();
    if (scale_dtype_ != DType::kFP32 && scale_dtype_ != DType::kInt32)
      core::fail(ctx_, "x_scales has dtype {}, expected float32 or int32 (packed UE8M0)", dtype_name(scale_dtype_));
    core::expect_tensor(ctx_, "x_scales", a.x_scales, scale_dtype_, {N_, -1});
    P_ = core::int_size(ctx_, "x_scales", a.x_scales, 1);
    if (P_ <= 0) core::fail(ctx_, "x_scales has {} columns, expected at least 1", P_);
  } else if (a.x_scales.defined()) {
    core::fail(ctx_, "x_scales is given but x is {} (scales go with float8_e4m3fn x only)", dtype_name(x_dtype_));
  }

  if (a.handle_hidden < 0) core::fail(ctx_, "the handle's hidden size {} is negative", a.handle_hidden);
  handle_hidden_ = a.handle_hidden > 0 ? a.handle_hidden : H_;

  // Routing.
  if (cached_) {
    const HandleFacts& h = cached_state_->facts;
    if (N_ != h.num_tokens) core::fail(ctx_, "x has {} tokens, the handle was made for {}", N_, h.num_tokens);
    if (handle_hidden_ != h.hidden)
      core::fail(ctx_, "x has hidden size {}, the handle was made for {}", handle_hidden_, h.hidden);
  } else {
    if (!a.topk_idx.defined()) core::fail(ctx_, "topk_idx is missing (required without a handle)");
    core::expect_tensor(ctx_, "topk_idx", a.topk_idx, DType::kInt64, {N_, -1});
    core::expect_rows_contiguous(ctx_, "topk_idx", a.topk_idx);
    k_ = core::int_size(ctx_, "topk_idx", a.topk_idx, 1);
  }
  if (k_ < 1 || k_ > kMaxTopk) core::fail(ctx_, "topk_idx has {} columns (k), expected 1 to {}", k_, kMaxTopk);
  if (E_ <= 0) core::fail(ctx_, "num_experts = {} must be positive", E_);
  if (E_ % engine_.num_ranks != 0)
    core::fail(ctx_, "num_experts = {} is not divisible by the {} ranks", E_, engine_.num_ranks);
  if (A_ < 1) core::fail(ctx_, "expert_alignment = {} must be at least 1", A_);
  El_ = E_ / engine_.num_ranks;
  has_weights_ = a.topk_weights.defined();
  if (has_weights_) {
    core::expect_tensor(ctx_, "topk_weights", a.topk_weights, DType::kFP32, {N_, k_});
    core::expect_rows_contiguous(ctx_, "topk_weights", a.topk_weights);
  }
  if (a.cumulative_local_expert_recv_stats.defined()) {
    core::expect_tensor(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats,
                        DType::kInt32, {El_});
    core::expect_contiguous(ctx_, "cumulative_local_expert_recv_stats", a.cumulative_local_expert_recv_stats);
  }
  if (a.zero_padding && !a.expand) core::fail(ctx_, "do_zero_padding = true requires do_expand = true");
  if (T_ == 0 && !cpu_sync_ && a.worst_rows <= 0)
    core::fail(ctx_, "outputs of worst-case size need num_max_tokens_per_rank or a worst-case row count");
  if (a.worst_rows < 0) core::fail(ctx_, "the worst-case row count {} is negative", a.worst_rows);
  engine_.check_num_qps(ctx_, a.num_qps);
  geo_ = routing::Geometry{engine_.num_ranks, E_, engine_.logical_scaleout};
  record_ = DispatchRecord(row_bytes_, fp8_ ? std::int64_t{P_} * 4 : 0, k_);
  if (T_ > 0) check_capacity(T_);

  // The routing of a new dispatch is checked here, before anything moves.
  if (!cached_)
    routing::validate_topk(ctx_, {a.topk_idx.data_as<const std::int64_t>(), a.topk_idx.stride(0), N_, k_}, E_);
}

// The row indices (int32) and the buffer must hold `tokens_bound` tokens per source.
void Dispatch::check_capacity(int tokens_bound) const {
  const std::int64_t worst =
      static_cast<std::int64_t>(tokens_bound) * engine_.num_ranks * std::min(k_, El_) + std::int64_t{A_} * El_;
  if (worst > (std::int64_t{1} << 31) - 1)
    core::fail(ctx_, "num_max_tokens_per_rank = {} x {} ranks x min(k, local experts) = {} rows exceed the int32 "
               "row index", tokens_bound, engine_.num_ranks, worst);
  const RegionSizes need = region_sizes(engine_.paths, tokens_bound, H_, row_bytes_, record_.scales_bytes, k_,
                                        engine_.config.allow_multiple_reduction);
  if (need.dispatch_bytes > engine_.config.pool_bytes) {
    const std::int64_t bytes = align_to(need.dispatch_bytes, engine_.config.pool_alignment);
    throw CapacityError(fmt::format("{}: this call needs {} bytes of buffer ({} tokens per rank, hidden = {}, k = {}), "
                                    "the buffer holds {}", ctx_, bytes, tokens_bound, H_, k_, engine_.config.pool_bytes),
                        bytes, engine_.config.pool_bytes);
  }
}

// Checks of what the agreement gathered: every rank computes the same answer, so a failure here is
// raised by all ranks alike.
void Dispatch::check_gathered(const std::vector<PeerTensors>& peers) {
  in_step_failure = true;
  if (T_ == 0) {
    for (const auto& p : peers) T_ = std::max(T_, p.num_tokens);
    T_ = std::max(T_, 1);
    check_capacity(T_);
  }
  if (req_.worst_rows > 0 && !cached_) {
    for (int d = 0; d < geo_.num_ranks; ++d)
      if (plan_->layout.rows_at(d) > req_.worst_rows)
        throw InvalidArgument(fmt::format("{}: rank {} receives {} tokens, more than the worst-case row count {}",
                                          ctx_, d, plan_->layout.rows_at(d), req_.worst_rows));
  }
  in_step_failure = false;
}

std::int64_t Dispatch::worst_rows() const {
  if (cached_) return cached_state_->facts.num_recv_tokens;
  if (req_.worst_rows > 0) return req_.worst_rows;
  return static_cast<std::int64_t>(T_) * engine_.num_ranks;
}

std::int64_t Dispatch::worst_expanded_rows() const {
  if (cached_) return cached_state_->facts.num_expanded_tokens;
  return routing::align_up(static_cast<std::int64_t>(engine_.num_ranks) * T_ * std::min(k_, El_) +
                               static_cast<std::int64_t>(A_ - 1) * El_, A_);
}

void Dispatch::allocate_outputs(std::int64_t rows, std::int64_t expanded_rows) {
  try {
    allocate_outputs_unnamed(rows, expanded_rows);
  } catch (const ResourceError& e) {
    throw ResourceError(fmt::format("{}: allocating the outputs ({} rows of hidden {}, {}) failed: {}", ctx_,
                                    expand_ ? expanded_rows : rows, H_, dtype_name(x_dtype_), e.what()));
  }
}

void Dispatch::allocate_outputs_unnamed(std::int64_t rows, std::int64_t expanded_rows) {
  const std::int64_t out_rows = expand_ ? expanded_rows : rows;
  result.recv_x = Tensor::empty({out_rows, H_}, x_dtype_);
  if (fp8_) {
    if (req_.col_major_scales) {
      const std::int64_t padded = routing::align_up(std::max<std::int64_t>(out_rows, 1), 4);
      Tensor storage = Tensor::empty({P_, padded}, scale_dtype_);
      const std::int64_t shape[] = {out_rows, P_};
      const std::int64_t strides[] = {1, padded};
      result.recv_x_scales = storage.with_view(TensorView(storage.data(), scale_dtype_, shape, strides));
    } else {
      result.recv_x_scales = Tensor::empty({out_rows, P_}, scale_dtype_);
    }
  }
  if (!expand_) result.recv_topk_idx = Tensor::empty({rows, k_}, DType::kInt64);
  if (has_weights_)
    result.recv_topk_weights = expand_ ? Tensor::empty({expanded_rows}, DType::kFP32) : Tensor::empty({rows, k_}, DType::kFP32);
  if (cached_) {
    result.handle = std::const_pointer_cast<EPHandle>(req_.handle);
  } else {
    result.handle->recv_src_metadata = Tensor::empty({rows, k_ + 2}, DType::kInt32);
  }
  if (req_.on_outputs_allocated) req_.on_outputs_allocated(result);
}

// The parts of a new handle known before any data moves, so that work queued behind an
// asynchronous dispatch (a combine) can be validated against it at once.
void Dispatch::start_handle() {
  state_ = std::make_shared<HandleState>();
  HandleState& s = *state_;
  s.engine_id = engine_.id;
  s.dispatch_sequence = sequence_;
  result.handle = std::make_shared<EPHandle>();
  EPHandle& h = *result.handle;
  h.do_expand = expand_;
  h.num_experts = E_;
  h.expert_alignment = A_;
  h.num_max_tokens_per_rank = T_;
  h.num_tokens = N_;
  h.num_topk = k_;
  h.hidden = handle_hidden_;
  if (!cpu_sync_) {
    h.num_recv_tokens = worst_rows();
    h.num_expanded_tokens = worst_expanded_rows();
  }
  s.facts = {.do_expand = expand_, .num_experts = E_, .expert_alignment = A_, .num_max_tokens_per_rank = T_,
             .num_tokens = N_, .num_topk = k_, .hidden = handle_hidden_, .num_recv_tokens = h.num_recv_tokens,
             .num_expanded_tokens = h.num_expanded_tokens};
  h.state = state_;
}

PeerTensors Dispatch::my_tensors() const {
  PeerTensors p;
  p.x = static_cast<const std::byte*>(req_.x.data());
  p.x_row_bytes = req_.x.stride(0) * static_cast<std::int64_t>(element_size(x_dtype_));
  if (fp8_) {
    p.scales = static_cast<const std::byte*>(req_.x_scales.data());
    p.scale_stride[0] = req_.x_scales.stride(0);
    p.scale_stride[1] = req_.x_scales.stride(1);
  }
  if (has_weights_) {
    p.weights = req_.topk_weights.data_as<const float>();
    p.weights_row = req_.topk_weights.stride(0);
  }
  const Tensor& topk = plan_->topk;
  p.topk = topk.data_as<const std::int64_t>();
  p.topk_row = topk.defined() ? topk.stride(0) : k_;
  p.num_tokens = N_;
  return p;
}

void Dispatch::run(const std::function<void()>& outputs_ready) {
  // Everything before the agreement reports failure through it, so that peers are not left
  // waiting for a rank that threw.
  std::exception_ptr error = local_error;
  if (!error) {
    error = core::attempt(ctx_, [&] {
      engine_.wait_for_event(previous_event, ctx_, "previous_event");
      workers_ = req_.workers(E_, k_);
      engine_.set_workers(workers_);
      core::trace(core::Subsys::kColl, "{}: {} tokens, hidden {}, {} experts, top-{}, {} workers{}", ctx_, N_, H_, E_,
                  k_, workers_, cached_ ? ", cached layout" : "");
      engine_.limit_inflight(req_.num_qps);
      if (cached_) {
        plan_ = cached_state_;
      } else {
        plan_ = state_.get();
        state_->topk =
            req_.do_handle_copy ? Tensor::empty({N_, k_}, DType::kInt64) : Tensor().with_view(req_.topk_idx);
        if (req_.do_handle_copy)
          for (int t = 0; t < N_; ++t)
            std::memcpy(state_->topk.data_as<std::int64_t>() + std::int64_t{t} * k_,
                        req_.topk_idx.data_as<const std::int64_t>() + t * req_.topk_idx.stride(0),
                        sizeof(std::int64_t) * k_);
        routing::count_local({state_->topk.data_as<const std::int64_t>(), state_->topk.stride(0), N_, k_}, geo_,
                             counts_);
        if (!req_.expert_counts.empty()) counts_.per_expert = req_.expert_counts;
      }
    });
  }

  // Agreement: arguments, signature, published tensors and (new dispatch) counts.
  std::vector<std::byte> payload(sizeof(PeerTensors));
  PeerTensors mine;
  if (!error) {
    error = core::attempt(ctx_, [&] {
      mine = my_tensors();
      const PeerTensors shared =
          share_tensors(engine_, mine,
                        {.x = view_extent(req_.x),
                         .scales = fp8_ ? view_extent(req_.x_scales) : 0,
                         .weights = has_weights_ ? view_extent(req_.topk_weights) : 0,
                         .topk = view_extent(plan_->topk)});
      std::memcpy(payload.data(), &shared, sizeof shared);
      if (!cached_) {
        for (const auto* v : {&counts_.per_rank, &counts_.per_expert, &counts_.per_node}) {
          const auto* b = reinterpret_cast<const std::byte*>(v->data());
          payload.insert(payload.end(), b, b + v->size() * sizeof(std::int32_t));
        }
      }
    });
  }
  comm::Agreement agreement(ctx_, req_.operation);
  agreement.local_error(error)
      .field("operation number", static_cast<std::int64_t>(sequence_))
      .field("cached (handle given)", cached_)
      .field("handle's dispatch number", cached_state_ ? static_cast<std::int64_t>(cached_state_->dispatch_sequence) : 0)
      .field("num_max_tokens_per_rank", T_)
      .field("num_experts", E_)
      .field("num_topk", k_)
      .field("hidden", H_)
      .field("handle's hidden", handle_hidden_)
      .field("x dtype", x_dtype_)
      .field("x_scales columns", P_)
      .field("x_scales dtype", fp8_ ? std::optional(scale_dtype_) : std::nullopt)
      .field("topk_weights given", has_weights_)
      .field("expert_alignment", A_)
      .field("do_expand", expand_);
  std::vector<std::span<const std::byte>> payloads;
  try {
    payloads = agreement.exchange(engine_.transport(), comm::Scope::kWorld, engine_.wait("dispatch: agreement"), payload);
  } catch (...) {
    in_step_failure = agreement.gathered();
    throw;
  }

  const std::size_t counts_bytes =
      cached_ ? 0 : sizeof(std::int32_t) * static_cast<size_t>(geo_.num_ranks + geo_.num_experts + geo_.num_nodes);
  std::vector<PeerTensors> peers(payloads.size());
  for (std::size_t r = 0; r < payloads.size(); ++r) {
    if (payloads[r].size() != sizeof(PeerTensors) + counts_bytes)
      throw StateError(fmt::format("{}: rank {} published {} bytes, expected {}", ctx_, r, payloads[r].size(),
                                   sizeof(PeerTensors) + counts_bytes));
    std::memcpy(&peers[r], payloads[r].data(), sizeof(PeerTensors));
  }
  resolve_tensors(engine_, peers, mine);
  if (!cached_) {
    state_->layout.reset(geo_, A_);
    const int R = geo_.num_ranks, E = geo_.num_experts, G = geo_.num_nodes;
    for (int s = 0; s < R; ++s) {
      const std::byte* c = payloads[static_cast<size_t>(s)].data() + sizeof(PeerTensors);
      std::memcpy(state_->layout.per_rank_counts(s), c, sizeof(std::int32_t) * R);
      std::memcpy(state_->layout.per_expert_counts(s), c + sizeof(std::int32_t) * R, sizeof(std::int32_t) * E);
      std::memcpy(state_->layout.per_node_counts(s), c + sizeof(std::int32_t) * (R + E), sizeof(std::int32_t) * G);
    }
    state_->layout.finish();
    state_->source_tokens.resize(peers.size());
    for (std::size_t r = 0; r < peers.size(); ++r) state_->source_tokens[r] = peers[r].num_tokens;
  }
  check_gathered(peers);
  if (!cached_) {
    plan_sources();
    comm::PeerReads reads(engine_.transport(), "dispatch: receive plan");  // node peers' top-k ids
    plan_receive_local(peers);
  }
  if (!result.recv_x.defined()) {  // not allocated early by an asynchronous submission
    if (outputs_known_early()) {
      allocate_outputs_early();
    } else {
      allocate_outputs(plan_->layout.rows_at(engine_.rank), plan_->layout.expanded_rows_at(engine_.rank));
    }
  }
  if (!cached_) fill_handle();
  outputs_ready();

  engine_.wait_for_event(req_.previous_event_before_epilogue, ctx_, "previous_event_before_epilogue");
  put_records(peers);
  wait_records();
  if (!cached_ && engine_.paths.hybrid()) plan_forwarding();
  if (engine_.paths.hybrid()) engine_.transport().barrier(comm::Scope::kNode, engine_.wait("dispatch: forwarded records ready"));
  if (!cached_ && (engine_.paths.hybrid() || engine_.paths.direct_remote())) plan_receive_remote();
  {
    comm::PeerReads reads(engine_.transport(), "dispatch: copy");  // node peers' x, scales and weights
    copy_rows(peers);
  }
  if (req_.zero_padding) zero_padding();
  if (req_.cumulative_local_expert_recv_stats.defined()) {
    auto* stats = req_.cumulative_local_expert_recv_stats.data_as<std::int32_t>();
    for (int i = 0; i < El_; ++i) stats[i] += plan_->layout.expert_total(engine_.rank * El_ + i);
  }
  if (req_.on_rows_received) req_.on_rows_received(result);
  engine_.transport().barrier(comm::Scope::kNode, engine_.wait("dispatch: exit"));
  if (!cached_ && req_.on_complete) req_.on_complete(*result.handle);
}

// Rows of my tokens at their destinations, and forwarder slots (hybrid).
void Dispatch::plan_sources() {
  HandleState& s = *state_;
  const std::size_t nk = static_cast<std::size_t>(N_) * static_cast<std::size_t>(k_);
  s.dst_row.resize(nk);
  s.dst_expanded.resize(nk);
  routing::RowAssigner assigner;
  assigner.start(s.layout, engine_.rank);
  const std::int64_t* topk = s.topk.data_as<const std::int64_t>();
  for (int t = 0; t < N_; ++t)
    assigner.next(topk + t * s.topk.stride(0), k_, [](int) { return true; }, &s.dst_row[static_cast<size_t>(t) * k_],
                  &s.dst_expanded[static_cast<size_t>(t) * k_]);
  if (engine_.paths.hybrid()) {
    s.node_slot.assign(nk, -1);
    std::vector<std::int32_t> next(static_cast<size_t>(geo_.num_nodes), 0);
    std::array<routing::Destination, routing::kMaxTopk> nodes;
    for (int t = 0; t < N_; ++t) {
      const int n = routing::token_nodes(topk + t * s.topk.stride(0), k_, geo_, nodes);
      for (int i = 0; i < n; ++i)
        s.node_slot[static_cast<size_t>(t) * k_ + nodes[static_cast<size_t>(i)].master_lane] =
            next[static_cast<size_t>(nodes[static_cast<size_t>(i)].target)]++;
    }
  }
}

// Which rows this rank receives, from where, in the fixed order. Rows from ranks of this node
// are planned from their published top-k ids; rows from other nodes once their records arrived.
void Dispatch::accept_token(routing::RowAssigner& assigner, int source, std::int32_t index, std::int32_t token,
                            const std::int64_t* ids) {
  HandleState& s = *state_;
  const int me = engine_.rank;
  std::int32_t row_at_lane[routing::kMaxTopk], expanded_at_lane[routing::kMaxTopk];
  assigner.next(ids, k_, [me](int r) { return r == me; }, row_at_lane, expanded_at_lane);
  for (int j = 0; j < k_; ++j) {
    if (row_at_lane[j] < 0) continue;
    const auto row = static_cast<std::size_t>(row_at_lane[j]);
    s.rows[row] = {source, index};
    s.row_token[row] = token;
    s.master_lane[row] = j;
    for (int l = 0; l < k_; ++l) {
      const bool local = ids[l] >= 0 && geo_.rank_of_expert(ids[l]) == me;
      s.local_ids[row * k_ + l] = local ? static_cast<std::int32_t>(ids[l] - std::int64_t{me} * El_) : -1;
      if (expand_) s.expanded_rows[row * k_ + l] = expanded_at_lane[l];
    }
  }
}

void Dispatch::plan_receive_local(const std::vector<PeerTensors>& peers) {
  HandleState& s = *state_;
  const int me = engine_.rank;
  const std::int32_t rows = s.layout.rows_at(me);
  s.rows.resize(static_cast<size_t>(rows));
  s.row_token.resize(static_cast<size_t>(rows));
  s.master_lane.resize(static_cast<size_t>(rows));
  s.local_ids.resize(static_cast<size_t>(rows) * k_);
  if (expand_) s.expanded_rows.resize(static_cast<size_t>(rows) * k_);
  routing::RowAssigner assigner;
  for (int src = 0; src < geo_.num_ranks; ++src) {
    if (!engine_.same_node(src) || s.layout.count(src, me) == 0) continue;
    assigner.start(s.layout, src);
    const PeerTensors& p = peers[static_cast<size_t>(src)];
    for (int t = 0; t < p.num_tokens; ++t) accept_token(assigner, src, t, t, p.topk + t * p.topk_row);
  }
}

void Dispatch::plan_receive_remote() {
  const auto& layout = state_->layout;
  const int me = engine_.rank;
  routing::RowAssigner assigner;
  std::int64_t ids[routing::kMaxTopk];
  for (int src = 0; src < geo_.num_ranks; ++src) {
    if (engine_.same_node(src) || layout.count(src, me) == 0) continue;
    assigner.start(layout, src);
    const std::int32_t records =
        engine_.paths.hybrid() ? layout.node_count(src, engine_.routing_node_of(me)) : layout.count(src, me);
    for (std::int32_t slot = 0; slot < records; ++slot) {
      const std::byte* rec = region_record(src, slot);
      const auto* rec_ids = reinterpret_cast<const std::int32_t*>(rec + record_.ids_offset);
      for (int j = 0; j < k_; ++j) ids[j] = rec_ids[j];
      std::int32_t token;
      std::memcpy(&token, rec + record_.token_offset, sizeof token);
      accept_token(assigner, src, slot, token, ids);
    }
  }
}

void Dispatch::fill_handle() {
  HandleState& s = *state_;
  EPHandle& h = *result.handle;
  const auto& layout = s.layout;
  const int me = engine_.rank, SU = engine_.logical_scaleup;
  h.num_sms = workers_;
  // Fields known at the start (start_handle) are not written again: a combine queued behind an
  // asynchronous dispatch reads them meanwhile.
  if (s.facts.num_max_tokens_per_rank != T_) h.num_max_tokens_per_rank = s.facts.num_max_tokens_per_rank = T_;
  s.max_tokens = T_;
  h.topk_idx = s.topk;
  if (cpu_sync_) {
    h.num_recv_tokens = s.facts.num_recv_tokens = layout.rows_at(me);
    h.num_expanded_tokens = s.facts.num_expanded_tokens = layout.expanded_rows_at(me);
  }
  h.psum_num_recv_tokens_per_scaleup_rank = Tensor::zeros({SU}, DType::kInt32);
  auto* region = h.psum_num_recv_tokens_per_scaleup_rank.data_as<std::int32_t>();
  for (int src = 0; src < geo_.num_ranks; ++src) region[src % SU] += layout.count(src, me);
  for (int r = 1; r < SU; ++r) region[r] += region[r - 1];
  h.psum_num_recv_tokens_per_expert = Tensor::empty({El_}, DType::kInt32);
  h.num_unaligned_recv_tokens_per_expert = Tensor::empty({El_}, DType::kInt32);
  std::int32_t psum = 0;
  for (int i = 0; i < El_; ++i) {
    const int e = me * El_ + i;
    const std::int32_t count = layout.expert_total(e);
    const auto aligned = static_cast<std::int32_t>(routing::align_up(count, A_));
    h.num_unaligned_recv_tokens_per_expert.data_as<std::int32_t>()[i] = count;
    psum += aligned;
    h.psum_num_recv_tokens_per_expert.data_as<std::int32_t>()[i] = expand_ ? layout.expert_start(e) + count : psum;
    if (cpu_sync_) h.num_recv_tokens_per_expert_list.push_back(aligned);
  }
  h.dst_buffer_slot_idx = Tensor::empty({N_, k_}, DType::kInt32);
  auto* slot = h.dst_buffer_slot_idx.data_as<std::int32_t>();
  const std::int64_t* topk = s.topk.data_as<const std::int64_t>();
  for (int t = 0; t < N_; ++t)
    for (int j = 0; j < k_; ++j) {
      const std::size_t i = static_cast<size_t>(t) * k_ + j;
      const std::int32_t row = s.dst_row[i];
      slot[i] = row < 0 ? -1 : me * T_ + (row - layout.row_base(me, geo_.rank_of_expert(topk[t * s.topk.stride(0) + j])));
    }
}

std::byte* Dispatch::region_record(int source, std::int32_t slot) {
  if (engine_.paths.hybrid()) {
    const int forwarder = engine_.node_of(engine_.rank) * engine_.physical.num_scaleup + source % engine_.physical.num_scaleup;
    return engine_.memory().node_peer(forwarder) + region_offset(source, slot);
  }
  return engine_.memory().local() + region_offset(source, slot);
}

// Scale-out: one record per (token, remote destination rank) in direct mode, per (token,
// remote destination node) in hybrid mode, then one signal per peer that got records.
void Dispatch::put_records(const std::vector<PeerTensors>& peers) {
  if (!engine_.paths.hybrid() && !engine_.paths.direct_remote()) return;
  const HandleState& s = *plan_;
  const auto& layout = s.layout;
  const int me = engine_.rank, R = geo_.num_ranks;
  const PeerTensors& mine = peers[static_cast<size_t>(me)];
  const std::int64_t* topk = s.topk.data_as<const std::int64_t>();
  record_scratch_.resize(static_cast<size_t>(record_.bytes - record_.scales_offset));
  std::byte* meta = record_scratch_.data();
  auto fill_meta = [&](int t) {
    if (fp8_) {
      auto* out = reinterpret_cast<std::uint32_t*>(meta);
      const auto* in = reinterpret_cast<const std::uint32_t*>(mine.scales) + t * mine.scale_stride[0];
      for (int p = 0; p < P_; ++p) out[p] = in[p * mine.scale_stride[1]];
    }
    auto* ids = reinterpret_cast<std::int32_t*>(meta + (record_.ids_offset - record_.scales_offset));
    auto* weights = reinterpret_cast<float*>(meta + (record_.weights_offset - record_.scales_offset));
    for (int j = 0; j < k_; ++j) {
      ids[j] = static_cast<std::int32_t>(topk[t * s.topk.stride(0) + j]);
      weights[j] = has_weights_ ? mine.weights[t * mine.weights_row + j] : 0.0f;
    }
    std::memcpy(meta + (record_.token_offset - record_.scales_offset), &t, sizeof t);
  };
  auto put = [&](int peer, std::int64_t offset, int t) {
    engine_.transport().put(peer, engine_.memory(), static_cast<std::size_t>(offset), mine.x + t * mine.x_row_bytes,
                          static_cast<std::size_t>(row_bytes_));
    engine_.transport().put(peer, engine_.memory(), static_cast<std::size_t>(offset + record_.scales_offset), meta,
                          record_scratch_.size());
  };
  std::vector<bool> signalled(static_cast<size_t>(R), false);
  for (int t = 0; t < N_; ++t) {
    bool filled = false;
    for (int j = 0; j < k_; ++j) {
      const std::size_t i = static_cast<size_t>(t) * k_ + j;
      int peer = -1;
      std::int32_t slot = -1;
      if (engine_.paths.hybrid()) {
        if (s.node_slot[i] < 0) continue;
        const int node = geo_.node_of_rank(geo_.rank_of_expert(topk[t * s.topk.stride(0) + j]));
        if (node == engine_.routing_node_of(me)) continue;
        peer = node * engine_.logical_scaleup + me % engine_.logical_scaleup;
        slot = s.node_slot[i];
      } else {
        if (s.dst_row[i] < 0) continue;
        const int d = geo_.rank_of_expert(topk[t * s.topk.stride(0) + j]);
        if (engine_.same_node(d)) continue;
        peer = d;
        slot = s.dst_row[i] - layout.row_base(me, d);
      }
      if (!filled) fill_meta(t);
      filled = true;
      put(peer, region_offset(me, slot), t);
      signalled[static_cast<size_t>(peer)] = true;
    }
  }
  for (int peer = 0; peer < R; ++peer)
    if (signalled[static_cast<size_t>(peer)]) engine_.transport().signal(peer);
}

// Waits for the records addressed to this rank (direct) or forwarded through it (hybrid).
void Dispatch::wait_records() {
  const auto& layout = plan_->layout;
  const int me = engine_.rank;
  std::vector<int> sources;
  std::vector<std::uint64_t> targets;
  if (engine_.paths.hybrid()) {
    const int my_node = engine_.routing_node_of(me), SU = engine_.logical_scaleup;
    for (int node = 0; node < geo_.num_nodes; ++node) {
      const int src = node * SU + me % SU;
      if (node == my_node || layout.node_count(src, my_node) == 0) continue;
      sources.push_back(src);
      targets.push_back(engine_.expect_signal(src));
    }
  } else if (engine_.paths.direct_remote()) {
    for (int src = 0; src < geo_.num_ranks; ++src) {
      if (engine_.same_node(src) || layout.count(src, me) == 0) continue;
      sources.push_back(src);
      targets.push_back(engine_.expect_signal(src));
    }
  }
  if (!sources.empty()) engine_.transport().wait_signals(sources, targets, engine_.wait("dispatch: scale-out records"));
}

// Hybrid: the rows, at this node's ranks, of every token this rank forwards (used by combine).
void Dispatch::plan_forwarding() {
  HandleState& s = *state_;
  const int me = engine_.rank, my_node = engine_.routing_node_of(me), SU = engine_.logical_scaleup;
  s.forward.assign(static_cast<size_t>(geo_.num_nodes), ForwardPlan{});
  routing::RowAssigner assigner;
  std::int64_t ids[routing::kMaxTopk];
  for (int node = 0; node < geo_.num_nodes; ++node) {
    const int src = node * SU + me % SU;
    if (node == my_node) continue;
    ForwardPlan& f = s.forward[static_cast<size_t>(node)];
    f.source = src;
    f.count = s.layout.node_count(src, my_node);
    f.token.resize(static_cast<size_t>(f.count));
    f.ids.resize(static_cast<size_t>(f.count) * k_);
    f.rows.resize(static_cast<size_t>(f.count) * k_);
    f.expanded.resize(static_cast<size_t>(f.count) * k_);
    assigner.start(s.layout, src);
    for (std::int32_t slot = 0; slot < f.count; ++slot) {
      const std::byte* rec = engine_.memory().local() + region_offset(src, slot);
      const auto* rec_ids = reinterpret_cast<const std::int32_t*>(rec + record_.ids_offset);
      for (int j = 0; j < k_; ++j) ids[j] = rec_ids[j];
      std::memcpy(&f.token[static_cast<size_t>(slot)], rec + record_.token_offset, sizeof(std::int32_t));
      std::copy(ids, ids + k_, f.ids.begin() + static_cast<std::ptrdiff_t>(slot) * k_);
      assigner.next(ids, k_, [&](int r) { return engine_.routing_node_of(r) == my_node; },
                    &f.rows[static_cast<size_t>(slot) * k_], &f.expanded[static_cast<size_t>(slot) * k_]);
    }
  }
}

void Dispatch::copy_rows(const std::vector<PeerTensors>& peers) {
  const bool fresh = !cached_;
  const HandleState& plan = *plan_;
  const auto rows = static_cast<std::int64_t>(plan.rows.size());
  std::byte* out_x = static_cast<std::byte*>(result.recv_x.data());
  auto* out_sf = fp8_ ? result.recv_x_scales.data_as<std::uint32_t>() : nullptr;
  const std::int64_t sf_row = fp8_ ? result.recv_x_scales.stride(0) : 0, sf_col = fp8_ ? result.recv_x_scales.stride(1) : 0;
  auto* out_ids = expand_ ? nullptr : result.recv_topk_idx.data_as<std::int64_t>();
  auto* out_w = has_weights_ ? result.recv_topk_weights.data_as<float>() : nullptr;
  std::int32_t* metadata = fresh ? result.handle->recv_src_metadata.data_as<std::int32_t>() : nullptr;
  const int meta_cols = k_ + 2;

  engine_.pool().parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](std::int64_t task) {
    const std::int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (std::int64_t i = task * kRowsPerTask; i < end; ++i) {
      const RowSource src = plan.rows[static_cast<size_t>(i)];
      const std::byte* payload;
      const std::uint32_t* scales = nullptr;
      std::int64_t scale_step = 1;
      const float* weights = nullptr;
      const std::int32_t token = plan.row_token[static_cast<size_t>(i)];
      if (engine_.same_node(src.source)) {
        const PeerTensors& p = peers[static_cast<size_t>(src.source)];
        payload = p.x + src.index * p.x_row_bytes;
        if (fp8_) {
          scales = reinterpret_cast<const std::uint32_t*>(p.scales) + src.index * p.scale_stride[0];
          scale_step = p.scale_stride[1];
        }
        if (has_weights_) weights = p.weights + src.index * p.weights_row;
      } else {
        const std::byte* rec = region_record(src.source, src.index);
        payload = rec;
        scales = reinterpret_cast<const std::uint32_t*>(rec + record_.scales_offset);
        weights = reinterpret_cast<const float*>(rec + record_.weights_offset);
      }
      auto copy_scales = [&](std::int64_t out_row) {
        if (!fp8_) return;
        std::uint32_t* dst = out_sf + out_row * sf_row;
        if (scale_step == 1 && sf_col == 1) {
          std::memcpy(dst, scales, sizeof(std::uint32_t) * static_cast<size_t>(P_));
        } else {
          for (int p = 0; p < P_; ++p) dst[p * sf_col] = scales[p * scale_step];
        }
      };
      const std::int32_t* local = &plan.local_ids[static_cast<size_t>(i) * k_];
      if (expand_) {
        const std::int32_t* expanded = &plan.expanded_rows[static_cast<size_t>(i) * k_];
        for (int j = 0; j < k_; ++j) {
          if (expanded[j] < 0) continue;
          core::copy_bytes(out_x + expanded[j] * row_bytes_, payload, static_cast<size_t>(row_bytes_));
          copy_scales(expanded[j]);
          if (out_w) out_w[expanded[j]] = weights[j];
        }
      } else {
        core::copy_bytes(out_x + i * row_bytes_, payload, static_cast<size_t>(row_bytes_));
        copy_scales(i);
        for (int j = 0; j < k_; ++j) out_ids[i * k_ + j] = local[j];
        if (out_w) {
          std::memcpy(out_w + i * k_, weights, sizeof(float) * static_cast<size_t>(k_));
          if (req_.zero_nonlocal_weights)
            for (int j = 0; j < k_; ++j)
              if (local[j] < 0) out_w[i * k_ + j] = 0.0f;
        }
      }
      if (metadata) {
        std::int32_t* m = metadata + i * meta_cols;
        m[0] = src.source * T_ + token;
        m[1] = src.source * k_ + plan.master_lane[static_cast<size_t>(i)];
        for (int j = 0; j < k_; ++j) m[2 + j] = expand_ ? plan.expanded_rows[static_cast<size_t>(i) * k_ + j] : -1;
      }
    }
  });
  // Rows past the real count (worst-case shapes) carry no data; mark their metadata.
  if (metadata) {
    const std::int64_t allocated = result.handle->recv_src_metadata.size(0);
    std::fill(metadata + rows * meta_cols, metadata + allocated * meta_cols, -1);
  }
  if (!expand_ && rows < result.recv_topk_idx.size(0))
    std::fill(out_ids + rows * k_, out_ids + result.recv_topk_idx.size(0) * k_, -1);
}

void Dispatch::zero_padding() {
  const auto& layout = plan_->layout;
  const int me = engine_.rank;
  for (int i = 0; i < El_; ++i) {
    const int e = me * El_ + i;
    const std::int64_t begin = layout.expert_start(e) + layout.expert_total(e);
    const std::int64_t end = layout.expert_start(e) + routing::align_up(layout.expert_total(e), A_);
    for (std::int64_t r = begin; r < end; ++r) {
      std::memset(static_cast<std::byte*>(result.recv_x.data()) + r * row_bytes_, 0, static_cast<size_t>(row_bytes_));
      if (fp8_)
        for (int p = 0; p < P_; ++p)
          result.recv_x_scales.data_as<std::uint32_t>()[r * result.recv_x_scales.stride(0) + p * result.recv_x_scales.stride(1)] = 0;
      if (has_weights_) result.recv_topk_weights.data_as<float>()[r] = 0.0f;
    }
  }
}

}  // namespace

std::shared_ptr<DispatchOperation> make_dispatch(Engine& engine, DispatchRequest request, std::uint64_t sequence) {
  return std::make_shared<Dispatch>(engine, std::move(request), sequence);
}

}  // namespace moe_ep::engine
