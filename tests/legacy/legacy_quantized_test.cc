// V1 low-latency quantized wire formats, end to end on in-process ranks, one node and across
// nodes: NVFP4 dispatch (both scale paths, both E2M1 roundings) with the received top-k weights
// and source ranks, checked against the reference cast of tests/reference/numeric_reference.hh
// and the 128 x 4 swizzled scale layout derived here from its definition; and the LogFMT combine,
// bit for bit against the reference codec of tests/reference/logfmt_reference.hh and within
// DeepEP's tolerance (calc_diff < 9e-4) of the unquantized combine.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "moe_ep/error.hpp"
#include "moe_ep/legacy_buffer.hpp"
#include "reference/dense_reference.hh"
#include "reference/logfmt_reference.hh"
#include "reference/low_latency_reference.hh"
#include "reference/numeric_reference.hh"
#include "support/errors.hh"
#include "support/rank_runner.hh"

namespace moe_ep {
namespace {

using reference::CaseSpec;
using reference::RankInputs;
using reference::expert_rows;
using testing::collect_on_ranks;
using testing::report_problems;

struct QOptions {
  bool nvfp4 = true, ue8m0_sf = false, sm90 = false, weights = true;
  bool logfmt = false, hook = false, combine_hook = false;
  float global_scale = 1.0f;
};

std::string describe(const CaseSpec& s, const QOptions& o) {
  return fmt::format("seed {} ranks {}x{} E {} k {} N {} H {} skew {} nvfp4 {} ue8m0 {} sm90 {} weights {} logfmt {} hook {}/{}",
                     s.seed, s.ranks, s.scaleout, s.num_experts, s.k, s.max_tokens, s.hidden, s.skew, o.nvfp4,
                     o.ue8m0_sf, o.sm90, o.weights, o.logfmt, o.hook, o.combine_hook);
}

// Expert outputs below 1 in magnitude (LogFMT-castable), except one 128-channel block of every
// fifth row, which makes its chunk travel as BF16, and an all-zero block in every third row.
std::uint16_t small_value(int dest, int local_expert, int src_global, int h) {
  const double v = std::sin(0.71 * src_global + 0.013 * h + 1.7 * dest + 0.3 * local_expert);
  if ((src_global + local_expert) % 5 == 0 && h / 128 == 1) return reference::bf16_from_float(static_cast<float>(3 * v));
  if (src_global % 3 == 0 && h / 128 == 3) return 0;
  return reference::bf16_from_float(static_cast<float>(0.9 * v * std::ldexp(1.0, -((src_global + h) % 9))));
}

void check_nvfp4(const CaseSpec& s, const QOptions& o, const std::vector<RankInputs>& all, int me,
                 const LowLatencyDispatchResult& d, std::vector<std::string>& bad) {
  const int El = s.experts_per_rank(), H = s.hidden;
  const std::int64_t RN = std::int64_t{s.ranks} * s.max_tokens, rm = (RN + 127) / 128, rk = H / 64;
  // recv_x: the view [R*N, H/2, El] of storage [El, R*N, H/2].
  const TensorView& x = d.recv_x;
  if (x.dtype() != DType::kUInt8 || x.ndim() != 3 || x.size(0) != RN || x.size(1) != H / 2 || x.size(2) != El ||
      x.stride(0) != H / 2 || x.stride(1) != 1 || x.stride(2) != RN * (H / 2)) {
    bad.push_back("recv_x is not the [R*N, H/2, El] view of uint8 storage [El, R*N, H/2]: " + x.describe());
    return;
  }
  // Scales: the view [32, 4, rm, 4, rk, El] of storage [El, rm, rk, 32, 4, 4] (permute 3, 4, 1, 5, 2, 0).
  const TensorView& sf = d.recv_x_scales;
  const std::int64_t shape[] = {32, 4, rm, 4, rk, El}, strides[] = {16, 4, rk * 512, 1, 512, rm * rk * 512};
  bool layout = sf.ndim() == 6 && sf.dtype() == (o.ue8m0_sf ? DType::kInt32 : DType::kFP8E4M3);
  for (int i = 0; layout && i < 6; ++i) layout = sf.size(i) == shape[i] && sf.stride(i) == strides[i];
  if (!layout) {
    bad.push_back("recv_x_scales is not the [32, 4, rm, 4, rk, El] view of [El, rm, rk, 32, 4, 4]: " + sf.describe());
    return;
  }
  // The expected storage image: each expert's bytes at the start of its storage (of 1- or 4-byte
  // elements), byte (t, j) at [t / 128][j / 4][t % 32][(t % 128) / 32][j % 4]; every other byte 0.
  const std::int64_t expert_bytes = rm * rk * 512 * (o.ue8m0_sf ? 4 : 1);
  std::vector<std::uint8_t> image(static_cast<size_t>(El * expert_bytes), 0);
  for (int i = 0; i < El; ++i) {
    const auto rows = expert_rows(s, all, me, i);
    if (d.packed_recv_count.data_as<const std::int32_t>()[i] != static_cast<int>(rows.size()))
      bad.push_back(fmt::format("count[{}] = {}, expected {}", i, d.packed_recv_count.data_as<const std::int32_t>()[i], rows.size()));
    for (std::size_t row = 0; row < rows.size(); ++row) {
      const auto [src, t] = rows[row];
      const auto* bf16 = reinterpret_cast<const std::uint16_t*>(all[static_cast<size_t>(src)].x.data()) + std::int64_t{t} * H;
      const reference::Nvfp4Row q = reference::quantize_row_nvfp4(bf16, H, o.global_scale, o.ue8m0_sf, o.sm90);
      const auto* got = x.data_as<const std::uint8_t>() + (i * RN + static_cast<std::int64_t>(row)) * (H / 2);
      if (std::memcmp(got, q.packed.data(), q.packed.size()) != 0)
        bad.push_back(fmt::format("values of expert {} row {} differ from the cast of rank {} token {}", i, row, src, t));
      const auto r = static_cast<std::int64_t>(row);
      for (int j = 0; j < H / 16; ++j)
        image[static_cast<size_t>(i * expert_bytes + ((r / 128) * rk + j / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4)] =
            q.scales[static_cast<size_t>(j)];
      if (o.weights) {
        const RankInputs& in = all[static_cast<size_t>(src)];
        float w = -1;
        for (int j = 0; j < s.k; ++j)
          if (in.topk[static_cast<size_t>(t * s.k + j)] == me * El + i) w = in.weights[static_cast<size_t>(t * s.k + j)];
        if (d.recv_topk_weights.data_as<const float>()[i * RN + r] != w || d.recv_rank_info.data_as<const std::int32_t>()[i * RN + r] != src)
          bad.push_back(fmt::format("weight / rank info of expert {} row {}", i, row));
      }
    }
  }
  if (std::memcmp(sf.data(), image.data(), image.size()) != 0) {
    std::size_t at = 0;
    while (static_cast<const std::uint8_t*>(sf.data())[at] == image[at]) ++at;
    bad.push_back(fmt::format("scale storage differs first at byte {}: {:#04x}, expected {:#04x}", at,
                              static_cast<const std::uint8_t*>(sf.data())[at], image[at]));
  }
}

void check_weights(const CaseSpec& s, const std::vector<RankInputs>& all, int me, const LowLatencyDispatchResult& d,
                   std::vector<std::string>& bad) {
  const int El = s.experts_per_rank();
  const std::int64_t RN = std::int64_t{s.ranks} * s.max_tokens;
  if (!d.recv_topk_weights.defined() || d.recv_topk_weights.size(0) != El || d.recv_topk_weights.size(1) != RN ||
      !d.recv_rank_info.defined() || d.recv_rank_info.dtype() != DType::kInt32) {
    bad.push_back("recv_topk_weights / recv_rank_info missing or misshapen");
    return;
  }
  for (int i = 0; i < El; ++i) {
    const auto rows = expert_rows(s, all, me, i);
    for (std::int64_t r = static_cast<std::int64_t>(rows.size()); r < RN; ++r)
      if (d.recv_topk_weights.data_as<const float>()[i * RN + r] != 0.0f || d.recv_rank_info.data_as<const std::int32_t>()[i * RN + r] != -1) {
        bad.push_back(fmt::format("expert {} row {} past the count: weight and rank must be 0 and -1", i, r));
        break;
      }
  }
}

std::vector<std::string> run_case(Group& g, const CaseSpec& s, const QOptions& o) {
  std::vector<std::string> bad;
  const int me = g.rank(), H = s.hidden, k = s.k, El = s.experts_per_rank(), N = s.max_tokens;
  Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(N, H, s.ranks, s.num_experts),
               .low_latency_mode = true, .num_cpu_timeout_secs = 60});
  std::vector<RankInputs> all = reference::make_all_inputs(s);
  RankInputs& in = all[static_cast<size_t>(me)];
  const std::int64_t n = in.num_tokens;
  const TensorView x(in.x.data(), DType::kBF16, {n, H}), topk(in.topk.data(), DType::kInt64, {n, k}),
      weights(in.weights.data(), DType::kFP32, {n, k});
  float gs = o.global_scale;
  const TensorView scalar(&gs, DType::kFP32, std::span<const std::int64_t>{});
  LowLatencyDispatchArgs a{.x = x, .topk_idx = topk, .num_max_dispatch_tokens_per_rank = N, .num_experts = s.num_experts,
                           .use_fp8 = false, .use_nvfp4 = o.nvfp4, .use_ue8m0_for_sf = o.ue8m0_sf,
                           .return_recv_hook = o.hook};
  if (o.weights) a.topk_weights = weights;
  if (o.nvfp4 && !o.ue8m0_sf) a.x_global_scale = scalar;
  if (o.nvfp4) a.nvfp4_rounding = o.sm90 ? E2M1Rounding::kSm90 : E2M1Rounding::kNearestEven;
  LowLatencyDispatchResult d = b.low_latency_dispatch(a);
  if (o.hook) {
    g.barrier();
    d.hook();
  }
  if (o.weights) check_weights(s, all, me, d, bad);
  if (o.nvfp4) {
    check_nvfp4(s, o, all, me, d, bad);
  } else {
    reference::check_slab(s, {.rows_per_expert = std::int64_t{s.ranks} * N}, all, me, d.recv_x, d.recv_x_scales,
                          d.packed_recv_count, bad);
  }
  if (!bad.empty()) return bad;

  // Combine the expert outputs (weighted by the combine's own topk_weights).
  const Tensor y = reference::slab_expert_outputs(s, all, me, std::int64_t{s.ranks} * N);
  LowLatencyCombineResult c = b.low_latency_combine({.x = y, .topk_idx = topk, .topk_weights = weights, .handle = d.handle,
                                                     .use_logfmt = o.logfmt, .return_recv_hook = o.combine_hook});
  if (o.combine_hook) {
    g.barrier();
    c.hook();
  }
  const auto unquantized = reference::low_latency_combine_reference(s, in, me);
  if (!o.logfmt) {
    if (n > 0 && std::memcmp(c.combined_x.data(), unquantized.data(), unquantized.size() * 2) != 0)
      bad.push_back("combined_x differs from the reference");
    return bad;
  }
  // LogFMT: bf16(sum over valid lanes, ascending, of w * decode(encode(y_lane))), first product as is.
  std::vector<double> got, want;
  for (std::int64_t t = 0; t < n; ++t) {
    std::vector<float> acc(static_cast<size_t>(H), 0.0f);
    bool first = true;
    for (int j = 0; j < k; ++j) {
      const std::int64_t id = in.topk[static_cast<size_t>(t * k + j)];
      if (id < 0) continue;
      std::vector<std::uint16_t> row(static_cast<size_t>(H));
      for (int h = 0; h < H; ++h) row[static_cast<size_t>(h)] = s.value(static_cast<int>(id / El), static_cast<int>(id % El), me * N + static_cast<int>(t), h);
      const std::vector<float> decoded = reference::logfmt_decode(reference::logfmt_encode(row.data(), H), H);
      for (int h = 0; h < H; ++h) {
        const float product = in.weights[static_cast<size_t>(t * k + j)] * decoded[static_cast<size_t>(h)];
        acc[static_cast<size_t>(h)] = first ? product : acc[static_cast<size_t>(h)] + product;
      }
      first = false;
    }
    for (int h = 0; h < H; ++h) {
      const std::uint16_t expect = reference::bf16_from_float(acc[static_cast<size_t>(h)]);
      const std::uint16_t have = c.combined_x.data_as<const std::uint16_t>()[t * H + h];
      if (have != expect) {
        bad.push_back(fmt::format("LogFMT combined token {} element {}: {:#06x}, expected {:#06x}", t, h, have, expect));
        return bad;
      }
      got.push_back(reference::float_from_bf16(have));
      want.push_back(reference::float_from_bf16(unquantized[static_cast<size_t>(t * H + h)]));
    }
  }
  const double diff = reference::calc_diff(got, want);
  if (!(diff < 9e-4)) bad.push_back(fmt::format("LogFMT combine calc_diff {} against the unquantized combine", diff));
  return bad;
}

void run(CaseSpec s, const QOptions& o) {
  const auto failures = collect_on_ranks(s.ranks, {.num_scaleout = s.scaleout},
                                         [&](Group& g, std::vector<std::string>& bad) { bad = run_case(g, s, o); });
  report_problems(failures, {.context = describe(s, o), .name_rank = true, .max_per_rank = 5});
}

CaseSpec spec(int ranks, int scaleout, int experts, int k, int N, int hidden, std::uint64_t seed, double skew = 1.0) {
  CaseSpec s = reference::low_latency_spec(ranks, scaleout, experts, k, N, hidden, seed, skew);
  s.values = small_value;
  return s;
}

TEST(LowLatencyNvfp4, BothScalePathsAndRoundings) {
  int seed = 1;
  for (bool ue8m0 : {false, true})
    for (bool sm90 : {false, true})
      for (float gs : {1.0f, 448.0f * 6.0f / 4.0f, 0.03f}) {
        CaseSpec s = spec(4, 1, 8, 3, 6, 256, static_cast<std::uint64_t>(seed++));
        s.wide_range = true;
        run(s, {.ue8m0_sf = ue8m0, .sm90 = sm90, .global_scale = gs});
        if (ue8m0) break;  // the global scale is ignored
      }
}

TEST(LowLatencyNvfp4, AcrossNodesHooksAndSkewedRoutings) {
  run(spec(8, 2, 16, 4, 5, 512, 20), {.global_scale = 7.5f});
  run(spec(8, 4, 16, 5, 5, 128, 21, 3.0), {.ue8m0_sf = true, .hook = true});
  run(spec(4, 2, 8, 2, 4, 384, 22, 6.0), {.sm90 = true, .weights = false});
  // More than 128 rows per expert: the swizzled layout's second row block.
  run(spec(2, 1, 2, 2, 80, 128, 23), {.global_scale = 2.0f});
}

TEST(LowLatencyNvfp4, RandomShapes) {
  std::mt19937 rng(31);
  for (int i = 0; i < 10; ++i) {
    const int ranks = std::uniform_int_distribution<int>(1, 8)(rng);
    const int scaleout = (ranks % 2 == 0 && i % 2) ? 2 : 1;
    const int experts = ranks * std::uniform_int_distribution<int>(1, 4)(rng);
    const int k = std::uniform_int_distribution<int>(1, std::min(6, experts))(rng);
    const int hidden = 128 * std::uniform_int_distribution<int>(1, 6)(rng);
    CaseSpec s = spec(ranks, scaleout, experts, k, std::uniform_int_distribution<int>(1, 9)(rng), hidden, 40 + i,
                      std::uniform_real_distribution<double>(0, 4)(rng));
    s.wide_range = i % 2 == 0;
    run(s, {.ue8m0_sf = i % 3 == 0, .sm90 = i % 4 == 1, .weights = i % 5 != 2, .logfmt = i % 2 == 1,
            .global_scale = std::ldexp(1.3f, i - 5)});
  }
}

TEST(LowLatencyWeights, Bf16DispatchCarriesTheWeights) {
  run(spec(4, 1, 16, 4, 6, 256, 50), {.nvfp4 = false});
  run(spec(8, 2, 16, 4, 5, 128, 51), {.nvfp4 = false, .hook = true});
}

TEST(LowLatencyLogFmt, CombineOneNodeAndAcrossNodes) {
  // 1024-element chunks (H % 1024 == 0), 512-element chunks, and a short last chunk (640).
  run(spec(4, 1, 8, 3, 6, 1024, 60), {.nvfp4 = false, .logfmt = true});
  run(spec(4, 1, 8, 3, 6, 640, 61), {.nvfp4 = false, .logfmt = true});
  run(spec(8, 2, 16, 4, 5, 1024, 62), {.nvfp4 = false, .logfmt = true});
  run(spec(8, 4, 16, 5, 4, 512, 63, 4.0), {.nvfp4 = false, .logfmt = true, .combine_hook = true});
  run(spec(4, 2, 8, 2, 4, 2560, 64), {.logfmt = true, .hook = true, .combine_hook = true});
}

// ---- Bad input -----------------------------------------------------------------------------------

TEST(LowLatencyQuantized, BadArgumentsAreTypedErrorsNamingTheRule) {
  LocalWorld(2).run([&](Group& g) {
    Buffer b(g, {.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(4, 256, 2, 4), .low_latency_mode = true});
    std::vector<std::uint16_t> xs(4 * 256, reference::bf16_from_float(0.5f));
    std::vector<std::int64_t> ids = {0, 1, 1, 2, 2, 3, 3, 0};
    std::vector<float> w(8, 0.5f);
    float gs = 1.0f, bad_gs = -2.0f;
    double gs64 = 1.0;
    const TensorView x(xs.data(), DType::kBF16, {4, 256}), topk(ids.data(), DType::kInt64, {4, 2});
    const TensorView scalar(&gs, DType::kFP32, std::span<const std::int64_t>{});
    const TensorView negative(&bad_gs, DType::kFP32, std::span<const std::int64_t>{});
    const TensorView vector1(&gs, DType::kFP32, {1});
    auto base = [&] {
      return LowLatencyDispatchArgs{.x = x, .topk_idx = topk, .num_max_dispatch_tokens_per_rank = 4, .num_experts = 4,
                                    .use_fp8 = false, .use_nvfp4 = true};
    };
    auto expect = [&](LowLatencyDispatchArgs a, const std::string& words) {
      const std::string e = testing::error_of([&] { b.low_latency_dispatch(a); });
      EXPECT_NE(e.find(words), std::string::npos) << "expected '" << words << "' in: " << e;
    };
    LowLatencyDispatchArgs a = base();
    a.use_fp8 = true;
    a.x_global_scale = scalar;
    expect(a, "use_fp8 = true and use_nvfp4 = true");
    expect(base(), "requires x_global_scale");
    a = base();
    a.x_global_scale = vector1;
    expect(a, "x_global_scale must be a float32 scalar (0-d tensor), got float32 with 1 dimensions");
    a = base();
    a.x_global_scale = TensorView(&gs64, DType::kInt64, std::span<const std::int64_t>{});
    expect(a, "x_global_scale must be a float32 scalar");
    a = base();
    a.x_global_scale = negative;
    expect(a, "x_global_scale = -2 must be a positive finite number");
    a = base();
    a.use_nvfp4 = false;
    a.use_ue8m0_for_sf = true;
    expect(a, "use_ue8m0_for_sf = true requires use_nvfp4 = true");
    a = base();
    a.x = TensorView(xs.data(), DType::kBF16, {4, 192});
    a.x_global_scale = scalar;
    expect(a, "NVFP4 hidden size 192 is not a multiple of 128");
    // The buffer still works, and LogFMT refuses zero_copy.
    a = base();
    a.x_global_scale = scalar;
    LowLatencyDispatchResult d = b.low_latency_dispatch(a);
    const TensorView next = b.get_next_low_latency_combine_buffer(*d.handle);
    const std::string e = testing::error_of([&] {
      b.low_latency_combine({.x = next, .topk_idx = topk, .topk_weights = TensorView(w.data(), DType::kFP32, {4, 2}),
                             .handle = d.handle, .use_logfmt = true, .zero_copy = true});
    });
    EXPECT_NE(e.find("use_logfmt = true cannot be combined with zero_copy = true"), std::string::npos) << e;
  });
}

}  // namespace
}  // namespace moe_ep
