// Dense, single-threaded reference for dispatch and combine, written from docs/semantics.md with
// plain loops over every rank's inputs. It shares no code with src/ (its BF16 conversions are
// those of numeric_reference.hh), so it checks the library's routing, ordering, reduction and
// rounding independently.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <vector>

namespace moe_ep::reference {

struct CaseSpec {
  int ranks = 1;
  int num_experts = 1;
  int k = 1;
  int max_tokens = 1;  // T
  int hidden = 128;
  int scaleout = 1;    // physical nodes
  bool allow_hybrid = true;
  bool multi = true;   // allow_multiple_reduction
  bool fp8 = false;
  int scale_cols = 0;  // P for FP8 (float32 scales)
  // > 0: x holds random bits in elements of this many bytes (1, 2 or 4: a payload dtype other
  // than bfloat16 and FP8, which moves bit for bit); 0: bfloat16, or FP8 codes with fp8.
  int payload_element_bytes = 0;
  bool expand = false;
  int alignment = 1;
  bool weights = true;
  int num_bias = 0;
  double mask_ratio = 0.0;  // chance of -1 per top-k slot
  double skew = 0.0;        // 0 uniform; larger values favour low expert ids
  std::uint64_t seed = 1;
  std::vector<int> tokens;  // per rank, <= max_tokens
  // Expanded lanes arrive weighted: bf16(w_j x expert_value) (the dispatcher's low-latency
  // format on V2, which weights each lane before V2's unweighted combine).
  bool weight_lanes = false;
  // Routing shapes: 0 drawn per token (k distinct experts by affinity); 1 every token of a rank
  // has the same ids (one drawn row, repeated); 2 every token of every rank goes to experts of
  // one rank only (lanes past that rank's experts are -1). Masks apply on top.
  int routing_style = 0;
  // BF16 x drawn over magnitudes 2^-24 .. 2^8 instead of N(0, 1), so that FP8 casts meet
  // subnormals, ties and the whole exponent range.
  bool wide_range = false;
  // Per rank [n * k]: when given, the routing of that rank. Weights stay those drawn for the drawn
  // routing (0 where it was masked, or where the fixed id is -1): use mask_ratio = 0 with it.
  std::vector<std::vector<std::int64_t>> fixed_topk;
  // Expert outputs; null: expert_value below.
  using ValueFn = std::uint16_t (*)(int dest, int local_expert, int src_global, int h);
  ValueFn values = nullptr;
  // For checks of the tests' own sensitivity: combine levels summed in descending key order
  // instead of the documented ascending one (bit 0: level 1, bit 1: level 2, bit 2: final sum).
  int reversed_levels = 0;

  int experts_per_rank() const { return num_experts / ranks; }
  int row_bytes() const { return hidden * (payload_element_bytes > 0 ? payload_element_bytes : fp8 ? 1 : 2); }
  bool hybrid() const { return allow_hybrid && scaleout > 1; }
  int routing_nodes() const { return hybrid() ? scaleout : 1; }
  std::uint16_t value(int dest, int local_expert, int src_global, int h) const;
};

struct RankInputs {
  int num_tokens = 0;
  std::vector<std::uint8_t> x;         // [n, row_bytes]
  std::vector<std::uint32_t> scales;   // [n, P] (FP8)
  std::vector<std::int64_t> topk;      // [n, k]
  std::vector<float> weights;          // [n, k]
  std::vector<std::vector<std::uint16_t>> bias;  // num_bias x [n, hidden]
};

// Deterministic in (spec.seed, rank).
RankInputs make_inputs(const CaseSpec& spec, int rank);
// Every rank's inputs, in rank order.
std::vector<RankInputs> make_all_inputs(const CaseSpec& spec);

struct ReceivedRow {
  int source;
  int token;
  int master_lane;
  std::vector<std::int64_t> local_ids;  // [k]
  std::vector<int> expanded_rows;       // [k], -1 where not local (expand only)
};

struct RefDispatch {
  std::vector<ReceivedRow> rows;          // compact order
  std::vector<int> unaligned;             // [El]
  std::vector<int> start;                 // [El] start of each expert block (aligned prefix)
  int expanded_rows = 0;                  // sum of aligned counts
  // expanded row -> (row index in `rows`, lane), -1 for padding
  std::vector<std::pair<int, int>> expanded_owner;
  std::vector<int> per_source;            // [R] rows from each source
};

RefDispatch reference_dispatch(const CaseSpec& spec, const std::vector<RankInputs>& all, int dest);

// Expert outputs used by the tests: a row for a (destination, source token) in the compact
// layout, or for (destination, local expert, source token) in the expanded layout.
std::uint16_t expert_value(int dest, int local_expert, int src_global, int h);

struct RefCombine {
  std::vector<std::uint16_t> x;  // [n, hidden]
  std::vector<float> weights;    // [n, k]
};

// weight_scale: combine's topk_weights are the received weights times this factor.
RefCombine reference_combine(const CaseSpec& spec, const std::vector<RankInputs>& all, int source, float weight_scale);

}  // namespace moe_ep::reference
