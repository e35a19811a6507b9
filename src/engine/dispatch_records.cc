// The data path of a dispatch: scale-out records (one counted exchange), the forwarding and
// remote receive plans read from them, and the copies into the outputs.
#include <algorithm>
#include <cstring>

#include "core/reduce.hh"
#include "engine/dispatch_op.hh"

namespace moe_ep::engine::dispatch_detail {

std::byte* Dispatch::region_record(int source, std::int32_t slot) {
  if (engine_.facts.paths.hybrid()) {
    const int forwarder =
        engine_.facts.node_of(engine_.facts.rank) * engine_.facts.physical.num_scaleup + source % engine_.facts.physical.num_scaleup;
    return engine_.memory().node_peer(forwarder) + region_offset(source, slot);
  }
  return engine_.memory().local() + region_offset(source, slot);
}

void Dispatch::read_record(const std::byte* record, std::int64_t* ids, std::int32_t* token) const {
  const auto* record_ids = reinterpret_cast<const std::int32_t*>(record + record_.ids_offset);
  for (int j = 0; j < shape_.topk; ++j) ids[j] = record_ids[j];
  std::memcpy(token, record + record_.token_offset, sizeof(std::int32_t));
}

// The record's scales, ids, weights and token index (everything after the payload row).
void Dispatch::fill_record_meta(const PeerTensors& mine, int t) {
  const HandleState& s = *plan_;
  const std::int64_t* topk = s.topk.data_as<const std::int64_t>();
  std::byte* meta = record_scratch_.data();
  if (fp8_) {
    auto* out = reinterpret_cast<std::uint32_t*>(meta);
    const auto* in = reinterpret_cast<const std::uint32_t*>(mine.scales) + t * mine.scale_stride[0];
    for (int p = 0; p < shape_.scale_columns; ++p) out[p] = in[p * mine.scale_stride[1]];
  }
  auto* ids = reinterpret_cast<std::int32_t*>(meta + (record_.ids_offset - record_.scales_offset));
  auto* weights = reinterpret_cast<float*>(meta + (record_.weights_offset - record_.scales_offset));
  for (int j = 0; j < shape_.topk; ++j) {
    ids[j] = static_cast<std::int32_t>(topk[t * s.topk.stride(0) + j]);
    weights[j] = has_weights_ ? mine.weights[t * mine.weights_row + j] : 0.0f;
  }
  std::memcpy(meta + (record_.token_offset - record_.scales_offset), &t, sizeof t);
}

// Scale-out: one record per (token, remote destination rank) in direct mode, per (token,
// remote destination node) in hybrid mode, then one signal per peer that got records.
void Dispatch::put_records(const std::vector<PeerTensors>& peers, CountedExchange& records) {
  if (!engine_.facts.paths.hybrid() && !engine_.facts.paths.direct_remote()) return;
  const HandleState& s = *plan_;
  const int me = engine_.facts.rank, k = shape_.topk;
  const PeerTensors& mine = peers[static_cast<size_t>(me)];
  const std::int64_t* topk = s.topk.data_as<const std::int64_t>();
  record_scratch_.resize(static_cast<size_t>(record_.bytes - record_.scales_offset));
  for (int t = 0; t < shape_.tokens; ++t) {
    bool filled = false;
    for (int j = 0; j < k; ++j) {
      const std::size_t i = static_cast<size_t>(t) * k + j;
      int peer = -1;
      std::int32_t slot = -1;
      if (engine_.facts.paths.hybrid()) {
        if (s.node_slot[i] < 0) continue;
        const int node = geo_.node_of_rank(geo_.rank_of_expert(topk[t * s.topk.stride(0) + j]));
        if (node == engine_.facts.routing_node_of(me)) continue;
        peer = routing::forwarder_on(geo_, me, node);
        slot = s.node_slot[i];
      } else {
        if (s.dst_row[i] < 0) continue;
        const int d = geo_.rank_of_expert(topk[t * s.topk.stride(0) + j]);
        if (engine_.facts.same_node(d)) continue;
        peer = d;
        slot = s.dst_row[i] - s.layout.row_base(me, d);
      }
      if (!filled) fill_record_meta(mine, t);
      filled = true;
      const std::int64_t offset = region_offset(me, slot);
      // The row is sent from the caller's tensor (valid for the whole call), the rest from scratch.
      records.put_retained(peer, static_cast<std::size_t>(offset), mine.x + t * mine.x_row_bytes,
                           static_cast<std::size_t>(row_bytes_));
      records.put(peer, static_cast<std::size_t>(offset + record_.scales_offset), record_scratch_.data(),
                  record_scratch_.size());
    }
  }
  records.signal_written();
}

// Waits for the records addressed to this rank (direct) or forwarded through it (hybrid).
void Dispatch::wait_records(CountedExchange& records) {
  if (!engine_.facts.paths.hybrid() && !engine_.facts.paths.direct_remote()) return;
  for (const int source : routing::record_senders(plan_->layout, planning_rank())) records.expect(source);
  records.wait();
}

// Hybrid: the rows, at this node's ranks, of every token this rank forwards (used by combine).
void Dispatch::plan_forwarding() {
  HandleState& s = *state_;
  const int k = shape_.topk;
  routing::start_forwarding(s.forward, s.layout, engine_.facts.rank, k);
  for (routing::ForwardPlan& f : s.forward) {
    if (f.source < 0) continue;
    for (std::int32_t slot = 0; slot < f.count; ++slot)
      read_record(engine_.memory().local() + region_offset(f.source, slot),
                  &f.ids[static_cast<size_t>(slot) * static_cast<size_t>(k)], &f.token[static_cast<size_t>(slot)]);
  }
  routing::plan_forwarding(s.forward, s.layout, engine_.facts.rank, k);
}

// The rows this rank receives from other nodes, once their records arrived.
void Dispatch::plan_receive_remote() {
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
    for (std::int32_t slot = 0; slot < count; ++slot)
      read_record(region_record(src, slot), &ids[static_cast<size_t>(slot) * static_cast<size_t>(k)],
                  &tokens[static_cast<size_t>(slot)]);
    routing::receive_source(s, me, src, {ids.data(), k, count, k}, tokens.data());
  }
}

void Dispatch::copy_rows(const std::vector<PeerTensors>& peers) {
  const std::int64_t rows = static_cast<std::int64_t>(plan_->rows.size());
  const int k = shape_.topk;
  out_.x = static_cast<std::byte*>(result.recv_x.data());
  out_.scales = fp8_ ? result.recv_x_scales.data_as<std::uint32_t>() : nullptr;
  out_.ids = expand_ ? nullptr : result.recv_topk_idx.data_as<std::int64_t>();
  out_.weights = has_weights_ ? result.recv_topk_weights.data_as<float>() : nullptr;
  std::int32_t* metadata = cached_ ? nullptr : result.handle->recv_src_metadata.data_as<std::int32_t>();
  engine_.pool().parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](std::int64_t task) {
    const std::int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (std::int64_t i = task * kRowsPerTask; i < end; ++i) copy_row(peers, i, metadata);
    core::streaming_fence();
  });
  // Rows past the real count (worst-case shapes) carry no data; mark their metadata.
  if (metadata) {
    const std::int64_t allocated = result.handle->recv_src_metadata.size(0);
    std::fill(metadata + rows * (k + 2), metadata + allocated * (k + 2), -1);
  }
  if (!expand_ && rows < result.recv_topk_idx.size(0))
    std::fill(out_.ids + rows * k, out_.ids + result.recv_topk_idx.size(0) * k, -1);
}

// Row i of the outputs (its expanded rows, in the expanded layout), from its source's tensors
// (same node) or its record.
void Dispatch::copy_row(const std::vector<PeerTensors>& peers, std::int64_t i, std::int32_t* metadata) {
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
    const std::byte* rec = region_record(src.source, src.index);
    payload = rec;
    scales = reinterpret_cast<const std::uint32_t*>(rec + record_.scales_offset);
    weights = reinterpret_cast<const float*>(rec + record_.weights_offset);
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
