// Internal calls of ElasticBuffer for the layer above it (the dispatcher): its dispatch and
// combine with engine options that DeepEP's API (DispatchArgs, CombineArgs) does not have. The
// arguments are translated exactly as ElasticBuffer::dispatch / combine translate them; the
// extras are then set on the engine request (engine::DispatchRequest / CombineRequest).
#pragma once

#include "moe_ep/dispatch_types.hpp"
#include "moe_ep/elastic_buffer.hpp"

namespace moe_ep::elastic {

struct DispatchExtras {
  // engine::DispatchRequest::expert_stride: with do_expand, local expert i's rows start at row
  // i x expert_stride (at most that many); with use_tma_aligned_col_major_sf the scales are
  // column-major per expert block, storage [El, S, expert_stride] viewed [El, expert_stride, S].
  int expert_stride = 0;
};

struct CombineExtras {
  // engine::CombineRequest::row_weights: float32 [expanded rows]; row r of x counts as
  // bf16(row_weights[r] * float(x[r])).
  TensorView row_weights;
  // engine::CombineRequest::sum_weights_over_ranks: combined_topk_weights sums every unit's whole
  // weight row (compact layout).
  bool sum_weights_over_ranks = false;
  // engine::CombineRequest::own_node_rank_terms: in hybrid mode with multiple reduction, this
  // node's rank units are terms of the final sum, not one rounded node unit.
  bool own_node_rank_terms = false;
};

class Access {
 public:
  static DispatchResult dispatch(ElasticBuffer& buffer, const DispatchArgs& args, const DispatchExtras& extras);
  static CombineResult combine(ElasticBuffer& buffer, const CombineArgs& args, const CombineExtras& extras);
};

}  // namespace moe_ep::elastic
