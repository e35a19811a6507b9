// A rank's receive window: the outputs of its dispatch and the receive plan that says which
// source token each output row holds, as plain data. The receiver writes the rows it pulls into
// its own window; with push, a source of its node writes its tokens' rows into the windows its
// node peers published (comm::Transport::offers_windows: ranks as threads, and processes of one
// node through memfd blocks), reading each token once for all its destinations. Nobody calls into
// another rank's objects: a window is only addresses and sizes.
//
// Guarantees: write_row writes only the output rows the plan names for one plan row, and refuses
// (StateError, nothing written) a plan row outside the plan or an output row outside the window's
// outputs; a pushing source also checks that the plan row holds its own token (check_source).
// Opening a peer's window checks that every span it published holds what its row counts claim
// (comm::Transport::node_window), so a source never writes past the memory the receiver gave.
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

struct ReceiveWindow {
  // The outputs; null when the call has none (scales without FP8, ids in the expanded layout,
  // weights without topk_weights, metadata for a cached dispatch).
  std::byte* x = nullptr;
  std::uint32_t* scales = nullptr;
  std::int64_t* ids = nullptr;
  float* weights = nullptr;
  std::int32_t* metadata = nullptr;  // [plan rows, k + 2]
  std::int64_t out_rows = 0;         // rows of x, scales and weights
  ScaleLayout scale_layout;
  // The receive plan (routing::RoutingPlan): per plan row its source, its token at the source,
  // its master lane, its local expert ids [k] and (expanded) its output rows [k].
  const routing::RowSource* rows = nullptr;
  const std::int32_t* row_token = nullptr;
  const std::int32_t* master_lane = nullptr;
  const std::int32_t* local_ids = nullptr;
  const std::int32_t* expanded_rows = nullptr;
  std::int64_t num_rows = 0;
};

// One token's data at its source (or in the record it travelled in).
struct RowInput {
  const std::byte* payload = nullptr;
  const std::uint32_t* scales = nullptr;  // FP8
  std::int64_t scale_step = 1;            // elements between scale columns
  const float* weights = nullptr;         // [k], when the call has weights
};

// Writes plan row i of `w` (its output rows, scales, ids, weights, metadata) from `in`.
void write_row(const ReceiveWindow& w, const WindowShape& shape, std::int64_t i, const RowInput& in);
// Throws StateError unless plan row i of `w` exists and holds token `token` of rank `source`.
void check_source(const ReceiveWindow& w, std::int64_t i, int source, std::int64_t token, int window_rank);

// Publication over a transport that offers windows: what a rank publishes (a node all-gather
// carries it) and the window a node peer's publication opens here.
struct PublishedWindow {
  comm::Transport::PublishedSpan x, scales, ids, weights, metadata, rows, row_token, master_lane, local_ids,
      expanded_rows;
  std::int64_t out_rows, num_rows, scale_block, scale_columns;
};
PublishedWindow publish_window(comm::Transport& transport, const ReceiveWindow& w, const WindowShape& shape);
// StateError (naming `rank`) when a span is smaller than the window's counts need.
ReceiveWindow open_window(const comm::Transport& transport, int rank, const PublishedWindow& published,
                          const WindowShape& shape);

}  // namespace moe_ep::engine
