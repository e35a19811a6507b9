// NVFP4 through the dispatcher (MOE_EP_DISPATCH_DTYPE=nvfp4): V1 casts inside its low-latency
// dispatch, V2 quantizes before sending and rebuilds V1's output format; both must deliver
// identical slabs (values, swizzled scales, counts, the same views) holding the reference cast of
// each source token (tests/reference/numeric_reference.hh), one node and across nodes, E4M3 and
// UE8M0 scales; combine matches each generation's low-latency reference; prefill batches of auto
// mode travel BF16; and the option rules are typed errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>

#include "support/dispatcher_fixture.hh"
#include "support/env_scope.hh"
#include "reference/low_latency_reference.hh"
#include "reference/numeric_reference.hh"

namespace moe_ep::testing {
namespace dispatcher_nvfp4_test {

constexpr int kHidden = 512, kExperts = 16, kTopk = 4, kCap = 6;

struct Slab {
  std::vector<std::uint8_t> values, scales;
  std::vector<std::int64_t> value_shape, value_strides, scale_shape, scale_strides;
  std::vector<std::int32_t> counts;
  DType scale_dtype = DType::kUInt8;
};

DispatcherOptions options(bool v2, bool ue8m0, float gs) {
  DispatcherOptions o;
  o.hidden = kHidden;
  o.num_experts = kExperts;
  o.num_topk = kTopk;
  o.use_v2 = v2;
  o.mode = DispatchMode::kAuto;
  o.num_max_dispatch_tokens_per_rank = kCap;
  o.num_max_prefill_tokens_per_rank = kCap;
  o.timeout_secs = 60;
  o.provider_path = "cpu";
  o.nvfp4_global_scale = gs;
  o.nvfp4_use_ue8m0 = ue8m0;
  return o;
}

// One decode batch (and a prefill batch before it, which must stay BF16) on every rank; returns
// each rank's slab.
std::vector<Slab> run_generation(bool v2, int scaleout, bool ue8m0, float gs, const CaseSpec& s) {
  ScopedEnvironment nvfp4("MOE_EP_DISPATCH_DTYPE", "nvfp4");
  std::vector<Slab> slabs(static_cast<size_t>(s.ranks));
  const std::string label = fmt::format("{} {} nodes ue8m0 {}", v2 ? "V2" : "V1", scaleout, ue8m0);
  run_ranks(s.ranks, {.num_scaleout = scaleout}, [&](Group& g, std::vector<std::string>& bad) {
    const int me = g.rank(), El = s.experts_per_rank();
    const std::int64_t RC = std::int64_t{s.ranks} * kCap;
    BufferCache cache(g);
    TokenDispatcher d(cache, options(v2, ue8m0, gs));
    if (*d.options().dispatch_dtype != WireDType::kNVFP4) bad.push_back(label + ": MOE_EP_DISPATCH_DTYPE=nvfp4 was not taken");
    // Prefill (normal mode): BF16 rows, checked end to end by the shared fixture.
    run_batch(g, d, s, BatchKind::kPrefill, bad, label + " prefill");
    const std::vector<RankInputs> all = reference::make_all_inputs(s);
    const Inputs in = to_tensors(s, all[static_cast<size_t>(me)]);
    const DispatchOutput out = d.dispatch(in.x, in.topk_idx, in.topk_weights, BatchKind::kDecode);
    Slab& slab = slabs[static_cast<size_t>(me)];
    const TensorView& x = out.hidden_states;
    const TensorView& sf = out.hidden_states_scale;
    slab.value_shape.assign(x.shape().begin(), x.shape().end());
    slab.value_strides.assign(x.strides().begin(), x.strides().end());
    slab.scale_shape.assign(sf.shape().begin(), sf.shape().end());
    slab.scale_strides.assign(sf.strides().begin(), sf.strides().end());
    slab.scale_dtype = sf.dtype();
    if (x.dtype() != DType::kUInt8 || x.ndim() != 3 || sf.ndim() != 6) {
      bad.push_back(label + ": the NVFP4 output is not the [R*N, H/2, El] / 6-d scale pair: " + x.describe() + ", " + sf.describe());
      return;
    }
    const auto* v = static_cast<const std::uint8_t*>(x.data());
    slab.values.assign(v, v + El * RC * (kHidden / 2));
    const std::int64_t scale_bytes = El * sf.stride(5) * static_cast<std::int64_t>(element_size(sf.dtype()));
    const auto* b = static_cast<const std::uint8_t*>(sf.data());
    slab.scales.assign(b, b + scale_bytes);
    slab.counts.assign(out.masked_m.data_as<const std::int32_t>(), out.masked_m.data_as<const std::int32_t>() + El);
    // Every valid row is the reference cast of its source token.
    for (int i = 0; i < El; ++i) {
      const auto rows = reference::expert_rows(s, all, me, i);
      if (slab.counts[static_cast<size_t>(i)] != static_cast<int>(rows.size())) bad.push_back(fmt::format("{}: masked_m[{}]", label, i));
      for (std::size_t r = 0; r < rows.size(); ++r) {
        const auto* row = reinterpret_cast<const std::uint16_t*>(all[static_cast<size_t>(rows[r].first)].x.data()) +
                          std::int64_t{rows[r].second} * kHidden;
        const reference::Nvfp4Row q = reference::quantize_row_nvfp4(row, kHidden, gs, ue8m0, false);
        if (std::memcmp(v + (i * RC + static_cast<std::int64_t>(r)) * (kHidden / 2), q.packed.data(), q.packed.size()) != 0)
          bad.push_back(fmt::format("{}: expert {} row {} values differ from the reference cast", label, i, r));
      }
    }
    // Combine the expert outputs: each generation's low-latency reference.
    const Tensor y = reference::slab_expert_outputs(s, all, me, RC);
    const Tensor combined = d.combine(y);
    check_combined(expected_combine(s, expectation(d.options()), all, me, out), combined, label + " combine", bad);
  });
  return slabs;
}

TEST(DispatcherNvfp4, BothGenerationsDeliverIdenticalSlabs) {
  std::uint64_t seed = 1300;
  for (int scaleout : {1, 2})
    for (bool ue8m0 : {false, true}) {
      CaseSpec s = make_spec(4, scaleout, kExperts, kTopk, kCap, kHidden, seed++);
      s.wide_range = true;
      const float gs = 448.0f * 6.0f / 5.0f;
      const std::vector<Slab> v1 = run_generation(false, scaleout, ue8m0, gs, s);
      const std::vector<Slab> v2 = run_generation(true, scaleout, ue8m0, gs, s);
      for (int r = 0; r < s.ranks; ++r) {
        const Slab &a = v1[static_cast<size_t>(r)], &b = v2[static_cast<size_t>(r)];
        const std::string what = fmt::format("{} nodes ue8m0 {} rank {}", scaleout, ue8m0, r);
        EXPECT_EQ(a.value_shape, b.value_shape) << what;
        EXPECT_EQ(a.value_strides, b.value_strides) << what;
        EXPECT_EQ(a.scale_shape, b.scale_shape) << what;
        EXPECT_EQ(a.scale_strides, b.scale_strides) << what;
        EXPECT_EQ(a.scale_dtype, b.scale_dtype) << what;
        EXPECT_EQ(a.counts, b.counts) << what;
        // Rows past the counts are unspecified in both; the valid rows and every scale byte agree.
        const std::int64_t RC = std::int64_t{s.ranks} * kCap;
        for (std::size_t i = 0; i < a.counts.size(); ++i)
          EXPECT_EQ(std::memcmp(a.values.data() + i * RC * (kHidden / 2), b.values.data() + i * RC * (kHidden / 2),
                                static_cast<size_t>(a.counts[i]) * (kHidden / 2)),
                    0)
              << what << " expert " << i;
        EXPECT_TRUE(a.scales == b.scales) << what << ": scale storage differs";
        EXPECT_EQ(a.scale_dtype, ue8m0 ? DType::kInt32 : DType::kFP8E4M3) << what;
      }
    }
}

TEST(DispatcherNvfp4, OptionRulesAreTypedErrors) {
  run_ranks(1, {}, [&](Group& g, std::vector<std::string>& bad) {
    BufferCache cache(g);
    auto expect = [&](DispatcherOptions o, const std::string& words) {
      const std::string e = error_of([&] { TokenDispatcher d(cache, o); });
      if (e.find(words) == std::string::npos) bad.push_back(fmt::format("expected '{}' in: {}", words, e));
    };
    DispatcherOptions o = options(false, false, 1.0f);
    o.dispatch_dtype = WireDType::kNVFP4;
    o.hidden = 192;
    expect(o, "NVFP4 dispatch (DispatcherOptions.dispatch_dtype) needs hidden to be a multiple of 128, got 192");
    o.use_v2 = true;
    expect(o, "needs hidden to be a multiple of 128, got 192");
    o = options(false, false, 1.0f);
    o.dispatch_dtype = WireDType::kNVFP4;
    o.mode = DispatchMode::kNormal;
    expect(o, "NVFP4 dispatch (DispatcherOptions.dispatch_dtype) is the low-latency wire format");
    o.mode = DispatchMode::kLowLatency;
    o.nvfp4_global_scale = 0.0f;
    expect(o, "nvfp4_global_scale = 0 must be a positive finite number");
  });
}

}  // namespace dispatcher_nvfp4_test
}  // namespace moe_ep::testing
