// The low-latency format on V2: the expanded dispatch output (expert groups aligned to R x cap
// rows) turned into the per-expert slab [El, R x cap, H] that V1 low-latency mode returns, and
// the slab of expert outputs turned back into expanded rows for V2's combine
// (docs/dispatcher.md §5).
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/dispatch_types.hpp"

namespace moe_ep::dispatcher {

struct V2Slab {
  Tensor hidden_states;  // [El, rows_per_expert, H], dtype of the dispatched rows
  Tensor scales;         // FP8: [El, rows_per_expert, S], token stride 1 (V1's layout)
  Tensor masked_m;       // int32 [El]
  std::vector<std::int64_t> starts;  // expanded row where expert i's group starts
  std::vector<std::int32_t> counts;
  std::int64_t rows_per_expert = 0;
};

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
