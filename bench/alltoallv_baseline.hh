// The baseline of `moe-ep bench --transport mpi`: dispatch and combine written the way users
// write them with plain MPI and no expert-parallel library.
//
// Dispatch: each token goes once to every distinct rank among its top-k experts (in lane order).
// The ranks exchange per-destination counts with MPI_Alltoall, pack the rows of each (token, rank)
// pair into a send buffer grouped by destination and their metadata (scales, top-k ids, weights)
// into another, and exchange both with MPI_Alltoallv: the rows straight into recv_x (two copies of
// a row: the pack and MPI's transfer, as a careful MPI code does it), the metadata into a buffer
// unpacked into its tensors; source-major then token order (the same rows, in the same order, as
// ElasticBuffer's compact layout).
// Combine: the expert outputs, in receive order, go back with MPI_Alltoallv; each token's rows
// are summed in FP32 in the order of the lanes that first name each rank, then rounded to BF16
// once (the one-node result of ElasticBuffer::combine).
// Buffers and outputs are kept between calls (as a caching allocator would): the returned tensors
// view them and stay valid until the next call of the same kind. Counts beyond INT_MAX bytes per
// peer are rejected (MPI's int counts). The collectives are MPI's nonblocking ones completed by
// polling, so that a rank that never takes part is a TimeoutError after MOE_EP_TIMEOUT_SECS.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "moe_ep/tensor.hpp"

namespace moe_ep::bench {

struct BaselineDispatch {
  Tensor recv_x;              // x's dtype [rows, hidden]
  Tensor recv_x_scales;       // float32 [rows, P] (when scales were given)
  Tensor recv_topk_idx;       // int64 [rows, k], global expert ids
  Tensor recv_topk_weights;   // float32 [rows, k]
  std::vector<int> recv_counts;  // [R] rows from each source
  std::int64_t num_tokens = 0, num_topk = 0;
  // For the combine: rows sent to each destination, and, per token, where its rows come back.
  std::vector<int> send_counts;              // [R]
  std::vector<std::int32_t> return_rows;     // [N * k]: row in the combine receive buffer, per first lane of a rank, else -1
};

class AlltoallvBaseline {
 public:
  explicit AlltoallvBaseline(MPI_Comm comm);  // duplicates comm
  ~AlltoallvBaseline();
  AlltoallvBaseline(const AlltoallvBaseline&) = delete;
  AlltoallvBaseline& operator=(const AlltoallvBaseline&) = delete;

  // x: [N, hidden] (any 1- or 2-byte dtype), scales: optional float32 [N, P], topk_idx: int64
  // [N, k] (-1 = none), topk_weights: float32 [N, k]; all rows contiguous.
  BaselineDispatch dispatch(const TensorView& x, const TensorView& scales, const TensorView& topk_idx,
                            const TensorView& topk_weights, int num_experts);
  // y: bfloat16 [rows of d, hidden]; returns bfloat16 [N, hidden].
  Tensor combine(const BaselineDispatch& d, const TensorView& y);

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::vector<std::byte> send_, recv_, send_meta_, recv_meta_;
  Tensor kept_x_, kept_scales_, kept_ids_, kept_weights_, kept_out_;
};

}  // namespace moe_ep::bench
