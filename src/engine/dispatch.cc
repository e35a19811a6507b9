// The dispatch operation of both buffer generations: its steps around the agreement. See
// engine.hh for the data paths and docs/semantics.md for the shapes and order of the outputs.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "comm/agreement.hh"
#include "core/arith.hh"
#include "core/env_vars.hh"
#include "core/failure.hh"
#include "core/host_allocator.hh"
#include "core/log.hh"
#include "engine/dispatch_op.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine {
namespace dispatch_detail {

Dispatch::Dispatch(Engine& engine, DispatchRequest request, std::uint64_t sequence)
    : DispatchOperation(engine.facts.context(request.operation), request.operation, "dispatch: agreement"),
      engine_(engine),
      req_(std::move(request)),
      sequence_(sequence),
      ctx_(context()) {}

void Dispatch::validate() {
  push_ = engine_.transport().offers_windows() && env::get(env::kDispatchPush);
  check_arguments();
  capacity_outputs_ = push_ && !cached_ && cpu_sync_ && shape_.max_tokens > 0 && !expand_ &&
                      !(fp8_ && req_.generation.col_major_scales) && !req_.allocate_unpacked_outputs &&
                      worst_output_bytes() <= kCapacityOutputBytes;
  if (!cached_) start_handle();
}

// Bytes of compact outputs with worst_rows() rows: x, scales, ids, weights and metadata.
std::int64_t Dispatch::worst_output_bytes() const {
  const std::int64_t k = shape_.topk;
  const std::int64_t row = row_bytes_ + (fp8_ ? 4 * std::int64_t{shape_.scale_columns} : 0) + 8 * k +
                           (has_weights_ ? 4 * k : 0) + 4 * (k + 2);
  return worst_rows() > kCapacityOutputBytes / row ? kCapacityOutputBytes + 1 : worst_rows() * row;
}

routing::PlanningRank Dispatch::planning_rank() const {
  return {.rank = engine_.facts.rank, .physical_scaleup = engine_.facts.physical.num_scaleup, .hybrid = engine_.facts.paths.hybrid(),
          .expand = expand_};
}

namespace {

// An uninitialised contiguous tensor in memory node peers in other processes can map and write
// (core::allocate_host_shared).
Tensor empty_shared(std::initializer_list<std::int64_t> shape, DType dtype) {
  std::size_t bytes = element_size(dtype);
  for (const std::int64_t d : shape) bytes *= static_cast<std::size_t>(d);
  std::shared_ptr<void> storage = core::allocate_host_shared(bytes);
  void* base = storage.get();
  return Tensor::adopt(std::move(storage), base, bytes).with_view(TensorView(base, dtype, shape));
}

}  // namespace

void Dispatch::allocate_outputs(std::int64_t rows, std::int64_t expanded_rows) {
  try {
    allocate_outputs_unnamed(rows, expanded_rows);
  } catch (const ResourceError& e) {
    throw ResourceError(fmt::format("{}: allocating the outputs ({} rows of hidden {}, {}) failed: {}", ctx_,
                                    expand_ ? expanded_rows : rows, shape_.hidden, dtype_name(x_dtype_), e.what()));
  }
}

void Dispatch::allocate_outputs_unnamed(std::int64_t rows, std::int64_t expanded_rows) {
  // Node peers in other processes write the outputs of a push: memory they can map.
  const bool shared = push_ && !engine_.transport().ranks_share_address_space();
  auto output = [shared](std::initializer_list<std::int64_t> shape, DType dtype) {
    return shared ? empty_shared(shape, dtype) : Tensor::empty(shape, dtype);
  };
  const std::int64_t out_rows = expand_ ? expanded_rows : rows;
  result.recv_x = output({out_rows, shape_.hidden}, x_dtype_);
  if (fp8_) {
    const std::int64_t S = shape_.scale_columns;
    if (req_.generation.col_major_scales && stride_ > 0) {
      const std::int64_t El = out_rows / stride_;
      scale_layout_ = {.block = stride_, .columns = S};
      Tensor storage = output({El, S, stride_}, scale_dtype_);
      const std::int64_t shape[] = {El, stride_, S};
      const std::int64_t strides[] = {stride_ * S, 1, stride_};
      result.recv_x_scales = storage.with_view(TensorView(storage.data(), scale_dtype_, shape, strides));
    } else if (req_.generation.col_major_scales) {
      const std::int64_t padded = core::round_up(std::max<std::int64_t>(out_rows, 1), 4);
      scale_layout_ = {.block = padded, .columns = S};
      Tensor storage = output({S, padded}, scale_dtype_);
      const std::int64_t shape[] = {out_rows, S};
      const std::int64_t strides[] = {1, padded};
      result.recv_x_scales = storage.with_view(TensorView(storage.data(), scale_dtype_, shape, strides));
    } else {
      scale_layout_ = {.block = 1, .columns = S};
      result.recv_x_scales = output({out_rows, S}, scale_dtype_);
    }
  }
  if (!expand_) result.recv_topk_idx = output({rows, shape_.topk}, DType::kInt64);
  if (has_weights_)
    result.recv_topk_weights =
        expand_ ? output({expanded_rows}, DType::kFP32) : output({rows, shape_.topk}, DType::kFP32);
  if (cached_) {
    result.handle = std::const_pointer_cast<EPHandle>(req_.handle);
  } else {
    result.handle->recv_src_metadata = output({rows, shape_.topk + 2}, DType::kInt32);
  }
  if (req_.allocate_unpacked_outputs) req_.allocate_unpacked_outputs(result);
}

// The first `rows` rows of outputs allocated with room for more (capacity_outputs_: compact,
// row-major scales), over the same storage.
void Dispatch::narrow_outputs(std::int64_t rows) {
  auto first_rows = [rows](const Tensor& t) {
    if (!t.defined()) return t;
    std::vector<std::int64_t> shape(t.shape().begin(), t.shape().end());
    shape[0] = rows;
    return t.with_view(TensorView(t.data(), t.dtype(), shape, t.strides()));
  };
  result.recv_x = first_rows(result.recv_x);
  result.recv_x_scales = first_rows(result.recv_x_scales);
  result.recv_topk_idx = first_rows(result.recv_topk_idx);
  result.recv_topk_weights = first_rows(result.recv_topk_weights);
  result.handle->recv_src_metadata = first_rows(result.handle->recv_src_metadata);
}

// The parts of a new handle known before any data moves, so that work queued behind an
// asynchronous dispatch (a combine) can be validated against it at once.
void Dispatch::start_handle() {
  state_ = std::make_shared<HandleState>();
  HandleState& s = *state_;
  s.engine_id = engine_.facts.id;
  s.dispatch_sequence = sequence_;
  result.handle = std::make_shared<EPHandle>();
  EPHandle& h = *result.handle;
  s.facts.do_expand = expand_;
  s.facts.num_experts = shape_.experts;
  s.facts.expert_alignment = shape_.alignment;
  s.facts.num_max_tokens_per_rank = shape_.max_tokens;
  s.facts.num_tokens = shape_.tokens;
  s.facts.num_topk = shape_.topk;
  s.facts.hidden = handle_hidden_;
  s.facts.expert_stride = stride_;
  if (!cpu_sync_) {  // worst-case counts; CPU sync writes the exact ones (fill_handle)
    s.facts.num_recv_tokens = worst_rows();
    s.facts.num_expanded_tokens = worst_expanded_rows();
  }
  core::v2::write_handle_fields(h, s.facts);
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
  p.topk_row = topk.defined() ? topk.stride(0) : shape_.topk;
  p.listed = listed_.defined() ? reinterpret_cast<const routing::ListedToken*>(listed_.data()) : nullptr;
  p.num_tokens = shape_.tokens;
  return p;
}

std::vector<std::byte> Dispatch::prepare() {
  prepare_routing();
  return publish();
}

void Dispatch::run(const std::vector<std::span<const std::byte>>& payloads, const std::function<void()>& outputs_ready) {
  const std::vector<PeerTensors> peers = unpack_peers(payloads);
  if (!cached_) take_layout(payloads, peers);
  check_gathered(peers);
  if (!cached_) plan_local(peers);
  make_outputs();
  if (!cached_) fill_handle();
  outputs_ready();

  engine_.wait_for_event(req_.previous_event_before_epilogue, ctx_, "previous_event_before_epilogue");
  move_rows(peers);
  finish();
}

// Workers, and the top-k ids and local counts of a new dispatch.
void Dispatch::prepare_routing() {
  const int N = shape_.tokens, k = shape_.topk;
  engine_.wait_for_event(req_.previous_event, ctx_, "previous_event");
  workers_ = req_.workers(shape_.experts, k);
  engine_.set_workers(workers_);
  core::trace(core::Subsys::kColl, "{}: {} tokens, hidden {}, {} experts, top-{}, {} workers{}", ctx_, N,
              shape_.hidden, shape_.experts, k, workers_, cached_ ? ", cached layout" : "");
  engine_.limit_inflight(req_.num_qps);
  if (cached_) {
    plan_ = cached_state_;
    return;
  }
  plan_ = state_.get();
  state_->topk = req_.do_handle_copy ? Tensor::empty({N, k}, DType::kInt64) : Tensor().with_view(req_.topk_idx);
  if (req_.do_handle_copy)
    for (int t = 0; t < N; ++t)
      std::memcpy(state_->topk.data_as<std::int64_t>() + std::int64_t{t} * k,
                  req_.topk_idx.data_as<const std::int64_t>() + t * req_.topk_idx.stride(0), sizeof(std::int64_t) * k);
  routing::TokenRanks ranks;
  routing::count_local({state_->topk.data_as<const std::int64_t>(), state_->topk.stride(0), N, k}, geo_, counts_, &ranks);
  if (!req_.generation.expert_counts.empty()) counts_.per_expert = req_.generation.expert_counts;
  std::int64_t sent = 0;
  for (const std::int32_t c : counts_.per_rank) sent += c;
  // Node peers read this list while planning what they receive (shared like the tensors).
  listed_ = Tensor::empty({sent, 2}, DType::kInt32);
  routing::list_by_destination(ranks, counts_.per_rank,
                               {reinterpret_cast<routing::ListedToken*>(listed_.data()), static_cast<std::size_t>(sent)});
}

// What this rank publishes: its shared tensors and (new dispatch) its counts.
std::vector<std::byte> Dispatch::publish() {
  mine_ = my_tensors();
  std::vector<std::byte> payload(sizeof(PeerTensors));
  // With push, node peers never read this rank's x, scales or weights (it writes their rows
  // itself): they are not shared, so a process does not copy caller tensors into its arena.
  const PeerTensors shared = share_tensors(engine_, mine_,
                                           {.x = push_ ? 0 : view_extent(req_.x),
                                            .scales = fp8_ && !push_ ? view_extent(req_.x_scales) : 0,
                                            .weights = has_weights_ && !push_ ? view_extent(req_.topk_weights) : 0,
                                            .topk = view_extent(plan_->topk),
                                            .listed = listed_.defined() ? listed_.nbytes() : 0});
  std::memcpy(payload.data(), &shared, sizeof shared);
  if (push_) {
    // Outputs allocated now travel with the agreement (node_windows).
    PushPublication pub;
    pub.holds_writes = req_.previous_event_before_epilogue ? 1 : 0;
    if (window_in_agreement()) {
      make_outputs();
      open_own_window();
      pub.window = publish_window(engine_.transport(), window_.out, window_shape_);
      pub.has_window = 1;
    }
    const auto* b = reinterpret_cast<const std::byte*>(&pub);
    payload.insert(payload.end(), b, b + sizeof pub);
  }
  if (cached_) return payload;
  for (const auto* v : {&counts_.per_rank, &counts_.per_expert, &counts_.per_node}) {
    const auto* b = reinterpret_cast<const std::byte*>(v->data());
    payload.insert(payload.end(), b, b + v->size() * sizeof(std::int32_t));
  }
  return payload;
}

// Agreement: arguments, signature, published tensors and (new dispatch) counts.
void Dispatch::describe(comm::Agreement& agreement) const {
  agreement.field("operation number", static_cast<std::int64_t>(sequence_))
      .field("cached (handle given)", cached_)
      .field("handle's dispatch number", cached_state_ ? static_cast<std::int64_t>(cached_state_->dispatch_sequence) : 0)
      .field("num_max_tokens_per_rank", shape_.max_tokens)
      .field("num_experts", shape_.experts)
      .field("num_topk", shape_.topk)
      .field("hidden", shape_.hidden)
      .field("handle's hidden", handle_hidden_)
      .field("x dtype", x_dtype_)
      .field("x_scales columns", shape_.scale_columns)
      .field("x_scales dtype", fp8_ ? std::optional(scale_dtype_) : std::nullopt)
      .field("topk_weights given", has_weights_)
      .field("expert_alignment", shape_.alignment)
      .field("do_expand", expand_)
      .field("expert stride", stride_)
      .field("sources push rows into windows", push_);
}

std::vector<PeerTensors> Dispatch::unpack_peers(const std::vector<std::span<const std::byte>>& payloads) {
  const std::size_t extra_bytes =
      agreed_window_bytes() +
      (cached_ ? 0 : sizeof(std::int32_t) * static_cast<size_t>(geo_.num_ranks + geo_.num_experts + geo_.num_nodes));
  std::vector<PeerTensors> peers(payloads.size());
  agreed_windows_.clear();
  agreed_windows_ready_ = push_;
  for (std::size_t r = 0; r < payloads.size(); ++r) {
    if (payloads[r].size() != sizeof(PeerTensors) + extra_bytes)
      throw StateError(fmt::format("{}: rank {} published {} bytes, expected {}", ctx_, r, payloads[r].size(),
                                   sizeof(PeerTensors) + extra_bytes));
    std::memcpy(&peers[r], payloads[r].data(), sizeof(PeerTensors));
    if (push_ && engine_.facts.same_node(static_cast<int>(r))) {
      PushPublication pub;
      std::memcpy(&pub, payloads[r].data() + sizeof(PeerTensors), sizeof pub);
      agreed_windows_.push_back(pub.window);
      agreed_windows_ready_ = agreed_windows_ready_ && pub.has_window == 1 && pub.holds_writes == 0;
    }
  }
  resolve_tensors(engine_, peers, mine_);
  return peers;
}

// The global layout from every rank's counts.
void Dispatch::take_layout(const std::vector<std::span<const std::byte>>& payloads,
                           const std::vector<PeerTensors>& peers) {
  state_->layout.reset(geo_, shape_.alignment, stride_);
  const int R = geo_.num_ranks, E = geo_.num_experts, G = geo_.num_nodes;
  for (int s = 0; s < R; ++s) {
    const std::byte* c = payloads[static_cast<size_t>(s)].data() + sizeof(PeerTensors) + agreed_window_bytes();
    std::memcpy(state_->layout.per_rank_counts(s), c, sizeof(std::int32_t) * R);
    std::memcpy(state_->layout.per_expert_counts(s), c + sizeof(std::int32_t) * R, sizeof(std::int32_t) * E);
    std::memcpy(state_->layout.per_node_counts(s), c + sizeof(std::int32_t) * (R + E), sizeof(std::int32_t) * G);
  }
  state_->layout.finish();
  state_->source_tokens.resize(peers.size());
  for (std::size_t r = 0; r < peers.size(); ++r) state_->source_tokens[r] = peers[r].num_tokens;
}

// Rows of this rank's tokens, and the rows it receives from its node (their published top-k ids).
void Dispatch::plan_local(const std::vector<PeerTensors>& peers) {
  HandleState& s = *state_;
  const routing::PlanningRank me = planning_rank();
  routing::plan_sources(s, {s.topk.data_as<const std::int64_t>(), s.topk.stride(0), shape_.tokens, shape_.topk}, me,
                        {reinterpret_cast<const routing::ListedToken*>(listed_.data()),
                         static_cast<std::size_t>(listed_.size(0))});
  comm::PeerReads reads(engine_.transport(), "dispatch: receive plan");  // node peers' top-k ids and lists
  routing::start_receive_plan(s, shape_.topk, me);
  std::vector<routing::LocalSource> sources(peers.size());
  for (std::size_t r = 0; r < peers.size(); ++r)
    if (engine_.facts.same_node(static_cast<int>(r)))
      sources[r] = {{peers[r].topk, peers[r].topk_row, peers[r].num_tokens, shape_.topk}, peers[r].listed};
  routing::plan_receive_local(s, me, sources);
}

void Dispatch::make_outputs() {
  if (result.recv_x.defined()) {  // allocated before the agreement, or early by an asynchronous submission
    if (capacity_outputs_) narrow_outputs(plan_->layout.rows_at(engine_.facts.rank));
    return;
  }
  if (outputs_known_early() || capacity_outputs_) {  // worst-case rows (capacity outputs: narrowed above)
    allocate_outputs_early();
  } else {
    allocate_outputs(plan_->layout.rows_at(engine_.facts.rank), plan_->layout.expanded_rows_at(engine_.facts.rank));
  }
}

// Scale-out records, forwarding (hybrid), the remote receive plan, then the copies.
void Dispatch::move_rows(const std::vector<PeerTensors>& peers) {
  const bool hybrid = engine_.facts.paths.hybrid();
  DispatchRecordExchange records(
      engine_, geo_,
      {.row_bytes = row_bytes_, .scale_columns = shape_.scale_columns, .topk = shape_.topk, .weights = has_weights_},
      shape_.max_tokens);
  records.send(*plan_, peers[static_cast<size_t>(engine_.facts.rank)]);
  records.receive(plan_->layout, planning_rank());
  if (!cached_ && hybrid) plan_forwarding(records);
  if (hybrid) engine_.transport().barrier(comm::Scope::kNode, engine_.facts.wait("dispatch: forwarded records ready"));
  if (!cached_ && records.used()) plan_receive_remote(records);
  open_own_window();
  if (push_) {
    push_rows(peers);
    copy_rows(peers, records, true);
  } else {
    comm::PeerReads reads(engine_.transport(), "dispatch: copy");  // node peers' x, scales and weights
    copy_rows(peers, records, false);
  }
  if (req_.zero_padding) zero_padding();
  add_expert_stats();
}

// Hybrid: the rows, at this node's ranks, of every token this rank forwards (used by combine).
void Dispatch::plan_forwarding(const DispatchRecordExchange& records) {
  HandleState& s = *state_;
  const int k = shape_.topk;
  routing::start_forwarding(s.forward, s.layout, engine_.facts.rank, k);
  for (routing::ForwardPlan& f : s.forward)
    if (f.source >= 0) records.read_arrived(f.source, f.count, f.ids.data(), f.token.data());
  routing::plan_forwarding(s.forward, s.layout, engine_.facts.rank, k);
}

// The rows this rank receives from other nodes, once their records arrived.
void Dispatch::plan_receive_remote(const DispatchRecordExchange& records) {
  HandleState& s = *state_;
  const routing::PlanningRank me = planning_rank();
  const int k = shape_.topk;
  std::vector<std::int64_t> ids;
  std::vector<std::int32_t> tokens;
  for (int src = 0; src < geo_.num_ranks; ++src) {
    const std::int32_t count = routing::remote_records(s.layout, me, src);
    if (count == 0) continue;
    ids.resize(static_cast<size_t>(count) * static_cast<size_t>(k));
    tokens.resize(static_cast<size_t>(count));
    records.read_received(src, count, ids.data(), tokens.data());
    routing::receive_source(s, me, src, {ids.data(), k, count, k}, tokens.data());
  }
}

void Dispatch::finish() {
  // Pushed rows are all here once every node peer passed the exit barrier.
  if (req_.unpack_received_rows && !push_) req_.unpack_received_rows(result);
  engine_.transport().barrier(comm::Scope::kNode, engine_.facts.wait("dispatch: exit"));
  if (req_.unpack_received_rows && push_) req_.unpack_received_rows(result);
  if (!cached_ && req_.fill_generation_handle) req_.fill_generation_handle(*result.handle);
}

void Dispatch::fill_handle() {
  HandleState& s = *state_;
  EPHandle& h = *result.handle;
  const auto& layout = s.layout;
  const int me = engine_.facts.rank, T = shape_.max_tokens;
  h.num_sms = workers_;
  // Fields known at the start (start_handle) are not written again: a combine queued behind an
  // asynchronous dispatch reads them meanwhile.
  if (s.facts.num_max_tokens_per_rank != T) h.num_max_tokens_per_rank = s.facts.num_max_tokens_per_rank = T;
  s.max_tokens = T;
  h.topk_idx = s.topk;
  if (cpu_sync_) {
    h.num_recv_tokens = s.facts.num_recv_tokens = layout.rows_at(me);
    h.num_expanded_tokens = s.facts.num_expanded_tokens = layout.expanded_rows_at(me);
  }
  routing::ReceiveCounts counts = routing::receive_counts(layout, me, engine_.facts.logical_scaleup, expand_);
  h.psum_num_recv_tokens_per_scaleup_rank = std::move(counts.psum_per_scaleup_rank);
  h.psum_num_recv_tokens_per_expert = std::move(counts.psum_per_expert);
  h.num_unaligned_recv_tokens_per_expert = std::move(counts.unaligned_per_expert);
  if (cpu_sync_)
    h.num_recv_tokens_per_expert_list.insert(h.num_recv_tokens_per_expert_list.end(), counts.aligned_per_expert.begin(),
                                             counts.aligned_per_expert.end());
  h.dst_buffer_slot_idx = routing::buffer_slots(
      layout, me, T, {s.topk.data_as<const std::int64_t>(), s.topk.stride(0), shape_.tokens, shape_.topk}, s.dst_row);
}

}  // namespace dispatch_detail

std::shared_ptr<DispatchOperation> make_dispatch(Engine& engine, DispatchRequest request, std::uint64_t sequence) {
  return std::make_shared<dispatch_detail::Dispatch>(engine, std::move(request), sequence);
}

}  // namespace moe_ep::engine
