// The V1 Buffer (DeepEP's first generation) in normal mode, on 2 ranks as threads of this process:
// get_dispatch_layout, dispatch, expert computation, combine.
//
// Every rank routes 4 tokens to 2 of 4 experts (2 experts per rank; one lane of one token is
// masked with -1). The "experts" multiply a received row by (global expert id + 1) and by the
// routing weight, so combine must return, for every token, the sum over its top-k lanes of
// weight * (id + 1) * x. This program computes that sum by hand from its own routing and checks
// every element (small integers and halves: exact in BF16 and FP32). Exits 0 when all match.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>

#include <moe_ep/dtype.hpp>
#include <moe_ep/group.hpp>
#include <moe_ep/legacy_buffer.hpp>
#include <moe_ep/tensor.hpp>

namespace {

constexpr int kRanks = 2, kTokens = 4, kHidden = 128, kExperts = 4, kTopk = 2;
constexpr int kExpertsPerRank = kExperts / kRanks;

struct Inputs {
  moe_ep::Tensor x;             // bfloat16 [kTokens, kHidden]
  moe_ep::Tensor topk_idx;      // int64 [kTokens, kTopk], -1 = no expert
  moe_ep::Tensor topk_weights;  // float32 [kTokens, kTopk]
};

float value(int rank, int token, int h) { return static_cast<float>((3 * rank + token + h) % 9 - 4); }
std::int64_t expert(int rank, int token, int lane) {
  if (rank == 1 && token == 2 && lane == 1) return -1;  // a masked lane
  return (rank + token + lane * (1 + token % 3)) % kExperts;  // two different experts per token
}
float weight(int lane) { return lane == 0 ? 1.0f : 0.5f; }

Inputs make_inputs(int rank) {
  Inputs in{moe_ep::Tensor::empty({kTokens, kHidden}, moe_ep::DType::kBF16),
            moe_ep::Tensor::empty({kTokens, kTopk}, moe_ep::DType::kInt64),
            moe_ep::Tensor::empty({kTokens, kTopk}, moe_ep::DType::kFP32)};
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) in.x.data_as<std::uint16_t>()[t * kHidden + h] = moe_ep::float_to_bf16(value(rank, t, h));
    for (int j = 0; j < kTopk; ++j) {
      in.topk_idx.data_as<std::int64_t>()[t * kTopk + j] = expert(rank, t, j);
      in.topk_weights.data_as<float>()[t * kTopk + j] = weight(j);
    }
  }
  return in;
}

// One output row per received row: the weighted sum over the row's experts that live here
// (recv_topk_idx holds local expert ids, -1 for lanes whose expert lives on another rank).
moe_ep::Tensor run_experts(int rank, const moe_ep::LegacyDispatchResult& received) {
  const std::int64_t rows = received.recv_x.size(0);
  auto y = moe_ep::Tensor::empty({rows, kHidden}, moe_ep::DType::kBF16);
  for (std::int64_t m = 0; m < rows; ++m) {
    for (int h = 0; h < kHidden; ++h) {
      const float x = moe_ep::bf16_to_float(received.recv_x.data_as<std::uint16_t>()[m * kHidden + h]);
      float sum = 0;
      for (int j = 0; j < kTopk; ++j) {
        const std::int64_t local = received.recv_topk_idx.data_as<std::int64_t>()[m * kTopk + j];
        if (local < 0) continue;
        const float w = received.recv_topk_weights.data_as<float>()[m * kTopk + j];
        sum += w * static_cast<float>(rank * kExpertsPerRank + local + 1) * x;
      }
      y.data_as<std::uint16_t>()[m * kHidden + h] = moe_ep::float_to_bf16(sum);
    }
  }
  return y;
}

// Mismatches between combine's output and the sum over top-k computed from this rank's routing.
int check(int rank, const moe_ep::Tensor& combined) {
  int mismatches = 0;
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) {
      float expected = 0;
      for (int j = 0; j < kTopk; ++j) {
        if (expert(rank, t, j) >= 0) expected += weight(j) * static_cast<float>(expert(rank, t, j) + 1) * value(rank, t, h);
      }
      const float got = moe_ep::bf16_to_float(combined.data_as<std::uint16_t>()[t * kHidden + h]);
      if (got != expected && mismatches++ < 5) {
        std::fprintf(stderr, "rank %d token %d element %d: combined %g, expected %g\n", rank, t, h, got, expected);
      }
    }
  }
  return mismatches;
}

}  // namespace

int main() {
  std::atomic<int> mismatches{0};
  try {
    moe_ep::LocalWorld world(kRanks);  // ranks as threads of this process
    world.run([&](moe_ep::Group& group) {
      const Inputs in = make_inputs(group.rank());
      // DeepEP's sizing: the scale-up pool from the default dispatch config's hint.
      const auto nvl_bytes = moe_ep::Buffer::get_dispatch_config(kRanks).get_nvl_buffer_size_hint(kHidden * 2, kRanks);
      moe_ep::Buffer buffer(group, {.num_nvl_bytes = nvl_bytes});
      auto layout = buffer.get_dispatch_layout(in.topk_idx, kExperts);
      auto received = buffer.dispatch({.x = in.x, .num_tokens_per_rank = layout.num_tokens_per_rank,
                                       .is_token_in_rank = layout.is_token_in_rank,
                                       .num_tokens_per_expert = layout.num_tokens_per_expert,
                                       .topk_idx = in.topk_idx, .topk_weights = in.topk_weights});
      // The experts produce y, one row per received row, weights already applied.
      moe_ep::Tensor y = run_experts(group.rank(), received);
      auto combined = buffer.combine({.x = y, .handle = received.handle, .topk_weights = received.recv_topk_weights});
      mismatches += check(group.rank(), combined.combined_x);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "legacy_buffer: %s\n", e.what());
    return 1;
  }
  if (mismatches != 0) {
    std::printf("legacy_buffer: %d mismatching elements\n", mismatches.load());
    return 1;
  }
  std::printf("legacy_buffer: %d ranks, combine = sum over top-k of the expert outputs: OK\n", kRanks);
  return 0;
}
