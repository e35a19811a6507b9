// The scale-out records of one dispatch (engine.hh, "Data paths"): what a rank sends to the ranks
// of other nodes and receives from them. A record is one payload row followed by its scales, top-k
// ids, weights and token index (engine/sizing.hh, DispatchRecord). This object places the records
// (slot `slot` of source `source` in the receiver's region [source][slot] in direct mode, in the
// region of the destination node's forwarder in hybrid mode), puts them, counts the ranks whose
// records reach this rank and waits for them, and reads the arrived records back.
//
// Guarantees: send() puts one record per (token, remote destination rank) in direct mode, per
// (token, remote destination node) in hybrid mode, then signals each peer it wrote to once
// (engine/counted_exchange.hh); receive() returns once every record addressed to this rank or
// forwarded through it has arrived. Without a scale-out path both do nothing. The payload rows are
// sent from the caller's x, read until receive() returns; every rank calls send() and receive() at
// the same step of the dispatch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/counted_exchange.hh"
#include "engine/engine.hh"
#include "engine/sizing.hh"
#include "routing/handle_plan.hh"
#include "routing/plan.hh"

namespace moe_ep::engine {

class DispatchRecordExchange {
 public:
  // What a record carries besides its row: `scale_columns` FP32/int32 scales (0: none), `topk`
  // ids and weights (weights 0 without `weights`).
  struct Content {
    std::int64_t row_bytes = 0;
    int scale_columns = 0;
    int topk = 0;
    bool weights = false;
  };
  // A record's parts as the copy into the outputs reads them.
  struct Row {
    const std::byte* payload;
    const std::uint32_t* scales;
    const float* weights;
  };

  // Regions hold `max_tokens` slots per source (the call's num_max_tokens_per_rank).
  DispatchRecordExchange(Engine& engine, const routing::Geometry& geometry, const Content& content, int max_tokens);

  // Whether records move at all: the hybrid path or direct scale-out.
  bool used() const { return engine_.facts.paths.hybrid() || engine_.facts.paths.direct_remote(); }

  // Puts this rank's records (its tokens, as `plan` routes them, from its tensors `mine`), then
  // signals every peer it wrote to.
  void send(const HandleState& plan, const PeerTensors& mine);
  // Counts the ranks whose records reach this rank (routing::record_senders) and waits for them.
  void receive(const routing::GlobalLayout& layout, const routing::PlanningRank& me);

  // Ids (as int64, `topk` per record) and token indices of slots 0..count of `source` in this
  // rank's own region: the records addressed to it (direct) or forwarded through it (hybrid).
  void read_arrived(int source, std::int32_t count, std::int64_t* ids, std::int32_t* tokens) const;
  // The same for the records whose rows this rank receives: its own region in direct mode, its
  // forwarder's in hybrid mode.
  void read_received(int source, std::int32_t count, std::int64_t* ids, std::int32_t* tokens) const;
  // The record of (source, slot) whose row this rank receives.
  Row received_row(int source, std::int32_t slot) const;

 private:
  // Byte offset of (source, slot) in a region.
  std::int64_t region_offset(int source, std::int32_t slot) const;
  // The record of (source, slot) in this rank's region (direct) or its forwarder's (hybrid).
  const std::byte* received_record(int source, std::int32_t slot) const;
  void read_record(const std::byte* record, std::int64_t* ids, std::int32_t* token) const;
  // The scales, ids, weights and token index of this rank's token into meta_ (all after the row).
  void fill_meta(const HandleState& plan, const PeerTensors& mine, int token);

  Engine& engine_;
  routing::Geometry geometry_;
  Content content_;
  DispatchRecord layout_;
  int max_tokens_;
  CountedExchange exchange_;
  std::vector<std::byte> meta_;  // one record past its row, put from here
};

}  // namespace moe_ep::engine
