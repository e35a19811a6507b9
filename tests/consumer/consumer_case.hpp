// A small MoE case for the installed-package consumers: each rank routes 4 tokens to 2 of 4
// experts through an ElasticBuffer, the "experts" scale a row by (global expert id + 1) and by
// its routing weight, and the combined output must be the sum over top-k of weight * (id + 1) * x,
// which check() recomputes from the routing alone (small integers and halves: exact in BF16).
// Uses the installed public headers only. run_case() returns the number of mismatching elements.
#pragma once

#include <cstdint>
#include <cstdio>

#include <moe_ep/dtype.hpp>
#include <moe_ep/elastic_buffer.hpp>
#include <moe_ep/group.hpp>
#include <moe_ep/limits.hpp>
#include <moe_ep/tensor.hpp>

namespace consumer {

constexpr int kTokens = 4, kHidden = 128, kTopk = 2, kExpertsPerRank = 2;
static_assert(kTopk <= moe_ep::kMaxTopk && kHidden <= moe_ep::kMaxHidden, "the case is within the library's limits");

inline float value(int rank, int token, int h) { return static_cast<float>((5 * rank + token + 2 * h) % 9 - 4); }
inline std::int64_t expert(int rank, int token, int lane, int num_experts) {
  if (rank == 0 && token == 1 && lane == 0) return -1;  // a masked lane
  return (rank + 2 * token + lane * (1 + token % 3)) % num_experts;
}
inline float weight(int lane) { return lane == 0 ? 0.5f : 1.0f; }

inline int run_case(moe_ep::Group& group) {
  const int rank = group.rank(), num_experts = kExpertsPerRank * group.size();
  auto x = moe_ep::Tensor::empty({kTokens, kHidden}, moe_ep::DType::kBF16);
  auto topk_idx = moe_ep::Tensor::empty({kTokens, kTopk}, moe_ep::DType::kInt64);
  auto topk_weights = moe_ep::Tensor::empty({kTokens, kTopk}, moe_ep::DType::kFP32);
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) x.data_as<std::uint16_t>()[t * kHidden + h] = moe_ep::float_to_bf16(value(rank, t, h));
    for (int j = 0; j < kTopk; ++j) {
      topk_idx.data_as<std::int64_t>()[t * kTopk + j] = expert(rank, t, j, num_experts);
      topk_weights.data_as<float>()[t * kTopk + j] = weight(j);
    }
  }
  moe_ep::ElasticBuffer buffer(group, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk});
  auto received = buffer.dispatch({.x = x, .topk_idx = topk_idx, .topk_weights = topk_weights, .num_experts = num_experts});
  const std::int64_t rows = received.recv_x.size(0);
  auto y = moe_ep::Tensor::empty({rows, kHidden}, moe_ep::DType::kBF16);
  for (std::int64_t m = 0; m < rows; ++m) {
    for (int h = 0; h < kHidden; ++h) {
      float sum = 0;
      for (int j = 0; j < kTopk; ++j) {
        const std::int64_t local = received.recv_topk_idx.data_as<std::int64_t>()[m * kTopk + j];
        if (local < 0) continue;
        sum += received.recv_topk_weights.data_as<float>()[m * kTopk + j] *
               static_cast<float>(rank * kExpertsPerRank + local + 1) *
               moe_ep::bf16_to_float(received.recv_x.data_as<std::uint16_t>()[m * kHidden + h]);
      }
      y.data_as<std::uint16_t>()[m * kHidden + h] = moe_ep::float_to_bf16(sum);
    }
  }
  auto combined = buffer.combine({.x = y, .handle = received.handle});
  int mismatches = 0;
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) {
      float expected = 0;
      for (int j = 0; j < kTopk; ++j) {
        const std::int64_t e = expert(rank, t, j, num_experts);
        if (e >= 0) expected += weight(j) * static_cast<float>(e + 1) * value(rank, t, h);
      }
      const float got = moe_ep::bf16_to_float(combined.combined_x.data_as<std::uint16_t>()[t * kHidden + h]);
      if (got != expected && mismatches++ < 5) {
        std::fprintf(stderr, "rank %d token %d element %d: combined %g, expected %g\n", rank, t, h, got, expected);
      }
    }
  }
  return mismatches;
}

}  // namespace consumer
