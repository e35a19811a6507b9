// A rank's receive window: the outputs of its dispatch and the receive plan that says which
// source token each output row holds, as plain data. The receiver writes the rows it pulls into
// its own window; with push, a source of its node writes its tokens' rows into the outputs its
// node peers published (comm::Transport::offers_windows: ranks as threads, and processes of one
// node through memfd blocks), reading each token once for all its destinations, at the rows its
// own plan derives from the agreed layout (routing/handle_plan.hh: the plans of a source and of
// its receiver agree row for row). Nobody calls into another rank's objects: a window is only
// addresses and sizes.
//
// Guarantees: place_row writes only the output rows one placement names and refuses (StateError,
// nothing written) an output or metadata row outside the outputs; write_row also refuses a plan
// row outside the plan. Opening a peer's outputs checks that every span it published holds what
// its row counts claim (comm::Transport::node_window), so a source never writes past the memory
// the receiver gave.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/transport.hh"
#include "routing/handle_plan.hh"

namespace moe_ep::engine {

// Where row r, column p of the output scales lives (DispatchRequest::col_major_scales): blocks of
// `block` rows, column-major within a block; block 1 is row-major.
struct ScaleLayout {
  std::int64_t block = 1, columns = 0;
  std::int64_t at(std::int64_t r, std::int64_t p) const { return (r / block) * (block * columns) + r % block + p * block; }
};

// What every rank of one dispatch shares: the row format and the layout.
struct WindowShape {
  std::int64_t row_bytes = 0;  // payload bytes per row
  int topk = 0, scale_columns = 0, max_tokens = 0;
  bool expand = false;                 // rows are (token, local expert) pairs
  bool zero_nonlocal_weights = false;  // compact weights are 0 where the expert is not local
};

// The outputs of one rank's dispatch, as plain data: what a source of its node writes.
struct WindowOutputs {
  // Null when the call has none (scales without FP8, ids in the expanded layout, weights without
  // topk_weights, metadata for a cached dispatch).
  std::byte* x = nullptr;
  std::uint32_t* scales = nullptr;
  std::int64_t* ids = nullptr;
  float* weights = nullptr;
  std::int32_t* metadata = nullptr;  // [meta_rows, k + 2]
  std::int64_t out_rows = 0;         // rows of x, scales and weights (and of ids: compact layout)
  std::int64_t meta_rows = 0;        // rows of metadata: the compact rows the outputs hold
  ScaleLayout scale_layout;
};

// Where one received token goes: its compact row and origin, and per lane its expert at the
// receiver (-1: none there) and, expanded, its output row (-1: none).
struct RowPlacement {
  std::int64_t row = 0;  // compact row: the output row (compact layout) and the metadata row
  int source = 0;
  std::int32_t token = 0;  // at the source
  int master_lane = 0;
  const std::int32_t* local_ids = nullptr;      // [k]
  const std::int32_t* expanded_rows = nullptr;  // [k], expanded layout
};

// One token's data at its source (or in the record it travelled in).
struct RowInput {
  const std::byte* payload = nullptr;
  const std::uint32_t* scales = nullptr;  // FP8
  std::int64_t scale_step = 1;            // elements between scale columns
  const float* weights = nullptr;         // [k], when the call has weights
};

// Writes one token's output rows, scales, ids, weights and metadata where `p` places them; a
// row outside `w` is refused (StateError) before anything is written.
void place_row(const WindowOutputs& w, const WindowShape& shape, const RowPlacement& p, const RowInput& in);

// A rank's own window: its outputs and its receive plan (routing::RoutingPlan): per plan row its
// source, its token at the source, its master lane, its local expert ids [k] and (expanded) its
// output rows [k].
struct ReceiveWindow {
  WindowOutputs out;
  const routing::RowSource* rows = nullptr;
  const std::int32_t* row_token = nullptr;
  const std::int32_t* master_lane = nullptr;
  const std::int32_t* local_ids = nullptr;
  const std::int32_t* expanded_rows = nullptr;
  std::int64_t num_rows = 0;
};

// Writes plan row i of `w` from `in` (place_row where the plan puts it); a plan row outside the
// plan is refused (StateError).
void write_row(const ReceiveWindow& w, const WindowShape& shape, std::int64_t i, const RowInput& in);

// Publication over a transport that offers windows: what a rank publishes (in the dispatch's
// agreement, or a node all-gather) and the outputs a node peer's publication opens here.
struct PublishedWindow {
  comm::Transport::PublishedSpan x, scales, ids, weights, metadata;
  std::int64_t out_rows, meta_rows, scale_block, scale_columns;
};
PublishedWindow publish_window(comm::Transport& transport, const WindowOutputs& w, const WindowShape& shape);
// StateError (naming `rank`) when a span is smaller than the window's counts need.
WindowOutputs open_window(const comm::Transport& transport, int rank, const PublishedWindow& published,
                          const WindowShape& shape);

}  // namespace moe_ep::engine
