// The low-latency format on V2 (docs/dispatcher.md §5): the per-expert slab [El, R x cap, H]
// that V1 low-latency mode returns, made from V2's expanded dispatch.
//  - The built-in ElasticBuffer dispatches straight into it (expert stride R x cap, scales
//    column-major per expert block): slab_views only views the output, and slab_rows hands the
//    expert outputs to the weighting combine as El x R x cap rows. One copy of each row per direction.
//  - Another provider's backend offers DeepEP's API only: its expert groups aligned to R x cap are
//    moved into the slab (make_slab) and the expert outputs are weighted back into expanded rows
//    (slab_to_expanded) for its combine.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/dispatch_types.hpp"

namespace moe_ep::dispatcher {

struct V2Slab {
  Tensor hidden_states;  // [El, rows_per_expert, H], dtype of the dispatched rows
  Tensor scales;         // FP8: [El, rows_per_expert, S], token stride 1 (V1's layout)
  Tensor masked_m;       // int32 [El]
  std::vector<std::int64_t> starts;  // expanded row where expert i's group starts (make_slab)
  std::vector<std::int32_t> counts;
  std::int64_t rows_per_expert = 0;
};

// Views of an expanded dispatch with expert stride rows_per_expert: hidden_states [El, RC, H] of
// recv_x, scales the [El, RC, S] view the dispatch made, masked_m the per-expert counts.
V2Slab slab_views(const DispatchResult& dispatched, int local_experts, std::int64_t rows_per_expert);

// The combine's input rows for a slab-strided dispatch: expert_output [El, RC, H] seen as El x RC
// rows when its strides allow (expert stride = RC x row stride), else the real rows copied into a
// contiguous [El x RC, H] tensor (padding rows left unset: combine reads only real rows).
Tensor slab_rows(const V2Slab& slab, const Tensor& expert_output);

// Moves each expert's group of the expanded output to row i x rows_per_expert (in place when the
// output has room for the slab, which it has unless the cap is tiny).
V2Slab make_slab(const DispatchResult& dispatched, int local_experts, std::int64_t rows_per_expert);

// NVFP4 rows (dispatched as H/2 one-byte values and H/64 scale words) turned into V1's NVFP4
// low-latency output: values as the [R x cap, H/2, El] view of storage [El, R x cap, H/2], scales
// in the swizzled layout [El, rm, rk, 32, 4, 4] viewed [32, 4, rm, 4, rk, El] (E4M3 codes, or
// UE8M0 bytes at the start of each expert's int32 storage), bytes no row owns zero.
void to_nvfp4_layout(V2Slab& slab, int hidden, bool ue8m0);

// Expanded rows for V2's combine: row start_i + t = bf16(weight(row) x expert_output[i, t]).
Tensor slab_to_expanded(const V2Slab& slab, const DispatchResult& dispatched, const TensorView& expert_output);

}  // namespace moe_ep::dispatcher
