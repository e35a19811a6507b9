#include "engine/dispatch_record_exchange.hh"

#include <cstring>

namespace moe_ep::engine {

DispatchRecordExchange::DispatchRecordExchange(Engine& engine, const routing::Geometry& geometry,
                                               const Content& content, int max_tokens)
    : engine_(engine),
      geometry_(geometry),
      content_(content),
      layout_(content.row_bytes, std::int64_t{content.scale_columns} * 4, content.topk),
      max_tokens_(max_tokens),
      exchange_(engine, "dispatch: scale-out records") {}

std::int64_t DispatchRecordExchange::region_offset(int source, std::int32_t slot) const {
  const int region = engine_.facts.paths.hybrid() ? engine_.facts.routing_node_of(source) : source;
  return (static_cast<std::int64_t>(region) * max_tokens_ + slot) * layout_.bytes;
}

const std::byte* DispatchRecordExchange::received_record(int source, std::int32_t slot) const {
  const EngineFacts& facts = engine_.facts;
  if (facts.paths.hybrid()) {
    const int forwarder = facts.node_of(facts.rank) * facts.physical.num_scaleup + source % facts.physical.num_scaleup;
    return engine_.memory().node_peer(forwarder) + region_offset(source, slot);
  }
  return engine_.memory().local() + region_offset(source, slot);
}

void DispatchRecordExchange::read_record(const std::byte* record, std::int64_t* ids, std::int32_t* token) const {
  const auto* record_ids = reinterpret_cast<const std::int32_t*>(record + layout_.ids_offset);
  for (int j = 0; j < content_.topk; ++j) ids[j] = record_ids[j];
  std::memcpy(token, record + layout_.token_offset, sizeof(std::int32_t));
}

void DispatchRecordExchange::read_arrived(int source, std::int32_t count, std::int64_t* ids,
                                          std::int32_t* tokens) const {
  const std::size_t k = static_cast<std::size_t>(content_.topk);
  for (std::int32_t slot = 0; slot < count; ++slot)
    read_record(engine_.memory().local() + region_offset(source, slot), ids + static_cast<std::size_t>(slot) * k,
                tokens + slot);
}

void DispatchRecordExchange::read_received(int source, std::int32_t count, std::int64_t* ids,
                                           std::int32_t* tokens) const {
  const std::size_t k = static_cast<std::size_t>(content_.topk);
  for (std::int32_t slot = 0; slot < count; ++slot)
    read_record(received_record(source, slot), ids + static_cast<std::size_t>(slot) * k, tokens + slot);
}

DispatchRecordExchange::Row DispatchRecordExchange::received_row(int source, std::int32_t slot) const {
  const std::byte* record = received_record(source, slot);
  return {record, reinterpret_cast<const std::uint32_t*>(record + layout_.scales_offset),
          reinterpret_cast<const float*>(record + layout_.weights_offset)};
}

void DispatchRecordExchange::fill_meta(const HandleState& plan, const PeerTensors& mine, int token) {
  const std::int64_t* topk = plan.topk.data_as<const std::int64_t>();
  std::byte* meta = meta_.data();
  if (content_.scale_columns > 0) {
    auto* out = reinterpret_cast<std::uint32_t*>(meta);
    const auto* in = reinterpret_cast<const std::uint32_t*>(mine.scales) + token * mine.scale_stride[0];
    for (int p = 0; p < content_.scale_columns; ++p) out[p] = in[p * mine.scale_stride[1]];
  }
  auto* ids = reinterpret_cast<std::int32_t*>(meta + (layout_.ids_offset - layout_.scales_offset));
  auto* weights = reinterpret_cast<float*>(meta + (layout_.weights_offset - layout_.scales_offset));
  for (int j = 0; j < content_.topk; ++j) {
    ids[j] = static_cast<std::int32_t>(topk[token * plan.topk.stride(0) + j]);
    weights[j] = content_.weights ? mine.weights[token * mine.weights_row + j] : 0.0f;
  }
  std::memcpy(meta + (layout_.token_offset - layout_.scales_offset), &token, sizeof token);
}

void DispatchRecordExchange::send(const HandleState& plan, const PeerTensors& mine) {
  if (!used()) return;
  const EngineFacts& facts = engine_.facts;
  const int me = facts.rank, k = content_.topk;
  const std::int64_t* topk = plan.topk.data_as<const std::int64_t>();
  meta_.resize(static_cast<std::size_t>(layout_.bytes - layout_.scales_offset));
  for (int t = 0; t < mine.num_tokens; ++t) {
    bool filled = false;
    for (int j = 0; j < k; ++j) {
      const std::size_t i = static_cast<std::size_t>(t) * k + j;
      int peer = -1;
      std::int32_t slot = -1;
      if (facts.paths.hybrid()) {
        if (plan.node_slot[i] < 0) continue;
        const int node = geometry_.node_of_rank(geometry_.rank_of_expert(topk[t * plan.topk.stride(0) + j]));
        if (node == facts.routing_node_of(me)) continue;
        peer = routing::forwarder_on(geometry_, me, node);
        slot = plan.node_slot[i];
      } else {
        if (plan.dst_row[i] < 0) continue;
        const int d = geometry_.rank_of_expert(topk[t * plan.topk.stride(0) + j]);
        if (facts.same_node(d)) continue;
        peer = d;
        slot = plan.dst_row[i] - plan.layout.row_base(me, d);
      }
      if (!filled) fill_meta(plan, mine, t);
      filled = true;
      const std::int64_t offset = region_offset(me, slot);
      // The row is sent from the caller's tensor (valid for the whole call), the rest from meta_.
      exchange_.put_retained(peer, static_cast<std::size_t>(offset), mine.x + t * mine.x_row_bytes,
                             static_cast<std::size_t>(content_.row_bytes));
      exchange_.put(peer, static_cast<std::size_t>(offset + layout_.scales_offset), meta_.data(), meta_.size());
    }
  }
  exchange_.signal_written();
}

void DispatchRecordExchange::receive(const routing::GlobalLayout& layout, const routing::PlanningRank& me) {
  if (!used()) return;
  for (const int source : routing::record_senders(layout, me)) exchange_.expect(source);
  exchange_.wait();
}

}  // namespace moe_ep::engine
