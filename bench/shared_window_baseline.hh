// The one-node baseline of `moe-ep bench --transport mpi`: dispatch and combine as a careful MPI
// code for ranks of one node writes them with MPI_Win_allocate_shared, no expert-parallel library.
//
// Every rank owns a segment of one shared window that every rank of the node maps.
// Dispatch: each rank copies its tokens' rows (and their scales, top-k ids, weights) into its
// segment once, with the list of tokens it sends to each rank (each token once per distinct rank
// of its top-k, in lane order); after a barrier every rank copies the rows listed for it straight
// from the sources' segments into its outputs: source-major, then the order of the list (the
// rows and order of AlltoallvBaseline and ElasticBuffer's compact layout). Two copies of a row: into
// the segment, and out of it.
// Combine: the expert outputs are read in place from the owners' segments (the bench writes them
// there: output_rows()), each token's rows summed in FP32 in the order of the lanes that first
// name each rank, rounded to BF16 once; one read of every row.
// Each call starts and ends with a barrier (a rank may rewrite its segment only once every reader
// is done). The window grows, collectively, when a call needs more. Collectives are nonblocking
// ones completed by polling: a rank that never takes part is a TimeoutError after
// MOE_EP_TIMEOUT_SECS. All ranks of the communicator must share one node (InvalidArgument
// otherwise).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "alltoallv_baseline.hh"
#include "moe_ep/tensor.hpp"

namespace moe_ep::bench {

class SharedWindowBaseline {
 public:
  explicit SharedWindowBaseline(MPI_Comm comm);  // duplicates comm; collective
  ~SharedWindowBaseline();
  SharedWindowBaseline(const SharedWindowBaseline&) = delete;
  SharedWindowBaseline& operator=(const SharedWindowBaseline&) = delete;

  // As AlltoallvBaseline::dispatch (its return_rows and counts describe the same layout). The
  // outputs stay valid until the next dispatch.
  BaselineDispatch dispatch(const TensorView& x, const TensorView& scales, const TensorView& topk_idx,
                            const TensorView& topk_weights, int num_experts);
  // bfloat16 [rows, hidden] rows of this rank's segment, where the experts write their outputs for
  // combine() to read in place (valid until the next dispatch or output_rows()). Collective.
  TensorView output_rows(std::int64_t rows, std::int64_t hidden);
  // y: the view output_rows() returned, filled; returns bfloat16 [N, hidden] (valid until the next
  // combine).
  Tensor combine(const BaselineDispatch& d, const TensorView& y);

 private:
  // One shared window: every rank's segment, mapped here; grows collectively.
  struct Window {
    MPI_Win window = MPI_WIN_NULL;
    std::size_t segment_bytes = 0;
    std::vector<std::byte*> bases;  // [rank]
    void free();
  };
  // The head of a rank's records segment: its row layout; then a table of ListEntry, one per
  // destination: where its token list (int32 token indices) lies in the segment, and its length.
  struct Head {
    std::int64_t tokens, record_bytes, row_bytes, scale_count, topk, records_at;
  };
  struct ListEntry {
    std::int64_t offset = 0, count = 0;
  };
  static constexpr std::size_t kTableAt = 64;  // after the head
  // This rank's rows, their metadata and its lists, into its segment.
  void publish(const TensorView& x, const TensorView& scales, const TensorView& topk_idx, const TensorView& topk_weights,
               const std::vector<std::vector<std::int32_t>>& lists);
  // The rows every source listed for this rank, copied from the sources' segments into the outputs.
  BaselineDispatch receive(DType dtype, const std::vector<std::vector<std::int32_t>>& lists);
  ListEntry list_entry(int source, int dest) const;
  // Makes every segment of `w` at least `bytes` long (the largest any rank asks for). Collective.
  void reserve(Window& w, std::size_t bytes);
  void barrier();

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  Window records_;  // dispatch: a header, every token's row and metadata once, the lists
  Window outputs_;  // combine: the expert outputs
  // Of the last dispatch, per (token, lane): the rank whose output row holds the lane's
  // contribution (first lane of each rank only, else -1) and the row there.
  std::vector<std::int32_t> from_rank_, from_row_;
  Tensor kept_x_, kept_scales_, kept_ids_, kept_weights_, kept_out_;
};

}  // namespace moe_ep::bench
