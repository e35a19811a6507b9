// The dispatcher's one-copy low-latency path on ElasticBuffer (DispatchExtras, CombineExtras): an
// expanded dispatch with a fixed expert stride (the slab [El, stride, H], FP8 scales stored
// [El, S, stride]) and a combine that weights each expert output row as it reads it, both against
// the dense reference (tests/reference, with weight_lanes: lanes bf16(w x y), then V2's order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "moe_ep/elastic_buffer.hpp"
#include "moe_ep/error.hpp"
#include "reference/dense_reference.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace {

using reference::CaseSpec;
using reference::RankInputs;

constexpr std::uint16_t kPoison = 0x7fc1;  // a NaN in the padding rows: combine must not read them

CaseSpec slab_case(int scaleout, bool hybrid, bool multi, bool fp8) {
  CaseSpec s;
  s.ranks = 4;
  s.num_experts = 16;
  s.k = 4;
  s.max_tokens = 6;
  s.hidden = 256;
  s.scaleout = scaleout;
  s.allow_hybrid = hybrid;
  s.multi = multi;
  s.fp8 = fp8;
  s.scale_cols = fp8 ? 2 : 0;
  s.expand = true;
  s.weight_lanes = true;
  s.mask_ratio = 0.2;
  s.seed = 11;
  s.tokens = {6, 3, 0, 5};
  return s;
}

// The local expert of expanded reference row r and its position in the expert's group.
std::pair<int, int> expert_of(const reference::RefDispatch& ref, int r) {
  for (std::size_t i = 0; i < ref.start.size(); ++i)
    if (r >= ref.start[i] && r < ref.start[i] + ref.unaligned[i]) return {static_cast<int>(i), r - ref.start[i]};
  return {-1, -1};
}

void check_dispatch(const CaseSpec& spec, const std::vector<RankInputs>& all, const reference::RefDispatch& ref,
                    const DispatchResult& res, std::int64_t stride, std::vector<std::string>& bad) {
  const int El = spec.experts_per_rank(), rb = spec.row_bytes(), S = spec.scale_cols;
  if (res.recv_x.size(0) != El * stride) bad.push_back("recv_x has " + std::to_string(res.recv_x.size(0)) + " rows");
  const auto* psum = res.handle->psum_num_recv_tokens_per_expert.data_as<const std::int32_t>();
  for (int i = 0; i < El; ++i)
    if (psum[i] != i * stride + ref.unaligned[static_cast<size_t>(i)])
      bad.push_back("psum_num_recv_tokens_per_expert[" + std::to_string(i) + "] = " + std::to_string(psum[i]));
  const auto* scales = spec.fp8 ? static_cast<const std::uint32_t*>(res.recv_x_scales.data()) : nullptr;
  for (int r = 0; r < ref.expanded_rows; ++r) {
    const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(r)];
    if (owner < 0) continue;
    const auto [i, t] = expert_of(ref, r);
    const std::int64_t row = i * stride + t;
    const reference::ReceivedRow& from = ref.rows[static_cast<size_t>(owner)];
    const RankInputs& src = all[static_cast<size_t>(from.source)];
    if (std::memcmp(static_cast<const std::uint8_t*>(res.recv_x.data()) + row * rb,
                    &src.x[static_cast<size_t>(from.token) * rb], static_cast<size_t>(rb)) != 0)
      bad.push_back("slab row " + std::to_string(row) + " differs");
    for (int p = 0; p < S; ++p)  // storage [El, S, stride]
      if (scales[(i * S + p) * stride + t] != src.scales[static_cast<size_t>(from.token * S + p)])
        bad.push_back("slab scale of row " + std::to_string(row) + " column " + std::to_string(p) + " differs");
    const float weight = src.weights[static_cast<size_t>(from.token * spec.k + lane)];
    if (res.recv_topk_weights.data_as<const float>()[row] != weight)
      bad.push_back("weight of slab row " + std::to_string(row) + " differs");
  }
}

void run_slab_case(Group& group, const CaseSpec& spec, std::vector<std::string>& bad) {
  const int me = group.rank(), k = spec.k, H = spec.hidden, El = spec.experts_per_rank();
  const std::int64_t stride = std::int64_t{spec.ranks} * spec.max_tokens;
  ElasticBuffer buffer(group, {.num_max_tokens_per_rank = spec.max_tokens, .hidden = H, .num_topk = k,
                               .use_fp8_dispatch = spec.fp8, .allow_hybrid_mode = spec.allow_hybrid,
                               .allow_multiple_reduction = spec.multi, .num_cpu_timeout_secs = 60});
  std::vector<RankInputs> all = reference::make_all_inputs(spec);
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  DispatchArgs args{.x = TensorView(in.x.data(), spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {n, H}),
                    .topk_idx = TensorView(in.topk.data(), DType::kInt64, {n, k}),
                    .topk_weights = TensorView(in.weights.data(), DType::kFP32, {n, k}),
                    .num_experts = spec.num_experts,
                    .do_cpu_sync = false,
                    .do_expand = true,
                    .use_tma_aligned_col_major_sf = true};
  if (spec.fp8) args.x_scales = TensorView(in.scales.data(), DType::kFP32, {n, spec.scale_cols});
  DispatchResult res = buffer.dispatch(args, DispatchExtras{.expert_stride = static_cast<int>(stride)});
  res.event.wait();
  const reference::RefDispatch ref = reference::reference_dispatch(spec, all, me);
  check_dispatch(spec, all, ref, res, stride, bad);

  // Expert outputs in the slab, unweighted; padding rows poisoned.
  Tensor y = Tensor::empty({El * stride, H}, DType::kBF16);
  std::fill(y.data_as<std::uint16_t>(), y.data_as<std::uint16_t>() + El * stride * H, kPoison);
  for (int r = 0; r < ref.expanded_rows; ++r) {
    const auto [owner, lane] = ref.expanded_owner[static_cast<size_t>(r)];
    if (owner < 0) continue;
    const auto [i, t] = expert_of(ref, r);
    const reference::ReceivedRow& from = ref.rows[static_cast<size_t>(owner)];
    for (int h = 0; h < H; ++h)
      y.data_as<std::uint16_t>()[(i * stride + t) * H + h] = spec.value(me, i, from.source * spec.max_tokens + from.token, h);
  }
  const CombineResult c = buffer.combine(CombineArgs{.x = y, .handle = res.handle},
                                        CombineExtras{.row_weights = res.recv_topk_weights});
  c.event.wait();
  const reference::RefCombine expected = reference::reference_combine(spec, all, me, 1.0f);
  if (!std::equal(expected.x.begin(), expected.x.end(), c.combined_x.data_as<const std::uint16_t>()))
    bad.push_back("combined_x differs from the reference");
}

void expect_slab_case(const CaseSpec& spec) {
  testing::report_problems(
      testing::collect_on_ranks(spec.ranks, Topology{spec.scaleout, spec.ranks / spec.scaleout},
                                [&](Group& g, std::vector<std::string>& bad) { run_slab_case(g, spec, bad); }),
      {.name_rank = true, .max_per_rank = 10});
}

TEST(ElasticSlab, OneNode) { expect_slab_case(slab_case(1, true, true, false)); }
TEST(ElasticSlab, OneNodeFp8) { expect_slab_case(slab_case(1, true, true, true)); }
TEST(ElasticSlab, Hybrid) { expect_slab_case(slab_case(2, true, true, false)); }
TEST(ElasticSlab, HybridWithoutMultipleReduction) { expect_slab_case(slab_case(2, true, false, true)); }
TEST(ElasticSlab, Direct) { expect_slab_case(slab_case(2, false, true, false)); }

TEST(ElasticSlab, RowWeightsNeedTheExpandedLayout) {
  testing::report_problems(testing::collect_on_ranks(2, Topology{1, 2}, [](Group& g, std::vector<std::string>& bad) {
    ElasticBuffer buffer(g, {.num_max_tokens_per_rank = 2, .hidden = 128, .num_topk = 1, .num_cpu_timeout_secs = 60});
    std::vector<std::uint16_t> x(2 * 128, 0);
    std::vector<std::int64_t> ids = {0, 1};
    std::vector<float> w(2, 1.0f);
    DispatchResult res = buffer.dispatch({.x = TensorView(x.data(), DType::kBF16, {2, 128}),
                                          .topk_idx = TensorView(ids.data(), DType::kInt64, {2, 1}),
                                          .num_experts = 2});
    Tensor rows = Tensor::zeros({res.recv_x.size(0), 128}, DType::kBF16);
    Tensor rw = Tensor::zeros({res.recv_x.size(0)}, DType::kFP32);
    try {
      buffer.combine(CombineArgs{.x = rows, .handle = res.handle}, CombineExtras{.row_weights = rw}).event.wait();
      bad.push_back("combine with row weights on a compact handle did not throw");
    } catch (const InvalidArgument& e) {
      if (std::string(e.what()).find("row weights need the expanded layout") == std::string::npos)
        bad.push_back(std::string("unexpected message: ") + e.what());
    }
  }));
}

}  // namespace
}  // namespace moe_ep
