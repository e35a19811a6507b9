// The copies of a dispatch into its outputs (through receive windows, engine/receive_window.hh):
// every row this rank receives, from its source's tensors (same node) or its record
// (DispatchRecordExchange), or, where the transport offers windows, the rows this rank's tokens
// make at its node peers (push); the padding and the statistics.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "comm/peer_reads.hh"
#include "core/arith.hh"
#include "core/reduce.hh"
#include "engine/dispatch_op.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine::dispatch_detail {

WindowOutputs Dispatch::own_outputs() const {
  WindowOutputs o;
  o.x = static_cast<std::byte*>(result.recv_x.data());
  o.scales = fp8_ ? result.recv_x_scales.data_as<std::uint32_t>() : nullptr;
  o.ids = expand_ ? nullptr : result.recv_topk_idx.data_as<std::int64_t>();
  o.weights = has_weights_ ? result.recv_topk_weights.data_as<float>() : nullptr;
  o.metadata = cached_ ? nullptr : result.handle->recv_src_metadata.data_as<std::int32_t>();
  o.out_rows = result.recv_x.size(0);
  o.meta_rows = cached_ ? 0 : result.handle->recv_src_metadata.size(0);
  o.scale_layout = scale_layout_;
  return o;
}

void Dispatch::open_own_window() {
  const HandleState& plan = *plan_;
  window_shape_ = {.row_bytes = row_bytes_, .topk = shape_.topk, .scale_columns = shape_.scale_columns,
                   .max_tokens = shape_.max_tokens, .expand = expand_, .zero_nonlocal_weights = req_.generation.zero_nonlocal_weights};
  window_ = {};
  window_.out = own_outputs();
  window_.rows = plan.rows.data();
  window_.row_token = plan.row_token.data();
  window_.master_lane = plan.master_lane.data();
  window_.local_ids = plan.local_ids.data();
  window_.expanded_rows = expand_ ? plan.expanded_rows.data() : nullptr;
  window_.num_rows = static_cast<std::int64_t>(plan.rows.size());
}

// Token `token` of a source of this node, read from its published tensors.
RowInput Dispatch::row_input(const PeerTensors& p, std::int64_t token) const {
  RowInput in;
  in.payload = p.x + token * p.x_row_bytes;
  if (fp8_) {
    in.scales = reinterpret_cast<const std::uint32_t*>(p.scales) + token * p.scale_stride[0];
    in.scale_step = p.scale_stride[1];
  }
  if (has_weights_) in.weights = p.weights + token * p.weights_row;
  return in;
}

// The outputs of this node's ranks, by rank (entries of other nodes stay empty): from the
// agreement (agreed_windows_ready_), or published now by a node all-gather, once every rank of
// the node has allocated them and passed its previous_event_before_epilogue (no source writes
// into outputs whose caller holds writes back).
std::vector<WindowOutputs> Dispatch::node_windows() {
  comm::Transport& transport = engine_.transport();
  std::vector<PublishedWindow> published = agreed_windows_;
  if (!agreed_windows_ready_) {
    published.clear();
    const PublishedWindow mine = publish_window(transport, window_.out, window_shape_);
    const comm::Gathered gathered = transport.all_gather(std::as_bytes(std::span(&mine, 1)), comm::Scope::kNode,
                                                         engine_.facts.wait("dispatch: outputs ready"));
    for (int i = 0; i < gathered.size(); ++i) {
      if (gathered[i].size() != sizeof(PublishedWindow))
        throw StateError(fmt::format("{}: rank {} published a {}-byte window, expected {}", ctx_,
                                     transport.node_first_rank() + i, gathered[i].size(), sizeof(PublishedWindow)));
      PublishedWindow w;
      std::memcpy(&w, gathered[i].data(), sizeof w);
      published.push_back(w);
    }
  }
  const int me = engine_.facts.rank, first = transport.node_first_rank();
  std::vector<WindowOutputs> windows(static_cast<size_t>(engine_.facts.num_ranks));
  for (int i = 0; i < transport.node_size(); ++i)
    windows[static_cast<size_t>(first + i)] = first + i == me ? window_.out
                                                              : open_window(transport, first + i,
                                                                            published[static_cast<size_t>(i)], window_shape_);
  return windows;
}

// Push: this rank's tokens in order, each written into the outputs of every rank of this node it
// goes to, so that the row is read from memory once and then from the cache. Its place there comes
// from this rank's own plan (the receiver's plan holds the same rows, routing/handle_plan.hh): the
// row is dst_row at the token's master lane for that rank, each lane's expert is local there when
// the rank owns it, and its expanded row is dst_expanded. The outputs stay alive until the exit
// barrier, or until this rank closed its peer section if one of them fails (comm/peer_reads.hh).
void Dispatch::push_rows(const std::vector<PeerTensors>& peers) {
  const std::vector<WindowOutputs> windows = node_windows();
  comm::PeerReads writes(engine_.transport(), "dispatch: push");  // node peers' outputs
  const int k = shape_.topk, me = engine_.facts.rank, N = shape_.tokens;
  const HandleState& plan = *plan_;
  const PeerTensors& own = peers[static_cast<size_t>(me)];
  const std::int64_t* topk = plan.topk.data_as<const std::int64_t>();
  const std::int64_t topk_row = plan.topk.stride(0);
  engine_.pool().parallel_for(core::ceil_div<std::int64_t>(N, kRowsPerTask), [&](std::int64_t task) {
    const std::int64_t end = std::min<std::int64_t>(N, (task + 1) * kRowsPerTask);
    std::int32_t local[kMaxTopk], expanded[kMaxTopk];
    for (std::int64_t t = task * kRowsPerTask; t < end; ++t) {
      const RowInput in = row_input(own, t);
      const std::int64_t* ids = topk + t * topk_row;
      for (int j = 0; j < k; ++j) {
        const std::int32_t row = plan.dst_row[static_cast<size_t>(t * k + j)];
        if (row < 0) continue;  // not the token's master lane for its rank
        const int d = geo_.rank_of_expert(ids[j]);
        if (!engine_.facts.same_node(d)) continue;  // travels as a record
        for (int l = 0; l < k; ++l) {
          local[l] = geo_.local_expert(ids[l], d);
          expanded[l] = local[l] >= 0 ? plan.dst_expanded[static_cast<size_t>(t * k + l)] : -1;
        }
        place_row(windows[static_cast<size_t>(d)], window_shape_,
                  {.row = row, .source = me, .token = static_cast<std::int32_t>(t), .master_lane = j,
                   .local_ids = local, .expanded_rows = expanded},
                  in);
      }
    }
    core::streaming_fence();
  });
}

// The rows this rank receives (remote_only: those of other nodes; its node's sources push theirs),
// from their sources' tensors (same node) or their records.
void Dispatch::copy_rows(const std::vector<PeerTensors>& peers, const DispatchRecordExchange& records,
                         bool remote_only) {
  const std::int64_t rows = window_.num_rows;
  const int k = shape_.topk;
  engine_.pool().parallel_for(core::ceil_div(rows, kRowsPerTask), [&](std::int64_t task) {
    const std::int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (std::int64_t i = task * kRowsPerTask; i < end; ++i) {
      const RowSource src = plan_->rows[static_cast<size_t>(i)];
      if (engine_.facts.same_node(src.source)) {
        if (!remote_only) write_row(window_, window_shape_, i, row_input(peers[static_cast<size_t>(src.source)], src.index));
      } else {
        const DispatchRecordExchange::Row record = records.received_row(src.source, src.index);
        write_row(window_, window_shape_, i, {.payload = record.payload, .scales = record.scales, .weights = record.weights});
      }
    }
    core::streaming_fence();
  });
  // Rows past the real count (worst-case shapes) carry no data; mark their metadata.
  if (window_.out.metadata)
    std::fill(window_.out.metadata + rows * (k + 2), window_.out.metadata + window_.out.meta_rows * (k + 2), -1);
  if (!expand_ && rows < result.recv_topk_idx.size(0))
    std::fill(window_.out.ids + rows * k, window_.out.ids + result.recv_topk_idx.size(0) * k, -1);
}

void Dispatch::zero_padding() {
  const auto& layout = plan_->layout;
  const int me = engine_.facts.rank, El = shape_.local_experts;
  for (int i = 0; i < El; ++i) {
    const int e = me * El + i;
    const std::int64_t begin = layout.expert_start(e) + layout.expert_total(e);
    const std::int64_t block =
        stride_ > 0 ? stride_ : core::round_up<std::int64_t>(layout.expert_total(e), shape_.alignment);
    const std::int64_t end = layout.expert_start(e) + block;
    for (std::int64_t r = begin; r < end; ++r) {
      std::memset(static_cast<std::byte*>(result.recv_x.data()) + r * row_bytes_, 0, static_cast<size_t>(row_bytes_));
      if (fp8_)
        for (int p = 0; p < shape_.scale_columns; ++p)
          result.recv_x_scales.data_as<std::uint32_t>()[scale_layout_.at(r, p)] = 0;
      if (has_weights_) result.recv_topk_weights.data_as<float>()[r] = 0.0f;
    }
  }
}

void Dispatch::add_expert_stats() {
  if (!req_.cumulative_local_expert_recv_stats.defined()) return;
  auto* stats = req_.cumulative_local_expert_recv_stats.data_as<std::int32_t>();
  for (int i = 0; i < shape_.local_experts; ++i)
    stats[i] += plan_->layout.expert_total(engine_.facts.rank * shape_.local_experts + i);
}

}  // namespace moe_ep::engine::dispatch_detail
