// ElasticBuffer (DeepEP V2) dispatch and combine, on 2 ranks as threads of this process.
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
#include <moe_ep/elastic_buffer.hpp>
#include <moe_ep/group.hpp>
#include <moe_ep/tensor.hpp>

#include "example_common.hh"  // the routing, the inputs and the check every example shares

using namespace example;

int main() {
  std::atomic<int> mismatches{0};
  try {
    moe_ep::LocalWorld world(kRanks);  // ranks as threads of this process
    world.run([&](moe_ep::Group& group) {
      const Inputs in = make_inputs(group.rank());
      moe_ep::ElasticBuffer buffer(group, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk});
      auto received = buffer.dispatch({.x = in.x, .topk_idx = in.topk_idx, .topk_weights = in.topk_weights,
                                       .num_experts = kExperts});
      // The experts produce y, one row per received row, weights already applied.
      moe_ep::Tensor y = run_experts(group.rank(), received);
      auto combined = buffer.combine({.x = y, .handle = received.handle});
      mismatches += check(group.rank(), in, combined.combined_x);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_buffer: %s\n", e.what());
    return 1;
  }
  return exit_status("elastic_buffer", mismatches);
}
