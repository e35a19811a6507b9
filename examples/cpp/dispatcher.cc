// The token dispatcher, as an engine's MoE layer calls it, on 2 ranks as threads of this process.
//
// A prefill batch (normal mode) then a decode batch (low-latency mode: the mode is auto unless
// MOE_EP_MODE says otherwise); V1 by default, V2 with MOE_EP_USE_V2=1. Every rank routes its
// tokens to 2 of 4 experts (2 experts per rank; one lane of one token masked with -1); the
// "experts" multiply a row by (global expert id + 1), so the combined output of every token
// must be the sum over its top-k lanes of weight * (id + 1) * x. This program computes that sum
// by hand from its own routing and checks every element (small integers and halves: exact in
// BF16 and FP32), whichever output format the dispatcher returns. Exits 0 when all match.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>

#include <moe_ep/dispatcher.hpp>
#include <moe_ep/dtype.hpp>
#include <moe_ep/group.hpp>
#include <moe_ep/tensor.hpp>

#include "example_common.hh"  // the routing, the inputs and the check every example shares

namespace {

using namespace example;

int batch_tokens(moe_ep::BatchKind kind) { return kind == moe_ep::BatchKind::kPrefill ? 6 : 3; }
Inputs make_inputs(int rank, moe_ep::BatchKind kind) { return example::make_inputs(rank, batch_tokens(kind)); }

// The expert outputs in the shape the output format asks for (docs/dispatcher.md §5).
moe_ep::Tensor run_experts(int rank, const moe_ep::DispatchOutput& out) {
  const moe_ep::Tensor& hs = out.hidden_states;
  auto y = moe_ep::Tensor::zeros(hs.shape(), moe_ep::DType::kBF16);
  auto* y_bf16 = y.data_as<std::uint16_t>();
  switch (out.format) {
    case moe_ep::OutputFormat::kNormal:  // one row per received token: weighted sum over its local experts
      for (std::int64_t m = 0; m < hs.size(0); ++m) {
        for (int h = 0; h < kHidden; ++h) {
          float sum = 0;
          for (int j = 0; j < kTopk; ++j) {
            const std::int64_t local = out.topk_ids.data_as<std::int64_t>()[m * kTopk + j];
            if (local >= 0) {
              sum += out.topk_weights.data_as<float>()[m * kTopk + j] * expert_factor(rank, local) *
                     bf16_at(hs, m * hs.stride(0) + h * hs.stride(1));
            }
          }
          y_bf16[m * kHidden + h] = moe_ep::float_to_bf16(sum);
        }
      }
      break;
    case moe_ep::OutputFormat::kV2Expanded: {  // one row per (token, local expert), weighted
      std::int64_t begin = 0;
      for (int e = 0; e < kExpertsPerRank; ++e) {
        for (std::int64_t m = begin; m < begin + out.masked_m.data_as<std::int32_t>()[e]; ++m) {
          for (int h = 0; h < kHidden; ++h) {
            y_bf16[m * kHidden + h] = moe_ep::float_to_bf16(out.topk_weights.data_as<float>()[m] * expert_factor(rank, e) *
                                                           bf16_at(hs, m * hs.stride(0) + h * hs.stride(1)));
          }
        }
        begin += out.num_recv_tokens_per_expert[e];
      }
      break;
    }
    case moe_ep::OutputFormat::kLowLatency:  // the slab [local experts, slots, H], unweighted
      for (int e = 0; e < kExpertsPerRank; ++e) {
        for (std::int64_t s = 0; s < out.masked_m.data_as<std::int32_t>()[e]; ++s) {
          for (int h = 0; h < kHidden; ++h) {
            y_bf16[(e * hs.size(1) + s) * kHidden + h] = moe_ep::float_to_bf16(
                expert_factor(rank, e) * bf16_at(hs, e * hs.stride(0) + s * hs.stride(1) + h * hs.stride(2)));
          }
        }
      }
      break;
  }
  return y;
}

void report(moe_ep::BatchKind kind, const moe_ep::DispatchOutput& out) {
  std::printf("dispatcher: %s batch: %s, %s mode, %s output\n", kind == moe_ep::BatchKind::kPrefill ? "prefill" : "decode",
              moe_ep::generation_name(out.generation), moe_ep::mode_name(out.mode), moe_ep::format_name(out.format));
}

}  // namespace

int main() {
  std::atomic<int> mismatches{0};
  try {
    moe_ep::LocalWorld world(kRanks);  // ranks as threads of this process
    world.run([&](moe_ep::Group& group) {
      moe_ep::BufferCache buffers(group);  // one per group: layers share its buffer
      moe_ep::TokenDispatcher layer(buffers, {.hidden = kHidden, .num_experts = kExperts, .num_topk = kTopk});
      for (auto kind : {moe_ep::BatchKind::kPrefill, moe_ep::BatchKind::kDecode}) {
        const Inputs in = make_inputs(group.rank(), kind);
        auto out = layer.dispatch(in.x, in.topk_idx, in.topk_weights, kind);
        // out.format: kNormal rows, kV2Expanded rows, or the kLowLatency slab with masked_m
        moe_ep::Tensor expert_output = run_experts(group.rank(), out);
        auto combined = layer.combine(expert_output);
        mismatches += check(group.rank(), in, combined);
        if (group.rank() == 0) report(kind, out);
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dispatcher: %s\n", e.what());
    return 1;
  }
  return exit_status("dispatcher", mismatches);
}
