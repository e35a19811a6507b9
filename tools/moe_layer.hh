// The MoE layer that `moe-ep run` pushes through dispatch and combine, and its single-threaded
// reference.
//
// Per rank: BF16 activations x [N, H] (N varies a little by rank), a router that picks top-k
// distinct experts per token from skewed logits (expert popularity follows a Zipf law over a
// seeded permutation, so hot experts land on random ranks) with softmax weights over the chosen
// logits. Expert e computes f_e(x)[h] = x[h] * scale_e[h] + bias_e[h] (FP32, x dequantized when
// dispatched as FP8): every expert differs, so a token routed to the wrong expert or rank changes
// the result. The destination applies the routing weights before combine (combine sums):
//   compact layout:  row = bf16( sum over the token's local lanes j, ascending, of w_j * f_ej(x) )
//   expanded layout: row = bf16( w_j * f_ej(x) )
// The reference computes every token's final output with the reduction order of
// docs/semantics.md, from the inputs of all ranks, without the library: its BF16 roundings, FP8
// and NVFP4 casts and LogFMT codes come from the format definitions of tests/reference
// (numeric_reference, logfmt_reference), which share no code with src/. The FP8 inputs of a batch
// are cast with them too; the experts decode what they receive with them.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/dispatcher.hpp"
#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "moe_ep/tensor.hpp"

namespace moe_ep::tools {

struct LayerConfig {
  int ranks = 8;
  int scaleout = 1;
  bool allow_hybrid = true;
  bool multi = true;
  int tokens = 256;  // num_max_tokens_per_rank
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  bool fp8 = false;
  // NVFP4 low-latency dispatch (E2M1 values, per-16 E4M3 scales from nvfp4_global_scale, one value
  // for the whole layer as engines calibrate it; or UE8M0 scales); the experts dequantize.
  bool nvfp4 = false;
  bool nvfp4_ue8m0 = false;
  float nvfp4_global_scale = 448.0f;  // 448 * 6 / 6: amax 6 maps to the largest scale
  // LogFMT low-latency combine; the experts are then scaled by 1/8 so that most of their outputs
  // are below 1 (LogFMT compresses only those blocks).
  bool logfmt = false;
  bool expand = false;
  int alignment = 1;
  double skew = 0.8;  // Zipf exponent of expert popularity
  // Expanded lanes are bf16(w * bf16(f(x))) (the dispatcher's low-latency format on V2: the
  // experts return unweighted rows, the dispatcher weights them before V2's combine).
  bool lanes_weighted_after_rounding = false;
  // The combine sums in HybridEP's order (the dispatcher's kHybridEp format; docs/hybrid-ep.md).
  bool hybrid_ep_order = false;
  std::uint64_t seed = 1;

  int tokens_on(int rank) const;  // N of a rank, <= tokens
};

struct RankBatch {
  int rank = 0;      // the rank whose tokens these are
  Tensor x;          // bfloat16 [N, H]
  Tensor x_fp8;      // float8_e4m3fn [N, H] (FP8 only)
  Tensor x_scales;   // float32 [N, H/128] (FP8 only)
  Tensor x_global_scale;  // float32 scalar (NVFP4 only)
  Tensor topk_idx;   // int64 [N, k]
  Tensor topk_weights;  // float32 [N, k]
};

RankBatch make_batch(const LayerConfig& config, int rank);
// The router alone: fills topk_idx and topk_weights for `num_tokens` tokens of `rank`.
void route(const LayerConfig& config, int rank, int num_tokens, Tensor& topk_idx, Tensor& topk_weights);

// Per-expert parameters, float32 [E, H] each.
struct ExpertParams {
  Tensor scale;
  Tensor bias;
};
ExpertParams make_experts(const LayerConfig& config);

// Runs the local experts on a dispatch result; returns the combine input (BF16, rows of the
// dispatch layout; padding and rows past the real count are zero).
Tensor run_experts(const LayerConfig& config, const ExpertParams& params, int rank, const DispatchResult& received);

// The experts on a dispatcher output, per its format: normal rows as the compact layout above,
// expanded rows as the expanded layout, the low-latency slab unweighted (as below).
Tensor run_experts(const LayerConfig& config, const ExpertParams& params, int rank, const DispatchOutput& received);

// The expected combine output of every token of a rank's batch, [N, H] BF16.
Tensor reference_output(const LayerConfig& config, const ExpertParams& params, const RankBatch& batch);

// Low-latency mode (V1): the experts return unweighted rows bf16(f_e(x)) into the slab
// [El, R*N, H]; combine applies the weights: out[t] = bf16(sum over lanes j, ascending, of
// w_j * f_ej(x)), FP32 products summed in order, the first taken as is. With NVFP4, x is the
// dequantized cast e2m1(q) * sf / gs (or e2m1(q) * 2^(sf - 127)); with LogFMT, each f_ej(x) row
// is what its LogFMT encoding decodes to (FP32, not rounded) before the weighted sum.
Tensor run_experts_low_latency(const LayerConfig& config, const ExpertParams& params, int rank,
                               const LowLatencyDispatchResult& received);
Tensor reference_low_latency_output(const LayerConfig& config, const ExpertParams& params, const RankBatch& batch);

}  // namespace moe_ep::tools
