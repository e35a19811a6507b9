// References for the low-latency format (the per-expert slab), shared by the V1 low-latency
// tests and the dispatcher tests: which rows each expert's slab holds, what they contain, and
// the weighted combine. Written from docs/legacy.md and docs/dispatcher.md with plain loops.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "moe_ep/tensor.hpp"
#include "reference/dense_reference.hh"

namespace moe_ep::reference {

// A low-latency case: up to N tokens per rank (rank 1 has none, others N - r % 3), 15% masked lanes.
CaseSpec low_latency_spec(int ranks, int scaleout, int experts, int k, int N, int hidden, std::uint64_t seed,
                          double skew);

// The (source, token) pairs of local expert i of `dest`, in slab order.
std::vector<std::pair<int, int>> expert_rows(const CaseSpec& s, const std::vector<RankInputs>& all, int dest, int i);

struct SlabFormat {
  bool fp8 = false, round_scale = false, ue8m0 = false;
  std::int64_t rows_per_expert = 0;  // R x N
};

// Checks counts, rows (BF16 copies, or the reference per-128 FP8 cast of numeric_reference.hh, with
// scales of token stride 1) of
// the slab `recv_x` [El, R*N, H] against every rank's inputs; appends one line per problem.
void check_slab(const CaseSpec& s, const SlabFormat& f, const std::vector<RankInputs>& all, int me,
                const TensorView& recv_x, const TensorView& recv_x_scales, const TensorView& counts,
                std::vector<std::string>& bad);

// Expert outputs in the slab [El, R*N, H]: row `row` of expert i = s.value(me, i, source token).
Tensor slab_expert_outputs(const CaseSpec& s, const std::vector<RankInputs>& all, int me, std::int64_t rows_per_expert);

// V1 low-latency combine: out[t] = bf16(sum over valid lanes, ascending, of w * y), the first
// product taken as is (y = s.value of the lane's expert).
std::vector<std::uint16_t> low_latency_combine_reference(const CaseSpec& s, const RankInputs& in, int me);

}  // namespace moe_ep::reference
