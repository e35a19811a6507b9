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

#include "example_common.hh"  // the routing, the inputs and the check every example shares

using namespace example;

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
      mismatches += check(group.rank(), in, combined.combined_x);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "legacy_buffer: %s\n", e.what());
    return 1;
  }
  return exit_status("legacy_buffer", mismatches);
}
