// Cross-check of the three APIs on the same routing: V1 normal, V1 low-latency and V2 deliver the
// same (source, token) rows to every expert, and produce the same combined outputs. Values are
// chosen so every sum is exact in BF16 and FP32 (small integers times powers of two), which makes
// the outputs independent of each path's reduction order: any difference is a routing error.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/numeric_reference.hh"

namespace moe_ep {
namespace cross_check_test {

constexpr int kRanks = 4, kExperts = 16, kTopk = 4, kTokens = 8, kHidden = 128;
constexpr int kEl = kExperts / kRanks;

struct Inputs {
  explicit Inputs(int rank) {
    std::mt19937 rng(static_cast<unsigned>(rank) * 31 + 7);
    n = 8 - rank % 2;  // ranks differ in token counts
    for (int i = 0; i < n * kHidden; ++i) x.push_back(float_to_bf16(static_cast<float>(static_cast<int>(rng() % 3) - 1)));
    for (int t = 0; t < n; ++t) {
      std::vector<int> experts(kExperts);
      for (int e = 0; e < kExperts; ++e) experts[static_cast<size_t>(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int j = 0; j < kTopk; ++j) {
        topk.push_back(rng() % 5 == 0 ? -1 : experts[static_cast<size_t>(j)]);
        weights.push_back(rng() % 2 ? 1.0f : 0.5f);
      }
    }
  }
  int n;
  std::vector<std::uint16_t> x;
  std::vector<std::int64_t> topk;
  std::vector<float> weights;
  TensorView xv() { return TensorView(x.data(), DType::kBF16, {n, kHidden}); }
  TensorView tv() { return TensorView(topk.data(), DType::kInt64, {n, kTopk}); }
  TensorView wv() { return TensorView(weights.data(), DType::kFP32, {n, kTopk}); }
};

float expert_scale(std::int64_t e) { return e % 2 ? 2.0f : 1.0f; }

// What each local expert received: (source rank, source token) in order.
using Received = std::map<int, std::vector<std::pair<int, int>>>;

struct PathResult {
  Received received;
  std::vector<std::uint16_t> combined;
};

// Compact row of a received token: the weighted sum of its local experts' outputs (exact).
void compact_row(const std::uint16_t* x, const std::int64_t* local_ids, const float* w, int rank, std::uint16_t* out) {
  for (int h = 0; h < kHidden; ++h) {
    float acc = 0.0f;
    for (int j = 0; j < kTopk; ++j)
      if (local_ids[j] >= 0) acc += w[j] * bf16_to_float(x[h]) * expert_scale(rank * kEl + local_ids[j]);
    out[h] = float_to_bf16(acc);
  }
}

PathResult run_v1_normal(Group& g, Inputs& in) {
  PathResult r;
  Buffer b(g, {.num_rdma_bytes = 4 << 20});  // across nodes, records travel through the pool
  auto layout = b.get_dispatch_layout(in.tv(), kExperts);
  auto d = b.dispatch({.x = in.xv(), .num_tokens_per_rank = layout.num_tokens_per_rank,
                       .num_tokens_per_rdma_rank = layout.num_tokens_per_rdma_rank,
                       .is_token_in_rank = layout.is_token_in_rank, .num_tokens_per_expert = layout.num_tokens_per_expert,
                       .topk_idx = in.tv(), .topk_weights = in.wv()});
  const std::int64_t M = d.recv_x.size(0);
  const auto* prefix = d.handle->recv_gbl_rank_prefix_sum.data_as<std::int32_t>();
  for (std::int64_t i = 0; i < M; ++i) {
    int src = 0;
    while (i >= prefix[src]) ++src;
    for (int j = 0; j < kTopk; ++j) {
      const std::int64_t local = d.recv_topk_idx.data_as<std::int64_t>()[i * kTopk + j];
      if (local >= 0) r.received[static_cast<int>(local)].push_back({src, d.handle->recv_src_idx.data_as<std::int32_t>()[i]});
    }
  }
  Tensor y = Tensor::empty({M, kHidden}, DType::kBF16);
  for (std::int64_t i = 0; i < M; ++i)
    compact_row(d.recv_x.data_as<std::uint16_t>() + i * kHidden, d.recv_topk_idx.data_as<std::int64_t>() + i * kTopk,
                d.recv_topk_weights.data_as<float>() + i * kTopk, g.rank(), y.data_as<std::uint16_t>() + i * kHidden);
  auto c = b.combine({.x = y, .handle = d.handle});
  r.combined.assign(c.combined_x.data_as<std::uint16_t>(), c.combined_x.data_as<std::uint16_t>() + in.n * kHidden);
  return r;
}

PathResult run_v2(Group& g, Inputs& in) {
  PathResult r;
  ElasticBuffer b(g, {.num_max_tokens_per_rank = kTokens, .hidden = kHidden, .num_topk = kTopk});
  auto d = b.dispatch({.x = in.xv(), .topk_idx = in.tv(), .topk_weights = in.wv(), .num_experts = kExperts});
  const std::int64_t M = d.recv_x.size(0);
  const auto* meta = d.handle->recv_src_metadata.data_as<std::int32_t>();
  for (std::int64_t i = 0; i < M; ++i)
    for (int j = 0; j < kTopk; ++j) {
      const std::int64_t local = d.recv_topk_idx.data_as<std::int64_t>()[i * kTopk + j];
      if (local >= 0)
        r.received[static_cast<int>(local)].push_back({meta[i * (kTopk + 2)] / kTokens, meta[i * (kTopk + 2)] % kTokens});
    }
  Tensor y = Tensor::empty({M, kHidden}, DType::kBF16);
  for (std::int64_t i = 0; i < M; ++i) {
    std::int64_t ids[kTopk];
    float w[kTopk];
    for (int j = 0; j < kTopk; ++j) {
      ids[j] = d.recv_topk_idx.data_as<std::int64_t>()[i * kTopk + j];
      w[j] = d.recv_topk_weights.data_as<float>()[i * kTopk + j];  // V2 delivers the full row
    }
    compact_row(d.recv_x.data_as<std::uint16_t>() + i * kHidden, ids, w, g.rank(), y.data_as<std::uint16_t>() + i * kHidden);
  }
  auto c = b.combine({.x = y, .handle = d.handle});
  r.combined.assign(c.combined_x.data_as<std::uint16_t>(), c.combined_x.data_as<std::uint16_t>() + in.n * kHidden);
  return r;
}

PathResult run_v1_low_latency(Group& g, Inputs& in) {
  PathResult r;
  Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(kTokens, kHidden, kRanks, kExperts),
               .low_latency_mode = true});
  auto d = b.low_latency_dispatch({.x = in.xv(), .topk_idx = in.tv(), .num_max_dispatch_tokens_per_rank = kTokens,
                                   .num_experts = kExperts, .use_fp8 = false});
  const std::int64_t slab = static_cast<std::int64_t>(kRanks) * kTokens;
  Tensor y = Tensor::zeros({kEl, slab, kHidden}, DType::kBF16);
  for (int i = 0; i < kEl; ++i)
    for (int src = 0; src < kRanks; ++src) {
      const std::int64_t range = d.handle->packed_recv_layout_range.data_as<std::int64_t>()[i * kRanks + src];
      for (std::int64_t row = range >> 32; row < (range >> 32) + (range & 0xffffffff); ++row) {
        r.received[i].push_back({src, d.handle->packed_recv_src_info.data_as<std::int32_t>()[i * slab + row]});
        for (int h = 0; h < kHidden; ++h)  // unweighted: low-latency combine applies the weights
          y.data_as<std::uint16_t>()[(i * slab + row) * kHidden + h] = float_to_bf16(
              bf16_to_float(d.recv_x.data_as<std::uint16_t>()[(i * slab + row) * kHidden + h]) * expert_scale(g.rank() * kEl + i));
      }
    }
  auto c = b.low_latency_combine({.x = y, .topk_idx = in.tv(), .topk_weights = in.wv(), .handle = d.handle});
  r.combined.assign(c.combined_x.data_as<std::uint16_t>(), c.combined_x.data_as<std::uint16_t>() + in.n * kHidden);
  return r;
}

TEST(CrossCheck, V1NormalV1LowLatencyAndV2AgreeOnRoutingAndOutputs) {
  for (int scaleout : {1, 2}) {
    std::vector<PathResult> v1(kRanks), ll(kRanks), v2(kRanks);
    LocalWorld(kRanks, {.num_scaleout = scaleout}).run([&](Group& g) {
      Inputs in(g.rank());
      const auto me = static_cast<size_t>(g.rank());
      v1[me] = run_v1_normal(g, in);
      ll[me] = run_v1_low_latency(g, in);
      v2[me] = run_v2(g, in);
    });
    for (int r = 0; r < kRanks; ++r) {
      const auto me = static_cast<size_t>(r);
      EXPECT_EQ(v1[me].received, v2[me].received) << "rank " << r << " nodes " << scaleout;
      EXPECT_EQ(ll[me].received, v2[me].received) << "rank " << r << " nodes " << scaleout;
      EXPECT_EQ(v1[me].combined, v2[me].combined) << "rank " << r << " nodes " << scaleout;
      EXPECT_EQ(ll[me].combined, v2[me].combined) << "rank " << r << " nodes " << scaleout;
      // And the outputs are what the layer computes: sum over lanes of w * x * scale.
      Inputs in(r);
      for (int t = 0; t < in.n; ++t)
        for (int h = 0; h < kHidden; ++h) {
          float expected = 0.0f;
          for (int j = 0; j < kTopk; ++j)
            if (in.topk[static_cast<size_t>(t * kTopk + j)] >= 0)
              expected += in.weights[static_cast<size_t>(t * kTopk + j)] *
                          reference::float_from_bf16(in.x[static_cast<size_t>(t * kHidden + h)]) *
                          expert_scale(in.topk[static_cast<size_t>(t * kTopk + j)]);
          ASSERT_EQ(v2[me].combined[static_cast<size_t>(t * kHidden + h)], reference::bf16_from_float(expected))
              << r << " " << t << " " << h;
        }
    }
  }
}

}  // namespace cross_check_test
}  // namespace moe_ep
