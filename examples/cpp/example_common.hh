// What the C++ examples share, none of it moe-ep's API: the routing every example uses (2 ranks as
// threads, 4 experts, 2 per rank, top-2, one lane of one token masked with -1), the inputs built
// from it, and the check of a combined output against the sum computed by hand.
//
// Values are small integers and halves, so every product and sum below is exact in BF16 and FP32:
// the combined output of token t must equal, element for element, the sum over its top-k lanes of
// weight(lane) * (global expert id + 1) * value(rank, t, h). Each example keeps its calls of the
// library (buffer, dispatch, combine) in its own file; the expert computation on compact received
// rows (run_experts) is shared by the two buffer examples.
#pragma once

#include <cstdint>
#include <cstdio>

#include <moe_ep/dtype.hpp>
#include <moe_ep/tensor.hpp>

namespace example {

constexpr int kRanks = 2, kTokens = 4, kHidden = 128, kExperts = 4, kTopk = 2;
constexpr int kExpertsPerRank = kExperts / kRanks;

struct Inputs {
  int tokens = 0;
  moe_ep::Tensor x;             // bfloat16 [tokens, kHidden]
  moe_ep::Tensor topk_idx;      // int64 [tokens, kTopk], -1 = no expert
  moe_ep::Tensor topk_weights;  // float32 [tokens, kTopk]
};

inline float value(int rank, int token, int h) { return static_cast<float>((3 * rank + token + h) % 9 - 4); }
inline std::int64_t expert(int rank, int token, int lane) {
  if (rank == 1 && token == 2 && lane == 1) return -1;  // a masked lane
  return (rank + token + lane * (1 + token % 3)) % kExperts;  // two different experts per token
}
inline float weight(int lane) { return lane == 0 ? 1.0f : 0.5f; }
// What the "expert" local_expert of `rank` multiplies a row by: its global id + 1.
inline float expert_factor(int rank, std::int64_t local_expert) {
  return static_cast<float>(rank * kExpertsPerRank + local_expert + 1);
}

inline Inputs make_inputs(int rank, int tokens = kTokens) {
  Inputs in{tokens, moe_ep::Tensor::empty({tokens, kHidden}, moe_ep::DType::kBF16),
            moe_ep::Tensor::empty({tokens, kTopk}, moe_ep::DType::kInt64),
            moe_ep::Tensor::empty({tokens, kTopk}, moe_ep::DType::kFP32)};
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < kHidden; ++h) in.x.data_as<std::uint16_t>()[t * kHidden + h] = moe_ep::float_to_bf16(value(rank, t, h));
    for (int j = 0; j < kTopk; ++j) {
      in.topk_idx.data_as<std::int64_t>()[t * kTopk + j] = expert(rank, t, j);
      in.topk_weights.data_as<float>()[t * kTopk + j] = weight(j);
    }
  }
  return in;
}

inline float bf16_at(const moe_ep::Tensor& t, std::int64_t i) { return moe_ep::bf16_to_float(t.data_as<std::uint16_t>()[i]); }

// Mismatches between the combined output and the sum over top-k computed from this rank's routing.
inline int check(int rank, const Inputs& in, const moe_ep::Tensor& combined) {
  int mismatches = 0;
  for (int t = 0; t < in.tokens; ++t) {
    for (int h = 0; h < kHidden; ++h) {
      float expected = 0;
      for (int j = 0; j < kTopk; ++j) {
        if (expert(rank, t, j) >= 0) expected += weight(j) * static_cast<float>(expert(rank, t, j) + 1) * value(rank, t, h);
      }
      const float got = bf16_at(combined, t * kHidden + h);
      if (got != expected && mismatches++ < 5) {
        std::fprintf(stderr, "rank %d token %d element %d: combined %g, expected %g\n", rank, t, h, got, expected);
      }
    }
  }
  return mismatches;
}

// The experts of this rank on the rows a compact dispatch (V1 normal mode, V2 without do_expand)
// received: one output row per received row, the weighted sum over the row's experts that live
// here (lanes of other ranks carry -1). `Received` is DispatchResult or LegacyDispatchResult.
template <class Received>
moe_ep::Tensor run_experts(int rank, const Received& received) {
  const std::int64_t rows = received.recv_x.size(0);
  auto y = moe_ep::Tensor::empty({rows, kHidden}, moe_ep::DType::kBF16);
  for (std::int64_t m = 0; m < rows; ++m) {
    for (int h = 0; h < kHidden; ++h) {
      const float x = bf16_at(received.recv_x, m * kHidden + h);
      float sum = 0;
      for (int j = 0; j < kTopk; ++j) {
        const std::int64_t local = received.recv_topk_idx.template data_as<std::int64_t>()[m * kTopk + j];
        if (local < 0) continue;  // that lane's expert lives on another rank
        sum += received.recv_topk_weights.template data_as<float>()[m * kTopk + j] * expert_factor(rank, local) * x;
      }
      y.data_as<std::uint16_t>()[m * kHidden + h] = moe_ep::float_to_bf16(sum);
    }
  }
  return y;
}

// The example's exit status, with its last line: 0 when every element of every rank matched.
inline int exit_status(const char* example, int mismatches) {
  if (mismatches != 0) {
    std::printf("%s: %d mismatching elements\n", example, mismatches);
    return 1;
  }
  std::printf("%s: %d ranks, combine = sum over top-k of the expert outputs: OK\n", example, kRanks);
  return 0;
}

}  // namespace example
