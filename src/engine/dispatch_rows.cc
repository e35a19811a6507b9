// The copies of a dispatch into its outputs: every row this rank receives, from its source's
// tensors (same node) or its record (DispatchRecordExchange), or with ranks as threads the rows
// this rank's tokens make at its node peers (push); the padding and the statistics.
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/reduce.hh"
#include "engine/dispatch_op.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::engine::dispatch_detail {

void Dispatch::prepare_copies(const std::vector<PeerTensors>& peers, const DispatchRecordExchange& records) {
  out_.x = static_cast<std::byte*>(result.recv_x.data());
  out_.scales = fp8_ ? result.recv_x_scales.data_as<std::uint32_t>() : nullptr;
  out_.ids = expand_ ? nullptr : result.recv_topk_idx.data_as<std::int64_t>();
  out_.weights = has_weights_ ? result.recv_topk_weights.data_as<float>() : nullptr;
  out_.metadata = cached_ ? nullptr : result.handle->recv_src_metadata.data_as<std::int32_t>();
  copy_peers_ = &peers;
  copy_records_ = &records;
}

// Push: this rank's tokens in order, each written to every rank of this node it goes to (its row
// there is dst_row at the token's master lane for that rank), by that rank's copy_row, so that the
// row is read from memory once and then from the cache. Node peers' outputs are ready (a node
// barrier after prepare_copies) and stay alive until the exit barrier, or until this rank closed
// its peer section if one of them fails (comm/peer_reads.hh).
void Dispatch::push_rows(const std::vector<PeerTensors>& peers) {
  const HandleState& plan = *plan_;
  const int k = shape_.topk, me = engine_.facts.rank, N = shape_.tokens;
  std::vector<Dispatch*> targets(peers.size(), nullptr);
  for (std::size_t r = 0; r < peers.size(); ++r) {
    if (!engine_.facts.same_node(static_cast<int>(r))) continue;
    targets[r] = static_cast<Dispatch*>(const_cast<void*>(peers[r].dispatch));
    if (!targets[r]) throw StateError(fmt::format("{}: rank {} published no dispatch to push rows into", ctx_, r));
  }
  const std::int64_t* topk = plan.topk.data_as<const std::int64_t>();
  const std::int64_t topk_row = plan.topk.stride(0);
  engine_.pool().parallel_for((N + kRowsPerTask - 1) / kRowsPerTask, [&](std::int64_t task) {
    const std::int64_t end = std::min<std::int64_t>(N, (task + 1) * kRowsPerTask);
    for (std::int64_t t = task * kRowsPerTask; t < end; ++t)
      for (int j = 0; j < k; ++j) {
        const std::int32_t row = plan.dst_row[static_cast<size_t>(t * k + j)];
        if (row < 0) continue;  // not the token's master lane for its rank
        const int d = geo_.rank_of_expert(topk[t * topk_row + j]);
        if (!engine_.facts.same_node(d)) continue;  // travels as a record
        Dispatch& target = *targets[static_cast<size_t>(d)];
        const routing::RowSource src = target.plan_->rows[static_cast<size_t>(row)];
        if (src.source != me || src.index != t)
          throw StateError(fmt::format("{}: row {} of rank {} is token {} of rank {}, not token {} of rank {}", ctx_,
                                       row, d, src.index, src.source, t, me));
        target.copy_row(*target.copy_peers_, *target.copy_records_, row, target.out_.metadata);
      }
    core::streaming_fence();
  });
}

// The rows this rank receives (remote_only: those of other nodes; its node's sources push theirs).
void Dispatch::copy_rows(bool remote_only) {
  const std::int64_t rows = static_cast<std::int64_t>(plan_->rows.size());
  const int k = shape_.topk;
  engine_.pool().parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](std::int64_t task) {
    const std::int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (std::int64_t i = task * kRowsPerTask; i < end; ++i)
      if (!remote_only || !engine_.facts.same_node(plan_->rows[static_cast<size_t>(i)].source))
        copy_row(*copy_peers_, *copy_records_, i, out_.metadata);
    core::streaming_fence();
  });
  // Rows past the real count (worst-case shapes) carry no data; mark their metadata.
  if (out_.metadata) {
    const std::int64_t allocated = result.handle->recv_src_metadata.size(0);
    std::fill(out_.metadata + rows * (k + 2), out_.metadata + allocated * (k + 2), -1);
  }
  if (!expand_ && rows < result.recv_topk_idx.size(0))
    std::fill(out_.ids + rows * k, out_.ids + result.recv_topk_idx.size(0) * k, -1);
}

// Row i of the outputs (its expanded rows, in the expanded layout), from its source's tensors
// (same node) or its record.
void Dispatch::copy_row(const std::vector<PeerTensors>& peers, const DispatchRecordExchange& records, std::int64_t i,
                        std::int32_t* metadata) {
  const HandleState& plan = *plan_;
  const int k = shape_.topk, P = shape_.scale_columns;
  const RowSource src = plan.rows[static_cast<size_t>(i)];
  const std::byte* payload;
  const std::uint32_t* scales = nullptr;
  std::int64_t scale_step = 1;
  const float* weights = nullptr;
  if (engine_.facts.same_node(src.source)) {
    const PeerTensors& p = peers[static_cast<size_t>(src.source)];
    payload = p.x + src.index * p.x_row_bytes;
    if (fp8_) {
      scales = reinterpret_cast<const std::uint32_t*>(p.scales) + src.index * p.scale_stride[0];
      scale_step = p.scale_stride[1];
    }
    if (has_weights_) weights = p.weights + src.index * p.weights_row;
  } else {
    const DispatchRecordExchange::Row record = records.received_row(src.source, src.index);
    payload = record.payload;
    scales = record.scales;
    weights = record.weights;
  }
  auto copy_scales = [&](std::int64_t out_row) {
    if (!fp8_) return;
    std::uint32_t* dst = out_.scales + scale_layout_.at(out_row, 0);
    const std::int64_t step = scale_layout_.block;
    if (scale_step == 1 && step == 1) {
      std::memcpy(dst, scales, sizeof(std::uint32_t) * static_cast<size_t>(P));
    } else {
      for (int p = 0; p < P; ++p) dst[p * step] = scales[p * scale_step];
    }
  };
  const std::int32_t* local = &plan.local_ids[static_cast<size_t>(i) * k];
  float* out_w = out_.weights;
  if (expand_) {
    const std::int32_t* expanded = &plan.expanded_rows[static_cast<size_t>(i) * k];
    for (int j = 0; j < k; ++j) {
      if (expanded[j] < 0) continue;
      core::copy_bytes_streaming(out_.x + expanded[j] * row_bytes_, payload, static_cast<size_t>(row_bytes_));
      copy_scales(expanded[j]);
      if (out_w) out_w[expanded[j]] = weights[j];
    }
  } else {
    core::copy_bytes_streaming(out_.x + i * row_bytes_, payload, static_cast<size_t>(row_bytes_));
    copy_scales(i);
    for (int j = 0; j < k; ++j) out_.ids[i * k + j] = local[j];
    if (out_w) {
      std::memcpy(out_w + i * k, weights, sizeof(float) * static_cast<size_t>(k));
      if (req_.zero_nonlocal_weights)
        for (int j = 0; j < k; ++j)
          if (local[j] < 0) out_w[i * k + j] = 0.0f;
    }
  }
  if (metadata) {
    std::int32_t* m = metadata + i * (k + 2);
    m[0] = src.source * shape_.max_tokens + plan.row_token[static_cast<size_t>(i)];
    m[1] = src.source * k + plan.master_lane[static_cast<size_t>(i)];
    for (int j = 0; j < k; ++j) m[2 + j] = expand_ ? plan.expanded_rows[static_cast<size_t>(i) * k + j] : -1;
  }
}

void Dispatch::zero_padding() {
  const auto& layout = plan_->layout;
  const int me = engine_.facts.rank, El = shape_.local_experts;
  for (int i = 0; i < El; ++i) {
    const int e = me * El + i;
    const std::int64_t begin = layout.expert_start(e) + layout.expert_total(e);
    const std::int64_t block = stride_ > 0 ? stride_ : routing::align_up(layout.expert_total(e), shape_.alignment);
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
